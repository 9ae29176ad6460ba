"""``pyterrier-prob depth``: re-rank only as deep as each query needs. A saved re-ranker (``--reranker``) scores BM25's
top ``--depth`` of the dev, test and ``--ood`` queries once; every depth rule of :mod:`pyterrier_prob.rerank_depth` is
fitted on dev, then replayed on each collection from those scores, against fixed-k on the cost-effectiveness curve
(nDCG@10 against the mean number of re-ranked pairs). Stages as every experiment (docs/experiments.md): data -> score
-> rules fitted on dev -> analyses -> report."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd
from scipy.stats import spearmanr

from pyterrier_prob.evaluation import paired_ci, paired_p
from pyterrier_prob.experiments.harness import CommonConfig, Harness, option, slug, subcommand
from pyterrier_prob.experiments.report import MISSING, cell, markdown_table
from pyterrier_prob.experiments.varce_train import Target, dev_target, folder_fingerprint, target_stage
from pyterrier_prob.pebr.rlt import mixture_stat
from pyterrier_prob.rerank_depth import (
    EET_ALPHA,
    EET_BETAS,
    ConformalRecallDepth,
    DepthRule,
    FirstPassDepth,
    FixedDepth,
    LearnedDepth,
    StatisticDepth,
    eet,
    fixed_at_depth,
    kept_recall,
    list_features,
    oracle_depths,
    rerank_at_depths,
)
from pyterrier_prob.varce.distill import ndcg_at_10, score_pairs
from pyterrier_prob.varce.scoring import PairScorer
from st_extensions.loading import load_model

__all__ = ["DESCRIPTION", "DepthConfig", "add_arguments", "config_from_args", "run"]

DESCRIPTION = (
    "Per-query re-ranking depth: a saved re-ranker scores BM25's top --depth once; depth rules fitted on dev (fixed-k, "
    "z-score and score-distribution truncation at a mean depth, conformal recall targets, a cheap first pass, a "
    "learned truncation) against fixed-k on the cost-effectiveness curve, in domain and zero-shot."
)
_RULES = "depth rules (fitted on dev)"


@dataclass
class DepthConfig(CommonConfig):
    """The ``pyterrier-prob depth`` options beyond :class:`CommonConfig`'s (nothing trains here: ``--steps`` 0)."""

    output: str = "outputs/depth"
    steps: int = 0
    reranker: str | None = option(None, "the re-ranker: a saved CrossEncoder or VarCrossEncoder folder (required)")
    depth: int = option(100, "BM25 candidates per query: the deepest re-ranking (fixed-100)")
    max_queries: int | None = option(None, "seeded cap on test queries (None: all)")
    dev_queries: int | None = option(None, "seeded cap on the dev queries the rules are fitted on (None: all)")
    ood: Sequence[str] = option((), "collections evaluated zero-shot (test split), e.g. irds:beir/scifact", nargs="*")
    ood_queries: int = option(0, "seeded query cap per --ood collection (0: every query)")
    ood_depth: int | None = option(None, "BM25 candidates per --ood query (default and only value: --depth)")
    fixed: Sequence[int] = option((5, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100), "the fixed-k grid", _RULES)
    mean_depths: Sequence[float] = option((10.0, 20.0, 30.0, 50.0), "dev mean depths of the rules' levels", _RULES)
    targets: Sequence[float] = option((0.8, 0.9, 0.95), "recall targets of the conformal rules", _RULES)
    prefix: int = option(10, "the first pass's prefix (FirstPassDepth, VarCE std[s])", _RULES)
    margin: float = option(0.005, "non-inferiority margin of nDCG@10 against fixed-100", _RULES)
    inference_batch_size: int = option(64, "pairs per forward pass")
    timing_pairs: int = option(256, "pairs timed for the re-ranker's seconds per pair")

    def check(self) -> None:
        self.ood_depth = self.depth if self.ood_depth is None else self.ood_depth
        super().check()
        if not self.reranker or not os.path.isfile(os.path.join(str(self.reranker), "modules.json")):
            raise ValueError(f"--reranker must be a saved sentence-transformers model folder, got {self.reranker!r}")
        if self.steps:
            raise ValueError("depth trains nothing: leave --steps at 0")
        if not self.fixed or max(self.fixed) != self.depth or min(self.fixed) < 1:
            raise ValueError(
                f"--fixed must be ks in [1, --depth] that include --depth ({self.depth}), got {self.fixed}"
            )
        if any(not 0 < t < 1 for t in self.targets):
            raise ValueError(f"--targets must be recalls in (0, 1), got {list(self.targets)}")
        if any(not 1 <= m <= self.depth for m in self.mean_depths):
            raise ValueError(f"--mean-depths must lie in [1, --depth], got {list(self.mean_depths)}")
        if not (math.isfinite(self.margin) and self.margin >= 0):
            raise ValueError(f"--margin must be >= 0, got {self.margin}")
        if self.ood_depth != self.depth:
            raise ValueError("--ood-depth must equal --depth: the rules are fitted at one depth")


add_arguments, config_from_args = subcommand(DepthConfig, "Per-query re-ranking depth")


# ------------------------------------------------------------------------------------------------ score
def scored(h: Harness, scorer: PairScorer, tg: Target, depth: int) -> pd.DataFrame:
    """BM25's top ``depth`` of ``tg`` with the re-ranker's score (``rr``) and, for a VarCE, its std[s] (``rr_std``)."""
    cand = tg.candidates(h, tg.topics, depth)
    mean, std = scorer.score(tg.label, cand)
    return cand.assign(rr=mean, rr_std=std)


def seconds_per_pair(model: Any, cand: pd.DataFrame, n: int, batch_size: int) -> float:
    """The re-ranker's wall time per pair on ``n`` pairs of ``cand`` (one warm-up batch first)."""
    sample = cand.head(n)
    q, d = sample["query"].tolist(), sample["text"].tolist()
    score_pairs(model, q[:batch_size], d[:batch_size], batch_size)
    start = time.perf_counter()
    score_pairs(model, q, d, batch_size)
    return (time.perf_counter() - start) / max(len(sample), 1)


# ------------------------------------------------------------------------------------------------ rules
def fit_rules(cfg: DepthConfig, dev: pd.DataFrame, qrels: pd.DataFrame, var: bool) -> dict[str, DepthRule]:
    """Every rule fitted on the dev run (name -> rule): fixed-k, z-score and score-distribution truncation and the
    learned truncation at each ``--mean-depths``, conformal recall for each ``--targets`` (adaptive on the z-score,
    and the fixed depth that keeps the promise), and for a VarCE the first pass on its std[s]."""
    d = cfg.depth
    rules: dict[str, DepthRule] = {f"fixed-{k}": FixedDepth(k, max_depth=d) for k in sorted(cfg.fixed)}
    oracle = oracle_depths(dev, dev["rr"], qrels, d)
    for m in cfg.mean_depths:
        rules[f"zscore@{m:g}"] = StatisticDepth("zscore", mean_depth=m, max_depth=d).fit(dev)
        rules[f"score-distribution@{m:g}"] = StatisticDepth(mixture_stat, mean_depth=m, max_depth=d).fit(dev)
        rules[f"learned@{m:g}"] = LearnedDepth(mean_depth=m, max_depth=d, seed=cfg.seed).fit(dev, oracle=oracle)
        if var and cfg.prefix < m:
            first = dev.assign(first_pass_std=dev["rr_std"])
            rules[f"first-pass@{m:g}"] = FirstPassDepth(cfg.prefix, m, max_depth=d).fit(first)
    for t in cfg.targets:
        rules[f"conformal-recall@{t:g}"] = ConformalRecallDepth(t, "zscore", max_depth=d).fit(dev, qrels)
        rules[f"conformal-fixed@{t:g}"] = ConformalRecallDepth(t, "rank", max_depth=d).fit(dev, qrels)
    return rules


def rule_frame(rule: DepthRule, run: pd.DataFrame) -> pd.DataFrame:
    """``run`` as the rule reads it (the first pass's statistic is the re-ranker's std[s] over the prefix)."""
    return run.assign(first_pass_std=run["rr_std"]) if isinstance(rule, FirstPassDepth) else run


# ------------------------------------------------------------------------------------------------ analyses
def evaluate(
    cfg: DepthConfig, rules: dict[str, DepthRule], run: pd.DataFrame, qrels: pd.DataFrame, qids: list[str], spp: float
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One row per rule on one collection (nDCG@10, mean pairs, the paired comparisons with fixed-k) and the oracle."""
    per, depth_of, seconds = {}, {}, {}
    for name, rule in rules.items():
        start = time.perf_counter()
        depths = rule.depths(rule_frame(rule, run))
        seconds[name] = (time.perf_counter() - start) / max(len(qids), 1)
        depth_of[name] = depths
        per[name] = ndcg_at_10(rerank_at_depths(run, run["rr"], depths), qrels, qids=qids)
    by_k = {k: per[f"fixed-{k}"] for k in sorted(cfg.fixed)}
    full = by_k[cfg.depth]
    fixed: dict[float, pd.Series] = {}  # fixed-k by its mean pairs (below k where lists are shorter than k)
    for k in sorted(cfg.fixed):
        fixed.setdefault(float(depth_of[f"fixed-{k}"].mean()), by_k[k])
    at_1 = ndcg_at_10(rerank_at_depths(run, run["rr"], 1), qrels, qids=qids)  # the first stage's order
    noninferior = [k for k in sorted(by_k) if _lower(paired_ci(by_k[k], full)) >= -cfg.margin]
    cheapest = min(noninferior) if noninferior else None
    rows = []
    for name, rule in rules.items():
        pairs = float(depth_of[name].mean())
        same = fixed_at_depth(fixed, min(max(pairs, min(fixed)), max(fixed)))
        row = {
            "rule": "fixed" if name.startswith("fixed-") else name.split("@")[0],
            "level": _level(name),
            "mean_pairs": pairs,
            "nDCG@10": float(per[name].mean()),
        }
        row |= {"fixed_k_nDCG@10_at_same_pairs": float(same.mean()), "p_vs_fixed_k": paired_p(per[name], same)}
        row |= {"ci95_vs_fixed100": paired_ci(per[name], full), "cheapest_noninferior_fixed_k": cheapest}
        promised = getattr(rule, "target", None)
        row |= {"promised_recall": promised, "kept_recall": kept_recall(run, depth_of[name], qrels, cfg.depth)}
        same_promise = rules.get(f"conformal-fixed@{promised:g}") if isinstance(rule, ConformalRecallDepth) else None
        row["fixed_k_for_same_promise"] = same_promise.fixed_k if same_promise is not None else None
        row["s_per_query"] = spp * pairs + seconds[name]
        row["EET"] = eet_means(per[name], at_1, depth_of[name])
        rows.append(row)
    oracle = oracle_depths(run, run["rr"], qrels, cfg.depth)
    best = ndcg_at_10(rerank_at_depths(run, run["rr"], oracle), qrels, qids=qids)
    info = {"mean_depth": float(oracle.mean()), "nDCG@10": float(best.mean()), "fixed100_nDCG@10": float(full.mean())}
    info["first_stage_nDCG@10"] = float(at_1.mean())
    info["EET"] = eet_means(best, at_1, oracle)
    info["depth_rho"] = oracle_depth_rho(cfg, run, oracle)
    info["depths"] = oracle.to_dict()
    return rows, info


def oracle_depth_rho(cfg: DepthConfig, run: pd.DataFrame, oracle: pd.Series) -> dict[str, float | None]:
    """Which list features predict the oracle depth: Spearman's rho of each first-stage list feature
    (:func:`~pyterrier_prob.rerank_depth.list_features`) and, for a VarCE, of the mean std[s] over the first
    ``--prefix`` candidates, with the oracle depth over the queries (None where either is constant)."""
    feats = list_features(run, cfg.depth)
    if run["rr_std"].notna().all():
        head = run[run["rank"] < cfg.prefix]
        feats["std_prefix"] = head.groupby("qid", sort=False)["rr_std"].mean().reindex(feats.index)
    o = oracle.reindex(feats.index).astype(float)
    out: dict[str, float | None] = {}
    for name, col in feats.items():
        ok = col.notna() & o.notna()
        constant = col[ok].nunique() < 2 or o[ok].nunique() < 2
        out[name] = None if constant else float(spearmanr(col[ok], o[ok]).statistic)
    return out


def eet_means(ndcg: pd.Series, at_1: pd.Series, depths: pd.Series) -> dict[str, float]:
    """The mean over queries of Meng et al.'s EET (:func:`~pyterrier_prob.rerank_depth.eet`) at their settings."""
    d = depths.reindex(ndcg.index).fillna(0)
    means = {f"beta={b:g}": float(eet(ndcg, at_1.reindex(ndcg.index), d, EET_ALPHA, b).mean()) for b in EET_BETAS}
    return {"alpha": EET_ALPHA, **means}


def _lower(ci: list[float] | None) -> float:
    return 0.0 if ci is None else ci[0]  # the same values: no difference


def _level(name: str) -> float | None:
    return float(name.split("@")[1]) if "@" in name else float(name.split("-")[1]) if name.startswith("fixed") else None


#: rules that re-rank one depth for every query (conformal-fixed: the fixed k that keeps a recall promise)
FIXED_RULES = ("fixed", "conformal-fixed")


def choose_on_dev(cfg: DepthConfig, dev_rows: list[dict[str, Any]]) -> str | None:
    """The rule chosen on dev before test is read: among the per-query rules (not :data:`FIXED_RULES`) non-inferior to
    fixed-100 on dev (the 95% interval's lower bound >= -``--margin``), the one with the fewest mean pairs (None: none
    is)."""
    ok = [r for r in dev_rows if r["rule"] not in FIXED_RULES and _lower(r["ci95_vs_fixed100"]) >= -cfg.margin]
    best = min(ok, key=lambda r: (r["mean_pairs"], r["rule"])) if ok else None
    return None if best is None else _name(best)


def _name(row: dict[str, Any]) -> str:
    return f"fixed-{row['level']:g}" if row["rule"] == "fixed" else f"{row['rule']}@{row['level']:g}"


# ------------------------------------------------------------------------------------------------ the run
def run(cfg: DepthConfig) -> dict[str, Any]:
    """The depth study into ``cfg.output``; returns the summary as :meth:`Harness.finish` wrote it."""
    h = Harness("depth", cfg)
    data = h.load_data(calibrate=True)
    if data.cal_topics.empty:
        raise ValueError(f"depth fits its rules on dev queries: {data.cal_source} has none")
    model = load_model(str(cfg.reranker), device="cpu")
    scorer = PairScorer(
        "reranker",
        model,
        cfg.inference_batch_size,
        cache_path=h.path("scores", "reranker.tsv"),
        fingerprint=folder_fingerprint(str(cfg.reranker), cfg.max_seq_length),
        fresh=not cfg.reuse,
        progress=h.progress,
    )
    dev = dev_target(cfg, h, data, cfg.depth)
    with h.stage("score_dev", f"scoring BM25's top {cfg.depth} of {len(dev.topics)} dev queries"):
        dev_run = scored(h, scorer, dev, cfg.depth)
    var = bool(dev_run["rr_std"].notna().all())
    with h.stage("fit", "fitting the depth rules on dev"):
        rules = fit_rules(cfg, dev_run, dev.qrels, var)
    spp = seconds_per_pair(model, dev_run, cfg.timing_pairs, cfg.inference_batch_size)
    dev_rows, _ = evaluate(cfg, rules, dev_run, dev.qrels, dev.topics["qid"].tolist(), spp)
    chosen = choose_on_dev(cfg, dev_rows)
    data.notes.append(
        f"chosen on dev ({len(dev.topics)} {dev.label} queries): every rule's level, and the rule reported as chosen "
        f"({chosen or 'none is non-inferior to fixed-100 there'}); test is read once"
    )
    rows, oracle = [], {}
    for tg in target_stage(cfg, h, data):
        with h.stage(f"score_{slug(tg.label, '_')}", f"scoring BM25's top {cfg.depth} of {tg.label}/{tg.split}"):
            frame = scored(h, scorer, tg, cfg.depth)
        r, oracle[tg.label] = evaluate(cfg, rules, frame, tg.qrels, tg.topics["qid"].tolist(), spp)
        rows += [{"collection": tg.label, **x, "chosen_on_dev": _name(x) == chosen} for x in r]
    summary = {"reranker": str(cfg.reranker), "seconds_per_pair": spp, "chosen_on_dev": chosen, "rows": rows}
    summary |= {"oracle": oracle, "dev_rows": dev_rows}
    from pyterrier_prob.plots import depth_curves_plot  # matplotlib: optional

    depth_curves_plot(rows, h.path("depth_curves.png"))
    return h.finish(
        "Per-query re-ranking depth", report(rows, oracle, chosen), {"rows": pd.DataFrame(rows)}, summary, data
    )


def rule_table(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """One collection's rows as the report prints them: every rule's nDCG@10 and mean pairs against fixed-k at the
    same pairs and fixed-100, its recall promise and what it kept, and Meng et al.'s EET."""
    g = pd.DataFrame(rows)
    return pd.DataFrame(
        {
            "rule": [_name(r) + (" (chosen on dev)" if r["chosen_on_dev"] else "") for r in rows],
            "nDCG@10": g["nDCG@10"].map("{:.4f}".format),
            "mean pairs": g["mean_pairs"].map("{:.1f}".format),
            "fixed-k at the same pairs": g["fixed_k_nDCG@10_at_same_pairs"].map("{:.4f}".format),
            "p": g["p_vs_fixed_k"].map(lambda v: cell(v, ".2g")),
            "95% CI vs fixed-100": g["ci95_vs_fixed100"].map(
                lambda v: MISSING if v is None else f"[{v[0]:+.4f}, {v[1]:+.4f}]"
            ),
            "promised / kept recall": [
                f"{r['kept_recall']:.3f}"
                if r["promised_recall"] is None or pd.isna(r["promised_recall"])
                else f"{r['promised_recall']:g} / {r['kept_recall']:.3f}"
                for r in rows
            ],
            "fixed-k for the same promise": g["fixed_k_for_same_promise"].map(lambda v: cell(v, ".0f")),
            "EET (alpha -0.001, beta 1)": g["EET"].map(lambda v: f"{v['beta=1']:.4f}"),
        }
    )


def report(rows: list[dict[str, Any]], oracle: dict[str, Any], chosen: str | None) -> str:
    """The report: per collection, every rule's nDCG@10 and mean pairs against fixed-k (:func:`rule_table`), and the
    oracle."""
    frame = pd.DataFrame(rows)
    text = []
    for label, g in frame.groupby("collection", sort=False):
        o = oracle[label]
        rho = ", ".join(f"{k} {MISSING if v is None else f'{v:+.2f}'}" for k, v in o.get("depth_rho", {}).items())
        text += [
            "",
            f"{label}: oracle depth {o['mean_depth']:.1f} on average reaches fixed-100's {o['fixed100_nDCG@10']:.4f}; "
            f"the cheapest fixed-k non-inferior to fixed-100: {g['cheapest_noninferior_fixed_k'].iloc[0]}; "
            f"Spearman's rho of the oracle depth with each list feature: {rho}",
            "",
            markdown_table(rule_table(g.to_dict("records"))),
        ]
    return "\n".join(text) + "\n"
