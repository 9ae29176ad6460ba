"""The pEBR cutoff study (#13): truncation rules, matched depth, oracle and conformal recall, against brute force."""

import itertools

import numpy as np
import pandas as pd
import pytest

from pyterrier_prob.pebr.rlt import (
    RecallTargetCutoff,
    conformal_recall_level,
    law_stat,
    level_for_depth,
    mean_measures,
    mixture_stat,
    oracle_runs,
    zscore_stat,
)


def _ranked(scores_per_query):
    rows = []
    for q, scores in enumerate(scores_per_query):
        for r, s in enumerate(sorted(scores, reverse=True)):
            rows.append((f"q{q}", f"d{q}_{r}", float(s), r))
    return pd.DataFrame(rows, columns=["qid", "docno", "score", "rank"])


def test_level_for_depth_matches_the_mean_depth():
    rng = np.random.default_rng(0)
    stat = rng.normal(size=1000)
    for k in (1, 7, 50, 100):
        lam = level_for_depth(stat, n_queries=10, k=k)
        assert (stat >= lam).sum() == 10 * k


def test_zscore_statistic_against_a_loop():
    rng = np.random.default_rng(1)
    ranked = _ranked([rng.normal(size=30), rng.normal(2, 3, size=30), np.full(30, 0.5)])
    z = zscore_stat(ranked, top=10)
    for i, row in ranked.iterrows():
        top = ranked[(ranked["qid"] == row["qid"]) & (ranked["rank"] < 10)]["score"].to_numpy()
        sd = top.std() if top.std() > 0 else 1.0
        assert z[i] == pytest.approx((row["score"] - top.mean()) / sd)


def test_law_statistic_keeps_exactly_the_rows_above_the_cdf_cutoff():
    from st_extensions.distributions import BetaCosine

    rng = np.random.default_rng(2)
    ranked = _ranked([rng.uniform(-0.2, 0.8, size=40) for _ in range(3)])
    law = BetaCosine(np.array([3.0, 8.0, 20.0]), np.array([2.0, 3.0, 5.0]))
    stat = law_stat(ranked, law)
    for p in (0.1, 0.5, 0.9):
        cut = law.cutoff(p)
        brute = ranked["score"].to_numpy() >= cut[ranked["qid"].str[1:].astype(int).to_numpy()]
        assert np.array_equal(stat >= -p, brute)


def test_score_distribution_fit_separates_a_normal_cluster_from_an_exponential_tail():
    rng = np.random.default_rng(3)
    rel = rng.normal(0.5, 0.03, size=6)
    non = rng.exponential(0.05, size=94)
    ranked = _ranked([np.concatenate([rel, non])])
    post = mixture_stat(ranked, top=100)
    kept = ranked["score"].to_numpy()[post >= 0.5]
    # the 6 cluster scores (around 0.5) are kept, the exponential bulk (mean 0.05) is not
    assert len(kept) >= 5 and kept.min() > 0.3
    assert np.all(np.diff(post) <= 1e-12)  # a truncation: non-increasing down the list


def test_oracle_depth_is_feasible_and_close_to_the_brute_force_optimum():
    rng = np.random.default_rng(4)
    lists = [rng.uniform(size=8) for _ in range(3)]
    ranked = _ranked(lists)
    is_rel = rng.uniform(size=len(ranked)) < 0.35
    qidx = ranked["qid"].str[1:].astype(int).to_numpy()
    n_rel = np.bincount(qidx[is_rel], minlength=3) + 1  # one relevant document below every list
    ranks = ranked["rank"].to_numpy()
    for k in (1, 2, 4):
        run = oracle_runs(ranked, is_rel, qidx, n_rel, k, 3)
        depth = run.groupby("qid").size().reindex(["q0", "q1", "q2"], fill_value=0).to_numpy()
        assert depth.sum() <= 3 * k
        got = sum(((qidx == q) & is_rel & (ranks < depth[q])).sum() / n_rel[q] for q in range(3))
        best = max(
            sum(((qidx == q) & is_rel & (ranks < d[q])).sum() / n_rel[q] for q in range(3))
            for d in itertools.product(range(9), repeat=3)
            if sum(d) <= 3 * k
        )
        largest_step = max(1.0 / n for n in n_rel)
        assert best - largest_step - 1e-12 <= got <= best + 1e-12


def _synthetic_queries(rng, n_queries, length=200):
    """Exchangeable queries: 1-10 relevant documents whose statistic is shifted up by a query-specific amount."""
    qidx, stat, is_rel, n_rel = [], [], [], []
    for q in range(n_queries):
        n = int(rng.integers(1, 11))
        shift = rng.uniform(0.5, 3.0)
        s = np.concatenate([rng.normal(shift, 1.0, size=n), rng.normal(0.0, 1.0, size=length - n)])
        qidx.append(np.full(length, q))
        stat.append(s)
        is_rel.append(np.r_[np.ones(n, bool), np.zeros(length - n, bool)])
        n_rel.append(n + int(rng.integers(0, 2)))  # sometimes a relevant document outside the list
    return np.concatenate(qidx), np.concatenate(stat), np.concatenate(is_rel), np.array(n_rel)


@pytest.mark.parametrize("target", [0.5, 0.8, 0.9])
def test_conformal_recall_level_covers_the_target_on_exchangeable_queries(target):
    rng = np.random.default_rng(5)
    achieved = []
    for _ in range(200):
        cq, cs, cr, cn = _synthetic_queries(rng, 100)
        lam, ok = conformal_recall_level(cs, cq, cr, cn, target)
        tq, ts, tr, tn = _synthetic_queries(rng, 100)
        achieved.append(mean_measures(tq, tr, tn, ts >= lam, 100)[1])
    achieved = np.array(achieved)
    # Conformal risk control guarantees E[recall] >= target for a new query; the mean over 200 x 100 test queries
    # has a standard error of about achieved.std() / sqrt(200) ~ 0.002-0.003 here, so 0.01 is ~4 standard errors.
    assert achieved.mean() >= target - 0.01
    # and it is not wastefully conservative: the finite-sample correction costs about (1 - target) / n
    assert achieved.mean() <= target + 0.05


def test_conformal_recall_level_reports_unreachable_targets():
    qidx = np.array([0, 0, 1, 1])
    stat = np.array([2.0, 1.0, 2.0, 1.0])
    is_rel = np.array([True, False, True, False])
    n_rel = np.array([4, 4])  # most relevant documents are outside the lists: recall at most 0.25
    lam, ok = conformal_recall_level(stat, qidx, is_rel, n_rel, 0.9)
    assert lam == -np.inf and not ok
    with pytest.raises(ValueError, match="no calibration query has a relevant document"):
        conformal_recall_level(stat, qidx, is_rel, np.array([0, 0]), 0.5)


def test_recall_target_cutoff_is_a_fitted_pipeline_stage():
    import pyterrier as pt

    rng = np.random.default_rng(6)
    cq, cs, cr, cn = _synthetic_queries(rng, 60, length=50)
    run = pd.DataFrame({"qid": [f"c{q}" for q in cq], "docno": [f"d{i}" for i in range(len(cq))], "score": cs})
    run["rank"] = run.groupby("qid")["score"].rank(ascending=False, method="first").astype(int) - 1
    qrels = pd.DataFrame({"qid": run["qid"][cr], "docno": run["docno"][cr], "label": 1})
    cut = RecallTargetCutoff(0.8).fit(run, qrels)
    assert cut.reachable_ and np.isfinite(cut.level_)
    out = (pt.Transformer.identity() >> cut)(run)
    assert (out["score"] >= cut.level_).all() and len(out) == int((run["score"] >= cut.level_).sum())
    # what it keeps is a prefix of every list
    assert (out.groupby("qid")["rank"].max() + 1 == out.groupby("qid").size()).all()
    # int qids and docnos stay ints (and every column as it came in), rows in the same order as with str ones
    as_int = run.assign(qid=run["qid"].str[1:].astype(int), docno=run["docno"].str[1:].astype(int), extra=1.5)
    out_int = cut(as_int)
    assert out_int["qid"].dtype == np.int64 and out_int["docno"].dtype == np.int64
    assert list(out_int.columns) == list(as_int.columns)
    assert (("c" + out_int["qid"].astype(str)).tolist(), ("d" + out_int["docno"].astype(str)).tolist()) == (
        out["qid"].tolist(),
        out["docno"].tolist(),
    )
    with pytest.raises(ValueError, match="not fitted"):
        RecallTargetCutoff(0.5)(run)
    with pytest.raises(ValueError, match="target must be a recall"):
        RecallTargetCutoff(1.5)
    with pytest.raises(ValueError, match="missing"):
        cut(run.drop(columns="rank"))


def test_likelihood_ratio_statistic_is_the_running_minimum_of_the_log_ratio():
    from pyterrier_prob.experiments.pebr_cutoffs import lr_stat
    from st_extensions.distributions import BetaCosine

    rng = np.random.default_rng(7)
    ranked = _ranked([rng.uniform(-0.5, 0.9, size=25) for _ in range(3)])
    rel = BetaCosine(np.array([8.0, 5.0, 12.0]), np.array([2.0, 3.0, 4.0]))
    irr = BetaCosine(np.array([2.0, 3.0, 2.5]), np.array([2.0, 2.0, 3.0]))
    stat = lr_stat(ranked, rel, irr)
    for q in range(3):
        rows = ranked["qid"] == f"q{q}"
        x = ranked.loc[rows, "score"].to_numpy()
        one_rel, one_irr = BetaCosine(rel.alpha[q], rel.beta[q]), BetaCosine(irr.alpha[q], irr.beta[q])
        llr = np.asarray(one_rel.logpdf(x)) - np.asarray(one_irr.logpdf(x))
        np.testing.assert_allclose(stat[rows.to_numpy()], np.minimum.accumulate(llr), rtol=1e-9, atol=1e-9)


def test_list_features_against_a_loop():
    from pyterrier_prob.pebr.rlt import list_features

    rng = np.random.default_rng(8)
    lists = [rng.uniform(-0.3, 0.9, size=n) for n in (3, 40, 12)]
    ranked = _ranked(lists)
    feats = list_features(ranked, top=10)
    assert list(feats.columns) == ["logit_top1", "logit_mean_top"] and len(feats) == 3
    for q, scores in enumerate(lists):
        s = np.sort(scores)[::-1]
        z1, zm = (1 + s[0]) / 2, np.mean((1 + s[:10]) / 2)
        assert feats["logit_top1"][q] == pytest.approx(np.log(z1 / (1 - z1)))
        assert feats["logit_mean_top"][q] == pytest.approx(np.log(zm / (1 - zm)))
    assert len(list_features(ranked.iloc[:0])) == 0
    with pytest.raises(ValueError, match="top must be a positive int"):
        list_features(ranked, top=0)


def test_recall_gain_statistic_against_a_loop():
    from pyterrier_prob.pebr.rlt import gain_stat
    from st_extensions.distributions import BetaCosine

    rng = np.random.default_rng(9)
    lists = [rng.uniform(-0.2, 0.8, size=n) for n in (1, 7, 30)]
    ranked = _ranked(lists)
    law = BetaCosine(np.array([6.0, 9.0, 14.0]), np.array([3.0, 2.0, 5.0]))
    w = 3
    stat = gain_stat(ranked, law, window=w)
    for q, scores in enumerate(lists):
        s = np.sort(scores)[::-1]
        one = BetaCosine(law.alpha[q], law.beta[q])
        raw = []
        for j in range(len(s)):
            lo, hi = max(j - w, 0), min(j + w, len(s) - 1)
            # the relevant law's mass between the scores w ranks above and below, per document
            raw.append(0.0 if hi == lo else (one.cdf(s[lo]) - one.cdf(s[hi])) / (hi - lo))
        rows = (ranked["qid"] == f"q{q}").to_numpy()
        np.testing.assert_allclose(stat[rows], np.minimum.accumulate(raw), rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="window must be a positive int"):
        gain_stat(ranked, law, window=0)


def test_conformal_resplits_against_explicit_splits():
    from pyterrier_prob.pebr.rlt import conformal_resplits

    rng = np.random.default_rng(10)
    qidx, stat, is_rel, n_rel = _synthetic_queries(rng, 40, length=30)
    n_rel[3] = 0  # a query without a relevant document is in neither half
    is_rel[qidx == 3] = False
    got = conformal_resplits(stat, qidx, is_rel, n_rel, 0.8, n_cal=20, seeds=5, seed=3)
    has = np.flatnonzero(n_rel > 0)
    perm_rng = np.random.default_rng(3)  # the function's documented generator
    for b in range(5):
        cal_q = perm_rng.permutation(has)[:20]
        test_q = np.setdiff1d(has, cal_q)
        cal_rows = np.isin(qidx, cal_q)
        cal_map = {q: i for i, q in enumerate(cal_q)}
        lam, _ = conformal_recall_level(
            stat[cal_rows], np.array([cal_map[q] for q in qidx[cal_rows]]), is_rel[cal_rows], n_rel[cal_q], 0.8
        )
        recall = [((qidx == q) & is_rel & (stat >= lam)).sum() / n_rel[q] for q in test_q]
        assert got[b] == pytest.approx(np.mean(recall))
    # given the pool, a random split makes calibration and test queries exchangeable, so conformal risk control
    # bounds the recall expected over splits: the mean of 400 splits is >= 0.8 up to its Monte Carlo error
    # (4 standard errors; 0.01 more for the discreteness of 20 test queries with 1-10 relevant documents)
    many = conformal_resplits(stat, qidx, is_rel, n_rel, 0.8, n_cal=20, seeds=400)
    assert many.mean() >= 0.8 - 4 * many.std() / np.sqrt(len(many)) - 0.01
    with pytest.raises(ValueError, match="n_cal must be"):
        conformal_resplits(stat, qidx, is_rel, n_rel, 0.8, n_cal=39)


def test_topk_depth_for_a_recall_top_k_reaches_at_the_list_end():
    """The recall-targets table's "top-k k for same recall": a rule keeping whole lists has top-k's recall at the list
    length, though the two means, summed in different orders, may differ in the last bits; beyond it: None."""
    from pyterrier_prob.experiments.pebr_cutoffs import _topk_depth_for, _topk_recall_matrix
    from pyterrier_prob.pebr.rlt import mean_measures

    rng, nq, cap = np.random.default_rng(0), 12, 15
    qidx, ranks = np.repeat(np.arange(nq), cap), np.tile(np.arange(cap), nq)
    for _ in range(200):  # lists whose mean recall, taken both ways, differs in the last bits
        is_rel = rng.random(nq * cap) < 0.1
        n_rel = np.bincount(qidx[is_rel], minlength=nq) + rng.integers(0, 3, nq)
        curve = _topk_recall_matrix(ranks, qidx, is_rel, n_rel, cap).mean(axis=0)
        recall = mean_measures(qidx, is_rel, n_rel, np.ones(nq * cap, bool), nq)[1]
        if recall > curve[-1]:
            break
    assert recall == pytest.approx(curve[-1]) and recall > curve[-1]
    k = _topk_depth_for(curve, recall)
    assert k == int(np.argmax(curve >= curve[-1]) + 1)  # the first depth at which top-k has that recall
    assert _topk_depth_for(curve, curve[-1] + 0.01) is None
    assert _topk_depth_for(curve, 0.0) == 1


def test_topk_at_a_rules_own_mean_depth_is_interpolated_per_query_and_tested_paired():
    """The cutoff-vs-top-k comparison: top-k's per-query recall at a fractional mean depth is linear between the
    neighbouring k (a loop over the lists), its mean is the mean curve's value there, and the paired t-test is
    scipy's on the per-query recalls (NaN for top-k against itself)."""
    from scipy.stats import ttest_rel

    from pyterrier_prob.experiments.pebr_cutoffs import _topk_recall_at, _topk_recall_matrix, same_depth_columns

    rng, nq, cap = np.random.default_rng(1), 9, 12
    qidx, ranks = np.repeat(np.arange(nq), cap), np.tile(np.arange(cap), nq)
    is_rel = rng.random(nq * cap) < 0.25
    n_rel = np.bincount(qidx[is_rel], minlength=nq) + rng.integers(0, 2, nq)
    n_rel[0] = 0  # a query without a relevant document takes no part
    is_rel[qidx == 0] = False
    per_query = _topk_recall_matrix(ranks, qidx, is_rel, n_rel, cap)
    has = np.flatnonzero(n_rel > 0)
    assert per_query.shape == (len(has), cap)

    def recall_at(q, k):  # top-k recall of query q by a loop
        return sum(1 for r in range(k) if is_rel[q * cap + r]) / n_rel[q]

    for depth in (0.0, 1.0, 3.4, 7.75, float(cap)):
        lo, frac = int(depth), depth - int(depth)
        want = [recall_at(q, lo) + frac * (recall_at(q, min(lo + 1, cap)) - recall_at(q, lo)) for q in has]
        np.testing.assert_allclose(_topk_recall_at(per_query, depth), want, atol=1e-12)
        mean_curve = np.r_[0.0, per_query.mean(axis=0)]
        assert _topk_recall_at(per_query, depth).mean() == pytest.approx(
            np.interp(depth, np.arange(cap + 1), mean_curve)
        )

    docno = np.array([f"d{i}" for i in range(nq * cap)])
    ranked = pd.DataFrame({"qid": qidx.astype(str), "docno": docno, "rank": ranks})
    qids = [str(q) for q in range(nq)]
    judged = [(str(q), d, 1) for q, d in zip(qidx[is_rel], docno[is_rel], strict=True)]
    judged += [(str(q), f"unretrieved{q}", 1) for q in range(nq) if n_rel[q] > is_rel[qidx == q].sum()]
    qrels = pd.DataFrame(judged + [("1", "d13", 0)], columns=["qid", "docno", "label"])  # label 0: not relevant
    depths = rng.integers(0, cap + 1, nq)  # a variable-depth rule: keep each query's first depths[q] rows
    runs = {"rule": ranked[ranks < depths[qidx]], "top-5": ranked[ranks < 5]}
    exp = pd.DataFrame({"name": ["rule", "top-5"], "test_mean_depth": [depths.mean(), 5.0]})
    same_depth_columns(exp, runs, qrels, qids, per_query)
    rule = np.array([recall_at(q, depths[q]) for q in has])
    at = _topk_recall_at(per_query, depths.mean())
    assert exp.loc[0, "topk_SetR_at_same_depth"] == pytest.approx(at.mean())
    assert exp.loc[0, "p_vs_topk_at_same_depth"] == pytest.approx(ttest_rel(rule, at).pvalue)
    assert exp.loc[1, "topk_SetR_at_same_depth"] == pytest.approx(per_query[:, 4].mean())
    assert np.isnan(exp.loc[1, "p_vs_topk_at_same_depth"])  # top-k against itself: nothing to test
