"""The one atomic file writer of :mod:`st_extensions` (which knows nothing of PyTerrier, so it cannot use
:mod:`pyterrier_prob.atomic`): caches and their indexes are replaced whole or not at all."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from typing import IO

__all__ = ["atomic_write"]


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
