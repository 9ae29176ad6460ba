"""``pyterrier-prob varce --teacher``: split-attention cross-encoders distilled from a bi-encoder + BM25 teacher, as
BM25 re-rankers in domain and zero-shot (docs/varce.md, "Cross-encoders distilled ..."); each stage reuses what an
earlier run in the same output folder made."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, fields
from functools import partial
from typing import Any

import numpy as np
import pandas as pd
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.cross_encoder.losses import MarginMSELoss

from pyterrier_prob.atomic import atomic_write, make_dirs, read_checked
from pyterrier_prob.collections import Collection, load_collection
from pyterrier_prob.curves import DevCurve
from pyterrier_prob.data import judged_pairs, training_pairs
from pyterrier_prob.experiments.harness import Harness, markdown_table, slug
from pyterrier_prob.training import Recipe, StepRate, fine_tune, read_json
from pyterrier_prob.varce import calibration as cal
from pyterrier_prob.varce import distill
from pyterrier_prob.varce.analysis import DevRerank, choose_risk, paired_p, ranked, system_rows, uncertainty_stats
from pyterrier_prob.varce.rerank import risk_adjusted
from st_extensions.cross_encoder.split import build_split_cross_encoder, split_state_cache
from st_extensions.defaults import default_model_path
from st_extensions.loading import load_model
from st_extensions.losses import MaskedMultipleNegativesRankingLoss, VariationalMarginMSELoss
from st_extensions.model_card import save_with_card

STUDENTS = {"CE": None, "VarCE-MEANVAR": "MEANVAR", "VarCE-VAR": "VAR"}
RISKS = (0.0, 0.25, 0.5, 1.0, 2.0)


@dataclass
class DistillConfig:
    """What a distillation run does; written into its summary."""

    output: str
    teacher: str
    dataset: str = "irds:beir/nfcorpus"
    ood: tuple[str, ...] = ("irds:beir/scifact", "irds:cranfield")
    depth: int = 100
    pool_depth: int = 100
    bm25_train_depth: int = 1000
    steps: int = 1000
    batch_size: int = 16
    negatives: int = 3
    learning_rate: float = 1e-4
    joint_layers: int = 2
    init_cross_bias: float = -4.0
    scale: float = 10.0
    max_seq_length: int = 128
    beta: float = 1e-7
    dev_queries: int = 100
    dev_depth: int = 30
    dev_every: int = 100
    patience: int = 3
    students: tuple[str, ...] = tuple(STUDENTS)
    seed: int = 0
    checkpoint_every: int = 100
    base_model: str | None = None
    teacher_steps: int = 3000
    teacher_layers: int = 2
    teacher_dev_every: int = 200

    def path(self, *parts: str) -> str:
        return os.path.join(self.output, *parts)

    def recipe(self, steps: int, batch_size: int, learning_rate: float, layers: int, every: int) -> Recipe:
        """The partial recipe (top ``layers`` layers trained, a checkpoint ``every`` steps) under this run's seed."""
        return Recipe(
            "partial", steps, batch_size, learning_rate, seed=self.seed, train_layers=layers, checkpoint_every=every
        )


# ------------------------------------------------------------------------------------------------ 1. teacher
def build_teacher(cfg: DistillConfig) -> str:
    """The teacher's folder: ``cfg.teacher``, or for ``"partial"`` an MNRL bi-encoder fine-tuned on the training split
    (top ``teacher_layers`` layers, best dev point kept), trained once into ``output/teacher/model`` and reused."""
    if cfg.teacher != "partial":
        if not os.path.isfile(os.path.join(cfg.teacher, "modules.json")):
            raise FileNotFoundError(f"--teacher {cfg.teacher!r} is not a saved sentence-transformers model folder")
        return cfg.teacher
    folder = cfg.path("teacher", "model")
    if os.path.isfile(os.path.join(folder, "modules.json")):
        return folder

    coll = load_collection(cfg.dataset)
    model = load_model(cfg.base_model or str(default_model_path()))
    model.max_seq_length = cfg.max_seq_length
    dev, qrels = coll.topics("dev").astype({"qid": str}), coll.qrels("dev").astype({"qid": str, "docno": str})
    evaluate = distill.DenseDev(dev, qrels, {d["docno"]: d["text"] for d in coll.corpus_iter()})
    loss = MaskedMultipleNegativesRankingLoss(model, judged=judged_pairs(coll, "train"))
    rows = training_pairs(coll, "train", seed=cfg.seed)
    recipe = cfg.recipe(cfg.teacher_steps, 32, 5e-5, cfg.teacher_layers, cfg.teacher_dev_every)
    curve = DevCurve(cfg.teacher_dev_every, evaluate, cfg.path("curves", "teacher.json"), patience=cfg.patience)
    _train_partial(cfg, "teacher", model, loss, rows, recipe, curve, cfg.path("teacher", "states"), folder)
    return folder


def _train_partial(
    cfg: DistillConfig, name: str, model: Any, loss: Any, rows: Any, recipe: Any, curve: Any, states: str, folder: str
) -> float | None:
    """``fine_tune`` into ``runs/<name>`` (resumable) with the dev ``curve``; then save the model with its card.
    Returns the training's steps/s (:class:`StepRate`)."""
    out, rate = cfg.path("runs", name), StepRate()
    fine_tune(
        model, loss, rows, recipe, output_dir=out, resume=True, desc=name, callbacks=[curve, rate], state_cache=states
    )
    if hasattr(model[0], "state_cache"):
        model[0].state_cache = None  # a split cross-encoder's cache of the run: not part of the model
    card = {"recipe": recipe.describe(), "train_data": f"{cfg.dataset}/train", "rows": rows, "model_name": name}
    save_with_card(folder, model, loss=loss, **card)
    return rate.steps_per_second


@dataclass
class Side:
    """One collection's texts and the teacher's embeddings of them."""

    spec: str
    collection: Collection
    corpus: dict[str, str]
    topics: dict[str, pd.DataFrame]
    qrels: dict[str, pd.DataFrame]
    docnos: list[str]
    d_emb: np.ndarray
    q_emb: dict[str, np.ndarray]


def load_side(cfg: DistillConfig, teacher: Any, spec: str, splits: tuple[str, ...]) -> Side:
    coll = load_collection(spec)
    corpus = {d["docno"]: d["text"] for d in coll.corpus_iter()}
    docnos = list(corpus)
    name = slug(spec, "_")
    d_emb = distill.encode(teacher, [corpus[d] for d in docnos], cfg.path("teacher", f"{name}-docs.npy"))
    topics = {s: coll.topics(s).astype({"qid": str}) for s in splits}
    qrels = {s: coll.qrels(s).astype({"qid": str, "docno": str}) for s in splits}
    q_emb = {
        s: distill.encode(teacher, topics[s]["query"].tolist(), cfg.path("teacher", f"{name}-{s}.npy"), query=True)
        for s in splits
    }
    return Side(spec, coll, corpus, topics, qrels, docnos, d_emb, q_emb)


def bm25_run(h: Harness, side: Side, topics: pd.DataFrame, k: int) -> pd.DataFrame:
    """BM25's top ``k`` of ``topics`` (``qid, docno, score, rank``) from the harness's PISA index of the collection."""
    run = h.bm25_run(h.bm25(side.collection), topics[["qid", "query"]], k)
    return run[["qid", "docno", "score", "rank"]].astype({"qid": str, "docno": str})


def candidates(cfg: DistillConfig, h: Harness, side: Side, split: str) -> pd.DataFrame:
    """BM25's top ``depth`` of a split with the teacher's cosine: ``qid, docno, bm25, dense, query, text``."""
    topics = side.topics[split]
    run = bm25_run(h, side, topics, cfg.depth).rename(columns={"score": "bm25"})
    run = distill.add_cosines(run, topics["qid"].tolist(), side.q_emb[split], side.docnos, side.d_emb)
    queries = dict(zip(topics["qid"], topics["query"]))
    return run.assign(query=run["qid"].map(queries), text=run["docno"].map(side.corpus))


def teacher_stage(cfg: DistillConfig, h: Harness, side: Side) -> dict[str, Any]:
    """Choose the fusion weight on dev; build the training pools with teacher scores (cached)."""
    chosen = distill.choose_teacher(candidates(cfg, h, side, "dev"), side.qrels["dev"])
    pool_path = cfg.path("teacher", f"pool-a{chosen['alpha']}-d{cfg.pool_depth}.parquet")
    if os.path.isfile(pool_path):
        pool = read_checked(pool_path, pd.read_parquet, "delete it: the next run scores the pool again")
    else:
        topics = side.topics["train"]
        bm25 = bm25_run(h, side, topics, cfg.bm25_train_depth)
        dense = distill.dense_run(topics, side.q_emb["train"], side.docnos, side.d_emb, cfg.pool_depth)
        pool = distill.candidate_pool(bm25, dense, cfg.pool_depth)
        pool = distill.add_cosines(pool, topics["qid"].tolist(), side.q_emb["train"], side.docnos, side.d_emb)
        pool["teacher"] = distill.teacher_scores(pool, chosen["alpha"])
        atomic_write(pool_path, lambda f: pool.to_parquet(f))
    return {"alpha": chosen["alpha"], "dev": chosen["dev"], "pool": pool}


# ------------------------------------------------------------------------------------------------ 2. students
def dev_subset(cfg: DistillConfig, h: Harness, side: Side) -> pd.DataFrame:
    """BM25's top ``dev_depth`` of ``dev_queries`` seeded dev queries: the learning curves' and the choices' pairs."""
    dev = candidates(cfg, h, side, "dev")
    qids = sorted(dev["qid"].unique())
    keep = set(np.random.default_rng(cfg.seed).choice(qids, size=min(cfg.dev_queries, len(qids)), replace=False))
    return dev[dev["qid"].isin(keep) & (dev["rank"] < cfg.dev_depth)].reset_index(drop=True)


def build_student(cfg: DistillConfig, name: str) -> Any:
    shape = {"joint_layers": cfg.joint_layers, "init_cross_bias": cfg.init_cross_bias, "scale": cfg.scale}
    return build_split_cross_encoder(cfg.teacher, variant=STUDENTS[name], max_seq_length=cfg.max_seq_length, **shape)


def train_students(cfg: DistillConfig, h: Harness, side: Side, rows: Any, dev: pd.DataFrame) -> dict[str, Any]:
    """Train (or load, when saved by an earlier run) every student on the same rows, steps and budget; ``dev``: the
    :func:`dev_subset` their learning curves score."""
    evaluate = DevRerank(dev, side.qrels["dev"])
    models, curves = {}, {}
    for name in cfg.students:
        folder = cfg.path("models", name)
        curve_path = cfg.path("curves", f"{name}.json")
        if os.path.isfile(os.path.join(folder, "modules.json")):
            model = load_model(folder)
        else:
            torch.manual_seed(cfg.seed)
            model = build_student(cfg, name)
            loss = MarginMSELoss(model) if STUDENTS[name] is None else VariationalMarginMSELoss(model, beta=cfg.beta)
            recipe = cfg.recipe(cfg.steps, cfg.batch_size, cfg.learning_rate, cfg.joint_layers, cfg.checkpoint_every)
            curve = DevCurve(cfg.dev_every, evaluate, curve_path, patience=cfg.patience)
            t0 = time.perf_counter()
            rate = _train_partial(cfg, name, model, loss, rows, recipe, curve, cfg.path("states"), folder)
            timing = {"train_wall_s": time.perf_counter() - t0, "train_steps_per_s": rate}
            atomic_write(os.path.join(folder, "training.json"), json.dumps(timing))
        if os.path.isfile(timing_file := os.path.join(folder, "training.json")):  # also a model an earlier run saved
            h.step_rates[name] = read_json(timing_file).get("train_steps_per_s")
        split_state_cache(model, cfg.path("states"))
        models[name], h.saved_models[name] = model, folder
        curves[name] = read_json(curve_path)
    return {"models": models, "curves": curves}


# ------------------------------------------------------------------------------------------------ 3. scoring
def score_stage(cfg: DistillConfig, models: dict[str, Any], name: str, cand: pd.DataFrame) -> pd.DataFrame:
    """``cand`` with ``<model>`` (E[s]) and ``<model>_std`` columns for every student (cached per collection)."""
    path = cfg.path("scores", f"{name}.parquet")
    fresh = not os.path.isfile(path)
    done = cand[["qid", "docno"]].copy() if fresh else read_checked(path, pd.read_parquet, "delete it and rerun")
    for m, model in models.items():
        if m in done.columns:
            continue
        mean, std = distill.score_pairs(model, cand["query"].tolist(), cand["text"].tolist())
        done[m] = mean
        if std is not None:
            done[f"{m}_std"] = std
        make_dirs(cfg.path("scores"))
        atomic_write(path, lambda f: done.to_parquet(f))
    return cand.merge(done, on=["qid", "docno"], how="left")


# ------------------------------------------------------------------------------------------------ 4. report
def rerank_rows(
    cfg: DistillConfig, frame: pd.DataFrame, qrels: pd.DataFrame, alpha: float, spec: str, qids: list[str]
) -> tuple:
    """Rows (collection, depth, system, queries, nDCG@10, p values) of BM25, the teacher and every student over all
    ``qids`` (nothing retrieved: 0), and the per-query values."""
    scores = {"BM25": frame["bm25"], "Teacher (bi-encoder)": frame["dense"]}
    scores[f"Teacher (bi-encoder + BM25, alpha {alpha})"] = distill.teacher_scores(frame, alpha)
    scores |= {s: frame[s] for s in cfg.students if s in frame.columns}
    per_query = {n: distill.ndcg_at_10(frame.assign(score=v), qrels, qids=qids) for n, v in scores.items()}
    return system_rows(per_query, spec, cfg.depth), per_query


def calibration_stage(
    dev: pd.DataFrame, test: pd.DataFrame, dev_qrels: pd.DataFrame, test_qrels: pd.DataFrame, students: list[str]
) -> dict[str, Any]:
    """Platt map per student fitted on the dev pairs, ECE and the reliability curve on the test pairs."""
    y_dev, y_test = cal.relevance_labels(dev, dev_qrels), cal.relevance_labels(test, test_qrels)
    out = {}
    for s in students:
        std_col = f"{s}_std"
        std_test = test[std_col].to_numpy() if std_col in test else None
        platt = cal.fit_platt(dev[s].to_numpy(), y_dev, dev[std_col].to_numpy() if std_col in dev else None)
        prob = cal.relevance_probability(test[s].to_numpy(), platt, std_test)
        curve = cal.reliability_curve(prob, y_test).to_dict("list")
        out[s] = {"platt": platt, "ece": cal.expected_calibration_error(prob, y_test), "reliability": curve}
        if std_test is not None:  # the same map without the uncertainty: what integrating it out changes
            prob_mean = cal.relevance_probability(test[s].to_numpy(), cal.fit_platt(dev[s].to_numpy(), y_dev))
            out[s]["ece_without_std"] = cal.expected_calibration_error(prob_mean, y_test)
    return out


def _ndcg_at_risk(frame: pd.DataFrame, qrels: pd.DataFrame, s: str, qids: list[str] | None, risk: float) -> Any:
    """Per-query nDCG@10 of student ``s`` ranking by E[s] - risk * std[s] (``qids`` None: the mean)."""
    score = risk_adjusted(frame[s].to_numpy(), frame[f"{s}_std"].to_numpy(), risk)
    values = distill.ndcg_at_10(frame.assign(score=score), qrels, qids=qids)
    return float(values.mean()) if qids is None else values


def uncertainty_stage(
    frame: pd.DataFrame,
    dev: pd.DataFrame,
    qrels: pd.DataFrame,
    dev_qrels: pd.DataFrame,
    students: list[str],
    per_query: dict[str, pd.Series],
) -> dict[str, Any]:
    """For every VarCE: :func:`~pyterrier_prob.varce.analysis.uncertainty_stats` (the spread of std[s], whether
    uncertain queries are the hard ones), lambda of the risk-aware ranking chosen on dev and its test value."""
    out = {}
    for s in students:
        std_col = f"{s}_std"
        if std_col not in frame:
            continue
        lam, dev_values = choose_risk(partial(_ndcg_at_risk, dev, dev_qrels, s, None), RISKS)
        test_values = _ndcg_at_risk(frame, qrels, s, per_query[s].index.tolist(), lam)  # every query, as the rows
        stats = uncertainty_stats(ranked(frame, frame[s].to_numpy(), frame[std_col].to_numpy()), per_query[s])
        out[s] = {**stats, "risk_dev": dev_values, "risk_chosen": lam, "risk_test": float(test_values.mean())}
        out[s]["risk_p_vs_lambda0"] = paired_p(test_values, per_query[s])
    return out


def run(cfg: DistillConfig, h: Harness) -> dict[str, Any]:
    """All the stages under the harness ``h``, reported by :meth:`Harness.finish`; returns the summary."""
    h.cfg.reuse = True  # every stage reuses what an earlier run in the output folder made (the BM25 indexes too)
    cfg.teacher = build_teacher(cfg)
    teacher = SentenceTransformer(cfg.teacher, device="cpu")
    teacher.max_seq_length = cfg.max_seq_length
    with h.stage("teacher", f"teacher {cfg.teacher}: embeddings of {cfg.dataset}, fusion weight on dev, pools"):
        side = load_side(cfg, teacher, cfg.dataset, ("train", "dev", "test"))
        chosen = teacher_stage(cfg, h, side)
    pool = chosen["pool"]
    queries = dict(zip(side.topics["train"]["qid"], side.topics["train"]["query"]))
    rows = distill.distillation_rows(
        pool, queries, side.corpus, cfg.steps * cfg.batch_size, negatives=cfg.negatives, seed=cfg.seed
    )
    dev_sub = dev_subset(cfg, h, side)
    trained = train_students(cfg, h, side, rows, dev_sub)
    models = trained["models"]
    students = list(models)
    rows_out, calibration, uncertainty = [], {}, {}
    dev_scored = score_stage(cfg, models, "dev-subset", dev_sub)
    for spec, s in [(cfg.dataset, side)] + [(spec, load_side(cfg, teacher, spec, ("test",))) for spec in cfg.ood]:
        name = slug(spec, "_")
        with h.stage(f"rerank_{name}", f"re-ranking BM25's top {cfg.depth} of {spec} (test)"):
            scored = score_stage(cfg, models, f"{name}-test", candidates(cfg, h, s, "test"))
            qids = s.topics["test"]["qid"].tolist()
            r, per_query = rerank_rows(cfg, scored, s.qrels["test"], chosen["alpha"], spec, qids)
        if spec == cfg.dataset:
            calibration = calibration_stage(dev_scored, scored, side.qrels["dev"], s.qrels["test"], students)
            for row in r:
                if row["system"] in calibration:
                    row["ece"] = calibration[row["system"]]["ece"]
        uncertainty[spec] = uncertainty_stage(
            scored, dev_scored, s.qrels["test"], side.qrels["dev"], students, per_query
        )
        rows_out.extend(r)
    fusion = {"alpha": chosen["alpha"], "dev_nDCG@10_by_alpha": chosen["dev"]}
    fusion |= {"pool_pairs": int(len(pool)), "pool_queries": int(pool["qid"].nunique())}
    summary = {
        "config": asdict(cfg),
        "teacher": fusion,
        "rows": rows_out,
        "dev_curves": trained["curves"],
        "calibration": calibration,
        "uncertainty": uncertainty,
        "dev_candidates": int(len(dev_sub)),
    }
    if calibration:
        from pyterrier_prob.plots import reliability_plot  # matplotlib: optional

        reliability_plot(calibration, cfg.path("reliability.png"))
    title = "Cross-encoders distilled from a bi-encoder + BM25 teacher, re-ranking BM25"
    return h.finish(title, markdown(summary), {"rows": pd.DataFrame(rows_out)}, summary)


def _fmt_p(p: float | None) -> str:
    return "–" if p is None else f"{p:.2g}"


def markdown(summary: dict[str, Any]) -> str:
    """The re-ranking table (nDCG@10, p vs BM25 / CE), the students' ECE and the teacher's choice."""
    rows = pd.DataFrame(summary["rows"])
    rows["cell"] = [f"{r['nDCG@10']:.4f} ({_fmt_p(r['p_vs_bm25'])} / {_fmt_p(r['p_vs_CE'])})" for r in summary["rows"]]
    rows["collection"] = [f"{c} ({n} q.)" for c, n in zip(rows["collection"], rows["queries"].astype(int))]
    table = rows.pivot_table(index="system", columns="collection", values="cell", aggfunc="first")
    table = table.reindex(index=list(dict.fromkeys(rows["system"])), columns=list(dict.fromkeys(rows["collection"])))
    teacher = summary["teacher"]
    text = [
        f"BM25's top {int(rows['depth'].iloc[0])} re-ranked, nDCG@10 (p vs BM25 / p vs CE, paired t-tests over all "
        "queries):",
        "",
        markdown_table(table.fillna("–").reset_index()),
        "",
        f"Teacher: the bi-encoder fused with BM25 at alpha {teacher['alpha']} (chosen on dev: "
        + ", ".join(f"{a}: {v:.4f}" for a, v in teacher["dev_nDCG@10_by_alpha"].items())
        + ").",
    ]
    if summary.get("calibration"):
        text += ["", "Expected calibration error on the test pairs (Platt map fitted on dev pairs):", ""]
        for name, c in summary["calibration"].items():
            extra = f" (without std[s]: {c['ece_without_std']:.4f})" if "ece_without_std" in c else ""
            text.append(f"- {name}: ECE {c['ece']:.4f}{extra}")
    return "\n".join(text) + "\n"


def config_from_varce(cfg: Any) -> DistillConfig:
    """The distillation settings of a ``pyterrier-prob varce --teacher ...`` run (its shared options mapped)."""
    if not cfg.training_recipe(1).caches_states:
        raise ValueError(
            f"--teacher trains split-attention students under --recipe partial (their joint top layers on lower "
            f"layers cached per text), got --recipe {cfg.recipe}"
        )
    values = {f.name: getattr(cfg, f.name) for f in fields(DistillConfig) if hasattr(cfg, f.name)}  # same names
    every = max(1, cfg.steps // 10)
    values.update(dev_every=cfg.dev_every or every, checkpoint_every=cfg.checkpoint_every or every, ood=tuple(cfg.ood))
    return DistillConfig(**values, learning_rate=cfg.lr, joint_layers=cfg.train_layers or 2, base_model=cfg.model)
