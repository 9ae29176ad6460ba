"""The per-query cutoff study of ``pyterrier-prob pebr`` (issue #13) on the pEBR model's ranked lists: calibrated
per-query laws and their PIT, recall targets by conformal risk control, and every ranked-list-truncation rule of
:mod:`pyterrier_prob.pebr.rlt` at matched mean depth; ``docs/pebr.md`` (Per-query cutoffs beyond the paper)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
from scipy.stats import spearmanr

from pyterrier_prob.dense import PARAM_COLUMNS
from pyterrier_prob.evaluation import evaluate_set_measures, paired_p
from pyterrier_prob.experiments.report import cell, insert_columns, markdown_table, measure_cell
from pyterrier_prob.pebr.calibration import (
    CalibratedLaw,
    beta_mle_laws,
    log_likelihood_ratio,
    model_law,
    pit_summary,
    pit_values,
    query_weights,
    take_queries,
)
from pyterrier_prob.pebr.rlt import (
    conformal_recall_level,
    conformal_resplits,
    gain_stat,
    law_stat,
    level_for_depth,
    list_features,
    mean_measures,
    mixture_stat,
    oracle_runs,
    ranked_lists,
    row_relevance,
    running_min,
    zscore_stat,
)
from pyterrier_prob.plots import pit_plot, truncation_curves_plot

__all__ = [
    "RULES",
    "StudyConfig",
    "cutoff_study",
    "matched_table",
    "relevant_cosines",
    "same_depth_columns",
    "study_markdown",
    "topk_recall_per_query",
]


def relevant_cosines(index: Any, queries: pd.DataFrame, qrels: pd.DataFrame) -> list[np.ndarray]:
    """Cosines between each query of ``queries`` (``qid``, ``query_vec``) and every document of ``index`` the qrels
    judge relevant to it (label > 0), in query order; documents missing from the index are skipped."""
    vectors = index.vectors()
    pos = {d: i for i, d in enumerate(index.docno_array())}
    rel = qrels[qrels["label"] > 0].assign(qid=lambda f: f["qid"].astype(str), docno=lambda f: f["docno"].astype(str))
    by_q = rel.groupby("qid")["docno"].apply(list).to_dict()
    out = []
    for qid, vec in zip(queries["qid"].astype(str), queries["query_vec"]):
        ids = [pos[d] for d in by_q.get(qid, []) if d in pos]
        q = np.asarray(vec, dtype=np.float64)
        q = q / max(np.linalg.norm(q), 1e-12)
        d = np.asarray(vectors[np.sort(ids)], dtype=np.float64) if ids else np.zeros((0, len(q)))
        out.append(d / np.maximum(np.linalg.norm(d, axis=1, keepdims=True), 1e-12) @ q)
    return out


CAL = "calibrated law"
CAL_F = "calibrated law + list features"
RULES = (
    "top-k",
    "score cutoff",
    "z-score cutoff",
    "score-distribution fit",
    "CDF cutoff (head's law)",
    f"CDF cutoff ({CAL})",
    f"CDF cutoff ({CAL_F})",
    f"recall-gain cutoff ({CAL_F})",
)
"""The truncation rules of the study, in table order (plus ``oracle depth``); significance against ``top-k``."""

TARGET_RULES = (
    f"CDF cutoff ({CAL})",
    f"CDF cutoff ({CAL_F})",
    "score cutoff",
    "z-score cutoff",
    "CDF cutoff (head's law)",
)
"""The rules given a recall target by conformal risk control."""

LR_RULE = "likelihood-ratio cutoff (beta_mle)"  #: a ``beta_mle`` head's extra rule: log f+(cos) - log f-(cos)


def lr_stat(ranked: pd.DataFrame, relevant: Any, irrelevant: Any) -> np.ndarray:
    """Per-row log likelihood ratio of the query's relevant and irrelevant cosine laws (pEBR Sec. 3.1), made
    prefix-monotone (the running minimum down the list), so that a level keeps a truncation."""
    lists = [g.to_numpy() for _, g in ranked.groupby("qid", sort=False)["score"]]
    width = max(map(len, lists))
    padded = np.array([np.pad(np.clip(v, -1 + 1e-6, 1 - 1e-6), (0, width - len(v))) for v in lists])
    llr = np.asarray(log_likelihood_ratio(relevant, irrelevant, padded))
    return running_min(ranked, np.concatenate([llr[i, : len(v)] for i, v in enumerate(lists)]))


@dataclass(frozen=True)
class StudyConfig:
    """Settings of :func:`cutoff_study`: the head's ``family`` and law dimension ``dim`` (None: the 1-D law), the
    matched mean depths ``ks``, the ranked lists' length ``cap`` and the recall ``targets``."""

    family: str
    dim: int | None
    ks: Sequence[int]
    cap: int
    targets: Sequence[float] = (0.5, 0.8, 0.9)


@dataclass
class _Split:
    """One query set's ranked lists, relevant cosines, head parameters, list features and the rows' relevance."""

    ranked: pd.DataFrame
    qids: list[str]
    rel: list[np.ndarray]
    params: pd.DataFrame
    feats: pd.DataFrame
    relinfo: tuple[np.ndarray, np.ndarray, np.ndarray]

    @property
    def has(self) -> list[int]:  # the queries with a relevant document in the index
        return [i for i, r in enumerate(self.rel) if len(r)]


def cutoff_study(
    h: Any, data: Any, indexes: dict[str, Any], queries: dict[str, pd.DataFrame], study: StudyConfig
) -> dict[str, Any]:
    """Run the study (module docstring) on the pEBR model's ``"dev"`` (calibration) and ``"test"`` indexes and encoded
    queries; returns ``{"matched", "targets", "pit", "pit_per_query", "calibrated_law*", "curves", "figures"}``."""
    qrels = {"dev": data.cal_qrels, "test": data.test_qrels}
    what = f"ranked lists (top {study.cap}) and relevant cosines of the calibration and test queries"
    with h.stage("cutoff_lists", what):
        splits = {s: _split(indexes[s], queries[s], qrels[s], study) for s in ("dev", "test")}
    out: dict[str, Any] = {"figures": {}}
    with h.stage("calibrate_law", "fitting the calibrated per-query laws on the calibration queries' relevant cosines"):
        laws = _calibrated_laws(h, splits, study, out)
    with h.stage("rule_statistics", "per-row statistics of every truncation rule"):
        stats = {s: _rule_statistics(splits[s], laws[s], study) for s in ("dev", "test")}
    test = splits["test"]
    topk_per_query = _topk_recall_matrix(test.ranked["rank"].to_numpy(), *test.relinfo, study.cap)
    topk_recall = topk_per_query.mean(axis=0)
    with h.stage("matched_depth", f"every rule at matched mean depth {list(study.ks)} (levels from {data.cal_source})"):
        out["matched"] = _matched_depth(h, data, splits, stats, study.ks, topk_per_query)
    what = f"recall targets {', '.join(f'{t:g}' for t in study.targets)} by conformal risk control"
    with h.stage("recall_targets", what):
        out["targets"] = _recall_targets(splits, stats, study.targets, topk_recall, indexes["dev"] is indexes["test"])
    with h.stage("curves", "recall, precision and F1 against mean depth for every rule"):
        out["curves"] = _curves(test, stats["test"], study.cap)
        out["figures"]["curves"] = truncation_curves_plot(out["curves"], h.path("truncation_curves.png"))
    return out


def _split(index: Any, queries: pd.DataFrame, qrels: pd.DataFrame, study: StudyConfig) -> _Split:
    ranked = ranked_lists(index, queries, study.cap)
    qids = list(queries["qid"].astype(str))
    params = queries[list(PARAM_COLUMNS[study.family])].reset_index(drop=True)
    rel = relevant_cosines(index, queries, qrels)
    return _Split(ranked, qids, rel, params, list_features(ranked), row_relevance(ranked, qrels, qids))


def _calibrated_laws(h: Any, splits: dict[str, _Split], study: StudyConfig, out: dict[str, Any]) -> dict[str, Any]:
    """The head's and both calibrated laws (fitted on the calibration queries) per split; the PITs to ``out``."""
    dev, test = splits["dev"], splits["test"]
    dev_rel = [dev.rel[i] for i in dev.has]
    cal, cal_f = (  # from the head's parameters alone, and with the query's list features
        CalibratedLaw(family=study.family, dim=study.dim).fit(dev.params.iloc[dev.has], dev_rel, features=f)
        for f in (None, dev.feats.iloc[dev.has])
    )
    out |= {"calibrated_law": cal.to_dict(), "calibrated_law_list_features": cal_f.to_dict()}
    laws = {
        name: {
            "head": model_law(sp.params, study.family, study.dim),
            CAL: cal.law(sp.params),
            CAL_F: cal_f.law(sp.params, features=sp.feats),
        }
        for name, sp in splits.items()
    }
    test_rel = [test.rel[i] for i in test.has]
    ht, hd = (np.array(sp.has, dtype=np.intp) for sp in (test, dev))
    dev_pit = np.sort(pit_values(take_queries(laws["dev"][CAL_F], hd), dev_rel))
    after_pit = pit_values(take_queries(laws["test"][CAL_F], ht), test_rel)
    pits = {
        "head's law (before)": pit_values(take_queries(laws["test"]["head"], ht), test_rel),
        f"{CAL} (after)": pit_values(take_queries(laws["test"][CAL], ht), test_rel),
        f"{CAL_F} (after)": after_pit,
        # the calibrated law composed with the empirical CDF of the calibration queries' PIT values: a monotone
        # remap of F_q, so it ranks and truncates exactly as the calibrated law, only its p is recalibrated
        f"{CAL_F} + dev PIT remap": np.searchsorted(dev_pit, after_pit, side="right") / len(dev_pit),
    }
    weights = query_weights(test_rel)
    out["pit"] = {name: pit_summary(v) for name, v in pits.items()}
    out["pit_per_query"] = {name: pit_summary(v, weights=weights) for name, v in pits.items()}
    out["figures"]["pit"] = pit_plot(pits, h.path("pit.png"), title="PIT of the test queries' relevant cosines")
    return laws


def _rule_statistics(split: _Split, laws: dict[str, Any], study: StudyConfig) -> dict[str, np.ndarray]:
    """Every truncation rule's per-row statistic on one split's lists: a rule keeps the rows at or above a level."""
    r = split.ranked
    stats = {
        "top-k": -r["rank"].to_numpy(dtype=np.float64),
        "score cutoff": r["score"].to_numpy(dtype=np.float64),
        "z-score cutoff": zscore_stat(r),
        "score-distribution fit": mixture_stat(r),
        "CDF cutoff (head's law)": law_stat(r, laws["head"]),
        f"CDF cutoff ({CAL})": law_stat(r, laws[CAL]),
        f"CDF cutoff ({CAL_F})": law_stat(r, laws[CAL_F]),
        f"recall-gain cutoff ({CAL_F})": gain_stat(r, laws[CAL_F]),
    }
    if study.family == "beta_mle":  # Sec. 3.1's two laws: keep while log f+(cos) - log f-(cos) >= level
        stats[LR_RULE] = lr_stat(r, *beta_mle_laws(split.params, study.dim))
    return stats


def _level(stats: dict[str, np.ndarray], rule: str, n_queries: int, k: int) -> float:
    """The level at which ``rule`` keeps a mean of ``k`` rows per query (top-k: exactly k)."""
    return float(-(k - 1)) if rule == "top-k" else level_for_depth(stats[rule], n_queries, k)


def _matched_depth(
    h: Any, data: Any, splits: dict[str, _Split], stats: dict[str, Any], ks: Sequence[int], topk_per_query: np.ndarray
) -> pd.DataFrame:
    """Every rule and the oracle depth at each mean depth k on test (levels from the calibration queries), each
    against top-k at the rule's own test mean depth: ``topk_SetR_at_same_depth`` and the paired t-test
    ``p_vs_topk_at_same_depth`` over the queries with a relevant document (``topk_per_query``:
    :func:`_topk_recall_matrix` of the test lists)."""
    dev, test = splits["dev"], splits["test"]
    rows = []
    for k in ks:
        runs, cal_runs = {}, {}
        for rule in [r for r in (*RULES, LR_RULE) if r in stats["dev"]]:
            level = _level(stats["dev"], rule, len(dev.qids), k)
            runs[rule] = test.ranked[stats["test"][rule] >= level]
            cal_runs[rule] = dev.ranked[stats["dev"][rule] >= level]
        # each rule's recall on the calibration queries themselves: what picks a rule without looking at test
        cal = evaluate_set_measures(cal_runs, data.cal_qrels, measures=("SetR",), topics=dev.qids)
        qidx, is_rel, n_rel = test.relinfo
        runs["oracle depth (qrels known)"] = oracle_runs(test.ranked, is_rel, qidx, n_rel, k, len(test.qids))
        exp = h.experiment(runs, data.test_topics, data.test_qrels, ["SetR", "SetP", "SetF"])
        counts = {n: r.groupby("qid").size().reindex(test.qids, fill_value=0) for n, r in runs.items()}
        insert_columns(exp, 1, k=k, test_mean_depth=[float(counts[n].mean()) for n in exp["name"]])
        # levels come from the calibration queries, so a rule's test depth is near k, not k: top-k is taken there
        exp["calibration_SetR"] = exp["name"].map(dict(zip(cal["name"], cal["SetR"], strict=True)))
        same_depth_columns(exp, runs, data.test_qrels, test.qids, topk_per_query)
        # how far each rule's per-query depths are from the oracle's, and whether they follow the number of
        # relevant documents (Spearman's rho; NaN for a constant depth such as top-k's)
        oracle = counts["oracle depth (qrels known)"]
        exp["depth_abs_diff_vs_oracle"] = [float((counts[n] - oracle).abs().mean()) for n in exp["name"]]
        exp["depth_rho_vs_oracle"] = [_rho(counts[n], oracle) for n in exp["name"]]
        exp["depth_rho_vs_num_relevant"] = [_rho(counts[n], n_rel) for n in exp["name"]]
        rows.append(exp)
    return pd.concat(rows, ignore_index=True)


def _recall_targets(
    splits: dict[str, _Split], stats: dict, targets: Sequence[float], topk_recall: np.ndarray, same_collection: bool
) -> pd.DataFrame:
    """Each target rule's conformal level on the calibration queries, on test and over random re-splits."""
    (dq, dr, dn), (tq, tr, tn) = splits["dev"].relinfo, splits["test"].relinfo
    n_dev, n_test = len(splits["dev"].qids), len(splits["test"].qids)
    pool_q, pool_r, pool_n = np.concatenate([dq, tq + n_dev]), np.concatenate([dr, tr]), np.concatenate([dn, tn])
    rows = []
    for target in targets:
        for rule in TARGET_RULES:
            lam, ok = conformal_recall_level(stats["dev"][rule], dq, dr, dn, target)
            depth, recall, prec, f1 = mean_measures(tq, tr, tn, stats["test"][rule] >= lam, n_test)
            need_k = _topk_depth_for(topk_recall, recall)
            row = {"target_recall": target, "rule": rule, "level": lam, "reachable_on_calibration": ok}
            row |= {"test_mean_recall": recall, "test_mean_depth": depth, "test_SetP": prec}
            row |= {"topk_k_for_same_recall": need_k, "test_queries_with_relevant": int((tn > 0).sum())}
            if same_collection:  # the guarantee is in expectation over calibration draws: re-split the pool
                pooled = np.concatenate([stats["dev"][rule], stats["test"][rule]])
                rec = conformal_resplits(pooled, pool_q, pool_r, pool_n, target, n_cal=int((dn > 0).sum()))
                low, high = (float(q) for q in np.quantile(rec, [0.05, 0.95]))
                row |= {"resplit_mean_recall": float(rec.mean()), "resplit_recall_5": low, "resplit_recall_95": high}
                in_range = float(np.mean((rec >= target - 0.02) & (rec <= target + 0.05)))
                row |= {"resplit_share_in_range": in_range, "resplits": len(rec)}
            rows.append(row)
    return pd.DataFrame(rows)


def _curves(test: _Split, stats: dict[str, np.ndarray], cap: int) -> dict[str, pd.DataFrame]:
    """Recall, precision and F1 against mean depth on test for every rule (levels set on test itself)."""
    tq, tr, tn = test.relinfo
    n_test = len(test.qids)
    curves = {}
    for rule in [r for r in (*RULES, LR_RULE) if r in stats]:
        pts = [
            mean_measures(tq, tr, tn, stats[rule] >= _level(stats, rule, n_test, k), n_test)
            for k in (1, 2, 5, 10, 20, 50, 100, 200, 500, cap)
            if k <= cap
        ]
        curves[rule] = pd.DataFrame(pts, columns=["mean_depth", "recall", "precision", "f1"])
    return curves


def matched_table(m: pd.DataFrame) -> pd.DataFrame:
    """The matched-depth table as the report prints it, from the study's ``matched`` frame (or its records in a
    results JSON's ``tables``): every rule against top-k at the rule's own test mean depth."""
    return pd.DataFrame(
        {
            "k": m["k"],
            "rule": m["name"],
            "test mean depth": m["test_mean_depth"].map("{:.1f}".format),
            "calibration SetR": m["calibration_SetR"].map(lambda v: cell(v, ".4f")),
            **{s: [measure_cell(r, s) for _, r in m.iterrows()] for s in ("SetR", "SetP", "SetF")},
            "top-k SetR at the same test depth": m["topk_SetR_at_same_depth"].map("{:.4f}".format),
            "p vs top-k at the same depth": m["p_vs_topk_at_same_depth"].map(lambda p: cell(p, ".3g")),
            "mean abs(depth - oracle's)": m["depth_abs_diff_vs_oracle"].map("{:.1f}".format),
            "rho(depth, oracle's)": m["depth_rho_vs_oracle"].map(lambda r: cell(r, "+.2f")),
            "rho(depth, relevant)": m["depth_rho_vs_num_relevant"].map(lambda r: cell(r, "+.2f")),
        }
    )


def study_markdown(study: dict[str, Any], cal_source: str) -> str:
    """The cutoff study's tables (issue #13) as Markdown."""
    per_query = study["pit_per_query"]
    pit = pd.DataFrame(
        [
            [name, int(p["n"]), *(p[c] for c in ("ks_statistic", "mean", "below_tail", "above_tail"))]
            + [per_query[name]["ks_statistic"], per_query[name]["mean"]]
            for name, p in study["pit"].items()
        ],
        columns=["law", "pairs", "KS", "mean", "share < 0.01", "share > 0.99", "KS per query", "mean per query"],
    )
    t, m = study["targets"], study["matched"]
    targets = pd.DataFrame(
        {
            "target": t["target_recall"].map("{:g}".format),
            "rule": t["rule"],
            "reachable": np.where(t["reachable_on_calibration"], "yes", "no"),
            "test mean recall": t["test_mean_recall"].map("{:.3f}".format),
            "test mean depth": t["test_mean_depth"].map("{:.1f}".format),
            "test SetP": t["test_SetP"].map("{:.3f}".format),
            "top-k k for same recall": t["topk_k_for_same_recall"].map(lambda k: cell(k, ".0f")),
        }
    )
    resplits = ""
    if "resplit_mean_recall" in t:
        n = int(t["resplits"].iloc[0])
        resplits = f"; re-splits: the calibration and test queries pooled and split again at random, {n} times"
        targets["re-splits: mean recall (5-95%)"] = [
            f"{r['resplit_mean_recall']:.3f} ({r['resplit_recall_5']:.3f}-{r['resplit_recall_95']:.3f})"
            for _, r in t.iterrows()
        ]
        targets["share in [r-0.02, r+0.05]"] = t["resplit_share_in_range"].map("{:.2f}".format)
    matched = matched_table(m)
    return f"""## Per-query cutoffs: calibrated law, recall targets, ranked-list-truncation baselines

Levels chosen on {cal_source}; lists = the pEBR model's top documents per query.

PIT of the test queries' relevant cosines (uniform if the law describes them; KS against U(0, 1)), over all relevant \
pairs and per query (each query weighted once, as mean recall weighs it):

{markdown_table(pit, ".3f")}

Recall targets (level by conformal risk control on the calibration queries; achieved on test{resplits}):

{markdown_table(targets)}

Matched mean depth (levels from the calibration queries; "calibration SetR": each rule's recall on those queries, \
what picks a rule without looking at test; "top-k SetR at the same \
test depth": top-k's SetR at the rule's own test mean depth, interpolated per query between the neighbouring k, \
with its paired t-test's p; then each rule's per-query depths \
against the oracle's: mean absolute difference and Spearman's rho, and rho against the number of relevant documents):

{markdown_table(matched)}
"""


def _rho(a: Any, b: Any) -> float:
    """Spearman's rho of two per-query series (NaN when either is constant)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return float("nan") if np.ptp(a) == 0 or np.ptp(b) == 0 else float(spearmanr(a, b).statistic)


def _topk_depth_for(topk_recall: np.ndarray, recall: float) -> int | None:
    """The smallest k at which top-k's mean recall (``topk_recall[k - 1]``) reaches ``recall``; None beyond the list.
    Both means are float sums in different orders: equal recalls may differ in the last bits, hence the tolerance."""
    if recall > topk_recall[-1] + 1e-12:
        return None
    return int(np.searchsorted(topk_recall, recall - 1e-12) + 1)


def _topk_recall_matrix(ranks: np.ndarray, qidx: np.ndarray, is_rel: np.ndarray, n_rel: np.ndarray, cap: int):
    """Per-query recall of top-k for k = 1..cap, one row per query with a relevant document (the mean over rows is
    top-k's mean recall curve, non-decreasing)."""
    hits = np.zeros((len(n_rel), cap))
    np.add.at(hits, (qidx[is_rel], ranks[is_rel].astype(int)), 1.0)
    return (np.cumsum(hits, axis=1) / np.maximum(n_rel, 1)[:, None])[n_rel > 0]


def _topk_recall_at(per_query: np.ndarray, depth: float) -> np.ndarray:
    """Each query's top-k recall at a fractional depth, linear between the neighbouring integer k (0 at 0): their
    mean is the mean curve's value at ``depth``, interpolated the same way."""
    curve = np.pad(per_query, ((0, 0), (1, 0)))
    return np.array([np.interp(depth, np.arange(curve.shape[1]), row) for row in curve])


def topk_recall_per_query(ranked: pd.DataFrame, qrels: pd.DataFrame, qids: Sequence[str], depth: int) -> np.ndarray:
    """Per-query recall of top-k for k = 1..``depth`` of ranked lists (0-based ``rank``), one row per query of
    ``qids`` with a relevant document."""
    ranked = ranked[ranked["rank"] < depth].assign(qid=lambda f: f["qid"].astype(str))
    qidx, is_rel, n_rel = row_relevance(ranked, qrels, qids)
    return _topk_recall_matrix(ranked["rank"].to_numpy(), qidx, is_rel, n_rel, depth)


def same_depth_columns(
    exp: pd.DataFrame,
    runs: Mapping[str, pd.DataFrame],
    qrels: pd.DataFrame,
    qids: Sequence[str],
    topk_per_query: np.ndarray,
    depth: str = "test_mean_depth",
    names: Sequence[str] = ("topk_SetR_at_same_depth", "p_vs_topk_at_same_depth"),
) -> None:
    """Each run of ``exp`` (its rows' ``name``) against top-k at the run's own mean depth (its ``depth`` column), over
    the queries of ``qids`` with a relevant document: top-k's mean recall there (interpolated per query between the
    neighbouring k of ``topk_per_query``, :func:`topk_recall_per_query`) and the paired t-test's p of the run's
    per-query set recall against it (NaN when they are equal), added as the two ``names`` columns."""
    values, ps = [], []
    for name, d in zip(exp["name"], exp[depth], strict=True):
        run = runs[name][runs[name]["qid"].astype(str).isin(set(qids))].assign(qid=lambda f: f["qid"].astype(str))
        qidx, is_rel, n_rel = row_relevance(run, qrels, qids)
        recall = np.bincount(qidx[is_rel].astype(int), minlength=len(qids))[n_rel > 0] / n_rel[n_rel > 0]
        topk = _topk_recall_at(topk_per_query, d)
        values.append(float(topk.mean()))
        ps.append(paired_p(pd.Series(recall), pd.Series(topk)))
    exp[names[0]], exp[names[1]] = values, np.array(ps, dtype=float)
