"""The per-query cutoff study of ``pyterrier-prob pebr`` (issue #13): calibrated laws, recall targets with a conformal
guarantee, and ranked-list-truncation baselines at matched mean depth.

Everything works on the pEBR model's ranked lists (its top ``cap`` documents per query, scores = cosines) of the
calibration (dev) and test queries:

* **calibrated law** (:class:`~pyterrier_prob.pebr.calibration.CalibratedLaw`): fitted by maximum likelihood on the
  calibration queries' relevant cosines (all of them, not only those in the top ``cap``) from the head's per-query
  parameters; its CDF cutoff keeps, per query, the documents above ``law.cutoff(p)``. The PIT of the test queries'
  relevant cosines before (the head's own law) and after calibration is summarised and plotted;
* **recall targets**: conformal risk control (:mod:`pyterrier_prob.pebr.conformal`) picks the level of the calibrated
  CDF cutoff and of a global score cutoff on the calibration queries so that expected recall on new exchangeable
  queries is at least r; on test: the achieved mean recall, the mean depth, and the fixed k top-k needs for the same
  recall;
* **matched depth**: every rule (:mod:`pyterrier_prob.pebr.truncation`) calibrated on the calibration queries to a
  mean depth k and applied to test: SetR / SetP / SetF with paired t-tests against top-k, and the oracle depth
  (qrels known) as an upper bound; recall / precision / F1 against mean depth for each rule (PNG).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["relevant_cosines"]


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


# ---- every truncation rule as a per-row statistic: a rule at level lam keeps the rows with stat >= lam --------------
def _running_min(ranked: pd.DataFrame, stat: np.ndarray) -> np.ndarray:
    """Make a statistic prefix-monotone within each query (rows sorted by qid, rank): the running minimum down the
    ranking, so that the rows kept at any level are a prefix of the query's list (a truncation)."""
    s = pd.Series(stat, index=ranked.index)
    return s.groupby(ranked["qid"].to_numpy(), sort=False).cummin().to_numpy()


def zscore_stat(ranked: pd.DataFrame, top: int = 100) -> np.ndarray:
    """Per-query normalised score: (score - mean) / std over the query's own top ``top`` scores."""
    g = ranked[ranked["rank"] < top].groupby("qid")["score"]
    mu, sd = ranked["qid"].map(g.mean()), ranked["qid"].map(g.std(ddof=0))
    return ((ranked["score"] - mu) / sd.where(sd > 0, 1.0)).to_numpy()


def mixture_stat(ranked: pd.DataFrame, top: int = 100, iters: int = 100) -> np.ndarray:
    """Posterior probability of relevance under a per-query score-distribution fit (Manmatha, Rath & Feng, SIGIR
    2001): on the query's top ``top`` scores, non-relevant scores exponential above the fitted list's minimum,
    relevant scores normal (started on the top 5% and kept above the exponential's mean), fitted by EM; made
    prefix-monotone (:func:`_running_min`)."""
    from scipy import stats

    out = np.zeros(len(ranked))
    for _, idx in ranked.groupby("qid", sort=False).indices.items():
        s = ranked["score"].to_numpy()[idx]
        lo = s[: min(top, len(s))].min()
        x = np.maximum(s - lo, 0.0)
        fit = x[: min(top, len(x))]
        if len(fit) < 5 or fit.std() == 0:
            out[idx] = 0.0
            continue
        head = fit[: max(2, len(fit) // 20)]
        w, mu, sd, lam = 0.05, float(head.mean()), float(head.std()) + 1e-3, 1.0 / (fit.mean() + 1e-9)
        for _ in range(iters):
            pr = w * stats.norm.pdf(fit, mu, sd)
            pn = (1 - w) * stats.expon.pdf(fit, scale=1.0 / lam)
            r = pr / np.maximum(pr + pn, 1e-300)
            w = float(np.clip(r.mean(), 1e-4, 1 - 1e-4))
            mu = max(float((r * fit).sum() / max(r.sum(), 1e-12)), 1.0 / lam)
            sd = float(np.sqrt((r * (fit - mu) ** 2).sum() / max(r.sum(), 1e-12))) + 1e-6
            lam = float((1 - r).sum() / max(((1 - r) * fit).sum(), 1e-12))
        pr = w * stats.norm.pdf(x, mu, sd)
        pn = (1 - w) * stats.expon.pdf(x, scale=1.0 / lam)
        out[idx] = pr / np.maximum(pr + pn, 1e-300)
    return _running_min(ranked, out)


def law_stat(ranked: pd.DataFrame, law: Any) -> np.ndarray:
    """The CDF cutoff as a statistic: ``F_q(score) - 1`` (minus the law's survival), so that the cutoff at CDF value
    p (``law.cutoff(p)``: keep a share p of the relevant documents) keeps the rows with stat >= -p. ``ranked`` holds
    the law's queries in its order, each query's rows together (:func:`ranked_lists`)."""
    from pyterrier_prob.pebr.calibration import pit_values

    lists = [g.to_numpy() for _, g in ranked.groupby("qid", sort=False)["score"]]
    return pit_values(law, lists) - 1.0


def ranked_lists(index: Any, queries: pd.DataFrame, cap: int) -> pd.DataFrame:
    """Each query's top ``cap`` documents (``qid, docno, score, rank``; score = cosine), queries in the order of
    ``queries``, each query's rows together in rank order."""
    from pyterrier_prob.pebr import TopKRetriever

    run = TopKRetriever(index, num_results=cap)(queries)[["qid", "docno", "score", "rank"]]
    order = {q: i for i, q in enumerate(queries["qid"].astype(str))}
    run = run.assign(qid=run["qid"].astype(str), docno=run["docno"].astype(str))
    run = run.assign(_o=run["qid"].map(order)).sort_values(["_o", "rank"], kind="stable").drop(columns="_o")
    return run.reset_index(drop=True)


def level_for_depth(stat: np.ndarray, n_queries: int, k: float) -> float:
    """The level at which the rows with stat >= level number ``k`` per query on average (the k·Q-th largest stat):
    matched mean depth (pEBR Sec. 4.1.3), exact up to ties."""
    srt = np.sort(stat)[::-1]
    m = int(np.clip(round(k * n_queries), 1, len(srt)))
    return float(srt[m - 1])


def conformal_recall_level(stat: np.ndarray, qidx: np.ndarray, is_rel: np.ndarray, n_rel: np.ndarray, target: float):
    """Conformal risk control for a recall target (Angelopoulos et al., *Conformal Risk Control*, ICLR 2024, Thm. 1).

    The loss of query i at level lam is L_i(lam) = 1 - recall_i(lam) in [0, 1] (B = 1), non-increasing as lam
    falls (more rows kept). Over the n calibration queries with a relevant document, the shallowest lam with

        n / (n + 1) * mean_i L_i(lam) + 1 / (n + 1) <= 1 - target

    guarantees E[recall] >= target on a new exchangeable query. ``n_rel`` counts every judged-relevant document of a
    query (also those below the ranked lists' cap, which no level reaches). Returns ``(lam, achievable)``;
    ``lam = -inf`` (keep the whole list) when even that does not satisfy the bound.
    """
    has = n_rel > 0
    n = int(has.sum())
    if n == 0:
        raise ValueError("no calibration query has a relevant document: cannot calibrate a recall target")
    need = 1.0 - ((1.0 - target) * (n + 1) - 1.0) / n  # mean recall the calibration queries must reach
    rel_rows = np.flatnonzero(is_rel & has[qidx])
    order = rel_rows[np.argsort(-stat[rel_rows], kind="stable")]
    gain = np.cumsum(1.0 / n_rel[qidx[order]]) / n
    values = stat[order]
    # at a tie the whole tied group is kept: the recall reached at a level is the last cumsum of its group
    last_of_value = np.r_[values[1:] != values[:-1], True]
    ok = np.flatnonzero(last_of_value & (gain >= need - 1e-12))
    if len(ok) == 0:
        return -np.inf, False
    return float(values[ok[0]]), True


def oracle_runs(ranked: pd.DataFrame, is_rel: np.ndarray, qidx: np.ndarray, n_rel: np.ndarray, k: float, n_q: int):
    """Per-query depths that maximise total recall under a mean-depth budget of ``k`` (qrels known: an upper bound).

    Each query's (depth, recall) points at its relevant documents' ranks form a curve; its upper concave hull's
    segments, taken across queries in decreasing gain per document until the budget k·Q is spent, solve the
    budgeted problem (exactly for the LP relaxation; a segment that no longer fits is skipped)."""
    budget = k * n_q
    segs = []
    ranks = ranked["rank"].to_numpy()
    for q in range(n_q):
        if n_rel[q] == 0:
            continue
        rel_ranks = np.sort(ranks[(qidx == q) & is_rel])
        pts = [(0, 0.0)] + [(int(r) + 1, (j + 1) / n_rel[q]) for j, r in enumerate(rel_ranks)]
        hull = [pts[0]]
        for p in pts[1:]:
            while len(hull) >= 2:
                (x1, y1), (x2, y2) = hull[-2], hull[-1]
                if (y2 - y1) * (p[0] - x1) <= (p[1] - y1) * (x2 - x1):
                    hull.pop()
                else:
                    break
            hull.append(p)
        for (x1, y1), (x2, y2) in zip(hull[:-1], hull[1:]):
            segs.append(((y2 - y1) / (x2 - x1), q, x2, x2 - x1))
    depth = np.zeros(n_q, dtype=int)
    spent = 0.0
    for _slope, q, x2, cost in sorted(segs, key=lambda s: -s[0]):
        if x2 <= depth[q]:
            continue
        if spent + cost <= budget:
            depth[q], spent = x2, spent + cost
    return ranked[ranks < depth[qidx]]


def _row_relevance(ranked: pd.DataFrame, qrels: pd.DataFrame, qids: Sequence[str]):
    """(query index per row, relevant flag per row, number of judged-relevant documents per query)."""
    rel = qrels[qrels["label"] > 0]
    pairs = set(zip(rel["qid"].astype(str), rel["docno"].astype(str)))
    pos = {q: i for i, q in enumerate(qids)}
    qidx = ranked["qid"].map(pos).to_numpy()
    is_rel = np.fromiter((p in pairs for p in zip(ranked["qid"], ranked["docno"])), bool, len(ranked))
    counts = rel.groupby(rel["qid"].astype(str)).size()
    n_rel = np.array([int(counts.get(q, 0)) for q in qids])
    return qidx, is_rel, n_rel


def _mean_measures(qidx: np.ndarray, is_rel: np.ndarray, n_rel: np.ndarray, keep: np.ndarray, n_q: int):
    """Mean depth, and SetR / SetP / F1 per query (recall over queries with a relevant document)."""
    depth = np.bincount(qidx[keep], minlength=n_q)
    hits = np.bincount(qidx[keep & is_rel], minlength=n_q)
    has = n_rel > 0
    rec = np.where(has, hits / np.maximum(n_rel, 1), 0.0)
    prec = np.where(depth > 0, hits / np.maximum(depth, 1), 0.0)
    f1 = np.where(rec + prec > 0, 2 * rec * prec / np.maximum(rec + prec, 1e-12), 0.0)
    return depth.mean(), rec[has].mean(), prec[has].mean(), f1[has].mean()


RULES = (
    "top-k",
    "score cutoff",
    "z-score cutoff",
    "score-distribution fit",
    "CDF cutoff (head's law)",
    "CDF cutoff (calibrated law)",
)
"""The truncation rules of the study, in table order (plus ``oracle depth``); significance against ``top-k``."""


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

    Returns ``{"matched": frame, "targets": frame, "pit": dict, "calibrated_law": dict, "figures": dict}``.
    """
    from pyterrier_prob.pebr.calibration import CalibratedLaw, model_law, pit_summary, pit_values
    from pyterrier_prob.plots import pit_plot, truncation_curves_plot

    qrels = {"dev": data.cal_qrels, "test": data.test_qrels}
    out: dict[str, Any] = {"figures": {}}
    with h.stage("cutoff_lists", f"ranked lists (top {cap}) and relevant cosines of the calibration and test queries"):
        ranked = {s: ranked_lists(indexes[s], queries[s], cap) for s in ("dev", "test")}
        qids = {s: list(queries[s]["qid"].astype(str)) for s in ("dev", "test")}
        rel = {s: relevant_cosines(indexes[s], queries[s], qrels[s]) for s in ("dev", "test")}
        params = {s: _params(queries[s], family) for s in ("dev", "test")}
        relinfo = {s: _row_relevance(ranked[s], qrels[s], qids[s]) for s in ("dev", "test")}
    with h.stage("calibrate_law", "fitting the calibrated per-query law on the calibration queries' relevant cosines"):
        has_dev = [i for i, r in enumerate(rel["dev"]) if len(r)]
        cal = CalibratedLaw(family=family, dim=dim).fit(params["dev"].iloc[has_dev], [rel["dev"][i] for i in has_dev])
        out["calibrated_law"] = cal.to_dict()
        has_test = [i for i, r in enumerate(rel["test"]) if len(r)]
        test_rel = [rel["test"][i] for i in has_test]
        before = model_law(params["test"].iloc[has_test], family, dim)
        after = cal.law(params["test"].iloc[has_test])
        pits = {
            "head's law (before)": pit_values(before, test_rel),
            "calibrated law (after)": pit_values(after, test_rel),
        }
        out["pit"] = {name: pit_summary(v) for name, v in pits.items()}
        out["figures"]["pit"] = pit_plot(pits, h.path("pit.png"), title="PIT of the test queries' relevant cosines")

    stats: dict[str, dict[str, np.ndarray]] = {s: {} for s in ("dev", "test")}
    with h.stage("rule_statistics", "per-row statistics of every truncation rule"):
        for s in ("dev", "test"):
            r = ranked[s]
            stats[s]["top-k"] = -r["rank"].to_numpy(dtype=np.float64)
            stats[s]["score cutoff"] = r["score"].to_numpy(dtype=np.float64)
            stats[s]["z-score cutoff"] = zscore_stat(r)
            stats[s]["score-distribution fit"] = mixture_stat(r)
            stats[s]["CDF cutoff (head's law)"] = law_stat(r, model_law(params[s], family, dim))
            stats[s]["CDF cutoff (calibrated law)"] = law_stat(r, cal.law(params[s]))

    # ---- matched mean depth -------------------------------------------------------------------------------------
    rows = []
    n_dev, n_test = len(qids["dev"]), len(qids["test"])
    with h.stage("matched_depth", f"every rule at matched mean depth {list(ks)} (levels from {data.cal_source})"):
        for k in ks:
            runs = {}
            for rule in RULES:
                lam = float(-(k - 1)) if rule == "top-k" else level_for_depth(stats["dev"][rule], n_dev, k)
                runs[rule] = ranked["test"][stats["test"][rule] >= lam]
            qidx, is_rel, n_rel = relinfo["test"]
            runs["oracle depth (qrels known)"] = oracle_runs(ranked["test"], is_rel, qidx, n_rel, k, n_test)
            exp = h.experiment(runs, data.test_topics, data.test_qrels, ["SetR", "SetP", "SetF"], baseline="top-k")
            counts = {n: r.groupby("qid").size().reindex(qids["test"], fill_value=0) for n, r in runs.items()}
            exp.insert(1, "k", k)
            exp.insert(2, "test_mean_depth", [float(counts[n].mean()) for n in exp["name"]])
            rows.append(exp)
    out["matched"] = pd.concat(rows, ignore_index=True)

    # ---- recall targets (conformal risk control on the calibration queries) -------------------------------------
    trows = []
    with h.stage("recall_targets", f"recall targets {_fmt_targets(targets)} by conformal risk control"):
        tq, tr, tn = relinfo["test"]
        has = tn > 0
        topk_recall = _topk_recall_curve(ranked["test"]["rank"].to_numpy(), tq, tr, tn, cap)
        for target in targets:
            for rule in ("CDF cutoff (calibrated law)", "score cutoff", "CDF cutoff (head's law)"):
                dq, dr, dn = relinfo["dev"]
                lam, ok = conformal_recall_level(stats["dev"][rule], dq, dr, dn, target)
                keep = stats["test"][rule] >= lam
                depth, recall, prec, f1 = _mean_measures(tq, tr, tn, keep, n_test)
                need_k = int(np.searchsorted(topk_recall, recall - 1e-12) + 1) if recall <= topk_recall[-1] else None
                trows.append(
                    {
                        "target_recall": target,
                        "rule": rule,
                        "level": lam,
                        "reachable_on_calibration": ok,
                        "test_mean_recall": recall,
                        "test_mean_depth": depth,
                        "test_SetP": prec,
                        "topk_k_for_same_recall": need_k,
                        "test_queries_with_relevant": int(has.sum()),
                    }
                )
    out["targets"] = pd.DataFrame(trows)

    # ---- recall / precision / F1 against mean depth (test) ------------------------------------------------------
    with h.stage("curves", "recall, precision and F1 against mean depth for every rule"):
        tq, tr, tn = relinfo["test"]
        curves = {}
        for rule in RULES:
            pts = []
            for k in (1, 2, 5, 10, 20, 50, 100, 200, 500, cap):
                if k > cap:
                    continue
                lam = float(-(k - 1)) if rule == "top-k" else level_for_depth(stats["test"][rule], n_test, k)
                pts.append(_mean_measures(tq, tr, tn, stats["test"][rule] >= lam, n_test))
            curves[rule] = pd.DataFrame(pts, columns=["mean_depth", "recall", "precision", "f1"])
        out["curves"] = curves
        out["figures"]["curves"] = truncation_curves_plot(curves, h.path("truncation_curves.png"))
    return out


def _topk_recall_curve(ranks: np.ndarray, qidx: np.ndarray, is_rel: np.ndarray, n_rel: np.ndarray, cap: int):
    """Mean recall of top-k for k = 1..cap over the queries with a relevant document (non-decreasing)."""
    has = n_rel > 0
    hits = np.zeros((len(n_rel), cap))
    np.add.at(hits, (qidx[is_rel], ranks[is_rel].astype(int)), 1.0)
    rec = np.cumsum(hits, axis=1) / np.maximum(n_rel, 1)[:, None]
    return rec[has].mean(axis=0)
