"""Per-query re-ranking depth: the convention (re-ranked head, then the first stage's tail), the rules fitted on dev
(fixed, statistic at a mean depth, conformal recall), the oracle depth and the PyTerrier stage, on small runs whose
answers are known."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyterrier as pt
import pytest

from pyterrier_prob.rerank_depth import (
    ConformalRecallDepth,
    DepthRerank,
    FixedDepth,
    StatisticDepth,
    oracle_depths,
    rerank_at_depths,
)


def _run(n_q: int = 3, n: int = 6, seed: int = 0) -> pd.DataFrame:
    """``n`` candidates per query, first-stage scores decreasing with rank, a query text, and a re-ranker column
    ``ce`` that reverses the first stage's order."""
    rng = np.random.default_rng(seed)
    rows = []
    for q in range(n_q):
        scores = np.sort(rng.uniform(0, 10, n))[::-1]
        for r in range(n):
            rows.append({"qid": f"q{q}", "query": f"text {q}", "docno": f"d{q}-{r}", "score": scores[r], "rank": r})
    run = pd.DataFrame(rows)
    return run.assign(ce=run["rank"].astype(float))  # the deeper, the better for the re-ranker


def test_convention_head_reranked_then_the_tail_in_first_stage_order():
    run = _run()
    out = rerank_at_depths(run, run["ce"], pd.Series({"q0": 3, "q1": 0, "q2": 6}))
    q0 = out[out["qid"] == "q0"]
    assert q0["docno"].tolist() == ["d0-2", "d0-1", "d0-0", "d0-3", "d0-4", "d0-5"]
    assert q0["reranked"].tolist() == [True] * 3 + [False] * 3
    assert out[out["qid"] == "q1"]["docno"].tolist() == [f"d1-{r}" for r in range(6)]  # depth 0: the first stage
    assert out[out["qid"] == "q2"]["docno"].tolist() == [f"d2-{r}" for r in range(5, -1, -1)]
    assert len(out) == len(run) and (out.groupby("qid")["rank"].apply(list) == [list(range(6))] * 3).all()
    for _, g in out.groupby("qid"):  # scores strictly decreasing down each final list: the ranks and scores agree
        assert (np.diff(g["score"].to_numpy()) < 0).all()
    with pytest.raises(ValueError, match="no re-ranker score"):
        rerank_at_depths(run, run["ce"].where(run["rank"] != 1), 3)


def test_fixed_and_statistic_depths():
    run = _run(n_q=4, n=10)
    assert FixedDepth(4).depths(run).tolist() == [4, 4, 4, 4]
    assert FixedDepth(40).depths(run).tolist() == [10] * 4  # never beyond the list
    rule = StatisticDepth("zscore", mean_depth=5, max_depth=10).fit(run)
    depths = rule.depths(run)
    assert depths.mean() == pytest.approx(5, abs=0.25)  # the dev run's own mean depth, up to ties
    z = pd.Series(run.groupby("qid")["score"].transform(lambda s: (s - s.mean()) / s.std(ddof=0)).to_numpy())
    # scores decrease down each list, so z does: the depth counts the rows at or above the level (within 1e-9)
    above, below = (z > rule.level + 1e-9).groupby(run["qid"]).sum(), (z >= rule.level - 1e-9).groupby(run["qid"]).sum()
    assert (above <= depths).all() and (depths <= below).all()
    with pytest.raises(ValueError, match="one of mean_depth"):
        StatisticDepth("zscore")
    with pytest.raises(ValueError, match="not fitted"):
        StatisticDepth("score", mean_depth=3).depths(run)


def test_conformal_recall_depth_keeps_its_promise_on_calibration():
    """The relevant documents of each query sit at known ranks among its top 10; the rank rule's depth is the
    shallowest fixed k whose conformal bound n/(n+1) mean(1 - recall) + 1/(n+1) <= 1 - target holds."""
    run = _run(n_q=20, n=10, seed=1)
    rng = np.random.default_rng(2)
    rel = [(f"q{q}", f"d{q}-{r}", 1) for q in range(20) for r in rng.choice(10, size=2, replace=False)]
    rel += [("q0", "d0-outside", 1)]  # beyond the first stage's list: not counted
    qrels = pd.DataFrame(rel, columns=["qid", "docno", "label"])
    target = 0.8
    rule = ConformalRecallDepth(target, "rank", max_depth=10).fit(run, qrels)
    k = int(rule.depths(run).iloc[0])
    assert (rule.depths(run) == k).all()

    def bound(k: int) -> float:
        kept = qrels[qrels["docno"].str.split("-").str[1].isin([str(r) for r in range(k)])].groupby("qid").size()
        recall = kept.reindex([f"q{q}" for q in range(20)]).fillna(0) / 2
        return 20 / 21 * float((1 - recall).mean()) + 1 / 21

    assert bound(k) <= 1 - target < bound(k - 1)
    assert rule.fixed_k == k  # the promise's fixed depth, read from the level (a short list does not hide it)
    short = run[~((run["qid"] == "q0") & (run["rank"] >= 1))]  # q0's list: one document
    assert int(rule.depths(short).iloc[0]) == 1 and rule.fixed_k == k
    adaptive = ConformalRecallDepth(target, "zscore", max_depth=10).fit(run, qrels)
    assert adaptive.reachable and adaptive.depths(run).between(1, 10).all() and adaptive.fixed_k is None
    with pytest.raises(ValueError, match="needs the calibration queries' qrels"):
        ConformalRecallDepth(0.9).fit(run)


def test_oracle_depth_is_the_shallowest_with_the_full_value():
    """A re-ranker that puts each query's relevant document first once it is in the head: the oracle depth is its
    first-stage rank + 1; a query with no relevant candidate needs no re-ranking (depth 0)."""
    run = _run(n_q=3, n=6)
    qrels = pd.DataFrame({"qid": ["q0", "q1"], "docno": ["d0-5", "d1-2"], "label": [1, 1]})
    ce = run["docno"].isin(qrels["docno"]).astype(float)  # ties keep the first stage's order
    assert oracle_depths(run, ce, qrels, max_depth=6).to_dict() == {"q0": 6, "q1": 3, "q2": 0}
    reverse = oracle_depths(run, run["ce"], qrels, max_depth=6)  # reversing: only the full depth gives its value
    assert reverse.to_dict() == {"q0": 6, "q1": 6, "q2": 0}


def test_depth_rerank_stage_in_a_pipeline():
    run = _run(n_q=3, n=8)
    seen = []

    def ce(frame: pd.DataFrame) -> pd.DataFrame:
        seen.append(len(frame))
        return frame.assign(score=frame["rank"].astype(float))

    stage = DepthRerank(FixedDepth(3), pt.apply.generic(ce))
    out = stage(run)
    assert seen == [9] and stage.pairs_scored == 9  # 3 queries x depth 3
    expected = rerank_at_depths(run, run["ce"], 3)
    pd.testing.assert_frame_equal(out[["qid", "docno", "rank"]], expected[["qid", "docno", "rank"]])
    top2 = (pt.Transformer.from_df(run, uniform=True) >> stage % 2)(run[["qid", "query"]].drop_duplicates())
    assert top2.groupby("qid").size().tolist() == [2, 2, 2]
    assert stage.fuse_rank_cutoff(2).num_results == 2 and "reranker" in stage.subtransformers()
    with pytest.raises(TypeError, match="rule must be a DepthRule"):
        DepthRerank(3, pt.apply.generic(ce))


def test_learned_depth_fits_a_depth_the_features_predict():
    """Queries whose first-stage top score stands far above the rest have a shallow oracle depth and the others a
    deep one: the cross-validated ridge regression on the list features learns it (test queries from the same law),
    and the scale matches a dev mean depth."""
    from pyterrier_prob.rerank_depth import LearnedDepth

    rng = np.random.default_rng(0)

    def runs(n_q: int, offset: int):
        rows, oracle = [], {}
        for q in range(n_q):
            peaked = q % 2 == 0
            scores = np.sort(rng.normal(0, 1, 30))[::-1] + np.r_[6.0 if peaked else 0.0, np.zeros(29)]
            qid = f"q{offset + q}"
            rows += [{"qid": qid, "docno": f"{qid}-{r}", "score": s, "rank": r} for r, s in enumerate(scores)]
            oracle[qid] = 2 if peaked else 25
        return pd.DataFrame(rows), pd.Series(oracle)

    dev, dev_oracle = runs(40, 0)
    test, test_oracle = runs(20, 100)
    rule = LearnedDepth(max_depth=30).fit(dev, oracle=dev_oracle)
    depths = rule.depths(test)
    assert (depths[test_oracle.index[test_oracle == 2]] <= 6).all() and (depths[test_oracle == 25] >= 15).all()
    matched = LearnedDepth(mean_depth=10, max_depth=30).fit(dev, oracle=dev_oracle)
    assert matched.depths(dev).mean() == pytest.approx(10, abs=1.0)
    with pytest.raises(ValueError, match="oracle depths"):
        LearnedDepth().fit(dev)


def test_first_pass_depth_sends_the_uncertain_queries_deep():
    from pyterrier_prob.rerank_depth import FirstPassDepth

    run = _run(n_q=4, n=20)
    std = run["qid"].map({"q0": 0.1, "q1": 0.9, "q2": 0.2, "q3": 0.8})
    run = run.assign(first_pass_std=np.where(run["rank"] < 5, std, np.nan))
    rule = FirstPassDepth(prefix=5, mean_depth=12.5, max_depth=20).fit(run)  # half of the queries go deep
    assert rule.depths(run).to_dict() == {"q0": 5, "q1": 20, "q2": 5, "q3": 20}
    with pytest.raises(ValueError, match="reads the first pass's column"):
        rule.depths(run.drop(columns=["first_pass_std"]))


def test_eet_closed_forms():
    from pyterrier_prob.rerank_depth import eet

    q, q1, k = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.4, 0.2]), np.array([10, 50, 0])
    # beta 0: the gain over the first stage's order alone, clipped at 0
    np.testing.assert_allclose(eet(q, q1, k, beta=0.0), [0.3, 0.0, 0.0])
    # beta 1: the harmonic mean of the gain and exp(alpha k); a depth of 0 counts as 1
    e, f = 0.3, np.exp(-0.001 * 10)
    np.testing.assert_allclose(eet(q, q1, k, beta=1.0), [2 * e * f / (e + f), 0.0, 0.0])
    # beta 2, and a larger beta tends to the efficiency
    np.testing.assert_allclose(eet(q, q1, k, beta=2.0)[0], 5 * e * f / (4 * e + f))
    assert abs(eet(q, q1, k, beta=1e4)[0] - f) < 1e-6
    with pytest.raises(ValueError, match="alpha"):
        eet(q, q1, k, alpha=0.1)
