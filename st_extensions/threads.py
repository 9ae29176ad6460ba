"""Thread counts that follow the CPUs a process may use (:func:`available_cpus`, :func:`configure_threads`), fewer
threads for small-model work (:func:`torch_threads`) and batch scheduling (:func:`batch_scheduling`), for shared
machines and cluster jobs; why, and the measurements: ``docs/cluster.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import platform
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from st_extensions.checks import positive_float, positive_int

__all__ = [
    "BATCH_SLICE_MS",
    "SMALL_MODEL_THREADS",
    "available_cpus",
    "batch_scheduling",
    "configure_threads",
    "is_batch_scheduled",
    "thread_count",
    "torch_threads",
]

#: Threads of small-model work (:func:`torch_threads`): heads on cached features (``benchmarks/contention.py``).
SMALL_MODEL_THREADS = 1
#: Time slice (ms) of :func:`batch_scheduling`: the kernel's longest (``benchmarks/contention.py``).
BATCH_SLICE_MS = 100.0
CGROUP_ROOT = Path("/sys/fs/cgroup")
_SCHED_SETATTR = {"x86_64": 314, "aarch64": 274}  # syscall numbers of sched_setattr(2)
_SCHED_BATCH = 3
_configured: int | None = None  # the count configure_threads set (thread_count)
_interop_set = False  # torch's inter-op pool can be sized once, before its first use


def _cgroup_quota(root: Path) -> float | None:
    """The cgroup's CPU quota in CPUs (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``); None if none."""
    candidates = [(root / "cpu.max", None)]
    candidates += [(root / d / "cpu.cfs_quota_us", root / d / "cpu.cfs_period_us") for d in ("cpu", "cpu,cpuacct")]
    for quota_file, period_file in candidates:
        try:
            parts = quota_file.read_text().split()
            if period_file is not None:
                parts = [parts[0], period_file.read_text().strip()]
        except (OSError, IndexError):
            continue
        try:
            quota, period = float(parts[0]), float(parts[1])
        except (ValueError, IndexError):  # "max": no quota
            return None
        return quota / period if quota > 0 and period > 0 else None  # v1: -1 for none
    return None


def available_cpus() -> int:
    """The CPUs this process may use: ``OMP_NUM_THREADS`` when set (a positive int), else its CPU affinity capped by
    the cgroup's CPU quota (rounded up); at least 1."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not on Linux
        n = os.cpu_count() or 1
    quota = _cgroup_quota(CGROUP_ROOT)
    if quota is not None:
        n = min(n, math.ceil(quota))
    return max(1, n)


def configure_threads(n: int | None = None) -> int:
    """Set torch's intra-op threads (and its inter-op threads, the first time), faiss's OpenMP threads when faiss is
    installed, and the tokenizers' (``RAYON_NUM_THREADS``; ``TOKENIZERS_PARALLELISM=false`` for one) to ``n``
    (default: :func:`available_cpus`); returns the count."""
    global _configured, _interop_set
    n = available_cpus() if n is None else positive_int("threads", n)
    torch.set_num_threads(n)
    if not _interop_set:
        _interop_set = True
        with contextlib.suppress(RuntimeError):  # torch refuses once inter-op work has started
            torch.set_num_interop_threads(n)
    with contextlib.suppress(ImportError):
        import faiss  # optional

        faiss.omp_set_num_threads(n)
    os.environ["RAYON_NUM_THREADS"] = str(n)
    if n == 1:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _configured = n
    return n


def thread_count() -> int:
    """The thread count :func:`configure_threads` set, else :func:`available_cpus` (for pools of our own)."""
    return _configured or available_cpus()


@contextlib.contextmanager
def torch_threads(n: int | None = None) -> Iterator[int]:
    """torch's intra-op threads lowered to ``n`` (never raised) for the block, restored after; yields the count.
    Default: ``ST_SMALL_MODEL_THREADS`` when set (0: leave the count as it is, the policy's off switch), else
    :data:`SMALL_MODEL_THREADS`."""
    before = torch.get_num_threads()
    if n is None:
        n = int(os.environ.get("ST_SMALL_MODEL_THREADS", SMALL_MODEL_THREADS)) or before
    torch.set_num_threads(min(positive_int("n", n), before))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def batch_scheduling(slice_ms: float | None = BATCH_SLICE_MS) -> bool:
    """Schedule every thread of this process as a batch job: ``SCHED_BATCH`` with a time slice of ``slice_ms``
    (``sched_setattr(2)``'s ``sched_runtime``, honoured by Linux >= 6.12 between 0.1 and 100 ms; threads started later
    inherit it), so that jobs sharing a core take long turns (``docs/cluster.md``). The nice value is kept. ``None`` or
    0: leave the scheduling as it is. Returns whether every thread was changed (False where the syscall is not known
    or refused: nothing else changes)."""
    if not slice_ms:
        return False
    positive_float("slice_ms", slice_ms)
    number = _SCHED_SETATTR.get(platform.machine())
    if number is None or not Path("/proc/self/task").is_dir():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    # struct sched_attr (version 1, 56 bytes): size, policy, flags, nice, priority, runtime, deadline, period, util
    attr = ctypes.create_string_buffer(
        struct.pack("IIQiIQQQII", 56, _SCHED_BATCH, 0, nice, 0, int(slice_ms * 1e6), 0, 0, 0, 0), 56
    )
    return all([libc.syscall(number, int(tid), attr, 0) == 0 for tid in os.listdir("/proc/self/task")])


def is_batch_scheduled() -> bool:
    """Whether this process's main thread runs as a batch job (``SCHED_BATCH``, :func:`batch_scheduling`)."""
    return hasattr(os, "sched_getscheduler") and os.sched_getscheduler(0) == _SCHED_BATCH
