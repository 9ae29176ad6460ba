"""Does BetaNCE give broad queries wider relevant-item distributions? (pEBR Sec. 4.4)

Fine-tunes the packaged all-MiniLM-L6-v2 with a BetaNCE head on beir/nfcorpus/train (query, relevant document)
pairs for a short budget, then reads tau_q for every nfcorpus/dev query and reports its spread and its Spearman
rank correlation with the query's number of relevant documents (a broad query has many). The paper's claim,
translated: larger tau_q (a flatter Beta(1/tau_q, 1) law, i.e. a lower per-query cutoff) for queries with more
relevant documents, so the correlation should be positive. No target: we report what happens.

    python benchmarks/query_temperature.py [--steps 200 --batch-size 16 --max-seq-length 128]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from scipy.stats import spearmanr

sys.path.insert(0, os.path.dirname(__file__))
from _machine import describe  # noqa: E402

from pyterrier_prob.data import relevant_counts, training_pairs  # noqa: E402
from pyterrier_prob.training import fine_tune  # noqa: E402
from st_extensions import build_pebr_model, encode_queries  # noqa: E402
from st_extensions.losses import BetaNCELoss  # noqa: E402


def dev_queries(dataset_id: str) -> dict[str, str]:
    import ir_datasets

    return {q.query_id: q.text for q in ir_datasets.load(dataset_id.removeprefix("irds:")).queries_iter()}


def summary(tau: np.ndarray, counts: np.ndarray) -> dict:
    rho, pval = spearmanr(tau, counts) if np.ptp(tau) > 0 else (float("nan"), float("nan"))
    terciles = np.quantile(counts, [1 / 3, 2 / 3])
    strata = np.digitize(counts, terciles, right=True)  # 0: fewest relevant docs (tail) .. 2: most (head)
    return {
        "tau_min": float(tau.min()),
        "tau_p10": float(np.quantile(tau, 0.1)),
        "tau_median": float(np.median(tau)),
        "tau_p90": float(np.quantile(tau, 0.9)),
        "tau_max": float(tau.max()),
        "tau_p90_over_p10": float(np.quantile(tau, 0.9) / np.quantile(tau, 0.1)),
        "spearman_tau_vs_num_relevant": float(rho),
        "p_value": float(pval),
        "mean_tau_by_tercile": {
            name: float(tau[strata == k].mean()) for k, name in enumerate(["tail", "torso", "head"])
        },
        "mean_num_relevant_by_tercile": {
            name: float(counts[strata == k].mean()) for k, name in enumerate(["tail", "torso", "head"])
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", default="irds:beir/nfcorpus/train")
    ap.add_argument("--dev", default="irds:beir/nfcorpus/dev")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--max-seq-length", type=int, default=128, help="token budget per text in training")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--head-scale", type=float, default=None, help="QueryDistributionHead scale (default: its own)")
    ap.add_argument("--out", default="benchmarks/results/query_temperature.json")
    a = ap.parse_args()

    head_kwargs = {} if a.head_scale is None else {"scale": a.head_scale}
    model = build_pebr_model(family="beta", device="cpu", **head_kwargs)
    model.max_seq_length = a.max_seq_length
    queries = dev_queries(a.dev)
    counts_by_qid = relevant_counts(a.dev)
    qids = [q for q in queries if q in counts_by_qid]
    counts = np.array([counts_by_qid[q] for q in qids], dtype=float)
    texts = [queries[q] for q in qids]

    _, before = encode_queries(model, texts)
    train = training_pairs(a.train, max_pairs=a.steps * a.batch_size * 2, seed=0)
    losses = fine_tune(model, BetaNCELoss(model), train, steps=a.steps, batch_size=a.batch_size, learning_rate=a.lr)
    _, after = encode_queries(model, texts)
    tau_before, tau_after = before[:, 0], after[:, 0]

    result = {
        "machine": describe(),
        "train": a.train,
        "dev": a.dev,
        "steps": a.steps,
        "batch_size": a.batch_size,
        "lr": a.lr,
        "head_scale": model[-1].scale,
        "n_dev_queries": len(qids),
        "loss_first_10_mean": float(np.mean(losses[:10])),
        "loss_last_10_mean": float(np.mean(losses[-10:])),
        "before": summary(tau_before, counts),
        "after": summary(tau_after, counts),
    }
    print(json.dumps(result, indent=2))
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
