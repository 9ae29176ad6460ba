"""Chaos test of ``--resume``: SIGKILL ``pyterrier-prob pebr --recipe partial --train-layers 1`` at random moments over
its stages, resume, and compare with an uninterrupted run.

A tiny BEIR folder cut from nfcorpus (ir_datasets' local copy) is written first; then one uninterrupted reference
run, whose stage markers (``[  12.3s] fine-tuning pebr ...`` on stdout) give each stage's start and length. Each kill
draws a stage (round robin over a seeded shuffle, so kills spread over training, encoding, indexing, calibration,
scoring and report writing) and a moment inside it (a uniform share of the stage's reference length after its marker
appears), runs the command into a fresh folder, SIGKILLs it there, then reruns with ``--resume`` -- killed again at a
random moment with probability ``--rekill`` -- until a run ends. A kill passes when the final ``results.md`` tables
equal the reference's, every saved model's tensors are within 1e-6 of the reference's, and no temporary or partial
file is left in the output folder. Writes ``benchmarks/results/chaos.json``.

    python benchmarks/chaos.py [--kills 20 --seed 0 --steps 8]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import describe, write_result  # noqa: E402

#: stage of the run -> the beginnings of the stage markers (``Harness.stage`` messages) that open it
STAGES = {
    "start-up": ("loading",),
    "training": ("fine-tuning",),
    "encoding": ("encoding the calibration",),
    "indexing": ("encoding ", "indexing "),  # a dense index is encoded and written in one stage; PISA for BM25
    "calibration": ("calibrating", "fitting the calibrated"),
    "scoring": ("running the systems", "ranking quality", "ranked lists", "per-row", "every rule"),
    "report writing": ("Table 3", "report"),
}
MARKER = re.compile(r"^\[\s*([0-9.]+)s\] (.*)$")
#: names a killed writer may leave behind (atomic temporaries, probes, half-written checkpoints)
PARTIAL = re.compile(r"(\.(tmp|old)-\d*-?[0-9a-z_]+$)|(^\.probe-)|(\.tmp$)|(^\.export-)|(\.partial$)")


def stage_of(message: str) -> str:
    """The stage a marker's message opens."""
    for stage, starts in STAGES.items():
        if any(message.startswith(s) for s in starts):
            return stage
    return "report writing"


def write_collection(folder: Path, splits: dict[str, int], extra_docs: int = 40, seed: int = 0) -> Path:
    """A tiny BEIR folder cut from nfcorpus (:func:`pyterrier_prob.collections.write_beir_sample`): per split the first
    ``n`` queries with relevant documents (the i-th with up to ``1 + i % 4`` of them), plus ``extra_docs`` others."""
    from pyterrier_prob.collections import write_beir_sample

    write_beir_sample(folder, splits, docs_per_query=4, extra_docs=extra_docs, seed=seed)
    return folder


def command(dataset: Path, steps: int) -> list[str]:
    """The run under test (without ``--output`` / ``--resume``)."""
    argv = ["pebr", "--dataset", str(dataset), "--recipe", "partial", "--train-layers", "1", "--steps", str(steps)]
    argv += ["--checkpoint-every", "2", "--batch-size", "4", "--max-seq-length", "32", "--ks", "5", "--cap", "50"]
    argv += ["--table3-ps", "0.9", "--study-cap", "50"]
    return [sys.executable, "-m", "pyterrier_prob.cli", *argv]


class Run:
    """One process of the command, its stage markers read as they come (stage, seconds since start)."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.t0 = time.monotonic()
        self.markers: list[tuple[str, str, float]] = []
        self.seen = threading.Condition()
        self._err = open(log, "ab")  # noqa: SIM115 - closed in wait()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            m = MARKER.match(line.strip())
            if m:
                with self.seen:
                    self.markers.append((stage_of(m[2]), m[2], time.monotonic() - self.t0))
                    self.seen.notify_all()
        with self.seen:
            self.seen.notify_all()

    def wait_for(self, stage: str, nth: int) -> bool:
        """Wait until the ``nth`` marker of ``stage`` (0-based) appears; False if the run ended first."""
        with self.seen:
            while sum(s == stage for s, _, _ in self.markers) <= nth:
                if self.proc.poll() is not None and not self._reader.is_alive():
                    return False
                self.seen.wait(0.2)
        return True

    def kill(self) -> str | None:
        """SIGKILL now; the stage it hit (None if the run had already ended)."""
        if self.proc.poll() is not None:
            return None
        self.proc.send_signal(signal.SIGKILL)
        self.wait()
        return self.markers[-1][0] if self.markers else "start-up"

    def wait(self) -> int:
        rc = self.proc.wait()
        self._reader.join()
        self._err.close()
        return rc


def stage_spans(markers: list[tuple[str, str, float]], end: float) -> list[tuple[str, int, float]]:
    """``(stage, n-th marker of that stage, seconds until the next marker)`` of each marker of a run ending at
    ``end``."""
    spans, counts = [], {}
    for i, (stage, _, t) in enumerate(markers):
        nxt = markers[i + 1][2] if i + 1 < len(markers) else end
        spans.append((stage, counts.get(stage, 0), nxt - t))
        counts[stage] = counts.get(stage, 0) + 1
    return spans


def tables(results_md: Path) -> list[str]:
    """The table rows of a ``results.md`` (what must not change; timings live elsewhere)."""
    return [line for line in results_md.read_text(encoding="utf8").splitlines() if line.startswith("|")]


def weights(out: Path) -> dict[str, np.ndarray]:
    """Every tensor of every saved model under ``out/models``, by ``model/file/tensor``."""
    found = {}
    for file in sorted((out / "models").rglob("*.safetensors")):
        for name, value in load_file(str(file)).items():
            found[f"{file.relative_to(out / 'models')}/{name}"] = value
    return found


def leftovers(out: Path) -> list[str]:
    """Temporary or partial files left in ``out``: atomic temporaries, half-written checkpoints, training runs."""
    left = [str(p.relative_to(out)) for p in out.rglob("*") if PARTIAL.search(p.name)]
    return left + [str(p.relative_to(out)) for p in (out / "runs").glob("*/checkpoint-*")]


def compare(out: Path, ref: Path) -> dict:
    """The checks of one resumed run against the reference."""
    if not (out / "results.md").is_file():
        return {"passed": False, "why": "no results.md"}
    same_tables = tables(out / "results.md") == tables(ref / "results.md")
    a, b = weights(out), weights(ref)
    diff = max((float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a if k in b), default=0.0)
    same_weights = a.keys() == b.keys() and diff <= 1e-6
    left = leftovers(out)
    checks = {"tables_identical": same_tables, "weights_within_1e-6": same_weights, "max_weight_diff": diff}
    return {"passed": same_tables and same_weights and not left, **checks, "leftovers": left}


def chaos(work: Path, kills: int, seed: int = 0, steps: int = 8, rekill: float = 0.3, log=print) -> dict:
    """Run the reference and ``kills`` killed-and-resumed runs under ``work``; the result (see the module doc)."""
    dataset = write_collection(work / "collection", {"train": 16, "dev": 8, "test": 8})
    argv = command(dataset, steps)
    ref = work / "reference"
    run = Run([*argv, "--output", str(ref)], work / "reference.log")
    if run.wait() != 0:
        raise RuntimeError(f"the reference run failed; see {work / 'reference.log'}")
    wall = time.monotonic() - run.t0
    spans = [s for s in stage_spans(run.markers, wall) if s[2] > 0.05]
    log(f"reference: {wall:.0f}s, stages {sorted({s for s, _, _ in spans})}")
    rng = random.Random(seed)
    by_stage: dict[str, list[tuple[str, int, float]]] = {}
    for span in spans:
        by_stage.setdefault(span[0], []).append(span)
    order = sorted(by_stage)
    rng.shuffle(order)
    results = []
    for i in range(kills):
        stage, nth, length = rng.choice(by_stage[order[i % len(order)]])
        out, hits, runs = work / f"kill-{i}", [], 0
        proc = Run([*argv, "--output", str(out)], work / f"kill-{i}.log")
        target = (stage, nth, rng.uniform(0, length))
        while True:
            runs += 1
            if target is not None and proc.wait_for(target[0], target[1]):
                time.sleep(target[2])
                hit = proc.kill()
                if hit is not None:
                    hits.append({"aimed": f"{target[0]} #{target[1]} +{target[2]:.1f}s", "hit": hit})
            rc = proc.wait() if proc.proc.returncode is None else proc.proc.returncode
            if rc == 0:
                break
            if rc != -signal.SIGKILL or runs > 10:
                hits.append({"failed_rc": rc})
                break
            proc = Run([*argv, "--output", str(out), "--resume"], work / f"kill-{i}.log")
            target = None
            if rng.random() < rekill:  # kill the rerun too, at a moment of its own (shorter: it reuses work)
                stage, nth, length = rng.choice(spans)
                target = (stage, 0, rng.uniform(0, length))
        checked = compare(out, ref) if rc == 0 else {"passed": False, "why": f"exit status {rc}"}
        results.append({"kill": i, "kills": hits, "runs": runs, **checked})
        log(f"kill {i}: {hits} -> {'pass' if checked['passed'] else 'FAIL ' + json.dumps(checked)}")
        if checked["passed"]:
            shutil.rmtree(out, ignore_errors=True)
    passed = sum(r["passed"] for r in results)
    return {
        "command": " ".join(["pyterrier-prob", *argv[3:]]),
        "seed": seed,
        "reference_wall_s": round(wall, 1),
        "reference_stages": [{"stage": s, "nth": n, "seconds": round(t, 2)} for s, n, t in spans],
        "kills": results,
        "passed": passed,
        "of": len(results),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rekill", type=float, default=0.3, help="chance that a resumed run is killed again")
    p.add_argument("--work", default=None, help="working folder (default: a temporary one)")
    p.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "results", "chaos.json"))
    a = p.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="chaos-"))
    result = chaos(work, a.kills, a.seed, a.steps, a.rekill)
    write_result(a.output, {"machine": describe(), "work": str(work), **result})
    print(f"{result['passed']} of {result['of']} kills resumed to the reference's results; {a.output}")


if __name__ == "__main__":
    main()
