"""An experiment's output folder: the lock a run holds on it (:func:`lock_output`) and reading what an earlier run
left there (:func:`read_if_present`)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from typing import Any

from st_extensions.atomic import FILE_MODE, locked

__all__ = ["LOCK_FILE", "lock_output", "read_if_present"]

LOCK_FILE = ".pyterrier-prob.lock"
_OUTPUT_LOCKS: dict[str, contextlib.ExitStack] = {}  # lock file -> this process's hold on it


def lock_output(folder: str) -> contextlib.ExitStack:
    """Hold an exclusive flock on ``folder/.pyterrier-prob.lock`` (with this process's pid) until the returned stack
    is closed or the process ends; ``ValueError`` naming the holder when another process holds it (this process's
    own earlier hold is taken over)."""
    path = os.path.join(folder, LOCK_FILE)
    held = _OUTPUT_LOCKS.pop(os.path.realpath(path), None)
    if held is not None:
        held.close()
    stack = contextlib.ExitStack()
    try:
        fd = stack.enter_context(locked(path, blocking=False))
    except BlockingIOError:
        holder = (read_if_present(path, str) or "").strip() or "another run"
        raise ValueError(
            f"--output {folder!r} is in use by pyterrier-prob {holder}; wait for it to finish or choose another "
            "--output"
        ) from None
    if fd is not None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n".encode(), 0)
        os.fchmod(fd, FILE_MODE)
    _OUTPUT_LOCKS[os.path.realpath(path)] = stack
    return stack


def read_if_present(path: str, parse: Callable[[str], Any] = json.loads) -> Any:
    """The text of ``path`` parsed (default: JSON), None when missing or unreadable."""
    try:
        with open(path, encoding="utf8") as f:
            return parse(f.read())
    except (OSError, ValueError):
        return None
