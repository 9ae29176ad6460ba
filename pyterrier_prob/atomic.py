"""The one atomic writer of pyterrier-prob: index directories, tables and plots.

Everything is first written beside its target (a hidden temporary file or directory in the same folder, so the
final ``os.replace`` is a rename on one file system), flushed and fsynced, then renamed into place. On any error
or interruption the temporary is removed and the target is left as it was. What we create is readable by others:
files 0644 and folders 0755 (``tempfile`` would make them 0600 / 0700).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = ["FILE_MODE", "DIR_MODE", "atomic_write", "atomic_directory", "make_dirs", "save_figure"]

FILE_MODE = 0o644
DIR_MODE = 0o755


def make_dirs(path: str | os.PathLike) -> Path:
    """Create ``path`` and its missing parents, each 0755 (whatever the umask); return it as a Path."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    path.mkdir(parents=True, exist_ok=True)
    for p in missing:
        os.chmod(p, DIR_MODE)
    return path


def atomic_write(path: str | os.PathLike, data: str | bytes | Callable[[IO[bytes]], Any]) -> str:
    """Write ``data`` to ``path`` atomically (mode 0644); returns the path.

    Args:
        path: target file; its folder is created (0755) if missing.
        data: text (written as UTF-8), bytes, or a callable that writes into the binary file object it is given
            (e.g. ``lambda f: fig.savefig(f, format="png")``).
    """
    path = Path(path)
    make_dirs(path.parent)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode("utf8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return str(path)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Build a directory in a hidden sibling and rename it to ``path`` when the ``with`` block succeeds.

    With ``overwrite`` an existing ``path`` is swapped out first and restored if the final rename fails; without
    it, ``FileExistsError`` is raised (checked before and after the block). Files written into the yielded folder
    should be closed by the end of the block; the folder and everything in it are made 0755 / 0644.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{str(path)!r} already exists")
    make_dirs(path.parent)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        yield tmp
        for root, dirs, files in os.walk(tmp):
            os.chmod(root, DIR_MODE)
            for name in files:
                os.chmod(os.path.join(root, name), FILE_MODE)
            for name in dirs:
                os.chmod(os.path.join(root, name), DIR_MODE)
        if path.exists() and not overwrite:
            raise FileExistsError(f"{str(path)!r} appeared while it was being written")
        if path.exists():
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:12]}"
            os.replace(path, old)
            try:
                os.replace(tmp, path)
            except BaseException:
                os.replace(old, path)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 120) -> str:
    """Save a matplotlib ``Figure`` as PNG at ``path`` atomically (0644), with an Agg canvas (no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    return atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=dpi))
