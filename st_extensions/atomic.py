"""The one atomic writer of pyterrier-prob and st_extensions: files, index directories, model folders and caches.

A file or directory is written into a hidden, flock-ed temporary beside its target (``.<name>.tmp-<pid>-<tag>``),
fsynced and renamed into place; a directory replaces the old one by an atomic exchange where the kernel can, else by
moving the old one aside (``.<name>.old-<pid>-<tag>``), which :func:`recover_directory` moves back after a killed
writer. Re-exported by :mod:`pyterrier_prob.atomic`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "DIR_MODE",
    "FILE_MODE",
    "atomic_directory",
    "atomic_write",
    "CorruptFileError",
    "read_checked",
    "clean_stale_temporaries",
    "locked",
    "make_dirs",
    "recover_directory",
]

FILE_MODE = 0o644
DIR_MODE = 0o755
_GRACE_S = 10.0  # an unlocked temporary younger than this may belong to a writer that has not locked it yet
T = TypeVar("T")
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?:(?P<pid>\d+)-)?(?P<tag>[0-9a-z_]{8,12})$")


def make_dirs(path: str | os.PathLike) -> Path:
    """Create ``path`` and its missing parents, each 0755 (whatever the umask); return it as a Path."""
    path = Path(path)
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    for p in missing:
        os.chmod(p, DIR_MODE)
    return path


class CorruptFileError(ValueError):
    """A file a run wrote (or a download) is truncated or corrupted; the message names it and what to do."""


def read_checked(path: str | os.PathLike, read: Callable[[str], T], remedy: str = "delete it and rerun") -> T:
    """``read(path)``, with any error but a missing file raised as :class:`CorruptFileError` naming ``path`` and
    ``remedy`` (what to do), never a raw parser traceback."""
    path = os.fspath(path)
    try:
        return read(path)
    except (FileNotFoundError, CorruptFileError):
        raise
    except Exception as e:
        raise CorruptFileError(f"{path!r} is truncated or corrupted ({type(e).__name__}: {e}); {remedy}") from e


# ---- liveness of temporaries: an flock held by the writer, its pid ------------------------------------------------


def _lock(fd: int) -> None:
    """Take an exclusive advisory lock on ``fd`` (silently nothing where flock is not supported)."""
    if fcntl is not None:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)


def _open(path: Path, lock: bool = False) -> int | None:
    """Open ``path`` (file or directory) read-only, and lock it if ``lock``; the fd (None if it cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    if lock:
        _lock(fd)
    return fd


def _close(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def _is_locked(path: Path) -> bool | None:
    """Whether a live process holds an flock on ``path``; None when this cannot be told."""
    fd = _open(path) if fcntl is not None else None
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)
    return False


def _pid_alive(pid: int) -> bool:
    if os.name != "posix":  # pragma: no cover - os.kill(pid, 0) is no probe on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: alive, another user's
        pass
    return True


def _temporaries(path: Path) -> list[tuple[Path, str, int | None]]:
    """``(temporary, "tmp" | "old", writer pid or None)`` for every hidden temporary of ``path``."""
    try:
        matches = [(e.path, _TEMP_RE.match(e.name)) for e in os.scandir(path.parent)]
    except OSError:
        return []
    return [
        (Path(p), m["kind"], int(m["pid"]) if m["pid"] else None) for p, m in matches if m and m["name"] == path.name
    ]


def _is_stale(temp: Path, pid: int | None) -> bool:
    """A temporary no live writer holds: its lock is free and its writer is dead (or it is past the grace time)."""
    locked = _is_locked(temp)
    if locked:
        return False
    if pid is not None and not _pid_alive(pid):
        return True
    if locked is None:  # no flock here: the pid is all we can go by
        return False
    with contextlib.suppress(OSError):
        return time.time() - temp.lstat().st_mtime > _GRACE_S
    return False


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            p.unlink()


def recover_directory(path: str | os.PathLike) -> bool:
    """Make ``path`` loadable again after a writer killed between its two renames (the previous version moved back;
    a live writer waited for up to a second) and remove stale temporaries; whether a version was moved back."""
    path = Path(path)
    recovered = False
    deadline = time.monotonic() + 1.0
    while not path.exists():
        olds = [(t, pid) for t, kind, pid in _temporaries(path) if kind == "old"]
        if not olds:
            break
        stale = [t for t, pid in olds if _is_stale(t, pid)]
        if stale:
            newest = max(stale, key=lambda t: t.lstat().st_ctime if t.exists() else 0.0)
            try:
                os.rename(newest, path)
                recovered = True
            except FileNotFoundError:  # another reader moved it back first
                continue
            except OSError:
                break
            _fsync_dir(path.parent)
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)  # a live writer is between its two renames
    clean_stale_temporaries(path)
    return recovered


def clean_stale_temporaries(path: str | os.PathLike) -> list[Path]:
    """Remove (and return) the temporaries of ``path`` that killed writers left; a previous version (``.old-*``) is
    kept while ``path`` is missing (:func:`recover_directory` moves it back)."""
    path = Path(path)
    removed = []
    for temp, kind, pid in _temporaries(path):
        if kind == "old" and not path.exists():
            continue
        if _is_stale(temp, pid):
            _remove(temp)
            removed.append(temp)
    return removed


# ---- renames -----------------------------------------------------------------------------------------------------

_RENAME_EXCHANGE = _RENAME_SWAP = 2  # linux/fs.h, macOS stdio.h
_AT_FDCWD = -100


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:  # pragma: no cover
        return None


def _exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` atomically; False when the platform or file system cannot."""
    linux, fa, fb = sys.platform == "linux", os.fsencode(a), os.fsencode(b)
    libc = _libc() if sys.platform in ("linux", "darwin") else None
    fn = getattr(libc, "renameat2" if linux else "renamex_np", None)  # None: no libc, or glibc < 2.28
    if fn is None:
        return False
    if linux:
        res = fn(_AT_FDCWD, fa, _AT_FDCWD, fb, ctypes.c_uint(_RENAME_EXCHANGE))
    else:  # pragma: no cover - macOS
        res = fn(fa, fb, ctypes.c_uint(_RENAME_SWAP))
    if res == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _exchange_supported(folder: str | os.PathLike) -> bool:
    """Whether two paths in ``folder`` can be swapped atomically (probed with two empty directories)."""
    folder = Path(folder)
    a, b = folder / f".probe-{uuid.uuid4().hex[:12]}", folder / f".probe-{uuid.uuid4().hex[:12]}"
    a.mkdir()
    b.mkdir()
    try:
        return _exchange(a, b)
    except OSError:
        return False
    finally:
        _remove(a)
        _remove(b)


def _fsync_dir(path: Path) -> None:
    """Make renames in ``path`` durable (best effort)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _temp_name(path: Path, kind: str) -> Path:
    return path.parent / f".{path.name}.{kind}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


# ---- writers -----------------------------------------------------------------------------------------------------


def atomic_write(path: str | os.PathLike, data: str | bytes | Callable[[IO[bytes]], Any]) -> str:
    """Write ``data`` -- text (UTF-8), bytes or a callable writing into the binary file it is given (``lambda f:
    fig.savefig(f, format="png")``) -- to ``path`` atomically (0644, its folder made if missing); returns the path."""
    path = Path(path)
    make_dirs(path.parent)
    clean_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            _lock(f.fileno())  # held while we write: marks the temporary as alive
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
    """Build a directory in a hidden sibling, renamed to ``path`` when the ``with`` block succeeds (0755 / 0644).
    ``overwrite`` replaces an existing ``path`` (see the module docstring); otherwise ``FileExistsError`` (checked
    before and after the block). Close files by the block's end."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise FileExistsError(f"{str(path)!r} already exists")
    make_dirs(path.parent)
    recover_directory(path)
    tmp = _temp_name(path, "tmp")
    tmp.mkdir()
    tmp_fd = _open(tmp, lock=True)  # held until we are done: marks the temporary (later the new version) as alive
    old_fd = None
    try:
        yield tmp
        for root, _dirs, files in os.walk(tmp):
            os.chmod(root, DIR_MODE)  # every folder is a root once
            for name in files:
                os.chmod(os.path.join(root, name), FILE_MODE)
        if path.exists() and not overwrite:
            raise FileExistsError(f"{str(path)!r} appeared while it was being written")
        garbage = tmp  # left to remove: the old version after an exchange, nothing after a plain rename
        if not (path.exists() or path.is_symlink()):
            os.replace(tmp, path)
        elif not _exchange(tmp, path):  # an exchange leaves path the new version, tmp the old one
            garbage = _temp_name(path, "old")
            old_fd = _open(path, lock=True)  # so that recover_directory leaves it alone while we live
            os.replace(path, garbage)
            try:
                os.replace(tmp, path)
            except BaseException:
                os.replace(garbage, path)
                raise
        _fsync_dir(path.parent)
        _remove(garbage)
    except BaseException:
        _remove(tmp)
        raise
    finally:
        _close(old_fd)
        _close(tmp_fd)


@contextlib.contextmanager
def locked(path: str, *, shared: bool = False, blocking: bool = True) -> Iterator[int | None]:
    """A POSIX flock on the file ``path`` for the block: exclusive (the file is created if missing), or shared, for a
    reader, which takes no lock where it cannot open the file (a read-only folder: nobody writes there). A no-op
    where flock is missing. ``blocking=False``: ``BlockingIOError`` at once when another holder has it (a killed
    holder's lock dies with it). Yields the open file's descriptor (None when not opened), e.g. to note the holder."""
    try:
        fd = os.open(path, os.O_RDONLY) if shared else os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        if not shared:
            raise
        fd = None
    try:
        if fd is not None and fcntl is not None:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB))
        yield fd
    finally:
        if fd is not None:
            os.close(fd)  # releases the flock
