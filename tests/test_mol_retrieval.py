"""Mixture-of-Logits retrieval (``shared/papers/mixture-of-logits.txt``, Sec. 3, Theorems 2-3, Appendix B).

The MoL model is faked here with the duck-typed interface of ``st_extensions.mol.MixtureOfLogits`` (gate,
score_candidates, score_all, num_query_components / num_doc_components / component_dim): a small random MLP gate
over the P dot products (Appendix A.3's QA gate) for learned-like, non-uniform pi; a uniform gate; and a table
gate holding Appendix B's pi. Exactness is checked against brute force on random unit components.
"""

import os
import sys
import types

import numpy as np
import pandas as pd
import pyterrier as pt
import pytest
import torch

import pyterrier_prob
from pyterrier_prob import DenseIndex, MoLEncoder, MoLIndex, MoLReranker, MoLRetriever
from pyterrier_prob.index.search import ExactSearcher
from pyterrier_prob.mol.retrieval import METHODS

torch.set_num_threads(1)


def pair_dots(q, x):
    """<f_pq(q), g_px(x)> for every pair, flattened pq-major: (B, Pq, d), (B, C, Px, d) -> (B, C, Pq*Px)."""
    return torch.einsum("bqd,bcxd->bcqx", q, x).flatten(2)


class FakeMoL(torch.nn.Module):
    """MixtureOfLogits-like: pi = softmax(MLP(dots)) (learned-like, non-uniform) or pi = 1/P (uniform)."""

    def __init__(self, pq, px, d, seed=0, uniform=False, hidden=16, sharpness=4.0):
        super().__init__()
        self.num_query_components, self.num_doc_components, self.component_dim = pq, px, d
        self.uniform = uniform
        g = torch.Generator().manual_seed(seed)
        P = pq * px
        self.w1 = torch.nn.Parameter(torch.randn(P, hidden, generator=g) * sharpness)
        self.b1 = torch.nn.Parameter(torch.randn(hidden, generator=g))
        self.w2 = torch.nn.Parameter(torch.randn(hidden, P, generator=g))
        self.b2 = torch.nn.Parameter(torch.randn(P, generator=g))

    def _pi(self, dots):
        if self.uniform:
            return torch.full_like(dots, 1.0 / dots.shape[-1])
        return torch.softmax(torch.nn.functional.silu(dots @ self.w1 + self.b1) @ self.w2 + self.b2, dim=-1)

    def gate(self, q_components, x_components, q_features=None, x_features=None):
        return self._pi(pair_dots(q_components, x_components))

    def score_candidates(self, q_components, x_components, q_features=None, x_features=None):
        dots = pair_dots(q_components, x_components)
        return (self._pi(dots) * dots).sum(-1)

    def score_all(self, q, x):
        return self.score_candidates(q, x.unsqueeze(0).expand(q.shape[0], -1, -1, -1))


class FeatMoL(FakeMoL):
    """A gate that also reads query- and document-side features (App. A.3): logits += W_q f_q + W_x f_x."""

    def __init__(self, pq, px, d, fdim, seed=0):
        super().__init__(pq, px, d, seed=seed)
        self.gate_features, self.embedding_dim = True, fdim
        g = torch.Generator().manual_seed(seed + 100)
        self.wq = torch.nn.Parameter(torch.randn(fdim, pq * px, generator=g) * 2)
        self.wx = torch.nn.Parameter(torch.randn(fdim, pq * px, generator=g) * 2)

    def _pi_f(self, dots, qf, xf):
        if qf is None or xf is None:
            raise ValueError("this MoL gate uses query- and document-side features: pass q_features, x_features")
        logits = torch.nn.functional.silu(dots @ self.w1 + self.b1) @ self.w2 + self.b2
        return torch.softmax(logits + (qf @ self.wq)[:, None] + xf @ self.wx, dim=-1)

    def gate(self, q_components, x_components, q_features=None, x_features=None):
        return self._pi_f(pair_dots(q_components, x_components), q_features, x_features)

    def score_candidates(self, q_components, x_components, q_features=None, x_features=None):
        dots = pair_dots(q_components, x_components)
        return (self._pi_f(dots, q_features, x_features) * dots).sum(-1)

    def score_all(self, q, x, q_features=None, x_features=None):
        B = q.shape[0]
        xf = None if x_features is None else x_features.unsqueeze(0).expand(B, -1, -1)
        return self.score_candidates(q, x.unsqueeze(0).expand(B, -1, -1, -1), q_features, xf)


class TableMoL(FakeMoL):
    """A gate returning fixed pi per item, the item found by its components (Appendix B's Table 6)."""

    def __init__(self, item_comps, pi):
        super().__init__(1, item_comps.shape[1], item_comps.shape[2])
        self.items = torch.as_tensor(item_comps, dtype=torch.float32).flatten(1)
        self.pi = torch.as_tensor(pi, dtype=torch.float32)

    def _pi_of(self, x):
        B, C = x.shape[:2]
        which = torch.cdist(x.reshape(B * C, -1), self.items).argmin(dim=1)
        return self.pi[which].reshape(B, C, -1)

    def gate(self, q_components, x_components, q_features=None, x_features=None):
        return self._pi_of(x_components)

    def score_candidates(self, q_components, x_components, q_features=None, x_features=None):
        return (self._pi_of(x_components) * pair_dots(q_components, x_components)).sum(-1)


def unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def make_index(path, comps, docnos=None):
    docnos = docnos if docnos is not None else [f"d{i}" for i in range(len(comps))]
    return MoLIndex(path).index(pd.DataFrame({"docno": docnos, "doc_comp": list(comps)}))


def query_frame(Q):
    return pd.DataFrame({"qid": [f"q{i}" for i in range(len(Q))], "query": "text", "query_comp": list(Q)})


def ranked(out, qid):
    rows = out[out["qid"] == qid]
    np.testing.assert_array_equal(rows["rank"].to_numpy(), np.arange(len(rows)))
    return rows["docno"].tolist(), rows["score"].to_numpy()


# ---- Appendix B, Table 6 ----------------------------------------------------------------------------------

# Table 6: items a-e, inner products <f_1, g_1>, <f_2, g_2>, gating weights pi_1, pi_2, and phi. (The text says
# "4 items"; the table lists 5, and the stated results -- a, b, c retrieved first, d in the second pass -- need e
# below 0.4, as it is.)
TABLE6 = {
    "a": (1.0, 1.0, 0.5, 0.5, 1.0),
    "b": (0.8, 0.0, 0.5, 0.5, 0.4),
    "c": (0.0, 0.8, 0.5, 0.5, 0.4),
    "d": (0.7, 0.0, 1.0, 0.0, 0.7),
    "e": (0.2, 0.2, 0.5, 0.5, 0.2),
}


@pytest.fixture(scope="module")
def table6(tmp_path_factory):
    """The example as MoL with P_q = 1, P_x = 2 (so the P = 2 pairs are (f, g_1) and (f, g_2)), d = 2, unit vectors:
    f = (1, 0) and g_p(x) = (v, sqrt(1 - v^2)) give <f, g_p(x)> = v exactly as stated."""
    docnos = list(TABLE6)
    dots = np.array([TABLE6[k][:2] for k in docnos], dtype=np.float64)
    comps = np.stack([dots, np.sqrt(1 - dots**2)], axis=-1).astype(np.float32)  # (5, 2, 2)
    pi = np.array([TABLE6[k][2:4] for k in docnos])
    mol = TableMoL(comps, pi)
    index = make_index(tmp_path_factory.mktemp("t6") / "table6.mol", comps, docnos)
    queries = pd.DataFrame({"qid": ["q"], "query_comp": [np.array([[1.0, 0.0]], np.float32)]})
    return index, mol, queries


def test_table6_encoding(table6):
    index, mol, queries = table6
    Q = torch.tensor(np.stack(queries["query_comp"]))
    phi = mol.score_all(Q, torch.from_numpy(np.array(index.components())))[0].numpy()
    np.testing.assert_allclose(phi, [TABLE6[k][4] for k in TABLE6], atol=1e-6)


def test_table6_exact(table6):
    """Appendix B: pass 1 retrieves a, b, c (phi 1.0, 0.4, 0.4, so S_min = 0.4); pass 2 adds d (<f_1, g_1> = 0.7
    >= 0.4, phi = 0.7); the result is a, d."""
    index, mol, queries = table6
    for method in ("exact", "brute_force"):
        out = MoLRetriever(index, mol, method=method, num_results=2, count_candidates=True)(queries)
        docnos, scores = ranked(out, "q")
        assert docnos == ["a", "d"], method
        np.testing.assert_allclose(scores, [1.0, 0.7], atol=1e-6)
    out = MoLRetriever(index, mol, method="exact", num_results=2, count_candidates=True)(queries)
    assert out["num_candidates"].iloc[0] == 4  # G' = {a, b, c} u {d}; e (0.2, 0.2) is never scored


def test_table6_topk_per_embedding_and_gap_bounds(table6):
    """Appendix B: top 2 per embedding retrieves a, b, c, S_K = 0.4; S = max{0.7, 0.2} so the gap bound is 0.3
    (tight: the true 2nd score, d's 0.7, is 0.3 above); from the retrieved items only, 0.8 - 0.4 = 0.4."""
    index, mol, queries = table6
    tight = MoLRetriever(
        index, mol, method="topk_per_embedding", num_results=2, gap_bound="tight", count_candidates=True
    )(queries)
    docnos, scores = ranked(tight, "q")
    assert docnos == ["a", "b"]  # b and c tie at 0.4: lower docid first
    np.testing.assert_allclose(scores, [1.0, 0.4], atol=1e-6)
    assert tight["num_candidates"].iloc[0] == 3
    np.testing.assert_allclose(tight["gap_bound"].to_numpy(), 0.3, atol=1e-6)
    actual_gap = 0.7 - scores.min()  # Definition 2: S' - S = phi(d) - min phi(X*)
    np.testing.assert_allclose(actual_gap, 0.3, atol=1e-6)
    loose = MoLRetriever(index, mol, method="topk_per_embedding", num_results=2, gap_bound="loose")(queries)
    np.testing.assert_allclose(loose["gap_bound"].to_numpy(), 0.4, atol=1e-6)
    # Theorem 3 on the same example (derived, not stated): TopKAvg's top 2 by (<f,g_1> + <f,g_2>) / 2 are a
    # (1.0) and b (0.4, tied with c); S' = max(max{c, d, e on p=1}, max{d, e on p=2}) = max(0.7, 0.2) = 0.7.
    comb = MoLRetriever(index, mol, method="comb_topk", num_results=2, gap_bound=True)(queries)
    assert ranked(comb, "q")[0] == ["a", "b"]
    np.testing.assert_allclose(comb["gap_bound"].to_numpy(), 0.3, atol=1e-6)
    # with N = 3 per embedding, d is among the candidates and the result is exact
    deeper = MoLRetriever(index, mol, method="topk_per_embedding", num_results=2, n_per_embedding=3, gap_bound=True)
    out = deeper(queries)
    assert ranked(out, "q")[0] == ["a", "d"]
    # S = max 4th dot product = max(0.2, 0.0) = 0.2 < S_K = 0.7: certified exact
    np.testing.assert_allclose(out["gap_bound"].to_numpy(), 0.0)


# ---- random data: exactness against brute force -----------------------------------------------------------

N, PQ, PX, D, NQ, K = 300, 3, 2, 8, 12, 10


def random_case(seed, tmp_path, uniform=False, pq=PQ, px=PX):
    rng = np.random.default_rng(seed)
    comps = unit(rng.standard_normal((N, px, D)))
    Q = unit(comps[rng.choice(N, NQ), :1].repeat(pq, axis=1) + 0.8 * rng.standard_normal((NQ, pq, D)))
    index = make_index(tmp_path / f"r{seed}{'u' if uniform else ''}{pq}{px}.mol", comps)
    return index, FakeMoL(pq, px, D, seed=seed, uniform=uniform), Q


def brute(mol, index, Q):
    with torch.no_grad():
        return mol.score_all(torch.from_numpy(Q), torch.from_numpy(np.array(index.components()))).double().numpy()


def test_fake_gate_is_learned_like(tmp_path):
    index, mol, Q = random_case(0, tmp_path)
    pi = mol.gate(torch.from_numpy(Q), torch.from_numpy(np.array(index.components()))[None].expand(NQ, -1, -1, -1))
    assert pi.shape == (NQ, N, PQ * PX)
    np.testing.assert_allclose(pi.sum(-1).detach().numpy(), 1.0, atol=1e-5)
    assert pi.max().item() > 0.5 and pi.std(-1).mean().item() > 0.05  # far from uniform, varies with (q, x)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_exact_equals_brute_force(seed, tmp_path):
    pq, px = [(3, 2), (2, 4), (4, 3), (2, 2)][seed]
    index, mol, Q = random_case(seed, tmp_path, pq=pq, px=px)
    phi = brute(mol, index, Q)
    bf = MoLRetriever(index, mol, method="brute_force", num_results=K)(query_frame(Q))
    ex = MoLRetriever(index, mol, method="exact", num_results=K, count_candidates=True, batch_size=5)(query_frame(Q))
    assert len(ex) == len(bf) == NQ * K
    for i in range(NQ):
        want = np.argsort(-phi[i], kind="stable")[:K]
        for out in (bf, ex):
            docnos, scores = ranked(out, f"q{i}")
            assert docnos == [f"d{j}" for j in want], (seed, i)
            np.testing.assert_allclose(scores, phi[i, want], atol=1e-5)
    assert (ex["num_candidates"] <= N).all() and (ex["num_candidates"] >= K).all()
    assert {"qid", "query", "query_comp", "docno", "docid", "score", "rank"} <= set(ex.columns)
    assert ex["rank"].dtype == np.int64 and ex["docid"].dtype == np.int64


def test_topk_avg_exact_for_uniform_gating(tmp_path):
    """Sec. 3.2: with pi_p = 1/P, phi = <sum f, sum g> / P (Eqs. 5-6) and TopKAvg (N = K) is the exact top K."""
    for seed in (0, 1):
        index, mol, Q = random_case(seed, tmp_path, uniform=True)
        phi = brute(mol, index, Q)
        means = Q.mean(1).astype(np.float64) @ np.asarray(index.means(), np.float64).T
        np.testing.assert_allclose(phi, means, atol=1e-5)
        avg = MoLRetriever(index, mol, method="topk_avg", num_results=K, gap_bound=True)(query_frame(Q))
        bf = MoLRetriever(index, mol, method="brute_force", num_results=K)(query_frame(Q))
        for i in range(NQ):
            assert ranked(avg, f"q{i}")[0] == ranked(bf, f"q{i}")[0]
        # the bound (Theorem 3 with N1 = 0) is valid but need not certify: it is about dot products, not phi
        assert (avg["gap_bound"] >= 0).all()


@pytest.mark.parametrize("method", ["topk_per_embedding", "topk_avg", "comb_topk"])
def test_approximate_methods_and_gap_bounds(method, tmp_path):
    """Approximate lists hold true MoL scores; Definition 2's gap never exceeds Theorem 2/3's bound."""
    index, mol, Q = random_case(5, tmp_path)
    phi = brute(mol, index, Q)
    n = 4  # shallow candidate lists, so that some queries miss part of the top K
    kw = {"n_avg": n} if method == "topk_avg" else {"n_per_embedding": n}
    if method == "comb_topk":
        kw["n_avg"] = n
    out = MoLRetriever(index, mol, method=method, num_results=K, gap_bound="tight", count_candidates=True, **kw)(
        query_frame(Q)
    )
    loose = None
    if method != "topk_avg":
        loose = MoLRetriever(index, mol, method=method, num_results=K, gap_bound="loose", **kw)(query_frame(Q))
    missed = 0
    for i in range(NQ):
        docnos, scores = ranked(out, f"q{i}")
        got = np.array([int(d[1:]) for d in docnos])
        np.testing.assert_allclose(scores, phi[i, got], atol=1e-5)
        assert np.all(np.diff(scores) <= 1e-7)
        exact = set(np.argsort(-phi[i])[:K].tolist())
        outside = exact - set(got.tolist())
        bound = out.loc[out["qid"] == f"q{i}", "gap_bound"].iloc[0]
        if outside:
            missed += 1
            gap = max(phi[i, list(outside)]) - scores.min()
            assert gap <= bound + 1e-5, (i, gap, bound)
        if loose is not None:
            assert loose.loc[loose["qid"] == f"q{i}", "gap_bound"].iloc[0] >= bound - 1e-6
    assert missed > 0  # the test exercises real gaps
    assert (out["num_candidates"] <= (PQ * PX * n + n)).all()


def test_comb_contains_both_candidate_sets(tmp_path):
    index, mol, Q = random_case(6, tmp_path)
    kw = {"num_results": K, "count_candidates": True}
    pe = MoLRetriever(index, mol, method="topk_per_embedding", n_per_embedding=3, **kw)(query_frame(Q))
    av = MoLRetriever(index, mol, method="topk_avg", n_avg=5, **kw)(query_frame(Q))
    cb = MoLRetriever(index, mol, method="comb_topk", n_per_embedding=3, n_avg=5, **kw)(query_frame(Q))
    for i in range(NQ):
        sizes = [o.loc[o["qid"] == f"q{i}", "num_candidates"].iloc[0] for o in (pe, av, cb)]
        assert max(sizes[:2]) <= sizes[2] <= sizes[0] + sizes[1]
        best = [o.loc[o["qid"] == f"q{i}", "score"].iloc[0] for o in (pe, av, cb)]
        assert best[2] >= max(best[:2]) - 1e-6


# ---- PyTerrier behaviour: empty frames, %, re-ranking, errors ---------------------------------------------


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    rng = np.random.default_rng(11)
    comps = unit(rng.standard_normal((60, PX, D)))
    Q = unit(rng.standard_normal((4, PQ, D)))
    index = make_index(tmp_path_factory.mktemp("small") / "small.mol", comps)
    return index, FakeMoL(PQ, PX, D, seed=3), Q


def test_empty_frames(small, fake_st_mol):
    index, mol, Q = small
    empty = query_frame(Q).iloc[:0]
    for method in METHODS:
        kw = {"gap_bound": True} if method not in ("brute_force", "exact") else {}
        out = MoLRetriever(index, mol, method=method, num_results=5, **kw)(empty)
        assert len(out) == 0
        assert {"qid", "query_comp", "docno", "docid", "score", "rank"} <= set(out.columns)
        assert ("gap_bound" in out.columns) == bool(kw)
    cands = query_frame(Q).assign(docno="d1", score=1.0, rank=0).iloc[:0]
    for rr in (MoLReranker(index, mol), MoLReranker(None, mol), MoLRetriever(index, mol)):
        inp = (
            cands.assign(doc_comp=pd.Series(dtype=object))
            if rr.__class__ is MoLReranker and rr.index is None
            else cands
        )
        out = rr(inp)
        assert len(out) == 0 and {"qid", "docno", "score", "rank"} <= set(out.columns)
    enc = MoLEncoder(FakeModel())
    assert "query_comp" in enc.query_encoder()(pd.DataFrame({"qid": [], "query": []})).columns
    assert "doc_comp" in enc.doc_encoder()(pd.DataFrame({"docno": [], "text": []})).columns


@pytest.mark.parametrize("method", METHODS)
def test_rank_cutoff_fuses(method, small):
    index, mol, Q = small
    kw = {"n_per_embedding": 6} if method in ("topk_per_embedding", "comb_topk") else {}
    ret = MoLRetriever(index, mol, method=method, num_results=10, **kw)
    pipe = ret % 3
    fused = pipe.compile() if hasattr(pipe, "compile") else pipe
    assert isinstance(fused, MoLRetriever) and fused.num_results == 3
    full = ret(query_frame(Q))
    cut = pipe(query_frame(Q))
    want = full[full["rank"] < 3].reset_index(drop=True)
    pd.testing.assert_frame_equal(cut.drop(columns="query_comp"), want.drop(columns="query_comp"))
    assert "method=" in repr(fused) and "num_results=3" in repr(fused)


def test_reranker(small, tmp_path):
    index, mol, Q = small
    phi = brute(mol, index, Q)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(len(Q)):
        for r, j in enumerate(rng.choice(60, 15, replace=False)):
            rows.append({"qid": f"q{i}", "query": "t", "docno": f"d{j}", "score": -r, "rank": r, "query_comp": Q[i]})
    cands = pd.DataFrame(rows)
    comps = np.asarray(index.components())
    with_comp = cands.assign(doc_comp=[comps[int(d[1:])] for d in cands["docno"]])
    outs = [
        MoLReranker(index, mol)(cands),
        MoLReranker(str(index.index_path), mol)(cands),
        MoLReranker(None, mol, drop_doc_comp=True)(with_comp),
        MoLRetriever(index, mol, num_results=1000)(cands),  # a candidate frame is re-ranked
    ]
    for out in outs:
        assert len(out) == len(cands) and "doc_comp" not in out.columns
        for i in range(len(Q)):
            docnos, scores = ranked(out, f"q{i}")
            idx = np.array([int(d[1:]) for d in docnos])
            np.testing.assert_allclose(scores, phi[i, idx], atol=1e-5)
            assert np.all(np.diff(scores) <= 0)
            assert sorted(docnos) == sorted(cands.loc[cands["qid"] == f"q{i}", "docno"])
        pd.testing.assert_frame_equal(out, outs[0])
    top = (MoLReranker(index, mol) % 4)(cands)
    assert top.groupby("qid").size().max() == 4
    pd.testing.assert_frame_equal(top, outs[0][outs[0]["rank"] < 4].reset_index(drop=True))
    with pytest.raises(ValueError, match="not in MoLIndex"):
        MoLReranker(index, mol)(cands.assign(docno="nope"))


def test_input_errors(small, tmp_path):
    index, mol, Q = small
    ret = MoLRetriever(index, mol, num_results=5)
    with pytest.raises(pt.validate.InputValidationError, match=r"query_comp.*query_encoder"):
        ret(pd.DataFrame({"qid": ["1"], "query": ["x"]}))
    with pytest.raises(pt.validate.InputValidationError, match="doc_comp"):
        MoLReranker(None, mol)(query_frame(Q).assign(docno="d1"))
    with pytest.raises(ValueError, match=r"4 component embeddings, the MoL expects 3 per query"):
        ret(query_frame(unit(np.ones((2, PQ + 1, D)))))
    with pytest.raises(ValueError, match=r"dimension mismatch: query_comp of row 0 \(qid='q0'\) has 9-dim"):
        ret(query_frame(unit(np.ones((2, PQ, D + 1)))))
    with pytest.raises(ValueError, match="2-D"):
        ret(pd.DataFrame({"qid": ["1"], "query_comp": [np.ones(D)]}))
    with pytest.raises(ValueError, match="non-finite"):
        ret(query_frame(np.full((1, PQ, D), np.nan, np.float32)))
    with pytest.raises(ValueError, match=r"doc_comp of row 0 \(qid='q0', docno='d1'\) has 3 component"):
        MoLReranker(None, mol)(query_frame(Q).assign(docno="d1", doc_comp=[np.ones((3, D))] * len(Q)))
    # MoL / index mismatches and wrong objects
    with pytest.raises(ValueError, match=r"P_x = 3 of dim 8"):
        MoLRetriever(index, FakeMoL(PQ, 3, D))
    with pytest.raises(ValueError, match=r"of dim 4"):
        MoLRetriever(index, FakeMoL(PQ, PX, 4))
    with pytest.raises(TypeError, match="MixtureOfLogits-like"):
        MoLRetriever(index, object())
    dense = DenseIndex(tmp_path / "dense.flex").index([{"docno": f"x{i}", "doc_vec": np.ones(3) + i} for i in range(3)])
    with pytest.raises(TypeError, match="expected a pyterrier_prob.MoLIndex, got DenseIndex"):
        MoLRetriever(dense, mol)
    with pytest.raises(ValueError, match=r"type='dense_index'.*not a MoL index"):
        MoLRetriever(str(dense.index_path), mol)
    # parameters
    with pytest.raises(ValueError, match="method must be one of"):
        MoLRetriever(index, mol, method="topk")
    with pytest.raises(ValueError, match="n_avg applies to topk_avg and comb_topk"):
        MoLRetriever(index, mol, method="topk_per_embedding", n_avg=3)
    with pytest.raises(ValueError, match="n_per_embedding applies"):
        MoLRetriever(index, mol, method="exact", n_per_embedding=3)
    with pytest.raises(ValueError, match="gap_bound='loose'"):
        MoLRetriever(index, mol, method="topk_avg", gap_bound="loose")
    with pytest.raises(ValueError, match="num_results must be a positive int"):
        MoLRetriever(index, mol, num_results=0)


def test_num_results_beyond_index(small):
    index, mol, Q = small
    for method in METHODS:
        out = MoLRetriever(index, mol, method=method, num_results=100, gap_bound=True)(query_frame(Q))
        assert out.groupby("qid").size().tolist() == [60] * len(Q), method
        np.testing.assert_allclose(out["gap_bound"], 0.0)


# ---- the index ---------------------------------------------------------------------------------------------


def test_index_round_trip(small, tmp_path):
    index, mol, Q = small
    comps = np.asarray(index.components())
    again = MoLIndex(index.index_path)
    assert len(again) == 60 and again.num_components == PX and again.dim == D
    np.testing.assert_array_equal(np.asarray(again.components()), comps)
    np.testing.assert_allclose(np.asarray(again.means()), comps.mean(1), atol=1e-7)
    assert list(again.docno_array()[:3]) == ["d0", "d1", "d2"]
    np.testing.assert_array_equal(again.docids_of(["d5", "zz"]), [5, -1])
    assert isinstance(again.components(), np.memmap) and again.components().dtype == np.float32
    meta = again.meta
    assert (meta["type"], meta["format"], meta["doc_count"], meta["num_components"], meta["dim"]) == (
        "mol_index",
        "np",
        60,
        PX,
        D,
    )
    assert isinstance(MoLIndex.load(str(index.index_path)), MoLIndex)
    # records, lists and pipelines index the same
    recs = ({"docno": f"d{i}", "doc_comp": comps[i].tolist(), "text": "x"} for i in range(60))
    other = MoLIndex(tmp_path / "recs.mol").indexer().index(recs)
    np.testing.assert_array_equal(np.asarray(other.components()), comps)
    assert "mol_index" in repr(index.indexer()) or "MoLIndex" in repr(index.indexer())
    a = index.retriever(mol, method="exact", num_results=5)(query_frame(Q))
    b = MoLRetriever(other, mol, num_results=5)(query_frame(Q))
    pd.testing.assert_frame_equal(a.drop(columns="query_comp"), b.drop(columns="query_comp"))


def test_index_writes_are_atomic(tmp_path):
    path = tmp_path / "atomic.mol"
    rng = np.random.default_rng(0)

    def interrupted():
        for i in range(5000):
            if i == 4500:
                raise KeyboardInterrupt("simulated interruption")
            yield {"docno": f"d{i}", "doc_comp": rng.standard_normal((2, 4))}

    with pytest.raises(KeyboardInterrupt):
        MoLIndex(path).indexer().index(interrupted())
    assert not path.exists() and os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="no MoL index"):
        len(MoLIndex(path))
    two = [{"docno": "a", "doc_comp": np.ones((2, 4))}, {"docno": "b", "doc_comp": -np.ones((2, 4))}]
    MoLIndex(path).index(two)
    with pytest.raises(FileExistsError, match="overwrite"):
        MoLIndex(path).index(two)
    with pytest.raises(KeyboardInterrupt):
        MoLIndex(path).indexer(mode="overwrite").index(interrupted())
    assert len(MoLIndex(path)) == 2 and sorted(os.listdir(tmp_path)) == ["atomic.mol"]
    new = (
        MoLIndex(path)
        .indexer(mode="overwrite")
        .index([{"docno": f"b{i}", "doc_comp": np.ones((3, 5))} for i in range(3)])
    )
    assert (len(new), new.num_components, new.dim) == (3, 3, 5) and sorted(os.listdir(tmp_path)) == ["atomic.mol"]


def test_index_errors(tmp_path):
    def idx(recs):
        return MoLIndex(tmp_path / "a").index(recs)

    with pytest.raises(ValueError, match=r"lacks column\(s\) \['doc_comp'\].*doc_encoder"):
        MoLIndex(tmp_path / "a").index(pd.DataFrame({"docno": ["x"], "text": ["y"]}))
    with pytest.raises(ValueError, match="doc_comp"):
        idx([{"docno": "x", "text": "y"}])
    with pytest.raises(ValueError, match="inconsistent component shapes"):
        idx([{"docno": "x", "doc_comp": np.ones((2, 4))}, {"docno": "y", "doc_comp": np.ones((3, 4))}])
    with pytest.raises(ValueError, match="inconsistent component shapes"):
        idx([{"docno": "x", "doc_comp": np.ones((2, 4))}, {"docno": "y", "doc_comp": np.ones((2, 5))}])
    with pytest.raises(ValueError, match="2-D"):
        idx([{"docno": "x", "doc_comp": np.ones(4)}])
    with pytest.raises(ValueError, match="non-finite"):
        idx([{"docno": "x", "doc_comp": np.ones((2, 4))}, {"docno": "y", "doc_comp": np.full((2, 4), np.inf)}])
    with pytest.raises(ValueError, match="duplicate docno 'x'"):
        idx([{"docno": "x", "doc_comp": np.ones((2, 4))}] * 2)
    with pytest.raises(ValueError, match="nothing to index"):
        idx([])
    with pytest.raises(ValueError, match="at least 2 documents"):
        idx([{"docno": "x", "doc_comp": np.ones((2, 4))}])
    with pytest.raises(ValueError, match="docno must be a str"):
        idx([{"docno": 1, "doc_comp": np.ones((2, 4))}, {"docno": 2, "doc_comp": np.ones((2, 4))}])
    assert os.listdir(tmp_path) == []  # no failed run left anything behind
    good = idx([{"docno": "x", "doc_comp": np.ones((2, 4))}, {"docno": "y", "doc_comp": -np.ones((2, 4))}])
    # incomplete, corrupt and foreign directories
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "comps.f4").write_bytes(b"\0" * 32)
    with pytest.raises(ValueError, match="not a complete MoL index"):
        MoLIndex(tmp_path / "half").components()
    with open(good.index_path / "mean.f4", "ab") as f:
        f.write(b"\0" * 4)
    with pytest.raises(ValueError, match=r"corrupt: mean.f4 has 36 bytes"):
        len(MoLIndex(good.index_path))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "pt_meta.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        len(MoLIndex(tmp_path / "bad"))
    with pytest.raises(ValueError, match="is a file"):
        len(MoLIndex(tmp_path / "bad" / "pt_meta.json"))


# ---- the encoder (a fake model through a fake st_extensions.mol) --------------------------------------------


class FakeModel:
    """Deterministic 'encoder': each text becomes P unit vectors seeded by its characters."""

    def __init__(self, pq=PQ, px=PX, d=D):
        self.pq, self.px, self.d = pq, px, d
        self.calls = []

    def encode(self, texts, task):
        self.calls.append((task, list(texts)))
        P = self.pq if task == "query" else self.px
        out = []
        for t in texts:
            rng = np.random.default_rng(sum(map(ord, t)) + 1000 * len(t))
            base = rng.standard_normal(self.d)
            out.append(unit(base + 0.5 * rng.standard_normal((P, self.d))))
        return np.stack(out) if out else np.zeros((0, P, self.d), np.float32)


@pytest.fixture
def fake_st_mol(monkeypatch):
    mol = FakeMoL(PQ, PX, D, seed=7)
    fake = types.ModuleType("st_extensions.mol")
    fake.encode_components = lambda model, texts, task="query", batch_size=32: model.encode(texts, task)
    fake.find_mol = lambda model: mol
    monkeypatch.setitem(sys.modules, "st_extensions.mol", fake)
    return mol


DOCS = ["vitamin d and bones", "statins and muscles", "diet and cancer", "sleep and memory", "coffee and heart"]


def test_encoder_end_to_end(fake_st_mol, tmp_path):
    model = FakeModel()
    enc = MoLEncoder(model, batch_size=2)
    assert enc.mol is fake_st_mol
    docs = pd.DataFrame({"docno": [f"doc{i}" for i in range(5)], "text": DOCS})
    d = enc.doc_encoder()(docs)
    assert d["doc_comp"].iloc[0].shape == (PX, D) and d["doc_comp"].iloc[0].dtype == np.float32
    index = (enc.doc_encoder() >> MoLIndex(tmp_path / "enc.mol").indexer()).index(docs.to_dict("records"))
    np.testing.assert_array_equal(np.asarray(index.components()), np.stack(d["doc_comp"]))
    q = pd.DataFrame({"qid": ["1", "2", "3"], "query": [DOCS[1], DOCS[3], DOCS[1]]})
    qc = enc.query_encoder()(q)
    assert qc["query_comp"].iloc[0].shape == (PQ, D)
    assert model.calls[-1] == ("query", sorted({DOCS[1], DOCS[3]}))  # identical texts encoded once
    res = (enc.query_encoder() >> MoLRetriever(index, enc.mol, method="exact", num_results=3))(q)
    assert res.groupby("qid").size().tolist() == [3, 3, 3]
    bf = (enc.query_encoder() >> MoLRetriever(index, enc.mol, method="brute_force", num_results=3))(q)
    pd.testing.assert_frame_equal(res.drop(columns="query_comp"), bf.drop(columns="query_comp"))
    # text_scorer re-ranks text candidates = MoLReranker over the index
    cands = res.drop(columns="query_comp").merge(docs, on="docno")
    scored = enc.text_scorer()(cands.drop(columns=["score", "rank"]))
    from_index = (enc.query_encoder() >> MoLReranker(index, enc.mol))(cands.drop(columns=["score", "rank"]))
    assert "doc_comp" not in scored.columns
    pd.testing.assert_frame_equal(
        scored[["qid", "docno", "score", "rank"]], from_index[["qid", "docno", "score", "rank"]], atol=1e-6
    )
    assert "MoLEncoder" in repr(enc.query_encoder())


def test_gate_features(tmp_path):
    """A gate with side features (App. A.3): features are indexed, read from the frame and passed to the MoL."""
    rng = np.random.default_rng(3)
    F = 5
    comps, feats = unit(rng.standard_normal((N, PX, D))), rng.standard_normal((N, F)).astype(np.float32)
    Q, Qf = unit(rng.standard_normal((NQ, PQ, D))), rng.standard_normal((NQ, F)).astype(np.float32)
    mol = FeatMoL(PQ, PX, D, F, seed=1)
    docs = pd.DataFrame({"docno": [f"d{i}" for i in range(N)], "doc_comp": list(comps), "doc_feat": list(feats)})
    index = MoLIndex(tmp_path / "feat.mol").index(docs)
    assert index.feature_dim == F
    np.testing.assert_array_equal(np.asarray(index.features()), feats)
    with torch.no_grad():
        phi = mol.score_all(torch.from_numpy(Q), torch.from_numpy(comps), torch.from_numpy(Qf), torch.from_numpy(feats))
    phi = phi.double().numpy()
    queries = query_frame(Q).assign(query_feat=list(Qf))
    for method in ("exact", "brute_force"):
        out = MoLRetriever(index, mol, method=method, num_results=K)(queries)
        for i in range(NQ):
            want = np.argsort(-phi[i], kind="stable")[:K]
            docnos, scores = ranked(out, f"q{i}")
            assert docnos == [f"d{j}" for j in want], (method, i)
            np.testing.assert_allclose(scores, phi[i, want], atol=1e-5)
    cands = out.drop(columns=["score", "rank"]).merge(docs, on="docno")
    a = MoLReranker(index, mol)(cands)
    b = MoLReranker(None, mol)(cands)
    pd.testing.assert_frame_equal(a, b)
    np.testing.assert_allclose(
        a["score"], [phi[int(q[1:]), int(d[1:])] for q, d in zip(a["qid"], a["docno"])], atol=1e-5
    )
    # missing pieces
    with pytest.raises(pt.validate.InputValidationError, match="query_feat"):
        MoLRetriever(index, mol)(query_frame(Q))
    with pytest.raises(pt.validate.InputValidationError, match="doc_feat"):
        MoLReranker(None, mol)(cands.drop(columns="doc_feat"))
    with pytest.raises(ValueError, match="dimension mismatch: query_feat has 4 dims"):
        MoLRetriever(index, mol)(query_frame(Q).assign(query_feat=list(Qf[:, :4])))
    plain = make_index(tmp_path / "plain.mol", comps)
    with pytest.raises(ValueError, match="reads document features .* holds none"):
        MoLRetriever(plain, mol)
    with pytest.raises(ValueError, match=r"lacks doc_feat: give gate features \(doc_feat\) for all documents or none"):
        MoLIndex(tmp_path / "mixed.mol").index(
            [{"docno": "a", "doc_comp": comps[0], "doc_feat": feats[0]}, {"docno": "b", "doc_comp": comps[1]}]
        )


def test_encoder_with_gate_features(monkeypatch, tmp_path):
    F = 6
    mol = FeatMoL(PQ, PX, D, F, seed=2)
    model = FakeModel()

    def encode_components(model, texts, task="query", batch_size=32, return_features=False):
        comps = model.encode(texts, task)
        feats = np.stack([np.full(F, len(t) / 10, np.float32) for t in texts])
        return (comps, feats) if return_features else comps

    fake = types.ModuleType("st_extensions.mol")
    fake.encode_components, fake.find_mol = encode_components, lambda model: mol
    monkeypatch.setitem(sys.modules, "st_extensions.mol", fake)
    enc = MoLEncoder(model)
    docs = pd.DataFrame({"docno": [f"doc{i}" for i in range(5)], "text": DOCS})
    d = enc.doc_encoder()(docs)
    assert d["doc_feat"].iloc[0].shape == (F,)
    index = (enc.doc_encoder() >> MoLIndex(tmp_path / "f.mol").indexer()).index(docs.to_dict("records"))
    assert index.feature_dim == F
    q = pd.DataFrame({"qid": ["1", "2"], "query": [DOCS[0], "heart"]})
    assert "query_feat" in enc.query_encoder()(q).columns
    assert {"query_comp", "query_feat"} <= set(enc.query_encoder()(q.iloc[:0]).columns)
    ex = (enc.query_encoder() >> MoLRetriever(index, mol, method="exact", num_results=3))(q)
    bf = (enc.query_encoder() >> MoLRetriever(index, mol, method="brute_force", num_results=3))(q)
    pd.testing.assert_frame_equal(
        ex.drop(columns=["query_comp", "query_feat"]), bf.drop(columns=["query_comp", "query_feat"])
    )
    scored = enc.text_scorer()(ex.drop(columns=["score", "rank"]).merge(docs, on="docno"))
    np.testing.assert_allclose(np.sort(scored["score"].to_numpy()), np.sort(ex["score"].to_numpy()), atol=1e-6)


def test_exports():
    for name in ("MoLIndex", "MoLEncoder", "MoLRetriever", "MoLReranker"):
        assert name in pyterrier_prob.__all__ and getattr(pyterrier_prob, name) is not None


def test_with_the_real_mol_module(base_model, tmp_path):
    """End to end with st_extensions.mol's MixtureOfLogits (heads on MiniLM, gate with side features)."""
    st_mol = pytest.importorskip("st_extensions.mol")
    model = st_mol.build_mol_model(
        base_model, num_query_components=2, num_doc_components=3, component_source="heads", gate_features=True
    )
    enc = MoLEncoder(model, batch_size=8)
    assert enc.gate_features
    docs = pd.DataFrame(
        {"docno": [f"d{i}" for i in range(12)], "text": [f"{t} number {i}" for i, t in enumerate(DOCS * 3)][:12]}
    )
    index = (enc.doc_encoder() >> MoLIndex(tmp_path / "real.mol").indexer()).index(docs.to_dict("records"))
    assert (index.num_components, index.dim, index.feature_dim) == (3, enc.mol.component_dim, enc.mol.embedding_dim)
    q = pd.DataFrame({"qid": ["1", "2"], "query": ["statins", "vitamin d bones"]})
    bf = (enc.query_encoder() >> MoLRetriever(index, enc.mol, method="brute_force", num_results=4))(q)
    for method in ("exact", "comb_topk"):
        kw = {"n_per_embedding": 12} if method == "comb_topk" else {}  # every item: exact too
        out = (enc.query_encoder() >> MoLRetriever(index, enc.mol, method=method, num_results=4, **kw))(q)
        pd.testing.assert_frame_equal(out[["qid", "docno", "rank"]], bf[["qid", "docno", "rank"]], check_dtype=False)
        np.testing.assert_allclose(out["score"], bf["score"], atol=1e-5)
    scored = enc.text_scorer()(bf.drop(columns=["score", "rank", "query_comp", "query_feat"]).merge(docs, on="docno"))
    np.testing.assert_allclose(
        scored.sort_values(["qid", "docno"])["score"], bf.sort_values(["qid", "docno"])["score"], atol=1e-5
    )


# ---- approximate candidate searches (pyterrier_prob.index.search) ------------------------------------------------


@pytest.mark.parametrize("method", ["topk_per_embedding", "topk_avg", "comb_topk"])
def test_searcher_probing_every_list_equals_the_exhaustive_candidates(method, tmp_path):
    """An IVF candidate stage that probes every list finds the same candidates as the exhaustive scan."""
    index, mol, Q = random_case(6, tmp_path)
    kw = {"n_avg": 20} if method == "topk_avg" else {"n_per_embedding": 20}
    exhaustive = MoLRetriever(index, mol, method=method, num_results=K, **kw)(query_frame(Q))
    ivf = {"backend": "ivf_flat", "nlist": 4, "nprobe": 4, "train_size": N}
    approx = MoLRetriever(index, mol, method=method, num_results=K, searcher=ivf, **kw)(query_frame(Q))
    pd.testing.assert_frame_equal(exhaustive[["qid", "docno", "rank"]], approx[["qid", "docno", "rank"]])
    np.testing.assert_allclose(exhaustive["score"], approx["score"], atol=1e-6)
    assert (index.index_path / "faiss" / "mean").is_dir()


def test_exact_stays_exact_on_an_approximate_first_pass(tmp_path):
    """Algorithm 1 with a one-probe IVF pass 1: the exhaustive range pass 2 still makes the top K exact."""
    index, mol, Q = random_case(7, tmp_path)
    phi = brute(mol, index, Q)
    one_probe = {"backend": "ivf_flat", "nlist": 4, "nprobe": 1, "train_size": N}
    ex = MoLRetriever(index, mol, method="exact", num_results=K, searcher=one_probe)(query_frame(Q))
    for i in range(NQ):
        assert ranked(ex, f"q{i}")[0] == [f"d{j}" for j in np.argsort(-phi[i], kind="stable")[:K]]
    shallow = MoLRetriever(index, mol, method="topk_avg", num_results=K, n_avg=K, searcher=one_probe)(query_frame(Q))
    for i in range(NQ):  # an approximate candidate list, re-scored: true MoL scores of the documents it found
        docnos, scores = ranked(shallow, f"q{i}")
        np.testing.assert_allclose(scores, phi[i, [int(d[1:]) for d in docnos]], atol=1e-5)


def test_searcher_argument_errors(tmp_path):
    index, mol, _ = random_case(8, tmp_path)
    with pytest.raises(ValueError, match="searcher must be a dict with 'backend'"):
        MoLRetriever(index, mol, method="topk_avg", searcher="hnsw")
    with pytest.raises(ValueError, match="gap_bound certifies the top K only over exact candidate searches"):
        MoLRetriever(index, mol, method="topk_avg", gap_bound=True, searcher={"backend": "hnsw"})
    with pytest.raises(ValueError, match="part must be 'mean' or a component in 0..1"):
        index.searcher(5)
    with pytest.raises(ValueError, match="backend must be one of"):
        MoLRetriever(index, mol, method="topk_avg", searcher={"backend": "annoy"})


def test_searcher_takes_a_searcher_per_part(tmp_path):
    """searcher= also takes {part: Searcher} (here MoLIndex.searcher's exact scans): the exhaustive result."""
    index, mol, Q = random_case(9, tmp_path)
    kw = {"method": "comb_topk", "num_results": K, "n_per_embedding": 20}
    ref = MoLRetriever(index, mol, **kw)(query_frame(Q))
    parts = {p: index.searcher(p) for p in [*range(index.num_components), "mean"]}
    out = MoLRetriever(index, mol, searcher=parts, **kw)(query_frame(Q))
    pd.testing.assert_frame_equal(ref[["qid", "docno", "rank"]], out[["qid", "docno", "rank"]])
    np.testing.assert_allclose(ref["score"], out["score"], atol=1e-6)
    with pytest.raises(ValueError, match=r"no Searcher for the parts \['mean'\]"):
        MoLRetriever(index, mol, method="topk_avg", searcher={0: parts[0]})
    with pytest.raises(ValueError, match="searcher covers 5 x 8 vectors"):
        MoLRetriever(index, mol, method="topk_avg", searcher={"mean": ExactSearcher(np.zeros((5, D), np.float32))})
