"""Encoders, the dense index and the variable-depth retrievers (pEBR Sec. 4.1.2, Appendix A).

Retrieval is checked against brute force (float64 cosines of random unit vectors); thresholds of the CDF
cutoff against the distributions of st_extensions and, for BetaNCE, the closed form t = 2 (1 - p)^tau - 1.
"""

import json
import os
import warnings

import numpy as np
import pandas as pd
import pyterrier as pt
import pytest
from pyterrier_dr import FlexIndex

import pyterrier_prob
from pyterrier_prob import (
    CDFCutoffRetriever,
    DenseIndex,
    ProbBiEncoder,
    ScoreCutoffRetriever,
    TopKRetriever,
    count_above,
    threshold_search,
)
from pyterrier_prob.evaluation import calibrate_mean_k
from pyterrier_prob.validation import EmptyRetrievalWarning
from st_extensions import BetaCosine, ExpCosine, build_pebr_model, encode_queries

N, DIM, NQ = 2000, 32, 20
EPS = 1e-5  # float32 scoring vs float64 brute force: documents this close to a threshold may go either way


def unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    docs = unit(rng.standard_normal((N, DIM))).astype(np.float32)
    queries = unit(docs[rng.choice(N, NQ, replace=False)] + 1.5 * rng.standard_normal((NQ, DIM)) / np.sqrt(DIM))
    queries = queries.astype(np.float32)
    cos = queries.astype(np.float64) @ docs.astype(np.float64).T
    return {"docs": docs, "queries": queries, "cos": cos, "docnos": np.array([f"d{i}" for i in range(N)])}


@pytest.fixture(scope="module")
def index(data, tmp_path_factory):
    path = tmp_path_factory.mktemp("idx") / "docs.flex"
    return DenseIndex(path).index(pd.DataFrame({"docno": data["docnos"], "doc_vec": list(data["docs"])}))


def query_frame(data, **cols):
    return pd.DataFrame(
        {"qid": [f"q{i}" for i in range(NQ)], "query": "text", "query_vec": list(data["queries"]), **cols}
    )


def check_against_brute_force(out, data, thresholds, k=None, candidates=None):
    """Each query's rows are the documents with cos >= t (restricted to candidates), best first, capped at k."""
    assert {"qid", "docno", "score", "rank", "query_vec"} <= set(out.columns)
    depths = []
    for i in range(NQ):
        rows = out[out["qid"] == f"q{i}"]
        np.testing.assert_array_equal(rows["rank"].to_numpy(), np.arange(len(rows)))
        got = np.array([int(d[1:]) for d in rows["docno"]], dtype=np.int64)
        cos = data["cos"][i]
        pool = np.arange(N) if candidates is None else candidates[i]
        ranked = pool[np.argsort(-cos[pool], kind="stable")]
        lo, hi = int((cos[pool] >= thresholds[i] + EPS).sum()), int((cos[pool] >= thresholds[i] - EPS).sum())
        if k is not None:
            lo, hi = min(lo, k), min(hi, k)
        assert lo <= len(got) <= hi, (i, len(got), lo, hi)
        np.testing.assert_array_equal(got, ranked[: len(got)])
        np.testing.assert_allclose(rows["score"].to_numpy(), cos[got], atol=EPS)
        depths.append(len(got))
    return np.array(depths)


# ---- the CDF cutoff (pEBR) ---------------------------------------------------------------------------------

CASES = [  # family, dim, parameter columns (as functions of an rng)
    ("beta", None, lambda r: {"query_temp": np.exp(r.uniform(np.log(0.3), np.log(1.2), NQ))}),
    ("exp", None, lambda r: {"query_temp": np.exp(r.uniform(np.log(1.0), np.log(5.0), NQ))}),
    ("beta", DIM, lambda r: {"query_temp": np.exp(r.uniform(np.log(0.02), np.log(0.2), NQ))}),
    ("exp", DIM, lambda r: {"query_temp": np.exp(r.uniform(np.log(0.02), np.log(0.2), NQ))}),
    ("beta_mle", None, lambda r: {"query_alpha": r.uniform(1.5, 6, NQ), "query_beta": r.uniform(1, 3, NQ)}),
    ("beta_mle", DIM, lambda r: {"query_alpha": r.uniform(15, 60, NQ), "query_beta": r.uniform(1, 3, NQ)}),
]


def expected_thresholds(family, dim, cols, p):
    if family == "exp":
        return ExpCosine(cols["query_temp"], dim=dim).cutoff(p)
    if family == "beta":
        return BetaCosine(1 / cols["query_temp"], 1.0, dim=dim).cutoff(p)
    return BetaCosine(cols["query_alpha"], cols["query_beta"], dim=dim).cutoff(p)


@pytest.mark.parametrize("family,dim,make", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_cdf_cutoff_equals_brute_force(data, index, family, dim, make):
    cols = make(np.random.default_rng(2))
    if family == "beta_mle":  # the law of the other items is carried along but not used by the cutoff
        cols = {**cols, "query_alpha_neg": np.ones(NQ), "query_beta_neg": np.ones(NQ)}
    retriever = CDFCutoffRetriever(index, p=0.5, family=family, dim=dim, num_results=None)
    out = retriever(query_frame(data, **cols))
    t = expected_thresholds(family, dim, cols, 0.5)
    np.testing.assert_allclose(retriever._thresholds(pd.DataFrame(cols)), t)
    depths = check_against_brute_force(out, data, t)
    assert len(set(depths)) >= 8 and depths.max() >= 40  # the depth is the query's own
    assert set(out.columns) >= set(cols)  # query columns carried into the result


@pytest.mark.filterwarnings("ignore::pyterrier_prob.validation.EmptyRetrievalWarning")  # p = 0.2: 19 of 20 empty
def test_beta_cutoff_closed_form_and_p(data, index):
    tau = np.exp(np.random.default_rng(3).uniform(np.log(0.3), np.log(1.2), NQ))
    frame = query_frame(data, query_temp=tau)
    for p in (0.2, 0.8):
        t = 2 * (1 - p) ** tau - 1  # BetaNCE, alpha = 1/tau, beta = 1 (Eq. 3): F(t) = ((1 + t) / 2)^alpha
        check_against_brute_force(CDFCutoffRetriever(index, p=p, num_results=None)(frame), data, t)
    low = CDFCutoffRetriever(index, p=0.2, num_results=None)(frame)
    high = CDFCutoffRetriever(index, p=0.8, num_results=None)(frame)
    assert len(high) > len(low)  # larger p, lower thresholds, deeper lists


def test_num_results_cap_keeps_the_best(data, index):
    tau = np.exp(np.random.default_rng(3).uniform(np.log(0.3), np.log(1.2), NQ))
    frame = query_frame(data, query_temp=tau)
    t = 2 * 0.5**tau - 1
    full = CDFCutoffRetriever(index, p=0.5, num_results=None)(frame)
    capped = CDFCutoffRetriever(index, p=0.5, num_results=25)(frame)
    check_against_brute_force(capped, data, t, k=25)
    assert capped.groupby("qid").size().max() == 25 and full.groupby("qid").size().max() > 25
    head = full[full["rank"] < 25].reset_index(drop=True)
    pd.testing.assert_frame_equal(capped.drop(columns="query_vec"), head.drop(columns="query_vec"))


# ---- DSSM-score, DSSM-topk -----------------------------------------------------------------------------------


@pytest.mark.parametrize("threshold,k", [(0.25, None), (0.1, 30), (-2.0, 7)])
def test_score_cutoff_equals_brute_force(data, index, threshold, k):
    out = ScoreCutoffRetriever(index, threshold=threshold, num_results=k)(query_frame(data))
    check_against_brute_force(out, data, np.full(NQ, threshold), k=k)


@pytest.mark.parametrize("k", [1, 10, 1500, 5000])
def test_topk_equals_brute_force_and_pyterrier_dr(data, index, k):
    out = TopKRetriever(index, num_results=k)(query_frame(data))
    depths = check_against_brute_force(out, data, np.full(NQ, -np.inf), k=k)
    assert (depths == min(k, N)).all()
    if k == 10:
        dr = index.np_retriever(num_results=k)(query_frame(data))
        assert (dr["docno"].to_numpy() == out["docno"].to_numpy()).all()


def test_threshold_search_and_count_above(data, index):
    rng = np.random.default_rng(4)
    t = rng.uniform(0.1, 0.5, NQ)
    counts = count_above(index, data["queries"], t, doc_batch_size=300)
    lo, hi = (data["cos"] >= t[:, None] + EPS).sum(1), (data["cos"] >= t[:, None] - EPS).sum(1)
    assert ((lo <= counts) & (counts <= hi)).all() and len(set(counts)) > 5
    # small blocks and chunks exercise the per-chunk threshold raising and the cross-chunk pruning
    for k in (None, 3, 40):
        hits = threshold_search(index, data["queries"], t, k, batch_size=7, doc_batch_size=250)
        np.testing.assert_array_equal(hits.counts, counts if k is None else np.minimum(counts, k))
        for i in range(NQ):
            got = hits.docids[hits.offsets[i] : hits.offsets[i + 1]]
            np.testing.assert_array_equal(got, np.argsort(-data["cos"][i], kind="stable")[: len(got)])
    hits = threshold_search(index, data["queries"], -np.inf, 5, doc_batch_size=250)
    assert (hits.counts == 5).all()


def test_threshold_search_adversarial_order(data, tmp_path, monkeypatch):
    """The best documents of query 0 all sit in the last chunk: thresholds raised on earlier chunks must not cut
    them, and pruning across chunks (forced by a tiny budget) must keep each query's best k."""
    from pyterrier_prob.index import exact as cutoff

    order = np.argsort(data["cos"][0])  # ascending: query 0's best documents come last
    docs, cos = data["docs"][order], data["cos"][:, order]
    index = DenseIndex(tmp_path / "adv").index([{"docno": f"d{i}", "doc_vec": v} for i, v in enumerate(docs)])
    t = np.full(NQ, -0.2)
    for prune in ((cutoff._PRUNE_MIN, cutoff._PRUNE_FACTOR), (0, 1)):
        monkeypatch.setattr(cutoff, "_PRUNE_MIN", prune[0])
        monkeypatch.setattr(cutoff, "_PRUNE_FACTOR", prune[1])
        for k in (3, 40, None):
            for ts in (t, -np.inf):
                if k is None and ts is not t:
                    continue
                hits = threshold_search(index, data["queries"], ts, k, batch_size=7, doc_batch_size=250)
                for i in range(NQ):
                    got = hits.docids[hits.offsets[i] : hits.offsets[i + 1]]
                    expected = np.argsort(-cos[i], kind="stable")
                    n = int((cos[i] >= np.max(ts)).sum()) if k is None else k
                    assert len(got) == n
                    # the same ranking; documents whose cosines differ by less than float32 rounding may swap
                    np.testing.assert_allclose(cos[i][got], cos[i][expected[:n]], rtol=0, atol=1e-6)
                    assert np.all(np.diff(cos[i][got]) <= 1e-6)


def test_ties_at_the_cap_prefer_lower_docids(data, tmp_path):
    vecs = np.concatenate([data["docs"][:5], np.repeat(data["queries"][:1], 6, axis=0), data["docs"][5:10]])
    index = DenseIndex(tmp_path / "ties").index([{"docno": f"d{i}", "doc_vec": v} for i, v in enumerate(vecs)])
    for k in (2, 4, 6):
        out = TopKRetriever(index, num_results=k)(query_frame(data).iloc[:1])
        assert out["docno"].tolist() == [f"d{i}" for i in range(5, 5 + k)]
        np.testing.assert_allclose(out["score"], 1.0, atol=1e-6)


def test_ranks_are_add_ranks(data, index):
    out = TopKRetriever(index, num_results=50)(query_frame(data))
    ranked = pt.model.add_ranks(out.drop(columns="rank").copy())
    np.testing.assert_array_equal(ranked["rank"].to_numpy(), out["rank"].to_numpy())


# ---- pipelines: %, re-ranking, empty frames --------------------------------------------------------------------

RETRIEVERS = {
    "cdf": lambda idx: CDFCutoffRetriever(idx, p=0.9, num_results=100),
    "score": lambda idx: ScoreCutoffRetriever(idx, threshold=0.1, num_results=100),
    "topk": lambda idx: TopKRetriever(idx, num_results=100),
}


@pytest.mark.parametrize("name", list(RETRIEVERS))
def test_rank_cutoff_fuses(data, index, name):
    retriever = RETRIEVERS[name](index)
    frame = query_frame(data, query_temp=np.full(NQ, 0.5))
    full = retriever(frame)
    cut = (retriever % 5)(frame)
    assert cut.groupby("qid").size().max() <= 5
    pd.testing.assert_frame_equal(
        cut.drop(columns="query_vec"), full[full["rank"] < 5].reset_index(drop=True).drop(columns="query_vec")
    )
    fused = (retriever % 5).compile()
    assert type(fused) is type(retriever) and fused.num_results == 5 and retriever.num_results == 100
    assert retriever.fuse_rank_cutoff(500).num_results == 100
    assert repr(retriever).startswith(type(retriever).__name__ + "(DenseIndex(")


@pytest.mark.parametrize("name", list(RETRIEVERS))
def test_reranking_restricts_to_candidates(data, index, name):
    retriever = RETRIEVERS[name](index)
    rng = np.random.default_rng(5)
    candidates = [np.sort(rng.choice(N, 300, replace=False)) for _ in range(NQ)]
    frame = query_frame(data, query_temp=np.full(NQ, 0.5))
    cand = pd.DataFrame(
        [
            {**frame.iloc[i].to_dict(), "docno": f"d{d}", "score": 0.0, "rank": 0, "text": f"text {d}"}
            for i in range(NQ)
            for d in candidates[i][::-1]
        ]
    )
    out = retriever(cand)
    assert "text" in out.columns and "docid" not in out.columns
    t = retriever._thresholds(frame)
    check_against_brute_force(out, data, t, k=100, candidates=candidates)
    assert (out["text"] == "text " + out["docno"].str[1:]).all()
    # the same pipeline shape as bm25 % 1000 >> encoder.query_encoder() >> cutoff
    assert len((retriever % 3)(cand).groupby("qid").size()) <= NQ


@pytest.mark.parametrize("name", list(RETRIEVERS))
def test_empty_frames(data, index, name):
    retriever = RETRIEVERS[name](index)
    q = query_frame(data, query_temp=np.full(NQ, 0.5)).iloc[:0]
    out = retriever(q)
    assert len(out) == 0 and {"qid", "docno", "score", "rank", "query_vec"} <= set(out.columns)
    r = retriever(q.assign(docno=pd.Series(dtype=object), score=pd.Series(dtype=float)))
    assert len(r) == 0 and {"qid", "docno", "score", "rank"} <= set(r.columns)
    inputs = pt.inspect.transformer_inputs(retriever)
    assert any("query_vec" in cols and "docno" not in cols for cols in inputs)


def _empty_warnings(record):
    return [w for w in record if issubclass(w.category, EmptyRetrievalWarning)]


def _n_empty(data, tau, p):
    t = expected_thresholds("beta", None, {"query_temp": tau}, p)
    return int(((data["cos"] >= t[:, None]).sum(axis=1) == 0).sum())


def test_cdf_cutoff_warns_when_most_queries_retrieve_nothing(data, index):
    """tau = 0.01 puts t_q at cos ~ 0.986 at p = 0.5 (nothing above it), tau = 1 at cos = 0 (many documents)."""
    tau = np.where(np.arange(NQ) < 15, 0.01, 1.0)
    assert _n_empty(data, tau, 0.5) == 15
    frame = query_frame(data, query_temp=tau)
    with pytest.warns(EmptyRetrievalWarning) as record:
        out = CDFCutoffRetriever(index, p=0.5)(frame)
    assert out["qid"].nunique() == 5
    (w,) = _empty_warnings(record)
    assert issubclass(w.category, UserWarning)
    message = str(w.message)
    assert message.startswith("CDFCutoffRetriever: 15 of 20 queries retrieved no document at level p=0.5")
    assert "pyterrier_prob.evaluation.calibrate_mean_k" in message and "RecallTargetCutoff" in message
    assert "pyterrier_prob.pebr.rlt" in message
    assert w.filename == __file__  # points at the caller, not at pyterrier_prob
    # through a pipeline (pyterrier's composition) it still points at the caller
    with pytest.warns(EmptyRetrievalWarning) as record:
        (pt.apply.generic(lambda df: df) >> CDFCutoffRetriever(index, p=0.5))(frame)
    assert [w.filename for w in _empty_warnings(record)] == [__file__]


def test_cdf_cutoff_does_not_warn_otherwise(data, index):
    half = np.where(np.arange(NQ) < 10, 0.01, 1.0)
    assert _n_empty(data, half, 0.5) == 10
    few = query_frame(data, query_temp=np.full(NQ, 0.01)).iloc[:4]
    assert _n_empty(data, np.full(NQ, 0.01), 0.5) == NQ
    all_empty = query_frame(data, query_temp=np.full(NQ, 0.01))
    cand = TopKRetriever(index, num_results=5)(all_empty)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EmptyRetrievalWarning)
        assert CDFCutoffRetriever(index, p=0.5)(query_frame(data, query_temp=half))["qid"].nunique() == 10  # half
        assert len(CDFCutoffRetriever(index, p=0.5)(few)) == 0  # 4 queries: fewer than 5
        assert len(CDFCutoffRetriever(index, p=0.5)(cand)) == 0  # re-ranking, not a first stage
        assert len(ScoreCutoffRetriever(index, threshold=0.99)(all_empty)) == 0  # only the CDF cutoff warns
        assert len(TopKRetriever(index, num_results=3)(all_empty)) == 3 * NQ
        # calibration searches levels that retrieve nothing (the lower bracket) without warning
        mid = query_frame(data, query_temp=np.full(NQ, 0.5))
        cal = calibrate_mean_k(lambda p: CDFCutoffRetriever(index, p=p)(mid), 5, 1e-6, 1 - 1e-6, topics=mid)
        assert cal.achieved and cal.iterations > 2
    with pytest.warns(EmptyRetrievalWarning, match="20 of 20 queries"):  # the lower bracket, outside calibration
        CDFCutoffRetriever(index, p=1e-6)(mid)


def test_errors(data, index, tmp_path):
    frame = query_frame(data, query_temp=np.full(NQ, 0.5))
    with pytest.raises(pt.validate.InputValidationError, match="query_vec"):
        TopKRetriever(index)(frame.drop(columns="query_vec"))
    with pytest.raises(pt.validate.InputValidationError, match="query_temp.*ProbBiEncoder"):
        CDFCutoffRetriever(index)(frame.drop(columns="query_temp"))
    with pytest.raises(pt.validate.InputValidationError, match="query_alpha"):
        CDFCutoffRetriever(index, family="beta_mle")(frame)
    with pytest.raises(ValueError, match="dimension mismatch.*16.*32"):
        TopKRetriever(index)(frame.assign(query_vec=[np.ones(16, np.float32)] * NQ))
    with pytest.raises(ValueError, match="non-finite"):
        TopKRetriever(index)(frame.assign(query_vec=[np.full(DIM, np.nan, np.float32)] * NQ))
    with pytest.raises(ValueError, match="query_temp"):
        CDFCutoffRetriever(index)(frame.assign(query_temp=-1.0))
    for bad in (str(index.index_path), object(), None):
        with pytest.raises(TypeError, match="DenseIndex or pyterrier_dr.FlexIndex"):
            TopKRetriever(bad)
    for p in (0, 1, 1.5, -0.1, float("nan"), "0.5"):
        with pytest.raises(ValueError, match="p must be"):
            CDFCutoffRetriever(index, p=p)
    with pytest.raises(ValueError, match="family"):
        CDFCutoffRetriever(index, family="gauss")
    for th in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="threshold must be a finite"):
            ScoreCutoffRetriever(index, threshold=th)
    with pytest.raises(ValueError, match="num_results"):
        TopKRetriever(index, num_results=None)
    with pytest.raises(ValueError, match="num_results"):
        ScoreCutoffRetriever(index, 0.1, num_results=0)
    cand = frame.iloc[:1].assign(docno="not-a-doc")
    with pytest.raises(ValueError, match="not in DenseIndex"):
        TopKRetriever(index)(cand)


# ---- the index ---------------------------------------------------------------------------------------------


def test_index_round_trip_and_artifact(data, index, tmp_path):
    again = DenseIndex(index.index_path)
    assert len(again) == N and again.dim == DIM and again.normalized
    vecs = again.vectors()
    assert isinstance(vecs, np.memmap) and vecs.dtype == np.float32 and vecs.shape == (N, DIM)
    np.testing.assert_allclose(vecs, data["docs"], atol=1e-6)
    np.testing.assert_array_equal(again.docno_array(), data["docnos"])
    assert list(again.docnos())[:3] == ["d0", "d1", "d2"]
    meta = json.loads((index.index_path / "pt_meta.json").read_text())
    assert meta["type"] == "dense_index" and meta["format"] == "flex" and meta["normalized"] is True
    # the files are a FlexIndex: pt.Artifact.load opens it (pyterrier-dr's entry point), our retrievers take it
    loaded = pt.Artifact.load(str(index.index_path))
    assert isinstance(loaded, FlexIndex)
    a = TopKRetriever(loaded, num_results=5)(query_frame(data))
    b = TopKRetriever(index, num_results=5)(query_frame(data))
    pd.testing.assert_frame_equal(a.drop(columns="query_vec"), b.drop(columns="query_vec"))


def test_index_with_non_ascii_docnos_opens_and_retrieves(data, tmp_path):
    """Docnos outside ASCII (Wikipedia titles, as in BEIR's FEVER / HotpotQA) are stored by npids as UTF-8: the index
    opens (its docno store is not reported corrupt) and the retrievers return those docnos, by brute force."""
    docnos = np.array([f"Café_{i}" if i % 2 else f"日本_{i}" for i in range(200)], dtype=object)
    idx = DenseIndex(tmp_path / "utf8").index(pd.DataFrame({"docno": docnos, "doc_vec": list(data["docs"][:200])}))
    again = DenseIndex(idx.index_path)
    np.testing.assert_array_equal(again.docno_array(), docnos)
    out = TopKRetriever(again, num_results=3)(query_frame(data))
    for i in range(NQ):
        want = docnos[np.argsort(-data["cos"][i, :200], kind="stable")[:3]]
        assert out.loc[out["qid"] == f"q{i}", "docno"].tolist() == want.tolist()
    # and as candidates to re-rank: looked up by docno
    again_rr = ScoreCutoffRetriever(DenseIndex(idx.index_path), threshold=-1.0, num_results=None)(out)
    assert sorted(again_rr["docno"]) == sorted(out["docno"])


def test_index_from_records_normalises(data, tmp_path):
    scale = np.linspace(0.5, 3, 50)[:, None].astype(np.float32)
    records = ({"docno": f"d{i}", "doc_vec": data["docs"][i] * scale[i], "text": "x"} for i in range(50))
    idx = DenseIndex(tmp_path / "rec").indexer().index(records)
    np.testing.assert_allclose(idx.vectors(), data["docs"][:50], atol=1e-6)
    raw = (
        DenseIndex(tmp_path / "raw")
        .indexer(normalize=False)
        .index([{"docno": f"d{i}", "doc_vec": list(data["docs"][i] * scale[i])} for i in range(50)])
    )
    np.testing.assert_array_equal(raw.vectors(), data["docs"][:50] * scale)
    assert not raw.normalized
    # cosine, not inner product, on unnormalised vectors (and on a FlexIndex pyterrier-dr wrote)
    FlexIndex(str(tmp_path / "dr"), verbose=False).index(
        [{"docno": f"d{i}", "doc_vec": data["docs"][i] * scale[i]} for i in range(50)]
    )
    for source in (raw, FlexIndex(str(tmp_path / "dr"))):
        out = ScoreCutoffRetriever(source, threshold=0.0, num_results=None)(query_frame(data))
        row = out.iloc[0]
        i, d = int(row["qid"][1:]), int(row["docno"][1:])
        np.testing.assert_allclose(row["score"], data["cos"][i, d], atol=EPS)
        sizes = out["qid"].value_counts().reindex([f"q{i}" for i in range(NQ)], fill_value=0).to_numpy()
        np.testing.assert_array_equal(sizes, (data["cos"][:, :50] >= 0).sum(1))


def test_index_writes_are_atomic(data, tmp_path):
    path = tmp_path / "atomic.flex"

    def interrupted():
        for i in range(5000):
            if i == 4500:
                raise KeyboardInterrupt("simulated interruption")
            yield {"docno": f"d{i}", "doc_vec": data["docs"][i % N]}

    with pytest.raises(KeyboardInterrupt):
        DenseIndex(path).indexer().index(interrupted())
    assert not path.exists() and os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="no dense index"):
        len(DenseIndex(path))
    # overwriting: a failed run leaves the old index intact, a complete one replaces it
    DenseIndex(path).index([{"docno": "a", "doc_vec": np.ones(4)}, {"docno": "b", "doc_vec": -np.ones(4)}])
    with pytest.raises(KeyboardInterrupt):
        DenseIndex(path).indexer(mode="overwrite").index(interrupted())
    assert len(DenseIndex(path)) == 2 and sorted(os.listdir(tmp_path)) == ["atomic.flex"]
    new = (
        DenseIndex(path).indexer(mode="overwrite").index([{"docno": f"b{i}", "doc_vec": np.ones(3)} for i in range(3)])
    )
    assert len(new) == 3 and new.dim == 3 and sorted(os.listdir(tmp_path)) == ["atomic.flex"]


def test_index_errors(data, tmp_path):
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['doc_vec'\].*doc_encoder"):
        DenseIndex(tmp_path / "a").index(pd.DataFrame({"docno": ["x"], "text": ["y"]}))
    with pytest.raises(ValueError, match="doc_vec"):
        DenseIndex(tmp_path / "a").index([{"docno": "x", "text": "y"}])
    with pytest.raises(ValueError, match="inconsistent vector dimensions"):
        DenseIndex(tmp_path / "a").index([{"docno": "x", "doc_vec": np.ones(4)}, {"docno": "y", "doc_vec": np.ones(5)}])
    with pytest.raises(ValueError, match="non-finite"):
        DenseIndex(tmp_path / "a").index([{"docno": "x", "doc_vec": np.array([1.0, np.inf])}])
    with pytest.raises(ValueError, match="all zeros"):
        DenseIndex(tmp_path / "a").index([{"docno": "x", "doc_vec": np.zeros(3)}])
    with pytest.raises(ValueError, match="duplicate docno 'x'"):
        DenseIndex(tmp_path / "a").index([{"docno": "x", "doc_vec": np.ones(3)}] * 2)
    with pytest.raises(ValueError, match="nothing to index"):
        DenseIndex(tmp_path / "a").index([])
    with pytest.raises(ValueError, match="at least 2 documents"):
        DenseIndex(tmp_path / "a").index([{"docno": "x", "doc_vec": np.ones(3)}])
    with pytest.raises(ValueError, match="docno must be a str"):
        DenseIndex(tmp_path / "a").index([{"docno": 1, "doc_vec": np.ones(3)}, {"docno": 2, "doc_vec": np.ones(3)}])
    assert os.listdir(tmp_path) == []  # no failed run left anything behind
    two = [{"docno": "x", "doc_vec": np.ones(DIM)}, {"docno": "y", "doc_vec": -np.ones(DIM)}]
    DenseIndex(tmp_path / "a").index(two)
    with pytest.raises(FileExistsError, match="overwrite"):
        DenseIndex(tmp_path / "a").index(two)
    # loading incomplete or corrupt directories
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "vecs.f4").write_bytes(b"\0" * 12)
    with pytest.raises(ValueError, match="not a complete dense index"):
        DenseIndex(tmp_path / "half").vectors()
    with open(tmp_path / "a" / "vecs.f4", "ab") as f:
        f.write(b"\0" * 4)
    with pytest.raises(ValueError, match="corrupt"):
        TopKRetriever(DenseIndex(tmp_path / "a"))(query_frame(data))


# ---- encoders (the real packaged MiniLM) --------------------------------------------------------------------

QUERIES = ["vitamin d and bone health", "statins side effects", "vitamin d and bone health"]
DOCS = ["Vitamin D helps calcium absorption.", "Statins can cause muscle pain.", "Breast cancer and diet."]


@pytest.fixture(scope="module")
def beta_encoder(base_model):
    return ProbBiEncoder(build_pebr_model(base_model, family="beta"), batch_size=2)


def test_prob_bi_encoder(beta_encoder, tmp_path):
    enc = beta_encoder
    assert enc.family == "beta" and enc.dim == 384 and enc.param_columns == ("query_temp",)
    q = pd.DataFrame({"qid": ["1", "2", "3"], "query": QUERIES})
    out = enc.query_encoder()(q)
    emb, params = encode_queries(enc.model, QUERIES)
    np.testing.assert_allclose(np.stack(out["query_vec"]), emb, atol=1e-6)
    np.testing.assert_allclose(out["query_temp"].to_numpy(), params[:, 0], rtol=1e-6)
    assert out["query_vec"].iloc[0].dtype == np.float32
    docs = pd.DataFrame({"docno": ["a", "b", "c"], "text": DOCS})
    d = enc.doc_encoder()(docs)
    np.testing.assert_allclose(np.linalg.norm(np.stack(d["doc_vec"]), axis=1), 1.0, atol=1e-5)
    # empty frames keep the schema
    assert {"query_vec", "query_temp"} <= set(enc.query_encoder()(q.iloc[:0]).columns)
    assert "doc_vec" in enc.doc_encoder()(docs.iloc[:0]).columns
    # end to end: encode >> index, encode >> cutoff; the best match of a query is its paraphrase
    index = (enc.doc_encoder() >> DenseIndex(tmp_path / "enc.flex").indexer()).index(docs.to_dict("records"))
    res = (enc.query_encoder() >> CDFCutoffRetriever(index, p=0.99, num_results=2))(q)
    assert res.groupby("qid").size().max() <= 2
    assert (enc.query_encoder() >> TopKRetriever(index, num_results=1))(q)["docno"].tolist() == ["a", "b", "a"]
    assert "ProbBiEncoder" in repr(enc.query_encoder())


def test_prob_bi_encoder_plain_and_mle(base_model):
    plain = ProbBiEncoder(base_model)
    assert plain.family is None and plain.param_columns == ()
    out = plain.query_encoder()(pd.DataFrame({"qid": ["1"], "query": QUERIES[:1]}))
    assert set(out.columns) == {"qid", "query", "query_vec"}
    np.testing.assert_allclose(out["query_vec"].iloc[0], base_model.encode_query(QUERIES[:1])[0], atol=1e-6)
    mle = ProbBiEncoder(build_pebr_model(base_model, family="beta_mle"))
    out = mle.query_encoder()(pd.DataFrame({"qid": ["1"], "query": QUERIES[:1]}))
    np.testing.assert_allclose(
        out[["query_alpha", "query_beta", "query_alpha_neg", "query_beta_neg"]].to_numpy()[0],
        [20.0, 1.0, 1.0, 1.0],
        rtol=1e-4,
    )  # the head's initial laws: BetaNCE-like relevant law (1/tau_init, 1), uniform for the rest
    with pytest.raises(TypeError, match="SentenceTransformer"):
        ProbBiEncoder(object())
    assert pyterrier_prob.ProbBiEncoder is ProbBiEncoder
