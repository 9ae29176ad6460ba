"""The data and training stages of ``pyterrier-prob varce`` (:mod:`pyterrier_prob.experiments.varce`): the evaluated
collections and their BM25 candidates, the training rows, and the CE and VarCE re-rankers fine-tuned with the same
rows, steps and seed under the run's :class:`~pyterrier_prob.training.Recipe` (docs/varce.md, "The experiment")."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import pandas as pd
import torch
from datasets import Dataset
from sentence_transformers import CrossEncoder, SentenceTransformer
from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss
from transformers.utils import logging as hf_logging

from pyterrier_prob import ProbBiEncoder
from pyterrier_prob.collections import choose_splits, load_collection
from pyterrier_prob.console import library_bars
from pyterrier_prob.curves import DevCurve
from pyterrier_prob.experiments.harness import Data, Harness
from pyterrier_prob.experiments.output import read_if_present
from pyterrier_prob.experiments.varce_config import VarceJobConfig, dev_every
from pyterrier_prob.training import read_json
from pyterrier_prob.varce.analysis import DevRerank
from pyterrier_prob.varce.data import cross_encoder_training_data, evaluated_queries, groups_for
from st_extensions import default_model_path, load_model
from st_extensions.cross_encoder import VarCrossEncoder, VariationalHead, build_var_cross_encoder
from st_extensions.cross_encoder.frozen import CachedPairFeatures, build_cross_encoder
from st_extensions.losses import VariationalBCELoss

__all__ = [
    "CE_HEAD_PARAMETERS",
    "Target",
    "Trained",
    "dev_evaluator",
    "dev_target",
    "folder_fingerprint",
    "recipe_summary",
    "score_fingerprint",
    "settings_fingerprint",
    "target_stage",
    "train_stage",
]

BASELINE = "CE"
VARIANTS = ("MEANVAR", "VAR")
#: The parameters of the CE's linear ranker (``build_cross_encoder``'s ``Dense``) as the trainer names them.
CE_HEAD_PARAMETERS = r"^model\.\d+\.linear\.(weight|bias)$"

#: The rate of every head: the VarCE head's declared one (the CE's linear ranker alike, as a new head should).
HEAD_RATE = float(VariationalHead.learning_rate)
#: Most training groups (1 relevant + ``negatives`` rows each) under the frozen recipe: about one round over
#: nfcorpus/train's queries; each pair is encoded once, and the heads then train over them for several epochs.
FROZEN_GROUPS = 2000


@dataclass
class Trained:
    """The re-rankers of a run and what their training did."""

    models: dict[str, Any]
    kind: str
    fine_tuned: bool = False
    losses: dict[str, list[float]] = field(default_factory=dict)
    rows_info: dict[str, Any] | None = None
    features: CachedPairFeatures | None = None  # the frozen recipe's [CLS] features, shared by every head
    curves: dict[str, Any] = field(default_factory=dict)


def train_stage(cfg: VarceJobConfig, h: Harness, data: Data) -> Trained:
    """The re-rankers: CE and the two VarCEs fine-tuned from ``--model`` with the same rows, steps and seed (the frozen
    recipe on one cache of backbone features; a dev curve per model otherwise), or ``--model`` as it is."""
    kind, given = _given_model(cfg.model)
    if data.train and kind == "var":
        raise ValueError(
            f"--model {cfg.model} is a saved VarCrossEncoder: evaluate it with --steps 0 (or on a collection without "
            "a train split), or pass its backbone to fine-tune the three re-rankers"
        )
    if data.train is None and kind in ("var", "cross"):
        name = f"VarCE-{given.head.variant}" if kind == "var" else BASELINE
        model, _ = h.train(name, lambda: given, None, None)
        data.notes.append(f"{name}: {cfg.model} evaluated as given (no fine-tuning)")
        return Trained({name: model}, kind)
    base = cfg.model or default_model_path()
    frozen = h.recipe.caches_features
    out = Trained({}, kind, fine_tuned=data.train is not None)
    out.features = CachedPairFeatures([], torch.zeros(0)) if frozen else None  # filled as pairs come
    rows = _TrainingRows(cfg, h, data, base) if data.train else None
    settings = {"train": f"{data.train_collection.name}/{data.train}", "negatives": cfg.negatives}
    settings |= {"pool_depth": cfg.pool_depth, "negatives_from": list(cfg.negatives_from)}
    settings |= {"positive_depth": cfg.positive_depth} if cfg.positive_depth is not None else {}
    evaluate = dev_evaluator(cfg, h, data) if rows is not None and not frozen else None
    if evaluate is not None:
        settings.update(dev_queries=cfg.dev_queries, dev_depth=cfg.dev_depth, dev_every=dev_every(cfg))
        settings |= {"patience": cfg.patience} if cfg.patience is not None else {}
    elif rows is not None and data.dev is not None and cfg.dev_queries:
        data.notes.append("no learning curve under the frozen recipe: each head is the one of its last step")
    for variant in (None, *VARIANTS):
        name = BASELINE if variant is None else f"VarCE-{variant}"
        curve_path = h.path("curves", f"{name}.json")
        curve = None if evaluate is None else DevCurve(dev_every(cfg), evaluate, curve_path, patience=cfg.patience)
        callbacks = [] if curve is None else [curve]
        if variant is None:  # the CE's new linear ranker trains at the rate the VarCE heads declare
            loss, rates, own = BinaryCrossEntropyLoss, {CE_HEAD_PARAMETERS: HEAD_RATE}, settings
        else:
            loss, rates = partial(VariationalBCELoss, beta=cfg.beta, num_samples=1), None
            own = {**settings, "variant": variant, "beta": cfg.beta, "num_samples": 1}
        build = partial(_build, base, variant, cfg.max_seq_length, cfg.seed)
        kw = {"learning_rate_mapping": rates, "settings": own, "callbacks": callbacks, "encoder_cache": out.features}
        out.models[name], out.losses[name] = h.train(name, build, loss, rows, **kw)
        if out.rows_info is None:  # what the rows' making reported: this run's, or what a reused model's training saved
            out.rows_info = h.rows_info.get(name)
        # the curve of a reused model is the one its training wrote; none from an earlier run without a curve
        if curve is not None and name in h.recipes and os.path.isfile(curve_path):
            out.curves[name] = read_json(curve_path)
    if rows is None:
        data.notes.append(
            f"nothing fine-tuned: the three re-rankers are {base} with untrained (seeded) heads, so their scores "
            "carry no relevance signal; pass a trained CrossEncoder or VarCrossEncoder with --model"
        )
    return out


def _build(base: str, variant: str | None, max_seq_length: int, seed: int) -> CrossEncoder:
    """CE (``variant`` None: [CLS] -> a linear ranker) or a VarCE, seeded."""
    torch.manual_seed(seed)
    if variant is None:
        return build_cross_encoder(base, max_seq_length=max_seq_length, device="cpu")
    return build_var_cross_encoder(base, variant=variant, max_seq_length=max_seq_length, device="cpu")


class _TrainingRows:
    """The training rows (``Harness.train``'s ``data``), built on first use (a reused model needs none)."""

    def __init__(self, cfg: VarceJobConfig, h: Harness, data: Data, base: str) -> None:
        self.cfg, self.h, self.data, self.base = cfg, h, data, base
        self.rows: Dataset | None = None
        self.info: dict[str, Any] | None = None

    def __call__(self) -> Dataset:
        if self.rows is None:
            cfg, coll = self.cfg, self.data.train_collection
            stages = _negative_sources(cfg, self.h, coll, self.base)
            groups = groups_for(cfg.steps, cfg.batch_size, cfg.negatives)
            groups = min(groups, FROZEN_GROUPS) if self.h.recipe.caches_features else groups
            mining = {"negatives": cfg.negatives, "pool_depth": cfg.pool_depth, "positive_depth": cfg.positive_depth}
            what = f"{coll.name}/{self.data.train} (1 relevant : {cfg.negatives} negatives from {' and '.join(stages)})"
            with self.h.stage("training_rows", f"building the training rows from {what}"):
                self.rows, self.info = cross_encoder_training_data(
                    coll, self.data.train, stages, n_groups=groups, seed=cfg.seed, **mining
                )
        return self.rows


def _negative_sources(cfg: VarceJobConfig, h: Harness, coll: Any, base: str) -> dict[str, Any]:
    """The first stages the training negatives are mined from (``--negatives-from``): BM25 and the untrained model."""
    stages: dict[str, Any] = {}
    k = max(cfg.pool_depth, cfg.positive_depth or 0)  # the negatives come from the top pool_depth of these
    if "bm25" in cfg.negatives_from:
        stages["BM25"] = h.bm25_retriever(h.bm25(coll), k)
    if "dense" in cfg.negatives_from:
        with _quiet_transformers():
            start, _ = h.train("dense-untrained", partial(SentenceTransformer, base, device="cpu"), None, None)
        encoder = ProbBiEncoder(start, batch_size=64, verbose=False)
        dense = h.dense_index("dense-untrained", encoder, coll)
        dense.verbose = library_bars()  # pyterrier-dr's inner "NumpyRetriever scoring" bar (not at default verbosity)
        stages["dense"] = encoder.query_encoder() >> dense.np_retriever(num_results=k)
    return stages


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' and sentence-transformers' warnings off for the duration (the load report of a new head)."""
    level, st_logger = hf_logging.get_verbosity(), logging.getLogger("sentence_transformers")
    st_level = st_logger.level
    hf_logging.set_verbosity_error()
    st_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        st_logger.setLevel(st_level)


def dev_evaluator(cfg: VarceJobConfig, h: Harness, data: Data) -> DevRerank | None:
    """``model -> dev nDCG@10`` of ``--dev-queries`` seeded dev queries (None without: test is never used)."""
    if not cfg.dev_queries or data.dev is None or data.cal_topics.empty:
        if cfg.dev_queries:
            data.notes.append("no dev split: no learning curve; each re-ranker is the one of its last step")
        return None
    target = dev_target(cfg, h, data, cfg.dev_depth)
    data.notes.append(
        f"learning curves: dev nDCG@10 of {len(target.topics)} {target.label} queries (BM25 top {cfg.dev_depth} "
        f"re-ranked) every {dev_every(cfg)} steps; each re-ranker is the one at its best dev point"
    )
    cand = target.candidates(h, target.topics, cfg.dev_depth)
    return DevRerank(cand, target.qrels, qids=target.topics["qid"], batch_size=cfg.inference_batch_size)


def _given_model(spec: str | None) -> tuple[str, Any]:
    """What ``--model`` is: ``("var"|"cross", model)`` a saved (Var)CrossEncoder, else ``("backbone", None)``."""
    if spec is None or not os.path.isdir(spec):
        return "backbone", None
    if not os.path.isfile(os.path.join(spec, "modules.json")):
        archs = (read_if_present(os.path.join(spec, "config.json")) or {}).get("architectures") or []
        if any(a.endswith("ForSequenceClassification") for a in archs):
            return "cross", CrossEncoder(spec, device="cpu")
        return "backbone", None
    model = load_model(spec, device="cpu")
    kind = "var" if isinstance(model, VarCrossEncoder) else "cross" if isinstance(model, CrossEncoder) else "backbone"
    return kind, model if kind != "backbone" else None


@dataclass
class Target:
    """One evaluated collection: its BM25 index, queries, qrels, depth and document texts."""

    label: str
    collection: Any
    split: str
    index: Any
    topics: pd.DataFrame
    qrels: pd.DataFrame
    depth: int
    available: int
    texts: dict[str, str] = field(default_factory=dict)

    def candidates(self, h: Harness, topics: pd.DataFrame, depth: int) -> pd.DataFrame:
        """BM25's top ``depth`` of ``topics``: ``qid, docno, score, rank, query, text``."""
        res = h.bm25_run(self.index, topics[["qid", "query"]], depth)[["qid", "docno", "score", "rank"]]
        res = res.merge(topics[["qid", "query"]], on="qid").sort_values(["qid", "rank"]).reset_index(drop=True)
        missing = set(res["docno"]) - set(self.texts)
        if missing:
            self.texts.update(self.collection.doc_texts(missing))
        return res.assign(text=res["docno"].map(self.texts))


def dev_target(cfg: VarceJobConfig, h: Harness, data: Data, depth: int) -> Target:
    coll = data.train_collection
    topics, qrels, n = evaluated_queries(data.cal_topics, data.cal_qrels, cfg.dev_queries, cfg.seed)
    return Target(f"{coll.name}/{data.dev}", coll, data.dev, h.bm25(coll), topics, qrels, depth, n)


def target_stage(cfg: VarceJobConfig, h: Harness, data: Data) -> list[Target]:
    """The evaluated collections: the test split (queries with a judged-relevant document, ``--max-queries``) and
    each ``--ood`` collection (zero-shot, ``--ood-queries`` at ``--ood-depth``)."""
    topics, qrels, available = evaluated_queries(data.test_topics, data.test_qrels, cfg.max_queries, cfg.seed)
    if topics.empty:
        raise ValueError(f"{data.test_collection.name}/{data.test} has no query with a judged-relevant document")
    if len(topics) < available:
        data.notes.append(f"a seeded sample of {len(topics)} of the {available} test queries (--max-queries)")
    if len(data.test_topics) > available:
        data.notes.append(f"{len(data.test_topics) - available} test queries without a judged-relevant document are "
                          "not evaluated")  # fmt: skip
    coll = data.test_collection
    data.test_topics, data.test_qrels = topics, qrels
    targets = [Target(coll.name, coll, data.test, h.bm25(coll), topics, qrels, cfg.depth, available)]
    for spec in cfg.ood:
        with h.stage("load_ood", f"loading {spec} (zero-shot)"):
            c = load_collection(spec)
            if any(tg.label == c.name for tg in targets):
                data.notes.append(f"--ood {spec}: {c.name} is already evaluated; skipped")
                continue
            split = choose_splits(c).test
            t, q, n = evaluated_queries(c.topics(split), c.qrels(split), cfg.ood_queries or None, cfg.seed)
        if t.empty:
            raise ValueError(f"{c.name}/{split} has no query with a judged-relevant document")
        targets.append(Target(c.name, c, split, h.bm25(c), t, q, cfg.ood_depth, n))
    return targets


def recipe_summary(cfg: VarceJobConfig, h: Harness, trained: Trained) -> dict[str, Any]:
    """Which training recipe ran: the Recipe's ``description`` followed by ``training``, what the heads did."""
    features = trained.features
    pairs = None if features is None else len(features.index)
    backbone = "as given" if features is None else "frozen (as pre-trained)"
    out: dict[str, Any] = {"name": cfg.recipe, "backbone": backbone, "pairs_through_backbone": pairs}
    shared = f"computed once per (query, document) pair and shared by every re-ranker ({pairs} pairs through it)"
    if not trained.fine_tuned:
        what = f"the heads read the frozen backbone's [CLS] features, {shared}"
        what = "every re-ranker scored with its own backbone" if features is None else what
        out["training"] = f"nothing fine-tuned; {what}."
        out["description"] = f"**{cfg.recipe}** -- {out['training']}"
        return out
    rate = out["head_learning_rate"] = HEAD_RATE
    heads = f"lr {rate:g} (the VarCE head's declared rate; the CE's linear ranker alike)"
    if features is not None:
        out["training"] = (
            f"Nothing trains at the encoder's rate: the backbone is kept as pre-trained and every head trains at "
            f"{heads} on its [CLS] features, {shared}."
        )
    else:
        layers = f", top {cfg.train_layers} layers" * h.recipe.caches_states
        out["backbone"] = f"fine-tuned at lr {cfg.lr:g}{layers}"
        out["training"] = f"The heads train at {heads}."
    out["description"] = f"{h.recipe.describe()} {out['training']}"
    return out


def settings_fingerprint(h: Harness, name: str) -> str | None:
    """What identifies the model ``name`` trained (or reused) in this run: its saved settings (None: none saved)."""
    path = h.path("models", name, "train_settings.json")
    if not os.path.isfile(path):
        return None
    return _digest(read_json(path).get("settings"))


#: A saved model's card (:func:`st_extensions.model_card.set_card_figures` rewrites it), not part of what it computes.
MODEL_CARD = "README.md"


def folder_fingerprint(folder: str, max_seq_length: int) -> str:
    """What identifies a model given as a folder: its real path, its files' modification times and the token budget.
    The model card (``README.md``) is left out: every run that uses a model of ours writes its figures into it."""
    stamp = [(f, os.path.getmtime(os.path.join(folder, f))) for f in sorted(os.listdir(folder)) if f != MODEL_CARD]
    return _digest([os.path.realpath(folder), max_seq_length, stamp])


def score_fingerprint(h: Harness, name: str, trained: bool, cfg: VarceJobConfig) -> str | None:
    """What identifies a model's scores across runs (saved settings, the given model's files; None: nothing)."""
    if trained:
        return settings_fingerprint(h, name)
    if cfg.model and os.path.isdir(cfg.model):
        return folder_fingerprint(cfg.model, cfg.max_seq_length)
    return None


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]
