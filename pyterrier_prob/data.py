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
    """The split's query texts by qid, and its (qid, docno) pairs with label >= ``min_relevance`` whose query is a
    topic of the split, in qrels order."""
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
    """(anchor, positive) pairs, one per judged-relevant (query, document) of a split.

    Args:
        source: an ir_datasets split id such as ``"irds:beir/nfcorpus/train"`` (the ``irds:`` prefix is optional),
            or any :class:`~pyterrier_prob.collections.Collection` / collection spec with ``split``.
        split: the split, when ``source`` has more than one.
        max_pairs: keep a seeded random sample of at most this many pairs.
        seed: shuffling seed (the pairs come back shuffled).
        min_relevance: smallest qrel grade counted as relevant.

    Returns:
        A :class:`datasets.Dataset` with columns ``anchor`` (query text), ``positive`` (document text), ``label``
        (``[query key, document key]``, :func:`st_extensions.judged.pair_labels`: the losses mask judged-relevant
        in-batch negatives with it, and :class:`~st_extensions.sampler.QueryBalancedBatchSampler` groups rows by
        query with it) and ``qid`` (for analysis; :func:`~pyterrier_prob.training.fine_tune` drops it). Train with
        ``QueryBalancedBatchSampler`` (``fine_tune`` does): each epoch is one pass over the queries, one row each,
        every query's relevant documents cycled across epochs, the queries of a batch distinct.
    """
    coll, split = _source(source, split)
    queries, qrels = _relevant_pairs(coll, split, min_relevance)
    if not qrels:
        raise ValueError(
            f"{coll.name}/{split} has no relevant (query, document) pairs with relevance >= {min_relevance}"
        )
    random.Random(seed).shuffle(qrels)
    if max_pairs is not None:
        qrels = qrels[:max_pairs]
    docs = coll.doc_texts({doc_id for _, doc_id in qrels})
    rows = [(qid, queries[qid], docs[doc_id]) for qid, doc_id in qrels if doc_id in docs]
    anchors, positives = [r[1] for r in rows], [r[2] for r in rows]
    return Dataset.from_dict(
        {
            "anchor": anchors,
            "positive": positives,
            "label": pair_labels(anchors, positives),
            "qid": [r[0] for r in rows],
        }
    )


def judged_pairs(source: str | Collection, split: str | None = None, min_relevance: int = 1) -> JudgedPairs:
    """Every judged-relevant (query text, document text) pair of a split (label >= ``min_relevance``; by default
    every positive grade, so a document judged relevant at any grade is never an in-batch negative), for the
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
