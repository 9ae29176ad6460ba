"""CE vs VarCrossEncoder (VAR, MEANVAR) distilled from a fine-tuned bi-encoder fused with BM25, as BM25 re-rankers:
nfcorpus/test (in domain), scifact/test and Cranfield (zero-shot), BM25's top 100, paired t-tests against BM25 and
against the CE, the teacher's own rows beside them.

Runs ``pyterrier-prob varce --teacher ...`` with the recipe below (split-attention students started from the
teacher: the lower layers of MiniLM read query and document apart and are cached per text, the top --train-layers
(2 here; the published run passed ``-- --train-layers 1``) attend across both and train with the head; Margin-MSE
rows from the training queries' BM25 + teacher top-100 pools; dev learning curves, the best dev point kept), then
writes ``benchmarks/results/varce_rerank.json``: a list ``rows`` (``collection``, ``depth``, ``system``, ``queries``,
``nDCG@10``, ``p_vs_bm25``, ``p_vs_CE``, and ``ece`` for the re-rankers on nfcorpus), the dev curves, the teacher's
choice on dev, calibration and uncertainty, and
``benchmarks/results/varce_reliability.png`` (the reliability diagram of the nfcorpus/test pairs).

    python benchmarks/varce_rerank.py --output runs/varce-distill                      # fine-tunes the teacher too
    python benchmarks/varce_rerank.py --output runs/varce-distill --teacher PATH       # a teacher trained before

Every run resumes (``--resume``): the teacher, the students trained with the same settings, BM25 indexes,
embeddings, pools, the state cache and every score already computed are reused, so the figures regenerate without
retraining. The label-trained recipe's results are kept in
``benchmarks/results/varce_rerank_labels.json`` (its command inside).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RECIPE = [
    "--dataset", "irds:beir/nfcorpus",
    "--recipe", "partial", "--train-layers", "2",
    "--steps", "1000", "--batch-size", "16", "--lr", "1e-4", "--max-seq-length", "128",
    "--pool-depth", "100", "--depth", "100",
    "--dev-queries", "100", "--dev-depth", "30", "--dev-every", "100",
    "--ood", "irds:beir/scifact", "irds:cranfield", "--ood-queries", "0", "--ood-depth", "100",
    "--risks", "0", "0.25", "0.5", "1", "2", "--inference-batch-size", "64", "--resume",
]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", default="outputs/varce_rerank", help="the experiment's output folder")
    ap.add_argument("--teacher", default="partial", help="a fine-tuned bi-encoder folder, or 'partial' to train one")
    ap.add_argument("--out", default="benchmarks/results/varce_rerank.json")
    ap.add_argument("extra", nargs="*", help="further pyterrier-prob varce options (after --)")
    a = ap.parse_args()

    from benchmarks._machine import describe, write_result
    from pyterrier_prob.cli import main as cli

    args = ["varce", *RECIPE, "--teacher", a.teacher, "--output", a.output, *a.extra]
    command = "pyterrier-prob " + shlex.join(args)
    print(command, flush=True)
    code = cli(args)
    if code:
        return code
    with open(os.path.join(a.output, "summary.json"), encoding="utf8") as f:
        summary = json.load(f)
    result = {
        "benchmark": "CE and VarCEs distilled from a bi-encoder + BM25 teacher, as BM25 re-rankers (nDCG@10)",
        "command": f"python benchmarks/varce_rerank.py --output {a.output} --teacher {a.teacher}"
        + (f" -- {shlex.join(a.extra)}" if a.extra else ""),
        "experiment_command": command,
        "machine": describe(),
        **summary,
    }
    write_result(a.out, result, indent=1)
    print(f"wrote {a.out}")
    plot = os.path.join(a.output, "reliability.png")
    if os.path.isfile(plot):  # the reliability diagram of the nfcorpus/test pairs, beside the JSON
        shutil.copyfile(plot, os.path.join(os.path.dirname(os.path.abspath(a.out)), "varce_reliability.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
