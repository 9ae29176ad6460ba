"""Fine-tuning with the sentence-transformers trainers under a :class:`Recipe` (frozen, partial or full; fixed step
budget; bounded, resumable checkpoints; optional gathering of in-batch candidates across devices)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import tempfile
import time
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from datasets import Dataset
from sentence_transformers import (
    CrossEncoder,
    SentenceTransformer,
    SentenceTransformerTrainer,
    SentenceTransformerTrainingArguments,
)
from sentence_transformers.cross_encoder import CrossEncoderTrainer, CrossEncoderTrainingArguments
from torch import nn
from tqdm.auto import tqdm
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from pyterrier_prob.atomic import atomic_write, read_checked
from pyterrier_prob.console import library_bars
from st_extensions.checks import choice, finite_float, non_negative_int, positive_int
from st_extensions.cross_encoder.frozen import cached_cross_encoder
from st_extensions.cross_encoder.split import SplitTransformer, split_state_cache
from st_extensions.frozen import CachedEmbeddings, cached_model
from st_extensions.modules.safetensors_module import check_safetensors_file
from st_extensions.partial import partial_model
from st_extensions.sampler import QueryBalancedBatchSampler
from st_extensions.threads import torch_threads

__all__ = [
    "COMPLETE",
    "MODES",
    "Recipe",
    "StepRate",
    "complete_checkpoints",
    "fine_tune",
    "head_learning_rates",
    "text_columns",
]


class _LossBar(TrainerCallback):
    """One tqdm bar over the optimiser steps with the running loss, instead of transformers' printer callbacks."""

    def __init__(self, show: bool, desc: str) -> None:
        self.show, self.desc = show, desc

    def on_train_begin(self, args, state, control, **kwargs):
        self.bar = tqdm(total=state.max_steps, desc=self.desc, unit="step", dynamic_ncols=True, disable=not self.show)

    def on_step_end(self, args, state, control, **kwargs):
        self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.bar.set_postfix(loss=f"{logs['loss']:.4f}", refresh=False)

    def on_train_end(self, args, state, control, **kwargs):
        self.bar.close()


class StepRate(TrainerCallback):
    """Optimiser steps per second (``steps_per_second``) from the first step's end to the last (warm-up left out)."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.last, self.steps = 0.0, 0

    def on_step_end(self, args, state, control, **kwargs):
        self.last = time.perf_counter()
        if self.first is None:
            self.first = self.last
        else:
            self.steps += 1

    @property
    def steps_per_second(self) -> float | None:
        return self.steps / (self.last - self.first) if self.steps and self.first is not None else None


def head_learning_rates(
    model: nn.Module,
    loss: nn.Module,
    by_class: Mapping[str, float] | None = None,
    default: float | None = None,
) -> dict[str, float]:
    """``learning_rate_mapping`` for the trainer: every parameter of a module that declares a ``learning_rate`` (the
    modules our builders add) trains at that rate, at ``default``, or at ``by_class[<class name>]`` (0: kept as built),
    times the module's ``parameter_rate_scales`` for a child module's parameters (e.g. a VarCE head's mean branch);
    keys are exact parameter names as the trainer sees them (through ``loss``)."""
    heads = [m for m in model.modules() if isinstance(getattr(type(m), "learning_rate", None), float)]
    by_class, declared = dict(by_class or {}), sorted({type(m).__name__ for m in heads})
    if unknown := sorted(set(by_class) - set(declared)):
        raise ValueError(f"module_learning_rates names {unknown}, not among the model's trained modules {declared}")
    rates: dict[int, float] = {}
    for m in heads:
        lr = by_class.get(type(m).__name__, type(m).learning_rate if default is None else default)
        for child, scale in dict(getattr(m, "parameter_rate_scales", None) or {}).items():
            for p in getattr(m, child).parameters():
                rates.setdefault(id(p), float(lr) * float(scale))
        for p in m.parameters():
            rates.setdefault(id(p), float(lr))
    return {f"^{re.escape(n)}$": rates[id(p)] for n, p in loss.named_parameters() if id(p) in rates}


def text_columns(train: Dataset) -> list[str]:
    """The columns a SentenceTransformer trains on, in order: ``anchor*``, ``positive*``, ``negative*``."""
    return [c for c in train.column_names if c.startswith(("anchor", "positive", "negative"))]


@contextlib.contextmanager
def _loss_on(loss: nn.Module, model: nn.Module, stand_in: nn.Module):
    """Point every ``.model`` of ``loss`` (and of its submodules) that is ``model`` at ``stand_in`` for a while."""
    swapped = [m for m in loss.modules() if getattr(m, "model", None) is model and stand_in is not model]
    for m in swapped:
        m.model = stand_in
    try:
        yield
    finally:
        for m in swapped:
            m.model = model


MODES = ("frozen", "partial", "full")  #: the fine-tuning recipes (:attr:`Recipe.mode`), the one list of them

#: name of the file a checkpoint folder gets once every part of it is written (the marker of a complete checkpoint)
COMPLETE = "checkpoint_complete.json"


def _option(default: Any, text: str) -> Any:
    """A :class:`Recipe` field with its ``help``; a type as ``default`` (``dict``) is the factory of a fresh one."""
    if isinstance(default, type):
        return field(default_factory=default, metadata={"help": text})
    return field(default=default, metadata={"help": text})


@dataclass
class Recipe:
    """Everything that decides how a model is fine-tuned (written beside every trained model); each field's ``help``
    says what it does (the command line's options are made from them). The global batch is ``batch_size`` times the
    world size; ``learning_rate_mapping`` (regex on parameter names -> rate) overrides every other rate."""

    mode: str = _option(
        "frozen",
        "frozen: train only the modules a method adds, on the encoder's pooled outputs computed once (fast, CPU); "
        "partial: also the top train_layers transformer layers, on the lower layers' hidden states cached once "
        "(fp16 memmaps); full: fine-tune every parameter (GPU)",
    )
    steps: int = _option(1000, "optimiser steps per model")
    batch_size: int = _option(64, "training rows per step and device (>= 2)")
    learning_rate: float = _option(5e-5, "learning rate of the encoder (partial, full)")
    module_learning_rates: dict[str, float] = _option(
        dict, "module class name -> rate, overriding the rate its builder declared (0: kept as built)"
    )
    head_learning_rate: float | None = _option(None, "one rate for every added module instead of their declared ones")
    learning_rate_mapping: dict[str, float] = _option(dict, "regex -> rate")
    warmup_ratio: float = _option(0.1, "linear warm-up over this share of the steps")
    seed: int = _option(0, "seed of the trainer, the batch sampler and the models' initialisation")
    train_layers: int | None = _option(None, "partial only: how many of the top transformer layers train")
    checkpoint_every: int = _option(0, "write a checkpoint every this many steps (0: none; needs an output folder)")
    checkpoint_limit: int = _option(2, "checkpoints kept per model (the newest)")
    gather_across_devices: bool = _option(
        False, "the in-batch losses gather the candidates of every device (DDP): global-batch negatives"
    )

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field out of range (the one validation of a recipe)."""
        choice("Recipe.mode", self.mode, MODES)
        positive_int("Recipe.steps", self.steps)
        positive_int("Recipe.batch_size", self.batch_size, minimum=2)
        finite_float("Recipe.learning_rate", self.learning_rate, low=0.0)
        finite_float("Recipe.warmup_ratio", self.warmup_ratio, low=0.0, high=1.0, high_open=True)
        if self.caches_states:
            positive_int("Recipe.train_layers (mode 'partial')", self.train_layers)
        elif self.train_layers is not None:
            raise ValueError(f"Recipe.train_layers is for mode 'partial' only (mode {self.mode!r})")
        non_negative_int("Recipe.checkpoint_every", self.checkpoint_every)
        positive_int("Recipe.checkpoint_limit", self.checkpoint_limit)

    @property
    def caches_features(self) -> bool:
        """Whether only the added modules train, on the encoder's outputs computed once (mode ``frozen``)."""
        return self.mode == "frozen"

    @property
    def caches_states(self) -> bool:
        """Whether the lower layers' hidden states are cached and the top ``train_layers`` train (mode ``partial``)."""
        return self.mode == "partial"

    @property
    def trains_encoder(self) -> bool:
        """Whether (some of) the encoder's own layers train (modes ``partial`` and ``full``)."""
        return self.mode != "frozen"

    @property
    def label(self) -> str:
        """A few words for progress lines: the mode, and the layers that train under ``partial``."""
        return self.mode + (f", top {self.train_layers} layers" if self.caches_states else "")

    def describe(self) -> str:
        """One sentence saying what trains under this recipe, for reports (generated, never written by hand)."""
        what = {
            "frozen": "only the added modules train, on the encoder's outputs computed once",
            "partial": f"the top {self.train_layers} transformer layer(s), the pooling and the added modules train "
            "on the lower layers' states computed once",
            "full": "every parameter trains",
        }[self.mode]
        heads = "their declared rates" if self.head_learning_rate is None else f"{self.head_learning_rate:g}"
        if self.mode == "frozen":  # nothing trains at the encoder's rate but an added module that declares none
            return f"**{self.mode}** -- {what}; {self.steps} steps of {self.batch_size}, the added modules at {heads}."
        return (
            f"**{self.mode}** -- {what}; {self.steps} steps of {self.batch_size} at lr {self.learning_rate:g} (added "
            f"modules at {heads})."
        )

    def to_dict(self) -> dict[str, Any]:
        """The recipe as JSON-ready values (what :meth:`save` writes)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Recipe:
        """A recipe from :meth:`to_dict`'s values; an unknown key is a ``ValueError`` naming it."""
        if unknown := sorted(set(values) - {f.name for f in fields(cls)}):
            raise ValueError(f"unknown Recipe fields {unknown}")
        return cls(**dict(values))

    def save(self, path: str) -> None:
        """Write the recipe to ``path`` as JSON (atomically)."""
        atomic_write(path, json.dumps(self.to_dict(), indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: str) -> Recipe:
        """Read a recipe written by :meth:`save`."""
        return cls.from_dict(read_json(path))


def complete_checkpoints(folder: str) -> list[str]:
    """The ``checkpoint-<step>`` folders in ``folder`` with the :data:`COMPLETE` marker, oldest first."""
    return [p for _, p in sorted(_checkpoints(folder).items()) if os.path.isfile(os.path.join(p, COMPLETE))]


def _checkpoints(folder: str) -> dict[int, str]:
    """step -> path of every ``checkpoint-<step>`` folder in ``folder``, complete or not."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return {int(m.group(1)): os.path.join(folder, n) for n in names if (m := re.fullmatch(r"checkpoint-(\d+)", n))}


def _remove_checkpoints(folder: str, after: int = -1) -> None:
    """Remove the checkpoints of ``folder`` beyond step ``after`` (default: all of them)."""
    for step, path in _checkpoints(folder).items():
        if step > after:
            shutil.rmtree(path, ignore_errors=True)


def _pairs_of(train: Dataset) -> list[tuple[str, str]]:
    """The (query, document) pairs a cross-encoder trains on (else the first text column with each further one)."""
    if "document" in train.column_names and "query" in train.column_names:
        return list(zip(train["query"], train["document"]))
    columns = [c for c in train.column_names if c != "label" and isinstance(train[0][c], str)]
    if len(columns) < 2:
        raise ValueError(
            f"a cross-encoder trains on (query, document) texts; the rows have columns {train.column_names}"
        )
    first = train[columns[0]]
    return [pair for c in columns[1:] for pair in zip(first, train[c])]


class _SamplerEpoch(TrainerCallback):
    """Sets the batch sampler's epoch at every epoch's start (the trainer's misses it in a resumed DDP epoch)."""

    def on_epoch_begin(self, args, state, control, train_dataloader=None, **kwargs):
        steps = len(train_dataloader) // max(1, args.gradient_accumulation_steps) if train_dataloader else 0
        inner = train_dataloader
        for _ in range(6):  # DataLoaderShard -> (SkipBatchSampler ->) BatchSamplerShard -> the sampler
            inner = getattr(inner, "batch_sampler", None)
            if inner is None or isinstance(inner, QueryBalancedBatchSampler):
                break
        if isinstance(inner, QueryBalancedBatchSampler) and steps:
            inner.set_epoch(state.global_step // steps)


class _MarkComplete(TrainerCallback):
    """Marks a checkpoint complete once the trainer has written all of it: resuming skips an unmarked one."""

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            atomic_write(os.path.join(folder, COMPLETE), json.dumps({"step": state.global_step}))


def _trainer_class(base: type) -> type:
    """``base`` (a trainer class) whose checkpoints save and load the real model, not the training stand-in."""

    class RecipeTrainer(base):
        real_model: nn.Module | None = None

        def _save(self, output_dir: str | None = None, state_dict=None) -> None:
            if self.real_model is None or self.real_model is self.model:
                return super()._save(output_dir, state_dict)
            output_dir = output_dir if output_dir is not None else self.args.output_dir
            os.makedirs(output_dir, exist_ok=True)
            self.real_model.save(output_dir)

        def _load_from_checkpoint(self, checkpoint_path: str, model=None) -> None:
            if self.real_model is None or self.real_model is self.model:
                return super()._load_from_checkpoint(checkpoint_path)
            from sentence_transformers.base.modules import Module
            from sentence_transformers.util import fullname

            real = self.real_model  # as the base trainer's own loader, on the model instead of the stand-in
            classes = {fullname(m): type(m) for m in real.modules() if isinstance(m, Module)}
            loaded = type(real)._load_with_module_classes(
                checkpoint_path, classes, trust_remote_code=real.trust_remote_code
            )
            real.load_state_dict(loaded.state_dict())

    RecipeTrainer.__name__ = RecipeTrainer.__qualname__ = f"Recipe{base.__name__}"
    return RecipeTrainer


def _texts_of(train: Dataset) -> list[str]:
    return [t for c in text_columns(train) for t in train[c]]


def fine_tune(
    model: SentenceTransformer,
    loss: nn.Module,
    train: Dataset,
    recipe: Recipe,
    *,
    output_dir: str | None = None,
    resume: bool = False,
    show_progress: bool = True,
    desc: str = "training",
    callbacks: Sequence[TrainerCallback] = (),
    encoder_cache: CachedEmbeddings | None = None,
    state_cache: str | None = None,
) -> list[float]:
    """Train ``model`` in place under ``recipe``; returns the logged training loss of every step. A CrossEncoder trains
    on its rows as given (shuffled), any other model on query-balanced batches of its ``anchor*``, ``positive*``,
    ``negative*`` columns. ``encoder_cache`` (frozen) and ``state_cache`` (partial: a folder) hold inputs computed once;
    ``output_dir`` receives ``recipe.json`` and the checkpoints, from which ``resume=True`` continues (same recipe
    only). Recipes, caches and checkpoints: ``docs/recipes.md``."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a pyterrier_prob.training.Recipe, got {type(recipe).__name__}")
    recipe.check()
    if recipe.checkpoint_every and not output_dir:
        raise ValueError("Recipe.checkpoint_every needs output_dir: the folder the checkpoints go to")
    if resume and not output_dir:
        raise ValueError("resume=True needs output_dir: the folder holding the checkpoints")
    if recipe.gather_across_devices:  # switched on in every part of the loss that has it
        parts = [m for m in loss.modules() if hasattr(m, "gather_across_devices")]
        if not parts:
            raise ValueError(
                f"Recipe.gather_across_devices is set but {type(loss).__name__} cannot gather across devices"
            )
        for m in parts:
            m.gather_across_devices = True
    if not isinstance(model, CrossEncoder):
        train = train.select_columns(text_columns(train) + (["label"] if "label" in train.column_names else []))
    # which checkpoint to resume from (or a refusal, for another recipe) before any cache is built
    checkpoint = _resume_point(output_dir, recipe) if resume else None
    trainable = {id(p): p.requires_grad for p in model.parameters()}  # given back after training
    with tempfile.TemporaryDirectory() as tmp:
        folder = state_cache or os.path.join(output_dir or tmp, "states")
        trained = _stand_in(model, train, recipe, folder, encoder_cache, show_progress)
        run_dir = output_dir or os.path.join(tmp, "run")
        if output_dir:
            if not resume:
                _remove_checkpoints(run_dir)  # a fresh run must not mix with an earlier run's checkpoints
            os.makedirs(run_dir, exist_ok=True)
            recipe.save(os.path.join(run_dir, "recipe.json"))
        # the model-card callback draws its own "Computing widget examples" bar while the trainer is made
        shown = show_progress and library_bars()
        with _loss_on(loss, model, trained):
            with contextlib.nullcontext() if shown else contextlib.redirect_stderr(io.StringIO()):
                trainer = _trainer(model, trained, loss, train, recipe, run_dir)
            for cb in (_LossBar(show_progress, desc), *callbacks):
                trainer.add_callback(cb)
            try:  # heads on cached features gain little from more threads and lose much on shared CPUs
                with torch_threads() if recipe.caches_features else contextlib.nullcontext():
                    trainer.train(resume_from_checkpoint=checkpoint)
            finally:
                if recipe.caches_states:  # the lower layers were frozen for the run only
                    for p in model.parameters():
                        p.requires_grad_(trainable.get(id(p), p.requires_grad))
                    if isinstance(model[0], SplitTransformer) and not (state_cache or output_dir):
                        model[0].state_cache = None  # its folder is the temporary one, removed below
    model.eval()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _stand_in(model: nn.Module, train: Dataset, recipe: Recipe, folder: str, cache: Any, show: bool) -> nn.Module:
    """What the trainer trains: ``model``, or a stand-in on cached encoder outputs (frozen) or states (partial)."""
    cross = isinstance(model, CrossEncoder)
    if recipe.caches_features:
        # encode's inner "Batches" bar only where library bars are wanted (not the command line's default)
        bar = show and library_bars()
        if cross:
            return cached_cross_encoder(model, _pairs_of(train), cache=cache, show_progress_bar=bar)
        return cached_model(model, _texts_of(train), show_progress_bar=bar, cache=cache)
    if recipe.caches_states and isinstance(model[0], SplitTransformer):
        # a split-attention cross-encoder: its lower layers read each text alone, so they are cached per text
        # (not per pair) and the joint top layers and the head train on them
        if recipe.train_layers != model[0].joint_layers:
            raise ValueError(
                f"a SplitTransformer with {model[0].joint_layers} joint layers trains those under 'partial': "
                f"got train_layers={recipe.train_layers}"
            )
        split_state_cache(model, folder, model[0].cache_texts(_pairs_of(train)), show_progress_bar=show)
        return model
    if recipe.caches_states:
        texts = _pairs_of(train) if cross else _texts_of(train)
        return partial_model(model, recipe.train_layers, texts, cache_dir=folder, show_progress_bar=show)
    return model


def _trainer(
    model: nn.Module, trained: nn.Module, loss: nn.Module, train: Dataset, recipe: Recipe, run_dir: str
) -> Any:
    """The trainer of :func:`fine_tune`: ``trained`` under ``recipe``, saving ``model`` itself in its checkpoints."""
    if isinstance(model, CrossEncoder):  # its rows as given, shuffled
        trainer_class, arguments_class, sampler = CrossEncoderTrainer, CrossEncoderTrainingArguments, {}
    else:
        trainer_class, arguments_class = SentenceTransformerTrainer, SentenceTransformerTrainingArguments
        sampler = {"batch_sampler": QueryBalancedBatchSampler}
    # names as the trainer sees them, through the (swapped) loss
    mapping = head_learning_rates(model, loss, recipe.module_learning_rates, recipe.head_learning_rate)
    mapping.update(recipe.learning_rate_mapping)
    args = arguments_class(
        output_dir=run_dir,
        max_steps=recipe.steps,
        per_device_train_batch_size=recipe.batch_size,
        learning_rate=recipe.learning_rate,
        learning_rate_mapping=mapping,
        warmup_steps=recipe.warmup_ratio,  # a float below 1 is a ratio of the steps (transformers >= 5)
        seed=recipe.seed,
        report_to="none",
        save_strategy="steps" if recipe.checkpoint_every else "no",
        save_steps=recipe.checkpoint_every or 500,  # (transformers' default where nothing is saved)
        save_total_limit=recipe.checkpoint_limit,
        logging_steps=1,
        disable_tqdm=True,
        **sampler,
        dataloader_drop_last=True,
        dataloader_pin_memory=torch.cuda.is_available(),
        **_ddp_arguments(),
    )
    ours = [_MarkComplete(), _SamplerEpoch()]
    trainer = _trainer_class(trainer_class)(model=trained, args=args, train_dataset=train, loss=loss, callbacks=ours)
    trainer.real_model = model
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    return trainer


def _ddp_arguments() -> dict[str, Any]:
    """Trainer arguments for several processes: DDP's static graph, and without a GPU the CPU flag and gloo."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return {}
    # our losses run the model more than once per step and leave parameters unused (BERT's pooler), which DDP's
    # unused-parameter search gets wrong; the graph is the same at every step, what static-graph mode is made for
    ddp = {"ddp_static_graph": True}
    return ddp if torch.cuda.is_available() else {**ddp, "use_cpu": True, "ddp_backend": "gloo"}


def _resume_point(folder: str, recipe: Recipe) -> str | None:
    """The newest complete checkpoint in ``folder`` written under ``recipe`` (None: none); newer ones are removed."""
    done = complete_checkpoints(folder)
    if not done:
        return None
    saved = os.path.join(folder, "recipe.json")
    if not os.path.isfile(saved):
        raise ValueError(f"cannot resume from {folder}: its recipe.json is missing")
    before = Recipe.load(saved)
    if before != recipe:
        diff = {k: (v, getattr(recipe, k)) for k, v in before.to_dict().items() if getattr(recipe, k) != v}
        raise ValueError(f"cannot resume from {folder}: it was written under another recipe (was, now): {diff}")
    _remove_checkpoints(folder, after=int(done[-1].rsplit("-", 1)[1]))
    _check_checkpoint(done[-1])
    return done[-1]


def _check_checkpoint(path: str) -> None:
    """Every file of the checkpoint ``path`` reads back whole, else ``CorruptFileError`` naming the file."""
    remedy = f"delete {path!r} and rerun with --resume (it continues from the checkpoint before, if any)"
    for root, _dirs, files in os.walk(path):
        for name in sorted(files):
            file = os.path.join(root, name)
            if name.endswith(".safetensors"):
                check_safetensors_file(file, remedy)
            elif name.endswith((".pt", ".pth")):
                read_checked(file, _test_zip, remedy)
            elif name.endswith(".json"):
                read_checked(file, read_json, remedy)


def _test_zip(path: str) -> None:
    with zipfile.ZipFile(path) as z:
        bad = z.testzip()
    if bad is not None:
        raise ValueError(f"its member {bad} fails its CRC check")


def read_json(path: str) -> Any:
    """The JSON value in the file ``path``."""
    with open(path, encoding="utf8") as f:
        return json.load(f)
