"""The shared experiment harness: what every paper's experiment needs, written once.

A paper's module (:mod:`pyterrier_prob.experiments.pebr`, ``mol``, ``varce``, ``unierf``) describes its protocol
and calls this for everything else:

* **collections and splits** (:meth:`Harness.load_data`): ``--dataset`` is an ir_datasets id, a BEIR folder or a
  TREC folder (:mod:`pyterrier_prob.collections`); splits are discovered. With no train split (or ``--steps 0``)
  nothing is fine-tuned; with no dev split, calibration uses a seeded share of the train queries held out from
  training (``--dev-from-train``), else (no train split, or ``--dev-from-train 0``) a seeded half of the test
  queries, and results are then reported on the other half; ``--test-dataset`` evaluates on another collection
  (zero-shot transfer), with calibration from the training collection's dev split (or held-out train queries);
* **training** (:meth:`Harness.train`): :func:`pyterrier_prob.training.fine_tune`, the model saved under
  ``output/models/<name>`` with its settings, and reused by ``--reuse`` only when the settings match;
* **encoding and indexing** (:meth:`Harness.dense_index`, :meth:`Harness.mol_index`) and **BM25 through PISA**
  (:meth:`Harness.bm25`), under ``output/indexes/``;
* **evaluation** (:meth:`Harness.experiment`): ``pt.Experiment`` with paired t-tests against a baseline;
* **the report** (:meth:`Harness.finish`): ``results.md``, one CSV per table, ``summary.json`` (settings, splits,
  timings) and the PNG plots, all through the one atomic writer (:mod:`pyterrier_prob.atomic`, 0644 files,
  0755 folders); the Markdown is printed at the end with its location.

Progress is one bar per stage (training, encoding/indexing, scoring); ``quiet`` silences them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt

from pyterrier_prob.atomic import atomic_write, make_dirs, save_figure
from pyterrier_prob.collections import (
    Collection,
    HeldOutCollection,
    choose_splits,
    load_collection,
    source_splits,
    split_topics,
)
from pyterrier_prob.console import native_output_to

__all__ = [
    "CommonConfig",
    "Data",
    "Harness",
    "add_common_arguments",
    "common_from_args",
    "markdown_table",
    "native_output_to",
    "p_mark",
]


RECIPES = ("frozen", "partial", "full")


@dataclass
class CommonConfig:
    """Options every experiment takes (the ``pyterrier-prob <paper>`` options shared by all four).

    Attributes:
        dataset: ir_datasets id, BEIR folder or TREC folder to train on (and test on, unless ``test_dataset``).
        test_dataset: another collection to evaluate on (zero-shot transfer), or None.
        train_split, dev_split, test_split: explicit split names; None: discovered (:func:`choose_splits`).
        dev_from_train: when an experiment calibrates and the training collection has a train split but no dev
            split, this seeded share of the train queries is held out as the dev split (training uses the rest;
            :class:`~pyterrier_prob.collections.HeldOutCollection`) and every test query is reported. 0: calibrate
            on a seeded half of the test queries instead, reporting on the other half.
        model: base model name or path, or one of our saved models (None: the packaged all-MiniLM-L6-v2).
        steps: training steps (0: evaluate ``model`` without fine-tuning).
        batch_size, lr, seed, max_seq_length: the training budget, the same for every trained system (``lr`` is
            the encoder's; the modules a method adds train at their own declared rate, see ``fine_tune``).
        recipe: ``"frozen"``: train only each method's own modules on encoder outputs cached once per run (the
            default on CPU: thousands of steps in minutes); ``"partial"``: also the top ``train_layers`` transformer
            layers, on the lower layers' hidden states cached once (fp16 memmaps under ``output/cache/``);
            ``"full"``: fine-tune the whole encoder (the GPU path). See :class:`~pyterrier_prob.training.Recipe`.
        train_layers: the top layers that train under ``recipe="partial"``.
        checkpoint_every: checkpoint every this many steps (None: a tenth of the steps under partial and full, none
            under frozen, whose runs take minutes); at most ``checkpoint_limit`` are kept.
        checkpoint_limit: checkpoints kept per model (the newest).
        resume: continue an interrupted run: models and indexes already finished are reused (as ``reuse``) and a
            training that was cut off continues from its newest complete checkpoint.
        output: folder for models, indexes, tables and plots.
        reuse: reuse models (when their saved settings match) and indexes already in ``output``.
        quiet: no progress bars nor stage lines (the result table and its location are still printed).
    """

    dataset: str = "irds:beir/nfcorpus"
    test_dataset: str | None = None
    train_split: str | None = None
    dev_split: str | None = None
    test_split: str | None = None
    dev_from_train: float = 0.25
    model: str | None = None
    steps: int = 1000
    batch_size: int = 64
    lr: float = 5e-5
    seed: int = 0
    max_seq_length: int = 128
    recipe: str = "frozen"
    train_layers: int | None = None
    checkpoint_every: int | None = None
    checkpoint_limit: int = 2
    output: str = "outputs/experiment"
    reuse: bool = False
    resume: bool = False
    quiet: bool = False

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting out of range."""
        if self.steps < 0:
            raise ValueError(f"--steps must be >= 0, got {self.steps}")
        if self.steps and self.batch_size < 2:
            raise ValueError(f"--batch-size must be >= 2, got {self.batch_size}")
        if not (self.lr > 0 and np.isfinite(self.lr)):
            raise ValueError(f"--lr must be a finite number > 0, got {self.lr}")
        if self.recipe not in RECIPES:
            raise ValueError(f"--recipe must be one of {RECIPES}, got {self.recipe!r}")
        if self.recipe == "partial" and (self.train_layers is None or self.train_layers < 1):
            raise ValueError(f"--recipe partial needs --train-layers N >= 1, got {self.train_layers}")
        if self.recipe != "partial" and self.train_layers is not None:
            raise ValueError(f"--train-layers is for --recipe partial, not {self.recipe!r}")
        if self.checkpoint_every is not None and self.checkpoint_every < 0:
            raise ValueError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.checkpoint_limit < 1:
            raise ValueError(f"--checkpoint-limit must be >= 1, got {self.checkpoint_limit}")
        if self.max_seq_length < 8:
            raise ValueError(f"--max-seq-length must be >= 8, got {self.max_seq_length}")
        if not 0 <= self.dev_from_train < 1:
            raise ValueError(f"--dev-from-train must be in [0, 1), got {self.dev_from_train}")
        named = [s for s in (self.train_split, self.dev_split) if s]
        if self.test_split and self.test_split in named:
            raise ValueError(f"the test split {self.test_split!r} must differ from the train and dev splits")


def add_common_arguments(ap: argparse.ArgumentParser, defaults: CommonConfig) -> None:
    """Add the shared options to a subcommand's parser, with the paper's defaults."""
    g = ap.add_argument_group("collection and splits")
    g.add_argument(
        "--dataset",
        default=defaults.dataset,
        help="ir_datasets id (irds:beir/nfcorpus), BEIR folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv) or "
        "TREC folder (topics, qrels, a jsonl/tsv corpus)",
    )
    g.add_argument(
        "--test-dataset",
        default=defaults.test_dataset,
        help="evaluate on this collection instead (zero-shot transfer; calibration from --dataset's dev split)",
    )
    g.add_argument("--train-split", default=defaults.train_split, help="default: 'train' if the collection has it")
    g.add_argument(
        "--dev-split",
        default=defaults.dev_split,
        help="default: 'dev'/'validation' if present, else held-out train queries (--dev-from-train) or half of test",
    )
    g.add_argument("--test-split", default=defaults.test_split, help="default: 'test', or the only split")
    g.add_argument(
        "--dev-from-train",
        type=float,
        default=defaults.dev_from_train,
        help="experiments that calibrate (pebr), on a collection with a train split and no dev split: hold out this "
        "seeded share of the train queries for calibration (training uses the rest) and report every test query "
        "(0: calibrate on a seeded half of the test queries instead)",
    )
    t = ap.add_argument_group("model and training")
    t.add_argument("--model", default=defaults.model, help="base or saved model (default: packaged all-MiniLM-L6-v2)")
    t.add_argument("--steps", type=int, default=defaults.steps, help="training steps per model (0: no fine-tuning)")
    t.add_argument("--batch-size", type=int, default=defaults.batch_size)
    t.add_argument("--lr", type=float, default=defaults.lr, help="learning rate of the encoder (recipe full)")
    t.add_argument(
        "--recipe",
        choices=list(RECIPES),
        default=defaults.recipe,
        help="frozen: train each method's own modules on encoder outputs cached once (fast, CPU); "
        "partial: also the top --train-layers layers, on the lower layers' hidden states cached once; "
        "full: fine-tune the whole encoder (GPU)",
    )
    t.add_argument(
        "--train-layers",
        type=int,
        default=defaults.train_layers,
        help="--recipe partial: how many of the top transformer layers train",
    )
    t.add_argument(
        "--checkpoint-every",
        type=int,
        default=defaults.checkpoint_every,
        help="checkpoint every N steps (default: a tenth of --steps under partial/full, none under frozen)",
    )
    t.add_argument("--checkpoint-limit", type=int, default=defaults.checkpoint_limit, help="checkpoints kept")
    t.add_argument("--max-seq-length", type=int, default=defaults.max_seq_length, help="token budget per text")
    t.add_argument("--seed", type=int, default=defaults.seed)
    o = ap.add_argument_group("output")
    o.add_argument("--output", default=defaults.output, help="folder for models, indexes, tables and plots")
    o.add_argument("--reuse", action="store_true", help="reuse models (same settings) and indexes in --output")
    o.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run in --output: reuse what finished, resume trainings from their checkpoints",
    )
    o.add_argument("--quiet", action="store_true", help="no progress bars (the result table is still printed)")


def common_from_args(a: argparse.Namespace) -> dict[str, Any]:
    """The :class:`CommonConfig` fields of parsed arguments, as keyword arguments."""
    return {f: getattr(a, f) for f in CommonConfig.__dataclass_fields__}


@dataclass
class Data:
    """The collections and query sets of one experiment (from :meth:`Harness.load_data`).

    ``train`` is None when there is nothing to fine-tune on. ``cal_topics``/``cal_qrels`` are what calibration and
    dev-side choices use: the dev split, else train queries held out from training (``train_collection`` is then
    a :class:`~pyterrier_prob.collections.HeldOutCollection`), else a seeded half of the test queries (then
    ``test_topics`` is the other half). ``notes`` says which, for the report.
    """

    train_collection: Collection
    test_collection: Collection
    train: str | None
    dev: str | None
    test: str
    cal_topics: pd.DataFrame
    cal_qrels: pd.DataFrame
    test_topics: pd.DataFrame
    test_qrels: pd.DataFrame
    cal_source: str
    notes: list[str] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        return {
            "train": f"{self.train_collection.name}/{self.train}" if self.train else None,
            "calibration": self.cal_source,
            "test": f"{self.test_collection.name}/{self.test}",
            "n_calibration_queries": len(self.cal_topics),
            "n_test_queries": len(self.test_topics),
            "notes": list(self.notes),
        }


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text.removeprefix("irds:")).strip("-") or "collection"


def p_mark(p: float | None) -> str:
    """`` *`` for p < 0.05 (a paired test against the table's baseline), else ``""``."""
    return " *" if p is not None and np.isfinite(p) and p < 0.05 else ""


def markdown_table(frame: pd.DataFrame, floatfmt: str = ".4f") -> str:
    """A frame as a GitHub Markdown table (floats with ``floatfmt``, NaN as blank)."""

    def cell(v: Any) -> str:
        if isinstance(v, (float, np.floating)):
            return "" if not np.isfinite(v) else format(float(v), floatfmt)
        return str(v)

    cols = [str(c) for c in frame.columns]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines)


class Harness:
    """Stages, models, indexes, ``pt.Experiment`` and the report of one experiment run (module docstring)."""

    def __init__(self, name: str, cfg: CommonConfig) -> None:
        cfg.check()
        if cfg.resume:  # what finished is reused; what was cut off resumes from its checkpoints
            cfg.reuse = True
        self.name, self.cfg = name, cfg
        try:
            self.output = str(make_dirs(cfg.output))
        except OSError as e:
            raise ValueError(f"--output {cfg.output!r} cannot be created: {e.strerror or e}") from e
        if not os.access(self.output, os.W_OK | os.X_OK):
            raise ValueError(f"--output {cfg.output!r} is not writable")
        self.verbose = not cfg.quiet
        self.timings: dict[str, float] = {}
        self.t0 = time.perf_counter()
        self._fresh: set[str] = set()  # models trained in this run: their indexes are rebuilt
        self._model_settings: dict[str, dict[str, Any]] = {}  # name -> what made the model (for index reuse)
        self._held_out: dict[str, Any] = {}  # the train queries held out as dev (load_data), part of a model's settings
        self._bm25: dict[str, Any] = {}  # collection name -> its PISA index, built once per run
        self._cache: Any = None  # the frozen recipe's encoder-output cache (st_extensions.frozen.CachedEmbeddings)
        self.recipes: dict[str, dict[str, Any]] = {}  # model name -> the recipe it trained under (summary.json)
        _silence_library_bars()

    # ---- stages and progress ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def stage(self, name: str, message: str) -> Iterator[None]:
        """Time a stage (``summary.json``'s ``timings_s``) and announce it with one line."""
        start = time.perf_counter()
        if self.verbose:
            print(f"[{start - self.t0:7.1f}s] {message}", flush=True)
        try:
            yield
        finally:
            self.timings[name] = round(self.timings.get(name, 0.0) + time.perf_counter() - start, 2)

    def progress(self, iterable: Iterable[Any], desc: str, total: int | None = None, unit: str = "it") -> Iterable[Any]:
        """A tqdm bar over ``iterable`` (none when quiet)."""
        from tqdm.auto import tqdm

        return tqdm(iterable, desc=desc, total=total, unit=unit, disable=not self.verbose, dynamic_ncols=True)

    def path(self, *parts: str) -> str:
        return os.path.join(self.output, *parts)

    # ---- collections ------------------------------------------------------------------------------------------
    def load_data(self, calibrate: bool = True) -> Data:
        """Load ``--dataset`` (and ``--test-dataset``), choose the splits and the calibration/test queries.

        Args:
            calibrate: whether the experiment needs calibration queries. With no dev split they are a seeded share
                (``dev_from_train``) of the train queries, held out from training; with no train split either (or
                ``dev_from_train`` 0) a seeded half of the test queries, and the results are reported on the other
                half. An experiment that calibrates nothing passes False and is reported on every test query
                (``cal_topics`` is then empty).
        """
        cfg = self.cfg
        with self.stage("load", f"loading {cfg.dataset}" + (f" and {cfg.test_dataset}" if cfg.test_dataset else "")):
            train_coll = load_collection(cfg.dataset)
            notes: list[str] = []
            if cfg.test_dataset:
                test_coll = load_collection(cfg.test_dataset)
                train, dev = source_splits(train_coll, cfg.train_split, cfg.dev_split)
                test = choose_splits(test_coll, None, None, cfg.test_split).test
                notes.append(
                    f"zero-shot transfer: trained on {train_coll.name}"
                    + (f"/{train}" if train else " (no train split)")
                    + f", evaluated on {test_coll.name}/{test}"
                )
            else:
                test_coll = train_coll
                ch = choose_splits(train_coll, cfg.train_split, cfg.dev_split, cfg.test_split)
                train, dev, test = ch.train, ch.dev, ch.test
            if calibrate and dev is None and train is not None and cfg.dev_from_train > 0:
                try:
                    held = HeldOutCollection(train_coll, train, fraction=cfg.dev_from_train, seed=cfg.seed)
                except ValueError as e:
                    raise ValueError(
                        f"--dev-from-train {cfg.dev_from_train}: {e} (0: calibrate on half of test)"
                    ) from e
                n_dev, n_fit = len(held.topics(held.dev_split)), len(held.topics(held.fit_split))
                notes.append(
                    f"{train_coll.name} has no dev split: {n_dev} of its {train} queries ({cfg.dev_from_train:.0%}, "
                    f"seed {cfg.seed}) are held out as {held.dev_split} for calibration"
                    + (f"; training uses the other {n_fit} ({held.fit_split})" if cfg.steps else "")
                )
                self._held_out = {"split": train, "fraction": cfg.dev_from_train, "seed": cfg.seed}
                test_coll = held if test_coll is train_coll else test_coll
                train_coll, train, dev = held, held.fit_split, held.dev_split
            if cfg.steps == 0:
                notes = [n for n in notes if not n.startswith("zero-shot transfer")]
                if cfg.test_dataset:
                    notes.append(f"zero-shot: evaluated on {test_coll.name}/{test}")
                notes.append(f"--steps 0: {cfg.model or 'the base model'} evaluated without fine-tuning")
                train = None
            elif train is None:
                notes.append(
                    f"{train_coll.name} has no train split: {cfg.model or 'the base model'} is evaluated "
                    "without fine-tuning"
                )
            test_topics, test_qrels = test_coll.topics(test), test_coll.qrels(test)
            if dev is not None:
                cal_topics, cal_qrels = train_coll.topics(dev), train_coll.qrels(dev)
                cal_source = f"{train_coll.name}/{dev}"
            elif not calibrate:
                cal_topics, cal_qrels = test_topics.iloc[:0], test_qrels.iloc[:0]
                cal_source = "none (nothing calibrated)"
            else:
                cal_topics, test_topics = split_topics(test_topics, seed=cfg.seed)
                cal_qrels = test_qrels[test_qrels["qid"].isin(set(cal_topics["qid"]))]
                test_qrels = test_qrels[test_qrels["qid"].isin(set(test_topics["qid"]))]
                cal_source = f"a seeded half (seed {cfg.seed}) of {test_coll.name}/{test}: {len(cal_topics)} queries"
                notes.append(
                    f"no dev split: calibration on a seeded half of {test_coll.name}/{test} ({len(cal_topics)} "
                    f"queries), results reported on the other, disjoint half ({len(test_topics)} queries)"
                )
        return Data(
            train_collection=train_coll,
            test_collection=test_coll,
            train=train,
            dev=dev,
            test=test,
            cal_topics=cal_topics,
            cal_qrels=cal_qrels.reset_index(drop=True),
            test_topics=test_topics,
            test_qrels=test_qrels.reset_index(drop=True),
            cal_source=cal_source,
            notes=notes,
        )

    # ---- models -----------------------------------------------------------------------------------------------
    def recipe(self, steps: int | None = None, **overrides: Any) -> Any:
        """The run's :class:`~pyterrier_prob.training.Recipe` from the common options (``--recipe``, ``--steps``,
        ``--batch-size``, ``--lr``, ``--seed``, ``--train-layers``, ``--checkpoint-every``, ``--checkpoint-limit``),
        with ``steps`` and any field given in ``overrides`` replaced."""
        from pyterrier_prob.training import Recipe

        cfg = self.cfg
        steps = cfg.steps if steps is None else steps
        every = cfg.checkpoint_every
        if every is None:
            every = 0 if cfg.recipe == "frozen" else max(1, steps // 10)
        values: dict[str, Any] = {
            "mode": cfg.recipe,
            "steps": steps,
            "batch_size": cfg.batch_size,
            "learning_rate": cfg.lr,
            "seed": cfg.seed,
            "train_layers": cfg.train_layers if cfg.recipe == "partial" else None,
            "checkpoint_every": every,
            "checkpoint_limit": cfg.checkpoint_limit,
        }
        values.update(overrides)
        return Recipe(**values)

    def train(
        self,
        name: str,
        build: Callable[[], Any],
        loss: Callable[[Any], Any],
        data: Callable[[], Any] | None,
        *,
        steps: int | None = None,
        learning_rate_mapping: Mapping[str, float] | None = None,
        module_learning_rates: Mapping[str, float] | None = None,
        settings: Mapping[str, Any] | None = None,
        fit: Callable[[Any, Any, Any], list[float]] | None = None,
        callbacks: Sequence[Any] = (),
    ) -> tuple[Any, list[float]]:
        """Build, fine-tune and save a model as ``output/models/<name>``; returns ``(model, losses)``.

        The training runs under :meth:`recipe` (with ``steps``, ``learning_rate_mapping`` and
        ``module_learning_rates``, a recipe's choice of rate for the module classes it names), written as
        ``recipe.json`` beside the model; its checkpoints go to ``output/runs/<name>`` and are removed once the model
        is saved. ``data`` builds the training rows (None, or ``steps`` 0: the built model is returned untrained and
        not saved). With ``--reuse``, a saved model whose ``train_settings.json`` matches these settings is loaded
        instead of trained again; with ``--resume`` a training that was cut off continues from its newest complete
        checkpoint. ``fit(model, rows, recipe) -> losses`` replaces the default training
        (:func:`~pyterrier_prob.training.fine_tune` of ``loss(model)``), e.g. to train a head on cached features;
        everything else (settings, saving, reuse) is the same. ``callbacks`` go to the trainer (e.g. a
        :class:`~pyterrier_prob.curves.DevCurve`).
        """
        from pyterrier_prob.training import fine_tune
        from st_extensions import load_model

        cfg = self.cfg
        steps = cfg.steps if steps is None else steps
        path = self.path("models", name)
        info_path = os.path.join(path, "train_settings.json")
        recipe = None
        if data is not None and steps:
            recipe = self.recipe(
                steps,
                learning_rate_mapping=dict(learning_rate_mapping or {}),
                module_learning_rates=dict(module_learning_rates or {}),
            )
        made = {k: v for k, v in (recipe.to_dict() if recipe else {}).items() if not k.startswith("checkpoint_")}
        wanted = {
            "model": cfg.model,
            "dataset": cfg.dataset,
            "max_seq_length": cfg.max_seq_length,
            "recipe": made,
            **({"held_out_dev": self._held_out} if self._held_out else {}),
            **dict(settings or {}),
        }
        wanted = json.loads(json.dumps(wanted, default=str))
        if recipe is None:
            wanted = {k: wanted[k] for k in ("model", "max_seq_length")} | {"trained": False, **dict(settings or {})}
        self._model_settings[name] = json.loads(json.dumps(wanted, default=str))
        if recipe is None:
            model = build()
            _set_max_len(model, cfg.max_seq_length)
            return model, []
        self.recipes[name] = recipe.to_dict()
        if cfg.reuse and os.path.isfile(info_path):
            with open(info_path, encoding="utf8") as f:
                saved = json.load(f)
            if saved.get("settings") == wanted:
                with self.stage(f"load_{name}", f"reusing the {name} model in {path}"):
                    model = load_model(path, device="cpu")
                _set_max_len(model, cfg.max_seq_length)
                return model, list(saved.get("losses", []))
        run_dir = self.path("runs", name)
        label = recipe.mode + (f", top {recipe.train_layers} layers" if recipe.mode == "partial" else "")
        with self.stage(f"train_{name}", f"fine-tuning {name}: {steps} steps of {cfg.batch_size} ({label})"):
            import torch

            torch.manual_seed(cfg.seed)
            model = build()
            _set_max_len(model, cfg.max_seq_length)
            rows = data()
            if fit is not None:
                losses = fit(model, rows, recipe)
            else:
                losses = fine_tune(
                    model,
                    loss(model),
                    rows,
                    recipe,
                    output_dir=run_dir,
                    resume=cfg.resume,
                    show_progress=self.verbose,
                    desc=f"training {name}",
                    encoder_cache=self.encoder_cache(model) if recipe.mode == "frozen" else None,
                    state_cache=self.state_cache_path(recipe) if recipe.mode == "partial" else None,
                    callbacks=callbacks,
                )
            if recipe.mode == "frozen" and fit is None:
                self.save_encoder_cache()
            _save_model(model, path)
            recipe.save(os.path.join(path, "recipe.json"))
            atomic_write(info_path, json.dumps({"settings": wanted, "losses": losses}, indent=1))
            _remove_checkpoints(run_dir)
        self._fresh.add(name)
        return model, losses

    def state_cache_path(self, recipe: Any) -> str:
        """Where the partial recipe caches the lower layers' hidden states: ``output/cache/states-<base>-<max len>-
        top<N>`` (one folder per base model, token budget and split point, reused across runs)."""
        base = _slug(os.path.basename(str(self.cfg.model or "minilm").rstrip("/"))) or "model"
        return self.path("cache", f"states-{base}-{self.cfg.max_seq_length}-top{recipe.train_layers}")

    # ---- the frozen recipe's encoder cache ---------------------------------------------------------------------
    def _cache_path(self) -> str:
        return self.path("cache", "encoder.safetensors")

    def _cache_settings(self) -> dict[str, Any]:
        return {"model": self.cfg.model, "max_seq_length": self.cfg.max_seq_length}

    def encoder_cache(self, model: Any) -> Any:
        """The run's cache of base-encoder outputs (:class:`st_extensions.frozen.CachedEmbeddings`): every text is
        encoded once per output folder by the base encoder (``model``'s frozen prefix) and then shared by every
        system's training and indexing. Kept in ``output/cache/`` and reused when made with the same base model and
        ``max_seq_length`` (an interrupted run resumes without encoding again)."""
        from st_extensions.frozen import CachedEmbeddings, prefix_model

        if self._cache is None:
            path = self._cache_path()
            try:
                with open(f"{path}.settings.json", encoding="utf8") as f:
                    same = json.load(f) == self._cache_settings()
            except (OSError, ValueError):
                same = False
            if same and os.path.isfile(path):
                self._cache = CachedEmbeddings.load_cache(path)
            else:
                import torch

                self._cache = CachedEmbeddings([], torch.zeros(0, model.get_embedding_dimension()))
        if self._cache.encoder[0] is None:
            self._cache.encoder[0] = prefix_model(model, require_added=False)
        return self._cache

    def save_encoder_cache(self) -> None:
        """Write the encoder cache (atomically) so a later or resumed run does not encode the texts again."""
        if self._cache is None:
            return
        make_dirs(os.path.dirname(self._cache_path()))
        self._cache.save_cache(self._cache_path())
        atomic_write(f"{self._cache_path()}.settings.json", json.dumps(self._cache_settings()))

    def encoding_model(self, model: Any) -> Any:
        """What to encode queries and documents with: under the frozen recipe, ``model``'s added modules on the
        run's encoder cache (identical outputs; each text through the encoder once per run), else ``model``."""
        if self.cfg.recipe != "frozen":
            return model
        from st_extensions.frozen import cached_model

        return cached_model(model, cache=self.encoder_cache(model))

    # ---- indexes ----------------------------------------------------------------------------------------------
    def _index_path(self, name: str, collection: Collection, ext: str) -> str:
        return self.path("indexes", f"{name}-{_slug(collection.name)}.{ext}")

    def _reusable(self, name: str, index: Any, path: str) -> bool:
        """With ``--reuse``: the index exists and was built by a model made with the same settings."""
        if not self.cfg.reuse or name in self._fresh or not os.path.isfile(os.path.join(path, "pt_meta.json")):
            return False
        try:
            with open(f"{path}.settings.json", encoding="utf8") as f:
                return json.load(f) == self._index_settings(name)
        except (OSError, ValueError):
            return False

    def _index_settings(self, name: str) -> dict[str, Any]:
        made = self._model_settings.get(name, {"model": self.cfg.model, "max_seq_length": self.cfg.max_seq_length})
        return {"model": made, "max_seq_length": self.cfg.max_seq_length}

    def _built(self, name: str, path: str) -> None:
        atomic_write(f"{path}.settings.json", json.dumps(self._index_settings(name), indent=1))
        if self.cfg.recipe == "frozen":  # the documents just encoded join the run's encoder cache on disk
            self.save_encoder_cache()

    def dense_index(self, name: str, encoder: Any, collection: Collection) -> Any:
        """Encode ``collection`` with a :class:`~pyterrier_prob.ProbBiEncoder` (or any pyterrier-dr BiEncoder) into a
        :class:`~pyterrier_prob.DenseIndex` (one bar over the documents). ``name`` is the model's name in
        :meth:`train`; with ``--reuse`` an index built by a model made with the same settings is reused."""
        from pyterrier_prob.index import DenseIndex

        path = self._index_path(name, collection, "flex")
        index = DenseIndex(path, verbose=self.verbose)
        if self._reusable(name, index, path):
            return index
        with self.stage(f"index_{name}", f"encoding {collection.name} with {name} into {path}"):
            (encoder.doc_encoder(verbose=False) >> index.indexer(mode="overwrite")).index(collection.corpus_iter())
        self._built(name, path)
        return index

    def mol_index(self, name: str, encoder: Any, collection: Collection) -> Any:
        """Encode ``collection`` with a :class:`~pyterrier_prob.MoLEncoder` into a :class:`~pyterrier_prob.MoLIndex`
        (one bar over the documents; reuse as for :meth:`dense_index`)."""
        from pyterrier_prob.index import MoLIndex

        path = self._index_path(name, collection, "mol")
        index = MoLIndex(path, verbose=self.verbose)
        if self._reusable(name, index, path):
            return index
        with self.stage(f"index_{name}", f"encoding {collection.name} with {name} into {path}"):
            (encoder.doc_encoder() >> index.indexer(mode="overwrite")).index(collection.corpus_iter())
        self._built(name, path)
        return index

    def bm25(self, collection: Collection) -> Any:
        """A PISA index of ``collection`` for BM25: built once per run (and, with ``--reuse``, once per output
        folder); PISA's own log goes to a file beside it."""
        from pyterrier_pisa import PisaIndex

        if collection.name in self._bm25:
            return self._bm25[collection.name]
        path = self._index_path("bm25", collection, "pisa")
        make_dirs(os.path.dirname(path))
        index = PisaIndex(path, text_field="text", threads=max(1, os.cpu_count() or 1), overwrite=True)
        if not (self.cfg.reuse and index.built()):
            with self.stage("index_bm25", f"indexing {collection.name} with PISA for BM25 (log: {path}.log)"):
                with native_output_to(f"{path}.log", fds=(1, 2)):
                    index.index(self.progress(collection.corpus_iter(), "indexing BM25", collection.num_docs, "doc"))
                    index.bm25(num_results=1)(pd.DataFrame({"qid": ["warm-up"], "query": ["warm up"]}))
        self._bm25[collection.name] = index
        return index

    def bm25_retriever(self, index: Any, k: int) -> Any:
        """PISA's BM25 top ``k`` as a PyTerrier transformer, its native log going to the index's log file."""
        return _NativeLogged(index.bm25(num_results=k), f"{index.path}.log")

    def bm25_run(self, index: Any, topics: pd.DataFrame, k: int) -> pd.DataFrame:
        """BM25's top ``k`` for ``topics`` (``qid, docno, score, rank`` + query columns)."""
        return self.bm25_retriever(index, k)(topics)

    # ---- evaluation -------------------------------------------------------------------------------------------
    def experiment(
        self,
        runs: Mapping[str, pd.DataFrame],
        topics: pd.DataFrame,
        qrels: pd.DataFrame,
        measures: Sequence[Any],
        baseline: str | None = None,
        perquery: bool = False,
    ) -> pd.DataFrame:
        """``pt.Experiment`` over precomputed runs, with paired t-tests against ``baseline`` (its name).

        Returns pt.Experiment's frame (``name``, one column per measure, and ``<measure> p-value`` columns when a
        baseline is given); with ``perquery`` the per-query frame instead.
        """
        import ir_measures

        names = list(runs)
        ms = [ir_measures.parse_measure(m) if isinstance(m, str) else m for m in measures]
        frames = [r[["qid", "docno", "score"]].assign(qid=r["qid"].astype(str)) for r in runs.values()]
        kwargs: dict[str, Any] = {"names": names, "eval_metrics": ms}
        if perquery:
            kwargs["perquery"] = True
        elif baseline is not None:
            kwargs["baseline"] = names.index(baseline)
        return pt.Experiment(frames, topics, qrels, **kwargs)

    # ---- report -----------------------------------------------------------------------------------------------
    def figure(self, fig: Any, filename: str) -> str:
        """Save a matplotlib figure as ``output/<filename>`` (PNG, atomic, 0644)."""
        return save_figure(fig, self.path(filename))

    def finish(
        self,
        title: str,
        markdown: str,
        tables: Mapping[str, pd.DataFrame],
        summary: Mapping[str, Any],
        data: Data | None = None,
    ) -> dict[str, Any]:
        """Write ``results.md``, ``<table>.csv`` per table and ``summary.json``; print the report and its location
        (also with ``quiet``: it silences only the progress output).

        Returns the summary as written (with ``timings_s``, ``total_s`` and ``outputs`` added).
        """
        total = round(time.perf_counter() - self.t0, 1)
        head = [f"# {title}", ""]
        if data is not None:
            d = data.describe()
            head.append(
                f"Trained on {d['train'] or 'nothing (no fine-tuning)'}; calibration/dev: {d['calibration']}; "
                f"test: {d['test']} ({d['n_test_queries']} queries)."
            )
            if d["notes"]:
                head += ["", *[f"- {n}" for n in d["notes"]]]
            head.append("")
        text = "\n".join(head) + "\n" + markdown.strip() + f"\n\nWall time: {total:.0f} s.\n"
        outputs = {}
        for name, frame in tables.items():
            outputs[name] = atomic_write(self.path(f"{name}.csv"), frame.to_csv(index=False))
        outputs["results.md"] = atomic_write(self.path("results.md"), text)
        if self.recipes:  # the recipe every model of this run trained under
            outputs["recipes.json"] = atomic_write(self.path("recipes.json"), json.dumps(self.recipes, indent=1))
        full = {
            "experiment": self.name,
            "config": asdict(self.cfg) if hasattr(self.cfg, "__dataclass_fields__") else dict(vars(self.cfg)),
            "data": data.describe() if data is not None else None,
            "recipes": dict(self.recipes),
            **dict(summary),
            "timings_s": dict(self.timings),
            "total_s": total,
        }
        full["outputs"] = {**outputs, "summary.json": self.path("summary.json")}
        atomic_write(self.path("summary.json"), json.dumps(full, indent=2, default=_json_default))
        print("\n" + text, flush=True)
        print(f"results written to {self.path('results.md')} (tables as CSV, summary.json) in {self.output}/")
        return full


class _NativeLogged(pt.Transformer):
    """A transformer whose native (C++) output goes to a log file while it runs (PISA prints on fds 1 and 2)."""

    def __init__(self, inner: Any, log: str) -> None:
        self.inner, self.log = inner, log

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        with native_output_to(self.log, fds=(1, 2)):
            return self.inner.transform(inp)

    def __repr__(self) -> str:
        return repr(self.inner)


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def _silence_library_bars() -> None:
    """transformers' and huggingface_hub's own bars (loading weights, writing shards) are not stages: hide them; and
    ir_datasets' INFO lines (which file it opens) -- unless the command line asked for ``--verbose``
    (:mod:`pyterrier_prob.console`)."""
    from pyterrier_prob import console

    if not console.verbose():
        console.quiet_libraries()


def _position_limit(model: Any) -> int | None:
    """The most tokens the model's transformer can take (``max_position_embeddings``), if it says."""
    import torch

    for m in model.modules() if isinstance(model, torch.nn.Module) else []:
        config = getattr(m, "config", None)
        limit = getattr(config, "max_position_embeddings", None)
        if isinstance(limit, int) and limit > 0:
            return limit
    return None


def _set_max_len(model: Any, n: int) -> None:
    """Set the model's token budget; ``ValueError`` naming ``--max-seq-length`` beyond its position limit."""
    limit = _position_limit(model)
    if limit is not None and n > limit:
        raise ValueError(f"--max-seq-length {n} exceeds the model's position limit of {limit} tokens")
    if hasattr(model, "max_seq_length"):
        model.max_seq_length = n
    elif hasattr(model, "max_length"):
        model.max_length = n


def _remove_checkpoints(folder: str) -> None:
    """Drop a finished training's checkpoints (the saved model replaces them; disk stays bounded)."""
    import shutil

    if os.path.isdir(folder):
        shutil.rmtree(folder, ignore_errors=True)


def _save_model(model: Any, path: str) -> None:
    """Save a model atomically: into a sibling folder renamed into place (folders 0755, files 0644)."""
    from pyterrier_prob.atomic import atomic_directory

    with atomic_directory(path, overwrite=True) as tmp:
        model.save(str(tmp))
