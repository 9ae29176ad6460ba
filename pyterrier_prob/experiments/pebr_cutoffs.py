"""The per-query cutoff study of ``pyterrier-prob pebr`` (issue #13): calibrated laws, recall targets with a conformal
guarantee, and ranked-list-truncation baselines at matched mean depth.

Everything works on the pEBR model's ranked lists (its top ``cap`` documents per query, scores = cosines) of the
calibration (dev) and test queries:

* **calibrated laws** (:class:`~pyterrier_prob.pebr.calibration.CalibratedLaw`): fitted by maximum likelihood on
  the calibration queries' relevant cosines (all of them, not only those in the top ``cap``), from the head's
  per-query parameters alone and from those plus the query's list features
  (:func:`~pyterrier_prob.pebr.rlt.list_features`); each gives a CDF cutoff (every query keeps a share p of its
  relevant documents) and the second a recall-gain cutoff (:func:`~pyterrier_prob.pebr.rlt.gain_stat`). The PIT
  of the test queries' relevant cosines before (the head's own law) and after calibration is summarised, per pair
  and per query, and plotted;
* **recall targets**: conformal risk control (:func:`~pyterrier_prob.pebr.rlt.conformal_recall_level`) picks each
  rule's level on the calibration queries so that expected recall on new exchangeable queries is at least r; on
  test: the achieved mean recall, the mean depth, and the fixed k top-k needs for the same recall; when calibration
  and test queries share a collection, the same over 200 random re-splits of their pool
  (:func:`~pyterrier_prob.pebr.rlt.conformal_resplits`);
* **matched depth**: every rule (:mod:`pyterrier_prob.pebr.rlt`) calibrated on the calibration queries to a mean
  depth k and applied to test: SetR / SetP / SetF with paired t-tests against top-k, and the oracle depth (qrels
  known) as an upper bound; recall / precision / F1 against mean depth for each rule (PNG).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

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
    zscore_stat,
)

__all__ = ["RULES", "cutoff_study", "relevant_cosines"]


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
        if len(d):
            d = d / np.maximum(np.linalg.norm(d, axis=1, keepdims=True), 1e-12)
        out.append(d @ q)
    return out


def _params(frame: pd.DataFrame, family: str) -> pd.DataFrame:
    from pyterrier_prob.pebr.encoders import PARAM_COLUMNS

    return frame[list(PARAM_COLUMNS[family])].reset_index(drop=True)


def _fmt_targets(targets: Sequence[float]) -> str:
    return ", ".join(f"{t:g}" for t in targets)


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

LR_RULE = "likelihood-ratio cutoff (beta_mle)"
"""The extra rule of a ``beta_mle`` head: log f+(cos) - log f-(cos) of its relevant and irrelevant laws (Sec. 3.1)."""


def lr_stat(ranked: pd.DataFrame, relevant: Any, irrelevant: Any) -> np.ndarray:
    """Per-row log likelihood ratio of the query's relevant and irrelevant cosine laws (pEBR Sec. 3.1), made
    prefix-monotone (the running minimum down the list), so that a level keeps a truncation."""
    from pyterrier_prob.pebr.calibration import log_likelihood_ratio
    from pyterrier_prob.pebr.rlt import running_min

    width = ranked.groupby("qid", sort=False).size().max()
    lists = [g.to_numpy() for _, g in ranked.groupby("qid", sort=False)["score"]]
    padded = np.array(
        [np.pad(np.clip(v, -1 + 1e-6, 1 - 1e-6), (0, width - len(v)), constant_values=0.0) for v in lists]
    )
    llr = np.asarray(log_likelihood_ratio(relevant, irrelevant, padded))
    return running_min(ranked, np.concatenate([llr[i, : len(v)] for i, v in enumerate(lists)]))


def cutoff_study(
    h: Any,
    data: Any,
    indexes: dict[str, Any],
    queries: dict[str, pd.DataFrame],
    family: str,
    dim: int | None,
    ks: Sequence[int],
    cap: int,
    targets: Sequence[float] = (0.5, 0.8, 0.9),
) -> dict[str, Any]:
    """Run the study of the module docstring on the pEBR model's indexes of the calibration (``"dev"``) and
    ``"test"`` collections (the same index unless ``--test-dataset`` transfers); ``queries`` are the encoded
    calibration and test queries (``qid``, ``query_vec``, the head's parameters).

    Returns ``{"matched": frame, "targets": frame, "pit": dict, "pit_per_query": dict, "calibrated_law": dict,
    "calibrated_law_list_features": dict, "curves": dict, "figures": dict}``.
    """
    from pyterrier_prob.pebr.calibration import (
        CalibratedLaw,
        beta_mle_laws,
        model_law,
        pit_summary,
        pit_values,
        query_weights,
        take_queries,
    )
    from pyterrier_prob.plots import pit_plot, truncation_curves_plot

    qrels = {"dev": data.cal_qrels, "test": data.test_qrels}
    out: dict[str, Any] = {"figures": {}}
    with h.stage("cutoff_lists", f"ranked lists (top {cap}) and relevant cosines of the calibration and test queries"):
        ranked = {s: ranked_lists(indexes[s], queries[s], cap) for s in ("dev", "test")}
        qids = {s: list(queries[s]["qid"].astype(str)) for s in ("dev", "test")}
        rel = {s: relevant_cosines(indexes[s], queries[s], qrels[s]) for s in ("dev", "test")}
        params = {s: _params(queries[s], family) for s in ("dev", "test")}
        relinfo = {s: row_relevance(ranked[s], qrels[s], qids[s]) for s in ("dev", "test")}
    with h.stage("calibrate_law", "fitting the calibrated per-query laws on the calibration queries' relevant cosines"):
        feats = {sp: list_features(ranked[sp]) for sp in ("dev", "test")}
        has = {sp: [i for i, r in enumerate(rel[sp]) if len(r)] for sp in ("dev", "test")}
        dev_rel = [rel["dev"][i] for i in has["dev"]]
        cal = CalibratedLaw(family=family, dim=dim).fit(params["dev"].iloc[has["dev"]], dev_rel)
        cal_f = CalibratedLaw(family=family, dim=dim).fit(
            params["dev"].iloc[has["dev"]], dev_rel, features=feats["dev"].iloc[has["dev"]]
        )
        out["calibrated_law"] = cal.to_dict()
        out["calibrated_law_list_features"] = cal_f.to_dict()
        laws = {
            sp: {
                "head": model_law(params[sp], family, dim),
                CAL: cal.law(params[sp]),
                CAL_F: cal_f.law(params[sp], features=feats[sp]),
            }
            for sp in ("dev", "test")
        }
        test_rel = [rel["test"][i] for i in has["test"]]
        ht, hd = (np.array(has[sp], dtype=np.intp) for sp in ("test", "dev"))
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

    stats: dict[str, dict[str, np.ndarray]] = {s: {} for s in ("dev", "test")}
    with h.stage("rule_statistics", "per-row statistics of every truncation rule"):
        for s in ("dev", "test"):
            r = ranked[s]
            stats[s]["top-k"] = -r["rank"].to_numpy(dtype=np.float64)
            stats[s]["score cutoff"] = r["score"].to_numpy(dtype=np.float64)
            stats[s]["z-score cutoff"] = zscore_stat(r)
            stats[s]["score-distribution fit"] = mixture_stat(r)
            stats[s]["CDF cutoff (head's law)"] = law_stat(r, laws[s]["head"])
            stats[s][f"CDF cutoff ({CAL})"] = law_stat(r, laws[s][CAL])
            stats[s][f"CDF cutoff ({CAL_F})"] = law_stat(r, laws[s][CAL_F])
            stats[s][f"recall-gain cutoff ({CAL_F})"] = gain_stat(r, laws[s][CAL_F])
            if family == "beta_mle":  # Sec. 3.1's two laws: keep while log f+(cos) - log f-(cos) >= level
                stats[s][LR_RULE] = lr_stat(r, *beta_mle_laws(params[s], dim))

    # ---- matched mean depth -------------------------------------------------------------------------------------
    rows = []
    n_dev, n_test = len(qids["dev"]), len(qids["test"])
    topk_recall = _topk_recall_curve(ranked["test"]["rank"].to_numpy(), *relinfo["test"], cap)
    with h.stage("matched_depth", f"every rule at matched mean depth {list(ks)} (levels from {data.cal_source})"):
        for k in ks:
            runs = {}
            for rule in [r for r in (*RULES, LR_RULE) if r in stats["dev"]]:
                lam = float(-(k - 1)) if rule == "top-k" else level_for_depth(stats["dev"][rule], n_dev, k)
                runs[rule] = ranked["test"][stats["test"][rule] >= lam]
            qidx, is_rel, n_rel = relinfo["test"]
            runs["oracle depth (qrels known)"] = oracle_runs(ranked["test"], is_rel, qidx, n_rel, k, n_test)
            exp = h.experiment(runs, data.test_topics, data.test_qrels, ["SetR", "SetP", "SetF"], baseline="top-k")
            counts = {n: r.groupby("qid").size().reindex(qids["test"], fill_value=0) for n, r in runs.items()}
            exp.insert(1, "k", k)
            exp.insert(2, "test_mean_depth", [float(counts[n].mean()) for n in exp["name"]])
            # levels come from the calibration queries, so a rule's test depth is near k, not k: top-k's recall at
            # the rule's own test mean depth is the comparison that leaves no depth advantage
            exp["topk_SetR_at_same_depth"] = [_interp(topk_recall, d) for d in exp["test_mean_depth"]]
            rows.append(exp)
    out["matched"] = pd.concat(rows, ignore_index=True)

    # ---- recall targets (conformal risk control on the calibration queries) -------------------------------------
    trows = []
    same_collection = indexes["dev"] is indexes["test"]
    with h.stage("recall_targets", f"recall targets {_fmt_targets(targets)} by conformal risk control"):
        tq, tr, tn = relinfo["test"]
        dq, dr, dn = relinfo["dev"]
        pool_q, pool_r, pool_n = np.concatenate([dq, tq + n_dev]), np.concatenate([dr, tr]), np.concatenate([dn, tn])
        for target in targets:
            for rule in TARGET_RULES:
                lam, ok = conformal_recall_level(stats["dev"][rule], dq, dr, dn, target)
                keep = stats["test"][rule] >= lam
                depth, recall, prec, f1 = mean_measures(tq, tr, tn, keep, n_test)
                need_k = int(np.searchsorted(topk_recall, recall - 1e-12) + 1) if recall <= topk_recall[-1] else None
                row = {
                    "target_recall": target,
                    "rule": rule,
                    "level": lam,
                    "reachable_on_calibration": ok,
                    "test_mean_recall": recall,
                    "test_mean_depth": depth,
                    "test_SetP": prec,
                    "topk_k_for_same_recall": need_k,
                    "test_queries_with_relevant": int((tn > 0).sum()),
                }
                if same_collection:  # the guarantee is in expectation over calibration draws: re-split the pool
                    pooled = np.concatenate([stats["dev"][rule], stats["test"][rule]])
                    rec = conformal_resplits(pooled, pool_q, pool_r, pool_n, target, n_cal=int((dn > 0).sum()))
                    row.update(
                        resplit_mean_recall=float(rec.mean()),
                        resplit_recall_5=float(np.quantile(rec, 0.05)),
                        resplit_recall_95=float(np.quantile(rec, 0.95)),
                        resplit_share_in_range=float(np.mean((rec >= target - 0.02) & (rec <= target + 0.05))),
                        resplits=len(rec),
                    )
                trows.append(row)
    out["targets"] = pd.DataFrame(trows)

    # ---- recall / precision / F1 against mean depth (test) ------------------------------------------------------
    with h.stage("curves", "recall, precision and F1 against mean depth for every rule"):
        tq, tr, tn = relinfo["test"]
        curves = {}
        for rule in [r for r in (*RULES, LR_RULE) if r in stats["test"]]:
            pts = []
            for k in (1, 2, 5, 10, 20, 50, 100, 200, 500, cap):
                if k > cap:
                    continue
                lam = float(-(k - 1)) if rule == "top-k" else level_for_depth(stats["test"][rule], n_test, k)
                pts.append(mean_measures(tq, tr, tn, stats["test"][rule] >= lam, n_test))
            curves[rule] = pd.DataFrame(pts, columns=["mean_depth", "recall", "precision", "f1"])
        out["curves"] = curves
        out["figures"]["curves"] = truncation_curves_plot(curves, h.path("truncation_curves.png"))
    return out


def _interp(curve: np.ndarray, depth: float) -> float:
    """Mean recall of top-k at a fractional mean depth: linear between the integer depths around it (recall 0 at 0;
    beyond the curve's end, its last value)."""
    return float(np.interp(depth, np.arange(len(curve) + 1), np.r_[0.0, curve]))


def _topk_recall_curve(ranks: np.ndarray, qidx: np.ndarray, is_rel: np.ndarray, n_rel: np.ndarray, cap: int):
    """Mean recall of top-k for k = 1..cap over the queries with a relevant document (non-decreasing)."""
    has = n_rel > 0
    hits = np.zeros((len(n_rel), cap))
    np.add.at(hits, (qidx[is_rel], ranks[is_rel].astype(int)), 1.0)
    rec = np.cumsum(hits, axis=1) / np.maximum(n_rel, 1)[:, None]
    return rec[has].mean(axis=0)
