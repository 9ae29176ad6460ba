"""Can anything we have tell the CE's training positives from its negatives? A diagnosis of the cross-encoder recipe.

The rows of ``pyterrier-prob varce`` (``benchmarks/varce_rerank.py``'s recipe: nfcorpus/train, groups of one
judged-relevant document and 3 negatives mined in turn from BM25's and the untrained dense model's top 30, never a
judged document) are rebuilt, and each group is scored by the signals available without training: BM25 and the
untrained MiniLM bi-encoder (cosine, 128 tokens, the vectors of the experiment's dense index). Per signal: the share
of groups whose positive scores above all 3 negatives (chance: 1/4) and the mean rank of the positive (chance: 2.5,
ranks 1-4). For reference the same is done for groups built the same way from nfcorpus/dev, whose qrels are graded
(label 2: directly cited), and with positives limited to label 2 there. Prints a table and writes
``benchmarks/results/ce_group_diagnosis.json``.

    python benchmarks/ce_group_diagnosis.py --experiment-output runs/varce
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment-output", default="outputs/varce_rerank")
    ap.add_argument("--groups", type=int, default=4000, help="groups per split (the experiment's: 4000)")
    ap.add_argument("--out", default="benchmarks/results/ce_group_diagnosis.json")
    a = ap.parse_args()

    import numpy as np
    from pyterrier_pisa import PisaIndex
    from sentence_transformers import SentenceTransformer

    from benchmarks._machine import describe
    from pyterrier_prob import ProbBiEncoder
    from pyterrier_prob.collections import load_collection
    from pyterrier_prob.index import DenseIndex
    from pyterrier_prob.varce.data import cross_encoder_training_data
    from st_extensions import default_model_path

    out = a.experiment_output
    coll = load_collection("irds:beir/nfcorpus")
    bm25 = PisaIndex(os.path.join(out, "indexes", "bm25-beir-nfcorpus.pisa"), text_field="text")
    model = SentenceTransformer(default_model_path(), device="cpu")
    model.max_seq_length = 128
    enc = ProbBiEncoder(model, batch_size=64, verbose=False)
    dense = DenseIndex(os.path.join(out, "indexes", "dense-untrained-beir-nfcorpus.flex"))
    stages = {"BM25": bm25.bm25(num_results=30), "dense": enc.query_encoder() >> dense.np_retriever(num_results=30)}
    vectors = np.asarray(dense.vectors(), dtype=np.float32)
    docno_of = {d["text"]: d["docno"] for d in coll.corpus_iter()}  # the rows hold texts (identical texts: one docno)
    row_of = {d: i for i, d in enumerate(dense.docno_array())}

    def diagnose(split: str, min_relevance: int) -> dict:
        rows, info = cross_encoder_training_data(
            coll, split, stages, n_groups=a.groups, negatives=3, pool_depth=30, min_relevance=min_relevance
        )
        frame = rows.to_pandas()
        frame["group"] = np.arange(len(frame)) // 4
        topics = coll.topics(split)
        qid_of = dict(zip(topics["query"], topics["qid"]))
        frame["qid"] = frame["query"].map(qid_of)
        frame["docno"] = frame["document"].map(docno_of)
        qv = dict(
            zip(sorted(set(frame["query"])), model.encode(sorted(set(frame["query"])), normalize_embeddings=True))
        )
        frame["dense"] = [float(qv[q] @ vectors[row_of[d]]) for q, d in zip(frame["query"], frame["docno"])]
        # BM25 of every (query, document) of the groups: its score in the query's top 1000, else below all of them
        res = bm25.bm25(num_results=1000)(topics[topics["qid"].isin(set(frame["qid"]))][["qid", "query"]])
        score = dict(zip(zip(res["qid"], res["docno"]), res["score"]))
        frame["BM25"] = [score.get((q, d), -1.0) for q, d in zip(frame["qid"], frame["docno"])]
        result = {"split": split, "min_relevance": min_relevance, "groups": int(frame["group"].nunique()), "info": info}
        for signal in ("BM25", "dense"):
            rank = frame.groupby("group")[signal].rank(ascending=False, method="average")
            pos = frame["label"] == 1.0
            result[signal] = {
                "positive_first": float((rank[pos] == 1).mean()),
                "positive_mean_rank": float(rank[pos].mean()),
            }
        return result

    rows = [diagnose("train", 1), diagnose("dev", 1), diagnose("dev", 2)]
    print(
        "| split | positives | groups | BM25: positive first | BM25: mean rank | dense: positive first "
        "| dense: mean rank |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| nfcorpus/{r['split']} | label >= {r['min_relevance']} | {r['groups']} | "
            f"{r['BM25']['positive_first']:.3f} | {r['BM25']['positive_mean_rank']:.2f} | "
            f"{r['dense']['positive_first']:.3f} | {r['dense']['positive_mean_rank']:.2f} |"
        )
    result = {
        "benchmark": "how well BM25 and the untrained bi-encoder tell the CE's training positives from its negatives "
        "(groups of 1 judged-relevant + 3 mined negatives; chance: positive first 0.25, mean rank 2.5)",
        "command": "python " + shlex.join(sys.argv),
        "machine": describe(),
        "rows": rows,
    }
    with open(a.out, "w", encoding="utf8") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
