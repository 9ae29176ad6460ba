"""The search layer (pyterrier_prob.index.search): every backend against the exact scan on small random data."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pyterrier_prob.index import (
    DenseIndex,
    ExactSearcher,
    FaissSearcher,
    ShardedSearcher,
    import_faiss,
    make_searcher,
    merge_runs,
    threshold_search,
)
from pyterrier_prob.index.backends import Backend
from pyterrier_prob.pebr import ScoreCutoffRetriever, TopKRetriever

faiss = import_faiss()
HAS_GPU = hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0

N, D, NQ = 2000, 16, 25
EXACT_STORAGE = ("flat", "ivf_flat", "hnsw")
LOSSY = ("flat_fp16", "ivf_fp16", "ivf_sq8", "ivf_pq")


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def data():
    """Clustered unit vectors (like embeddings) and queries near the clusters; cosines by brute force."""
    rng = np.random.default_rng(7)
    centers = _unit(rng.standard_normal((20, D)))
    docs = _unit(centers[rng.integers(0, 20, N)] + 0.35 * rng.standard_normal((N, D)))
    queries = _unit(centers[rng.integers(0, 20, NQ)] + 0.35 * rng.standard_normal((NQ, D)))
    cos = queries @ docs.T
    # per-query thresholds at varied depths (5 .. 400 documents above), as pEBR's CDF cutoffs give
    depths = rng.integers(5, 400, NQ)
    t = np.array([np.sort(cos[i])[::-1][depths[i]] for i in range(NQ)]) + 1e-6
    return {"docs": docs, "queries": queries, "cos": cos, "t": t}


@pytest.fixture(scope="module")
def index(data, tmp_path_factory):
    path = tmp_path_factory.mktemp("search") / "idx"
    return DenseIndex(path).index(pd.DataFrame({"docno": [f"d{i}" for i in range(N)], "doc_vec": list(data["docs"])}))


def _params(backend: str) -> dict:
    """Exhaustive search settings: every list probed, a beam as large as the collection."""
    if backend.startswith("ivf"):
        return {"nlist": 16, "nprobe": 16, "train_size": N}
    if backend.startswith("hnsw"):
        return {"M": 16, "ef_search": N}
    return {}


def _sets(hits, n):
    return [set(hits.docids[hits.offsets[i] : hits.offsets[i + 1]].tolist()) for i in range(n)]


def _exact_topk(cos, k):
    return [set(np.lexsort((np.arange(cos.shape[1]), -cos[i]))[:k].tolist()) for i in range(cos.shape[0])]


def _exact_range(cos, t):
    return [set(np.flatnonzero(cos[i] >= np.float32(t[i])).tolist()) for i in range(cos.shape[0])]


def _recall(got, want):
    return np.mean([len(g & w) / len(w) if w else 1.0 for g, w in zip(got, want)])


@pytest.mark.parametrize("backend", ["exact", *EXACT_STORAGE])
def test_topk_and_range_equal_the_exact_scan(backend, data, index):
    s = index.searcher(backend, **_params(backend))
    Q, cos, t = data["queries"], data["cos"], data["t"]
    topk = s.search(Q, -np.inf, 30)
    assert _sets(topk, NQ) == _exact_topk(cos, 30)
    # scores are the cosines, best first
    for i in range(NQ):
        a, b = topk.offsets[i], topk.offsets[i + 1]
        np.testing.assert_allclose(topk.scores[a:b], cos[i, topk.docids[a:b]], atol=1e-5)
        assert np.all(np.diff(topk.scores[a:b]) <= 1e-7)
    rng = s.search(Q, t, None)  # per-query thresholds, no cap: a range search
    got, want = _sets(rng, NQ), _exact_range(cos, t)
    if backend == "hnsw":  # a beam search: the range it returns is the part of the beam above t
        assert _recall(got, want) >= 0.99
        assert all(g <= w for g, w in zip(got, want))
    else:
        assert got == want
    capped = s.search(Q, t, 50)
    ref = threshold_search(index, Q, t, 50)
    assert _sets(capped, NQ) == _sets(ref, NQ)


@pytest.mark.parametrize("backend", LOSSY)
def test_lossy_codes_rescored_exact_scores_and_range_recall(backend, data, index):
    """fp16/SQ8/PQ codes: candidates re-scored from the exact vectors, so every returned score is the cosine and is
    above its threshold; with a slack on the candidate radius the range recall is (near) complete."""
    slack, extra = (0.1, {"pq_m": 8, "k_factor": 4}) if backend == "ivf_pq" else (0.02, {})
    s = index.searcher(backend, **_params(backend), range_slack=slack, **extra)
    assert s.rescore
    Q, cos, t = data["queries"], data["cos"], data["t"]
    hits = s.search(Q, t, None)
    for i in range(NQ):
        a, b = hits.offsets[i], hits.offsets[i + 1]
        np.testing.assert_allclose(hits.scores[a:b], cos[i, hits.docids[a:b]], atol=1e-5)
        assert np.all(hits.scores[a:b] >= np.float32(t[i]))
    want = _exact_range(cos, t)
    assert _recall(_sets(hits, NQ), want) >= (0.97 if backend == "ivf_pq" else 0.999)
    topk = s.search(Q, -np.inf, 10)
    assert _recall(_sets(topk, NQ), _exact_topk(cos, 10)) >= 0.95


def test_fewer_probes_lower_recall_but_never_wrong_scores(data, index):
    s = index.searcher("ivf_flat", nlist=16, train_size=N)
    Q, cos, t = data["queries"], data["cos"], data["t"]
    want = _exact_range(cos, t)
    recalls = []
    for nprobe in (1, 4, 16):
        hits = s.with_params(nprobe=nprobe).search(Q, t, None)
        got = _sets(hits, NQ)
        assert all(g <= w for g, w in zip(got, want))  # a subset: IVF misses, it never invents
        recalls.append(_recall(got, want))
    assert recalls[0] < recalls[-1] == 1.0
    assert recalls == sorted(recalls)


def test_probe_margin_probes_more_lists_for_broad_queries(data, index):
    """probe_margin: every list whose centroid scores >= t_q - margin; a margin beyond every score is exhaustive."""
    s = index.searcher("ivf_flat", nlist=16, train_size=N)
    Q, cos, t = data["queries"], data["cos"], data["t"]
    want = _exact_range(cos, t)
    recalls, probes = [], []
    for margin in (0.0, 0.2, 0.5, 3.0):
        a = s.with_params(nprobe=1, probe_margin=margin)
        got = _sets(a.search(Q, t, None), NQ)
        assert all(g <= w for g, w in zip(got, want))
        recalls.append(_recall(got, want))
        probes.append(a.last_probes.copy())
    assert recalls == sorted(recalls) and recalls[-1] == 1.0 and recalls[0] < 1.0
    assert (probes[-1] == 16).all() and (probes[0] >= 1).all()
    # at one margin, the queries with the lowest thresholds (the broadest) probe the most lists
    depth = np.array([len(w) for w in want])
    assert np.corrcoef(depth, probes[1])[0, 1] > 0.3
    with pytest.raises(ValueError, match="unknown parameter 'probe_margin' of the hnsw backend"):
        index.searcher("hnsw", **_params("hnsw"), probe_margin=0.1)


def test_faiss_index_is_cached_in_the_index_folder(data, index):
    s = index.searcher("ivf_sq8", nlist=8, train_size=N)
    files = sorted(p.name for p in (index.index_path / "faiss").iterdir())
    assert "ivf_sq8-nlist8-seed0-train2000.faiss" in files
    assert s.memory_bytes == (index.index_path / "faiss" / "ivf_sq8-nlist8-seed0-train2000.faiss").stat().st_size
    again = DenseIndex(index.index_path).searcher("ivf_sq8", nlist=8, train_size=N)  # read back, not rebuilt
    assert again.index is not s.index
    a, b = s.search(data["queries"], -np.inf, 20), again.search(data["queries"], -np.inf, 20)
    np.testing.assert_array_equal(a.docids, b.docids)
    assert again.build_s == pytest.approx(s.build_s, abs=1e-3)


def test_hnsw_graph_is_the_one_plain_faiss_builds_from_one_add(data, monkeypatch):
    """Added in chunks, faiss' HNSW builds another graph (at 1M a much worse one, docs/scale.md): ours gets every
    vector in one add, whatever the chunk size of the other backends."""
    monkeypatch.setattr(Backend, "add_batch", 300)  # the other backends' chunk; HNSW's own is None: one add
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)  # one thread inserts in a fixed order: the same graph from the same adds
    docs, Q = data["docs"], data["queries"]

    def plain(step: int) -> np.ndarray:
        index = faiss.IndexHNSWFlat(D, 8, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 16
        for a in range(0, N, step):
            index.add(docs[a : a + step])
        index.hnsw.efSearch = 16
        return index.search(Q, 10)[1]

    try:
        hits = make_searcher(docs, "hnsw", M=8, ef_construction=16, ef_search=16).search(Q, -np.inf, 10)
        one_add, chunked = plain(N), plain(300)
    finally:
        faiss.omp_set_num_threads(threads)
    ours = hits.docids.reshape(NQ, 10)
    assert not np.array_equal(one_add, chunked)  # the two graphs can be told apart on this data
    np.testing.assert_array_equal(ours, one_add)


@pytest.mark.parametrize("backend", ["exact", "flat", "ivf_flat"])
def test_ties_at_the_cap_keep_the_lower_docids(backend):
    """Duplicate documents tie: every exhaustive backend keeps, of the documents tied at the K-th score, the lower
    docids (the exact scan's rule), as brute force on small integer vectors (exact dot products) does. (Not HNSW:
    its graph cannot reach every copy of a duplicated document, docs/scale.md.)"""
    rng = np.random.default_rng(11)
    docs = rng.integers(-2, 3, (12, 8)).astype(np.float32)[rng.integers(0, 12, 400)]  # each row ~33 times
    Q = rng.integers(-2, 3, (6, 8)).astype(np.float32)
    S = Q.astype(np.int64) @ docs.astype(np.int64).T
    params = {"nlist": 4, "nprobe": 4, "train_size": 400} if backend == "ivf_flat" else _params(backend)
    searchers = [make_searcher(docs, backend, **params)]
    searchers.append(ShardedSearcher([make_searcher(docs[a : a + 200], backend, **params) for a in (0, 200)]))
    for s in searchers:
        for k in (5, 40, 100):
            hits = s.search(Q, -np.inf, k)
            for i in range(len(Q)):
                want = np.lexsort((np.arange(len(docs)), -S[i]))[:k]
                np.testing.assert_array_equal(hits.docids[hits.offsets[i] : hits.offsets[i + 1]], want)
        t = np.sort(S, axis=1)[:, -60].astype(np.float64)  # capped range search, ties at the cap
        hits = s.search(Q, t, 30)
        for i in range(len(Q)):
            want = np.lexsort((np.arange(len(docs)), -S[i]))[:30]
            np.testing.assert_array_equal(hits.docids[hits.offsets[i] : hits.offsets[i + 1]], want)


@pytest.mark.parametrize("backend", ["exact", "ivf_flat"])
def test_shard_merge_equals_unsharded(backend, data):
    docs, Q, t = data["docs"], data["queries"], data["t"]
    whole = make_searcher(docs, backend, **_params(backend))
    cuts = [0, 300, 1100, N]
    shards = ShardedSearcher([make_searcher(docs[a:b], backend, **_params(backend)) for a, b in zip(cuts, cuts[1:])])
    assert shards.n_docs == N
    for thresholds, k in ((-np.inf, 40), (t, None), (t, 25)):
        a, b = whole.search(Q, thresholds, k), shards.search(Q, thresholds, k)
        np.testing.assert_array_equal(a.offsets, b.offsets)
        np.testing.assert_array_equal(a.docids, b.docids)
        np.testing.assert_allclose(a.scores, b.scores, atol=1e-6)


def test_merge_runs_of_shard_indexes_equals_the_unsharded_run(data, index, tmp_path):
    docs = data["docs"]
    queries = pd.DataFrame({"qid": [f"q{i}" for i in range(NQ)], "query_vec": list(data["queries"])})
    cuts = [0, 700, N]
    runs = []
    for j, (a, b) in enumerate(zip(cuts, cuts[1:])):
        frame = pd.DataFrame({"docno": [f"d{i}" for i in range(a, b)], "doc_vec": list(docs[a:b])})
        shard = DenseIndex(tmp_path / f"shard{j}").index(frame)
        runs.append(ScoreCutoffRetriever(shard, threshold=0.6, num_results=30)(queries))
    merged = merge_runs(runs, num_results=30)
    whole = ScoreCutoffRetriever(index, threshold=0.6, num_results=30)(queries)
    cols = ["qid", "docno", "rank"]
    pd.testing.assert_frame_equal(merged[cols].reset_index(drop=True), whole[cols].reset_index(drop=True))
    np.testing.assert_allclose(merged["score"], whole["score"], atol=1e-6)
    with pytest.raises(ValueError, match="docno 'd[0-9]+' of qid 'q0' is in runs \\[0, 1\\]"):
        merge_runs([runs[0], runs[0]])
    with pytest.raises(ValueError, match="run 0 has no column"):
        merge_runs([runs[0].drop(columns="score")])


def test_cutoff_retrievers_on_an_ivf_searcher_return_the_exact_frames(data, index):
    queries = pd.DataFrame({"qid": [f"q{i}" for i in range(NQ)], "query_vec": list(data["queries"])})
    ivf = index.searcher("ivf_flat", nlist=16, nprobe=16, train_size=N)
    for make in (
        lambda **kw: TopKRetriever(index, num_results=20, **kw),
        lambda **kw: ScoreCutoffRetriever(index, threshold=0.55, num_results=None, **kw),
    ):
        exact, approx = make()(queries), make(searcher=ivf)(queries)
        cols = ["qid", "docno", "docid", "rank"]
        pd.testing.assert_frame_equal(exact[cols], approx[cols])
        np.testing.assert_allclose(exact["score"], approx["score"], atol=1e-6)
    assert "searcher=ivf_flat[nprobe=16]" in repr(TopKRetriever(index, searcher=ivf))


def test_unnormalised_index_searches_cosines(data, tmp_path):
    rng = np.random.default_rng(3)
    raw = data["docs"] * rng.uniform(0.5, 3.0, (N, 1)).astype(np.float32)
    frame = pd.DataFrame({"docno": [f"d{i}" for i in range(N)], "doc_vec": list(raw)})
    idx = DenseIndex(tmp_path / "raw").indexer(normalize=False).index(frame)
    s = idx.searcher("ivf_flat", nlist=16, nprobe=16, train_size=N)
    hits = s.search(data["queries"], data["t"], None)
    assert _sets(hits, NQ) == _exact_range(data["cos"], data["t"])


def test_bad_arguments_name_the_problem(data, index):
    with pytest.raises(ValueError, match="backend must be one of"):
        index.searcher("annoy")
    with pytest.raises(ValueError, match="nlist=4000 exceeds the 2000 vectors"):
        make_searcher(data["docs"], "ivf_flat", nlist=4000)
    with pytest.raises(ValueError, match="needs a finite threshold"):
        index.searcher().search(data["queries"], -np.inf, None)
    with pytest.raises(ValueError, match=r"query vectors must have shape \(queries, 16\)"):
        index.searcher().search(data["queries"][:, :8], 0.5, 10)
    with pytest.raises(ValueError, match="unknown search parameter 'nprob'"):
        index.searcher("ivf_flat", nlist=16, train_size=N).with_params(nprob=3)
    with pytest.raises(ValueError, match="exact backend has no parameters"):
        index.searcher("exact", nprobe=3)
    small = make_searcher(data["docs"][:100], "flat")
    with pytest.raises(ValueError, match="searcher covers 100 x 16 vectors"):
        TopKRetriever(index, searcher=small)
    with pytest.raises(TypeError, match="searcher must be a pyterrier_prob.index.Searcher"):
        TopKRetriever(index, searcher="ivf_flat")
    with pytest.raises(ValueError, match="different dimensions"):
        ShardedSearcher([ExactSearcher(data["docs"]), ExactSearcher(data["docs"][:, :8])])


@pytest.mark.skipif(not HAS_GPU, reason="needs faiss-gpu and a CUDA GPU")
@pytest.mark.parametrize("backend", ["flat", "ivf_flat"])
def test_gpu_backend_equals_the_exact_scan(backend, data, index):  # pragma: no cover - GPU only
    s = make_searcher(data["docs"], backend, gpu=True, **_params(backend))
    assert s.backend == f"gpu_{backend}"
    Q, cos, t = data["queries"], data["cos"], data["t"]
    assert _sets(s.search(Q, -np.inf, 30), NQ) == _exact_topk(cos, 30)
    assert _sets(s.search(Q, t, None), NQ) == _exact_range(cos, t)


class _Spy:
    """Calls ``fn``, recording what ``record`` makes of each call's arguments."""

    def __init__(self, fn, record):
        self.fn, self.record, self.calls = fn, record, []

    def __call__(self, *args):
        self.calls.append(self.record(*args))
        return self.fn(*args)


def test_gpu_range_past_the_gpu_cap_falls_back_to_the_exact_range_search(data, monkeypatch):
    """The GPU range search (k-NN of doubling depth) driven on the CPU: a flat CPU index stands in for the GPU one,
    the GPU k-NN limit is forced small; queries whose range exceeds it get the CPU range search -- every document
    above the threshold, none missed, none extra -- and the k-NN never goes deeper than the limit."""
    from pyterrier_prob.index import search

    Q, cos = data["queries"][:7], data["cos"][:7]
    depths = [3, 8, 9, 50, 100, 300, 1000]  # documents above each query's threshold
    srt = np.sort(cos, axis=1)[:, ::-1]
    t = np.array([(srt[i, d - 1] + srt[i, d]) / 2 for i, d in enumerate(depths)])
    want = _exact_range(cos, t)
    assert [len(w) for w in want] == depths
    for cap, ks_expected in ((8, [8]), (256, [64, 128, 256])):
        monkeypatch.setattr(search, "GPU_MAX_K", cap)
        s = make_searcher(data["docs"], "flat")
        knn, cpu_range = _Spy(s._knn, lambda q, k: k), _Spy(s._range_pairs, lambda q, tt: len(q))
        monkeypatch.setattr(s, "_knn", knn)
        monkeypatch.setattr(s, "_range_pairs", cpu_range)
        hits = s._gpu_range(Q, t)
        assert _sets(hits, len(depths)) == want
        assert sorted(set(knn.calls)) == ks_expected  # the depth doubles, up to the cap
        assert cpu_range.calls == [sum(d >= cap for d in depths)]  # those the cap cannot show complete, on the CPU
        for i in range(len(depths)):  # exact scores, best first
            a, b = hits.offsets[i], hits.offsets[i + 1]
            np.testing.assert_allclose(hits.scores[a:b], cos[i, hits.docids[a:b]], atol=1e-6)
            assert np.all(np.diff(hits.scores[a:b]) <= 0)


def test_backends_are_a_registry_a_new_one_is_one_file_and_one_registration(data):
    """make_searcher looks backends up in the registry: the built-in families (flat, ivf, hnsw, hnsw_sq8) and one
    registered here, a subclass in a few lines, work end to end; a taken name or an unknown backend is refused."""
    from pyterrier_prob.index import backends
    from pyterrier_prob.index.backends.flat import Flat

    assert {"flat", "flat_fp16", "ivf_flat", "ivf_fp16", "ivf_sq8", "ivf_pq", "hnsw", "hnsw_sq8"} <= set(
        backends.names()
    )

    class FlatAgain(Flat):
        name = "flat_again"

    try:
        backends.register(FlatAgain())
        hits = make_searcher(data["docs"], "flat_again").search(data["queries"], -np.inf, 10)
        assert _sets(hits, NQ) == _exact_topk(data["cos"], 10)
        with pytest.raises(ValueError, match="'flat' is already registered"):
            backends.register(type("Other", (Flat,), {"name": "flat", "create": Flat.create})())
        with pytest.raises(ValueError, match="unknown parameter 'nprobe' of the flat_again backend"):
            make_searcher(data["docs"], "flat_again", nprobe=3)
    finally:
        backends.unregister("flat_again")
    with pytest.raises(ValueError, match="backend must be one of"):
        make_searcher(data["docs"], "flat_again")


def test_hnsw_sq8_matches_the_exact_scan_after_rescoring(data):
    """The backend the registry gained: HNSW over 8-bit codes. Its approximate scores miss a few of the exact top 10
    even at an exhaustive beam; re-scoring a 4x deeper candidate list from the exact vectors (``k_factor``, as faiss'
    IndexRefine) gives the exact scan's top 10 and scores."""
    import faiss

    s = make_searcher(data["docs"], "hnsw_sq8", **_params("hnsw_sq8"))
    assert isinstance(s.cpu_index, faiss.IndexHNSWSQ) and s.settings.rescore and s.setting() == f"ef_search={N}"
    want = _exact_topk(data["cos"], 10)
    assert 0.9 <= _recall(_sets(s.search(data["queries"], -np.inf, 10), NQ), want) < 1.0
    hits = s.with_params(k_factor=4).search(data["queries"], -np.inf, 10)
    exact = ExactSearcher(data["docs"]).search(data["queries"], -np.inf, 10)
    assert _sets(hits, NQ) == want
    np.testing.assert_array_equal(hits.docids, exact.docids)
    np.testing.assert_allclose(hits.scores, exact.scores, rtol=1e-6)
    with pytest.raises(ValueError, match="rescore=True needs the exact vectors"):
        FaissSearcher(s.cpu_index, "hnsw_sq8", s.settings)
