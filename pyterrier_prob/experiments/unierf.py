"""The UniERF experiment (``pyterrier-prob unierf``): recall of the merged branch candidates at a total budget B,
the Table 2 ablation, and how much the branches' candidate sets overlap.

Jiang et al., *UniERF* (KDD'25, ``shared/papers/unierf.md``), adapted to text retrieval with two branches of one
query tower (Sec. 4.1): ``semantic`` reads the query, ``trigger`` the query and the text of its top BM25 document
(:class:`~pyterrier_prob.TriggerText`), trained by the terms of :class:`~st_extensions.losses.UniERFLoss` (Eq.
28-32) on the same rows and batches. The stages (:func:`start`, :func:`training_rows`, :func:`train_systems`,
:func:`recall_at_budgets`, :func:`overlap_table`, :func:`report`, on a :class:`UniERFRun`) can be called one by
one; the protocol in full: ``docs/unierf.md`` (The protocol).
"""

from __future__ import annotations

import argparse
import gc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import pandas as pd
from sentence_transformers import SentenceTransformer

from pyterrier_prob.experiments import harness
from pyterrier_prob.experiments.harness import (
    CommonConfig,
    Data,
    Harness,
    add_options,
    loss_ends,
    markdown_table,
    measure_cell,
    option,
)
from pyterrier_prob.training import text_columns
from pyterrier_prob.unierf.analysis import (
    RECORDED,
    BranchLists,
    LossFactory,
    RecordedUniERFLoss,
    alone_run,
    branch_lists,
    mean_jaccard,
    merged_run,
)
from pyterrier_prob.unierf.branches import (
    TriggerText,
    UniERFEncoder,
    unierf_training_data,
)
from st_extensions import build_unierf_model, default_model_path, load_model
from st_extensions.judged import JudgedPairs, pair_labels
from st_extensions.losses.unierf import FrozenDocumentTower
from st_extensions.modules.branches import MultiBranchQueryEncoder
from st_extensions.unierf import POSITIVE_COLUMN, anchor_column, find_branches, negative_column

__all__ = [
    "DESCRIPTION",
    "RecordedUniERFLoss",
    "UniERFJobConfig",
    "UniERFRun",
    "add_arguments",
    "config_from_args",
    "overlap_table",
    "recall_at_budgets",
    "report",
    "run",
    "run_unierf_job",
    "start",
    "train_systems",
    "training_rows",
]

DESCRIPTION = (
    "UniERF (uniform embedding-based retrieval framework): fine-tune two-branch query towers (semantic: the "
    "query; trigger: the query and its top BM25 document) with the UniERF loss and its Table 2 ablations on the "
    "same rows and batches, merge the branches' candidates into a total budget B, and compare merged recall R@B "
    "(pt.Experiment, paired t-tests against UniERF (all)) and the branches' overlap."
)

BRANCHES = ("semantic", "trigger")
BASELINE = "UniERF (all)"
HEAD_PARAMS = r"(^|\.)heads\."
"""Regex of the branch heads' parameters (trained at ``--head-lr``)."""
HARD_DEPTH = 100
"""BM25 candidates per query for the hard negatives."""
HARD_TAIL = 0.3
"""Share of those candidates, from the bottom, that are hard negatives ("the last 30%", Sec. 5.3.2)."""


@dataclass(frozen=True)
class _System:
    key: str
    name: str
    hard_negatives: bool
    diversity: bool
    low_alpha: bool = False


JOINT = (
    _System("all", "UniERF (all)", True, True),
    _System("nodiv", "w/o L_div", True, False),
    _System("nodiff", "w/o diff. negatives", False, True),
    _System("neither", "w/o L_div / diff-sam", False, False),
    _System("lowalpha", "UniERF (all, low alpha)", True, True, low_alpha=True),
)
"""The jointly trained systems: (a), (a1), (a2), (a3) of Table 2 and (a) at a low alpha."""
INDEPENDENT = "independent"
ABLATIONS = {
    "none": ("all",),
    "table2": ("all", "nodiv", "nodiff", "neither"),
    "all": ("all", "nodiv", "nodiff", "neither", "lowalpha", INDEPENDENT),
}
"""``--ablations`` -> the trained systems (keys of :data:`JOINT`, and ``independent``)."""


@dataclass
class UniERFJobConfig(CommonConfig):
    """Settings of :func:`run_unierf_job` (the ``pyterrier-prob unierf`` options: each field's help documents it);
    the shared ones are :class:`~pyterrier_prob.experiments.harness.CommonConfig`'s."""

    output: str = "outputs/unierf"
    head_lr: float | None = option(
        None,
        "learning rate of the branch heads (new parameters; the encoder trains at --lr; default: the rate "
        "MultiBranchQueryEncoder declares)",
        type=float,
    )
    alpha: float = option(0.6, "truncation alpha of the diversity loss (Eq. 31; the paper's 0.6, Sec. 5.3.2)")
    low_alpha: float = option(0.3, "alpha of the 'UniERF (all, low alpha)' system")
    budgets: Sequence[int] = option((100, 300), "total budgets B (R@B; each branch's quota is B/2)")
    ablations: str = option(
        "table2",
        "trained systems: none: UniERF (all); table2: + w/o L_div, w/o diff. negatives, w/o both (Table 2); "
        "all: + low alpha and (c) independently trained branches",
        choices=tuple(ABLATIONS),
    )
    doc_tower: str = option(
        "frozen",
        "frozen: documents keep the start model's embeddings (one index, only the query tower trains); "
        "joint: the encoder also trains on the documents and every trained model re-indexes (~4x the time)",
        choices=("frozen", "joint"),
    )
    timings: dict[str, float] = field(default_factory=dict, repr=False)

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting out of range."""
        super().check()
        if self.head_lr is not None and not self.head_lr > 0:
            raise ValueError(f"--head-lr must be > 0, got {self.head_lr}")
        for name, value in (("alpha", self.alpha), ("low-alpha", self.low_alpha)):
            if not (math.isfinite(value) and -1.0 <= value < 1.0):
                raise ValueError(f"--{name} must lie in [-1, 1) (a cosine), got {value}")
        if not self.budgets or any(int(b) != b or b < 2 for b in self.budgets):
            raise ValueError(f"--budgets must be integers >= 2 (each branch gets B/2), got {list(self.budgets)}")
        if len(set(self.budgets)) != len(self.budgets):
            raise ValueError(f"--budgets must be distinct, got {list(self.budgets)}")
        if self.ablations not in ABLATIONS:
            raise ValueError(f"--ablations must be one of {list(ABLATIONS)}, got {self.ablations!r}")
        if self.doc_tower not in ("frozen", "joint"):
            raise ValueError(f"--doc-tower must be 'frozen' or 'joint', got {self.doc_tower!r}")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The ``pyterrier-prob unierf`` options."""
    add_options(ap, UniERFJobConfig(), "UniERF")


def config_from_args(a: argparse.Namespace) -> UniERFJobConfig:
    return harness.config_from_args(UniERFJobConfig, a)


# --------------------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------------------


def _with_triggers(
    h: Harness, index: Any, coll: Any, topics: pd.DataFrame, texts: dict[str, str] | None = None
) -> pd.DataFrame:
    """``topics`` (``qid, query``) + ``trigger_docno``, ``trigger_text``: the top BM25 document of each query."""
    topics = topics[["qid", "query"]].reset_index(drop=True)
    bm25 = h.bm25_retriever(index, 1)
    if texts is None:
        texts = coll.doc_texts(set(bm25(topics)["docno"].astype(str)))
    return TriggerText(bm25, texts)(topics)


def _training_rows(
    cfg: UniERFJobConfig, h: Harness, data: Data, bm25_index: Any, dense_index: Any
) -> tuple[Any, dict[str, str]]:
    """The UniERF training rows of the train split (all six columns) and the train corpus' texts."""
    coll = data.train_collection
    with h.stage("training_data", f"mining UniERF training rows (differentiated negatives) from {coll.name}"):
        doc_texts = {d["docno"]: d["text"] for d in coll.corpus_iter()}
        topics = _with_triggers(h, bm25_index, coll, coll.topics(data.train), doc_texts)
        rows = unierf_training_data(
            topics,
            coll.qrels(data.train),
            doc_texts,
            BRANCHES,
            retriever=h.bm25_retriever(bm25_index, HARD_DEPTH),
            index=dense_index,
            hard_negatives=True,
            depth=HARD_DEPTH,
            tail=HARD_TAIL,
            max_examples=cfg.steps * cfg.batch_size * 2,
            seed=cfg.seed,
        )
    if len(rows) < cfg.batch_size:
        raise ValueError(
            f"{coll.name}/{data.train} gives {len(rows)} training rows, fewer than one batch of {cfg.batch_size}"
        )
    return rows, doc_texts


def _frozen_tower(start: Any, rows: Any, doc_texts: dict[str, str], index: Any) -> Any:
    """A :class:`FrozenDocumentTower` of the start model, primed with ``index``'s vectors of the rows' documents."""
    tower = FrozenDocumentTower(start)
    wanted: set[str] = set()
    for c in rows.column_names:
        if c.startswith(("positive", "negative")):
            wanted.update(rows[c])
    docno_of: dict[str, str] = {}
    for d, t in doc_texts.items():
        if t in wanted and t not in docno_of:
            docno_of[t] = d
    position = {str(d): i for i, d in enumerate(index.docno_array())}
    texts = [t for t, d in docno_of.items() if d in position]
    if texts:
        ids = np.asarray([position[docno_of[t]] for t in texts], dtype=np.int64)
        tower.prime(texts, np.asarray(index.vectors()[ids], dtype=np.float32))
    return tower


# --------------------------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------------------------


def _load(cfg: UniERFJobConfig) -> Any:
    return load_model(cfg.model or default_model_path(), device="cpu")


def _is_unierf(model: Any) -> bool:
    return any(isinstance(m, MultiBranchQueryEncoder) for m in model.modules())


def _start_model(cfg: UniERFJobConfig) -> Any:
    """The two-branch start model: ``--model`` as it is when it is a UniERF model with both branches, else the
    model (default: the packaged MiniLM) with identity-initialised semantic and trigger heads (``given_heads``
    says which)."""
    model = _load(cfg)
    if _is_unierf(model):
        missing = [b for b in BRANCHES if b not in find_branches(model).branches]
        if missing:
            raise ValueError(f"--model {cfg.model} is a UniERF model without the branches {missing}")
        model.given_heads = True
        return model
    model = build_unierf_model(model, branches=BRANCHES, seed=cfg.seed, device="cpu")
    model.given_heads = False
    return model


def _single_branch_model(cfg: UniERFJobConfig, branch: str) -> Any:
    """(c): a model with one head, ``branch``, on the start model's encoder (a UniERF ``--model`` loses its heads)."""
    model = _load(cfg)
    if _is_unierf(model):
        model = SentenceTransformer(modules=[m for m in model if not isinstance(m, MultiBranchQueryEncoder)])
    return build_unierf_model(model, branches=(branch,), seed=cfg.seed, device="cpu")


def run_unierf_job(cfg: UniERFJobConfig) -> dict[str, Any]:
    """Run the UniERF experiment (``docs/unierf.md``, The protocol) and write its outputs to ``cfg.output``.

    Writes ``results.csv`` (R@B and p-values of every run), ``overlap.csv``, ``training.csv``, ``summary.json`` and
    ``results.md``; models under ``models/``, indexes under ``indexes/``.

    Returns:
        ``{"results": frame, "overlap": frame, "training": frame, "summary": dict}``.
    """
    h = Harness("unierf", cfg)
    data = h.load_data(calibrate=False)  # nothing is calibrated: every test query is reported
    if data.dev is not None:
        data.notes.append(f"the dev split ({data.cal_source}) is not used: UniERF calibrates nothing")
    run = start(cfg, h, data)
    train_systems(run)
    results, shares = recall_at_budgets(run)
    overlap = overlap_table(run, shares)
    return report(run, results, overlap)


@dataclass
class UniERFRun:
    """One UniERF run's state, stage after stage: the test queries with their triggers, each system's branch lists
    (``lists``: system -> branch -> qid -> (docnos, scores)) and branch cosine, and the training rows."""

    cfg: UniERFJobConfig
    h: Harness
    data: Data
    topics: pd.DataFrame  # test queries + trigger documents
    test_index: Any  # the start model's index of the test collection
    bm25_runs: dict[int, pd.DataFrame]
    start_name: str
    lists: dict[str, dict[str, BranchLists]] = field(default_factory=dict)
    cosines: dict[str, float | None] = field(default_factory=dict)
    info: dict[str, dict[str, Any]] = field(default_factory=dict)  # trained system -> its training summary
    rows: Any = None
    judged: Any = None
    tower: Any = None

    @property
    def budgets(self) -> list[int]:
        return sorted(int(b) for b in self.cfg.budgets)

    def query_vectors(self, model: Any) -> pd.DataFrame:
        return UniERFEncoder(self.h.encoding_model(model), batch_size=64).query_encoder()(self.topics)

    def add_lists(self, name: str, frames: dict[str, pd.DataFrame], indexes: dict[str, Any]) -> None:
        """System ``name``'s branch lists: ``frames[b]``, test queries with ``query_vec_<b>``; ``indexes[b]``, the
        index branch b searches."""
        self.lists[name] = {b: branch_lists(frames[b], indexes[b], b, max(self.budgets)) for b in BRANCHES}
        sem, trig = (np.stack(frames[b][f"query_vec_{b}"].to_list()) for b in BRANCHES)
        same_space = indexes["semantic"] is indexes["trigger"]
        self.cosines[name] = float(np.mean(np.sum(sem * trig, axis=1))) if same_space else None

    def index_of(self, slug: str, model: Any) -> Any:
        """The index a trained model searches: the start model's, unless the document tower trains too."""
        if self.cfg.doc_tower == "frozen" or self.h.recipe.caches_features:
            return self.test_index
        encoder = UniERFEncoder(self.h.encoding_model(model), batch_size=64)
        return self.h.dense_index(slug, encoder, self.data.test_collection)


def start(cfg: UniERFJobConfig, h: Harness, data: Data) -> UniERFRun:
    """The start model, its index of the test collection, BM25, the test queries' triggers and the start model's
    branch lists; then the training rows (when something trains)."""
    model, _ = h.train("untrained", partial(_start_model, cfg), None, None)
    start_name = "given model" if model.given_heads else "untrained"
    encoder = UniERFEncoder(h.encoding_model(model), batch_size=64)
    test_coll = data.test_collection
    test_index = h.dense_index("untrained", encoder, test_coll)
    test_bm25 = h.bm25(test_coll)
    with h.stage("triggers", f"finding the trigger documents (top BM25) of the {len(data.test_topics)} test queries"):
        topics = _with_triggers(h, test_bm25, test_coll, data.test_topics)
        bm25_runs = {b: h.bm25_run(test_bm25, topics[["qid", "query"]], b) for b in cfg.budgets}
    run = UniERFRun(cfg, h, data, topics, test_index, bm25_runs, start_name)
    with h.stage("retrieve_untrained", f"retrieving with the {start_name} model's branches"):
        q = run.query_vectors(model)
        run.add_lists(start_name, {b: q for b in BRANCHES}, {b: test_index for b in BRANCHES})
    if data.train and ABLATIONS[cfg.ablations]:
        same = data.train_collection is test_coll
        train_bm25 = test_bm25 if same else h.bm25(data.train_collection)
        train_index = test_index if same else h.dense_index("untrained", encoder, data.train_collection)
        training_rows(run, model, train_bm25, train_index)
    del model, encoder
    gc.collect()
    return run


def training_rows(run: UniERFRun, model: Any, bm25_index: Any, dense_index: Any) -> None:
    """The training rows (Sec. 4.3) with their judged-pair labels, and (document tower frozen, encoder trained) the
    frozen document tower primed with the start model's vectors."""
    rows, doc_texts = _training_rows(run.cfg, run.h, run.data, bm25_index, dense_index)
    # judged negatives: rows hold every judged-relevant pair unless max_examples cut them
    anchors, positives = rows[anchor_column(BRANCHES[0])], rows[POSITIVE_COLUMN]
    run.judged = JudgedPairs(zip(anchors, positives))
    run.rows = rows.add_column("label", pair_labels(anchors, positives))
    if run.cfg.doc_tower == "frozen" and run.h.recipe.trains_encoder:  # else the whole encoder is frozen anyway
        with run.h.stage("frozen_tower", "priming the frozen document tower with the start model's index"):
            run.tower = _frozen_tower(model, run.rows, doc_texts, dense_index)


def train_systems(run: UniERFRun) -> None:
    """Train the systems ``--ablations`` names on the same rows and retrieve with each one's branches: the joint
    ones ((a) and its ablations) and (c) the independently trained branches."""
    cfg, h = run.cfg, run.h
    wanted = ABLATIONS[cfg.ablations] if run.rows is not None else ()
    hard_cols = [negative_column(b) for b in BRANCHES]
    for s in (s for s in JOINT if s.key in wanted):
        alpha = cfg.low_alpha if s.low_alpha else cfg.alpha
        ignore = [] if s.hard_negatives else hard_cols
        slug = f"unierf-{s.key}"
        model = _train_one(run, slug, s.name, partial(_start_model, cfg), BRANCHES, ignore, s.diversity, alpha)
        index = run.index_of(slug, model)
        with h.stage(f"retrieve_{s.key}", f"retrieving with {s.name}'s branches"):
            q = run.query_vectors(model)
            run.add_lists(s.name, {b: q for b in BRANCHES}, {b: index for b in BRANCHES})
        del model
        gc.collect()
    if INDEPENDENT in wanted:
        frames, indexes = {}, {}
        for b in BRANCHES:
            ignore = [c for o in BRANCHES if o != b for c in (anchor_column(o), negative_column(o))]
            build = partial(_single_branch_model, cfg, b)
            model = _train_one(run, f"independent-{b}", f"{INDEPENDENT} {b}", build, (b,), ignore, False, cfg.alpha)
            indexes[b] = run.index_of(f"independent-{b}", model)
            with h.stage(f"retrieve_independent_{b}", f"retrieving with the independent {b} model"):
                frames[b] = run.query_vectors(model)
            del model
            gc.collect()
        run.add_lists(INDEPENDENT, frames, indexes)


def _train_one(
    run: UniERFRun,
    slug: str,
    name: str,
    build: Callable[[], Any],
    branches: Sequence[str],
    ignore: list[str],
    diversity: bool,
    alpha: float,
) -> Any:
    """Train one system by the terms it keeps (``diversity``, the columns it does not ``ignore``); its training
    summary goes to ``run.info[name]``."""
    cfg, h = run.cfg, run.h
    columns = text_columns(run.rows)
    loss = LossFactory(
        columns=columns,
        ignore_columns=ignore,
        document_tower=run.tower,
        use_diversity=diversity,
        diversity_threshold=alpha,
        judged=run.judged,
    )
    settings = {
        "train": f"{run.data.train_collection.name}/{run.data.train}",
        "branches": list(branches),
        "columns": [c for c in columns if c not in ignore],
        "use_diversity": diversity,
        "alpha": alpha,
        "head_lr": cfg.head_lr,
        "doc_tower": cfg.doc_tower,
        "rows": len(run.rows),
    }
    mapping = {HEAD_PARAMS: cfg.head_lr} if cfg.head_lr is not None else None
    model, losses = h.train(slug, build, loss, lambda: run.rows, learning_rate_mapping=mapping, settings=settings)
    rec = loss.loss
    stats = rec.stats if rec is not None else {}
    several = len(branches) > 1
    run.info[name] = {
        "model": h.path("models", slug),
        "columns": settings["columns"],
        "use_diversity": diversity if several else None,
        "alpha": alpha if several else None,
        "reused": rec is None,
        "train_s": h.timings.get(f"train_{slug}"),
        "loss_first_last_10": loss_ends(losses),
        **{f"{k}_first_last_10": loss_ends(stats.get(k, [])) for k in RECORDED},
        "batch_fingerprint": rec.digest.hexdigest()[:16] if rec is not None else None,
    }
    return model


def _order(run: UniERFRun) -> tuple[str, list[str]]:
    """The significance baseline and the systems in table order (the baseline first)."""
    trained = [s for s in run.lists if s != run.start_name]
    baseline = BASELINE if BASELINE in trained else run.start_name
    return baseline, [baseline] + [s for s in [*trained, run.start_name] if s != baseline]


def recall_at_budgets(run: UniERFRun) -> tuple[pd.DataFrame, dict[str, dict[int, float]]]:
    """R@B of every system's merged candidates (and of the branches alone, and BM25) for each budget B, in
    ``pt.Experiment`` with paired t-tests against the baseline's merged list; and each system's share of the merged
    B found by both branches."""
    h, lists = run.h, run.lists
    baseline, order = _order(run)
    alone = {BASELINE, INDEPENDENT, run.start_name}
    shares: dict[str, dict[int, float]] = {s: {} for s in lists}
    tables = []
    coll = run.data.test_collection
    with h.stage("test", f"R@B of the merged candidates on {coll.name}/{run.data.test} (pt.Experiment per B)"):
        for budget in h.progress(run.budgets, "scoring", unit="B"):
            runs: dict[str, pd.DataFrame] = {}
            for s in order:
                runs[f"{s}: merged"], shares[s][budget] = merged_run([lists[s][b] for b in BRANCHES], budget)
                if s in alone:
                    for b in BRANCHES:
                        runs[f"{s}: {b} branch alone"] = alone_run(lists[s][b], budget)
            runs["BM25"] = run.bm25_runs[budget][["qid", "docno", "score", "rank"]]
            topics = run.topics[["qid", "query"]]
            exp = h.experiment(runs, topics, run.data.test_qrels, [f"R@{budget}"], baseline=f"{baseline}: merged")
            keep = ["name", f"R@{budget}"] + ([f"R@{budget} p-value"] if f"R@{budget} p-value" in exp else [])
            tables.append(exp[keep].set_index("name"))
    return pd.concat(tables, axis=1).reset_index(), shares


def overlap_table(run: UniERFRun, shares: dict[str, dict[int, float]]) -> pd.DataFrame:
    """Per system: the mean Jaccard of the branches' top-B/2 lists, the share of the merged B found by both, and the
    mean cosine of a query's two branch vectors."""
    rows = []
    for s in _order(run)[1]:
        row: dict[str, Any] = {"system": s}
        for budget in run.budgets:
            row[f"J@{budget // 2}"] = mean_jaccard(run.lists[s]["semantic"], run.lists[s]["trigger"], budget // 2)
            row[f"both@{budget}"] = shares[s][budget]
        row["cos(H_sem, H_trig)"] = run.cosines[s] if run.cosines[s] is not None else float("nan")
        rows.append(row)
    return pd.DataFrame(rows)


def report(run: UniERFRun, results: pd.DataFrame, overlap: pd.DataFrame) -> dict[str, Any]:
    """The training table, ``summary.json`` and ``results.md`` (:meth:`Harness.finish`)."""
    cfg, info = run.cfg, run.info
    nan2 = (np.nan, np.nan)
    training = pd.DataFrame(
        [
            {
                "system": name,
                "columns": " ".join(i["columns"]),
                "L_div": i["use_diversity"],
                "alpha": i["alpha"],
                "train_s": i["train_s"],
                "loss_first10": (i["loss_first_last_10"] or nan2)[0],
                "loss_last10": (i["loss_first_last_10"] or nan2)[1],
                "branch_cos_first10": (i["branch_cos_first_last_10"] or nan2)[0],
                "branch_cos_last10": (i["branch_cos_first_last_10"] or nan2)[1],
                "batch_fingerprint": i["batch_fingerprint"],
            }
            for name, i in info.items()
        ]
    )
    baseline = _order(run)[0]
    prints = {n: i["batch_fingerprint"] for n, i in info.items() if i["batch_fingerprint"]}
    summary: dict[str, Any] = {
        "branches": {"semantic": "query", "trigger": "query [SEP] text of the top BM25 document"},
        "systems": list(run.lists),
        "trained": list(info),
        "significance": f"paired t-test against {baseline + ': merged'!r} (pt.Experiment / scipy.stats.ttest_rel)",
        "merge": "equal quotas B/2, dedup, refill (branch_quotas + merge_branch_lists, as MultiBranchRetriever)",
        "doc_tower": cfg.doc_tower,
        "hard_negatives": f"semantic: {HARD_TAIL:.0%} tail of the BM25 top {HARD_DEPTH}; trigger: the "
        f"{HARD_TAIL:.0%} of the BM25 top {HARD_DEPTH} least similar to the trigger document (start model's "
        "vectors); relevant documents excluded",
        "training_rows": len(run.rows) if run.rows is not None else 0,
        "training_columns": text_columns(run.rows) if run.rows is not None else [],
        "batch_fingerprints": prints,
        "identical_batches": (len(set(prints.values())) == 1) if len(prints) > 1 else None,
        "frozen_tower": run.tower.stats if run.tower is not None else None,
        "training": info,
        "recall": _json_records(results),
        "overlap": _json_records(overlap),
    }
    md = _markdown(results, overlap, training, run.budgets, summary)
    title = "UniERF: merged recall at budget B, Table 2 ablation and branch overlap"
    tables = {"results": results, "overlap": overlap, "training": training}
    summary = run.h.finish(title, md, tables, summary, run.data)
    cfg.timings.update(run.h.timings)
    return {"results": results, "overlap": overlap, "training": training, "summary": summary}


def _json_records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """A frame as JSON-ready records (NaN as None)."""
    return [
        {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
        for r in frame.to_dict(orient="records")
    ]


def _markdown(
    results: pd.DataFrame,
    overlap: pd.DataFrame,
    training: pd.DataFrame,
    budgets: Sequence[int],
    summary: dict[str, Any],
) -> str:
    """The report: the main table (R@B with `*` marks, overlap of the merged systems), then the details."""
    ov = overlap.set_index("system")
    head = ["system", *[f"R@{b}" for b in budgets], *[f"J@{b // 2}" for b in budgets], "cos(H_sem, H_trig)"]
    lines = [
        f"R@B: recall of the B merged candidates (equal quotas B/2, dedup, refill); `*`: p < 0.05, "
        f"{summary['significance']}. J@B/2: Jaccard of the two branches' top-B/2 lists, mean over queries; "
        "cos: mean cosine of a query's two branch vectors. Document tower: "
        f"{summary['doc_tower']}.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for _, r in results.iterrows():
        name = str(r["name"])
        cells = [name]
        for b in budgets:
            cells.append(measure_cell(r, f"R@{b}"))
        system = name[: -len(": merged")] if name.endswith(": merged") else None
        for b in budgets:
            cells.append(f"{ov.loc[system, f'J@{b // 2}']:.3f}" if system in ov.index else "")
        cos = ov.loc[system, "cos(H_sem, H_trig)"] if system in ov.index else np.nan
        cells.append(f"{cos:.3f}" if np.isfinite(cos) else "")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Overlap (means over the test queries; both@B: share of the merged B found by both branches):", ""]
    lines.append(markdown_table(overlap, ".3f"))
    if len(training):
        same = summary.get("identical_batches")
        lines += [
            "",
            f"Training ({summary['training_rows']} rows; the same batches for every system: "
            f"{'yes' if same else 'no' if same is False else 'not checked'}; means of the first/last 10 steps):",
            "",
            markdown_table(training, ".3f"),
        ]
    return "\n".join(lines) + "\n"


run = run_unierf_job  # what ``pyterrier-prob unierf`` runs
