"""The UniERF experiment (``pyterrier-prob unierf``; Jiang et al., KDD'25, ``shared/papers/unierf.md``): two branches
of one query tower (``semantic``: the query; ``trigger``: the query and its top BM25 document, Sec. 4.1) trained by
the terms of :class:`~st_extensions.losses.UniERFLoss` (Eq. 28-32); merged recall at a total budget B, the Table 2
ablation and the branches' overlap. The stages run on a :class:`UniERFRun`; the protocol: ``docs/unierf.md``."""

from __future__ import annotations

import gc
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import pandas as pd
from sentence_transformers import SentenceTransformer

from pyterrier_prob.experiments.claims import perquery_claims, record_claims
from pyterrier_prob.experiments.harness import (
    CommonConfig,
    Data,
    Harness,
    base_model,
    loss_ends,
    markdown_table,
    measure_cell,
    option,
    set_max_len,
    subcommand,
)
from pyterrier_prob.experiments.output import read_if_present
from pyterrier_prob.training import complete_checkpoints, text_columns
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
from pyterrier_prob.unierf.branches import TriggerText, UniERFEncoder, unierf_training_data
from st_extensions import build_unierf_model, load_model
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
PAPER_ALPHA = 0.6  #: the paper's diversity truncation alpha (Sec. 5.3.2)
DEV_QUOTAS = f"{BASELINE}: merged, dev quotas"  #: the full model's merge with the trigger share chosen on dev
SHARES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  #: ``--dev-quotas``: the trigger shares of B tried on dev
HEAD_PARAMS = r"(^|\.)heads\."  #: the branch heads' parameters (trained at ``--head-lr``)
HARD_DEPTH = 100  #: BM25 candidates per query for the hard negatives
HARD_TAIL = 0.3  #: share of them, from the bottom, that are hard negatives ("the last 30%", Sec. 5.3.2)


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
    """The ``pyterrier-prob unierf`` options beyond :class:`CommonConfig`'s, each field's help its documentation."""

    output: str = "outputs/unierf"
    head_lr: float | None = option(
        None,
        "learning rate of the branch heads (new parameters; the encoder trains at --lr; default: the rate "
        "MultiBranchQueryEncoder declares)",
    )
    alpha: float = option(0.6, "truncation alpha of the diversity loss (Eq. 31; the paper's 0.6, Sec. 5.3.2)")
    low_alpha: float = option(0.3, "alpha of the 'UniERF (all, low alpha)' system")
    alpha_grid: Sequence[float] = option(
        (),
        "choose alpha on dev from this grid (fixed before any test figure is read): UniERF (all) is trained at each "
        "alpha, the one with the best dev merged R@100 (its dev curve's best point; ties: nearest the paper's 0.6) is "
        "'UniERF (all)' and the alpha of the other systems (replacing --alpha), every other alpha's model is reported "
        "as 'UniERF (all) at alpha A' with its test figures; needs dev curves (--recipe partial/full or --dev-every)",
        nargs="*",
        type=float,
    )
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
        "joint: the encoder also trains on the documents and every trained model re-indexes (~4x the time; needs "
        "--recipe partial or full)",
        choices=("frozen", "joint"),
    )
    dev_quotas: bool = option(
        False,
        "also merge the full model's branches with the trigger branch's share of each budget B chosen on the dev "
        "queries (R@B over the shares 0.1, 0.2, ..., 0.9; the paper's merge is the equal share 0.5)",
    )
    timings: dict[str, float] = field(default_factory=dict, repr=False)

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting out of range."""
        super().check()
        if self.head_lr is not None and not (math.isfinite(self.head_lr) and self.head_lr > 0):
            raise ValueError(f"--head-lr must be finite and > 0, got {self.head_lr}")
        named = {"alpha": [self.alpha], "low-alpha": [self.low_alpha], "alpha-grid": self.alpha_grid}
        for name, value in ((n, v) for n, values in named.items() for v in values):
            if not (math.isfinite(value) and -1.0 <= value < 1.0):
                raise ValueError(f"--{name} must lie in [-1, 1) (a cosine), got {value}")
        if len(self.alpha_grid) == 1 or len(set(self.alpha_grid)) != len(self.alpha_grid):
            raise ValueError(f"--alpha-grid takes two or more distinct alphas (one: --alpha), got {self.alpha_grid}")
        if self.alpha_grid and not (self.dev_every or self.training_recipe(1).trains_encoder):
            raise ValueError("--alpha-grid chooses alpha on the dev curves: use --recipe partial/full or --dev-every")
        if not self.budgets or any(int(b) != b or b < 2 for b in self.budgets):
            raise ValueError(f"--budgets must be integers >= 2 (each branch gets B/2), got {list(self.budgets)}")
        if len(set(self.budgets)) != len(self.budgets):
            raise ValueError(f"--budgets must be distinct, got {list(self.budgets)}")
        if self.dev_quotas and self.doc_tower != "frozen":
            raise ValueError("--dev-quotas searches the dev queries in the start model index: needs --doc-tower frozen")
        if self.doc_tower == "joint" and self.steps and self.training_recipe(1).caches_features:
            raise ValueError(
                "--doc-tower joint trains the encoder on the documents, which --recipe frozen keeps frozen (only the "
                "branch heads train and every system searches the start model's index): use --recipe partial or "
                "full, or --doc-tower frozen"
            )


add_arguments, config_from_args = subcommand(UniERFJobConfig, "UniERF")  # what ``pyterrier-prob`` calls


# ---- data ------------------------------------------------------------------------------------------------------


def _with_triggers(
    h: Harness, index: Any, coll: Any, topics: pd.DataFrame, texts: dict[str, str] | None = None
) -> pd.DataFrame:
    """``topics`` (``qid, query``) + ``trigger_docno``, ``trigger_text``: the top BM25 document of each query."""
    topics = topics[["qid", "query"]].reset_index(drop=True)
    bm25 = h.bm25_retriever(index, 1)
    if texts is None:
        texts = coll.doc_texts(bm25(topics)["docno"].astype(str))
    return TriggerText(bm25, texts)(topics)


def _frozen_tower(start: Any, rows: Any, doc_texts: dict[str, str], index: Any) -> Any:
    """A :class:`FrozenDocumentTower` of the start model, primed with ``index``'s vectors of the rows' documents."""
    tower = FrozenDocumentTower(start)
    wanted = {t for c in rows.column_names if c.startswith(("positive", "negative")) for t in rows[c]}
    docno_of = {t: d for d, t in reversed(doc_texts.items()) if t in wanted}  # each text's first docno
    position = {str(d): i for i, d in enumerate(index.docno_array())}
    texts = [t for t, d in docno_of.items() if d in position]
    if texts:
        ids = np.asarray([position[docno_of[t]] for t in texts], dtype=np.int64)
        tower.prime(texts, np.asarray(index.vectors()[ids], dtype=np.float32))
    return tower


# ---- models ----------------------------------------------------------------------------------------------------


def _start_model(cfg: UniERFJobConfig, branches: Sequence[str] = BRANCHES) -> Any:
    """``--model`` as it is when it is a UniERF model with ``branches``, else the model (a UniERF one loses its heads)
    with identity-initialised heads for ``branches``; ``given_heads`` says which."""
    model = base_model(cfg)
    heads = [m for m in model.modules() if isinstance(m, MultiBranchQueryEncoder)]
    if heads and len(branches) > 1:
        missing = [b for b in branches if b not in find_branches(model).branches]
        if missing:
            raise ValueError(f"--model {cfg.model} is a UniERF model without the branches {missing}")
        model.given_heads = True
        return model
    if heads:
        model = SentenceTransformer(modules=[m for m in model if not isinstance(m, MultiBranchQueryEncoder)])
    model = build_unierf_model(model, branches=branches, seed=cfg.seed, device="cpu")
    model.given_heads = False
    return model


def run_unierf_job(cfg: UniERFJobConfig) -> dict[str, Any]:
    """Run the UniERF experiment (``docs/unierf.md``) into ``cfg.output``; returns its tables and ``"summary"``."""
    h = Harness("unierf", cfg)
    dev_curves = bool(cfg.dev_every) or h.recipe.trains_encoder or cfg.dev_quotas  # dev: curves and quota shares
    data = h.load_data(calibrate=dev_curves, for_training=True)  # every test query is reported
    dev_curves = dev_curves and data.train is not None  # dev serves the trained systems only
    if cfg.dev_quotas and not dev_curves:
        data.notes.append(f"--dev-quotas: no {BASELINE} model is trained, so no trigger share is chosen on dev")
    if data.dev is not None and not dev_curves:
        data.notes.append(f"the dev split ({data.cal_source}) is not used: nothing is chosen on dev")
    run = start(cfg, h, data)
    train_systems(run)
    results, shares = recall_at_budgets(run)
    return report(run, results, overlap_table(run, shares))


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
    dev: Any = None  # the dev curves' scores (_MergedDev), shared by every system
    train_index: Any = None  # the start model's index of the collection the dev queries search
    shares: dict[int, dict[str, Any]] = field(default_factory=dict)  # --dev-quotas: B -> the share chosen on dev
    alpha: float | None = None  # the diversity alpha of the systems (--alpha, or the one --alpha-grid chose)
    alpha_grid: dict[str, dict[str, Any]] = field(default_factory=dict)  # --alpha-grid: alpha -> dev figures

    @property
    def budgets(self) -> list[int]:
        return sorted(int(b) for b in self.cfg.budgets)

    def query_vectors(self, model: Any, topics: pd.DataFrame | None = None) -> pd.DataFrame:
        """``model``'s branch vectors of ``topics`` (default: the test queries with their triggers)."""
        topics = self.topics if topics is None else topics
        return UniERFEncoder(self.h.encoding_model(model), batch_size=64).query_encoder()(topics)

    def add_lists(self, name: str, frames: dict[str, pd.DataFrame], indexes: dict[str, Any]) -> None:
        """System ``name``'s branch lists from ``frames[b]`` (``query_vec_<b>``) searched in ``indexes[b]``."""
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
    """The start model, its test index, BM25, the test queries' triggers and branch lists; then the training rows."""
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
        run.train_index = test_index if same else h.dense_index("untrained", encoder, data.train_collection)
        training_rows(run, model, train_bm25, run.train_index)
    del model, encoder
    gc.collect()
    return run


def training_rows(run: UniERFRun, model: Any, bm25_index: Any, dense_index: Any) -> None:
    """The training rows of the train split (Sec. 4.3, all six columns) with their judged-pair labels, and (document
    tower frozen, encoder trained) the frozen document tower primed with the start model's vectors."""
    cfg, h, coll = run.cfg, run.h, run.data.train_collection
    with h.stage("training_data", f"mining UniERF training rows (differentiated negatives) from {coll.name}"):
        doc_texts = {d["docno"]: d["text"] for d in coll.corpus_iter()}
        topics = _with_triggers(h, bm25_index, coll, coll.topics(run.data.train), doc_texts)
        mining = {"hard_negatives": True, "depth": HARD_DEPTH, "tail": HARD_TAIL, "seed": cfg.seed}
        mining |= {"retriever": h.bm25_retriever(bm25_index, HARD_DEPTH), "index": dense_index}
        qrels, most = coll.qrels(run.data.train), cfg.steps * cfg.batch_size * 2
        rows = unierf_training_data(topics, qrels, doc_texts, BRANCHES, max_examples=most, **mining)
    if len(rows) < cfg.batch_size:
        raise ValueError(
            f"{coll.name}/{run.data.train} gives {len(rows)} training rows, fewer than one batch of {cfg.batch_size}"
        )
    # judged negatives: rows hold every judged-relevant pair unless max_examples cut them
    anchors, positives = rows[anchor_column(BRANCHES[0])], rows[POSITIVE_COLUMN]
    run.judged = JudgedPairs(zip(anchors, positives))
    run.rows = rows.add_column("label", pair_labels(anchors, positives))
    if cfg.doc_tower == "frozen" and h.recipe.trains_encoder:  # else the whole encoder is frozen anyway
        with h.stage("frozen_tower", "priming the frozen document tower with the start model's index"):
            run.tower = _frozen_tower(model, run.rows, doc_texts, dense_index)


def train_systems(run: UniERFRun) -> None:
    """Train the systems ``--ablations`` names (joint ones, (c) independent branches) and retrieve with each one."""
    cfg = run.cfg
    wanted = ABLATIONS[cfg.ablations] if run.rows is not None else ()
    hard_cols = [negative_column(b) for b in BRANCHES]
    run.alpha = cfg.alpha
    for s in (s for s in JOINT if s.key in wanted):
        if s.key == "all" and cfg.alpha_grid:
            run.alpha = choose_alpha(run)
            continue
        alpha = cfg.low_alpha if s.low_alpha else run.alpha
        ignore = [] if s.hard_negatives else hard_cols
        q, index = _train_one(run, f"unierf-{s.key}", s.name, BRANCHES, ignore, s.diversity, alpha)
        run.add_lists(s.name, {b: q for b in BRANCHES}, {b: index for b in BRANCHES})
    if INDEPENDENT in wanted:
        frames, indexes = {}, {}
        for b in BRANCHES:
            ignore = [c for o in BRANCHES if o != b for c in (anchor_column(o), negative_column(o))]
            name = f"{INDEPENDENT} {b}"
            frames[b], indexes[b] = _train_one(run, f"independent-{b}", name, (b,), ignore, False, run.alpha)
        run.add_lists(INDEPENDENT, frames, indexes)


def grid_name(alpha: float) -> str:
    """The system name of ``--alpha-grid``'s model at ``alpha`` when another alpha was chosen."""
    return f"{BASELINE} at alpha {alpha:g}"


def choose_alpha(run: UniERFRun) -> float:
    """``--alpha-grid``: UniERF (all) trained at each alpha; the chosen alpha (the best dev merged R@100 of its dev
    curve, ties nearest the paper's 0.6) names its model ``UniERF (all)``, every other is ``grid_name(alpha)``;
    ``run.alpha_grid`` holds each alpha's dev figures. Test figures play no part."""
    cfg, h, found = run.cfg, run.h, {}
    for a in cfg.alpha_grid:
        slug = f"unierf-all-a{a:g}"
        frame, index = _train_one(run, slug, grid_name(a), BRANCHES, [], True, a)
        curve = read_if_present(h.path("curves", f"{slug}.json")) or {}
        if not curve.get("best"):
            raise ValueError(f"--alpha-grid: {slug} has no dev curve ({h.path('curves', f'{slug}.json')})")
        found[a] = (frame, index, slug, curve["best"])
    chosen = max(found, key=lambda a: (round(found[a][3]["dev"], 12), -abs(a - PAPER_ALPHA)))
    for a, (frame, index, _, best) in found.items():
        name = BASELINE if a == chosen else grid_name(a)
        if a == chosen:
            run.info[BASELINE] = run.info.pop(grid_name(a))
        run.add_lists(name, {b: frame for b in BRANCHES}, {b: index for b in BRANCHES})
        run.alpha_grid[f"{a:g}"] = {"system": name, "dev_R@100": best["dev"], "best_step": best["step"]}
        run.alpha_grid[f"{a:g}"]["chosen"] = a == chosen
    if cfg.dev_quotas:
        model = load_model(h.path("models", found[chosen][2]), device="cpu")
        choose_quota_shares(run, model)
        del model
    return chosen


def _train_one(
    run: UniERFRun, slug: str, name: str, branches: Sequence[str], ignore: list[str], diversity: bool, alpha: float
) -> tuple[pd.DataFrame, Any]:
    """Train one system (summary to ``run.info[name]``); returns its test query vectors and the index it searches."""
    cfg, h = run.cfg, run.h
    columns = text_columns(run.rows)
    terms = {"use_diversity": diversity, "diversity_threshold": alpha}
    # a resumed training sees only its last steps' batches: no fingerprint then (an incomplete checkpoint: step 0)
    terms["resumed"] = cfg.resume and bool(complete_checkpoints(h.path("runs", slug)))
    loss = LossFactory(columns=columns, ignore_columns=ignore, document_tower=run.tower, judged=run.judged, **terms)
    settings = {"train": f"{run.data.train_collection.name}/{run.data.train}", "branches": list(branches)}
    settings |= {"columns": [c for c in columns if c not in ignore], "use_diversity": diversity, "alpha": alpha}
    settings |= {"head_lr": cfg.head_lr, "doc_tower": cfg.doc_tower, "rows": len(run.rows)}
    mapping = {HEAD_PARAMS: cfg.head_lr} if cfg.head_lr is not None else None
    run.dev = run.dev or _MergedDev(run)
    dev = h.dev_evaluator(run.data, "R@100", run.dev)
    build, rows = partial(_start_model, cfg, branches), lambda: run.rows
    model, losses = h.train(slug, build, loss, rows, learning_rate_mapping=mapping, settings=settings, dev=dev)
    record, several = h.records.get(slug, {}), len(branches) > 1  # also a reused model's, saved when it was trained
    run.info[name] = {
        "model": h.path("models", slug),
        "columns": settings["columns"],
        **({"use_diversity": diversity, "alpha": alpha} if several else {"use_diversity": None, "alpha": None}),
        "reused": loss.loss is None,
        "train_s": h.timings.get(f"train_{slug}"),
        "loss_first_last_10": loss_ends(losses),
        **{f"{k}_first_last_10": loss_ends(record.get("stats", {}).get(k, [])) for k in RECORDED},
        "batch_fingerprint": record.get("batch_fingerprint"),
    }
    index = run.index_of(slug, model)
    with h.stage(f"retrieve_{slug}", f"retrieving with {name}'s branches"):
        frame = run.query_vectors(model)
    if cfg.dev_quotas and name == BASELINE:
        choose_quota_shares(run, model)
    del model
    gc.collect()
    return frame, index


def choose_quota_shares(run: UniERFRun, model: Any) -> None:
    """``--dev-quotas``: for each budget B, the trigger branch's share of B (:data:`SHARES`) whose merge has the highest
    dev R@B (ties: the share nearest 0.5), to ``run.shares`` with every share's dev R@B."""
    h, data = run.h, run.data
    coll, index = (data.train_collection, run.train_index) if data.dev else (data.test_collection, run.test_index)
    with h.stage("dev_quotas", f"choosing the trigger share of B on the {len(data.cal_topics)} dev queries"):
        topics = _with_triggers(h, h.bm25(coll), coll, data.cal_topics)
        frame = run.query_vectors(model, topics)
        lists = [branch_lists(frame, index, b, max(run.budgets)) for b in BRANCHES]
        for budget in run.budgets:
            runs = {str(w): merged_run(lists, budget, (1.0 - w, w))[0] for w in SHARES}
            exp = h.experiment(runs, topics[["qid", "query"]], data.cal_qrels, [f"R@{budget}"])
            dev = {str(n): float(v) for n, v in zip(exp["name"], exp[f"R@{budget}"])}
            best = max(SHARES, key=lambda w: (round(dev[str(w)], 12), -abs(w - 0.5)))
            run.shares[budget] = {"trigger_share": best, "dev_queries": len(topics), f"dev_R@{budget}": dev}


def _dev_quota_run(run: UniERFRun, budget: int) -> pd.DataFrame:
    """The full model's test lists merged with the trigger share ``--dev-quotas`` chose for ``budget``."""
    w = run.shares[budget]["trigger_share"]
    return merged_run([run.lists[BASELINE][b] for b in BRANCHES], budget, (1.0 - w, w))[0]


def _order(run: UniERFRun) -> tuple[str, list[str]]:
    """The significance baseline and the systems in table order (the baseline first)."""
    trained = [s for s in run.lists if s != run.start_name]
    baseline = BASELINE if BASELINE in trained else run.start_name
    return baseline, [baseline] + [s for s in [*trained, run.start_name] if s != baseline]


class _MergedDev:
    """UniERF's dev scores for :class:`~pyterrier_prob.curves.DevRetrieval`: the branch rankings merged as the test
    lists are (a document ranks by its best rank over the branches)."""

    def __init__(self, run: UniERFRun) -> None:
        self.run, self.topics, self.docs = run, None, None

    def __call__(self, model: Any, topics: pd.DataFrame, texts: list[str]) -> np.ndarray:
        h, data, cfg = self.run.h, self.run.data, self.run.cfg
        if self.topics is None:  # the dev queries with their trigger documents (top BM25), in the given order
            coll = data.train_collection if data.dev else data.test_collection
            found = _with_triggers(h, h.bm25(coll), coll, topics).set_index("qid", drop=False)
            self.topics = found.loc[topics["qid"].astype(str)].reset_index(drop=True)
        docs = self.docs
        if docs is None:
            frozen, tower = cfg.doc_tower == "frozen" or h.recipe.caches_features, model
            if frozen:
                tower = h.encoding_model(set_max_len(_start_model(cfg), cfg.max_seq_length))
            docs = tower.encode_document(texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
            self.docs = docs if frozen else None
        queries = UniERFEncoder(model, batch_size=64).encode(self.topics)
        ranks = [np.argsort(np.argsort(-(q @ docs.T), axis=1), axis=1) for q in queries.values()]
        return -np.min(ranks, axis=0).astype(np.float32)


def claims(run: UniERFRun, budget: int = 100) -> list[dict[str, Any]]:
    """Claims at B = ``budget`` (R@B on the test queries): ``merged_vs_best_branch``, the full model's merged list
    against its better branch alone, and ``ablation_<key>``, each other jointly trained system against the full one."""
    if budget not in run.budgets or BASELINE not in run.lists:
        return []
    h, data, metric = run.h, run.data, [f"R@{budget}"]
    merged = {s: merged_run([run.lists[s][b] for b in BRANCHES], budget)[0] for s in run.lists}
    alone = {b: alone_run(run.lists[BASELINE][b], budget) for b in BRANCHES}
    against = {}  # branch -> the merged list's claim row against it
    for b in BRANCHES:
        runs = {BASELINE: merged[BASELINE], f"{b} branch alone": alone[b]}
        against[b] = perquery_claims(h, runs, data, "unierf", "merged_vs_best_branch", *runs, metric)[0]
    best = max(BRANCHES, key=lambda b: against[b]["baseline_value"])
    rows = [against[best]]
    if budget in run.shares:  # the merge with the dev-chosen share, against the same branch
        runs = {DEV_QUOTAS: _dev_quota_run(run, budget), f"{best} branch alone": alone[best]}
        rows += perquery_claims(h, runs, data, "unierf", "merged_dev_quotas_vs_best_branch", *runs, metric)
    for s in JOINT:
        if s.name in merged and s.name != BASELINE:
            rows += perquery_claims(h, merged, data, "unierf", f"ablation_{s.key}", s.name, BASELINE, metric)
    return rows


def recall_at_budgets(run: UniERFRun) -> tuple[pd.DataFrame, dict[str, dict[int, float]]]:
    """R@B of every system's merged candidates (and of the branches alone, and BM25) for each B against the baseline's
    merged list (``pt.Experiment``); and each system's share of the merged B found by both branches."""
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
                if s == BASELINE and budget in run.shares:
                    runs[DEV_QUOTAS] = _dev_quota_run(run, budget)
            runs["BM25"] = run.bm25_runs[budget][["qid", "docno", "score", "rank"]]
            topics = run.topics[["qid", "query"]]
            exp = h.experiment(runs, topics, run.data.test_qrels, [f"R@{budget}"], baseline=f"{baseline}: merged")
            keep = ["name", f"R@{budget}"] + ([f"R@{budget} p-value"] if f"R@{budget} p-value" in exp else [])
            tables.append(exp[keep].set_index("name"))
    return pd.concat(tables, axis=1).reset_index(), shares


def overlap_table(run: UniERFRun, shares: dict[str, dict[int, float]]) -> pd.DataFrame:
    """Per system: the branches' mean Jaccard at B/2, the share of the merged B found by both, their mean cosine."""
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
    rows = []
    for name, i in info.items():
        row = {"system": name, "columns": " ".join(i["columns"]), "L_div": i["use_diversity"], "alpha": i["alpha"]}
        row["train_s"] = i["train_s"]
        for key in ("loss", "branch_cos"):
            row[f"{key}_first10"], row[f"{key}_last10"] = i[f"{key}_first_last_10"] or (np.nan, np.nan)
        rows.append({**row, "batch_fingerprint": i["batch_fingerprint"]})
    training = pd.DataFrame(rows)
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
        "identical_batches": (len(set(prints.values())) == 1) if len(info) == len(prints) > 1 else None,
        "frozen_tower": run.tower.stats if run.tower is not None else None,
        "dev_quotas": {str(b): v for b, v in run.shares.items()} or None,
        "alpha": run.alpha,
        "alpha_grid": run.alpha_grid or None,
        "training": info,
        **{
            k: f.astype(object).where(f.notna(), None).to_dict("records")
            for k, f in (("recall", results), ("overlap", overlap))
        },
    }
    summary["claims"] = claims(run)  # the claims file's rows, in the run's own JSON too
    md = _markdown(results, overlap, training, run.budgets, summary)
    title = "UniERF: merged recall at budget B, Table 2 ablation and branch overlap"
    tables = {"results": results, "overlap": overlap, "training": training}
    record_claims(cfg, summary["claims"])
    return {**tables, "summary": run.h.finish(title, md, tables, summary, run.data)}


def _markdown(
    results: pd.DataFrame, overlap: pd.DataFrame, training: pd.DataFrame, budgets: Sequence[int], summary: dict
) -> str:
    """The report: the main table (R@B with `*` marks, overlap of the merged systems), then the details."""
    names = results["name"].astype(str)
    merged = names.str.removesuffix(": merged").where(names.str.endswith(": merged"))
    main = overlap.set_index("system").reindex(merged)[[*(f"J@{b // 2}" for b in budgets), "cos(H_sem, H_trig)"]]
    for i, b in enumerate(budgets):
        main.insert(i, f"R@{b}", [measure_cell(r, f"R@{b}") for _, r in results.iterrows()])
    main.insert(0, "system", names.to_numpy())
    parts = [
        f"R@B: recall of the B merged candidates (equal quotas B/2, dedup, refill); `*`: p < 0.05, "
        f"{summary['significance']}. J@B/2: Jaccard of the two branches' top-B/2 lists, mean over queries; "
        f"cos: mean cosine of a query's two branch vectors. Document tower: {summary['doc_tower']}.",
        markdown_table(main, ".3f"),
        "Overlap (means over the test queries; both@B: share of the merged B found by both branches):",
        markdown_table(overlap, ".3f"),
    ]
    if summary.get("dev_quotas"):
        chosen = ", ".join(f"B = {b}: {v['trigger_share']}" for b, v in summary["dev_quotas"].items())
        n = next(iter(summary["dev_quotas"].values()))["dev_queries"]
        parts.insert(
            1,
            f"`{DEV_QUOTAS}`: the same lists merged with the trigger branch's share of B chosen on {n} dev queries "
            f"(R@B over the shares {', '.join(map(str, SHARES))}): {chosen}.",
        )
    if summary.get("alpha_grid"):
        cells = ", ".join(
            f"{a}: {v['dev_R@100']:.4f} (step {v['best_step']})" + (" **chosen**" if v["chosen"] else "")
            for a, v in summary["alpha_grid"].items()
        )
        parts.insert(
            1,
            f"alpha chosen on dev (`--alpha-grid`, merged R@100 at each model's best dev step): {cells}; the other "
            f"alphas' models are the rows '{BASELINE} at alpha A', with their test figures.",
        )
    if len(training):
        same = summary.get("identical_batches")
        same = "yes" if same else "no" if same is False else "not checked"
        parts.append(
            f"Training ({summary['training_rows']} rows; the same batches for every system: {same}; means of the "
            f"first/last 10 steps):\n\n{markdown_table(training, '.3f')}"
        )
    return "\n\n".join(parts) + "\n"


run = run_unierf_job  # what ``pyterrier-prob unierf`` runs
