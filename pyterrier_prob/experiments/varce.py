"""The VarCrossEncoder experiment (``pyterrier-prob varce``; ``shared/papers/var-cross-encoder.md``): CrossEncoder
against VarCrossEncoder re-rankers of BM25 (E[s], Eq. 22; variance, Eq. 23; variational BCE, Eq. 10); the protocol:
``docs/varce.md``. By default (``--teacher partial``, or a teacher folder)
:mod:`pyterrier_prob.experiments.varce_distill` runs; ``--teacher none``: the label recipe (:func:`run_varce_job`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import pandas as pd

from pyterrier_prob.experiments import varce_distill
from pyterrier_prob.experiments.harness import Data, Harness, insert_columns, slug, subcommand
from pyterrier_prob.experiments.varce_config import NOISE_ORDER, RECIPE_DEFAULTS, VarceJobConfig
from pyterrier_prob.experiments.varce_report import markdown
from pyterrier_prob.experiments.varce_train import (
    BASELINE,
    Target,
    Trained,
    dev_target,
    recipe_summary,
    score_fingerprint,
    target_stage,
    train_stage,
)
from pyterrier_prob.fusion import choose_alpha
from pyterrier_prob.varce import hard_query_table, per_query
from pyterrier_prob.varce.analysis import choose_risk, interpolated, ranked, rerank_rows, risk_table, uncertainty_stats
from pyterrier_prob.varce.noise import build_noises
from pyterrier_prob.varce.scoring import PairScorer, SharedLayers
from st_extensions.cross_encoder.frozen import cached_cross_encoder

__all__ = [
    "DESCRIPTION",
    "RECIPE_DEFAULTS",
    "MEASURES",
    "NOISE_ORDER",
    "VarceJobConfig",
    "add_arguments",
    "build_noises",
    "config_from_args",
    "run",
    "run_varce_job",
]

DESCRIPTION = (
    "VarCrossEncoder (uncertainty-aware cross-encoder re-ranking): by default, distil a CrossEncoder and a "
    "VarCrossEncoder (VAR; --students adds MEANVAR) from a bi-encoder + BM25 teacher fine-tuned in the run (--teacher "
    "none: train CE, MEANVAR and VAR with the same budget on the labels, BCE and variational BCE (Eq. 10), on rows of "
    "one judged-relevant document and N negatives mined from BM25 and the untrained dense model), re-rank the BM25 "
    "candidates of the test collection, compare them with pt.Experiment (nDCG@10, RR@10, paired t-tests against CE), "
    "and report the score uncertainty (spread, correlation with nDCG@10, risk-aware ranking, selective prediction), "
    "the hard queries (Table 8) and, under --teacher none, the robustness to six query perturbations (Table 4)."
)

MEASURES = ("nDCG@10", "RR@10")
add_arguments, config_from_args = subcommand(VarceJobConfig, "VarCrossEncoder")  # what ``pyterrier-prob`` calls


def run(cfg: VarceJobConfig) -> dict[str, Any]:
    """The run ``cfg`` asks for: the distillation run (:func:`varce_distill.run`), its teacher alone
    (``--teacher-only``) or the label recipe (``--teacher none``, :func:`run_varce_job`)."""
    if cfg.teacher_only:  # the teacher alone, for runs that read it (--teacher <its folder>)
        folder = varce_distill.make_teacher(cfg)
        print(f"the teacher: {folder} (--teacher {folder})")
        return {"teacher": folder}
    if cfg.teacher:
        return varce_distill.run(cfg)
    return run_varce_job(cfg)


def run_varce_job(cfg: VarceJobConfig) -> dict[str, Any]:
    """Run the VarCrossEncoder experiment (docs/varce.md) into ``cfg.output``; returns its tables and ``"summary"``."""
    h = Harness("varce", cfg)  # checks cfg
    data = h.load_data(calibrate=False)  # dev queries choose lambda and alpha; every test query is evaluated
    job = VarceRun(cfg, h, data, train_stage(cfg, h, data), target_stage(cfg, h, data))
    results = job.rerank()
    dev = job.choose_on_dev()
    uncertainty, risk = job.uncertainty(dev["risk"])
    tables = {"results": results, "uncertainty": uncertainty, "risk": risk, "hard_queries": job.hard_queries()}
    tables["robustness"], examples = job.robustness()
    summary = job.summary(dev, examples)
    md = markdown(tables, summary, job.baseline)
    title = "VarCrossEncoder: CrossEncoder vs VarCrossEncoder re-ranking of BM25"
    summary = h.finish(title, md, {k: v for k, v in tables.items() if not v.empty}, summary, data)
    return {**tables, "summary": summary}


class VarceRun:
    """The scoring and analysis stages of one run, over its re-rankers (``trained``) and evaluated collections."""

    def __init__(self, cfg: VarceJobConfig, h: Harness, data: Data, trained: Trained, targets: list[Target]):
        self.cfg, self.h, self.data, self.trained, self.targets = cfg, h, data, trained, targets
        self.baseline = BASELINE if BASELINE in trained.models else "BM25"
        self.var_systems = [n for n in trained.models if n.startswith("VarCE")]
        self.risks = sorted({0.0, *map(float, cfg.risks)})
        self.shared = None
        if h.recipe.caches_states and trained.fine_tuned:
            self.shared = SharedLayers.find(trained.models, cfg.train_layers, cfg.inference_batch_size, h.progress)
        self.scorers = {
            n: PairScorer(
                n,
                self._scoring_model(m),
                cfg.inference_batch_size,
                cache_path=h.path("scores", f"{n}.tsv"),
                fingerprint=score_fingerprint(h, n, trained.fine_tuned, cfg),
                fresh=not cfg.reuse,
                progress=h.progress,
            )
            for n, m in trained.models.items()
        }
        self.cands: dict[str, pd.DataFrame] = {}
        self.runs: dict[str, dict[str, pd.DataFrame]] = {}

    def _scoring_model(self, model: Any) -> Any:
        """Under the frozen recipe ``model``'s head on the cached backbone features (if separate), else ``model``."""
        if self.trained.features is None:
            return model
        try:
            return cached_cross_encoder(model, cache=self.trained.features)
        except ValueError:
            return model

    def scores(self, label: str, cand: pd.DataFrame) -> dict[str, tuple[Any, Any]]:
        """Every re-ranker's ``(E[s], std[s])`` of the rows of ``cand``, each new pair scored once."""
        if self.shared is not None:
            self.shared.prefetch(label, cand, self.scorers)
        return {n: sc.score(label, cand) for n, sc in self.scorers.items()}

    def runs_of(self, label: str, cand: pd.DataFrame) -> dict[str, pd.DataFrame]:
        """BM25's run of ``cand`` and every re-ranker's (by E[s])."""
        return {"BM25": cand[["qid", "docno", "score", "rank"]]} | {
            n: ranked(cand, mean, std) for n, (mean, std) in self.scores(label, cand).items()
        }

    def rerank(self) -> pd.DataFrame:
        """``pt.Experiment`` of BM25 and the re-rankers on every evaluated collection."""
        tables = []
        names = ", ".join(self.scorers)
        for tg in self.targets:
            what = f"re-ranking BM25's top {tg.depth} of {len(tg.topics)} {tg.label}/{tg.split} queries with {names}"
            with self.h.stage("rerank_" + slug(tg.label, "_"), what):
                cand = self.cands[tg.label] = tg.candidates(self.h, tg.topics, tg.depth)
                self.runs[tg.label] = self.runs_of(tg.label, cand)
                exp = self.h.experiment(self.runs[tg.label], tg.topics, tg.qrels, MEASURES, baseline=self.baseline)
            tables.append(insert_columns(exp, collection=tg.label, queries=len(tg.topics), depth=tg.depth))
        return pd.concat(tables, ignore_index=True)

    def choose_on_dev(self) -> dict[str, dict[str, Any]]:
        """On dev queries (BM25 top ``--depth``): lambda of the risk-aware ranking per VarCE and alpha of each
        re-ranker's interpolation with BM25; ``{"risk": ..., "alpha": ...}`` (empty without dev queries)."""
        cfg, chosen, alphas = self.cfg, {}, {}
        if not (self.scorers and self.data.dev is not None and cfg.dev_queries):
            if self.data.dev is not None:
                self.data.notes.append(f"the dev split ({self.data.cal_source}) is not used (--dev-queries 0)")
            return {"risk": chosen, "alpha": alphas}
        dev = dev_target(cfg, self.h, self.data, cfg.depth)
        with self.h.stage("risk_dev", f"choosing lambda and alpha on {len(dev.topics)} {dev.label} queries"):
            cand = dev.candidates(self.h, dev.topics, cfg.depth)
            for n, (mean, std) in self.scores(dev.label, cand).items():
                alpha, by_alpha = choose_alpha(partial(_dev_ndcg, dev, partial(interpolated, cand, mean)))
                alphas[n] = {"alpha": alpha, "dev_nDCG@10": by_alpha, "dev": dev.label}
                if n in self.var_systems and len(self.risks) > 1:
                    best, by_risk = choose_risk(partial(_dev_ndcg, dev, partial(ranked, cand, mean, std)), self.risks)
                    chosen[n] = {"lambda": best, "dev_nDCG@10": by_risk, "dev": dev.label}
        self.data.notes.append(
            f"chosen on {len(dev.topics)} seeded {dev.label} queries (BM25 top {cfg.depth}): alpha of each re-ranker's "
            "interpolation with BM25" + (", lambda of each VarCE's risk-aware ranking" if chosen else "")
            + "; used unchanged on every evaluated collection"
        )  # fmt: skip
        return {"risk": chosen, "alpha": alphas}

    def uncertainty(self, chosen: dict[str, dict[str, Any]]) -> tuple[pd.DataFrame, pd.DataFrame]:
        """Per VarCE and collection: the spread and informativeness of std[s], and the risk-aware ranking for every
        lambda (the dev choice's test values are added to ``chosen``)."""
        rows, tables = [], []
        with self.h.stage("uncertainty", "uncertainty of the VarCE scores and risk-aware ranking"):
            for tg in self.targets:
                for n in self.var_systems:
                    run = self.runs[tg.label][n]
                    ndcg = per_query(run, tg.qrels, MEASURES[0], topics=tg.topics)
                    rows.append({"collection": tg.label, "name": n, **uncertainty_stats(run, ndcg)})
                    exp = risk_table(run, tg.topics, tg.qrels, self.risks, MEASURES)
                    insert_columns(exp, collection=tg.label, model=n)
                    exp["chosen_on_dev"] = [n in chosen and r == chosen[n]["lambda"] for r in self.risks]
                    tables.append(exp)
                    if n in chosen and tg is self.targets[0]:
                        row = exp[exp["chosen_on_dev"]].iloc[0]
                        chosen[n] |= {"test": tg.label, "test_nDCG@10": float(row["nDCG@10"])}
                        chosen[n]["test_nDCG@10_at_lambda_0"] = float(exp.iloc[0]["nDCG@10"])
                        chosen[n]["p_vs_lambda_0"] = float(row.get("nDCG@10 p-value", math.nan))
        return pd.DataFrame(rows), pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()

    def hard_queries(self) -> pd.DataFrame:
        """Table 8: every system on the bottom 50% of the queries by nDCG@10 under the baseline and under BM25."""
        tables = []
        with self.h.stage("hard_queries", "hard queries (bottom 50% by nDCG@10 under the baseline)"):
            for tg in self.targets:
                for under in dict.fromkeys([self.baseline, "BM25"]):
                    runs = self.runs[tg.label]
                    tab = hard_query_table(runs, tg.qrels, under, list(MEASURES), 0.5, k=10, topics=tg.topics)
                    tables.append(insert_columns(tab, collection=tg.label, hard_under=under))
        return pd.concat(tables, ignore_index=True)

    def robustness(self) -> tuple[pd.DataFrame, dict[str, list[list[str]]]]:
        """Table 4: the clean and perturbed runs of ``--robust-queries`` seeded test queries, BM25's top
        ``--robust-depth`` of the (perturbed) query re-ranked; nDCG@10 drop against the clean queries."""
        cfg, target = self.cfg, self.targets[0]
        if cfg.robust_queries == 0 or not cfg.noise:
            return pd.DataFrame(), {}
        sub = target.topics
        if cfg.robust_queries < len(sub):
            sub = sub.sample(n=cfg.robust_queries, random_state=cfg.seed).sort_values("qid").reset_index(drop=True)
        what = f"{len(sub)} {target.label} queries, {len(cfg.noise)} perturbations, BM25 top {cfg.robust_depth}"
        with self.h.stage("robustness", f"robustness: {what} of the perturbed query"):
            noises, skipped = build_noises(cfg.noise, cfg.seed)
            for note in skipped:
                if self.h.verbose:
                    print(f"note: {note}", flush=True)
                self.data.notes.append(note)
            topics, changed, examples = {"clean": sub}, {"clean": 0}, {}
            for k, noise in noises.items():
                noisy = noise(sub[["qid", "query"]])
                diff = noisy["query"] != noisy["query_0"]
                topics[k], changed[k] = noisy[["qid", "query"]], int(diff.sum())
                examples[k] = [[a, b] for a, b in zip(noisy.loc[diff, "query_0"], noisy.loc[diff, "query"])][:3]
            cands = {k: target.candidates(self.h, t, cfg.robust_depth) for k, t in topics.items()}
            self.scores(target.label, pd.concat(cands.values(), ignore_index=True))  # one bar per model
            rows, clean = [], {}
            for k, cand in cands.items():
                runs = self.runs_of(target.label, cand)
                exp = self.h.experiment(runs, sub, target.qrels, MEASURES, baseline=self.baseline)
                if k == "clean":
                    clean = dict(zip(exp["name"], exp[MEASURES[0]]))
                insert_columns(exp, perturbation=k, changed_queries=changed[k], queries=len(sub))
                exp[f"{MEASURES[0]} drop"] = [clean[n] - v for n, v in zip(exp["name"], exp[MEASURES[0]])]
                rows.append(exp)
        return pd.concat(rows, ignore_index=True), examples

    def summary(self, dev: dict[str, dict[str, Any]], examples: dict[str, list[list[str]]]) -> dict[str, Any]:
        """What the run did and found, for ``summary.json`` and the report."""
        trained, alphas = self.trained, {n: float(c["alpha"]) for n, c in dev["alpha"].items()}
        rerank = []
        for tg in self.targets:
            for depth in sorted({tg.depth, *(d for d in self.cfg.extra_depths if d < tg.depth)}, reverse=True):
                cand, runs = self.cands[tg.label], self.runs[tg.label]
                rerank += rerank_rows(tg.label, depth, cand, runs, tg.topics, tg.qrels, alphas)
        shared = self.shared
        return {
            "systems": ["BM25", *trained.models],
            "recipe": recipe_summary(self.cfg, self.h, trained),
            "dev_curves": trained.curves,
            "rerank_rows": rerank,
            "risk_chosen_on_dev": dev["risk"],
            "interpolation_chosen_on_dev": dev["alpha"],
            "scored_sharing_lower_layers": shared and {"frozen_layers": shared.frozen, "pairs": shared.pairs},
            "significance": f"paired t-test against {self.baseline!r} (pt.Experiment / scipy.stats.ttest_rel); risk "
            "rows against risk=0; no multiple-test correction",
            "model_kind": trained.kind,
            "fine_tuned": trained.fine_tuned,
            "training_rows": trained.rows_info,
            "training_loss_first_last": {n: [float(v[0]), float(v[-1])] for n, v in trained.losses.items() if v},
            "evaluated": {
                tg.label: dict(split=tg.split, queries=len(tg.topics), queries_available=tg.available, depth=tg.depth)
                for tg in self.targets
            },
            "scoring": {n: sc.info() for n, sc in self.scorers.items()},
            "robustness_examples": examples,
        }


def _dev_ndcg(dev: Target, rank: Callable[[float], pd.DataFrame], value: float) -> float:
    """Mean dev nDCG@10 of the run ``rank(value)`` (an interpolation's alpha, a risk-aware ranking's lambda)."""
    return float(per_query(rank(value), dev.qrels, MEASURES[0], topics=dev.topics).mean())
