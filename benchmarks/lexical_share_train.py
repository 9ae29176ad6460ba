"""How far distilled students follow BM25 on training queries' own candidate pools (the rows they were fitted to),
beside the fused teacher: :func:`pyterrier_prob.varce.distill.lexical_share` (least-squares weights of a ranker's
per-query z-scores on BM25's and the teacher bi-encoder's, R², BM25's share of the weights) over seeded queries of
the teacher's training pool. A run's summary gives the same measure on its test pools (``lexical_share``), so the
two together tell a student that did not fit the teacher's lexical half from one that fitted it and did not carry it
to new queries.

    python benchmarks/lexical_share_train.py --pool outputs/v52/teacher/<fingerprint>/beir_nfcorpus-pool-*.parquet \\
        --model 'CE (J 2)=outputs/v52/models/distilled-CE' \\
        --model 'CE (J 1)=outputs/v52-j1-pseudo/models/distilled-CE'
    python benchmarks/lexical_share_train.py --table benchmarks/results/lexical_share_train.json
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks._machine

RESULT = "benchmarks/results/lexical_share_train.json"


def table(result: dict) -> list[str]:
    """Markdown rows: each ranker's BM25 share (R²) on the training pools."""
    from pyterrier_prob.experiments.report import cell

    lines = ["| ranker | BM25 share (R²), training queries' pools |", "|---|---|"]
    for name, v in result["shares"].items():
        lines.append(f"| {name} | {cell(v['bm25_share'], '.3f')} ({cell(v['r2'], '.2f')}) |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pool", help="the teacher's pool of the training queries (qid, docno, bm25, dense; parquet)")
    ap.add_argument("--model", action="append", default=[], metavar="NAME=PATH", help="a saved student (repeatable)")
    ap.add_argument("--dataset", default="irds:beir/nfcorpus")
    ap.add_argument("--split", default="train", help="the split whose queries the pool holds")
    ap.add_argument("--queries", type=int, default=40, help="seeded sample of the pool's queries")
    ap.add_argument("--alpha", type=float, default=0.8, help="the teacher's fusion weight (its run's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-seq-length", type=int, default=128, help="the students' (the run's --max-seq-length)")
    ap.add_argument("--out", default=RESULT)
    ap.add_argument("--table", metavar="JSON", help="print the table of a results file (no measurement)")
    a = ap.parse_args(argv)
    if a.table:
        from pyterrier_prob.experiments.report import print_json_table

        print_json_table(a.table, table)
        return
    if not a.pool or not a.model:
        ap.error("--pool and --model NAME=PATH are needed to measure (or --table JSON)")
    models = dict(m.split("=", 1) for m in a.model)
    import pandas as pd
    import torch

    from benchmarks._machine import describe, write_result
    from pyterrier_prob.collections import load_collection
    from pyterrier_prob.varce import distill
    from st_extensions.cross_encoder import VarCrossEncoder
    from st_extensions.loading import load_model

    pool = pd.read_parquet(a.pool)
    qids = sorted(pool["qid"].unique())
    rng = np.random.default_rng(a.seed)
    picked = set(rng.choice(qids, size=min(a.queries, len(qids)), replace=False).tolist())
    frame = pool[pool["qid"].isin(picked)].reset_index(drop=True)
    collection = load_collection(a.dataset)
    topics = collection.topics(a.split)
    query = dict(zip(topics["qid"].astype(str), topics["query"]))
    missing = sorted(set(frame["qid"]) - set(query))
    if missing:
        raise SystemExit(f"--pool holds queries that {a.dataset}/{a.split} does not: {missing[:5]}")
    texts = collection.doc_texts(frame["docno"].unique())
    queries, documents = frame["qid"].map(query).tolist(), frame["docno"].map(texts).tolist()
    shares = {f"Teacher (bi-encoder + BM25, alpha {a.alpha})": distill.lexical_share(
        frame, distill.teacher_scores(frame, a.alpha))}  # fmt: skip
    for name, path in models.items():
        model = load_model(path, device="cpu")
        model.max_seq_length = a.max_seq_length
        if isinstance(model, VarCrossEncoder):
            mean, _ = distill.score_pairs(model, queries, documents, a.batch_size)  # E[s]
        else:  # logits, as a run's re-ranking scores them (a sigmoid would change the z-scores)
            pairs = list(zip(queries, documents))
            mean = model.predict(pairs, batch_size=a.batch_size, activation_fn=torch.nn.Identity())
        shares[name] = distill.lexical_share(frame, mean)
        print(f"{name}: BM25 share {shares[name]['bm25_share']:.3f} (R² {shares[name]['r2']:.2f})", flush=True)
    result = {
        "benchmark": __doc__.split("\n\n")[0].replace("\n", " "),
        "command": shlex.join(["python", "benchmarks/lexical_share_train.py", *(argv or sys.argv[1:])]),
        "machine": describe(),
        "pool": a.pool,
        "queries": sorted(picked),
        "pairs": len(frame),
        "models": models,
        "shares": shares,
    }
    print("\n".join(table(result)))
    write_result(a.out, result)
    print(f"written to {a.out}")


if __name__ == "__main__":
    main()
