"""Training data from a collection's train split, as datasets the sentence-transformers trainers take."""

from __future__ import annotations

import random

from datasets import Dataset

from pyterrier_prob.collections import Collection, load_collection
from st_extensions.judged import JudgedPairs, pair_labels

__all__ = ["training_pairs", "judged_pairs", "relevant_counts"]


def _source(source: str | Collection, split: str | None) -> tuple[Collection, str]:
    coll = load_collection(source)
    if split is None:
        if len(coll.splits) != 1:
            raise ValueError(f"{coll.name} has splits {list(coll.splits)}: name one (split=...)")
        split = coll.splits[0]
    return coll, split


def _relevant_pairs(coll: Collection, split: str, min_relevance: int) -> tuple[dict, list[tuple[str, str]]]:
    """The split's query texts by qid, and its (qid, docno) pairs with label >= ``min_relevance``, in qrels order."""
    queries = dict(zip(*coll.topics(split)[["qid", "query"]].T.values))
    qrels = coll.qrels(split)[["qid", "docno", "label"]]
    return queries, [(q, d) for q, d, lab in qrels.itertuples(index=False) if lab >= min_relevance and q in queries]


def training_pairs(
    source: str | Collection,
    split: str | None = None,
    max_pairs: int | None = None,
    seed: int = 0,
    min_relevance: int = 1,
) -> Dataset:
    """(anchor, positive) pairs, one per judged-relevant (query, document) of a split, shuffled by ``seed``.

    ``source``: an ir_datasets split id (``"irds:beir/nfcorpus/train"``) or a collection with ``split``. Columns
    ``anchor``, ``positive``, ``label`` (:func:`st_extensions.judged.pair_labels`: the losses mask judged in-batch
    negatives and the query-balanced sampler groups rows by it) and ``qid`` (dropped by ``fine_tune``)."""
    coll, split = _source(source, split)
    queries, qrels = _relevant_pairs(coll, split, min_relevance)
    if not qrels:
        raise ValueError(
            f"{coll.name}/{split} has no relevant (query, document) pairs with relevance >= {min_relevance}"
        )
    random.Random(seed).shuffle(qrels)
    qrels = qrels[:max_pairs]  # all of them for None
    docs = coll.doc_texts({doc_id for _, doc_id in qrels})
    kept = [(qid, doc_id) for qid, doc_id in qrels if doc_id in docs]
    anchors, positives = [queries[q] for q, _ in kept], [docs[d] for _, d in kept]
    labels = pair_labels(anchors, positives)
    return Dataset.from_dict({"anchor": anchors, "positive": positives, "label": labels, "qid": [q for q, _ in kept]})


def judged_pairs(source: str | Collection, split: str | None = None, min_relevance: int = 1) -> JudgedPairs:
    """Every judged-relevant (query text, document text) pair of a split (label >= ``min_relevance``), for the
    ``judged=`` argument of the losses."""
    coll, split = _source(source, split)
    queries, pairs = _relevant_pairs(coll, split, min_relevance)
    docs = coll.doc_texts({d for _, d in pairs})
    return JudgedPairs((queries[q], docs[d]) for q, d in pairs if d in docs)


def relevant_counts(source: str | Collection, split: str | None = None, min_relevance: int = 1) -> dict[str, int]:
    """Number of judged-relevant documents per query of a split."""
    coll, split = _source(source, split)
    q = coll.qrels(split)
    return {str(k): int(v) for k, v in q[q["label"] >= min_relevance].groupby("qid").size().items()}
