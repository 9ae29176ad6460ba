"""Seconds per training step of ExpNCE and BetaNCE relative to MultipleNegativesRankingLoss.

Same backbone weights (the packaged all-MiniLM-L6-v2), same batches of real nfcorpus/train (query, relevant
document) pairs, same optimiser; every batch is stepped by the three losses back to back in one run, and
the median of the per-batch time ratios is reported (target: pEBR / MNRL <= 1.05).

    python benchmarks/train_overhead.py [--batch-size 16 --batches 20]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _machine import describe  # noqa: E402
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss  # noqa: E402

from pyterrier_prob.data import training_pairs  # noqa: E402
from st_extensions import build_pebr_model, load_model  # noqa: E402
from st_extensions.losses import BetaNCELoss, ExpNCELoss  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--batches", type=int, default=20, help="timed steps per loss")
    ap.add_argument("--out", default="benchmarks/results/train_overhead.json")
    a = ap.parse_args()

    from st_extensions import default_model_path

    base = load_model(default_model_path(), device="cpu")
    pairs = training_pairs("irds:beir/nfcorpus/train", max_pairs=a.batch_size * (a.batches + 1), seed=0)
    batches = [
        (pairs["anchor"][i : i + a.batch_size], pairs["positive"][i : i + a.batch_size])
        for i in range(0, len(pairs) - a.batch_size + 1, a.batch_size)
    ]
    # One model per loss family, each starting from the same weights; MNRL runs on the ExpNCE model's twin.
    runs = {}
    for name, family, loss_cls in [
        ("MNRL", "exp", None),
        ("ExpNCE", "exp", ExpNCELoss),
        ("BetaNCE", "beta", BetaNCELoss),
    ]:
        torch.manual_seed(0)
        model = build_pebr_model(base, family=family)
        loss = MultipleNegativesRankingLoss(model, scale=20.0) if loss_cls is None else loss_cls(model)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-5)
        runs[name] = (model, loss, opt)

    def step(name: str, batch) -> None:
        model, loss, opt = runs[name]
        model.train()
        feats = [model.preprocess(list(batch[0])), model.preprocess(list(batch[1]))]
        value = loss(feats, None)
        value.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for name in runs:  # warm-up
        step(name, batches[0])
    # Every batch is run by all three losses back to back (rotating the order), so batch length and
    # machine load cancel in the per-batch ratio; the median of those ratios is the figure.
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for b, batch in enumerate(batches[: a.batches]):
        for name in names[b % 3 :] + names[: b % 3]:
            t0 = time.perf_counter()
            step(name, batch)
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) for name, t in times.items()}
    ratios = {name: statistics.median(x / m for x, m in zip(times[name], times["MNRL"])) for name in names}
    totals = {name: sum(times[name]) / sum(times["MNRL"]) for name in names}
    result = {
        "machine": describe(),
        "batch_size": a.batch_size,
        "max_seq_length": base.max_seq_length,
        "batches": len(times["MNRL"]),
        "seconds_per_step_median": med,
        "ratio_vs_MNRL_median_per_batch": ratios,
        "ratio_vs_MNRL_total_time": totals,
        "target": "pEBR / MNRL <= 1.05",
    }
    print(json.dumps(result["machine"]))
    print(f"batch {a.batch_size}, max_seq_length {base.max_seq_length}, {len(times['MNRL'])} batches per loss")
    print(f"{'loss':10s} {'s/step (median)':>16s} {'vs MNRL, median of per-batch ratios':>36s} {'total time':>11s}")
    for name in names:
        print(f"{name:10s} {med[name]:16.4f} {ratios[name]:36.3f} {totals[name]:11.3f}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
