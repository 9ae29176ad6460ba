"""Choose the frozen-encoder recipes' learning rates and budgets on nfcorpus train/dev (never test).

Encodes the corpus and the train/dev queries once with all-MiniLM-L6-v2 (cached under ``--output``), then for each
method and learning rate trains the method's own modules on the cached embeddings (``fine_tune`` under
``Recipe(mode="frozen")``, query-balanced batches, judged negatives masked) and scores dev nDCG@10 by brute force
on the cached embeddings, against the untrained model. Prints one line per setting and writes ``recipe_search.json``.

    python benchmarks/recipe_search.py --methods mnrl mol pebr --steps 1000 2000
    python benchmarks/recipe_search.py --methods pebr_mle --lrs 3e-4 --adapter-lrs 0 1e-5 3e-5 1e-4 3e-4

``--adapter-lrs`` sets the pEBR methods' ``LinearAdapter`` rate apart from the head's (``--lrs``): the MLE loss
(pEBR Sec. 3.1) is point-wise and pulls the embedding space towards fitting the two laws rather than ranking.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import ir_measures
import numpy as np
import pandas as pd
import torch

from pyterrier_prob.atomic import atomic_write
from pyterrier_prob.collections import load_collection
from pyterrier_prob.data import judged_pairs, training_pairs
from pyterrier_prob.training import Recipe, fine_tune
from st_extensions import build_mol_model, build_pebr_model
from st_extensions.defaults import default_model_path
from st_extensions.frozen import CachedEmbeddings, build_adapter_model, cached_model, encode_prefix
from st_extensions.losses import BetaMLELoss, BetaNCELoss, MaskedMultipleNegativesRankingLoss, MoLLoss
from st_extensions.mol import find_mol


def dev_ndcg(m, mol: bool, queries: pd.DataFrame, docnos: list[str], doc_texts: list[str], qrels) -> float:
    """dev nDCG@10 of the model ``m`` (brute force over the whole corpus); for a frozen-recipe model pass
    ``cached_model(model, cache=cache)``, which gives the same outputs without running the encoder again."""
    with torch.inference_mode():
        if mol:
            head = find_mol(m)
            q = m.encode_query(list(queries["query"]), output_value=None, convert_to_tensor=False)
            d = m.encode_document(doc_texts, output_value=None, convert_to_tensor=False)
            qc = torch.stack([o["mol_components"] for o in q])
            dc = torch.stack([o["mol_components"] for o in d])
            scores = head.score_all(qc, dc).numpy()
        else:
            q = m.encode_query(list(queries["query"]), convert_to_numpy=True)
            d = m.encode_document(doc_texts, convert_to_numpy=True)
            scores = q @ d.T
    top = np.argsort(-scores, axis=1)[:, :100]
    run = [
        ir_measures.ScoredDoc(str(qid), docnos[j], float(scores[i, j]))
        for i, qid in enumerate(queries["qid"])
        for j in top[i]
    ]
    return ir_measures.calc_aggregate([ir_measures.nDCG @ 10], qrels, run)[ir_measures.nDCG @ 10]


def dev_law_fit(m, family: str, queries: pd.DataFrame, docnos: list[str], doc_texts: list[str], qrels) -> dict:
    """How well the head's own relevant-item law describes dev's relevant cosines: mean log density (nats per
    relevant pair, query-weighted) and the KS distance of their PIT values from uniform."""
    from pyterrier_prob.pebr.calibration import mean_log_density, model_law, pit_summary, pit_values, query_weights

    with torch.inference_mode():
        out = m.encode_query(list(queries["query"]), output_value=None)
        q = torch.stack([o["sentence_embedding"] for o in out]).numpy()
        params = torch.stack([o["query_distribution"] for o in out]).numpy()
        d = m.encode_document(doc_texts, convert_to_numpy=True)
    row = {docno: i for i, docno in enumerate(docnos)}
    rel = qrels[qrels["relevance"] > 0]
    lists = [
        q[i] @ d[[row[x] for x in rel.loc[rel["query_id"] == qid, "doc_id"] if x in row]].T
        for i, qid in enumerate(queries["qid"])
    ]
    keep = np.array([c.size > 0 for c in lists])
    law = model_law(params[keep], family)
    lists = [c for c in lists if c.size]
    pit = pit_values(law, lists)
    return {
        "dev_rel_log_density": mean_log_density(law, lists),
        "dev_pit_ks": pit_summary(pit, weights=query_weights(lists))["ks_statistic"],
    }


def dev_setup(dataset: str) -> dict:
    """Train pairs, judged pairs, dev topics and qrels (ir_measures columns), the corpus' docnos and texts."""
    coll = load_collection(dataset)
    dev_qrels = coll.qrels("dev").rename(columns={"qid": "query_id", "docno": "doc_id", "label": "relevance"})
    dev_qrels = dev_qrels.assign(query_id=dev_qrels["query_id"].astype(str), doc_id=dev_qrels["doc_id"].astype(str))
    corpus = list(coll.corpus_iter())
    return {
        "train": training_pairs(coll, "train"),
        "judged": judged_pairs(coll, "train"),
        "dev": coll.topics("dev"),
        "dev_qrels": dev_qrels,
        "docnos": [d["docno"] for d in corpus],
        "doc_texts": [d["text"] for d in corpus],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="irds:beir/nfcorpus")
    ap.add_argument("--methods", nargs="+", default=["mnrl", "mol", "pebr"], help="mnrl, mol, pebr, pebr_mle")
    ap.add_argument("--lrs", nargs="+", type=float, default=[1e-4, 3e-4, 1e-3, 3e-3])
    ap.add_argument("--steps", nargs="+", type=int, default=[1000])
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument(
        "--adapter-lrs", nargs="+", type=float, default=None, help="pEBR methods: the adapter's rates (default: --lrs)"
    )
    ap.add_argument("--output", default="outputs/recipe_search")
    args = ap.parse_args()
    os.makedirs(args.output, exist_ok=True)
    setup = dev_setup(args.dataset)
    train, judged, dev, dev_qrels = setup["train"], setup["judged"], setup["dev"], setup["dev_qrels"]
    docnos, doc_texts = setup["docnos"], setup["doc_texts"]

    base = build_adapter_model(default_model_path())
    texts = list(dict.fromkeys([*train["anchor"], *train["positive"], *dev["query"], *doc_texts]))
    t0 = time.time()
    cache_file = os.path.join(args.output, "encoder_cache.safetensors")
    if os.path.exists(cache_file):
        cache = CachedEmbeddings.load_cache(cache_file)
    else:
        cache = CachedEmbeddings(texts, encode_prefix(base, texts, batch_size=64, show_progress_bar=True))
        cache.save_cache(cache_file)
    encode_s = time.time() - t0
    results = {"encode_seconds": encode_s, "texts": len(texts), "runs": []}
    results["untrained"] = dev_ndcg(cached_model(base, cache=cache), False, dev, docnos, doc_texts, dev_qrels)
    print(f"encoded {len(texts)} texts in {encode_s:.0f}s; untrained dev nDCG@10 {results['untrained']:.4f}")
    grid = [
        (method, steps, lr, adapter_lr)
        for method in args.methods
        for steps in args.steps
        for lr in args.lrs
        for adapter_lr in (args.adapter_lrs if args.adapter_lrs and method.startswith("pebr") else [None])
    ]
    for method, steps, lr, adapter_lr in grid:
        torch.manual_seed(0)
        if method == "mnrl":
            model = build_adapter_model(default_model_path())
            loss = MaskedMultipleNegativesRankingLoss(model, judged=judged)
        elif method == "mol":
            model = build_mol_model(default_model_path(), component_source="heads", head_init="identity")
            loss = MoLLoss(model, judged=judged)
        elif method == "pebr":
            model = build_pebr_model(default_model_path(), family="beta", projection=True)
            loss = BetaNCELoss(model, judged=judged)
        elif method == "pebr_mle":
            model = build_pebr_model(default_model_path(), family="beta_mle", projection=True)
            loss = BetaMLELoss(model, judged=judged)
        else:
            raise SystemExit(f"unknown method {method!r}")
        t0 = time.time()
        losses = fine_tune(
            model,
            loss,
            train,
            Recipe(
                mode="frozen",
                steps=steps,
                batch_size=args.batch_size,
                head_learning_rate=lr,
                module_learning_rates={} if adapter_lr is None else {"LinearAdapter": adapter_lr},
            ),
            encoder_cache=cache,
            show_progress=False,
        )
        secs = time.time() - t0
        law = {}
        if method.startswith("pebr"):
            fam = "beta_mle" if method == "pebr_mle" else "beta"
            law = dev_law_fit(cached_model(model, cache=cache), fam, dev, docnos, doc_texts, dev_qrels)
        ndcg = dev_ndcg(cached_model(model, cache=cache), method == "mol", dev, docnos, doc_texts, dev_qrels)
        row = {
            "method": method,
            "steps": steps,
            "lr": lr,
            **({} if adapter_lr is None else {"adapter_lr": adapter_lr}),
            "dev_ndcg10": ndcg,
            **law,
            "seconds": secs,
            "loss_first10": float(np.mean(losses[:10])),
            "loss_last10": float(np.mean(losses[-10:])),
        }
        results["runs"].append(row)
        print(json.dumps(row), flush=True)
        atomic_write(os.path.join(args.output, "recipe_search.json"), json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
