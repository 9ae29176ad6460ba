"""Training speed on a shared core: steps/s of ``pyterrier-prob`` trainings alone, beside a busy process, beside a
second job of the same kind, all pinned to one core (``taskset -c <cpu>``).

Two workloads: the frozen-head training of ``pyterrier-prob unierf`` (``--ablations none``) and the partial recipe of
``pyterrier-prob pebr --recipe partial --train-layers 1``. Each runs (a) alone, (b) beside one busy single-threaded
process (``python -c "while True: pass"``) and (c) beside a second identical job (both measured, averaged), under
these policies: ``after`` (the defaults: threads follow the CPUs the process may use, heads on cached features on
:data:`st_extensions.threads.SMALL_MODEL_THREADS`, batch scheduling with 100 ms slices, OpenMP's idle threads
sleeping), ``no_slice`` (the same with ``--sched-slice-ms 0``), ``spinning`` (the same with OpenMP's idle threads
spinning first, libgomp's default: ``GOMP_SPINCOUNT=300000``) and ``before`` (the old default reproduced: ``--threads
<the machine's cores>``, ``ST_SMALL_MODEL_THREADS=0``, ``--sched-slice-ms 0`` and spinning threads). ``--cpu 0,1``
pins to two cores instead: each job then has as many threads as cores. Steps/s come from each run's ``summary.json``
(``train_steps_per_s``: first to last step, set-up and caches left out). A warm-up run per workload fills the encoder
and state caches the measured runs share.

The speed of this machine drifts by 10-20% between runs minutes apart, so each (workload, policy) is measured in
``--rounds`` rounds whose order of conditions alternates, and each ratio is a round's beside-figure over the same
round's alone-figure; the JSON reports medians over the rounds (and the min and max of the ratios) beside every
round's figures. Each job's ``cpu_share`` (its CPU time over its wall time, from the kernel's resource usage) shows
what the scheduler gave it: about 1 alone, at most 0.5 beside one other busy process (a fair share of one core), so a
single-threaded job beside another cannot exceed half its speed alone. Goal: beside another job at least half the speed
alone (``ratio_beside_job >= 0.5``). Writes ``benchmarks/results/contention.json``.

    python benchmarks/contention.py [--dataset irds:beir/nfcorpus --unierf-steps 1000 --partial-steps 30 --cpu 0
        --rounds 3 --policies after,no_slice,spinning,before --resume]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scipy.stats import ttest_1samp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import describe, write_result  # noqa: E402
from chaos import write_collection  # noqa: E402

BUSY = [sys.executable, "-c", "while True: pass"]


def workloads(a: argparse.Namespace) -> dict[str, list[str]]:
    """Workload name -> its ``pyterrier-prob`` command (without ``--output``)."""
    common = ["--quiet", *(["--batch-size", str(a.batch_size)] if a.batch_size else [])]
    return {
        "unierf_frozen": [
            *["pyterrier-prob", "unierf", "--ablations", "none", "--steps", str(a.unierf_steps)],
            *["--dataset", a.dataset, *common],
        ],
        "pebr_partial": [
            *["pyterrier-prob", "pebr", "--recipe", "partial", "--train-layers", "1"],
            *["--steps", str(a.partial_steps), "--checkpoint-every", "0", "--dataset", partial_dataset(a), *common],
        ],
    }


def partial_dataset(a: argparse.Namespace) -> str:
    """``--partial-dataset``, or a cut of nfcorpus written once under ``--work`` (``--partial-queries`` training
    queries, the same texts and token budget, so a training step costs what it costs on nfcorpus, while the
    indexing and evaluation each run repeats stay short)."""
    if a.partial_dataset:
        return a.partial_dataset
    folder = Path(a.work) / f"nfcorpus-cut-{a.partial_queries}"
    if not (folder / "corpus.jsonl").exists():
        write_collection(folder, {"train": a.partial_queries, "dev": 40, "test": 40}, extra_docs=200)
    return str(folder)


#: libgomp's own default spin count (its manual, ``GOMP_SPINCOUNT``): idle threads spin this long before sleeping, as
#: they did before the command set ``OMP_WAIT_POLICY=PASSIVE`` (``pyterrier_prob.cli.passive_waiting``)
SPINNING = {"GOMP_SPINCOUNT": "300000"}


def policies() -> dict[str, tuple[list[str], dict[str, str]]]:
    """Policy name -> (extra options, environment changes)."""
    old_threads = ["--threads", str(os.cpu_count() or 1), "--sched-slice-ms", "0"]
    return {
        "after": ([], {}),
        "no_slice": (["--sched-slice-ms", "0"], {}),
        "spinning": ([], SPINNING),
        "before": (old_threads, {"ST_SMALL_MODEL_THREADS": "0", **SPINNING}),
    }


def start(cmd: list[str], cpu: str, output: str | None, env: dict[str, str], log: str) -> subprocess.Popen:
    """Start ``cmd`` pinned to ``cpu`` (a ``pyterrier-prob`` job writing ``output``, or a busy process)."""
    args = ["taskset", "-c", cpu, *cmd, *(["--output", output] if output else [])]
    with open(log, "w") as f:
        return subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **env})


def rates_of(jobs: list[tuple[str, subprocess.Popen, str]], timeout: float) -> list[dict[str, float]]:
    """Wait for jobs ``(output, process, log)`` started together: for each, the mean of its trainings' steps/s
    (``summary.json``), its wall time and its CPU time (user + system, the kernel's resource usage of the process),
    and ``cpu_share`` = CPU / wall, how much of the core the job had."""
    t0, done = time.monotonic(), {}
    while len(done) < len(jobs):
        for output, proc, log in jobs:
            if output in done:
                continue
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                proc.returncode = os.waitstatus_to_exitcode(status)
                if proc.returncode != 0:
                    raise SystemExit(f"exit status {proc.returncode}: {shlex.join(proc.args)} (log: {log})")
                done[output] = (time.monotonic() - t0, usage.ru_utime + usage.ru_stime)
            elif time.monotonic() - t0 > timeout:
                for _, p, _ in jobs:
                    p.kill()
                raise SystemExit(f"timed out after {timeout:.0f} s: {shlex.join(proc.args)} (log: {log})")
        time.sleep(0.2)
    out = []
    for output, _, _ in jobs:
        with open(os.path.join(output, "summary.json"), encoding="utf8") as f:
            rates = [r for r in json.load(f)["train_steps_per_s"].values() if r]
        if not rates:
            raise SystemExit(f"no training step measured in {output}/summary.json (more --*-steps?)")
        wall, cpu = done[output]
        out.append({"steps_per_s": statistics.mean(rates), "wall_s": wall, "cpu_s": cpu, "cpu_share": cpu / wall})
    return out


def fresh_output(work: str, name: str, warm: str) -> str:
    """An empty output folder sharing the warm-up run's caches (``cache/`` linked)."""
    out = os.path.join(work, name)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    os.symlink(os.path.abspath(os.path.join(warm, "cache")), os.path.join(out, "cache"))
    return out


CONDITIONS = ("alone", "beside_busy", "beside_job")


def run_condition(
    condition: str, job: list[str], env: dict[str, str], a: argparse.Namespace, work: str, tag: str, warm: str
) -> list[dict[str, float]]:
    """One measurement of ``job`` on ``--cpu``: alone, beside a busy process, or beside a second copy of itself."""
    if condition != "beside_job":
        busy = start(BUSY, a.cpu, None, {}, os.devnull) if condition == "beside_busy" else None
        try:
            out = fresh_output(work, f"{tag}-{'busy' if busy else 'alone'}", warm)
            return rates_of([(out, start(job, a.cpu, out, env, f"{out}.log"), f"{out}.log")], a.timeout)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    outs = [fresh_output(work, f"{tag}-pair{i}", warm) for i in (1, 2)]
    procs = [start(job, a.cpu, o, env, f"{o}.log") for o in outs]
    return rates_of([(o, p, f"{o}.log") for o, p in zip(outs, procs)], a.timeout)


def summarise(rounds: list[dict[str, float]]) -> dict[str, Any]:
    """Medians over the rounds of each condition's steps/s and CPU share, and of the per-round ratios (each round's
    beside-figure over the same round's alone-figure), with their min and max and a one-sided t-test against 0.5;
    and the ratios of the medians."""
    out: dict[str, Any] = {"rounds": len(rounds)}
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        out[key] = round(statistics.median(values), 3)
        if key.startswith("ratio_"):
            out[f"{key}_min"], out[f"{key}_max"] = round(min(values), 3), round(max(values), 3)
            if len(values) > 1:  # one-sided one-sample t-test of the per-round ratios: below half the speed alone?
                out[f"{key}_p_below_half"] = round(float(ttest_1samp(values, 0.5, alternative="less").pvalue), 3)
    for where in ("beside_busy", "beside_job"):  # the other estimate: median speed beside over median speed alone
        beside, alone = (statistics.median(r[w] for r in rounds) for w in (where, "alone"))
        out[f"ratio_of_medians_{where}"] = round(beside / alone, 3)
    out["per_round"] = rounds
    return out


def measure(name: str, cmd: list[str], a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """One workload's steps/s alone, beside a busy process and beside a second job, under each policy, in
    ``--rounds`` rounds whose order alternates (alone, busy, job; then job, busy, alone; ...), so that a drift of the
    machine's speed over the run falls on every condition alike; round k of every policy runs before round k + 1 of
    any, so that the drift also falls on the policies alike."""
    work = os.path.join(a.work, name)
    warm = os.path.join(work, "warm")
    os.makedirs(work, exist_ok=True)
    wanted = [p for p in policies() if p in a.policies]
    finished = {p: Path(work) / f"{p}.rounds.json" for p in wanted}
    state = {
        p: json.loads(f.read_text(encoding="utf8")) if a.resume and f.exists() else [] for p, f in finished.items()
    }
    if not a.report_only and any(len(state[p]) < a.rounds for p in wanted):
        if not (Path(warm) / "summary.json").exists() or not a.resume:
            print(f"{name}: warm-up ({shlex.join(cmd)})", flush=True)
            every_cpu = ",".join(map(str, sorted(os.sched_getaffinity(0))))
            rates_of([(warm, start(cmd, every_cpu, warm, {}, f"{warm}.log"), f"{warm}.log")], a.timeout)
    for k in range(0 if a.report_only else a.rounds):  # round k of every policy before round k + 1 of any
        for policy in wanted:
            if len(state[policy]) > k:
                continue
            options, env = policies()[policy]
            order = CONDITIONS if k % 2 == 0 else CONDITIONS[::-1]
            runs = {c: run_condition(c, [*cmd, *options], env, a, work, policy, warm) for c in order}
            r = {c: statistics.mean(m["steps_per_s"] for m in runs[c]) for c in CONDITIONS}
            r |= {f"cpu_share_{c}": statistics.mean(m["cpu_share"] for m in runs[c]) for c in CONDITIONS}
            r |= {"ratio_beside_busy": r["beside_busy"] / r["alone"], "ratio_beside_job": r["beside_job"] / r["alone"]}
            state[policy].append({key: round(v, 3) for key, v in r.items()})
            write_result(str(finished[policy]), state[policy])  # a killed benchmark resumes after the last whole round
            print(f"{name} {policy} round {k + 1}: {json.dumps(state[policy][-1])}", flush=True)
    results: dict[str, dict[str, Any]] = {}
    for policy, rounds in state.items():
        if len(rounds) < a.rounds:
            print(f"{name} {policy}: {len(rounds)} of {a.rounds} rounds measured (rerun with --resume)", flush=True)
            a.not_measured.append(f"{name} {policy}: {a.rounds - len(rounds)} of {a.rounds} rounds")
        if rounds:
            results[policy] = summarise(rounds)
    return results


WORKLOAD_NAMES = {"unierf_frozen": "`unierf`, frozen heads", "pebr_partial": "`pebr --recipe partial --train-layers 1`"}
POLICY_NAMES = {
    "after": "now",
    "no_slice": "now without batch scheduling (`--sched-slice-ms 0`)",
    "spinning": "now with spinning OpenMP threads (`GOMP_SPINCOUNT=300000`)",
    "before": "old (`--threads <cores>`, no small-model cap, no batch scheduling, spinning OpenMP threads)",
}


def markdown(steps_per_s: dict[str, dict[str, dict[str, Any]]]) -> str:
    """The results as a Markdown table (medians over the rounds; each ratio's min-max over the rounds)."""
    lines = [
        "| workload | threads | rounds | alone | beside a busy process | ratio | beside a second job | ratio "
        "(min-max) | p (ratio < 0.5) | ratio of the medians | CPU share beside the job |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, by_policy in steps_per_s.items():
        for policy, v in by_policy.items():
            lines.append(
                f"| {WORKLOAD_NAMES[workload]} | {POLICY_NAMES[policy]} | {v['rounds']} | {v['alone']:.3f} | "
                f"{v['beside_busy']:.3f} | {v['ratio_beside_busy']:.3f} | {v['beside_job']:.3f} | "
                f"**{v['ratio_beside_job']:.3f}** ({v['ratio_beside_job_min']:.3f}-{v['ratio_beside_job_max']:.3f}) | "
                f"{v.get('ratio_beside_job_p_below_half', float('nan')):.3f} | "
                f"{v['ratio_of_medians_beside_job']:.3f} | "
                f"{v['cpu_share_beside_job']:.3f} |"
            )
    return "\n".join(lines)


def _measuring(argv: list[str]) -> list[str]:
    """The command line without ``--report-only`` and ``--note``: the command that measures."""
    out, args = [], iter(argv)
    for x in args:
        if x == "--note":
            next(args, None)  # its text
        elif x != "--report-only" and not x.startswith("--note="):
            out.append(x)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="irds:beir/nfcorpus")
    ap.add_argument("--unierf-steps", type=int, default=1000, help="frozen-head training steps of unierf")
    ap.add_argument("--partial-steps", type=int, default=30, help="training steps of pebr --recipe partial")
    ap.add_argument("--batch-size", type=int, help="training batch (default: each command's; 16 for a tiny collection)")
    ap.add_argument(
        "--cpu", default="0", help="the core every process is pinned to (taskset -c; a list, e.g. 0,1, pins to those)"
    )
    ap.add_argument("--work", default="outputs/contention", help="folder of the runs' outputs and logs")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    ap.add_argument(
        "--partial-dataset", help="collection of the partial workload (default: a cut of nfcorpus, --partial-queries)"
    )
    ap.add_argument("--partial-queries", type=int, default=200, help="training queries of that cut")
    ap.add_argument("--only", choices=["unierf_frozen", "pebr_partial"], help="measure one workload only")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per (workload, policy); medians are reported")
    ap.add_argument(
        "--policies",
        default="after,before",
        type=lambda s: s.split(","),
        help="policies (after,no_slice,spinning,before)",
    )
    ap.add_argument("--resume", action="store_true", help="keep the rounds an earlier, interrupted run finished")
    ap.add_argument(
        "--report-only", action="store_true", help="with --resume: write the JSON from what finished, measure nothing"
    )
    ap.add_argument("--note", action="append", default=[], help="a line for the JSON's notes (e.g. rounds' provenance)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "contention.json"))
    a = ap.parse_args()
    if shutil.which("taskset") is None:
        raise SystemExit("taskset (util-linux) is needed to pin the processes to one core")
    if a.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {a.rounds}")
    unknown = sorted(set(a.policies) - set(policies()))
    if unknown:
        raise SystemExit(f"--policies: unknown policy {unknown} (choose from {', '.join(policies())})")
    if a.report_only and not a.resume:
        raise SystemExit("--report-only reports what an earlier run finished: it needs --resume")
    t0, a.not_measured = time.perf_counter(), []
    results = {name: measure(name, cmd, a) for name, cmd in workloads(a).items() if a.only in (None, name)}
    result = {
        # the command that measures (a --report-only run writes what it finished: rerun it to complete the file)
        "command": shlex.join([os.path.relpath(sys.argv[0]), *_measuring(sys.argv[1:])]),
        "not_measured": a.not_measured,
        "notes": a.note,
        "machine": describe(),
        "pinned_to_cpu": a.cpu,
        "commands": {name: shlex.join(cmd) for name, cmd in workloads(a).items() if a.only in (None, name)},
        "policies": {p: {"options": o, "env": e} for p, (o, e) in policies().items()},
        "goal": "ratio_beside_job >= 0.5 (beside another job at least half the speed alone)",
        "protocol": (
            f"{a.rounds} rounds per (workload, policy), the order of the conditions alternating between rounds; "
            "figures are medians over the rounds, each ratio a round's beside-figure over the same round's alone one"
        ),
        "steps_per_s": results,
        "wall_s": None if a.report_only else round(time.perf_counter() - t0, 1),  # None: measured by earlier runs
    }
    write_result(a.out, result)
    print(json.dumps(result["steps_per_s"], indent=2))
    print(markdown(result["steps_per_s"]))
    print(f"written to {a.out}")


if __name__ == "__main__":
    main()
