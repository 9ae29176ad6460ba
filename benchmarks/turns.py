"""How long two CPU-bound processes on one core run between preemptions, with and without batch scheduling.

Two busy loops are pinned to one core (``taskset -c <cpu>``); each first sets its own scheduling
(:func:`st_extensions.threads.batch_scheduling` with a slice of S ms, or none: the kernel's default), then both spin
over the same window of ``--seconds``. Each reports its involuntary context switches in that window (the kernel's
resource usage, ``ru_nivcsw``) per second, its CPU share (CPU time over the window) and its mean turn: CPU time over
the number of preemptions. Pairs: both with 100 ms slices (what every ``pyterrier-prob`` command asks for), one with
100 ms beside one with the default slice (a job beside any other busy program), both default, both 20 ms. This checks
what docs/cluster.md says of the turns, and explains why batch scheduling changes nothing beside a busy process.
Writes ``benchmarks/results/turns.json``.

    python benchmarks/turns.py [--cpu 0 --seconds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import describe, write_result  # noqa: E402

PAIRS = ((100.0, 100.0), (100.0, 0.0), (0.0, 0.0), (20.0, 20.0))
"""Slices (ms) of the two processes; 0: the kernel's default scheduling."""


def spin(slice_ms: float, start: float, seconds: float) -> dict[str, float | bool]:
    """Set this process's scheduling, wait for the wall-clock ``start``, spin ``seconds``; what the window saw."""
    from st_extensions.threads import batch_scheduling

    batched = batch_scheduling(slice_ms) if slice_ms else False
    late = max(0.0, time.time() - start)  # > 0: the window began before this process was ready
    time.sleep(max(0.0, start - time.time()))
    switches, cpu, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw, time.process_time(), time.monotonic()
    while time.monotonic() - t0 < seconds:
        pass
    wall = time.monotonic() - t0
    n, used = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw - switches, time.process_time() - cpu
    return {
        "slice_ms": slice_ms,
        "batch_scheduled": batched,
        "switches_per_s": round(n / wall, 1),
        "cpu_share": round(used / wall, 3),
        "mean_turn_ms": round(1000 * used / n, 2) if n else None,
        "late_s": round(late, 2),
    }


def pair(slices: tuple[float, float], cpu: str, seconds: float) -> list[dict[str, float | bool]]:
    """Run two spinning processes with ``slices`` on ``cpu`` over one window; their reports."""
    start = time.time() + 10.0  # both have imported and set their scheduling by then
    cmd = [sys.executable, os.path.abspath(__file__), "--spin"]
    procs = [
        subprocess.Popen(
            ["taskset", "-c", cpu, *cmd, str(s), str(start), str(seconds)], stdout=subprocess.PIPE, text=True
        )
        for s in slices
    ]
    out = [p.communicate()[0] for p in procs]
    for p in procs:
        if p.returncode != 0:
            raise SystemExit(f"exit status {p.returncode}: {shlex.join(p.args)}")
    return [json.loads(text) for text in out]


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--spin":
        print(json.dumps(spin(*map(float, sys.argv[2:]))))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", default="0", help="the core both processes are pinned to (taskset -c)")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of the measured window")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "turns.json"))
    a = ap.parse_args()
    if shutil.which("taskset") is None:
        raise SystemExit("taskset (util-linux) is needed to pin the processes to one core")
    if not a.seconds > 0:
        raise SystemExit(f"--seconds must be > 0, got {a.seconds}")
    pairs = []
    for slices in PAIRS:
        pairs.append(pair(slices, a.cpu, a.seconds))
        print(json.dumps(pairs[-1]), flush=True)
    result = {
        "command": shlex.join([os.path.relpath(sys.argv[0]), *sys.argv[1:]]),
        "machine": describe(),
        "kernel": platform.release(),
        "pinned_to_cpu": a.cpu,
        "seconds": a.seconds,
        "pairs": pairs,
    }
    write_result(a.out, result)
    print(f"written to {a.out}")


if __name__ == "__main__":
    main()
