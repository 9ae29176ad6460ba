"""Pairs per second of the distilled students per number of joint layers J, training and inference, measured side by
side in one run (interleaved repeats): J = 1, 2, 3 split students (``--score-from kernels``: the lower 6 - J layers'
states cached per text as the partial recipe keeps them, the top J layers reading query and document together plus the
frozen bi-encoder path) and J = 6, a plain sentence-transformers ``CrossEncoder`` over ``[CLS] q [SEP] d [SEP]``.

A training step is a forward and backward pass and an AdamW step on ``--rows`` rows of a query and ``--docs``
documents (nfcorpus/train queries with nfcorpus documents); inference scores ``--pairs`` pairs in batches of 64. The
per-text caches are filled before timing (their cost is paid once per text, not per pair): the lower layers' states
and, for inference, the frozen bi-encoder path's mean state of each text (``SplitTransformer.separate_means``; in
training its layers' dropout is on, so it runs per pair). The split students' inference is also timed with that path
run per pair (``cache_separate = False``), in the same repeats: ``infer_pairs_per_s_path_per_pair`` and the ratio
``infer_speedup_of_path_cache`` (medians of the same batches).

    python benchmarks/joint_speed.py --teacher outputs/v52/models/distill-teacher
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "joint_speed.json")


def texts(rows: int, docs: int, pairs: int, seed: int = 0) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Training pairs (``rows`` queries, ``docs`` documents each) and inference pairs from nfcorpus."""
    import numpy as np

    from pyterrier_prob.collections import load_collection

    coll = load_collection("irds:beir/nfcorpus")
    queries = coll.topics("train")["query"].tolist()
    corpus = [d["text"] for _, d in zip(range(2000), coll.corpus_iter())]
    rng = np.random.default_rng(seed)
    train = [(queries[i], corpus[j]) for i in rng.choice(len(queries), rows) for j in rng.choice(len(corpus), docs)]
    infer = [(queries[i], corpus[j]) for i, j in zip(rng.choice(len(queries), pairs), rng.choice(len(corpus), pairs))]
    return train, infer


def build(teacher: str, joint: int, max_seq_length: int) -> Any:
    import torch
    from sentence_transformers import CrossEncoder

    from st_extensions.cross_encoder.split import build_split_cross_encoder

    if joint == 6:  # every layer joint: a plain cross-encoder over the pair, twice the per-text length
        return CrossEncoder(teacher, num_labels=1, max_length=2 * max_seq_length, activation_fn=torch.nn.Identity())
    return build_split_cross_encoder(
        teacher, joint_layers=joint, bi_encoder_path=True, joint_feature="kernels", scale=10.0,
        max_seq_length=max_seq_length,
    )  # fmt: skip


def train_step(model: Any, pairs: list[tuple[str, str]], optimizer: Any) -> None:
    model.train()
    features = model.preprocess(pairs) if hasattr(model, "preprocess") else None
    if features is None:
        raise RuntimeError("the installed sentence-transformers CrossEncoder has no preprocess()")
    out = model(features)
    out["scores"].float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> None:
    import torch

    from st_extensions.cross_encoder.split import split_state_cache

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", default="outputs/v52/models/distill-teacher")
    ap.add_argument("--joints", type=int, nargs="+", default=[1, 2, 3, 6])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-seq-length", type=int, default=128)
    ap.add_argument("--out", default=RESULT)
    a = ap.parse_args(argv)
    from benchmarks._machine import describe, write_result

    train, infer = texts(a.rows, a.docs, a.pairs)
    models, optimizers, caches = {}, {}, []
    for j in a.joints:
        model = build(a.teacher, j, a.max_seq_length)
        if j != 6:
            folder = tempfile.TemporaryDirectory()
            caches.append(folder)
            split_state_cache(model, folder.name, list(dict.fromkeys(t for p in train + infer for t in p)))
        params = [p for p in model.parameters() if p.requires_grad]
        models[j], optimizers[j] = model, torch.optim.AdamW(params, lr=1e-5)
        train_step(model, train[: a.docs], optimizers[j])  # warm-up
        warm = infer if j != 6 else infer[:64]  # the split students: every text's bi-encoder path once
        model.predict(warm, batch_size=64, show_progress_bar=False)
    times: dict[int, dict[str, list[float]]] = {j: {"train": [], "infer": [], "per_pair": []} for j in a.joints}
    for _ in range(a.repeats):  # interleaved: every J once per repeat
        for j in a.joints:
            start = time.perf_counter()
            train_step(models[j], train, optimizers[j])
            times[j]["train"].append(time.perf_counter() - start)
            models[j].eval()
            start = time.perf_counter()
            models[j].predict(infer, batch_size=64, show_progress_bar=False)
            times[j]["infer"].append(time.perf_counter() - start)
            if j != 6:  # the same pairs with the bi-encoder path per pair
                models[j][0].cache_separate = False
                start = time.perf_counter()
                models[j].predict(infer, batch_size=64, show_progress_bar=False)
                times[j]["per_pair"].append(time.perf_counter() - start)
                models[j][0].cache_separate = True
    rows = []
    for j in a.joints:
        t, i = times[j]["train"], times[j]["infer"]
        row = {"joint_layers": j, "train_pairs_per_s": len(train) / statistics.median(t)}
        row |= {"infer_pairs_per_s": a.pairs / statistics.median(i)}
        row |= {"train_s": {"min": min(t), "median": statistics.median(t), "max": max(t)}}
        row |= {"infer_s": {"min": min(i), "median": statistics.median(i), "max": max(i)}}
        if per := times[j]["per_pair"]:
            row |= {"infer_pairs_per_s_path_per_pair": a.pairs / statistics.median(per)}
            row |= {"infer_speedup_of_path_cache": statistics.median(per) / statistics.median(i)}
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["train_speed_vs_first"] = row["train_pairs_per_s"] / base["train_pairs_per_s"]
        row["infer_speed_vs_first"] = row["infer_pairs_per_s"] / base["infer_pairs_per_s"]
    result = {
        "command": "python benchmarks/joint_speed.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": {
            "rows": a.rows,
            "docs": a.docs,
            "pairs": a.pairs,
            "repeats": a.repeats,
            "max_seq_length": a.max_seq_length,
            "threads": torch.get_num_threads(),
        },  # fmt: skip
        "rows": rows,
        "machine": describe(),
    }
    write_result(a.out, result, indent=1)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
