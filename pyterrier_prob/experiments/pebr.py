"""The pEBR experiment (``pyterrier-prob pebr``, and plain ``pyterrier-prob``; ``shared/papers/pebr.md``): a BetaNCE
head (Sec. 3.2.2) against an MNRL baseline, every variable-depth retriever calibrated to a mean depth k (Sec. 4.1.3)
and compared on test, overall and per stratum (Table 1, Table 3, Figure 2). Each stage can be called on its own; the
protocol: ``docs/pebr.md``."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import pandas as pd
from scipy.stats import spearmanr

from pyterrier_prob.evaluation import Calibration, assign_strata, calibrate_mean_k, evaluate_set_measures, table3_grid
from pyterrier_prob.experiments import pebr_cutoffs
from pyterrier_prob.experiments.claims import record_claims
from pyterrier_prob.experiments.harness import (
    CommonConfig,
    Data,
    Harness,
    TrainingPairs,
    base_model,
    insert_columns,
    markdown_table,
    measure_cell,
    option,
    subcommand,
)
from pyterrier_prob.experiments.report import cell
from pyterrier_prob.pebr import CDFCutoffRetriever, ProbBiEncoder, ScoreCutoffRetriever, TopKRetriever
from pyterrier_prob.plots import retrieved_count_histogram, table3_plot
from st_extensions import build_pebr_model, load_model
from st_extensions.losses import BetaMLELoss, BetaNCELoss, ExpNCELoss, MaskedMultipleNegativesRankingLoss
from st_extensions.pebr import find_head

__all__ = [
    "DESCRIPTION",
    "Encoded",
    "PebrJobConfig",
    "add_arguments",
    "calibrate",
    "config_from_args",
    "cutoffs",
    "encode",
    "query_spread",
    "ranking_quality",
    "run",
    "run_pebr_job",
    "table3_and_figure2",
    "test_runs",
    "train_models",
]

DESCRIPTION = (
    "pEBR (probabilistic embedding-based retrieval): fine-tune a BetaNCE pEBR model and an MNRL baseline with the "
    "same budget, index them (and BM25 with PISA), calibrate top-k / score-cutoff / CDF-cutoff retrieval to matched "
    "mean depth k on the dev split, and compare them on the test split with pt.Experiment, overall and per stratum."
)

SIGNIFICANCE_BASELINE = "pEBR top-k"  # the systems' paired t-tests are against it (the order: _runs_at)
MEASURES = ("SetR", "SetP")
RANKING_MEASURES = ("nDCG@10", "R@100")
STUDY_KEYS = ("pit", "pit_per_query", "calibrated_law", "calibrated_law_list_features", "figures")  # in summary.json
FAMILIES = ("beta", "exp", "beta_mle")
#: the frozen recipe's rates for ``--family beta_mle``: BetaMLE's log-likelihood (Sec. 3.1) pulls the embedding space
#: towards fitting the laws, and every adapter rate above 0 lowered nDCG@10 on nfcorpus/dev
#: (``benchmarks/recipe_search.py --methods pebr_mle``): only the head learns
MLE_FROZEN_RATES = {"LinearAdapter": 0.0}


@dataclass
class PebrJobConfig(CommonConfig):
    """The ``pyterrier-prob pebr`` options beyond :class:`CommonConfig`'s, each field's help its documentation."""

    output: str = "outputs/pebr"
    family: str = option(
        "beta", "pEBR head and loss: BetaNCE (beta), ExpNCE (exp) or BetaMLE (beta_mle)", choices=FAMILIES
    )
    ks: Sequence[int] = option((10, 50, 100), "matched mean depths (documents per query)")
    cap: int = option(1000, "most documents a cutoff retriever returns (the paper's maximum K)")
    geometry: str = option(
        "line",
        "cosine law of the CDF cutoff: 1-D (line, Sec. 3.2, what the loss trains) or sphere-corrected (sphere, App. A)",
        choices=("line", "sphere"),
    )
    table3_ps: Sequence[float] = option((0.99, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4), "CDF values of Table 3")
    recall_targets: Sequence[float] = option(
        (0.5, 0.8, 0.9), "recall targets met by conformal risk control on the calibration queries (cutoff study)"
    )
    study_cap: int = option(10000, "ranked-list length of the cutoff study (high recall targets need deep lists)")
    timings: dict[str, float] = field(default_factory=dict, repr=False)

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting out of range."""
        super().check()
        if not self.ks or any(int(k) != k or k < 1 for k in self.ks):
            raise ValueError(f"ks must be positive integers, got {list(self.ks)}")
        for name in ("cap", "study_cap"):
            if getattr(self, name) < max(self.ks):
                raise ValueError(f"{name} ({getattr(self, name)}) must be at least the largest k ({max(self.ks)})")
        for name in ("recall_targets", "table3_ps"):
            values = list(getattr(self, name))
            if not values or any(not 0 < v < 1 for v in values):
                raise ValueError(f"{name} must lie strictly inside (0, 1), got {values}")


add_arguments, config_from_args = subcommand(PebrJobConfig, "pEBR")  # what ``pyterrier-prob`` calls


def run_pebr_job(cfg: PebrJobConfig) -> dict[str, Any]:
    """Run the pEBR experiment into ``cfg.output``; returns its main tables and ``"summary"``."""
    h = Harness("pebr", cfg)
    data = h.load_data()
    trained = train_models(cfg, h, data)
    enc = encode(cfg, h, data, trained["models"])
    calibration, settings = calibrate(cfg, h, data, enc)
    tested = test_runs(cfg, h, data, enc, settings)
    ranking = ranking_quality(h, data, enc)
    table3, figures = table3_and_figure2(cfg, h, enc, tested)
    study = cutoffs(cfg, h, data, enc)
    summary = {
        "strata_basis": tested["strata"].attrs.get("basis", str(tested["strata"]["basis"].iloc[0])),
        "significance": f"paired t-test against {SIGNIFICANCE_BASELINE!r} (pt.Experiment / scipy.stats.ttest_rel)",
        "training_loss_first_last": {n: [float(v[0]), float(v[-1])] for n, v in trained["losses"].items() if v},
        **query_spread(cfg, enc, tested["strata"]),
        "figures": figures,
        "cutoff_study": {**{k: study[k] for k in STUDY_KEYS}, "calibration_queries": data.cal_source},
        "ranking_vs_untrained": {
            str(r["name"]): {m: float(r[m]) for m in RANKING_MEASURES} for _, r in ranking.iterrows()
        },
    }
    md = _markdown(ranking, tested, table3, calibration, summary)
    md += "\n" + pebr_cutoffs.study_markdown(study, data.cal_source)
    out = {"experiment": tested["experiment"], "strata": tested["per_stratum"], "table3": table3}
    out["calibration"] = calibration
    tables = {"results": out["experiment"], "ranking": ranking, "strata": out["strata"], "table3": table3}
    tables |= {"calibration": calibration, "cutoffs_matched_depth": study["matched"]}
    tables["cutoffs_recall_targets"] = study["targets"]
    summary["claims"] = cutoff_claims(data, study["matched"])  # the claims file's rows, in the run's own JSON too
    record_claims(cfg, summary["claims"])
    title = "pEBR: CDF cutoff vs top-k and score cutoff at matched mean depth"
    return {**out, "summary": h.finish(title, md, tables, summary, data)}


def cutoff_claims(data: Data, matched: pd.DataFrame) -> list[dict[str, Any]]:
    """Claims ``cutoff_vs_topk_k<k>``: the cutoff rule with the best SetR on the calibration queries (its levels set
    for a mean depth of k there) against top-k at the rule's own test mean depth (``depth``), interpolated per query
    between the neighbouring k, with the matched-depth table's paired t-test (``p_vs_topk_at_same_depth``)."""
    rows = []
    for k, g in matched.groupby("k"):
        g = g.set_index("name")
        rules = g[(g.index != "top-k") & ~g.index.str.startswith("oracle")]
        if rules.empty:
            continue
        best = rules["calibration_SetR"].astype(float).idxmax()
        r = g.loc[best]
        row = {"paper": "pebr", "claim": f"cutoff_vs_topk_k{k}", "system": "per-query cutoff (chosen on calibration)"}
        row |= {"rule": best, "calibration_SetR": float(r["calibration_SetR"]), "depth": float(r["test_mean_depth"])}
        row |= {"baseline": "top-k at the same mean depth", "metric": "SetR", "value": float(r["SetR"])}
        row |= {"baseline_value": float(r["topk_SetR_at_same_depth"]), "p": float(r["p_vs_topk_at_same_depth"])}
        rows.append({**row, "queries": len(data.test_topics)})
    return rows


def _pebr_model(cfg: PebrJobConfig, projection: bool) -> Any:
    """``--model`` when it has a pEBR head, else a new head (``projection``: on a LinearAdapter) on it."""
    if cfg.model:
        model = load_model(cfg.model, device="cpu")
        with contextlib.suppress(ValueError):  # no head: a new one below
            find_head(model)
            return model
    return build_pebr_model(cfg.model, family=cfg.family, device="cpu", projection=projection)


def train_models(cfg: PebrJobConfig, h: Harness, data: Data) -> dict[str, Any]:
    """The pEBR and baseline (masked MNRL) models trained with the same recipe, rows and budget (nothing to train: the
    given model, with a new pEBR head unless it has one), and the untrained one; returns ``{"models": {"pebr",
    "baseline", "untrained"}, "losses": {"pebr", "baseline"}}``."""
    adapter = h.recipe.caches_features
    pairs = TrainingPairs(data, cfg.seed) if data.train else None
    settings = {"family": cfg.family, "train": f"{data.train_collection.name}/{data.train}", "judged_masked": True}
    mle_rates = MLE_FROZEN_RATES if adapter and cfg.family == "beta_mle" else None
    systems = {  # name -> (model, loss, module rates): the same recipe, rows and budget
        "pebr": (_pebr_model, {"exp": ExpNCELoss, "beta": BetaNCELoss, "beta_mle": BetaMLELoss}[cfg.family], mle_rates),
        "baseline": (base_model, MaskedMultipleNegativesRankingLoss, None),  # a pEBR --model: its encoder
    }
    dev = h.dev_evaluator(data, "nDCG@10") if pairs else None  # both systems' dev curve: the same measure and pool
    models, losses = {}, {}
    for name, (build, loss, rates) in systems.items():
        args = (partial(build, cfg, adapter), pairs and partial(pairs.loss, cls=loss), pairs)
        models[name], losses[name] = h.train(name, *args, module_learning_rates=rates, settings=settings, dev=dev)
    models["untrained"], _ = h.train("untrained", partial(base_model, cfg), None, None)
    return {"models": models, "losses": losses}


@dataclass
class Encoded:
    """The models' encoders and test indexes, the encoded ``"dev"`` and ``"test"`` queries, and their retrievers."""

    cfg: PebrJobConfig
    encoders: dict[str, Any]
    indexes: dict[str, Any]
    queries: dict[tuple[str, str], pd.DataFrame]  # (model, split) -> encoded queries
    dim: int | None  # the sphere-corrected law's dimension (None: the 1-D law)

    def topk(self, name: str, k: int, split: str = "test") -> pd.DataFrame:
        return TopKRetriever(self.indexes[name], num_results=k)(self.queries[(name, split)])

    def score_cutoff(self, name: str, threshold: float, split: str = "dev") -> pd.DataFrame:
        retriever = ScoreCutoffRetriever(self.indexes[name], threshold=threshold, num_results=self.cfg.cap)
        return retriever(self.queries[(name, split)])

    def cdf_cutoff(self, p: float, split: str = "dev") -> pd.DataFrame:
        cfg = self.cfg
        r = CDFCutoffRetriever(self.indexes["pebr"], p=p, family=cfg.family, dim=self.dim, num_results=cfg.cap)
        return r(self.queries[("pebr", split)])


def encode(cfg: PebrJobConfig, h: Harness, data: Data, models: dict[str, Any]) -> Encoded:
    """Index the test collection with every model and encode the calibration and test queries."""
    encoders = {n: ProbBiEncoder(h.encoding_model(m), batch_size=64, verbose=False) for n, m in models.items()}
    if encoders["pebr"].family != cfg.family:
        raise ValueError(
            f"the pEBR model has family {encoders['pebr'].family!r}, not {cfg.family!r}: pass --family "
            f"{encoders['pebr'].family} (or run without --reuse / with another --output)"
        )
    indexes = {n: h.dense_index(n, e, data.test_collection) for n, e in encoders.items()}
    topics = {"dev": data.cal_topics, "test": data.test_topics}
    with h.stage("encode_queries", "encoding the calibration and test queries"):
        queries = {(n, s): encoders[n].query_encoder()(topics[s]) for n in encoders for s in ("dev", "test")}
    # the sphere law's dimension from the model itself: the frozen recipe's encoding model (its cached encoder
    # outputs, then the added modules) cannot tell it
    dim = ProbBiEncoder(models["pebr"]).dim if cfg.geometry == "sphere" else None
    return Encoded(cfg, encoders, indexes, queries, dim)


def _calibrated(
    run: Any, k: int, lo: float, hi: float, increasing: bool, topics: pd.DataFrame
) -> tuple[Calibration, bool]:
    """:func:`calibrate_mean_k` of one rule and False, or the end of ``[lo, hi]`` whose mean depth is nearest ``k``
    and True when ``k`` is out of reach (beyond the deepest setting, or below the shallowest)."""
    try:
        return calibrate_mean_k(run, k, lo, hi, increasing=increasing, topics=topics, max_iter=80), False
    except ValueError as e:
        if "unreachable" not in str(e):
            raise
    depth = {x: float(run(x).groupby("qid").size().reindex(topics["qid"], fill_value=0).mean()) for x in (lo, hi)}
    edge = min(depth, key=lambda x: abs(depth[x] - k))
    return Calibration(value=edge, mean_k=depth[edge], target_k=k, iterations=2, achieved=False), True


def calibrate(
    cfg: PebrJobConfig, h: Harness, data: Data, enc: Encoded
) -> tuple[pd.DataFrame, dict[int, dict[str, float]]]:
    """On the calibration queries only, each variable-depth rule's setting (p, cosine threshold) for a mean depth of k
    (Sec. 4.1.3); returns the calibration table and ``k -> system -> setting``."""
    rules = (
        ("pEBR CDF cutoff", enc.cdf_cutoff, 1e-9, 1 - 1e-9, True),
        ("pEBR score cutoff", partial(enc.score_cutoff, "pebr"), -1.0, 1.0, False),
        ("baseline score cutoff", partial(enc.score_cutoff, "baseline"), -1.0, 1.0, False),
    )
    rows, settings = [], {}
    jobs = [(k, *rule) for k in cfg.ks for rule in rules]
    with h.stage("calibrate", f"calibrating the cutoffs to mean depth k in {list(cfg.ks)} on {data.cal_source}"):
        for k, system, run, lo, hi, increasing in h.progress(jobs, "calibrating", unit="cutoff"):
            c, unreachable = _calibrated(run, k, lo, hi, increasing, data.cal_topics)
            if unreachable:
                data.notes.append(
                    f"{system}: mean depth {k} is unreachable on the calibration queries "
                    f"({'at most' if c.mean_k < k else 'at least'} {c.mean_k:.2f})"
                )
            settings.setdefault(k, {})[system] = float(c.value)
            parameter = "p" if system == "pEBR CDF cutoff" else "threshold"
            rows.append([k, system, parameter, float(c.value), c.mean_k, c.achieved, c.iterations])
    columns = ["k", "system", "parameter", "value", "dev_mean_k", "achieved_within_1pct", "iterations"]
    return pd.DataFrame(rows, columns=columns), settings


def _runs_at(h: Harness, enc: Encoded, bm25: Any, topics: pd.DataFrame, k: int, s: dict[str, float]) -> dict:
    """Every system's test run at mean depth ``k`` (the cutoffs at their calibrated settings ``s``)."""
    runs = {
        "BM25": h.bm25_run(bm25, topics, k),
        "untrained top-k": enc.topk("untrained", k),
        "baseline top-k": enc.topk("baseline", k),
        "baseline score cutoff": enc.score_cutoff("baseline", s["baseline score cutoff"], "test"),
        "pEBR top-k": enc.topk("pebr", k),
        "pEBR score cutoff": enc.score_cutoff("pebr", s["pEBR score cutoff"], "test"),
        "pEBR CDF cutoff": enc.cdf_cutoff(s["pEBR CDF cutoff"], "test"),
    }
    return {n: r[["qid", "docno", "score", "rank"]] for n, r in runs.items()}


def test_runs(
    cfg: PebrJobConfig, h: Harness, data: Data, enc: Encoded, settings: dict[int, dict[str, float]]
) -> dict[str, Any]:
    """On the test queries, every system at each k in ``pt.Experiment`` (paired t-tests against pEBR top-k), overall
    and per stratum (Table 1); returns ``{"experiment", "per_stratum", "strata", "histogram_counts", "histogram_p"}``
    (the last two: the CDF cutoff's counts per query at the largest k, for Figure 2)."""
    topics, qrels = data.test_topics, data.test_qrels
    bm25 = h.bm25(data.test_collection)
    strata = assign_strata(topics, qrels)
    out: dict[str, Any] = {"strata": strata}
    experiments, per_stratum = [], []
    qids = topics["qid"].astype(str).tolist()
    with h.stage("test", f"running the systems on {data.test_collection.name}/{data.test} (pt.Experiment per k)"):
        for k in h.progress(cfg.ks, "scoring", unit="k"):
            runs = _runs_at(h, enc, bm25, topics, k, settings[k])
            exp = h.experiment(runs, topics, qrels, MEASURES, baseline=SIGNIFICANCE_BASELINE)
            counts = {n: r.groupby("qid").size().reindex(topics["qid"], fill_value=0) for n, r in runs.items()}
            mean_k = [float(counts[n].mean()) for n in exp["name"]]
            insert_columns(exp, 1, k=k, test_mean_k=mean_k, setting=[_setting(n, settings[k]) for n in exp["name"]])
            # a system's test mean k is near k, not k: pEBR top-k is also taken at the system's own test mean k
            deep = math.ceil(max(mean_k)) + 1
            topk = pebr_cutoffs.topk_recall_per_query(enc.topk("pebr", deep), qrels, qids, deep)
            names = ("pebr_topk_SetR_at_same_k", "p_vs_pebr_topk_at_same_k")
            pebr_cutoffs.same_depth_columns(exp, runs, qrels, qids, topk, "test_mean_k", names)
            experiments.append(exp)
            st = evaluate_set_measures(runs, qrels, strata, measures=MEASURES, baseline=SIGNIFICANCE_BASELINE)
            per_stratum.append(insert_columns(st, 1, k=k))
            if k == max(cfg.ks):
                out["histogram_counts"], out["histogram_p"] = counts["pEBR CDF cutoff"], settings[k]["pEBR CDF cutoff"]
    out["experiment"] = pd.concat(experiments, ignore_index=True)
    out["per_stratum"] = pd.concat(per_stratum, ignore_index=True)
    return out


def ranking_quality(h: Harness, data: Data, enc: Encoded) -> pd.DataFrame:
    """nDCG@10 and R@100 of each model's top 100, paired t-tests against the untrained model."""
    with h.stage("ranking", "ranking quality (nDCG@10, R@100) against the untrained model"):
        ranked = {
            label: enc.topk(n, 100)[["qid", "docno", "score", "rank"]]
            for label, n in (("untrained", "untrained"), ("baseline (MNRL)", "baseline"), ("pEBR", "pebr"))
        }
        return h.experiment(ranked, data.test_topics, data.test_qrels, RANKING_MEASURES, baseline="untrained")


def table3_and_figure2(
    cfg: PebrJobConfig, h: Harness, enc: Encoded, tested: dict[str, Any]
) -> tuple[pd.DataFrame, dict[str, str]]:
    """Table 3 (mean retrieved documents per stratum against p, test queries) and Figure 2 (histogram of the pEBR
    CDF cutoff's retrieved counts at the largest k); returns the table and the figures' paths."""
    strata = tested["strata"]
    with h.stage("table3", "Table 3 grid and Figure 2 histogram"):
        table3 = table3_grid(partial(enc.cdf_cutoff, split="test"), cfg.table3_ps, strata, include_all=True)
        title = f"pEBR CDF cutoff at p={tested['histogram_p']:.4g} (mean k={max(cfg.ks)} on dev): retrieved per query"
        fig2 = retrieved_count_histogram(tested["histogram_counts"], strata, h.path("figure2.png"), title=title)
        fig3 = table3_plot(table3.drop(index="all"), h.path("table3.png"))
    table3 = table3.rename_axis("stratum").reset_index()
    table3.columns = ["stratum", *[f"{float(c):g}" for c in table3.columns[1:]]]
    return table3, {"figure2": fig2, "table3": fig3}


def query_spread(cfg: PebrJobConfig, enc: Encoded, strata: pd.DataFrame) -> dict[str, Any]:
    """The head's per-query spread on the test queries: quantiles, mean per stratum, rho against the relevant count."""
    q = enc.queries[("pebr", "test")].merge(strata[["qid", "stratum", "value"]], on="qid")
    col = "query_temp" if cfg.family != "beta_mle" else "query_alpha"
    rho, pval = spearmanr(q[col], q["value"]) if q[col].nunique() > 1 else (float("nan"),) * 2
    by_stratum = q.groupby("stratum", observed=True)[col].mean().to_dict()
    return {
        f"{col}_test_quantiles_10_50_90": [float(x) for x in np.quantile(q[col], [0.1, 0.5, 0.9])],
        f"{col}_mean_by_stratum": {str(k): float(v) for k, v in by_stratum.items()},
        f"spearman_{col}_vs_num_relevant": {"rho": float(rho), "p": float(pval)},
    }


def cutoffs(cfg: PebrJobConfig, h: Harness, data: Data, enc: Encoded) -> dict[str, Any]:
    """The per-query cutoff study beyond the paper (issue #13; :func:`~pyterrier_prob.experiments.pebr_cutoffs.
    cutoff_study`) on the pEBR model's lists of the calibration queries' own collection and of test."""
    coll = data.test_collection
    cal_index = enc.indexes["pebr"]
    if data.train_collection is not coll and data.dev is not None:
        cal_index = h.dense_index("pebr", enc.encoders["pebr"], data.train_collection)
    cap = min(cfg.study_cap, coll.num_docs, data.train_collection.num_docs)
    study = pebr_cutoffs.StudyConfig(family=cfg.family, dim=enc.dim, ks=cfg.ks, cap=cap, targets=cfg.recall_targets)
    queries = {s: enc.queries[("pebr", s)] for s in ("dev", "test")}
    return pebr_cutoffs.cutoff_study(h, data, {"dev": cal_index, "test": enc.indexes["pebr"]}, queries, study)


def _setting(name: str, s: dict[str, float]) -> str:
    if name == "pEBR CDF cutoff":
        return f"p={s[name]:.6g}"
    if name.endswith("score cutoff"):
        return f"cos>={s[name]:.6g}"
    return "top-k"


def _markdown(
    ranking: pd.DataFrame, tested: dict[str, Any], table3: pd.DataFrame, calibration: pd.DataFrame, summary: dict
) -> str:
    """The job's tables as Markdown (what goes into the README; the cutoff study's: :func:`study_markdown`)."""
    experiment, per_stratum = tested["experiment"], tested["per_stratum"]
    ranked = [[r["name"], *(measure_cell(r, m) for m in RANKING_MEASURES)] for _, r in ranking.iterrows()]
    strata = [s for s in ("all", "head", "torso", "tail") if s in set(per_stratum["stratum"])]
    by_stratum = [
        [k, name, *(f"{measure_cell(g.loc[s], 'SetR')} ({g.loc[s, 'mean_k']:.0f})" for s in strata)]
        for (k, name), g in ((key, g.set_index("stratum")) for key, g in per_stratum.groupby(["k", "name"], sort=False))
    ]
    t3 = [[s, *(f"{v:.1f}" for v in row)] for s, row in table3.set_index("stratum").iterrows()]
    cal = [
        [r["k"], r["system"], r["parameter"], f"{r['value']:.6g}", f"{r['dev_mean_k']:.2f}"]
        + ["yes" if r["achieved_within_1pct"] else "no"]
        for _, r in calibration.iterrows()
    ]
    ps = [f"p={float(p):g}" for p in table3.columns if p != "stratum"]
    ranking_title = "Ranking (top 100 of each model; `*`: p < 0.05, paired t-test against the untrained model):"
    main_title = (
        f"`*`: p < 0.05, {summary['significance']} at k, as the paper compares; a system's test mean k is near k, not "
        "k, so the last two columns compare its SetR with pEBR top-k at the system's own test mean k (interpolated "
        "per query between the neighbouring k; paired t-test):"
    )
    cal_columns = ["k", "system", "parameter", "value", "dev mean k", "within 1%"]
    parts = [
        (ranking_title, ranked, ["model", *RANKING_MEASURES]),
        (main_title, table1(experiment).to_numpy().tolist(), TABLE1_COLUMNS),
        (
            f"Per stratum ({summary['strata_basis']}): SetR (mean k; `*` against pEBR top-k at k)",
            by_stratum,
            ["k", "system", *strata],
        ),
        ("Table 3 (pEBR CDF cutoff, test queries): mean retrieved documents per query", t3, ["stratum", *ps]),
        ("Calibration (mean depth reached on the calibration queries):", cal, cal_columns),
    ]
    tables = (f"{title}\n\n{markdown_table(pd.DataFrame(rows, columns=cols))}" for title, rows, cols in parts)
    return "\n\n".join(tables) + "\n"


TABLE1_COLUMNS = ["k", "system", "setting", "test mean k", "SetR", "SetP"]
TABLE1_COLUMNS += ["pEBR top-k SetR at the same test mean k", "p (same k)"]


def table1(experiment: pd.DataFrame) -> pd.DataFrame:
    """Table 1 as the report prints it, from the run's ``results`` frame (or its records in a results JSON's
    ``tables``): every system at each k, ``*`` against pEBR top-k at k, then against pEBR top-k at its own test
    mean k."""
    rows = [
        [r["k"], r["name"], r["setting"], f"{r['test_mean_k']:.1f}", measure_cell(r, "SetR"), measure_cell(r, "SetP")]
        + [f"{r['pebr_topk_SetR_at_same_k']:.4f}", cell(r["p_vs_pebr_topk_at_same_k"], ".3g")]
        for _, r in experiment.iterrows()
    ]
    return pd.DataFrame(rows, columns=TABLE1_COLUMNS)


run = run_pebr_job  # what ``pyterrier-prob pebr`` runs
