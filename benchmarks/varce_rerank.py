"""CE vs VarCrossEncoder (VAR, MEANVAR) fine-tuned on nfcorpus/train as BM25 re-rankers: nfcorpus/test (in domain),
scifact/test and Cranfield (zero-shot), BM25's top 100 and top 20, paired t-tests against BM25 and against CE.

Runs ``pyterrier-prob varce`` with the recipe below (partial fine-tuning of the top 2 of MiniLM's 6 layers with the
lower layers' pair states cached, 128 tokens, positives and negatives from the same candidate pool -- the judged
documents and the negatives both among BM25's and the untrained dense model's top 100, the best of the recipe probes
on dev -- dev learning curves, the best dev point kept), then writes ``benchmarks/results/varce_rerank.json``: a
list ``rows`` (``collection``, ``depth``, ``system``, ``queries``, ``nDCG@10``, ``p_vs_bm25``, ``p_vs_CE``) and the
learning curves, the lambda of the risk-aware ranking chosen on dev, the uncertainty statistics and the training
rows' description.

    python benchmarks/varce_rerank.py --output runs/varce            # trains (resumable: run it again after a cut)
    python benchmarks/varce_rerank.py --output runs/varce            # again: reuses the models and the scores
    python benchmarks/varce_rerank.py --output runs/varce -- --steps 200   # extra experiment options after --

Every run passes ``--reuse --resume``: trained models, BM25 and dense indexes, the state cache and every score already
computed are reused, so the figures regenerate without retraining.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RECIPE = [
    "--dataset", "irds:beir/nfcorpus",
    "--recipe", "partial", "--train-layers", "2",
    "--steps", "1000", "--batch-size", "16", "--lr", "1e-4", "--max-seq-length", "128",
    "--positive-depth", "100", "--pool-depth", "100",
    "--depth", "100", "--extra-depths", "20",
    "--dev-queries", "50", "--dev-depth", "20", "--dev-every", "100",
    "--robust-queries", "0",
    "--ood", "irds:beir/scifact", "irds:cranfield", "--ood-queries", "100000", "--ood-depth", "100",
]  # fmt: skip


def _csv(path: str) -> list[dict] | None:
    import pandas as pd

    return json.loads(pd.read_csv(path).to_json(orient="records")) if os.path.isfile(path) else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", default="outputs/varce_rerank", help="the experiment's output folder")
    ap.add_argument("--out", default="benchmarks/results/varce_rerank.json")
    ap.add_argument("extra", nargs="*", help="further pyterrier-prob varce options (after --)")
    a = ap.parse_args()

    from benchmarks._machine import describe
    from pyterrier_prob.cli import main as cli

    args = ["varce", *RECIPE, "--output", a.output, "--reuse", "--resume", *a.extra]
    command = "pyterrier-prob " + shlex.join(args)
    print(command, flush=True)
    code = cli(args)
    if code:
        return code
    with open(os.path.join(a.output, "summary.json"), encoding="utf8") as f:
        summary = json.load(f)
    result = {
        "benchmark": "VarCrossEncoder vs CrossEncoder as BM25 re-rankers (nDCG@10, paired t-tests)",
        "command": f"python benchmarks/varce_rerank.py --output {a.output}"
        + (f" -- {shlex.join(a.extra)}" if a.extra else ""),
        "experiment_command": command,
        "machine": describe(),
        "rows": summary["rerank_rows"],
        "dev_curves": summary.get("dev_curves"),
        "risk_chosen_on_dev": summary.get("risk_chosen_on_dev"),
        "interpolation_chosen_on_dev": summary.get("interpolation_chosen_on_dev"),
        "uncertainty": _csv(os.path.join(a.output, "uncertainty.csv")),
        "risk": _csv(os.path.join(a.output, "risk.csv")),
        "training_rows": summary.get("training_rows"),
        "recipe": summary.get("recipe"),
        "recipes": summary.get("recipes"),
        "scoring": summary.get("scoring"),
        "scored_sharing_lower_layers": summary.get("scored_sharing_lower_layers"),
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf8") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
