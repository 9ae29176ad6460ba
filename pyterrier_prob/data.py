"""Training data from a collection's train split, as datasets the sentence-transformers trainers take."""

from __future__ import annotations

import random

from datasets import Dataset

from pyterrier_prob.collections import Collection, load_collection

__all__ = ["training_pairs", "relevant_counts"]


def _source(source: str | Collection, split: str | None) -> tuple[Collection, str]:
    coll = load_collection(source)
    if split is None:
        if len(coll.splits) != 1:
            raise ValueError(f"{coll.name} has splits {list(coll.splits)}: name one (split=...)")
        split = coll.splits[0]
    return coll, split


def training_pairs(
    source: str | Collection,
    split: str | None = None,
    max_pairs: int | None = None,
    seed: int = 0,
    min_relevance: int = 1,
) -> Dataset:
    """(anchor, positive) pairs, one per judged-relevant (query, document) of a split.

    Args:
        source: an ir_datasets split id such as ``"irds:beir/nfcorpus/train"`` (the ``irds:`` prefix is optional),
            or any :class:`~pyterrier_prob.collections.Collection` / collection spec with ``split``.
        split: the split, when ``source`` has more than one.
        max_pairs: keep a seeded random sample of at most this many pairs.
        seed: shuffling seed (the pairs come back shuffled).
        min_relevance: smallest qrel grade counted as relevant.

    Returns:
        A :class:`datasets.Dataset` with columns ``anchor`` (query text), ``positive`` (document text)
        and ``qid`` (for analysis; drop it before training). Use ``BatchSamplers.NO_DUPLICATES`` so a query
        with many relevant documents does not meet itself as an in-batch negative.
    """
    coll, split = _source(source, split)
    queries = dict(zip(*coll.topics(split)[["qid", "query"]].T.values))
    qrels = coll.qrels(split)
    qrels = [
        (q, d)
        for q, d, lab in qrels[["qid", "docno", "label"]].itertuples(index=False)
        if lab >= min_relevance and q in queries
    ]
    if not qrels:
        raise ValueError(
            f"{coll.name}/{split} has no relevant (query, document) pairs with relevance >= {min_relevance}"
        )
    random.Random(seed).shuffle(qrels)
    if max_pairs is not None:
        qrels = qrels[:max_pairs]
    docs = coll.doc_texts({doc_id for _, doc_id in qrels})
    rows = [(qid, queries[qid], docs[doc_id]) for qid, doc_id in qrels if doc_id in docs]
    return Dataset.from_dict(
        {
            "anchor": [r[1] for r in rows],
            "positive": [r[2] for r in rows],
            "qid": [r[0] for r in rows],
        }
    )


def relevant_counts(source: str | Collection, split: str | None = None, min_relevance: int = 1) -> dict[str, int]:
    """Number of judged-relevant documents per query of a split."""
    coll, split = _source(source, split)
    q = coll.qrels(split)
    return {str(k): int(v) for k, v in q[q["label"] >= min_relevance].groupby("qid").size().items()}
