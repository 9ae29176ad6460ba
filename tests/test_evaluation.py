"""pEBR evaluation protocol: matched mean k (Sec. 4.1.3), strata (Sec. 4.2), set measures, Table 3 / Figure 2."""

import os

import matplotlib.image
import numpy as np
import pandas as pd
import pytest
from scipy import stats

from pyterrier_prob.evaluation import (
    NUM_REL_BASIS,
    TABLE3_PS,
    assign_strata,
    calibrate_mean_k,
    evaluate_set_measures,
    per_query_set_measures,
    retrieved_counts,
    table3_grid,
)
from pyterrier_prob.plots import retrieved_count_histogram, table3_plot

# ---- a synthetic variable-depth system: 50 queries x 5000 documents with random cosine-like scores ----------

NQ, ND = 50, 5000
_rng = np.random.default_rng(0)
SCORES = _rng.random((NQ, ND))
WIDTH = _rng.uniform(0.05, 1.0, NQ)  # per-query spread: how much of the collection a CDF value lets through
WIDTH[7] = 0.0  # a query that never retrieves anything (no rows at any p)
QIDS = np.array([f"q{i}" for i in range(NQ)])
DOCNOS = np.array([f"d{j}" for j in range(ND)])
TOPICS = pd.DataFrame({"qid": QIDS, "query": [f"query {i}" for i in range(NQ)], "popularity": WIDTH})


def _frame(mask: np.ndarray) -> pd.DataFrame:
    qi, di = np.nonzero(mask)
    score = SCORES[qi, di]
    df = pd.DataFrame({"qid": QIDS[qi], "docno": DOCNOS[di], "score": score})
    df = df.sort_values(["qid", "score"], ascending=[True, False], kind="stable")
    df["rank"] = df.groupby("qid").cumcount()
    return df.reset_index(drop=True)


def p_mask(p: float) -> np.ndarray:
    """CDF-like cutoff: larger p keeps more, each query at its own scale."""
    return SCORES >= (1.0 - p * WIDTH)[:, None]


def threshold_mask(t: float) -> np.ndarray:
    """A global cosine threshold: larger t keeps fewer."""
    return SCORES >= t


def test_calibrate_increasing_p_with_frames():
    target = 1000.0
    cal = calibrate_mean_k(lambda p: _frame(p_mask(p)), target, 0.0, 1.0, topics=TOPICS)
    assert cal.achieved
    # independent check of the mean over all 50 topics, the empty query included
    true_mean = p_mask(cal.value).sum() / NQ
    assert cal.mean_k == pytest.approx(true_mean)
    assert abs(true_mean - target) <= 0.01 * target
    assert isinstance(cal.frame, pd.DataFrame) and len(cal.frame) == p_mask(cal.value).sum()
    assert len(cal.counts) == NQ and cal.counts["q7"] == 0
    assert cal.iterations == len(cal.history) <= 60
    # without topics the empty query is unknown, so the same p gives a larger mean
    cal2 = calibrate_mean_k(lambda p: _frame(p_mask(p)), target, 0.0, 1.0)
    assert cal2.achieved and len(cal2.counts) == NQ - 1
    assert abs(p_mask(cal2.value).sum() / (NQ - 1) - target) <= 0.01 * target


def test_calibrate_decreasing_threshold_with_counts():
    target = 700.0

    def run(t):  # count-returning fast path: qid-indexed Series
        return pd.Series(threshold_mask(t).sum(axis=1), index=QIDS)

    cal = calibrate_mean_k(run, target, 0.0, 1.0, increasing=False)
    assert cal.achieved and cal.frame is None
    assert abs(threshold_mask(cal.value).sum(axis=1).mean() - target) <= 0.01 * target
    # positional arrays work too
    cal_arr = calibrate_mean_k(lambda t: threshold_mask(t).sum(axis=1), target, 0.0, 1.0, increasing=False)
    assert cal_arr.value == pytest.approx(cal.value)
    # the wrong direction is detected and named
    with pytest.raises(ValueError, match="increasing=False"):
        calibrate_mean_k(run, target, 0.0, 1.0)


def test_calibrate_integer_top_k_exact():
    order = np.argsort(-SCORES, axis=1)

    def top_k(k):
        mask = np.zeros_like(SCORES, dtype=bool)
        np.put_along_axis(mask, order[:, :k], True, axis=1)
        return _frame(mask)

    cal = calibrate_mean_k(top_k, 137, 1, ND, integer=True, topics=TOPICS)
    assert cal.value == 137 and isinstance(cal.value, int)
    assert cal.mean_k == 137.0 and cal.achieved
    assert cal.frame.groupby("qid").size().eq(137).all()

    # queries with fewer candidates than k: the mean is sum(min(k, n_q)) / NQ; compare to brute force
    n_q = np.random.default_rng(1).integers(10, 800, NQ)

    def capped(k):
        return np.minimum(k, n_q)

    cal = calibrate_mean_k(capped, 300, 1, 1000, integer=True)
    means = np.array([capped(k).mean() for k in range(1, 1001)])
    best = int(np.argmin(np.abs(means - 300))) + 1
    assert abs(capped(cal.value).mean() - 300) == pytest.approx(abs(means[best - 1] - 300))
    assert cal.achieved


def test_calibrate_errors_and_failures():
    def run(t):
        return pd.Series(threshold_mask(t).sum(axis=1), index=QIDS)

    with pytest.raises(ValueError, match=r"unreachable.*\[0, 5000\]"):
        calibrate_mean_k(run, 10_000, 0.0, 1.0, increasing=False)
    with pytest.raises(ValueError, match="unreachable"):
        calibrate_mean_k(run, 3000, 0.6, 0.9, increasing=False)  # this bracket reaches about [500, 2000]
    with pytest.raises(ValueError, match="target_k"):
        calibrate_mean_k(run, 0, 0.0, 1.0, increasing=False)
    with pytest.raises(ValueError, match="lo < hi"):
        calibrate_mean_k(run, 10, 1.0, 1.0, increasing=False)
    with pytest.raises(ValueError, match="qid"):
        calibrate_mean_k(lambda p: _frame(p_mask(p)).drop(columns="qid"), 100, 0.0, 1.0)

    # non-monotone: a bump in the middle of the bracket
    def bumpy(x):
        return np.full(NQ, 4000.0 if 0.4 < x < 0.6 else 2000.0 * x)

    with pytest.raises(ValueError, match="not monotone"):
        calibrate_mean_k(bumpy, 1500, 0.0, 1.0)

    # a step over the tolerance band: in range, never within 1% -> achieved False with a warning
    def step(x):
        return np.full(NQ, 0.0 if x < 0.5 else 1000.0)

    with pytest.warns(RuntimeWarning, match="misses target_k"):
        cal = calibrate_mean_k(step, 400, 0.0, 1.0)
    assert not cal.achieved and cal.mean_k == 0.0 and cal.value < 0.5
    assert 0.5 - cal.value < 1e-11 and cal.iterations <= 45  # bisected to x_tol, not to float resolution


# ---- strata (Sec. 4.2) --------------------------------------------------------------------------------------


def _qrels_with_counts(counts: dict[str, int]) -> pd.DataFrame:
    rows = [(q, f"{q}-d{j}", 1) for q, n in counts.items() for j in range(n)]
    rows += [(q, f"{q}-nonrel{j}", 0) for q in counts for j in range(12)]  # label 0 never counts
    return pd.DataFrame(rows, columns=["qid", "docno", "label"])


def test_assign_strata_by_relevant_count():
    counts = {f"t{i}": 10 - i for i in range(1, 10)}  # t1: 9 relevant ... t9: 1
    qrels = _qrels_with_counts(counts)
    topics = pd.DataFrame({"qid": list(counts) + ["t10"], "query": "x"})  # t10 has no qrels: 0 relevant
    st = assign_strata(topics, qrels)
    assert st.attrs["basis"] == NUM_REL_BASIS == "terciles of the number of relevant documents per query"
    assert (st["basis"] == NUM_REL_BASIS).all()
    got = st.groupby("stratum", observed=True)["qid"].apply(set).to_dict()
    # 10 queries: positions 0-2 head, 3-6 torso, 7-9 tail
    assert got == {"head": {"t1", "t2", "t3"}, "torso": {"t4", "t5", "t6", "t7"}, "tail": {"t8", "t9", "t10"}}
    assert st.set_index("qid").loc["t1", "value"] == 9 and st.set_index("qid").loc["t10", "value"] == 0
    # qrels alone
    st9 = assign_strata(None, qrels)
    assert st9.groupby("stratum", observed=True).size().tolist() == [3, 3, 3]


def test_assign_strata_ties_are_deterministic():
    counts = {f"a{i}": 5 for i in range(4)} | {f"b{i}": 1 for i in range(5)}
    qrels = _qrels_with_counts(counts)
    with pytest.warns(UserWarning, match="torso"):
        grouped = assign_strata(None, qrels)  # ties kept together: 4 x 5 -> head, 5 x 1 -> tail
    g = grouped.set_index("qid")["stratum"]
    assert set(g[[f"a{i}" for i in range(4)]]) == {"head"} and set(g[[f"b{i}" for i in range(5)]]) == {"tail"}
    split = assign_strata(None, qrels, ties="split").set_index("qid")["stratum"]
    assert list(split[split == "head"].index) == ["a0", "a1", "a2"]
    assert list(split[split == "torso"].index) == ["a3", "b0", "b1"]
    shuffled = qrels.sample(frac=1.0, random_state=3)
    assert assign_strata(None, shuffled, ties="split").set_index("qid")["stratum"].equals(split)


def test_assign_strata_popularity_column():
    st = assign_strata(TOPICS)  # "popularity" is recognised without being named
    assert st.attrs["basis"] == "popularity column popularity"
    head = set(st.loc[st["stratum"] == "head", "qid"])
    assert head == set(QIDS[np.argsort(-WIDTH)[: len(head)]]) and len(head) == 17
    topics = TOPICS.rename(columns={"popularity": "freq"})
    st2 = assign_strata(topics, popularity_column="freq")
    assert st2.attrs["basis"] == "popularity column freq"
    assert st2.set_index("qid")["stratum"].equals(st.set_index("qid")["stratum"])
    labelled = pd.DataFrame({"qid": ["x", "y", "z"], "popularity": ["Head", "tail", "torso"]})
    assert assign_strata(labelled).set_index("qid")["stratum"].to_dict() == {"x": "head", "z": "torso", "y": "tail"}
    with pytest.raises(ValueError, match="not in topics"):
        assign_strata(topics, popularity_column="clicks")
    with pytest.raises(ValueError, match="no qrels"):
        assign_strata(topics[["qid", "query"]])
    with pytest.raises(ValueError, match="label"):
        assign_strata(topics[["qid"]], qrels=pd.DataFrame({"qid": ["q0"], "docno": ["d0"]}))


# ---- set measures (Sec. 4.1.3, Table 1) ---------------------------------------------------------------------

QRELS = pd.DataFrame(
    [
        ("1", "a", 1), ("1", "b", 1), ("1", "c", 2), ("1", "d", 0),
        ("2", "e", 1),
        ("3", "f", 1), ("3", "g", 1),
        ("4", "h", 0),  # no relevant document: not evaluated
    ],
    columns=["qid", "docno", "label"],
)  # fmt: skip


def _run(rows):
    df = pd.DataFrame(rows, columns=["qid", "docno"])
    df["score"] = -df.groupby("qid").cumcount().astype(float)
    df["rank"] = df.groupby("qid").cumcount()
    return df


RUN_A = _run([("1", "a"), ("1", "d"), ("2", "e"), ("2", "x"), ("2", "y"), ("2", "z"), ("4", "h")])  # q3: no rows
RUN_B = _run([("1", "a"), ("1", "b"), ("1", "c"), ("1", "x"), ("2", "x"), ("3", "f")])
STRATA = pd.DataFrame({"qid": ["1", "2", "3"], "stratum": ["head", "torso", "tail"]})


def test_evaluate_set_measures_hand_computed():
    res = evaluate_set_measures({"A": RUN_A, "B": RUN_B}, QRELS, STRATA, baseline="A").set_index(["name", "stratum"])
    # per query  A: SetP (1/2, 1/4, 0)  SetR (1/3, 1, 0)  k (2, 4, 0)
    #            B: SetP (3/4, 0, 1)    SetR (1, 0, 1/2)  k (4, 1, 1)
    a, b = res.loc["A"], res.loc["B"]
    assert a.loc["all", "SetP"] == pytest.approx((0.5 + 0.25 + 0) / 3)
    assert a.loc["all", "SetR"] == pytest.approx((1 / 3 + 1 + 0) / 3)
    assert b.loc["all", "SetP"] == pytest.approx((0.75 + 0 + 1) / 3)
    assert b.loc["all", "SetR"] == pytest.approx((1 + 0 + 0.5) / 3)
    assert a.loc["all", "mean_k"] == pytest.approx(2.0) and b.loc["all", "mean_k"] == pytest.approx(2.0)
    assert a.loc["all", "n_queries"] == 3  # query 4 has no relevant document
    assert a.loc["head", "SetR"] == pytest.approx(1 / 3) and b.loc["head", "SetP"] == pytest.approx(0.75)
    assert a.loc["torso", "SetP"] == pytest.approx(0.25) and a.loc["torso", "mean_k"] == 4
    assert b.loc["tail", "SetR"] == pytest.approx(0.5) and a.loc["tail", "mean_k"] == 0
    assert list(res.loc["A"].index) == ["all", "head", "torso", "tail"]
    expected_p = stats.ttest_rel([0.75, 0.0, 1.0], [0.5, 0.25, 0.0]).pvalue
    assert b.loc["all", "SetP p-value"] == pytest.approx(expected_p)
    assert np.isnan(a.loc["all", "SetP p-value"]) and np.isnan(b.loc["head", "SetP p-value"])  # baseline; n=1

    per_q = per_query_set_measures({"A": RUN_A}, QRELS, STRATA, ("SetP", "R@2")).set_index("qid")
    assert per_q["num_retrieved"].to_dict() == {"1": 2, "2": 4, "3": 0}
    assert per_q.loc["2", "R@2"] == 1.0 and per_q.loc["1", "R@2"] == pytest.approx(1 / 3)
    assert per_q.loc["3", "stratum"] == "tail"


def test_evaluate_set_measures_errors():
    with pytest.raises(ValueError, match="label"):
        evaluate_set_measures({"A": RUN_A}, QRELS.drop(columns="label"))
    with pytest.raises(ValueError, match="qid"):
        evaluate_set_measures({"A": RUN_A.drop(columns="qid")}, QRELS)
    with pytest.raises(ValueError, match="empty"):
        evaluate_set_measures({"A": RUN_A}, QRELS, STRATA.iloc[:0])
    with pytest.raises(ValueError, match="share no qid"):
        evaluate_set_measures({"A": RUN_A}, QRELS, pd.DataFrame({"qid": ["zz"], "stratum": ["head"]}))
    with pytest.raises(ValueError, match="baseline"):
        evaluate_set_measures({"A": RUN_A}, QRELS, baseline="C")
    with pytest.raises(ValueError, match="non-empty"):
        evaluate_set_measures({}, QRELS)
    only_all = evaluate_set_measures({"A": RUN_A}, QRELS)
    assert only_all["stratum"].tolist() == ["all"] and "SetP p-value" not in only_all


# ---- Table 3 and Figure 2 (Sec. 4.4.2) ----------------------------------------------------------------------


def test_table3_grid_matches_hand_counts_and_paper_ordering():
    strata = assign_strata(TOPICS)  # popularity = per-query spread, so head retrieves most
    grid = table3_grid(lambda p: _frame(p_mask(p)), TABLE3_PS, strata)
    assert grid.shape == (3, 8) and list(grid.index) == ["head", "torso", "tail"]
    assert list(grid.columns) == list(TABLE3_PS)
    s = strata.set_index("qid")["stratum"]
    for p in (0.99, 0.5):
        by_q = pd.Series(p_mask(p).sum(axis=1), index=QIDS)
        for stratum in ("head", "tail"):
            assert grid.loc[stratum, p] == pytest.approx(by_q[s.index[s == stratum]].mean())
    # the shape of the paper's Table 3: counts fall with p, head > torso > tail at every p
    assert (grid.diff(axis=1).iloc[:, 1:] < 0).all().all()
    assert ((grid.loc["head"] > grid.loc["torso"]) & (grid.loc["torso"] > grid.loc["tail"])).all()
    # counts instead of frames give the same table
    grid_counts = table3_grid(lambda p: pd.Series(p_mask(p).sum(axis=1), index=QIDS), TABLE3_PS, strata)
    pd.testing.assert_frame_equal(grid, grid_counts)
    with pytest.raises(ValueError, match="qid"):
        table3_grid(lambda p: _frame(p_mask(p)).drop(columns="qid"), (0.5,), strata)


def test_histogram_and_table3_png(tmp_path):
    strata = assign_strata(TOPICS)
    frame = _frame(p_mask(0.985))
    path = retrieved_count_histogram(frame, strata, tmp_path / "fig2.png", title="CDF 0.985")
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(path)
    assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 300
    counts = retrieved_counts(frame, QIDS)
    assert counts["q7"] == 0 and counts.sum() == len(frame)
    over = retrieved_count_histogram(counts, strata, tmp_path / "sub" / "overlay.png", layout="overlay")
    assert matplotlib.image.imread(over).ndim == 3
    grid = table3_grid(lambda p: pd.Series(p_mask(p).sum(axis=1), index=QIDS), TABLE3_PS, strata)
    t3 = table3_plot(grid, tmp_path / "table3.png")
    assert matplotlib.image.imread(t3).ndim == 3
    assert sorted(os.listdir(tmp_path)) == ["fig2.png", "sub", "table3.png"]  # no temporary files left
    with pytest.raises(ValueError, match="empty"):
        retrieved_count_histogram(counts, {}, tmp_path / "x.png")
