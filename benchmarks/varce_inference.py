"""Inference time of a VarCrossEncoder relative to a plain CrossEncoder (the paper's claim: the probabilistic head
costs next to nothing at inference; our target VarCE / CE <= 1.05).

The three re-rankers of ``pyterrier-prob varce`` are built on the same backbone (the packaged all-MiniLM-L6-v2, or
``--model``): ``CE`` (``CrossEncoder``, num_labels=1) and ``VarCE-MEANVAR`` / ``VarCE-VAR``
(:func:`st_extensions.cross_encoder.build_var_cross_encoder`). Training does not change the cost of a forward pass,
so they are timed untrained. Each scores the same seeded sample of (query, judged document) pairs of
``--dataset``'s test split: ``CE`` with ``predict`` (identity activation: logits), the VarCEs with
``predict(return_std=True)`` (E[s] and std[s], Eq. 22-23), as :class:`~pyterrier_prob.varce.VarCrossEncoderReranker`
calls it. After a warm-up, ``--repeats`` rounds run every model once, in rotating order (interleaved, so that a
slow phase of the machine hits all of them); the result is the median over rounds of each round's time ratio to CE.

    python benchmarks/varce_inference.py [--pairs 128 --repeats 5 --batch-size 32 --max-seq-length 128]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _machine import describe, write_result  # noqa: E402

BASELINE = "CE"
TARGET = 1.05


def sample_pairs(dataset: str, n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` seeded (query, document text) pairs from the judged pairs of ``dataset``'s test split."""
    from pyterrier_prob.collections import choose_splits, load_collection

    coll = load_collection(dataset)
    split = choose_splits(coll).test
    queries = dict(zip(coll.topics(split)["qid"], coll.topics(split)["query"]))
    judged = [(q, d) for q, d in coll.qrels(split)[["qid", "docno"]].itertuples(index=False) if q in queries]
    picked = random.Random(seed).sample(judged, min(n, len(judged)))
    texts = coll.doc_texts({d for _, d in picked})
    return [(" ".join(queries[q].split()), texts[d]) for q, d in picked if d in texts]


def build_models(model: str | None, max_seq_length: int, seed: int) -> dict[str, Any]:
    import torch
    from sentence_transformers import CrossEncoder
    from transformers.utils import logging as hf_logging

    from st_extensions import default_model_path
    from st_extensions.cross_encoder import build_var_cross_encoder

    hf_logging.set_verbosity_error()  # the load report of the CE's new classifier head
    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)  # "Converting ... to CrossEncoder"
    base = model or default_model_path()
    torch.manual_seed(seed)
    models = {BASELINE: CrossEncoder(base, num_labels=1, max_length=max_seq_length, device="cpu")}
    for v in ("MEANVAR", "VAR"):
        models[f"VarCE-{v}"] = build_var_cross_encoder(base, variant=v, max_seq_length=max_seq_length, device="cpu")
    for m in models.values():
        m.eval()
    return models


def score(name: str, model: Any, pairs: list[tuple[str, str]], batch_size: int) -> None:
    """What the experiment's scoring runs: logits for CE, (E[s], std[s]) for a VarCE."""
    import torch

    if name == BASELINE:
        model.predict(pairs, batch_size=batch_size, activation_fn=torch.nn.Identity(), show_progress_bar=False)
    else:
        model.predict(pairs, batch_size=batch_size, return_std=True, show_progress_bar=False)


def inference_time(models: dict[str, Any], pairs: list[tuple[str, str]], repeats: int, batch_size: int) -> dict:
    """Interleaved timings on the same pairs (rotating order); median of per-round ratios to CE."""
    names = list(models)
    for n in names:  # warm-up
        score(n, models[n], pairs[:batch_size], batch_size)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            score(n, models[n], pairs, batch_size)
            times[n].append(time.perf_counter() - t0)
    ratios = {n: [t / c for t, c in zip(times[n], times[BASELINE])] for n in names}
    return {
        "pairs": len(pairs),
        "repeats": repeats,
        "batch_size": batch_size,
        "seconds_median": {n: statistics.median(t) for n, t in times.items()},
        "pairs_per_s_median": {n: len(pairs) / statistics.median(t) for n, t in times.items()},
        "ratio_vs_CE_median_of_repeats": {n: statistics.median(v) for n, v in ratios.items()},
        "ratio_vs_CE_min_max": {n: [min(v), max(v)] for n, v in ratios.items()},
        "ratio_vs_CE_total_time": {n: sum(times[n]) / sum(times[BASELINE]) for n in names},
        "target": f"VarCrossEncoder / CrossEncoder <= {TARGET}",
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="irds:beir/nfcorpus", help="collection whose test pairs are scored")
    ap.add_argument("--model", default=None, help="backbone (default: the packaged all-MiniLM-L6-v2)")
    ap.add_argument("--pairs", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-seq-length", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/varce_inference.json")
    a = ap.parse_args(argv)
    if a.pairs < 1 or a.repeats < 1 or a.batch_size < 1:
        ap.error("--pairs, --repeats and --batch-size must be >= 1")
    machine = describe()
    print(json.dumps(machine), flush=True)
    pairs = sample_pairs(a.dataset, a.pairs, a.seed)
    models = build_models(a.model, a.max_seq_length, a.seed)
    speed = inference_time(models, pairs, a.repeats, a.batch_size)
    result = {"machine": machine, "settings": vars(a), **speed}
    write_result(a.out, result)
    print(
        f"\nInference time ({a.dataset} test pairs: {speed['pairs']}, batch {a.batch_size}, max_seq_length "
        f"{a.max_seq_length}, {a.repeats} interleaved repeats; target VarCE / CE <= {TARGET})"
    )
    for n in models:
        lo, hi = speed["ratio_vs_CE_min_max"][n]
        print(
            f"  {n:14s} {speed['seconds_median'][n]:8.2f} s  {speed['pairs_per_s_median'][n]:7.1f} pairs/s  ratio vs "
            f"CE {speed['ratio_vs_CE_median_of_repeats'][n]:.3f} (min {lo:.3f}, max {hi:.3f}; total-time "
            f"{speed['ratio_vs_CE_total_time'][n]:.3f})"
        )
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
