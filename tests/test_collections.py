"""Collections from ir_datasets ids, BEIR folders and TREC folders; split discovery; the seeded no-dev split."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from pyterrier_prob.collections import (
    BeirCollection,
    HeldOutCollection,
    IrdsCollection,
    TrecCollection,
    choose_splits,
    load_collection,
    source_splits,
    split_topics,
)

DOCS = [
    {"_id": "d1", "title": "Statins", "text": "Statins lower cholesterol."},
    {"_id": "d2", "title": "", "text": "Breast cancer screening."},
    {"_id": "d3", "text": "Vitamin D and bones."},
    {"_id": "d4", "title": "Coffee", "text": "Coffee and sleep."},
    {"_id": "d5", "title": "Exercise", "text": "Exercise and the heart."},
]


def _write_beir(folder, splits: dict[str, list[tuple[str, str, int]]], queries: dict[str, str]) -> None:
    (folder / "qrels").mkdir(parents=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / "queries.jsonl").write_text("".join(json.dumps({"_id": q, "text": t}) + "\n" for q, t in queries.items()))
    for split, rows in splits.items():
        lines = ["query-id\tcorpus-id\tscore"] + [f"{q}\t{d}\t{s}" for q, d, s in rows]
        (folder / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n")


QUERIES = {"q1": "statins", "q2": "cancer", "q3": "vitamin d", "q4": "coffee", "q5": "unjudged query"}


@pytest.fixture
def beir(tmp_path):
    folder = tmp_path / "beir"
    _write_beir(
        folder,
        {
            "train": [("q1", "d1", 2), ("q1", "d2", 0), ("q2", "d2", 1)],
            "test": [("q3", "d3", 1), ("q4", "d4", 1), ("q4", "d5", 1)],
        },
        QUERIES,
    )
    return folder


def test_beir_folder_loads_with_the_right_counts(beir):
    c = load_collection(beir)
    assert isinstance(c, BeirCollection) and c.splits == ("test", "train")
    docs = list(c.corpus_iter())
    assert [d["docno"] for d in docs] == ["d1", "d2", "d3", "d4", "d5"] and c.num_docs == 5
    assert docs[0]["text"] == "Statins\nStatins lower cholesterol." and docs[1]["text"] == "Breast cancer screening."
    train = c.topics("train")
    assert train.to_dict("list") == {"qid": ["q1", "q2"], "query": ["statins", "cancer"]}  # only judged queries
    assert len(c.topics("test")) == 2 and len(c.qrels("test")) == 3
    q = c.qrels("train")
    assert list(q.columns) == ["qid", "docno", "label"] and q["label"].tolist() == [2, 0, 1]
    assert c.doc_texts(["d4", "nope"]) == {"d4": "Coffee\nCoffee and sleep."}
    with pytest.raises(ValueError, match="split must be one of 'test', 'train'; got 'dev'"):
        c.topics("dev")


def test_beir_errors_name_the_file_and_line(tmp_path):
    folder = tmp_path / "bad"
    _write_beir(folder, {"test": [("q1", "d1", 1)]}, QUERIES)
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\tx\n")
    with pytest.raises(ValueError, match=r"test\.tsv, line 2"):
        load_collection(folder).qrels("test")
    (folder / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq9\td1\t1\n")
    with pytest.raises(ValueError, match="missing from queries.jsonl"):
        load_collection(folder).topics("test")
    (folder / "corpus.jsonl").write_text('{"_id": "d1", "text": "ok"}\n{not json\n')
    with pytest.raises(ValueError, match=r"corpus\.jsonl, line 2: not valid JSON"):
        list(load_collection(folder).corpus_iter())
    (folder / "qrels" / "test.tsv").unlink()
    with pytest.raises(ValueError, match="no qrels/<split>.tsv"):
        load_collection(folder)


TREC_TOPICS = """<top>
<num> Number: 301
<title> statins cholesterol
<desc> Description:
ignored
</top>
<top>
<num> Number: 302
<title> breast cancer
</top>
"""


def test_trec_folder_loads_with_the_right_counts(tmp_path):
    folder = tmp_path / "trec"
    folder.mkdir()
    (folder / "topics.test.txt").write_text(TREC_TOPICS)
    (folder / "qrels.test.txt").write_text("301 0 d1 1\n301 0 d2 0\n302 0 d2 2\n")
    (folder / "queries.train.tsv").write_text("t1\tvitamin d\nt2\tcoffee sleep\nt3\texercise\n")
    (folder / "train.qrels").write_text("t1 0 d3 1\nt2 0 d4 1\nt3 0 d5 1\n")
    (folder / "docs.tsv").write_text("docno\ttext\n" + "".join(f"{d['_id']}\t{d['text']}\n" for d in DOCS))
    c = load_collection(folder)
    assert isinstance(c, TrecCollection) and c.splits == ("test", "train")
    assert c.topics("test").to_dict("list") == {
        "qid": ["301", "302"],
        "query": ["statins cholesterol", "breast cancer"],
    }
    assert len(c.qrels("test")) == 3 and c.qrels("test")["label"].tolist() == [1, 0, 2]
    assert len(c.topics("train")) == 3 and len(c.qrels("train")) == 3
    assert c.num_docs == 5 and next(iter(c.corpus_iter())) == {"docno": "d1", "text": "Statins lower cholesterol."}
    ch = choose_splits(c)
    assert (ch.train, ch.dev, ch.test) == ("train", None, "test")


def test_trec_folder_single_split_and_jsonl_corpus(tmp_path):
    folder = tmp_path / "trec1"
    folder.mkdir()
    (folder / "topics.xml").write_text(
        '<topics><topic number="7"><query>coffee</query></topic><topic number="8"><query>heart</query></topic></topics>'
    )
    (folder / "qrels").write_text("7 0 d4 1\n8 0 d5 1\n")
    (folder / "corpus.jsonl").write_text(
        "".join(json.dumps({"docno": d["_id"], "text": d["text"]}) + "\n" for d in DOCS)
    )
    c = load_collection(folder)
    assert c.splits == ("test",) and c.topics("test")["qid"].tolist() == ["7", "8"]
    assert c.topics("test")["query"].tolist() == ["coffee", "heart"]
    ch = choose_splits(c)
    assert (ch.train, ch.dev, ch.test) == (None, None, "test")


def test_trec_folder_errors(tmp_path):
    folder = tmp_path / "trec2"
    folder.mkdir()
    (folder / "topics.test.tsv").write_text("1\tq\n")
    with pytest.raises(ValueError, match="no corpus"):
        TrecCollection(folder)
    (folder / "docs.tsv").write_text("d1\ttext\n")
    with pytest.raises(ValueError, match="no split has both a topics file"):
        TrecCollection(folder)
    (folder / "qrels.test.txt").write_text("1 0 d1\n")
    with pytest.raises(ValueError, match=r"qrels\.test\.txt, line 1: expected 'qid iter docno label'"):
        TrecCollection(folder).qrels("test")
    (folder / "qrels.dev.txt").write_text("1 0 d1 1\n")
    with pytest.raises(ValueError, match="split 'dev' has a qrels file but no topics file"):
        TrecCollection(folder)


@pytest.mark.slow
def test_irds_splits_are_discovered():
    nf = load_collection("irds:beir/nfcorpus")
    assert isinstance(nf, IrdsCollection) and set(nf.splits) == {"train", "dev", "test"}
    assert len(nf.topics("test")) == 323 and nf.num_docs == 3633
    sf = load_collection("beir/scifact")
    assert set(sf.splits) == {"train", "test"}
    ch = choose_splits(sf)
    assert (ch.train, ch.dev, ch.test) == ("train", None, "test")
    cran = load_collection("irds:cranfield")
    assert cran.splits == ("test",) and len(cran.topics("test")) == 225
    one = load_collection("irds:beir/nfcorpus/dev")
    assert one.splits == ("dev",) and len(one.topics("dev")) == 324 and one.num_docs == 3633
    with pytest.raises(ValueError, match="unknown ir_datasets id"):
        load_collection("irds:no/such/thing")


def test_no_dev_split_is_seeded_and_disjoint():
    topics = pd.DataFrame({"qid": [f"q{i}" for i in range(101)], "query": [f"text {i}" for i in range(101)]})
    cal, ev = split_topics(topics, seed=3)
    assert len(cal) == 50 and len(ev) == 51
    assert not set(cal["qid"]) & set(ev["qid"]) and set(cal["qid"]) | set(ev["qid"]) == set(topics["qid"])
    cal2, ev2 = split_topics(topics, seed=3)
    pd.testing.assert_frame_equal(cal, cal2)
    pd.testing.assert_frame_equal(ev, ev2)
    cal3, _ = split_topics(topics, seed=4)
    assert set(cal3["qid"]) != set(cal["qid"])
    assert list(cal["qid"]) == sorted(cal["qid"], key=lambda q: int(q[1:]))  # input order kept
    with pytest.raises(ValueError, match="at least 2 queries"):
        split_topics(topics.head(1))


def test_held_out_dev_divides_train_and_keeps_the_rest(beir, tmp_path):
    """The held-out dev split and the fit split partition train's queries and qrels; test and corpus pass through."""
    base = load_collection(beir)
    held = HeldOutCollection(base, "train", fraction=0.5, seed=0)
    assert held.splits == ("test", "train-fit", "train-dev") and held.name == base.name and held.num_docs == 5
    fit, dev = held.topics("train-fit"), held.topics("train-dev")
    assert len(fit) == len(dev) == 1 and {*fit["qid"], *dev["qid"]} == {"q1", "q2"}
    for split, topics in (("train-fit", fit), ("train-dev", dev)):
        want = base.qrels("train")[lambda q, t=topics: q["qid"].isin(t["qid"])].reset_index(drop=True)
        pd.testing.assert_frame_equal(held.qrels(split), want)
    pd.testing.assert_frame_equal(held.qrels("test"), base.qrels("test"))
    assert list(held.corpus_iter()) == list(base.corpus_iter()) and held.doc_texts(["d3"]) == {
        "d3": "Vitamin D and bones."
    }
    with pytest.raises(ValueError, match="split must be one of .*; got 'train'"):
        held.topics("train")
    _write_beir(tmp_path / "one", {"train": [("q1", "d1", 1)], "test": [("q3", "d3", 1)]}, QUERIES)
    with pytest.raises(ValueError, match="has 1 query: too few to hold out"):
        HeldOutCollection(load_collection(tmp_path / "one"), "train")
    with pytest.raises(ValueError, match=r"in \(0, 1\)"):
        HeldOutCollection(base, "train", fraction=1.0)
    nf = HeldOutCollection(load_collection("irds:beir/scifact"), "train", fraction=0.25, seed=0)
    n_fit, n_dev = len(nf.topics("train-fit")), len(nf.topics("train-dev"))
    assert n_dev == round(0.25 * 809) and n_fit + n_dev == 809
    assert not set(nf.qrels("train-fit")["qid"]) & set(nf.qrels("train-dev")["qid"])


def test_choose_splits_explicit_and_errors(beir):
    c = load_collection(beir)
    assert choose_splits(c, test="train").test == "train"
    with pytest.raises(ValueError, match="--dev-split 'validation'"):
        choose_splits(c, dev="validation")
    with pytest.raises(ValueError, match="must differ"):
        choose_splits(c, train="train", test="train")
    assert source_splits(c) == ("train", None)


def test_harness_holds_out_train_queries_as_dev(beir, tmp_path):
    """With train and no dev split, a calibrating experiment calibrates on held-out train queries, trains on the
    rest and reports every test query; ``--dev-from-train 0`` and non-calibrating experiments keep the old splits."""
    from pyterrier_prob.experiments.harness import CommonConfig, Harness

    def data(calibrate: bool = True, **kw):
        return Harness("t", CommonConfig(dataset=str(beir), output=str(tmp_path / "o"), quiet=True, **kw)).load_data(
            calibrate
        )

    d = data(dev_from_train=0.5)
    assert (d.train, d.dev, d.test) == ("train-fit", "train-dev", "test")
    assert isinstance(d.train_collection, HeldOutCollection) and d.test_collection is d.train_collection
    assert set(d.cal_topics["qid"]) | set(d.train_collection.topics("train-fit")["qid"]) == {"q1", "q2"}
    assert set(d.test_topics["qid"]) == {"q3", "q4"} and d.cal_source.endswith("/train-dev")
    assert any("held out as train-dev" in n for n in d.notes)
    half = data(dev_from_train=0)
    assert half.train == "train" and half.dev is None and len(half.cal_topics) == len(half.test_topics) == 1
    plain = data(calibrate=False)
    assert plain.train == "train" and plain.cal_topics.empty and len(plain.test_topics) == 2
    with pytest.raises(ValueError, match="--dev-from-train"):
        data(dev_from_train=1.0)


def test_write_beir_sample_round_trips_through_load_collection(tmp_path):
    """The folder loads back as a BEIR collection with the counts it reports; the i-th query of a split keeps up to
    ``1 + i % docs_per_query`` of its relevant documents (all labelled 1, all in the corpus); bad sizes are refused."""
    import ir_datasets

    from pyterrier_prob.collections import write_beir_sample

    info = write_beir_sample(tmp_path / "s", {"train": 5, "test": 4}, docs_per_query=3, extra_docs=7, seed=1)
    c = load_collection(str(tmp_path / "s"))
    assert set(c.splits) >= {"train", "test"}
    docnos = {d["docno"] for d in c.corpus_iter()}
    assert len(docnos) == info["docs"]
    for split, n in (("train", 5), ("test", 4)):
        qrels = c.qrels(split)
        assert info["queries"][split] == n == c.topics(split)["qid"].nunique()
        assert info["qrels"][split] == len(qrels) and set(qrels["label"]) == {1} and set(qrels["docno"]) <= docnos
        relevant = {}
        for r in ir_datasets.load(f"beir/nfcorpus/{split}").qrels_iter():
            if r.relevance >= 1:
                relevant.setdefault(r.query_id, set()).add(r.doc_id)
        kept = qrels.groupby("qid")["docno"].apply(set)
        for i, qid in enumerate(sorted(kept.index)):
            assert kept[qid] == set(sorted(relevant[qid])[: 1 + i % 3])
    judged = set().union(*(set(c.qrels(s)["docno"]) for s in ("train", "test")))
    assert len(docnos - judged) == 7
    with pytest.raises(ValueError, match="docs_per_query"):
        write_beir_sample(tmp_path / "bad", {"test": 1}, docs_per_query=0)
