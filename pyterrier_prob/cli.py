"""The ``pyterrier-prob`` command.

For now (the foundation release) a short pEBR demo: fine-tune a BetaNCE model on a collection's train split,
save it, and show the per-query temperature and cosine cutoff it predicts for the dev queries. The full
experiment (indexing, CDF-cutoff retrieval, pt.Experiment at matched k) comes with the retrieval release.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="pyterrier-prob",
        description="pEBR demo: fine-tune a BetaNCE query-distribution model and show per-query cutoffs.",
    )
    ap.add_argument("--dataset", default="irds:beir/nfcorpus", help="ir_datasets id without the split")
    ap.add_argument("--train-split", default="train")
    ap.add_argument("--dev-split", default="dev")
    ap.add_argument("--model", default=None, help="base model name or path (default: packaged all-MiniLM-L6-v2)")
    ap.add_argument("--family", choices=["exp", "beta", "beta_mle"], default="beta")
    ap.add_argument("--steps", type=int, default=60, help="training steps")
    ap.add_argument("--max-seq-length", type=int, default=128, help="token budget per text")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--p", type=float, default=0.5, help="share of the relevant-item law the cutoff keeps, in (0, 1)")
    ap.add_argument("--output", default="outputs/pebr-demo", help="folder for the model and summary.json")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if not 0 < a.p < 1:
        print(f"pyterrier-prob: --p must be in (0, 1), got {a.p}", file=sys.stderr)
        return 2
    import ir_datasets
    from scipy.stats import spearmanr

    from pyterrier_prob.data import relevant_counts, training_pairs
    from pyterrier_prob.training import fine_tune
    from st_extensions import build_pebr_model, encode_queries
    from st_extensions.losses import BetaMLELoss, BetaNCELoss, ExpNCELoss
    from st_extensions.pebr import distribution_from_params

    train_id = f"{a.dataset}/{a.train_split}"
    dev_id = f"{a.dataset}/{a.dev_split}"
    print(f"[1/3] fine-tuning {a.family} head on {train_id} for {a.steps} steps of {a.batch_size}", flush=True)
    model = build_pebr_model(a.model, family=a.family, device="cpu")
    model.max_seq_length = a.max_seq_length
    loss = {"exp": ExpNCELoss, "beta": BetaNCELoss, "beta_mle": BetaMLELoss}[a.family](model)
    pairs = training_pairs(train_id, max_pairs=a.steps * a.batch_size * 2, seed=a.seed)
    losses = fine_tune(model, loss, pairs, steps=a.steps, batch_size=a.batch_size, learning_rate=a.lr, seed=a.seed)
    os.makedirs(a.output, exist_ok=True)
    model_dir = os.path.join(a.output, "model")
    model.save(model_dir)

    print(f"[2/3] per-query distributions for {dev_id}", flush=True)
    queries = {q.query_id: q.text for q in ir_datasets.load(dev_id.removeprefix("irds:")).queries_iter()}
    counts = relevant_counts(dev_id)
    qids = [q for q in queries if q in counts]
    _, params = encode_queries(model, [queries[q] for q in qids])
    dist = distribution_from_params(params, a.family)
    cut = dist.cutoff(a.p)
    tau = params[:, 0] if a.family != "beta_mle" else 1 / params[:, 0]
    n_rel = np.array([counts[q] for q in qids])
    rho = float(spearmanr(tau, n_rel)[0]) if np.ptp(tau) > 0 else float("nan")
    summary = {
        "train": train_id,
        "dev": dev_id,
        "family": a.family,
        "steps": a.steps,
        "loss_first": float(losses[0]),
        "loss_last": float(losses[-1]),
        "tau_quantiles_10_50_90": [float(x) for x in np.quantile(tau, [0.1, 0.5, 0.9])],
        f"cutoff_quantiles_10_50_90_at_p={a.p}": [float(x) for x in np.quantile(cut, [0.1, 0.5, 0.9])],
        "spearman_tau_vs_num_relevant": rho,
        "model": model_dir,
    }
    with open(os.path.join(a.output, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)

    print("[3/3] examples (broadest and narrowest predicted laws):")
    order = np.argsort(tau)
    for i in [*order[:3], *order[-3:]]:
        print(f"  tau={tau[i]:.4f}  cutoff(p={a.p})={cut[i]:+.4f}  #rel={n_rel[i]:4d}  {queries[qids[i]][:60]}")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
