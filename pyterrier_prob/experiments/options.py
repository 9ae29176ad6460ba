"""The options every experiment command takes (:class:`CommonConfig`) and how a paper's config dataclass becomes its
``pyterrier-prob <paper>`` options (:func:`option`, :func:`add_options`, :func:`subcommand`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any, TypeVar

import numpy as np

from pyterrier_prob.training import MODES, Recipe
from st_extensions.checks import choice, is_int, positive_int
from st_extensions.threads import BATCH_SLICE_MS

__all__ = ["RECIPE_OPTIONS", "CommonConfig", "add_options", "config_from_args", "flag", "option", "subcommand"]

C = TypeVar("C", bound="CommonConfig")

#: The training options: :class:`CommonConfig` field (``--flag``) -> the Recipe field giving its type and help.
RECIPE_OPTIONS = {"recipe": "mode", "lr": "learning_rate"} | {
    name: name for name in ("steps", "batch_size", "train_layers", "checkpoint_every", "checkpoint_limit", "seed")
}
_OPTION_NOTES = {  # what an option means on the command line beyond the Recipe field's help
    "steps": " (0: evaluate --model without fine-tuning)",
    "checkpoint_every": " (default: a tenth of --steps when the encoder trains, none under frozen)",
}
_OPTIONAL_TYPES = {"int | None": int, "float | None": float}  # the type of an option whose default is None


def flag(name: str) -> str:
    """The command-line flag of a config field: ``dev_every`` -> ``--dev-every``."""
    return "--" + name.replace("_", "-")


def option(default: Any = None, help: str = "", group: str | None = None, **argparse_kwargs: Any) -> Any:
    """A config field that is also the option ``--<field name>`` (:func:`add_options`): default, help, help group (None:
    the paper's own) and argparse keywords; a tuple default takes several values (``nargs="+"``), False: a flag."""
    return field(default=default, metadata={"help": help, "group": group, **argparse_kwargs})


SPLITS, TRAINING, OUTPUT = "collection and splits", "model and training", "output"


@dataclass
class CommonConfig:
    """Options every experiment takes, each field's help its documentation (:func:`option`); the training options
    (:data:`RECIPE_OPTIONS`) are :class:`~pyterrier_prob.training.Recipe`'s fields. ``command``: the command line
    that ran the experiment (set by ``pyterrier-prob``)."""

    dataset: str = option(
        "irds:beir/nfcorpus",
        "ir_datasets id (irds:beir/nfcorpus), BEIR folder (corpus.jsonl, queries.jsonl, qrels/<split>.tsv) or TREC "
        "folder (topics, qrels, a jsonl/tsv corpus) to train on (and test on, unless --test-dataset)",
        SPLITS,
    )
    test_dataset: str | None = option(
        None, "evaluate on this collection instead (zero-shot transfer; calibration from --dataset's dev split)", SPLITS
    )
    train_split: str | None = option(None, "default: 'train' if the collection has it", SPLITS)
    dev_split: str | None = option(
        None,
        "default: 'dev'/'validation' if present, else held-out train queries (--dev-from-train) or half of test",
        SPLITS,
    )
    test_split: str | None = option(None, "default: 'test', or the only split", SPLITS)
    dev_from_train: float = option(
        0.25,
        "experiments that calibrate (pebr), on a collection with a train split and no dev split: hold out this "
        "seeded share of the train queries for calibration (training uses the rest; HeldOutCollection) and report "
        "every test query (0: calibrate on a seeded half of the test queries instead, report the other half)",
        SPLITS,
    )
    model: str | None = option(
        None, "base or saved model, or one of our saved models (default: packaged all-MiniLM-L6-v2)", TRAINING
    )
    steps: int = 1000
    batch_size: int = 64
    lr: float = 5e-5
    seed: int = 0
    max_seq_length: int = option(128, "token budget per text", TRAINING)
    recipe: str = "frozen"
    train_layers: int | None = None
    checkpoint_every: int | None = None
    checkpoint_limit: int = 2
    threads: int | None = option(
        None,
        "CPU threads of torch, faiss and the tokenizers (default: the CPUs this process may use: OMP_NUM_THREADS, "
        "else its affinity (taskset, a cluster's cpuset) capped by its cgroup's CPU quota)",
        TRAINING,
    )
    sched_slice_ms: float = option(
        BATCH_SLICE_MS,
        "the command runs as a batch job (SCHED_BATCH) asking the kernel for time slices of this many ms (Linux >= "
        "6.12 honours 0.1-100): jobs sharing a core then take turns every slice instead of every tick; 0: the default "
        "scheduling",
        TRAINING,
    )
    dev_every: int | None = option(
        None,
        "steps between dev evaluations of each trained system (its own dev retrieval measure on the calibration "
        "queries; the best dev step's weights are kept, curves/<system>.json); default: 250 when the encoder trains, "
        "none under frozen",
        TRAINING,
    )
    patience: int | None = option(
        None, "with --dev-every: stop after this many dev points without a better one", TRAINING
    )
    output: str = option("outputs/experiment", "folder for models, indexes, tables and plots", OUTPUT)
    reuse: bool = option(False, "reuse models (same settings) and indexes in --output", OUTPUT)
    resume: bool = option(
        False,
        "continue an interrupted run in --output: reuse what finished (as --reuse), resume trainings from their "
        "newest complete checkpoints",
        OUTPUT,
    )
    quiet: bool = option(False, "no progress bars nor stage lines (the result table is still printed)", OUTPUT)
    results_json: str | None = option(
        None,
        "also write the run's summary.json, with the command line as 'command', to PATH (a file, or a folder that "
        "gets <experiment>.json), e.g. benchmarks/results/ for the docs' tables",
        OUTPUT,
        metavar="PATH",
    )
    claims_json: str | None = option(
        None,
        "add/replace this run's rows (paper, claim, recipe, system, metric, p...) in the claims file PATH, e.g. "
        "benchmarks/results/claims.json",
        OUTPUT,
        metavar="PATH",
    )
    command: str | None = None

    def training_recipe(self, steps: int | None = None, **overrides: Any) -> Recipe:
        """The run's :class:`~pyterrier_prob.training.Recipe`, ``steps`` and any field in ``overrides`` replaced."""
        values = {field_: getattr(self, option) for option, field_ in RECIPE_OPTIONS.items()}
        values["steps"] = self.steps if steps is None else steps
        values["checkpoint_every"] = self.checkpoint_every or 0
        recipe = Recipe(**{**values, **overrides})
        if self.checkpoint_every is None and recipe.trains_encoder and "checkpoint_every" not in overrides:
            recipe.checkpoint_every = max(1, recipe.steps // 10)
        return recipe

    def check(self) -> None:
        """Raise ``ValueError`` naming the first setting out of range (as its command-line flag)."""
        if not (is_int(self.steps) and self.steps >= 0):
            raise ValueError(f"--steps must be >= 0, got {self.steps}")
        if not (self.lr > 0 and np.isfinite(self.lr)):  # a recipe may keep the encoder (0); the command line trains
            raise ValueError(f"--lr must be a finite number > 0, got {self.lr}")
        try:  # with --steps 0 nothing trains: the batch size does not matter
            self.training_recipe(max(self.steps, 1), **({} if self.steps else {"batch_size": 2}))
        except ValueError as e:
            message = str(e)
            for option, field_ in RECIPE_OPTIONS.items():
                message = message.replace(f"Recipe.{field_} ", flag(option) + " ")
            raise ValueError(message.replace("mode '", "--recipe '")) from None
        for name in ("threads", "dev_every", "patience"):
            positive_int(flag(name), getattr(self, name), allow_none=True)
        for f in fields(self):  # every option with choices (each value of a sequence option)
            if allowed := f.metadata.get("choices"):
                value = getattr(self, f.name)
                for v in value if isinstance(value, tuple | list) else (value,):
                    choice(flag(f.name), v, allowed)
        if not (np.isfinite(self.sched_slice_ms) and self.sched_slice_ms >= 0):
            raise ValueError(f"--sched-slice-ms must be a finite number >= 0, got {self.sched_slice_ms}")
        if self.max_seq_length < 8:
            raise ValueError(f"--max-seq-length must be >= 8, got {self.max_seq_length}")
        if not 0 <= self.dev_from_train < 1:
            raise ValueError(f"--dev-from-train must be in [0, 1), got {self.dev_from_train}")
        if self.test_split and self.test_split in (self.train_split, self.dev_split):
            raise ValueError(f"the test split {self.test_split!r} must differ from the train and dev splits")


def add_options(ap: argparse.ArgumentParser, defaults: CommonConfig, title: str | None = None) -> None:
    """Add a config dataclass's options to ``ap``: every :func:`option` field (default from ``defaults``; a paper's own
    in group ``title``) and the training options from :class:`~pyterrier_prob.training.Recipe`'s fields."""
    recipe_fields = {f.name: f for f in fields(Recipe)}
    common = {f.name: f.metadata for f in fields(CommonConfig)}
    groups: dict[str, Any] = {}
    for f in fields(defaults):
        meta = dict(f.metadata or common.get(f.name, {}))
        if f.name in RECIPE_OPTIONS:
            r = recipe_fields[RECIPE_OPTIONS[f.name]]
            meta = {"help": r.metadata["help"] + _OPTION_NOTES.get(f.name, ""), "group": TRAINING}
            meta["type"] = {"mode": str, "learning_rate": float}.get(r.name, int)
            meta["choices"] = list(MODES) if r.name == "mode" else None
        if "help" not in meta:
            continue
        name = meta.pop("group") or title or type(defaults).__name__
        group = groups.get(name) or groups.setdefault(name, ap.add_argument_group(name))
        default = getattr(defaults, f.name)
        if default is False:
            group.add_argument(flag(f.name), action="store_true", **meta)
            continue
        if isinstance(default, tuple):  # an empty default needs its own ``type`` (else str)
            if default and "type" not in meta:
                meta["type"] = type(default[0])
            meta.setdefault("nargs", "+")
            default = list(default)
        else:  # a None default: the type its annotation names (``int | None``: int)
            meta.setdefault("type", type(default) if default is not None else _OPTIONAL_TYPES.get(f.type))
        group.add_argument(flag(f.name), default=default, **meta)


def config_from_args(cls: type[C], a: argparse.Namespace) -> C:
    """A config dataclass from parsed arguments: every field the parser has (lists as tuples)."""
    values = {f.name: getattr(a, f.name) for f in fields(cls) if f.init and hasattr(a, f.name)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def subcommand(cls: type[C], title: str) -> tuple[Callable[..., None], Callable[..., C]]:
    """A paper's ``add_arguments(ap)`` and ``config_from_args(a)`` for ``cls`` (its own options in group ``title``)."""
    return partial(add_options, defaults=cls(), title=title), partial(config_from_args, cls)
