"""Training pairs from ir_datasets collections."""

import pytest

from pyterrier_prob.collections import doc_text
from pyterrier_prob.data import relevant_counts, training_pairs


@pytest.mark.slow
def test_training_pairs_nfcorpus_are_judged_relevant():
    import ir_datasets

    pairs = training_pairs("irds:beir/nfcorpus/train", max_pairs=50, seed=3)
    assert len(pairs) == 50 and set(pairs.column_names) == {"anchor", "positive", "label", "qid"}
    ds = ir_datasets.load("beir/nfcorpus/train")
    qrels = {(r.query_id, r.doc_id) for r in ds.qrels_iter() if r.relevance > 0}
    docs = {d.doc_id: doc_text(d.title, d.text) for d in ds.docs_iter()}
    by_text = {}
    for doc_id, text in docs.items():
        by_text.setdefault(text, set()).add(doc_id)
    for row in pairs:
        assert any((row["qid"], doc_id) in qrels for doc_id in by_text[row["positive"]])
    assert training_pairs("irds:beir/nfcorpus/train", max_pairs=50, seed=3)["positive"] == pairs["positive"]
    counts = relevant_counts("irds:beir/nfcorpus/dev")
    assert len(counts) == 324 and sum(counts.values()) == 11385


def test_no_relevant_pairs_is_an_error():
    with pytest.raises(ValueError, match="no relevant"):
        training_pairs("irds:beir/nfcorpus/dev", min_relevance=99)
