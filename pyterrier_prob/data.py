"""Training data from ir_datasets collections, as datasets the sentence-transformers trainers take."""

from __future__ import annotations

import random

from datasets import Dataset


def _irds(dataset_id: str):
    import ir_datasets

    return ir_datasets.load(dataset_id.removeprefix("irds:"))


def doc_text(doc) -> str:
    """A document's text as the encoders see it: ``title`` then ``text`` where the collection has both."""
    title = getattr(doc, "title", "") or ""
    text = getattr(doc, "text", "") or ""
    return f"{title}\n{text}".strip() if title else text


def training_pairs(dataset_id: str, max_pairs: int | None = None, seed: int = 0, min_relevance: int = 1) -> Dataset:
    """(anchor, positive) pairs, one per judged-relevant (query, document) of an ir_datasets split.

    Args:
        dataset_id: e.g. ``"irds:beir/nfcorpus/train"`` (the ``irds:`` prefix is optional).
        max_pairs: keep a seeded random sample of at most this many pairs.
        seed: shuffling seed (the pairs come back shuffled).
        min_relevance: smallest qrel grade counted as relevant.

    Returns:
        A :class:`datasets.Dataset` with columns ``anchor`` (query text), ``positive`` (document text)
        and ``qid`` (for analysis; drop it before training). Use ``BatchSamplers.NO_DUPLICATES`` so a query
        with many relevant documents does not meet itself as an in-batch negative.
    """
    ds = _irds(dataset_id)
    queries = {q.query_id: q.text for q in ds.queries_iter()}
    qrels = [(r.query_id, r.doc_id) for r in ds.qrels_iter() if r.relevance >= min_relevance and r.query_id in queries]
    if not qrels:
        raise ValueError(f"{dataset_id} has no relevant (query, document) pairs with relevance >= {min_relevance}")
    random.Random(seed).shuffle(qrels)
    if max_pairs is not None:
        qrels = qrels[:max_pairs]
    store = ds.docs_store()
    docs = store.get_many({doc_id for _, doc_id in qrels})
    rows = [(qid, queries[qid], doc_text(docs[doc_id])) for qid, doc_id in qrels if doc_id in docs]
    return Dataset.from_dict(
        {
            "anchor": [r[1] for r in rows],
            "positive": [r[2] for r in rows],
            "qid": [r[0] for r in rows],
        }
    )


def relevant_counts(dataset_id: str, min_relevance: int = 1) -> dict[str, int]:
    """Number of judged-relevant documents per query of an ir_datasets split."""
    counts: dict[str, int] = {}
    for r in _irds(dataset_id).qrels_iter():
        if r.relevance >= min_relevance:
            counts[r.query_id] = counts.get(r.query_id, 0) + 1
    return counts
