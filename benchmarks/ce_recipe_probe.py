"""Dev-only probes of the cross-encoder recipe on nfcorpus: does a recipe let the CE re-rank BM25 better than BM25?

The CE of ``pyterrier-prob varce`` (``build_cross_encoder``: MiniLM, a pooling, a linear ranker) is trained on the
experiment's own training rows (nfcorpus/train, 1 judged-relevant : 3 negatives mined in turn from BM25 and the
untrained dense model, never a judged document; the rows of a 1000-step, batch-16 run) under one setting, and its dev
nDCG@10 is recorded every ``--every`` steps (:class:`~pyterrier_prob.curves.DevCurve`) on 50 seeded nfcorpus/dev
queries, BM25's top 20 re-ranked; BM25's own value on the same queries is printed beside it. Test queries are never
read. Settings: the positives (``--positive-depth k``: only judged-relevant documents in a first stage's top k), the
loss (``bce``: BinaryCrossEntropyLoss on single rows, as the experiment; ``lce``: softmax over each query's group of 1
relevant + 3 negatives, localised contrastive estimation, no in-batch negatives; ``distill``: MSE towards the
untrained bi-encoder's cosine of each training pair, no labels), the rate of the encoder layers and of
the head, the pooling (``cls`` / ``mean``), and how many top layers train (1-5: the partial recipe on cached
lower-layer pair states; 6: full fine-tuning).

    python benchmarks/ce_recipe_probe.py --experiment-output runs/varce --name bce --steps 1000 --every 100
    python benchmarks/ce_recipe_probe.py --experiment-output runs/varce --name lce --loss lce --steps 250 --every 50

``--experiment-output`` is the folder of a ``pyterrier-prob varce`` run (``benchmarks/varce_rerank.py``), whose BM25
and dense indexes and state cache are reused. Each probe writes its curve to ``<--out-dir>/<name>.json``;
``--references`` writes BM25's and the untrained bi-encoder's dev nDCG@10 on the same candidates; ``--table`` merges
the curves and references into ``benchmarks/results/ce_recipe_probe.json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


FUSION_ALPHAS = (0.1, 0.2, 0.3, 0.5, 0.7)  # the probe's interpolations with BM25 (pyterrier_prob.fusion)


def _lce_loss(model):
    """Softmax cross-entropy over each row's (query, positive, negative_1..k) scores: sentence-transformers'
    cross-encoder MultipleNegativesRankingLoss on logits without its in-batch negatives (another query's document may
    be relevant to this one: judged-relevant documents are never negatives here)."""
    import torch
    from sentence_transformers.cross_encoder.losses import MultipleNegativesRankingLoss

    class LocalisedContrastiveLoss(MultipleNegativesRankingLoss):
        def get_in_batch_negatives(self, anchors, candidates):
            return []

    return LocalisedContrastiveLoss(model, num_negatives=1, scale=1.0, activation_fn=torch.nn.Identity())


def probe(a: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from datasets import Dataset
    from pyterrier_pisa import PisaIndex
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss
    from sentence_transformers.sentence_transformer.modules import Pooling

    from pyterrier_prob import ProbBiEncoder
    from pyterrier_prob.collections import load_collection
    from pyterrier_prob.curves import DevCurve
    from pyterrier_prob.experiments.varce_train import CE_HEAD_PARAMETERS
    from pyterrier_prob.fusion import interpolate
    from pyterrier_prob.index import DenseIndex
    from pyterrier_prob.training import Recipe, fine_tune
    from pyterrier_prob.varce import per_query
    from pyterrier_prob.varce.data import cross_encoder_training_data, groups_for
    from pyterrier_prob.varce.data import evaluated_queries as _eval_queries
    from st_extensions import default_model_path
    from st_extensions.cross_encoder.frozen import build_cross_encoder

    torch.set_num_threads(a.threads)
    out = a.experiment_output
    coll = load_collection("irds:beir/nfcorpus")
    bm25 = PisaIndex(os.path.join(out, "indexes", "bm25-beir-nfcorpus.pisa"), text_field="text")
    enc = ProbBiEncoder(SentenceTransformer(default_model_path(), device="cpu"), batch_size=64, verbose=False)
    dense = DenseIndex(os.path.join(out, "indexes", "dense-untrained-beir-nfcorpus.flex"))
    k = max(a.pool_depth, a.positive_depth or 0)
    stages = {"BM25": bm25.bm25(num_results=k), "dense": enc.query_encoder() >> dense.np_retriever(num_results=k)}
    if a.negatives == "random":  # a sanity check: no first stage, so every negative is a random unjudged document

        def nothing(topics):
            return topics.iloc[:0].assign(docno=[], rank=[])

        stages = {"none": nothing}
    rows, info = cross_encoder_training_data(
        coll,
        "train",
        stages,
        n_groups=groups_for(1000, 16, 3),
        negatives=3,
        pool_depth=a.pool_depth,
        positive_depth=a.positive_depth,
    )
    print(json.dumps(info), flush=True)
    if a.loss == "distill":  # targets: the untrained bi-encoder's cosine of each pair, times --distill-scale
        model_b = SentenceTransformer(default_model_path(), device="cpu")
        model_b.max_seq_length = 128
        qs, ds = sorted(set(rows["query"])), sorted(set(rows["document"]))
        qv = dict(zip(qs, model_b.encode(qs, normalize_embeddings=True, batch_size=64, show_progress_bar=True)))
        dv = dict(zip(ds, model_b.encode(ds, normalize_embeddings=True, batch_size=64, show_progress_bar=True)))
        cos = [float(qv[q] @ dv[d]) * a.distill_scale for q, d in zip(rows["query"], rows["document"])]
        rows = rows.remove_columns("label").add_column("label", cos)
    if a.loss == "lce":  # one row per group: query, positive, negative_1..3
        d, n = rows.to_dict(), len(rows) // 4
        rows = Dataset.from_dict(
            {
                "query": [d["query"][4 * i] for i in range(n)],
                "positive": [d["document"][4 * i] for i in range(n)],
                **{f"negative_{j}": [d["document"][4 * i + j] for i in range(n)] for j in (1, 2, 3)},
            }
        )
    topics, qrels, _ = _eval_queries(coll.topics("dev"), coll.qrels("dev"), 50, 0)
    cand = bm25.bm25(num_results=20)(topics)
    bm25_dev = float(per_query(cand, qrels, "nDCG@10", topics=topics).mean())
    cand = cand[["qid", "docno", "score"]].merge(topics, on="qid")
    texts = coll.doc_texts(set(cand["docno"]))
    pairs = list(zip(cand["query"], cand["docno"].map(texts)))

    fusion: list[dict[str, float]] = []  # per evaluation: dev nDCG@10 of alpha * z(CE) + (1 - alpha) * z(BM25)

    def evaluate(model) -> float:
        s = model.predict(pairs, batch_size=32, activation_fn=torch.nn.Identity(), show_progress_bar=False)
        s = np.asarray(s, dtype=np.float64)
        run = cand[["qid", "docno"]].assign(score=s)
        fusion.append(
            {
                f"{alpha:g}": float(
                    per_query(
                        cand[["qid", "docno"]].assign(score=interpolate(cand["qid"], cand["score"], s, alpha)),
                        qrels,
                        "nDCG@10",
                        topics=topics,
                    ).mean()
                )
                for alpha in FUSION_ALPHAS
            }
        )
        print("fusion", fusion[-1], flush=True)
        return float(per_query(run, qrels, "nDCG@10", topics=topics).mean())

    torch.manual_seed(0)
    model = build_cross_encoder(None, max_seq_length=128, device="cpu")
    if a.pool != "cls":
        model._modules["1"] = Pooling(model[0].get_embedding_dimension(), a.pool)
    if a.loss == "distill":
        from sentence_transformers.cross_encoder.losses import MSELoss

        loss = MSELoss(model, activation_fn=torch.nn.Identity())
    else:
        loss = BinaryCrossEntropyLoss(model) if a.loss == "bce" else _lce_loss(model)
    partial = a.layers < len(model[0].auto_model.encoder.layer)
    recipe = Recipe(
        mode="partial" if partial else "full",
        train_layers=a.layers if partial else None,
        steps=a.steps,
        batch_size=a.batch_size,
        learning_rate=a.lr,
        learning_rate_mapping={CE_HEAD_PARAMETERS: a.head_lr},
    )
    os.makedirs(a.out_dir, exist_ok=True)
    curve = DevCurve(a.every, evaluate, path=os.path.join(a.out_dir, f"{a.name}.json"))
    state = os.path.join(out, "cache", f"states-minilm-128-top{a.layers}") if partial else None
    fine_tune(model, loss, rows, recipe, callbacks=[curve], state_cache=state, show_progress=True, desc=a.name)
    with open(os.path.join(a.out_dir, f"{a.name}.json"), encoding="utf8") as f:
        saved = json.load(f)
    saved.update(bm25_dev_nDCG10=bm25_dev, settings=vars(a), command="python " + shlex.join(sys.argv))
    saved["fusion_with_bm25"] = fusion  # one entry per evaluation, in the order of "points"
    if a.save_model:
        model.save(os.path.join(a.out_dir, f"{a.name}.model"))
    with open(os.path.join(a.out_dir, f"{a.name}.json"), "w", encoding="utf8") as f:
        json.dump(saved, f, indent=1)
    print(a.name, [(p["step"], round(p["dev"], 4)) for p in curve.points], "BM25", round(bm25_dev, 4), flush=True)


def references(a: argparse.Namespace) -> None:
    """The references on the probes' dev queries and candidates: BM25's order and the untrained MiniLM bi-encoder
    (cosine of its normalised embeddings, 128 tokens) re-ranking BM25's top 20."""
    import numpy as np
    from pyterrier_pisa import PisaIndex
    from sentence_transformers import SentenceTransformer

    from pyterrier_prob.collections import load_collection
    from pyterrier_prob.varce import per_query
    from pyterrier_prob.varce.data import evaluated_queries as _eval_queries
    from st_extensions import default_model_path

    coll = load_collection("irds:beir/nfcorpus")
    topics, qrels, _ = _eval_queries(coll.topics("dev"), coll.qrels("dev"), 50, 0)
    bm25 = PisaIndex(os.path.join(a.experiment_output, "indexes", "bm25-beir-nfcorpus.pisa"), text_field="text")
    cand = bm25.bm25(num_results=20)(topics)
    out = {"BM25": float(per_query(cand, qrels, "nDCG@10", topics=topics).mean())}
    texts = coll.doc_texts(set(cand["docno"]))
    model = SentenceTransformer(default_model_path(), device="cpu")
    model.max_seq_length = 128
    q = model.encode(list(cand["query"]), normalize_embeddings=True, batch_size=64)
    d = model.encode(list(cand["docno"].map(texts)), normalize_embeddings=True, batch_size=64)
    run = cand[["qid", "docno"]].assign(score=np.sum(q * d, axis=1).astype(np.float64))
    out["untrained MiniLM bi-encoder"] = float(per_query(run, qrels, "nDCG@10", topics=topics).mean())
    out["command"] = "python " + shlex.join(sys.argv)
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, "references.json"), "w", encoding="utf8") as f:
        json.dump(out, f, indent=1)
    print(out)


def table(a: argparse.Namespace) -> None:
    rows, refs = [], None
    for path in sorted(glob.glob(os.path.join(a.out_dir, "*.json"))):
        with open(path, encoding="utf8") as f:
            c = json.load(f)
        if os.path.basename(path) == "references.json":
            refs = c
        else:
            rows.append({"name": os.path.basename(path)[:-5], **c})
    result = {
        "benchmark": "cross-encoder recipe probes: dev nDCG@10 of 50 nfcorpus/dev queries, BM25 top 20 re-ranked",
        "references": refs,
        "probes": rows,
    }
    with open(a.table, "w", encoding="utf8") as f:
        json.dump(result, f, indent=1)
    for r in rows:
        best = r.get("best") or {}
        print(f"{r['name']}: best dev {best.get('dev')} at step {best.get('step')}; BM25 {r.get('bm25_dev_nDCG10')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experiment-output", default="outputs/varce_rerank")
    ap.add_argument("--name", default="bce")
    ap.add_argument("--loss", choices=["bce", "lce", "distill"], default="bce")
    ap.add_argument("--distill-scale", type=float, default=10.0, help="distill: target = scale x bi-encoder cosine")
    ap.add_argument("--lr", type=float, default=1e-4, help="the encoder layers' rate")
    ap.add_argument("--head-lr", type=float, default=1e-3, help="the linear ranker's rate")
    ap.add_argument("--pool", choices=["cls", "mean"], default="cls")
    ap.add_argument("--layers", type=int, default=2, help="top layers that train (6: full fine-tuning)")
    ap.add_argument("--positive-depth", type=int, default=None, help="positives only from the first stages' top k")
    ap.add_argument("--pool-depth", type=int, default=30, help="negatives from the first stages' top k")
    ap.add_argument("--negatives", choices=["mined", "random"], default="mined", help="random: a sanity check")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--save-model", action="store_true", help="save the model of the best dev point into --out-dir")
    ap.add_argument("--out-dir", default="outputs/ce_recipe_probe")
    ap.add_argument("--table", default=None, help="merge the curves in --out-dir into this JSON instead of probing")
    ap.add_argument("--references", action="store_true", help="BM25 and the untrained bi-encoder on the dev queries")
    a = ap.parse_args()
    (table if a.table else references if a.references else probe)(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
