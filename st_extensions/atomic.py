"""The atomic file writer and the file lock of :mod:`st_extensions` (which knows nothing of PyTerrier, so it cannot use
:mod:`pyterrier_prob.atomic`): caches and their indexes are replaced whole or not at all."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import IO

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None

__all__ = ["atomic_write", "locked"]


def atomic_write(path: str, write: Callable[[IO[bytes]], object]) -> None:
    """``write(file)`` into a temporary file beside ``path``, fsync, then ``os.replace`` it onto ``path`` (0644); on
    any error the temporary file is removed and ``path`` is left as it was."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def locked(path: str, *, shared: bool = False) -> Iterator[None]:
    """A POSIX flock on the file ``path`` for the block: exclusive (the file is created if missing), or shared, for a
    reader, which takes no lock where it cannot open the file (a read-only folder: nobody writes there). A no-op
    where flock is missing."""
    try:
        fd = os.open(path, os.O_RDONLY) if shared else os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        if not shared:
            raise
        fd = None
    try:
        if fd is not None and fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the flock
