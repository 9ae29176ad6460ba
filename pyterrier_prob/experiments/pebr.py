"""The pEBR experiment (``pyterrier-prob pebr``, and plain ``pyterrier-prob``): fine-tune, index, calibrate on dev,
compare cutoffs on test at matched mean depth.

``notebooks/pebr.ipynb`` walks through the same on a small budget. Collections, training, indexing, BM25,
``pt.Experiment`` and the report come from :mod:`pyterrier_prob.experiments.harness`. The protocol is pEBR's
(``shared/papers/pebr.md``):

1. fine-tune two bi-encoders from the same base with the same pairs, steps, batch size, learning rate and
   seed: pEBR (a :class:`~st_extensions.QueryDistributionHead` trained with BetaNCE, Sec. 3.2.2) and a
   baseline with sentence-transformers' ``MultipleNegativesRankingLoss`` (the DSSM-style in-batch softmax);
2. encode the collection with each and write a :class:`~pyterrier_prob.DenseIndex`; index the same text with
   PISA for BM25;
3. on the **dev** split only (with no dev split: a seeded 25% of the train queries held out from training, or a
   seeded half of the test queries when there is no train split either; the report says so), calibrate each
   variable-depth retriever so that the mean number of documents retrieved per query equals k (Sec. 4.1.3,
   :func:`~pyterrier_prob.evaluation.calibrate_mean_k`): the cosine threshold of the score cutoff (DSSM-score)
   for each model, and the CDF value p of the pEBR cutoff;
4. on the **test** split, run BM25, baseline top-k, baseline score cutoff, pEBR top-k, pEBR score cutoff and
   pEBR CDF cutoff in ``pt.Experiment`` with set measures (SetR, SetP; the paper's R@k / P@k at matched
   average depth) and paired t-tests against pEBR top-k; the same per head/torso/tail stratum (Table 1);
   Table 3 (mean retrieved count per stratum against p) and Figure 2 (histogram of retrieved counts).

The test split's mean depth is whatever the dev-calibrated settings give; it is reported beside every row.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pyterrier_prob.experiments.harness import CommonConfig, Harness, add_common_arguments, common_from_args, p_mark

__all__ = ["DESCRIPTION", "PebrJobConfig", "run_pebr_job", "add_arguments", "config_from_args", "run"]

DESCRIPTION = (
    "pEBR (probabilistic embedding-based retrieval): fine-tune a BetaNCE pEBR model and an MNRL baseline with the "
    "same budget, index them (and BM25 with PISA), calibrate top-k / score-cutoff / CDF-cutoff retrieval to matched "
    "mean depth k on the dev split, and compare them on the test split with pt.Experiment, overall and per stratum."
)

SYSTEMS = (
    "BM25",
    "untrained top-k",
    "baseline top-k",
    "baseline score cutoff",
    "pEBR top-k",
    "pEBR score cutoff",
    "pEBR CDF cutoff",
)
"""System names in the result tables, in order; significance is tested against ``SIGNIFICANCE_BASELINE``."""

SIGNIFICANCE_BASELINE = "pEBR top-k"
MEASURES = ("SetR", "SetP")
RANKING_MEASURES = ("nDCG@10", "R@100")
FAMILIES = ("beta", "exp", "beta_mle")
#: the frozen recipe's rates for ``--family beta_mle``: BetaMLE's point-wise log-likelihood l(θ) (pEBR Sec. 3.1) pulls
#: the shared embedding space towards fitting the two laws rather than ranking, and on nfcorpus/dev every adapter
#: rate above 0 lowered nDCG@10 below the untrained model's (``benchmarks/recipe_search.py --methods pebr_mle``;
#: README), so the adapter keeps the base geometry and only the head learns the relevant and irrelevant laws
MLE_FROZEN_RATES = {"LinearAdapter": 0.0}


@dataclass
class PebrJobConfig(CommonConfig):
    """Settings of :func:`run_pebr_job` (the ``pyterrier-prob pebr`` options); the shared ones are
    :class:`~pyterrier_prob.experiments.harness.CommonConfig`'s.

    Attributes:
        family: pEBR head family: ``"beta"`` (BetaNCE, default), ``"exp"`` (ExpNCE) or ``"beta_mle"``.
        ks: the matched mean depths.
        cap: ``num_results`` of the variable-depth retrievers (the paper's maximum K of DSSM-score / pEBR).
        geometry: ``"line"``: the 1-D cosine law the loss trains (Sec. 3.2, ``dim=None``); ``"sphere"``: the
            sphere-corrected law of Appendix A (``dim`` = embedding dimension).
        table3_ps: CDF values of the Table-3 grid.
        recall_targets: recall targets of the conformal cutoff study (:mod:`~pyterrier_prob.experiments.pebr_cutoffs`).
        study_cap: length of the study's ranked lists (at most the collection): high recall targets need deep lists.
    """

    output: str = "outputs/pebr"
    family: str = "beta"
    ks: Sequence[int] = (10, 50, 100)
    cap: int = 1000
    geometry: str = "line"
    table3_ps: Sequence[float] = (0.99, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
    recall_targets: Sequence[float] = (0.5, 0.8, 0.9)
    study_cap: int = 10000
    timings: dict[str, float] = field(default_factory=dict, repr=False)

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting out of range."""
        super().check()
        if self.family not in FAMILIES:
            raise ValueError(f"family must be 'beta', 'exp' or 'beta_mle', got {self.family!r}")
        if self.geometry not in ("line", "sphere"):
            raise ValueError(f"geometry must be 'line' or 'sphere', got {self.geometry!r}")
        if not self.ks or any(int(k) != k or k < 1 for k in self.ks):
            raise ValueError(f"ks must be positive integers, got {list(self.ks)}")
        if self.cap < max(self.ks):
            raise ValueError(f"cap ({self.cap}) must be at least the largest k ({max(self.ks)})")
        if self.study_cap < max(self.ks):
            raise ValueError(f"study_cap ({self.study_cap}) must be at least the largest k ({max(self.ks)})")
        if not self.recall_targets or any(not 0 < r < 1 for r in self.recall_targets):
            raise ValueError(f"recall_targets must lie strictly inside (0, 1), got {list(self.recall_targets)}")
        if not self.table3_ps or any(not 0 < p < 1 for p in self.table3_ps):
            raise ValueError(f"table3_ps must lie strictly inside (0, 1), got {list(self.table3_ps)}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``pyterrier-prob pebr`` options."""
    d = PebrJobConfig()
    add_common_arguments(ap, d)
    g = ap.add_argument_group("pEBR")
    g.add_argument("--family", choices=list(FAMILIES), default=d.family, help="pEBR head and loss")
    g.add_argument("--ks", type=int, nargs="+", default=list(d.ks), help="matched mean depths (documents per query)")
    g.add_argument("--cap", type=int, default=d.cap, help="most documents a cutoff retriever returns")
    g.add_argument(
        "--geometry",
        choices=["line", "sphere"],
        default=d.geometry,
        help="cosine law of the CDF cutoff: 1-D (Sec. 3.2, what the loss trains) or sphere-corrected (App. A)",
    )
    g.add_argument("--table3-ps", type=float, nargs="+", default=list(d.table3_ps), help="CDF values of Table 3")
    g.add_argument(
        "--recall-targets",
        type=float,
        nargs="+",
        default=list(d.recall_targets),
        help="recall targets met by conformal risk control on the calibration queries (cutoff study)",
    )
    g.add_argument("--study-cap", type=int, default=d.study_cap, help="ranked-list length of the cutoff study")


def config_from_args(a: argparse.Namespace) -> PebrJobConfig:
    return PebrJobConfig(
        **common_from_args(a),
        family=a.family,
        ks=tuple(a.ks),
        cap=a.cap,
        geometry=a.geometry,
        table3_ps=tuple(a.table3_ps),
        recall_targets=tuple(a.recall_targets),
        study_cap=a.study_cap,
    )


def run(cfg: PebrJobConfig) -> dict[str, Any]:
    return run_pebr_job(cfg)


def _models(cfg: PebrJobConfig, h: Harness, data: Any) -> dict[str, Any]:
    """The pEBR and baseline models trained with the same recipe and budget (query-balanced batches, judged
    negatives masked; under ``--recipe frozen`` a LinearAdapter + head on the cached encoder, the baseline the same
    adapter with masked MNRL), or (no train split / ``--steps 0``) the given model as it is, with an untrained head
    on the pEBR side unless it already has one; and the untrained starting point."""
    from pyterrier_prob.data import judged_pairs, training_pairs
    from st_extensions import build_pebr_model, default_model_path, load_model
    from st_extensions.frozen import build_adapter_model
    from st_extensions.losses import BetaMLELoss, BetaNCELoss, ExpNCELoss, MaskedMultipleNegativesRankingLoss
    from st_extensions.pebr import find_head

    frozen = cfg.recipe == "frozen"
    judged: list[Any] = []

    def pairs() -> Any:
        judged[:] = [judged_pairs(data.train_collection, data.train)]
        return training_pairs(data.train_collection, data.train, seed=cfg.seed)

    def build_pebr() -> Any:
        if cfg.model:
            model = load_model(cfg.model, device="cpu")
            try:
                find_head(model)
                return model
            except ValueError:
                pass
        return build_pebr_model(cfg.model, family=cfg.family, device="cpu", projection=frozen)

    def build_untrained() -> Any:  # a saved pEBR model as --model: its encoder (the head only adds query_temp)
        return load_model(cfg.model or default_model_path(), device="cpu")

    def build_baseline() -> Any:
        return build_adapter_model(build_untrained()) if frozen else build_untrained()

    loss_cls = {"exp": ExpNCELoss, "beta": BetaNCELoss, "beta_mle": BetaMLELoss}[cfg.family]
    train = pairs if data.train else None
    settings = {"family": cfg.family, "train": f"{data.train_collection.name}/{data.train}", "judged_masked": True}
    rates = MLE_FROZEN_RATES if frozen and cfg.family == "beta_mle" else None
    pebr, l1 = h.train(
        "pebr",
        build_pebr,
        lambda m: loss_cls(m, judged=judged[0]),
        train,
        module_learning_rates=rates,
        settings=settings,
    )
    base, l2 = h.train(
        "baseline",
        build_baseline,
        lambda m: MaskedMultipleNegativesRankingLoss(m, judged=judged[0]),
        train,
        settings=settings,
    )
    untrained, _ = h.train("untrained", build_untrained, None, None)
    return {
        "models": {"pebr": pebr, "baseline": base, "untrained": untrained},
        "losses": {"pebr": l1, "baseline": l2},
    }


def run_pebr_job(cfg: PebrJobConfig) -> dict[str, Any]:
    """Run the pEBR experiment (module docstring) and write its outputs to ``cfg.output``.

    Writes ``results.csv`` (pt.Experiment tables, all k), ``strata.csv`` (per head/torso/tail stratum),
    ``table3.csv``, ``calibration.csv``, ``summary.json``, ``results.md`` (the tables as Markdown),
    ``figure2.png`` and ``table3.png``; models under ``models/``, indexes under ``indexes/``.

    Returns:
        ``{"experiment": frame, "strata": frame, "table3": frame, "calibration": frame, "summary": dict}``.
    """
    from scipy.stats import spearmanr

    from pyterrier_prob.evaluation import (
        Calibration,
        assign_strata,
        calibrate_mean_k,
        evaluate_set_measures,
        table3_grid,
    )
    from pyterrier_prob.pebr import CDFCutoffRetriever, ProbBiEncoder, ScoreCutoffRetriever, TopKRetriever
    from pyterrier_prob.plots import retrieved_count_histogram, table3_plot

    cfg.check()
    h = Harness("pebr", cfg)
    data = h.load_data()
    trained = _models(cfg, h, data)
    encoders = {
        n: ProbBiEncoder(h.encoding_model(m), batch_size=64, verbose=False) for n, m in trained["models"].items()
    }
    if encoders["pebr"].family != cfg.family:
        raise ValueError(
            f"the pEBR model has family {encoders['pebr'].family!r}, not {cfg.family!r}: pass --family "
            f"{encoders['pebr'].family} (or run without --reuse / with another --output)"
        )
    coll = data.test_collection
    indexes = {n: h.dense_index(n, enc, coll) for n, enc in encoders.items()}
    bm25_index = h.bm25(coll)
    topics = {"dev": data.cal_topics, "test": data.test_topics}

    with h.stage("encode_queries", "encoding the calibration and test queries"):
        enc = {(n, split): encoders[n].query_encoder()(topics[split]) for n in encoders for split in ("dev", "test")}
    dim = encoders["pebr"].dim if cfg.geometry == "sphere" else None

    def cdf(p: float, split: str = "dev") -> pd.DataFrame:
        r = CDFCutoffRetriever(indexes["pebr"], p=p, family=cfg.family, dim=dim, num_results=cfg.cap)
        return r(enc[("pebr", split)])

    def score_cut(name: str, t: float, split: str = "dev") -> pd.DataFrame:
        return ScoreCutoffRetriever(indexes[name], threshold=t, num_results=cfg.cap)(enc[(name, split)])

    # ---- calibration on dev -------------------------------------------------------------------------------------
    cal_rows = []
    settings: dict[int, dict[str, float]] = {}
    with h.stage("calibrate", f"calibrating the cutoffs to mean depth k in {list(cfg.ks)} on {data.cal_source}"):
        jobs = [
            (k, system, run, lo, hi, increasing)
            for k in cfg.ks
            for system, run, lo, hi, increasing in (
                ("pEBR CDF cutoff", cdf, 1e-9, 1 - 1e-9, True),
                ("pEBR score cutoff", lambda t: score_cut("pebr", t), -1.0, 1.0, False),
                ("baseline score cutoff", lambda t: score_cut("baseline", t), -1.0, 1.0, False),
            )
        ]
        for k, system, run, lo, hi, increasing in h.progress(jobs, "calibrating", unit="cutoff"):
            try:
                c = calibrate_mean_k(run, k, lo, hi, increasing=increasing, topics=topics["dev"], max_iter=80)
            except ValueError as e:  # e.g. the head's law keeps fewer than k documents even at p -> 1
                if "unreachable" not in str(e):
                    raise
                edge = hi if increasing else lo  # the deepest setting the rule has
                mean_k = float(run(edge).groupby("qid").size().reindex(topics["dev"]["qid"], fill_value=0).mean())
                c = Calibration(value=edge, mean_k=mean_k, target_k=k, iterations=1, achieved=False)
                data.notes.append(
                    f"{system}: mean depth {k} is unreachable on the calibration queries (at most {mean_k:.2f})"
                )
            settings.setdefault(k, {})[system] = float(c.value)
            cal_rows.append(
                {
                    "k": k,
                    "system": system,
                    "parameter": "p" if system == "pEBR CDF cutoff" else "threshold",
                    "value": float(c.value),
                    "dev_mean_k": c.mean_k,
                    "achieved_within_1pct": c.achieved,
                    "iterations": c.iterations,
                }
            )
    calibration = pd.DataFrame(cal_rows)

    # ---- test runs ----------------------------------------------------------------------------------------------
    test_qrels = data.test_qrels
    strata = assign_strata(topics["test"], test_qrels)
    basis = strata.attrs.get("basis", str(strata["basis"].iloc[0]))
    experiments, strata_tables = [], []
    with h.stage("test", f"running the systems on {coll.name}/{data.test} (pt.Experiment per k)"):
        for k in h.progress(cfg.ks, "scoring", unit="k"):
            s = settings[k]
            runs = {
                "BM25": h.bm25_run(bm25_index, topics["test"], k),
                "untrained top-k": TopKRetriever(indexes["untrained"], num_results=k)(enc[("untrained", "test")]),
                "baseline top-k": TopKRetriever(indexes["baseline"], num_results=k)(enc[("baseline", "test")]),
                "baseline score cutoff": score_cut("baseline", s["baseline score cutoff"], "test"),
                "pEBR top-k": TopKRetriever(indexes["pebr"], num_results=k)(enc[("pebr", "test")]),
                "pEBR score cutoff": score_cut("pebr", s["pEBR score cutoff"], "test"),
                "pEBR CDF cutoff": cdf(s["pEBR CDF cutoff"], "test"),
            }
            runs = {n: r[["qid", "docno", "score", "rank"]] for n, r in runs.items()}
            exp = h.experiment(runs, topics["test"], test_qrels, MEASURES, baseline=SIGNIFICANCE_BASELINE)
            counts = {n: r.groupby("qid").size().reindex(topics["test"]["qid"], fill_value=0) for n, r in runs.items()}
            exp.insert(1, "k", k)
            exp.insert(2, "test_mean_k", [float(counts[n].mean()) for n in exp["name"]])
            exp.insert(3, "setting", [_setting(n, s) for n in exp["name"]])
            experiments.append(exp)
            st = evaluate_set_measures(runs, test_qrels, strata, measures=MEASURES, baseline=SIGNIFICANCE_BASELINE)
            st.insert(1, "k", k)
            strata_tables.append(st)
            if k == max(cfg.ks):
                histogram_counts = counts["pEBR CDF cutoff"]
                histogram_p = s["pEBR CDF cutoff"]
    experiment = pd.concat(experiments, ignore_index=True)
    per_stratum = pd.concat(strata_tables, ignore_index=True)

    # ---- ranking quality against the untrained start ----------------------------------------------------------
    with h.stage("ranking", "ranking quality (nDCG@10, R@100) against the untrained model"):
        ranked = {
            label: TopKRetriever(indexes[n], num_results=100)(enc[(n, "test")])[["qid", "docno", "score", "rank"]]
            for label, n in (("untrained", "untrained"), ("baseline (MNRL)", "baseline"), ("pEBR", "pebr"))
        }
        ranking = h.experiment(ranked, topics["test"], test_qrels, RANKING_MEASURES, baseline="untrained")

    # ---- Table 3, Figure 2 --------------------------------------------------------------------------------------
    with h.stage("table3", "Table 3 grid and Figure 2 histogram"):
        table3 = table3_grid(lambda p: cdf(p, "test"), cfg.table3_ps, strata, include_all=True)
        fig2 = retrieved_count_histogram(
            histogram_counts,
            strata,
            h.path("figure2.png"),
            title=f"pEBR CDF cutoff at p={histogram_p:.4g} (mean k={max(cfg.ks)} on dev): retrieved per query",
        )
        fig3 = table3_plot(table3.drop(index="all"), h.path("table3.png"))
    table3 = table3.rename_axis("stratum").reset_index()
    table3.columns = ["stratum", *[f"{float(c):g}" for c in table3.columns[1:]]]

    # ---- per-query temperature vs number of relevant documents --------------------------------------------------
    q = enc[("pebr", "test")].merge(strata[["qid", "stratum", "value"]], on="qid")
    spread_col = "query_temp" if cfg.family != "beta_mle" else "query_alpha"
    rho, pval = spearmanr(q[spread_col], q["value"]) if q[spread_col].nunique() > 1 else (float("nan"),) * 2
    temp_by_stratum = q.groupby("stratum", observed=True)[spread_col].mean().to_dict()

    summary = {
        "strata_basis": basis,
        "significance": f"paired t-test against {SIGNIFICANCE_BASELINE!r} (pt.Experiment / scipy.stats.ttest_rel)",
        "training_loss_first_last": {n: [float(v[0]), float(v[-1])] for n, v in trained["losses"].items() if v},
        f"{spread_col}_test_quantiles_10_50_90": [float(x) for x in np.quantile(q[spread_col], [0.1, 0.5, 0.9])],
        f"{spread_col}_mean_by_stratum": {str(k): float(v) for k, v in temp_by_stratum.items()},
        f"spearman_{spread_col}_vs_num_relevant": {"rho": float(rho), "p": float(pval)},
        "figures": {"figure2": fig2, "table3": fig3},
    }
    # ---- per-query cutoffs beyond the paper (issue #13): calibrated law, recall targets, RLT baselines ----------
    from pyterrier_prob.experiments.pebr_cutoffs import cutoff_study

    # calibration needs the calibration queries' own collection (under --test-dataset, the training collection's)
    cal_index = indexes["pebr"]
    if data.train_collection is not coll and data.dev is not None:
        cal_index = h.dense_index("pebr", encoders["pebr"], data.train_collection)
    study = cutoff_study(
        h,
        data,
        {"dev": cal_index, "test": indexes["pebr"]},
        {"dev": enc[("pebr", "dev")], "test": enc[("pebr", "test")]},
        cfg.family,
        dim,
        cfg.ks,
        min(cfg.study_cap, coll.num_docs, data.train_collection.num_docs),
        cfg.recall_targets,
    )
    summary["cutoff_study"] = {
        "pit": study["pit"],
        "pit_per_query": study["pit_per_query"],
        "calibrated_law": study["calibrated_law"],
        "calibrated_law_list_features": study["calibrated_law_list_features"],
        "figures": study["figures"],
        "calibration_queries": data.cal_source,
    }
    summary["ranking_vs_untrained"] = {
        str(r["name"]): {m: float(r[m]) for m in RANKING_MEASURES} for _, r in ranking.iterrows()
    }
    md = (
        _ranking_markdown(ranking)
        + "\n"
        + _markdown(experiment, per_stratum, table3, calibration, summary)
        + "\n"
        + _study_markdown(study, data.cal_source)
    )
    summary = h.finish(
        "pEBR: CDF cutoff vs top-k and score cutoff at matched mean depth",
        md,
        {
            "results": experiment,
            "ranking": ranking,
            "strata": per_stratum,
            "table3": table3,
            "calibration": calibration,
            "cutoffs_matched_depth": study["matched"],
            "cutoffs_recall_targets": study["targets"],
        },
        summary,
        data,
    )
    cfg.timings.update(h.timings)
    return {
        "experiment": experiment,
        "strata": per_stratum,
        "table3": table3,
        "calibration": calibration,
        "summary": summary,
    }


def _setting(name: str, s: dict[str, float]) -> str:
    if name == "pEBR CDF cutoff":
        return f"p={s[name]:.6g}"
    if name.endswith("score cutoff"):
        return f"cos>={s[name]:.6g}"
    return "top-k"


def _study_markdown(study: dict[str, Any], cal_source: str) -> str:
    """The cutoff study's tables (issue #13) as Markdown."""
    lines = [
        "## Per-query cutoffs: calibrated law, recall targets, ranked-list-truncation baselines",
        "",
        f"Levels chosen on {cal_source}; lists = the pEBR model's top documents per query.",
        "",
        "PIT of the test queries' relevant cosines (uniform if the law describes them; KS against U(0, 1)), over "
        "all relevant pairs and per query (each query weighted once, as mean recall weighs it):",
        "",
        "| law | pairs | KS | mean | share < 0.01 | share > 0.99 | KS per query | mean per query |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, p in study["pit"].items():
        q = study["pit_per_query"][name]
        lines.append(
            f"| {name} | {p['n']:.0f} | {p['ks_statistic']:.3f} | {p['mean']:.3f} | {p['below_tail']:.3f} | "
            f"{p['above_tail']:.3f} | {q['ks_statistic']:.3f} | {q['mean']:.3f} |"
        )
    targets = study["targets"]
    resplit = "resplit_mean_recall" in targets
    lines += [
        "",
        "Recall targets (level by conformal risk control on the calibration queries; achieved on test"
        + (
            f"; re-splits: the calibration and test queries pooled and split again at random, "
            f"{int(targets['resplits'].iloc[0])} times"
            if resplit
            else ""
        )
        + "):",
        "",
        "| target | rule | reachable | test mean recall | test mean depth | test SetP | top-k k for same recall |"
        + (" re-splits: mean recall (5-95%) | share in [r-0.02, r+0.05] |" if resplit else ""),
        "|---|---|---|---|---|---|---|" + ("---|---|" if resplit else ""),
    ]
    for _, r in targets.iterrows():
        k = "—" if pd.isna(r["topk_k_for_same_recall"]) else f"{int(r['topk_k_for_same_recall'])}"
        extra = (
            f" {r['resplit_mean_recall']:.3f} ({r['resplit_recall_5']:.3f}-{r['resplit_recall_95']:.3f}) | "
            f"{r['resplit_share_in_range']:.2f} |"
            if resplit
            else ""
        )
        lines.append(
            f"| {r['target_recall']:g} | {r['rule']} | {'yes' if r['reachable_on_calibration'] else 'no'} | "
            f"{r['test_mean_recall']:.3f} | {r['test_mean_depth']:.1f} | {r['test_SetP']:.3f} | {k} |" + extra
        )
    lines += [
        "",
        "Matched mean depth (levels from the calibration queries; `*`: p < 0.05, paired t-test against top-k at k; the "
        "last column: top-k's SetR at the rule's own test mean depth, interpolated):",
        "",
        "| k | rule | test mean depth | SetR | SetP | SetF | top-k SetR at the same test depth |",
        "|---|---|---|---|---|---|---|",
    ]
    for _, r in study["matched"].iterrows():
        cells = [f"{r[m]:.4f}{p_mark(r.get(f'{m} p-value', np.nan))}" for m in ("SetR", "SetP", "SetF")]
        cells.append(f"{r['topk_SetR_at_same_depth']:.4f}")
        lines.append(f"| {r['k']} | {r['name']} | {r['test_mean_depth']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ranking_markdown(ranking: pd.DataFrame) -> str:
    """The ranking table (top 100 of each model; paired t-test against the untrained model)."""
    lines = [
        "Ranking (top 100 of each model; `*`: p < 0.05, paired t-test against the untrained model):",
        "",
        "| model | " + " | ".join(RANKING_MEASURES) + " |",
        "|---|" + "---|" * len(RANKING_MEASURES),
    ]
    for _, r in ranking.iterrows():
        cells = [f"{r[m]:.4f}{p_mark(r.get(f'{m} p-value', np.nan))}" for m in RANKING_MEASURES]
        lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _markdown(
    experiment: pd.DataFrame,
    per_stratum: pd.DataFrame,
    table3: pd.DataFrame,
    calibration: pd.DataFrame,
    summary: dict[str, Any],
) -> str:
    """The job's tables as Markdown (what goes into the README)."""
    lines = [
        f"`*`: p < 0.05, {summary['significance']}.",
        "",
        "| k | system | setting | test mean k | SetR | SetP |",
        "|---|---|---|---|---|---|",
    ]
    for _, r in experiment.iterrows():
        sr, sp = r.get("SetR p-value", np.nan), r.get("SetP p-value", np.nan)
        lines.append(
            f"| {r['k']} | {r['name']} | {r['setting']} | {r['test_mean_k']:.1f} | "
            f"{r['SetR']:.4f}{p_mark(sr)} | {r['SetP']:.4f}{p_mark(sp)} |"
        )
    lines += ["", f"Per stratum ({summary['strata_basis']}): SetR (mean k)", ""]
    strata = [s for s in ("all", "head", "torso", "tail") if s in set(per_stratum["stratum"])]
    lines += ["| k | system | " + " | ".join(strata) + " |", "|---|---|" + "---|" * len(strata)]
    for (k, name), g in per_stratum.groupby(["k", "name"], sort=False):
        g = g.set_index("stratum")
        cells = [
            f"{g.loc[s, 'SetR']:.4f}{p_mark(g.loc[s].get('SetR p-value', np.nan))} ({g.loc[s, 'mean_k']:.0f})"
            for s in strata
        ]
        lines.append(f"| {k} | {name} | " + " | ".join(cells) + " |")
    lines += ["", "Table 3 (pEBR CDF cutoff, test queries): mean retrieved documents per query", ""]
    ps = [c for c in table3.columns if c != "stratum"]
    lines += ["| stratum | " + " | ".join(f"p={float(p):g}" for p in ps) + " |"]
    lines += ["|---|" + "---|" * len(ps)]
    for s, row in table3.set_index("stratum").iterrows():
        lines.append(f"| {s} | " + " | ".join(f"{v:.1f}" for v in row) + " |")
    lines += ["", "Calibration (mean depth reached on the calibration queries):", ""]
    lines += ["| k | system | parameter | value | dev mean k | within 1% |", "|---|---|---|---|---|---|"]
    for _, r in calibration.iterrows():
        lines.append(
            f"| {r['k']} | {r['system']} | {r['parameter']} | {r['value']:.6g} | {r['dev_mean_k']:.2f} | "
            f"{'yes' if r['achieved_within_1pct'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"
