"""``pyterrier-prob varce --teacher``: split-attention cross-encoders distilled from a bi-encoder + BM25 teacher, as
BM25 re-rankers in domain and zero-shot (docs/varce.md, "Cross-encoders distilled ..."). A mode of the varce
experiment on the shared harness, in the experiments' stages (docs/experiments.md): data (:meth:`Harness.load_data`,
the evaluated collections of :func:`~pyterrier_prob.experiments.varce_train.target_stage`) -> train (the teacher,
given or fine-tuned, its fusion weight chosen on dev and its training pool; the students; both through
:meth:`Harness.train`, reused only when their settings match) -> score
(:class:`~pyterrier_prob.varce.scoring.PairScorer`, cached per model's settings) -> analyses (calibration,
uncertainty) -> report (:meth:`Harness.finish`)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import pandas as pd
from scipy.stats import mannwhitneyu
from sentence_transformers import SentenceTransformer
from sentence_transformers.cross_encoder.losses import MarginMSELoss

from pyterrier_prob.atomic import atomic_write, make_dirs, read_checked
from pyterrier_prob.collections import Collection
from pyterrier_prob.curves import DevCurve
from pyterrier_prob.evaluation import paired_ci, paired_p
from pyterrier_prob.experiments.harness import Data, Harness, TrainingPairs, slug
from pyterrier_prob.experiments.options import flag
from pyterrier_prob.experiments.varce_config import TRAIN_LAYERS, VarceJobConfig, dev_every
from pyterrier_prob.experiments.varce_report import distill_markdown
from pyterrier_prob.experiments.varce_train import (
    Target,
    dev_evaluator,
    folder_fingerprint,
    settings_fingerprint,
    target_stage,
)
from pyterrier_prob.training import read_json
from pyterrier_prob.varce import calibration as cal
from pyterrier_prob.varce import distill
from pyterrier_prob.varce.analysis import (
    DevRerank,
    choose_risk,
    ranked,
    system_rows,
    uncertainty_stats,
)
from pyterrier_prob.varce.data import evaluated_queries
from pyterrier_prob.varce.pseudo_queries import KINDS, drop_sources, pseudo_queries
from pyterrier_prob.varce.rerank import risk_adjusted, score_as_text
from pyterrier_prob.varce.scoring import PairScorer
from pyterrier_prob.varce.selective import mc_dropout_std, nqc, selective_table, top_k_mean, wig
from st_extensions.cross_encoder.head import VariationalHead
from st_extensions.cross_encoder.split import (
    CrossAttentionBias,
    LinearScoreHead,
    build_split_cross_encoder,
    cross_attention_mass,
    joint_term,
    split_state_cache,
)
from st_extensions.defaults import default_model_path
from st_extensions.loading import load_model
from st_extensions.losses import MaskedMultipleNegativesRankingLoss, VariationalMarginMSELoss

__all__ = [
    "MODEL_PREFIX",
    "TRAIN_LAYERS",
    "NOT_UNDER_TEACHER",
    "SCORE_STUDENTS",
    "STUDENTS",
    "TEACHER",
    "check_options",
    "run",
    "students",
]

#: The students (their rows' system names) and their VarCE variant (None: the CE).
STUDENTS = {"CE": None, "VarCE-MEANVAR": "MEANVAR", "VarCE-VAR": "VAR"}
#: The students that read BM25's score as text before the document (``--input-score``; their own rows).
SCORE_STUDENTS = {"CE (BM25 score as text)": None, "VarCE-VAR (BM25 score as text)": "VAR"}
#: What a score-as-text student reads (its rows' ``input_score``).
INPUT_SCORE = "BM25 score as text before the document (2 decimals)"
#: A student's model folder is ``models/<MODEL_PREFIX><system>`` (a plain, label-trained run's: ``models/<system>``).
MODEL_PREFIX = "distilled-"
#: The row of the teacher's bi-encoder alone (``p_vs_bi_encoder`` compares every other row with it).
BI_ENCODER = "Teacher (bi-encoder)"
#: The model folder of a teacher fine-tuned by the run (``--teacher partial``).
TEACHER = "distill-teacher"
#: The varce options that do not apply under ``--teacher`` (refused when set to another value than their default).
NOT_UNDER_TEACHER = ("robust_queries", "robust_depth", "noise", "negatives_from", "positive_depth")


def students(cfg: VarceJobConfig) -> dict[str, str | None]:
    """The run's students (system -> VarCE variant, None: the CE): those of :data:`STUDENTS` that ``--students``
    names, and with ``--input-score`` :data:`SCORE_STUDENTS`."""
    chosen = {s: v for s, v in STUDENTS.items() if s in cfg.students}
    return chosen | (SCORE_STUDENTS if cfg.input_score else {})


def reads_score(system: str) -> bool:
    """Whether the student ``system`` reads the first stage's score as text."""
    return system in SCORE_STUDENTS


def check_options(cfg: VarceJobConfig) -> None:
    """``ValueError`` naming an option that cannot apply to a distillation run; ``--train-layers`` (the students'
    joint layers) set to its distillation default when not given."""
    if cfg.recipe != "partial":
        raise ValueError(
            f"--teacher trains split-attention students under --recipe partial (their joint top layers on lower "
            f"layers cached per text), got --recipe {cfg.recipe}"
        )
    if cfg.train_layers is None:
        cfg.train_layers = TRAIN_LAYERS
    if cfg.steps == 0:
        raise ValueError("--teacher distils students by training them: --steps 0 leaves nothing to distil")
    defaults = type(cfg)()
    for name in NOT_UNDER_TEACHER:
        if getattr(cfg, name) != getattr(defaults, name):
            raise ValueError(
                f"{flag(name)} does not apply under --teacher (the distillation mines no negatives of its own and "
                "runs no robustness table); leave it out"
            )


# ------------------------------------------------------------------------------------------------ data
@dataclass
class Side:
    """One collection's texts and the teacher's embeddings of them (cached under the teacher's fingerprint)."""

    collection: Collection
    corpus: dict[str, str]
    docnos: list[str]
    d_emb: np.ndarray
    teacher: Any
    folder: str

    def with_cosines(self, frame: pd.DataFrame, topics: pd.DataFrame) -> pd.DataFrame:
        """``frame`` (``qid, docno, ...``) with the teacher's cosine of each row's query and document (``dense``)."""
        return distill.add_cosines(frame, topics["qid"].tolist(), self.queries(topics), self.docnos, self.d_emb)

    def queries(self, topics: pd.DataFrame) -> np.ndarray:
        """The teacher's embeddings of ``topics``' queries (cached)."""
        return distill.encode(self.teacher, topics["query"].tolist(), self.path("queries", topics), query=True)

    def path(self, what: str, topics: pd.DataFrame, ext: str = "npy") -> str:
        """The cache file of ``what`` made from ``topics`` (named by a digest of their qids and texts)."""
        texts = "\n".join(f"{q}\t{t}" for q, t in zip(topics["qid"], topics["query"]))
        return os.path.join(self.folder, f"{slug(self.collection.name, '_')}-{what}-{_digest(texts)}.{ext}")


def load_side(
    h: Harness, teacher: Any, fingerprint: str, collection: Collection, corpus: dict[str, str] | None = None
) -> Side:
    """``collection``'s texts (``corpus`` when already read) and the teacher's document embeddings (cached)."""
    corpus = corpus if corpus is not None else {d["docno"]: d["text"] for d in collection.corpus_iter()}
    docnos = list(corpus)
    folder = make_dirs(h.path("teacher", fingerprint))
    path = os.path.join(str(folder), f"{slug(collection.name, '_')}-docs-{_digest(chr(10).join(docnos))}.npy")
    return Side(collection, corpus, docnos, distill.encode(teacher, [corpus[d] for d in docnos], path), teacher, folder)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def check_data(data: Data) -> None:
    if data.train is None:
        raise ValueError(f"--teacher needs training queries: {data.train_collection.name} has no train split")
    if data.cal_topics.empty:
        raise ValueError(f"--teacher chooses the teacher's fusion weight on dev queries: {data.cal_source} has none")


# ------------------------------------------------------------------------------------------------ train: the teacher
def teacher_model(cfg: VarceJobConfig, h: Harness, data: Data, corpus: dict[str, str]) -> tuple[str, str]:
    """The teacher's folder and fingerprint: ``--teacher`` as given, or for ``partial`` an MNRL bi-encoder fine-tuned
    on the training split through :meth:`Harness.train` (top ``--teacher-layers`` layers, best dev point kept; its
    dev curve searches ``corpus``, the training collection's texts)."""
    if cfg.teacher != "partial":
        if not os.path.isfile(os.path.join(str(cfg.teacher), "modules.json")):
            raise FileNotFoundError(f"--teacher {cfg.teacher!r} is not a saved sentence-transformers model folder")
        data.notes.append(f"teacher: the bi-encoder {cfg.teacher} as given, fused with BM25")
        return str(cfg.teacher), folder_fingerprint(str(cfg.teacher), cfg.max_seq_length)
    topics, qrels = data.cal_topics.astype({"qid": str}), data.cal_qrels.astype({"qid": str, "docno": str})
    every = cfg.teacher_dev_every
    dense_dev = distill.DenseDev(topics, qrels, corpus)
    curve = DevCurve(every, dense_dev, h.path("curves", f"{TEACHER}.json"), patience=cfg.patience)
    pairs = TrainingPairs(data, cfg.seed)
    h.train(
        TEACHER,
        partial(load_model, cfg.model or str(default_model_path()), device="cpu"),
        partial(_masked_mnrl, pairs),
        pairs,
        settings={"role": "teacher (MNRL bi-encoder)", "dev": {"every": every, "patience": cfg.patience}},
        callbacks=[curve],
        steps=cfg.teacher_steps,
        batch_size=cfg.teacher_batch_size,
        learning_rate=cfg.teacher_lr,
        train_layers=cfg.teacher_layers,
        checkpoint_every=every,
    )
    data.notes.append(
        f"teacher: a bi-encoder fine-tuned here ({TEACHER}: {cfg.teacher_steps} steps, the best of its dev points "
        f"every {every} steps kept), fused with BM25"
    )
    return h.path("models", TEACHER), str(settings_fingerprint(h, TEACHER))


def _masked_mnrl(pairs: TrainingPairs, model: Any) -> Any:
    return pairs.loss(model, MaskedMultipleNegativesRankingLoss)


def fusion_stage(cfg: VarceJobConfig, h: Harness, data: Data, side: Side) -> dict[str, Any]:
    """The fusion weight chosen on every dev query with a judged-relevant document (BM25 top ``--depth``), and the
    training pool (BM25's top ``--bm25-train-depth`` and the teacher's top ``--pool-depth`` of each train query) with
    the teacher's scores (cached)."""
    topics, qrels, _ = evaluated_queries(data.cal_topics, data.cal_qrels, None, cfg.seed)
    coll = data.train_collection
    dev = Target(data.cal_source, coll, str(data.dev), h.bm25(coll), topics, qrels, cfg.depth, len(topics))
    cand = side.with_cosines(dev.candidates(h, topics, cfg.depth).rename(columns={"score": "bm25"}), topics)
    chosen = distill.choose_teacher(cand, qrels)
    train = data.train_collection.topics(str(data.train)).astype({"qid": str})
    pool = teacher_pool(cfg, h, side, train, chosen["alpha"], "pool")
    queries = dict(zip(train["qid"], train["query"]))
    data.notes.append(
        f"chosen on dev ({len(topics)} {data.cal_source} queries, BM25 top {cfg.depth}): the teacher's fusion weight "
        f"alpha {chosen['alpha']}"
    )
    fusion = {"alpha": chosen["alpha"], "dev": chosen["dev"], "pool": pool, "queries": queries, "pseudo": None}
    if cfg.pseudo_queries:
        add_pseudo_queries(cfg, h, data, side, fusion)
    return fusion


def teacher_pool(
    cfg: VarceJobConfig, h: Harness, side: Side, topics: pd.DataFrame, alpha: float, what: str
) -> pd.DataFrame:
    """The training pool of ``topics`` (BM25's top ``--bm25-train-depth`` and the teacher's top ``--pool-depth``;
    for pseudo-queries, without the document each was cut from) with the teacher's scores (cached)."""
    pool_path = side.path(f"{what}-a{alpha}-d{cfg.pool_depth}-b{cfg.bm25_train_depth}", topics, "parquet")
    if os.path.isfile(pool_path) and cfg.reuse:
        return read_checked(pool_path, pd.read_parquet, "delete it: the next run scores the pool again")
    bm25 = h.bm25_run(h.bm25(side.collection), topics[["qid", "query"]], cfg.bm25_train_depth)
    q_emb = side.queries(topics)
    dense = distill.dense_run(topics, q_emb, side.docnos, side.d_emb, cfg.pool_depth)
    bm25 = bm25[["qid", "docno", "score", "rank"]].astype({"docno": str})
    pool = distill.candidate_pool(bm25, dense, cfg.pool_depth)
    if "source" in topics:
        pool = drop_sources(pool, topics)
    pool = distill.add_cosines(pool, topics["qid"].tolist(), q_emb, side.docnos, side.d_emb)
    pool["teacher"] = distill.teacher_scores(pool, alpha)
    atomic_write(pool_path, lambda f: pool.to_parquet(f))
    return pool


def add_pseudo_queries(cfg: VarceJobConfig, h: Harness, data: Data, side: Side, fusion: dict[str, Any]) -> None:
    """Add to ``fusion``'s pool and queries the ``--pseudo-queries`` cut from the training collection's documents
    (:mod:`~pyterrier_prob.varce.pseudo_queries`; none equal to a query of the collection's splits), their pools
    labelled by the teacher."""
    coll = data.train_collection
    known = [coll.topics(s)["query"] for s in coll.splits]
    made = pseudo_queries(side.corpus, cfg.pseudo_queries, seed=cfg.seed, exclude=pd.concat(known))
    if made.empty:
        raise ValueError(f"--pseudo-queries {' '.join(cfg.pseudo_queries)}: no document of {coll.name} gave one")
    pool = teacher_pool(cfg, h, side, made, fusion["alpha"], "pseudo-pool")
    fusion["pool"] = pd.concat([fusion["pool"], pool], ignore_index=True)
    fusion["queries"] |= dict(zip(made["qid"], made["query"]))
    counts = made["kind"].value_counts()
    fusion["pseudo"] = {"kinds": list(cfg.pseudo_queries), "queries": {k: int(counts.get(k, 0)) for k in KINDS}}
    fusion["pseudo"]["pool_pairs"] = int(len(pool))
    data.notes.append(
        f"pseudo-queries: {len(made)} cut from {coll.name}'s documents ({', '.join(cfg.pseudo_queries)}), pools "
        "labelled by the teacher, each without the document it was cut from"
    )


# ------------------------------------------------------------------------------------------------ train: the students
class StudentRows:
    """The Margin-MSE rows of the students (:meth:`Harness.train`'s ``data``; ``benchmarks/gpu_students.py`` exports the
    same rows), made on first use."""

    def __init__(
        self, cfg: VarceJobConfig, fusion: dict[str, Any], corpus: dict[str, str], score: str | None = None
    ) -> None:
        self.cfg, self.fusion, self.corpus, self.score, self.rows = cfg, fusion, corpus, score, None

    def __call__(self) -> Any:
        if self.rows is None:
            n, pool, queries = self.cfg.steps * self.cfg.batch_size, self.fusion["pool"], self.fusion["queries"]
            if self.cfg.teacher_units == "student":  # the same ranking, in the students' units
                scores = distill.teacher_in_student_units(pool, self.fusion["alpha"], self.cfg.score_scale)
                pool = pool.assign(teacher=scores)
            kw = {"negatives": self.cfg.negatives, "seed": self.cfg.seed, "score_column": self.score}
            self.rows = distill.distillation_rows(pool, queries, self.corpus, n, **kw)
        return self.rows


def joint_layers(cfg: VarceJobConfig) -> int:
    """The students' top layers that read both texts (and train): ``--train-layers`` (default :data:`TRAIN_LAYERS`)."""
    return int(cfg.train_layers or TRAIN_LAYERS)


def train_students(
    cfg: VarceJobConfig,
    h: Harness,
    teacher: tuple[str, str],
    fusion: dict,
    corpus: dict[str, str],
    evaluate: DevRerank | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every student trained (or reused, when saved with the same settings) on the same rows, steps and seed, the
    best point of its dev curve (``evaluate``: :func:`dev_evaluator`) kept; returns ``{system: model}`` (each with
    its lower layers' state cache) and ``{system: attention}`` (:func:`attention_mass`; empty without dev pairs)."""
    folder, fingerprint = teacher
    layers = joint_layers(cfg)
    rows = {False: StudentRows(cfg, fusion, corpus), True: StudentRows(cfg, fusion, corpus, score="bm25")}
    base = {"role": "distilled student", "teacher": fingerprint, "alpha": fusion["alpha"], "pool": len(fusion["pool"])}
    base |= {"pool_depth": cfg.pool_depth, "bm25_train_depth": cfg.bm25_train_depth, "negatives": cfg.negatives}
    base |= {"joint_layers": layers, "init_cross_bias": cfg.init_cross_bias, "scale": cfg.score_scale}
    base |= {"score_from": cfg.score_from} if cfg.score_from != "joint" else {}  # (runs before the option: joint)
    base |= {"teacher_units": cfg.teacher_units} if cfg.teacher_units != "z" else {}  # (runs before it: z)
    base |= {"pseudo_queries": fusion["pseudo"]} if fusion.get("pseudo") else {}
    if evaluate is not None:
        base["dev"] = {"queries": cfg.dev_queries, "depth": cfg.dev_depth, "every": dev_every(cfg)}
        base["dev"]["patience"] = cfg.patience
    models, attention = {}, {}
    for system, variant in students(cfg).items():
        name, score = MODEL_PREFIX + system, reads_score(system)
        path = h.path("curves", f"{name}.json")
        dev = evaluate if evaluate is None or not score else _with_score_dev(evaluate)
        curve = None if dev is None else DevCurve(dev_every(cfg), dev, path, patience=cfg.patience)
        loss = MarginMSELoss if variant is None else partial(VariationalMarginMSELoss, beta=cfg.beta)
        settings = {**base, "variant": variant} | ({"beta": cfg.beta} if variant else {})
        settings |= {"mean_branch_rate": "head rate / width"} if variant == "MEANVAR" else {}  # (before: the head's)
        settings |= {"input_score": INPUT_SCORE} if score else {}
        shape = (layers, cfg.init_cross_bias, cfg.score_scale, score, cfg.score_from)
        build = partial(_student, folder, variant, cfg.max_seq_length, *shape)
        head = (LinearScoreHead if variant is None else VariationalHead).__name__
        rates = {head: cfg.head_lr, CrossAttentionBias.__name__: cfg.cross_bias_lr}
        rates = {k: v for k, v in rates.items() if v is not None}  # the others: the rates their modules declare
        settings |= {"module_learning_rates": rates} if rates else {}
        kw = {"settings": settings, "callbacks": [curve] if curve else [], "train_layers": layers}
        kw["module_learning_rates"] = rates or None
        model, _ = h.train(name, build, loss, rows[score], **kw)
        split_state_cache(model, h.state_cache_path(h.cfg.training_recipe(cfg.steps, train_layers=layers), model))
        models[system] = model
        if dev is not None:
            attention[system] = attention_mass(build, model, dev.cand, cfg.seed)
    return models, attention


#: Dev pairs on which :func:`attention_mass` measures the students' cross-segment attention.
ATTENTION_PAIRS = 256


def attention_mass(build: Any, model: Any, cand: pd.DataFrame, seed: int) -> dict[str, Any]:
    """The attention mass between the two texts in each joint layer
    (:func:`~st_extensions.cross_encoder.split.cross_attention_mass`) on :data:`ATTENTION_PAIRS` seeded dev pairs, of
    the student as built (step 0) and as kept (the best dev step)."""
    rows = cand.sample(n=min(ATTENTION_PAIRS, len(cand)), random_state=seed)
    pairs = list(zip(rows["query"], rows["text"]))
    step_0 = cross_attention_mass(build(), pairs)
    out = {"pairs": len(pairs), "step_0": step_0, "kept": cross_attention_mass(model, pairs)}
    if model[0].bi_encoder_path:  # how much of the kept student's score its joint layers make
        out["joint_term"] = joint_term(model, pairs)
    return out


def _student(
    teacher: str,
    variant: str | None,
    max_seq_length: int,
    layers: int,
    bias: float,
    scale: float,
    score: bool,
    score_from: str,
) -> Any:
    shape = {"joint_layers": layers, "init_cross_bias": bias, "scale": scale, "score_segment": score}
    feature = "kernels" if score_from == "kernels" else "cosine"
    shape |= {"bi_encoder_path": score_from != "joint", "joint_feature": feature}
    return build_split_cross_encoder(teacher, variant=variant, max_seq_length=max_seq_length, **shape)


# ------------------------------------------------------------------------------------------------ score
def with_score_text(cand: pd.DataFrame, score: str = "score") -> pd.DataFrame:
    """``cand`` whose ``text`` is preceded by its first-stage ``score`` as text (:func:`score_as_text`)."""
    return cand.assign(text=score_as_text(cand["text"].tolist(), cand[score].to_numpy()))


def _with_score_dev(evaluate: DevRerank) -> DevRerank:
    """The learning curves' dev pairs as a score-as-text student reads them."""
    return DevRerank(with_score_text(evaluate.cand), evaluate.qrels, evaluate.qids, evaluate.batch_size)


def scored(
    h: Harness, scorers: dict[str, PairScorer], label: str, cand: pd.DataFrame, score: str = "bm25"
) -> pd.DataFrame:
    """``cand`` with every student's E[s] (``<system>``) and, for a VarCE, std[s] (``<system>_std``); a student that
    reads the first stage's score reads column ``score`` as text."""
    out, with_score = cand.copy(), None
    for system, sc in scorers.items():
        if reads_score(system) and with_score is None:
            with_score = with_score_text(cand, score)
        mean, std = sc.score(label, with_score if reads_score(system) else cand)
        out[system] = mean
        if sc.var:
            out[f"{system}_std"] = std
    return out


def _scorers(cfg: VarceJobConfig, h: Harness, models: dict[str, Any]) -> dict[str, PairScorer]:
    return {
        s: PairScorer(
            s,
            m,
            cfg.inference_batch_size,
            cache_path=h.path("scores", f"{MODEL_PREFIX}{s}.tsv"),
            fingerprint=settings_fingerprint(h, MODEL_PREFIX + s),
            fresh=not cfg.reuse,
            progress=h.progress,
        )
        for s, m in models.items()
    }


# ------------------------------------------------------------------------------------------------ analyses
def ranker_scores(frame: pd.DataFrame, alpha: float) -> dict[str, Any]:
    """Each ranker's scores of ``frame``'s rows by row name: BM25, the teacher's bi-encoder alone, the fused teacher
    and every student scored there."""
    scores = {"BM25": frame["bm25"], BI_ENCODER: frame["dense"]}
    scores[f"Teacher (bi-encoder + BM25, alpha {alpha})"] = distill.teacher_scores(frame, alpha)
    return scores | {s: frame[s] for s in (*STUDENTS, *SCORE_STUDENTS) if s in frame.columns}


def lexical_shares(frame: pd.DataFrame, alpha: float) -> dict[str, dict[str, float]]:
    """:func:`~pyterrier_prob.varce.distill.lexical_share` of the fused teacher and every student on ``frame``: how
    far each ranks by BM25 and how far by the teacher's bi-encoder."""
    scores = ranker_scores(frame, alpha)
    return {n: distill.lexical_share(frame, v) for n, v in scores.items() if n not in ("BM25", BI_ENCODER)}


def rerank_rows(
    frame: pd.DataFrame, qrels: pd.DataFrame, alpha: float, label: str, qids: list[str], depth: int
) -> tuple[list[dict], dict[str, pd.Series]]:
    """Rows (collection, depth, system, queries, nDCG@10, p values) of BM25, the teacher and every student over all
    ``qids`` (nothing retrieved: 0) on BM25's top ``depth`` of ``frame``, and the per-query values."""
    frame = frame[frame["rank"] < depth]
    scores = ranker_scores(frame, alpha)
    per_query = {n: distill.ndcg_at_10(frame.assign(score=v), qrels, qids=qids) for n, v in scores.items()}
    rows = system_rows(per_query, label, depth)
    for row in rows:
        name = row["system"]
        row["p_vs_bi_encoder"] = None if name == BI_ENCODER else paired_p(per_query[name], per_query[BI_ENCODER])
        row["ci95_vs_bm25"] = None if name == "BM25" else paired_ci(per_query[name], per_query["BM25"])
    return rows, per_query


def describe_students(rows: list[dict], cfg: VarceJobConfig, attention: dict[str, Any], curves: dict[str, Any]) -> None:
    """Each row's re-ranker: ``joint_layers`` (layers that read both texts; None for BM25 and the teacher's rows),
    ``cross_attention_mass`` (per joint layer at the kept step), ``joint_share`` (with a bi-encoder path, ``--score-from
    kernels`` or ``both``: the share of the kept score's spread over dev pairs that its joint layers make,
    :func:`joint_term`), ``input_score``
    (None: the first stage's score is not read) and ``chosen_on_dev``: the plain student with the best dev point of
    this run (none without dev curves)."""
    best = {s: c["best"]["dev"] for s, c in curves.items() if c.get("best") and s in STUDENTS}  # plain ones
    chosen = max(best, key=lambda s: (best[s], -list(STUDENTS).index(s))) if best else None
    for row in rows:
        student = row["system"] in students(cfg)
        row["joint_layers"] = joint_layers(cfg) if student else None
        row["cross_attention_mass"] = attention.get(row["system"], {}).get("kept") if student else None
        term = attention.get(row["system"], {}).get("joint_term") if student else None
        row["joint_share"] = None if term is None else term["joint_share"]
        row["input_score"] = INPUT_SCORE if reads_score(row["system"]) else None
        row["chosen_on_dev"] = row["system"] == chosen


def calibration_stage(
    dev: pd.DataFrame, test: pd.DataFrame, dev_qrels: pd.DataFrame, test_qrels: pd.DataFrame, students: list[str]
) -> dict[str, Any]:
    """Platt map per student fitted on the dev pairs, ECE and the reliability curve on the test pairs; the ranking
    calibration error over each query's top 10 (:func:`~pyterrier_prob.varce.calibration.ranking_calibration`)."""
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
        std = std_col if std_test is not None else None
        pairs = [cal.preference_pairs(f, q, s, std) for f, q in ((dev, dev_qrels), (test, test_qrels))]
        if len(pairs[0]) and len(pairs[1]):
            out[s]["ranking"] = cal.ranking_calibration(*pairs)
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
    per_query: dict[str, pd.Series],
    risks: list[float],
) -> dict[str, Any]:
    """For every VarCE: :func:`~pyterrier_prob.varce.analysis.uncertainty_stats` (the spread of std[s], whether
    uncertain queries are the hard ones), lambda of the risk-aware ranking chosen on dev and its test value."""
    out = {}
    for s in per_query:
        std_col = f"{s}_std"
        if std_col not in frame:
            continue
        lam, dev_values = choose_risk(partial(_ndcg_at_risk, dev, dev_qrels, s, None), risks)
        test_values = _ndcg_at_risk(frame, qrels, s, per_query[s].index.tolist(), lam)  # every query, as the rows
        stats = uncertainty_stats(ranked(frame, frame[s].to_numpy(), frame[std_col].to_numpy()), per_query[s])
        out[s] = {**stats, "risk_dev": dev_values, "risk_chosen": lam, "risk_test": float(test_values.mean())}
        out[s]["risk_p_vs_lambda0"] = paired_p(test_values, per_query[s])
    return out


def mc_dropout_cached(
    h: Harness, system: str, model: Any, label: str, top: pd.DataFrame, cfg: VarceJobConfig
) -> np.ndarray:
    """:func:`~pyterrier_prob.varce.selective.mc_dropout_std` of ``top``'s pairs, kept in
    ``scores/mc-dropout-<model>-<collection>.json`` and read back (``--reuse``) when the model's saved settings, the
    passes, the seed and the pairs are the same: a run killed later does not pay for the passes again."""
    key = {
        "fingerprint": settings_fingerprint(h, MODEL_PREFIX + system),
        "passes": cfg.mc_dropout,
        "seed": cfg.seed,
        "pairs": [[str(q), str(d)] for q, d in zip(top["qid"], top["docno"])],
    }
    path = h.path("scores", f"mc-dropout-{MODEL_PREFIX}{system}-{slug(label, '_')}.json")
    if key["fingerprint"] is not None and cfg.reuse and os.path.isfile(path):
        kept = read_json(path)
        if {k: kept.get(k) for k in key} == key:
            return np.asarray(kept["std"], dtype=np.float64)
    spread = mc_dropout_std(
        model, top["query"].tolist(), top["text"].tolist(), cfg.mc_dropout, cfg.seed, cfg.inference_batch_size
    )
    if key["fingerprint"] is not None:
        make_dirs(os.path.dirname(path))
        atomic_write(path, json.dumps({**key, "std": [float(v) for v in spread]}))
    return spread


def selective_stage(
    h: Harness,
    label: str,
    frame: pd.DataFrame,
    per_query: dict[str, pd.Series],
    models: dict[str, Any],
    queries: dict[str, str],
    cfg: VarceJobConfig,
) -> dict[str, Any]:
    """Per student, query-level selective prediction (:func:`~pyterrier_prob.varce.selective.selective_table`: AURC
    and E-AURC, risk 1 - nDCG@10) of its confidences on collection ``label``: its mean score over its top 10, for a
    VarCE minus its mean std[s] there, NQC and WIG of BM25's scores, and minus the mean MC-dropout spread over its top
    10 (``--mc-dropout``, :func:`mc_dropout_cached`)."""
    first_stage = {"NQC (BM25)": nqc(frame, score="bm25"), "WIG (BM25)": wig(frame, queries, score="bm25")}
    out = {}
    for s, model in models.items():
        conf = {"score (top 10)": top_k_mean(frame, s, score=s)}
        if f"{s}_std" in frame:
            conf["std[s] (top 10)"] = -top_k_mean(frame, f"{s}_std", score=s)
        conf |= first_stage
        if cfg.mc_dropout:
            top = frame.sort_values(["qid", s], ascending=[True, False], kind="stable").groupby("qid").head(10)
            top = with_score_text(top, "bm25") if reads_score(s) else top
            spread = mc_dropout_cached(h, s, model, label, top, cfg)
            conf["MC dropout (top 10)"] = -top.assign(mc=spread).groupby("qid")["mc"].mean()
        out[s] = selective_table(1.0 - per_query[s], conf)
        if f"{s}_std" in frame:
            out[s]["std_top10"] = (-conf["std[s] (top 10)"]).to_dict()
    return out


def std_shift(selective: dict[str, dict[str, Any]], home: str) -> dict[str, Any]:
    """Does std[s] rise out of domain? For every VarCE and zero-shot collection: the mean over queries of std[s] over
    the top 10 there and at ``home`` (the in-domain test), and the one-sided Mann-Whitney U test's p (higher there)."""
    out: dict[str, Any] = {}
    for label, systems in selective.items():
        if label == home:
            continue
        for s, table in systems.items():
            if "std_top10" not in table or "std_top10" not in selective[home].get(s, {}):
                continue
            there, here = list(table["std_top10"].values()), list(selective[home][s]["std_top10"].values())
            p = float(mannwhitneyu(there, here, alternative="greater").pvalue)
            out.setdefault(s, {})[label] = {"mean": float(np.mean(there)), "in_domain": float(np.mean(here)), "p": p}
    return out


# ------------------------------------------------------------------------------------------------ the run
def _start(cfg: VarceJobConfig) -> tuple[Harness, Data, dict[str, str]]:
    """The run's harness (holding ``cfg.output``), its data and the training collection's texts (read once)."""
    check_options(cfg)
    h = Harness("varce", cfg)  # checks cfg
    data = h.load_data(calibrate=True)  # the teacher's weight, the kept steps and lambda are chosen on dev
    check_data(data)
    return h, data, {d["docno"]: d["text"] for d in data.train_collection.corpus_iter()}


def make_teacher(cfg: VarceJobConfig) -> str:
    """The run's teacher alone (:func:`teacher_model`: for ``--teacher partial`` trained into ``cfg.output``, or
    reused when saved there with the same settings, resumed from its checkpoints when killed): its folder. For runs
    that reuse another run's teacher when that run's folder is gone (``benchmarks/varce_rerank.py``)."""
    h, data, corpus = _start(cfg)
    return teacher_model(cfg, h, data, corpus)[0]


def run(cfg: VarceJobConfig) -> dict[str, Any]:
    """The distillation run into ``cfg.output`` (docs/varce.md); returns the summary as :meth:`Harness.finish` wrote."""
    h, data, train_corpus = _start(cfg)
    teacher = teacher_model(cfg, h, data, train_corpus)
    model = SentenceTransformer(teacher[0], device="cpu")
    model.max_seq_length = cfg.max_seq_length
    sides: dict[str, Side] = {}

    def side(collection: Collection) -> Side:
        if collection.name not in sides:
            known = train_corpus if collection.name == data.train_collection.name else None
            sides[collection.name] = load_side(h, model, teacher[1], collection, known)
        return sides[collection.name]

    with h.stage("teacher", f"teacher {teacher[0]}: embeddings of {cfg.dataset}, fusion weight on dev, pools"):
        fusion = fusion_stage(cfg, h, data, side(data.train_collection))
    targets = target_stage(cfg, h, data)  # the test split (--max-queries) and each --ood collection (zero-shot)
    evaluate = dev_evaluator(cfg, h, data)  # the learning curves' dev pairs, also those of the choices on dev
    models, attention = train_students(cfg, h, teacher, fusion, train_corpus, evaluate)
    scorers = _scorers(cfg, h, models)
    dev_cand = dev_scored = None
    if evaluate is not None:
        dev_cand, dev_qrels = evaluate.cand, evaluate.qrels
        dev_scored = scored(h, scorers, f"{data.train_collection.name}/{data.dev}", dev_cand, "score")
    risks = sorted({0.0, *map(float, cfg.risks)})
    rows, calibration, uncertainty, evaluated, selective, per_query_ndcg, lexical = [], {}, {}, {}, {}, {}, {}
    for tg in targets:
        with h.stage(f"rerank_{slug(tg.label, '_')}", f"re-ranking BM25's top {tg.depth} of {tg.label}/{tg.split}"):
            cand = tg.candidates(h, tg.topics, tg.depth).rename(columns={"score": "bm25"})
            frame = scored(h, scorers, tg.label, side(tg.collection).with_cosines(cand, tg.topics))
            qids = tg.topics["qid"].tolist()
            for depth in sorted({tg.depth, *(d for d in cfg.extra_depths if d < tg.depth)}, reverse=True):
                r, per_query = rerank_rows(frame, tg.qrels, fusion["alpha"], tg.label, qids, depth)
                if depth == tg.depth:
                    kept = per_query
                    per_query_ndcg[tg.label] = {n: v.to_dict() for n, v in per_query.items()}
                    lexical[tg.label] = lexical_shares(frame[frame["rank"] < depth], fusion["alpha"])
                rows.extend(r)
        zero_shot = tg.collection.name != data.train_collection.name or tg is not targets[0]
        evaluated[tg.label] = {"split": tg.split, "queries": len(tg.topics), "queries_available": tg.available}
        evaluated[tg.label] |= {"depth": tg.depth, "zero_shot": zero_shot}
        with h.stage(f"selective_{slug(tg.label, '_')}", f"selective prediction on {tg.label}"):
            selective[tg.label] = selective_stage(
                h, tg.label, frame, kept, models, dict(zip(tg.topics["qid"], tg.topics["query"])), cfg
            )
        if dev_scored is None:
            continue
        if tg is targets[0]:
            calibration = calibration_stage(dev_scored, frame, dev_qrels, tg.qrels, list(models))
            for row in rows:
                if row["collection"] == tg.label and row["depth"] == tg.depth and row["system"] in calibration:
                    row["ece"] = calibration[row["system"]]["ece"]
        uncertainty[tg.label] = uncertainty_stage(frame, dev_scored, tg.qrels, dev_qrels, kept, risks)
    _report_notes(cfg, data, targets, evaluated)
    curves = _curves(cfg, h)
    describe_students(rows, cfg, attention, curves)
    pool = fusion["pool"]
    summary = {
        "teacher": {
            "model": teacher[0],
            "alpha": fusion["alpha"],
            "dev_nDCG@10_by_alpha": fusion["dev"],
            "pool_pairs": int(len(pool)),
            "pool_queries": int(pool["qid"].nunique()),
            "pseudo_queries": fusion["pseudo"],
        },
        "students": {s: MODEL_PREFIX + s for s in models},
        "joint_layers": joint_layers(cfg),
        "cross_attention_mass": attention,
        "rows": rows,
        "evaluated": evaluated,
        "dev_curves": curves,
        "calibration": calibration,
        "uncertainty": uncertainty,
        "scoring": {s: sc.info() for s, sc in scorers.items()},
        "aurc": selective,
        "per_query": per_query_ndcg,
        "lexical_share": lexical,
        "std_shift": std_shift(selective, targets[0].label) if selective else {},
        "dev_candidates": 0 if dev_cand is None else int(len(dev_cand)),
    }
    if calibration:
        from pyterrier_prob.plots import reliability_plot  # matplotlib: optional

        reliability_plot(calibration, h.path("reliability.png"))
    var = [s for s in ("VarCE-VAR", "VarCE-MEANVAR") if s in models]
    if selective and var:
        from pyterrier_prob.plots import risk_coverage_plot  # matplotlib: optional

        risk_coverage_plot(selective, var[0], h.path("risk_coverage.png"))
    title = "Cross-encoders distilled from a bi-encoder + BM25 teacher, re-ranking BM25"
    return h.finish(title, distill_markdown(summary), {"rows": pd.DataFrame(rows)}, summary, data)


def _curves(cfg: VarceJobConfig, h: Harness) -> dict[str, Any]:
    """Each student's learning curve (by system name) as its training wrote it (none without dev queries)."""
    out = {}
    for s in students(cfg):
        path = h.path("curves", f"{MODEL_PREFIX}{s}.json")
        if os.path.isfile(path):
            out[s] = read_json(path)
    return out


def _report_notes(cfg: VarceJobConfig, data: Data, targets: list[Target], evaluated: dict[str, Any]) -> None:
    """What was zero-shot and what was chosen on dev, for the report's head."""
    shot = [tg.label for tg in targets if evaluated[tg.label]["zero_shot"]]
    if shot:
        data.notes.append(
            f"zero-shot: {', '.join(shot)} (no corpus, query or label of theirs in training: the teacher, its pool "
            f"and the students' rows come from {data.train_collection.name}/{data.train})"
        )
    if cfg.dev_queries:
        data.notes.append(
            "chosen on dev: each student's kept step (its learning curve), the Platt map of the ECE and lambda of each "
            "VarCE's risk-aware ranking; test is read once"
        )
