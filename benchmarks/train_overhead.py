"""Seconds per training step of ExpNCE and BetaNCE relative to MultipleNegativesRankingLoss.

Same backbone weights (the packaged all-MiniLM-L6-v2), same batches of real nfcorpus/train (query, relevant
document) pairs, same optimiser; the three losses are timed in interleaved rounds in one run and the median
seconds per step is compared (target: pEBR / MNRL <= 1.05).

    python benchmarks/train_overhead.py [--batch-size 16 --rounds 6 --steps 5]
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
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per loss per round")
    ap.add_argument("--out", default="benchmarks/results/train_overhead.json")
    a = ap.parse_args()

    from st_extensions import default_model_path

    base = load_model(default_model_path(), device="cpu")
    pairs = training_pairs("irds:beir/nfcorpus/train", max_pairs=a.batch_size * a.steps * 4, seed=0)
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
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(a.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            for s in range(a.steps):
                batch = batches[(r * a.steps + s) % len(batches)]
                t0 = time.perf_counter()
                step(name, batch)
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "machine": describe(),
        "batch_size": a.batch_size,
        "steps_per_loss": len(times["MNRL"]),
        "seconds_per_step_median": med,
        "ratio_vs_MNRL": {name: med[name] / med["MNRL"] for name in med},
        "target": "pEBR / MNRL <= 1.05",
    }
    print(json.dumps(result["machine"]))
    print(f"{'loss':10s} {'s/step (median)':>16s} {'vs MNRL':>8s}")
    for name in names:
        print(f"{name:10s} {med[name]:16.4f} {result['ratio_vs_MNRL'][name]:8.3f}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
