"""The UniERF experiment (``pyterrier-prob unierf``): recall of the merged branch candidates at a total budget B,
the Table 2 ablation, and how much the branches' candidate sets overlap.

Jiang et al., *UniERF* (KDD'25, ``shared/papers/unierf.md``), adapted to text retrieval with two branches of one
query tower (Sec. 4.1): ``semantic`` reads the query; ``trigger`` reads the query and the text of its top BM25
document (:class:`~pyterrier_prob.TriggerText`, the stand-in for the paper's trigger items, for training and test
queries alike). Collections, training, indexing, BM25, ``pt.Experiment`` and the report come from
:mod:`pyterrier_prob.experiments.harness`. The protocol:

1. **training rows** (Sec. 4.3): one row per judged-relevant (query, document) pair of the train split, a seeded
   sample of 2 x steps x batch rows (:func:`~pyterrier_prob.unierf_training_data`): every branch's input text,
   the positive (Eq. 20), a shared random negative (Eq. 22) and a hard negative per branch -- ``semantic``: the
   30% tail of the query's BM25 top 100 (Eq. 24); ``trigger``: the 30% of that top 100 least similar to the
   trigger document (Eq. 25, cosine of the start model's vectors); in-batch negatives (Eq. 21) are implicit;
2. **systems**, every one built from the same start model (``--model``, default the packaged all-MiniLM-L6-v2
   with identity-initialised branch heads) and fine-tuned by :meth:`Harness.train
   <pyterrier_prob.experiments.harness.Harness.train>` (the sentence-transformers trainer) on the *same rows*
   with the same steps, batch size, learning rates (encoder ``--lr``, branch heads ``--head-lr``) and seed, by
   the terms of :class:`~st_extensions.losses.UniERFLoss` (L = L_pos + L_trip + L_Info + L_diversity, Eq. 28-32):

   * ``UniERF (all)`` -- (a): both branches jointly, all four terms, diversity truncated at alpha (``--alpha``,
     the paper's 0.6, Sec. 5.3.2) and the differentiated negatives;
   * ``w/o L_div`` -- (a1): without Eq. 31; ``w/o diff. negatives`` -- (a2): without the per-branch hard
     negatives (in-batch and the shared random negative only); ``w/o L_div / diff-sam`` -- (a3): both removed,
     the ablation row of the paper's Table 2;
   * with ``--ablations all`` also ``UniERF (all, low alpha)`` ((a) with alpha ``--low-alpha``: the branches'
     vectors of a query start at a cosine of about 0.55, below 0.6, where the truncated Eq. 31 is flat) and
     ``independent`` -- (c): two single-branch models, each trained alone on its own columns of the same rows;

   Every system reads the same six-column rows; the columns a system does not use are skipped by the loss
   (``UniERFLoss(ignore_columns=...)``), so the trainer's ``NO_DUPLICATES`` sampler, which looks at every column,
   draws the very same batches for every system (checked: ``summary.json``'s ``batch_fingerprints``);
3. **document tower** (``--doc-tower``): ``frozen`` (default): the documents keep the start model's embeddings --
   one :class:`~pyterrier_prob.DenseIndex` for every system -- and only the query tower (the encoder on the
   query and trigger texts, and the branch heads) is fine-tuned: the loss embeds the positives and negatives with
   a :class:`~st_extensions.losses.unierf.FrozenDocumentTower` (no gradient), primed with that index's vectors;
   ``joint``: the encoder is fine-tuned on documents too and every trained model indexes the test corpus again;
4. **test** (the test split; nothing is tuned on dev): per system, each branch's top-B list (cosine), merged
   into B candidates with equal quotas B/2, deduplicated and refilled (:func:`~pyterrier_prob.branch_quotas`,
   :func:`~pyterrier_prob.merge_branch_lists`, the merge of :class:`~pyterrier_prob.MultiBranchRetriever`);
   recall R@B of the merged set for every B of ``--budgets`` in ``pt.Experiment`` with paired t-tests against
   ``UniERF (all): merged``; (b) each branch of (a), of (c) and of the start model alone, given the whole budget;
   the start model (``untrained``) and BM25 as references;
5. **overlap**: per query the Jaccard index of the two branches' top-B/2 lists (each branch's quota), the share
   of the merged B found by both branches, and the mean cosine cos(H_sem, H_trig) of a query's two branch
   vectors (what Eq. 31 acts on), averaged over the test queries.

With no train split (or ``--steps 0``) nothing is fine-tuned: the start model (``--model``; a saved UniERF model
keeps its heads) is evaluated as it is, against BM25. ``--test-dataset`` trains on ``--dataset`` and tests on
another collection (zero-shot transfer; the frozen document tower is then the start model's index of the test
collection).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pyterrier_prob.experiments.harness import (
    CommonConfig,
    Data,
    Harness,
    add_common_arguments,
    common_from_args,
    markdown_table,
    p_mark,
)

__all__ = [
    "DESCRIPTION",
    "UniERFJobConfig",
    "add_arguments",
    "config_from_args",
    "run",
    "run_unierf_job",
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
    """Settings of :func:`run_unierf_job` (the ``pyterrier-prob unierf`` options); the shared ones are
    :class:`~pyterrier_prob.experiments.harness.CommonConfig`'s.

    Attributes:
        head_lr: learning rate of the branch heads (new parameters; the encoder trains at ``lr``); None: the rate
            ``MultiBranchQueryEncoder.learning_rate`` declares.
        alpha: truncation alpha of the diversity loss (Eq. 31; the paper's 0.6, Sec. 5.3.2).
        low_alpha: alpha of the ``UniERF (all, low alpha)`` system.
        budgets: the total budgets B (each branch's quota is B/2).
        ablations: ``none`` (UniERF (all) only), ``table2`` ((a) and the three ablations of Table 2) or ``all``
            (also low alpha and (c) the independently trained branches).
        doc_tower: ``frozen`` (documents keep the start model's embeddings, one index) or ``joint`` (the encoder is
            fine-tuned on documents too; one index per trained model).
    """

    output: str = "outputs/unierf"
    head_lr: float | None = None
    alpha: float = 0.6
    low_alpha: float = 0.3
    budgets: Sequence[int] = (100, 300)
    ablations: str = "table2"
    doc_tower: str = "frozen"
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
    d = UniERFJobConfig()
    add_common_arguments(ap, d)
    g = ap.add_argument_group("UniERF")
    g.add_argument(
        "--head-lr",
        type=float,
        default=d.head_lr,
        help="learning rate of the branch heads (default: the rate MultiBranchQueryEncoder declares)",
    )
    g.add_argument("--alpha", type=float, default=d.alpha, help="truncation alpha of the diversity loss (Eq. 31)")
    g.add_argument("--low-alpha", type=float, default=d.low_alpha, help="alpha of 'UniERF (all, low alpha)'")
    g.add_argument("--budgets", type=int, nargs="+", default=list(d.budgets), help="total budgets B (R@B)")
    g.add_argument(
        "--ablations",
        choices=list(ABLATIONS),
        default=d.ablations,
        help="trained systems: none: UniERF (all); table2: + w/o L_div, w/o diff. negatives, w/o both (Table 2); "
        "all: + low alpha and (c) independently trained branches",
    )
    g.add_argument(
        "--doc-tower",
        choices=["frozen", "joint"],
        default=d.doc_tower,
        help="frozen: documents keep the start model's embeddings (one index, only the query tower trains); "
        "joint: the encoder also trains on the documents and every trained model re-indexes (~4x the time)",
    )


def config_from_args(a: argparse.Namespace) -> UniERFJobConfig:
    return UniERFJobConfig(
        **common_from_args(a),
        head_lr=a.head_lr,
        alpha=a.alpha,
        low_alpha=a.low_alpha,
        budgets=tuple(a.budgets),
        ablations=a.ablations,
        doc_tower=a.doc_tower,
    )


def run(cfg: UniERFJobConfig) -> dict[str, Any]:
    return run_unierf_job(cfg)


# --------------------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------------------


def _with_triggers(
    h: Harness, index: Any, coll: Any, topics: pd.DataFrame, texts: dict[str, str] | None = None
) -> pd.DataFrame:
    """``topics`` (``qid, query``) + ``trigger_docno``, ``trigger_text``: the top BM25 document of each query."""
    from pyterrier_prob.unierf.branches import TriggerText

    topics = topics[["qid", "query"]].reset_index(drop=True)
    bm25 = h.bm25_retriever(index, 1)
    if texts is None:
        texts = coll.doc_texts(set(bm25(topics)["docno"].astype(str)))
    return TriggerText(bm25, texts)(topics)


def _training_rows(
    cfg: UniERFJobConfig, h: Harness, data: Data, bm25_index: Any, dense_index: Any
) -> tuple[Any, dict[str, str]]:
    """The UniERF training rows of the train split (all six columns) and the train corpus' texts."""
    from pyterrier_prob.unierf.branches import unierf_training_data

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
    from st_extensions.losses.unierf import FrozenDocumentTower

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
    from st_extensions import default_model_path, load_model

    return load_model(cfg.model or default_model_path(), device="cpu")


def _is_unierf(model: Any) -> bool:
    from st_extensions.modules.branches import MultiBranchQueryEncoder

    return any(isinstance(m, MultiBranchQueryEncoder) for m in model.modules())


def _start_model(cfg: UniERFJobConfig) -> Any:
    """The two-branch start model: ``--model`` as it is when it is a UniERF model with both branches, else the
    model (default: the packaged MiniLM) with identity-initialised semantic and trigger heads (``given_heads``
    says which)."""
    from st_extensions import build_unierf_model
    from st_extensions.unierf import find_branches

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
    from sentence_transformers import SentenceTransformer

    from st_extensions import build_unierf_model
    from st_extensions.modules.branches import MultiBranchQueryEncoder

    model = _load(cfg)
    if _is_unierf(model):
        model = SentenceTransformer(modules=[m for m in model if not isinstance(m, MultiBranchQueryEncoder)])
    return build_unierf_model(model, branches=(branch,), seed=cfg.seed, device="cpu")


def _recording_loss(tower: Any, columns: Sequence[str], ignore: Sequence[str], **kwargs: Any) -> Callable[[Any], Any]:
    """A factory of :class:`~st_extensions.losses.UniERFLoss` that also records, per step, a fingerprint of the
    batch (its anchor and positive token ids: equal fingerprints, identical batches), the mean cosine of a row's two
    branch embeddings, the share of rows above alpha (the rows Eq. 31 acts on) and the diversity term."""
    from st_extensions.losses import UniERFLoss
    from st_extensions.losses.unierf import FrozenDocumentTower

    marks = [columns.index(c) for c in ("anchor_semantic", "positive_doc")]

    class Recorded(UniERFLoss):
        def forward(self, sentence_features, labels=None):
            features = list(sentence_features)
            for i in marks:
                for key in FrozenDocumentTower.row_keys(features[i]):
                    self.digest.update(key + b"|")
            return super().forward(features, labels)

        def terms_from_embeddings(self, branch_emb, positives, negatives, tags, labels=None):
            terms = super().terms_from_embeddings(branch_emb, positives, negatives, tags, labels=labels)
            if len(branch_emb) == 2:
                h1, h2 = (e.detach() for e in branch_emb.values())
                cos = (h1 * h2).sum(-1)
                self.stats["branch_cos"].append(float(cos.mean()))
                self.stats["share_above_alpha"].append(float((cos > self.diversity_threshold).float().mean()))
                self.stats["diversity_term"].append(float(terms["diversity"].detach()))
            return terms

    def build(model: Any) -> Any:
        loss = Recorded(model, columns=list(columns), ignore_columns=list(ignore), document_tower=tower, **kwargs)
        loss.digest = hashlib.sha1()
        loss.stats = {"branch_cos": [], "share_above_alpha": [], "diversity_term": []}
        build.loss = loss
        return loss

    build.loss = None
    return build


def _mean_ends(values: Sequence[float], n: int = 10) -> tuple[float, float] | None:
    """Means of the first and last ``n`` values (None for none)."""
    if not values:
        return None
    k = min(n, len(values))
    return float(np.mean(values[:k])), float(np.mean(values[-k:]))


# --------------------------------------------------------------------------------------------------------------
# branch lists, merging, overlap
# --------------------------------------------------------------------------------------------------------------

BranchLists = dict[str, tuple[np.ndarray, np.ndarray]]


def branch_lists(frame: pd.DataFrame, index: Any, branch: str, k: int) -> BranchLists:
    """qid -> (docnos, scores) of branch ``branch``'s top-``k`` cosine search, best first."""
    from pyterrier_prob.pebr.cutoff import TopKRetriever

    col = f"query_vec_{branch}"
    queries = frame[["qid", col]].rename(columns={col: "query_vec"})
    res = TopKRetriever(index, num_results=k)(queries).sort_values(["qid", "rank"], kind="stable")
    return {
        str(q): (g["docno"].astype(str).to_numpy(), g["score"].to_numpy(np.float64))
        for q, g in res.groupby("qid", sort=False)
    }


def alone_run(lists: BranchLists, budget: int) -> pd.DataFrame:
    """One branch's top-``budget`` as a run (the branch given the whole budget)."""
    rows = [
        (q, d, float(s), r) for q, (ds, ss) in lists.items() for r, (d, s) in enumerate(zip(ds[:budget], ss[:budget]))
    ]
    return pd.DataFrame(rows, columns=["qid", "docno", "score", "rank"])


def merged_run(per_branch: Sequence[BranchLists], budget: int) -> tuple[pd.DataFrame, float]:
    """The branches' lists merged into ``budget`` documents with equal quotas (dedup, refill:
    :func:`~pyterrier_prob.merge_branch_lists`, as :class:`~pyterrier_prob.MultiBranchRetriever` merges), and the
    mean share of the merged set that more than one branch found."""
    from pyterrier_prob.unierf.branches import branch_quotas, merge_branch_lists

    quotas = branch_quotas(budget, [1.0] * len(per_branch))
    empty = (np.empty(0, dtype=object), np.empty(0))
    qids = list(dict.fromkeys(q for b in per_branch for q in b))
    rows, shared = [], []
    for qid in qids:
        lists = [(b.get(qid, empty)[0][:budget], b.get(qid, empty)[1][:budget]) for b in per_branch]
        merged = sorted(merge_branch_lists(lists, budget, quotas), key=lambda m: (-m[1], str(m[0])))
        rows += [(qid, d, s, r) for r, (d, s, _, _) in enumerate(merged)]
        shared.append(np.mean([len(m[2]) > 1 for m in merged]) if merged else 0.0)
    run = pd.DataFrame(rows, columns=["qid", "docno", "score", "rank"])
    return run, float(np.mean(shared)) if shared else float("nan")


def mean_jaccard(a: BranchLists, b: BranchLists, k: int) -> float:
    """Mean over queries of the Jaccard index of the two branches' top-``k`` sets."""
    vals = []
    for qid in set(a) | set(b):
        x = set(a[qid][0][:k].tolist()) if qid in a else set()
        y = set(b[qid][0][:k].tolist()) if qid in b else set()
        if x | y:
            vals.append(len(x & y) / len(x | y))
    return float(np.mean(vals)) if vals else float("nan")


# --------------------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------------------


def run_unierf_job(cfg: UniERFJobConfig) -> dict[str, Any]:
    """Run the UniERF experiment (module docstring) and write its outputs to ``cfg.output``.

    Writes ``results.csv`` (R@B and p-values of every run), ``overlap.csv``, ``training.csv``, ``summary.json`` and
    ``results.md``; models under ``models/``, indexes under ``indexes/``.

    Returns:
        ``{"results": frame, "overlap": frame, "training": frame, "summary": dict}``.
    """
    from pyterrier_prob.training import text_columns
    from pyterrier_prob.unierf.branches import UniERFEncoder
    from st_extensions.judged import JudgedPairs, pair_labels
    from st_extensions.unierf import POSITIVE_COLUMN, anchor_column, negative_column

    cfg.check()
    h = Harness("unierf", cfg)
    data = h.load_data(calibrate=False)  # nothing is calibrated: every test query is reported
    if data.dev is not None:
        data.notes.append(f"the dev split ({data.cal_source}) is not used: UniERF calibrates nothing")
    train_coll, test_coll = data.train_collection, data.test_collection
    same = train_coll is test_coll
    wanted = ABLATIONS[cfg.ablations] if data.train else ()
    budgets = sorted(int(b) for b in cfg.budgets)
    kmax = max(budgets)

    # ---- the start model, its index, BM25, the test queries' triggers --------------------------------------------
    start, _ = h.train("untrained", lambda: _start_model(cfg), None, None)
    start_name = "given model" if start.given_heads else "untrained"
    encoder = UniERFEncoder(h.encoding_model(start), batch_size=64)
    test_index = h.dense_index("untrained", encoder, test_coll)
    test_bm25 = h.bm25(test_coll)
    with h.stage("triggers", f"finding the trigger documents (top BM25) of the {len(data.test_topics)} test queries"):
        topics = _with_triggers(h, test_bm25, test_coll, data.test_topics)
        bm25_runs = {b: h.bm25_run(test_bm25, topics[["qid", "query"]], b) for b in budgets}
    qrels = data.test_qrels

    lists: dict[str, dict[str, BranchLists]] = {}  # system -> branch -> qid -> (docnos, scores)
    cosines: dict[str, float | None] = {}

    def system_lists(name: str, frames: dict[str, pd.DataFrame], indexes: dict[str, Any]) -> None:
        """``frames[b]``: test queries with ``query_vec_<b>``; ``indexes[b]``: the index branch b searches."""
        lists[name] = {b: branch_lists(frames[b], indexes[b], b, kmax) for b in BRANCHES}
        sem, trig = (np.stack(frames[b][f"query_vec_{b}"].to_list()) for b in BRANCHES)
        same_space = indexes["semantic"] is indexes["trigger"]
        cosines[name] = float(np.mean(np.sum(sem * trig, axis=1))) if same_space else None

    def query_vectors(model: Any) -> pd.DataFrame:
        return UniERFEncoder(h.encoding_model(model), batch_size=64).query_encoder()(topics)

    with h.stage("retrieve_untrained", f"retrieving with the {start_name} model's branches"):
        q = query_vectors(start)
        system_lists(start_name, {b: q for b in BRANCHES}, {b: test_index for b in BRANCHES})

    # ---- training ------------------------------------------------------------------------------------------------
    info: dict[str, dict[str, Any]] = {}
    rows = tower = judged = None
    if wanted:
        train_bm25 = test_bm25 if same else h.bm25(train_coll)
        train_index = test_index if same else h.dense_index("untrained", encoder, train_coll)
        rows, doc_texts = _training_rows(cfg, h, data, train_bm25, train_index)
        # judged negatives: rows hold every judged-relevant pair unless max_examples cut them
        anchors, positives = rows[anchor_column(BRANCHES[0])], rows[POSITIVE_COLUMN]
        judged = JudgedPairs(zip(anchors, positives))
        rows = rows.add_column("label", pair_labels(anchors, positives))
        if cfg.doc_tower == "frozen" and cfg.recipe != "frozen":  # the frozen recipe freezes the whole encoder
            with h.stage("frozen_tower", "priming the frozen document tower with the start model's index"):
                tower = _frozen_tower(start, rows, doc_texts, train_index)
        del doc_texts
    del start, encoder
    gc.collect()
    columns = text_columns(rows) if rows is not None else []
    train_desc = f"{train_coll.name}/{data.train}"

    def train(
        slug: str,
        name: str,
        build: Callable[[], Any],
        branches: Sequence[str],
        ignore: list[str],
        diversity: bool,
        alpha: float,
    ) -> Any:
        loss = _recording_loss(
            tower, columns, ignore, use_diversity=diversity, diversity_threshold=alpha, judged=judged
        )
        settings = {
            "train": train_desc,
            "branches": list(branches),
            "columns": [c for c in columns if c not in ignore],
            "use_diversity": diversity,
            "alpha": alpha,
            "head_lr": cfg.head_lr,
            "doc_tower": cfg.doc_tower,
            "rows": len(rows),
        }
        model, losses = h.train(
            slug,
            build,
            loss,
            lambda: rows,
            learning_rate_mapping={HEAD_PARAMS: cfg.head_lr} if cfg.head_lr is not None else None,
            settings=settings,
        )
        rec = loss.loss
        stats = rec.stats if rec is not None else {}
        info[name] = {
            "model": h.path("models", slug),
            "columns": settings["columns"],
            "use_diversity": diversity if len(branches) > 1 else None,
            "alpha": alpha if len(branches) > 1 else None,
            "reused": rec is None,
            "train_s": h.timings.get(f"train_{slug}"),
            "loss_first_last_10": _mean_ends(losses),
            "branch_cos_first_last_10": _mean_ends(stats.get("branch_cos", [])),
            "share_above_alpha_first_last_10": _mean_ends(stats.get("share_above_alpha", [])),
            "diversity_term_first_last_10": _mean_ends(stats.get("diversity_term", [])),
            "batch_fingerprint": rec.digest.hexdigest()[:16] if rec is not None else None,
        }
        return model

    def index_of(slug: str, model: Any) -> Any:
        if cfg.doc_tower == "frozen" or cfg.recipe == "frozen":
            return test_index
        return h.dense_index(slug, UniERFEncoder(h.encoding_model(model), batch_size=64), test_coll)

    hard_cols = [negative_column(b) for b in BRANCHES]
    for s in (s for s in JOINT if s.key in wanted):
        alpha = cfg.low_alpha if s.low_alpha else cfg.alpha
        model = train(
            f"unierf-{s.key}",
            s.name,
            lambda: _start_model(cfg),
            BRANCHES,
            [] if s.hard_negatives else hard_cols,
            s.diversity,
            alpha,
        )
        index = index_of(f"unierf-{s.key}", model)
        with h.stage(f"retrieve_{s.key}", f"retrieving with {s.name}'s branches"):
            q = query_vectors(model)
            system_lists(s.name, {b: q for b in BRANCHES}, {b: index for b in BRANCHES})
        del model
        gc.collect()
    if INDEPENDENT in wanted:
        frames, indexes = {}, {}
        for b in BRANCHES:
            other = [o for o in BRANCHES if o != b]
            ignore = [c for o in other for c in (anchor_column(o), negative_column(o))]
            model = train(
                f"independent-{b}",
                f"{INDEPENDENT} {b}",
                lambda b=b: _single_branch_model(cfg, b),
                (b,),
                ignore,
                False,
                cfg.alpha,
            )
            indexes[b] = index_of(f"independent-{b}", model)
            with h.stage(f"retrieve_independent_{b}", f"retrieving with the independent {b} model"):
                frames[b] = query_vectors(model)
            del model
            gc.collect()
        system_lists(INDEPENDENT, frames, indexes)

    # ---- recall at B ---------------------------------------------------------------------------------------------
    trained = [s for s in lists if s != start_name]
    baseline = BASELINE if BASELINE in trained else start_name
    order = [baseline] + [s for s in [*trained, start_name] if s != baseline]
    alone = {BASELINE, INDEPENDENT, start_name}
    shares: dict[str, dict[int, float]] = {s: {} for s in lists}
    tables = []
    with h.stage("test", f"R@B of the merged candidates on {test_coll.name}/{data.test} (pt.Experiment per B)"):
        for budget in h.progress(budgets, "scoring", unit="B"):
            runs: dict[str, pd.DataFrame] = {}
            for s in order:
                runs[f"{s}: merged"], shares[s][budget] = merged_run([lists[s][b] for b in BRANCHES], budget)
                if s in alone:
                    for b in BRANCHES:
                        runs[f"{s}: {b} branch alone"] = alone_run(lists[s][b], budget)
            runs["BM25"] = bm25_runs[budget][["qid", "docno", "score", "rank"]]
            exp = h.experiment(runs, topics[["qid", "query"]], qrels, [f"R@{budget}"], baseline=f"{baseline}: merged")
            keep = ["name", f"R@{budget}"] + ([f"R@{budget} p-value"] if f"R@{budget} p-value" in exp else [])
            tables.append(exp[keep].set_index("name"))
    results = pd.concat(tables, axis=1).reset_index()

    # ---- overlap -------------------------------------------------------------------------------------------------
    overlap_rows = []
    for s in order:
        row: dict[str, Any] = {"system": s}
        for budget in budgets:
            row[f"J@{budget // 2}"] = mean_jaccard(lists[s]["semantic"], lists[s]["trigger"], budget // 2)
            row[f"both@{budget}"] = shares[s][budget]
        row["cos(H_sem, H_trig)"] = cosines[s] if cosines[s] is not None else float("nan")
        overlap_rows.append(row)
    overlap = pd.DataFrame(overlap_rows)

    training = pd.DataFrame(
        [
            {
                "system": name,
                "columns": " ".join(i["columns"]),
                "L_div": i["use_diversity"],
                "alpha": i["alpha"],
                "train_s": i["train_s"],
                "loss_first10": (i["loss_first_last_10"] or (np.nan, np.nan))[0],
                "loss_last10": (i["loss_first_last_10"] or (np.nan, np.nan))[1],
                "branch_cos_first10": (i["branch_cos_first_last_10"] or (np.nan, np.nan))[0],
                "branch_cos_last10": (i["branch_cos_first_last_10"] or (np.nan, np.nan))[1],
                "batch_fingerprint": i["batch_fingerprint"],
            }
            for name, i in info.items()
        ]
    )
    prints = {n: i["batch_fingerprint"] for n, i in info.items() if i["batch_fingerprint"]}
    summary: dict[str, Any] = {
        "branches": {"semantic": "query", "trigger": "query [SEP] text of the top BM25 document"},
        "systems": list(lists),
        "trained": list(info),
        "significance": f"paired t-test against {baseline + ': merged'!r} (pt.Experiment / scipy.stats.ttest_rel)",
        "merge": "equal quotas B/2, dedup, refill (branch_quotas + merge_branch_lists, as MultiBranchRetriever)",
        "doc_tower": cfg.doc_tower,
        "hard_negatives": f"semantic: {HARD_TAIL:.0%} tail of the BM25 top {HARD_DEPTH}; trigger: the "
        f"{HARD_TAIL:.0%} of the BM25 top {HARD_DEPTH} least similar to the trigger document (start model's "
        "vectors); relevant documents excluded",
        "training_rows": len(rows) if rows is not None else 0,
        "training_columns": columns,
        "batch_fingerprints": prints,
        "identical_batches": (len(set(prints.values())) == 1) if len(prints) > 1 else None,
        "frozen_tower": tower.stats if tower is not None else None,
        "training": info,
        "recall": _json_records(results),
        "overlap": _json_records(overlap),
    }
    md = _markdown(results, overlap, training, budgets, baseline, start_name, summary)
    summary = h.finish(
        "UniERF: merged recall at budget B, Table 2 ablation and branch overlap",
        md,
        {"results": results, "overlap": overlap, "training": training},
        summary,
        data,
    )
    cfg.timings.update(h.timings)
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
    baseline: str,
    start_name: str,
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
            cells.append(f"{r[f'R@{b}']:.4f}{p_mark(r.get(f'R@{b} p-value', np.nan))}")
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
