"""The pEBR main job: fine-tune, index, calibrate on dev, compare cutoffs on test at matched mean depth.

What ``pyterrier-prob`` runs (and ``notebooks/pebr.ipynb`` walks through on a small budget). The protocol is
pEBR's (``shared/papers/pebr.md``):

1. fine-tune two bi-encoders from the same base with the same pairs, steps, batch size, learning rate and
   seed: pEBR (a :class:`~st_extensions.QueryDistributionHead` trained with BetaNCE, Sec. 3.2.2) and a
   baseline with sentence-transformers' ``MultipleNegativesRankingLoss`` (the DSSM-style in-batch softmax);
2. encode the collection with each and write a :class:`~pyterrier_prob.DenseIndex`; index the same text with
   PISA for BM25;
3. on the **dev** split only, calibrate each variable-depth retriever so that the mean number of documents
   retrieved per query equals k (Sec. 4.1.3, :func:`~pyterrier_prob.evaluation.calibrate_mean_k`): the
   cosine threshold of the score cutoff (DSSM-score) for each model, and the CDF value p of the pEBR cutoff;
4. on the **test** split, run BM25, baseline top-k, baseline score cutoff, pEBR top-k, pEBR score cutoff and
   pEBR CDF cutoff in ``pt.Experiment`` with set measures (SetR, SetP; the paper's R@k / P@k at matched
   average depth) and paired t-tests against pEBR top-k; the same per head/torso/tail stratum (Table 1);
   Table 3 (mean retrieved count per stratum against p) and Figure 2 (histogram of retrieved counts).

The test split's mean depth is whatever the dev-calibrated settings give; it is reported beside every row.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["PebrJobConfig", "run_pebr_job", "load_topics", "load_qrels", "corpus_iter"]

SYSTEMS = (
    "BM25",
    "baseline top-k",
    "baseline score cutoff",
    "pEBR top-k",
    "pEBR score cutoff",
    "pEBR CDF cutoff",
)
"""System names in the result tables, in order; significance is tested against ``SIGNIFICANCE_BASELINE``."""

SIGNIFICANCE_BASELINE = "pEBR top-k"
MEASURES = ("SetR", "SetP")


@dataclass
class PebrJobConfig:
    """Settings of :func:`run_pebr_job` (the ``pyterrier-prob`` options).

    Attributes:
        dataset: PyTerrier dataset id without the split, e.g. ``"irds:beir/nfcorpus"``.
        train_split, dev_split, test_split: the splits to train on, to calibrate on and to report.
        model: base model name or path (``None``: the packaged all-MiniLM-L6-v2).
        family: pEBR head family: ``"beta"`` (BetaNCE, default), ``"exp"`` (ExpNCE) or ``"beta_mle"``.
        steps, batch_size, lr, seed: the training budget, the same for both models.
        max_seq_length: token budget per text, in training and encoding.
        ks: the matched mean depths.
        cap: ``num_results`` of the variable-depth retrievers (the paper's maximum K of DSSM-score / pEBR).
        geometry: ``"line"``: the 1-D cosine law the loss trains (Sec. 3.2, ``dim=None``); ``"sphere"``: the
            sphere-corrected law of Appendix A (``dim`` = embedding dimension).
        table3_ps: CDF values of the Table-3 grid.
        output: folder for models, indexes, tables and plots.
        reuse: reuse models and indexes already in ``output`` (written by an earlier run with the same
            settings) instead of training and encoding again.
        verbose: progress bars.
    """

    dataset: str = "irds:beir/nfcorpus"
    train_split: str = "train"
    dev_split: str = "dev"
    test_split: str = "test"
    model: str | None = None
    family: str = "beta"
    steps: int = 120
    batch_size: int = 16
    lr: float = 5e-5
    seed: int = 0
    max_seq_length: int = 128
    ks: Sequence[int] = (10, 50, 100)
    cap: int = 1000
    geometry: str = "line"
    table3_ps: Sequence[float] = (0.99, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
    output: str = "outputs/pebr"
    reuse: bool = False
    verbose: bool = True
    timings: dict[str, float] = field(default_factory=dict, repr=False)

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting out of range."""
        if self.family not in ("beta", "exp", "beta_mle"):
            raise ValueError(f"family must be 'beta', 'exp' or 'beta_mle', got {self.family!r}")
        if self.geometry not in ("line", "sphere"):
            raise ValueError(f"geometry must be 'line' or 'sphere', got {self.geometry!r}")
        if self.steps < 1 or self.batch_size < 2:
            raise ValueError(f"need steps >= 1 and batch_size >= 2, got {self.steps} and {self.batch_size}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.max_seq_length < 8:
            raise ValueError(f"max_seq_length must be >= 8, got {self.max_seq_length}")
        if not self.ks or any(int(k) != k or k < 1 for k in self.ks):
            raise ValueError(f"ks must be positive integers, got {list(self.ks)}")
        if self.cap < max(self.ks):
            raise ValueError(f"cap ({self.cap}) must be at least the largest k ({max(self.ks)})")
        if not self.table3_ps or any(not 0 < p < 1 for p in self.table3_ps):
            raise ValueError(f"table3_ps must lie strictly inside (0, 1), got {list(self.table3_ps)}")
        for split in (self.train_split, self.dev_split, self.test_split):
            if not split:
                raise ValueError("split names must be non-empty")
        if self.test_split in (self.train_split, self.dev_split):
            raise ValueError(f"the test split {self.test_split!r} must differ from the train and dev splits")


# --------------------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------------------


def _irds(dataset_id: str):
    import ir_datasets

    name = dataset_id.removeprefix("irds:")
    try:
        return ir_datasets.load(name)
    except KeyError as e:
        raise ValueError(f"unknown ir_datasets id {dataset_id!r}: {e}") from e


def load_topics(dataset_id: str) -> pd.DataFrame:
    """``qid, query`` of an ir_datasets split (the query's ``text`` field)."""
    ds = _irds(dataset_id)
    rows = [(q.query_id, getattr(q, "text", None) or q[1]) for q in ds.queries_iter()]
    if not rows:
        raise ValueError(f"{dataset_id} has no queries")
    return pd.DataFrame(rows, columns=["qid", "query"])


def load_qrels(dataset_id: str) -> pd.DataFrame:
    """``qid, docno, label`` of an ir_datasets split."""
    ds = _irds(dataset_id)
    rows = [(r.query_id, r.doc_id, int(r.relevance)) for r in ds.qrels_iter()]
    if not rows:
        raise ValueError(f"{dataset_id} has no qrels")
    return pd.DataFrame(rows, columns=["qid", "docno", "label"])


def corpus_iter(dataset_id: str) -> Iterator[dict[str, str]]:
    """``{docno, text}`` records of a collection, the text as the encoders see it (title, then body)."""
    from pyterrier_prob.data import doc_text

    for doc in _irds(dataset_id).docs_iter():
        yield {"docno": doc.doc_id, "text": doc_text(doc)}


# --------------------------------------------------------------------------------------------------------------
# the job
# --------------------------------------------------------------------------------------------------------------


class _Clock:
    def __init__(self, timings: dict[str, float], verbose: bool) -> None:
        self.timings, self.verbose, self.t0 = timings, verbose, time.perf_counter()

    def stage(self, name: str, message: str) -> _Stage:
        return _Stage(self, name, message)


class _Stage:
    def __init__(self, clock: _Clock, name: str, message: str) -> None:
        self.clock, self.name, self.message = clock, name, message

    def __enter__(self) -> None:
        self.start = time.perf_counter()
        if self.clock.verbose:
            print(f"[{self.start - self.clock.t0:7.1f}s] {self.message}", flush=True)

    def __exit__(self, *exc: Any) -> None:
        self.clock.timings[self.name] = round(time.perf_counter() - self.start, 2)


def _train_models(cfg: PebrJobConfig, clock: _Clock) -> dict[str, Any]:
    """Fine-tune (or, with ``reuse``, reload) the pEBR and baseline models under ``output/models``."""
    from sentence_transformers.losses import MultipleNegativesRankingLoss

    from pyterrier_prob.data import training_pairs
    from pyterrier_prob.training import fine_tune
    from st_extensions import build_pebr_model, default_model_path, load_model
    from st_extensions.losses import BetaMLELoss, BetaNCELoss, ExpNCELoss

    train_id = f"{cfg.dataset}/{cfg.train_split}"
    pairs = None
    models: dict[str, Any] = {}
    losses: dict[str, list[float]] = {}
    for name in ("pebr", "baseline"):
        path = os.path.join(cfg.output, "models", name)
        if cfg.reuse and os.path.isfile(os.path.join(path, "modules.json")):
            with clock.stage(f"load_{name}", f"reusing the {name} model in {path}"):
                models[name] = load_model(path, device="cpu")
            continue
        if pairs is None:
            pairs = training_pairs(train_id, max_pairs=cfg.steps * cfg.batch_size * 2, seed=cfg.seed)
        with clock.stage(
            f"train_{name}",
            f"fine-tuning the {name} model on {train_id}: {cfg.steps} steps of {cfg.batch_size} pairs "
            f"({'BetaNCE' if cfg.family == 'beta' else cfg.family} head)"
            if name == "pebr"
            else f"fine-tuning the {name} model on {train_id}: {cfg.steps} steps of {cfg.batch_size} pairs "
            "(MultipleNegativesRankingLoss)",
        ):
            if name == "pebr":
                model = build_pebr_model(cfg.model, family=cfg.family, device="cpu")
                loss_cls = {"exp": ExpNCELoss, "beta": BetaNCELoss, "beta_mle": BetaMLELoss}[cfg.family]
                loss = loss_cls(model)
            else:
                model = load_model(cfg.model or default_model_path(), device="cpu")
                loss = MultipleNegativesRankingLoss(model)
            model.max_seq_length = cfg.max_seq_length
            losses[name] = fine_tune(
                model,
                loss,
                pairs,
                steps=cfg.steps,
                batch_size=cfg.batch_size,
                learning_rate=cfg.lr,
                seed=cfg.seed,
                show_progress=cfg.verbose,
            )
            model.save(path)
            models[name] = model
    for model in models.values():
        model.max_seq_length = cfg.max_seq_length
    return {"models": models, "losses": losses}


def _index_dense(cfg: PebrJobConfig, name: str, encoder: Any, clock: _Clock) -> Any:
    from pyterrier_prob.index import DenseIndex

    path = os.path.join(cfg.output, "indexes", f"{name}.flex")
    index = DenseIndex(path, verbose=cfg.verbose)  # one progress bar over the documents
    if cfg.reuse and index.built():
        return index
    with clock.stage(f"index_{name}", f"encoding {cfg.dataset} with the {name} model into {path}"):
        (encoder.doc_encoder(verbose=False) >> index.indexer(mode="overwrite")).index(corpus_iter(cfg.dataset))
    return index


def _index_bm25(cfg: PebrJobConfig, clock: _Clock) -> Any:
    from pyterrier_pisa import PisaIndex

    path = os.path.join(cfg.output, "indexes", "bm25.pisa")
    index = PisaIndex(path, text_field="text", threads=max(1, os.cpu_count() or 1), overwrite=True)
    if not (cfg.reuse and index.built()):
        with clock.stage("index_bm25", f"indexing {cfg.dataset} with PISA for BM25 into {path} (log: {path}.log)"):
            with _stderr_to(f"{path}.log"):  # PISA's C++ progress lines go to file descriptor 2
                index.index(corpus_iter(cfg.dataset))
                index.bm25(num_results=1)(pd.DataFrame({"qid": ["warm-up"], "query": ["warm up"]}))
    return index


@contextlib.contextmanager
def _stderr_to(path: str) -> Iterator[None]:
    """Send file descriptor 2 (where native libraries print) to ``path`` for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "ab") as log:
            os.dup2(log.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _dim(cfg: PebrJobConfig, encoder: Any) -> int | None:
    return encoder.dim if cfg.geometry == "sphere" else None


def run_pebr_job(cfg: PebrJobConfig) -> dict[str, Any]:
    """Run the pEBR main job (module docstring) and write its outputs to ``cfg.output``.

    Writes ``results.csv`` (pt.Experiment tables, all k), ``strata.csv`` (per head/torso/tail stratum),
    ``table3.csv``, ``calibration.csv``, ``summary.json``, ``results.md`` (the tables as Markdown),
    ``figure2.png`` and ``table3.png``; models under ``models/``, indexes under ``indexes/``.

    Returns:
        ``{"experiment": frame, "strata": frame, "table3": frame, "calibration": frame, "summary": dict}``.
    """
    import pyterrier as pt
    from scipy.stats import spearmanr

    from pyterrier_prob.cutoff import CDFCutoffRetriever, ScoreCutoffRetriever, TopKRetriever
    from pyterrier_prob.encoders import ProbBiEncoder
    from pyterrier_prob.evaluation import assign_strata, calibrate_mean_k, evaluate_set_measures, table3_grid
    from pyterrier_prob.plots import retrieved_count_histogram, table3_plot

    cfg.check()
    os.makedirs(cfg.output, exist_ok=True)
    clock = _Clock(cfg.timings, cfg.verbose)
    t_start = time.perf_counter()

    dev_id, test_id = f"{cfg.dataset}/{cfg.dev_split}", f"{cfg.dataset}/{cfg.test_split}"
    with clock.stage("load", f"loading topics and qrels of {dev_id} and {test_id}"):
        topics = {"dev": load_topics(dev_id), "test": load_topics(test_id)}
        test_qrels = load_qrels(test_id)

    trained = _train_models(cfg, clock)
    encoders = {n: ProbBiEncoder(m, batch_size=64, verbose=False) for n, m in trained["models"].items()}
    if encoders["pebr"].family != cfg.family:
        raise ValueError(
            f"the pEBR model in {cfg.output}/models/pebr has family {encoders['pebr'].family!r}, not "
            f"{cfg.family!r}: run without --reuse or with another --output"
        )
    indexes = {n: _index_dense(cfg, n, enc, clock) for n, enc in encoders.items()}
    bm25_index = _index_bm25(cfg, clock)

    with clock.stage("encode_queries", "encoding the dev and test queries"):
        enc = {(n, split): encoders[n].query_encoder()(topics[split]) for n in encoders for split in ("dev", "test")}
    dim = _dim(cfg, encoders["pebr"])

    def cdf(p: float, split: str = "dev") -> pd.DataFrame:
        r = CDFCutoffRetriever(indexes["pebr"], p=p, family=cfg.family, dim=dim, num_results=cfg.cap)
        return r(enc[("pebr", split)])

    def score_cut(name: str, t: float, split: str = "dev") -> pd.DataFrame:
        return ScoreCutoffRetriever(indexes[name], threshold=t, num_results=cfg.cap)(enc[(name, split)])

    # ---- calibration on dev ---------------------------------------------------------------------------------
    cal_rows = []
    settings: dict[int, dict[str, float]] = {}
    with clock.stage("calibrate", f"calibrating the cutoffs to mean depth k in {list(cfg.ks)} on {dev_id}"):
        for k in cfg.ks:
            settings[k] = {}
            for system, run, lo, hi, increasing in (
                ("pEBR CDF cutoff", cdf, 1e-9, 1 - 1e-9, True),
                ("pEBR score cutoff", lambda t: score_cut("pebr", t), -1.0, 1.0, False),
                ("baseline score cutoff", lambda t: score_cut("baseline", t), -1.0, 1.0, False),
            ):
                c = calibrate_mean_k(run, k, lo, hi, increasing=increasing, topics=topics["dev"], max_iter=80)
                settings[k][system] = float(c.value)
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

    # ---- test runs --------------------------------------------------------------------------------------------
    strata = assign_strata(topics["test"], test_qrels)
    basis = strata.attrs.get("basis", str(strata["basis"].iloc[0]))
    experiments, strata_tables = [], []
    import ir_measures

    measures = [ir_measures.parse_measure(m) for m in MEASURES]
    with clock.stage("test", f"running the systems on {test_id} (pt.Experiment per k)"):
        for k in cfg.ks:
            s = settings[k]
            runs = {
                "BM25": bm25_index.bm25(num_results=k)(topics["test"]),
                "baseline top-k": TopKRetriever(indexes["baseline"], num_results=k)(enc[("baseline", "test")]),
                "baseline score cutoff": score_cut("baseline", s["baseline score cutoff"], "test"),
                "pEBR top-k": TopKRetriever(indexes["pebr"], num_results=k)(enc[("pebr", "test")]),
                "pEBR score cutoff": score_cut("pebr", s["pEBR score cutoff"], "test"),
                "pEBR CDF cutoff": cdf(s["pEBR CDF cutoff"], "test"),
            }
            runs = {n: r[["qid", "docno", "score", "rank"]] for n, r in runs.items()}
            exp = pt.Experiment(
                list(runs.values()),
                topics["test"],
                test_qrels,
                eval_metrics=measures,
                names=list(runs),
                baseline=list(runs).index(SIGNIFICANCE_BASELINE),
            )
            counts = {n: r.groupby("qid").size().reindex(topics["test"]["qid"], fill_value=0) for n, r in runs.items()}
            exp.insert(1, "k", k)
            exp.insert(2, "test_mean_k", [float(counts[n].mean()) for n in exp["name"]])
            exp.insert(3, "setting", [_setting(n, s) for n in exp["name"]])
            experiments.append(exp)
            st = evaluate_set_measures(
                runs, test_qrels, strata, measures=("SetR", "SetP"), baseline=SIGNIFICANCE_BASELINE
            )
            st.insert(1, "k", k)
            strata_tables.append(st)
            if k == max(cfg.ks):
                histogram_counts = counts["pEBR CDF cutoff"]
                histogram_p = s["pEBR CDF cutoff"]
    experiment = pd.concat(experiments, ignore_index=True)
    per_stratum = pd.concat(strata_tables, ignore_index=True)

    # ---- Table 3, Figure 2 ------------------------------------------------------------------------------------
    with clock.stage("table3", "Table 3 grid and Figure 2 histogram"):
        table3 = table3_grid(lambda p: cdf(p, "test"), cfg.table3_ps, strata, include_all=True)
        fig2 = retrieved_count_histogram(
            histogram_counts,
            strata,
            os.path.join(cfg.output, "figure2.png"),
            title=f"pEBR CDF cutoff at p={histogram_p:.4g} (mean k={max(cfg.ks)} on dev): retrieved per query",
        )
        fig3 = table3_plot(table3.drop(index="all"), os.path.join(cfg.output, "table3.png"))

    # ---- per-query temperature vs number of relevant documents ------------------------------------------------
    q = enc[("pebr", "test")].merge(strata[["qid", "stratum", "value"]], on="qid")
    spread_col = "query_temp" if cfg.family != "beta_mle" else "query_alpha"
    rho, pval = spearmanr(q[spread_col], q["value"]) if q[spread_col].nunique() > 1 else (float("nan"),) * 2
    temp_by_stratum = q.groupby("stratum", observed=True)[spread_col].mean().to_dict()

    summary = {
        "config": {k: v for k, v in asdict(cfg).items() if k != "timings"},
        "dataset": {"dev": dev_id, "test": test_id, "n_dev": len(topics["dev"]), "n_test": len(topics["test"])},
        "strata_basis": basis,
        "significance": f"paired t-test against {SIGNIFICANCE_BASELINE!r} (pt.Experiment / scipy.stats.ttest_rel)",
        "training_loss_first_last": {n: [float(v[0]), float(v[-1])] for n, v in trained["losses"].items() if v},
        f"{spread_col}_test_quantiles_10_50_90": [float(x) for x in np.quantile(q[spread_col], [0.1, 0.5, 0.9])],
        f"{spread_col}_mean_by_stratum": {str(k): float(v) for k, v in temp_by_stratum.items()},
        f"spearman_{spread_col}_vs_num_relevant": {"rho": float(rho), "p": float(pval)},
        "timings_s": dict(cfg.timings),
        "total_s": round(time.perf_counter() - t_start, 1),
        "outputs": {"figure2": fig2, "table3": fig3},
    }
    _write_outputs(cfg, experiment, per_stratum, table3, calibration, summary)
    if cfg.verbose:
        print(_markdown(experiment, per_stratum, table3, calibration, summary))
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


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf8") as f:
        f.write(text)
    os.replace(tmp, path)


def _write_outputs(
    cfg: PebrJobConfig,
    experiment: pd.DataFrame,
    per_stratum: pd.DataFrame,
    table3: pd.DataFrame,
    calibration: pd.DataFrame,
    summary: dict[str, Any],
) -> None:
    out = cfg.output
    _atomic_write(os.path.join(out, "results.csv"), experiment.to_csv(index=False))
    _atomic_write(os.path.join(out, "strata.csv"), per_stratum.to_csv(index=False))
    _atomic_write(os.path.join(out, "table3.csv"), table3.to_csv())
    _atomic_write(os.path.join(out, "calibration.csv"), calibration.to_csv(index=False))
    _atomic_write(os.path.join(out, "summary.json"), json.dumps(summary, indent=2, default=str))
    _atomic_write(os.path.join(out, "results.md"), _markdown(experiment, per_stratum, table3, calibration, summary))


def _fmt_p(p: float) -> str:
    return "" if not np.isfinite(p) else (" *" if p < 0.05 else "")


def _markdown(
    experiment: pd.DataFrame,
    per_stratum: pd.DataFrame,
    table3: pd.DataFrame,
    calibration: pd.DataFrame,
    summary: dict[str, Any],
) -> str:
    """The job's tables as Markdown (what goes into the README)."""
    lines = [
        f"Test: {summary['dataset']['test']} ({summary['dataset']['n_test']} queries); cutoffs calibrated on "
        f"{summary['dataset']['dev']}. `*`: p < 0.05, {summary['significance']}.",
        "",
        "| k | system | setting | test mean k | SetR | SetP |",
        "|---|---|---|---|---|---|",
    ]
    for _, r in experiment.iterrows():
        sr, sp = r.get("SetR p-value", np.nan), r.get("SetP p-value", np.nan)
        lines.append(
            f"| {r['k']} | {r['name']} | {r['setting']} | {r['test_mean_k']:.1f} | "
            f"{r['SetR']:.4f}{_fmt_p(sr)} | {r['SetP']:.4f}{_fmt_p(sp)} |"
        )
    lines += ["", f"Per stratum ({summary['strata_basis']}): SetR (mean k)", ""]
    strata = [s for s in ("all", "head", "torso", "tail") if s in set(per_stratum["stratum"])]
    lines += ["| k | system | " + " | ".join(strata) + " |", "|---|---|" + "---|" * len(strata)]
    for (k, name), g in per_stratum.groupby(["k", "name"], sort=False):
        g = g.set_index("stratum")
        cells = [
            f"{g.loc[s, 'SetR']:.4f}{_fmt_p(g.loc[s].get('SetR p-value', np.nan))} ({g.loc[s, 'mean_k']:.0f})"
            for s in strata
        ]
        lines.append(f"| {k} | {name} | " + " | ".join(cells) + " |")
    lines += ["", "Table 3 (pEBR CDF cutoff, test queries): mean retrieved documents per query", ""]
    lines += ["| stratum | " + " | ".join(f"p={p:g}" for p in table3.columns) + " |"]
    lines += ["|---|" + "---|" * len(table3.columns)]
    for s, row in table3.iterrows():
        lines.append(f"| {s} | " + " | ".join(f"{v:.1f}" for v in row) + " |")
    lines += ["", "Calibration on dev (mean depth reached on the dev queries):", ""]
    lines += ["| k | system | parameter | value | dev mean k | within 1% |", "|---|---|---|---|---|---|"]
    for _, r in calibration.iterrows():
        lines.append(
            f"| {r['k']} | {r['system']} | {r['parameter']} | {r['value']:.6g} | {r['dev_mean_k']:.2f} | "
            f"{'yes' if r['achieved_within_1pct'] else 'no'} |"
        )
    return "\n".join(lines) + "\n"
