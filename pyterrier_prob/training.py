"""Fine-tuning with the sentence-transformers trainers under a :class:`Recipe` (frozen, partial or full; fixed step
budget; bounded, resumable checkpoints; optional gathering of in-batch candidates across devices)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from torch import nn
from tqdm.auto import tqdm
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from pyterrier_prob.console import library_bars
from st_extensions.cross_encoder.split import SplitTransformer, split_state_cache
from st_extensions.frozen import CachedEmbeddings

__all__ = ["COMPLETE", "MODES", "Recipe", "complete_checkpoints", "fine_tune", "head_learning_rates", "text_columns"]


class _LossBar(TrainerCallback):
    """One tqdm bar over the optimiser steps with the running loss as its postfix, instead of transformers'
    printer / progress callbacks (which write one loss dictionary per logged step)."""

    def __init__(self, show: bool, desc: str) -> None:
        self.show, self.desc, self.bar = show, desc, None

    def on_train_begin(self, args, state, control, **kwargs):
        if self.show:
            self.bar = tqdm(total=state.max_steps, desc=self.desc, unit="step", dynamic_ncols=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.bar is not None and logs and "loss" in logs:
            self.bar.set_postfix(loss=f"{logs['loss']:.4f}", refresh=False)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def head_learning_rates(
    model: nn.Module,
    loss: nn.Module,
    by_class: Mapping[str, float] | None = None,
    default: float | None = None,
) -> dict[str, float]:
    """``learning_rate_mapping`` for the trainer: every parameter of a module that declares a ``learning_rate``
    (the modules our builders add: :class:`~st_extensions.modules.LinearAdapter`, the pEBR
    :class:`~st_extensions.modules.QueryDistributionHead`, :class:`~st_extensions.modules.MixtureOfLogits`,
    :class:`~st_extensions.modules.MultiBranchQueryEncoder`, the VarCE ``VariationalHead``) trains at that rate,
    or at ``default`` when given, or at ``by_class[<its class name>]`` for the classes named there (e.g.
    ``{"LinearAdapter": 3e-5}``; 0 keeps that module as built); the encoder keeps the trainer's rate. Keys are
    exact parameter names as the trainer sees them (through ``loss``)."""
    by_class = dict(by_class or {})
    declared = {type(m).__name__ for m in model.modules() if isinstance(getattr(type(m), "learning_rate", None), float)}
    unknown = sorted(set(by_class) - declared)
    if unknown:
        raise ValueError(
            f"module_learning_rates names {unknown}, not among the model's trained modules {sorted(declared)}"
        )
    rates: dict[int, float] = {}
    for m in model.modules():
        lr = getattr(type(m), "learning_rate", None)
        if isinstance(lr, float):
            lr = by_class.get(type(m).__name__, lr if default is None else default)
            for p in m.parameters():
                rates.setdefault(id(p), float(lr))
    return {f"^{re.escape(n)}$": rates[id(p)] for n, p in loss.named_parameters() if id(p) in rates}


def text_columns(train: Dataset) -> list[str]:
    """The columns a SentenceTransformer trains on, in order: ``anchor*``, ``positive*``, ``negative*``."""
    return [c for c in train.column_names if c.startswith(("anchor", "positive", "negative"))]


@contextlib.contextmanager
def _loss_on(loss: nn.Module, model: nn.Module, stand_in: nn.Module):
    """Point every ``.model`` of ``loss`` (and of its submodules) that is ``model`` at ``stand_in`` for a while."""
    swapped = [m for m in loss.modules() if getattr(m, "model", None) is model]
    for m in swapped:
        m.model = stand_in
    try:
        yield
    finally:
        for m in swapped:
            m.model = model


MODES = ("frozen", "partial", "full")

#: name of the file a checkpoint folder gets once every part of it is written (the marker of a complete checkpoint)
COMPLETE = "checkpoint_complete.json"


@dataclass
class Recipe:
    """Everything that decides how a model is fine-tuned, in one object (written beside every trained model).

    Attributes:
        mode: ``"frozen"``: only the modules a method adds train, on the encoder's pooled outputs computed once
            (:mod:`st_extensions.frozen`); ``"partial"``: the top ``train_layers`` transformer layers, the pooling and
            the added modules train on the lower layers' hidden states computed once and cached as fp16 memmaps
            (:mod:`st_extensions.partial`); ``"full"``: every parameter trains (the GPU path).
        steps: optimiser steps.
        batch_size: training rows per step and device (the global batch is ``batch_size`` times the world size).
        learning_rate: the encoder's rate (partial, full).
        module_learning_rates: module class name -> rate, overriding the rate a module's builder declared
            (e.g. ``{"LinearAdapter": 0.0}`` keeps the adapter as built).
        head_learning_rate: one rate for every added module instead of their declared ones (None: declared).
        learning_rate_mapping: regex on parameter names -> rate; overrides all of the above.
        warmup_ratio: linear warm-up over this share of the steps.
        seed: seed of the trainer, the batch sampler and the model's initialisation by the experiments.
        train_layers: partial only: how many of the top transformer layers train (1 .. the model's layer count).
        checkpoint_every: write a checkpoint every this many steps (0: none); needs an output folder.
        checkpoint_limit: keep at most this many checkpoints (the newest).
        gather_across_devices: the in-batch losses gather the candidates of every device (DDP), so each anchor sees
            the negatives of the global batch (see the losses' ``gather_across_devices``).
    """

    mode: str = "frozen"
    steps: int = 1000
    batch_size: int = 64
    learning_rate: float = 5e-5
    module_learning_rates: dict[str, float] = field(default_factory=dict)
    head_learning_rate: float | None = None
    learning_rate_mapping: dict[str, float] = field(default_factory=dict)
    warmup_ratio: float = 0.1
    seed: int = 0
    train_layers: int | None = None
    checkpoint_every: int = 0
    checkpoint_limit: int = 2
    gather_across_devices: bool = False

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field out of range."""
        if self.mode not in MODES:
            raise ValueError(f"Recipe.mode must be one of {MODES}, got {self.mode!r}")
        if not isinstance(self.steps, int) or self.steps <= 0:
            raise ValueError(f"Recipe.steps must be an int > 0, got {self.steps!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 2:
            raise ValueError(f"Recipe.batch_size must be an int >= 2, got {self.batch_size!r}")
        for name in ("learning_rate", "warmup_ratio"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Recipe.{name} must be a finite number >= 0, got {value!r}")
        if not self.warmup_ratio < 1:
            raise ValueError(f"Recipe.warmup_ratio must be below 1, got {self.warmup_ratio}")
        if self.mode == "partial":
            if not isinstance(self.train_layers, int) or self.train_layers < 1:
                raise ValueError(
                    f"Recipe.train_layers must be an int >= 1 under mode 'partial', got {self.train_layers!r}"
                )
        elif self.train_layers is not None:
            raise ValueError(f"Recipe.train_layers is for mode 'partial' only (mode {self.mode!r})")
        if not isinstance(self.checkpoint_every, int) or self.checkpoint_every < 0:
            raise ValueError(f"Recipe.checkpoint_every must be an int >= 0, got {self.checkpoint_every!r}")
        if not isinstance(self.checkpoint_limit, int) or self.checkpoint_limit < 1:
            raise ValueError(f"Recipe.checkpoint_limit must be an int >= 1, got {self.checkpoint_limit!r}")

    def describe(self) -> str:
        """One sentence saying what trains under this recipe, for reports (generated, never written by hand)."""
        what = {
            "frozen": "only the added modules train, on the encoder's outputs computed once",
            "partial": f"the top {self.train_layers} transformer layer(s), the pooling and the added modules train "
            "on the lower layers' states computed once",
            "full": "every parameter trains",
        }[self.mode]
        return (
            f"**{self.mode}** -- {what}; {self.steps} steps of {self.batch_size} at lr {self.learning_rate:g}"
            f"{'' if self.head_learning_rate is None else f' (added modules at {self.head_learning_rate:g})'}."
        )

    def to_dict(self) -> dict[str, Any]:
        """The recipe as JSON-ready values (what :meth:`save` writes)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Recipe:
        """A recipe from :meth:`to_dict`'s values; an unknown key is a ``ValueError`` naming it."""
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown Recipe fields {unknown}")
        return cls(**dict(values))

    def save(self, path: str) -> None:
        """Write the recipe to ``path`` as JSON (atomically)."""
        from pyterrier_prob.atomic import atomic_write

        atomic_write(path, json.dumps(self.to_dict(), indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: str) -> Recipe:
        """Read a recipe written by :meth:`save`."""
        with open(path, encoding="utf8") as f:
            return cls.from_dict(json.load(f))


def complete_checkpoints(folder: str) -> list[str]:
    """The complete checkpoints (``checkpoint-<step>`` folders holding the :data:`COMPLETE` marker) in ``folder``,
    oldest first. A checkpoint whose writing was interrupted has no marker and is not listed."""
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and os.path.isfile(os.path.join(folder, name, COMPLETE)):
            found.append((int(m.group(1)), os.path.join(folder, name)))
    return [p for _, p in sorted(found)]


def _pairs_of(train: Dataset) -> list[tuple[str, str]]:
    """The (query, document) pairs a cross-encoder trains on: ``query`` with ``document`` for (query, document,
    label) rows; else the first column with each further text column (e.g. ``query, positive, negative_1, ...`` for a
    listwise loss)."""
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
    """Sets the epoch of the :class:`~st_extensions.sampler.QueryBalancedBatchSampler` under the trainer's data
    loader at every epoch's start, from the step count as the trainer computes the epochs it has trained. The trainer
    sets it too, except in the epoch a multi-process run resumes in the middle of (there its ``set_epoch`` reaches
    accelerate's ``BatchSamplerShard``, not the sampler), which would otherwise be drawn as epoch 0."""

    def on_epoch_begin(self, args, state, control, train_dataloader=None, **kwargs):
        from st_extensions.sampler import QueryBalancedBatchSampler

        steps = len(train_dataloader) // max(1, args.gradient_accumulation_steps) if train_dataloader else 0
        inner = train_dataloader
        for _ in range(6):  # DataLoaderShard -> (SkipBatchSampler ->) BatchSamplerShard -> the sampler
            inner = getattr(inner, "batch_sampler", None)
            if inner is None or isinstance(inner, QueryBalancedBatchSampler):
                break
        if isinstance(inner, QueryBalancedBatchSampler) and steps:
            inner.set_epoch(state.global_step // steps)


class _MarkComplete(TrainerCallback):
    """Marks a checkpoint complete once the trainer has written all of it (weights, optimizer, scheduler, RNG,
    trainer state with the sampler's position): an interrupted write leaves no marker, and resuming skips it."""

    def on_save(self, args, state, control, **kwargs):
        from pyterrier_prob.atomic import atomic_write

        if state.is_world_process_zero:
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            atomic_write(os.path.join(folder, COMPLETE), json.dumps({"step": state.global_step}))


def _trainer_class(base: type) -> type:
    """``base`` (a sentence-transformers trainer) whose checkpoints hold the *real* model, not the training
    stand-in: under the frozen and partial recipes the trainer trains a stand-in (cached encoder outputs or lower
    layers) that shares its trained modules with the model; each checkpoint saves the model itself (an ordinary
    sentence-transformers folder, safetensors weights) and a resumed run loads its weights back into it."""

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


def _gather(loss: nn.Module) -> None:
    """Switch on ``gather_across_devices`` in every part of ``loss`` that has it; a loss without it is an error."""
    parts = [m for m in loss.modules() if hasattr(m, "gather_across_devices")]
    if not parts:
        raise ValueError(f"Recipe.gather_across_devices is set but {type(loss).__name__} cannot gather across devices")
    for m in parts:
        m.gather_across_devices = True


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
    """Train ``model`` in place under ``recipe`` (:class:`Recipe`: mode, steps, batch, rates, checkpoints).

    A :class:`~sentence_transformers.CrossEncoder` (e.g. a VarCrossEncoder) trains with
    :class:`~sentence_transformers.cross_encoder.CrossEncoderTrainer` on its ``(query, document, label)`` rows as
    given (shuffled, every column kept). Any other model trains with
    :class:`~sentence_transformers.SentenceTransformerTrainer` on query-balanced batches
    (:class:`~st_extensions.sampler.QueryBalancedBatchSampler`: distinct queries per global batch, each query's
    relevant documents cycled across epochs), linear warm-up. Only columns named ``anchor*``, ``positive*`` and
    ``negative*`` are trained on, in their order (so UniERF's ``anchor_<branch>`` / ``positive_doc`` /
    ``negative_<branch>`` layout passes), plus a ``label`` column (the :func:`~st_extensions.judged.pair_labels`
    keys with which the losses mask judged-relevant in-batch negatives).

    Modes: ``frozen`` trains only the added modules on the encoder's outputs of every training text computed once
    (:func:`st_extensions.frozen.cached_model`; ``encoder_cache`` reuses and extends a cache of the same encoder);
    ``partial`` trains the top ``recipe.train_layers`` layers, pooling and added modules on the lower layers'
    hidden states cached once in ``state_cache`` (a folder, reused across runs; default: under ``output_dir``, or
    a temporary folder; :func:`st_extensions.partial.partial_model`); ``full`` trains everything. In every mode the
    model is then saved and used exactly as after full training: no cache is needed.

    Learning rates: the encoder trains at ``recipe.learning_rate``; the parameters of every module a builder added
    train at that module's declared ``learning_rate`` (:func:`head_learning_rates`), or ``recipe.head_learning_rate``,
    or ``recipe.module_learning_rates[<class name>]``; ``recipe.learning_rate_mapping`` overrides all of them.

    Checkpoints (``recipe.checkpoint_every`` > 0, which needs ``output_dir``): every that many steps the trainer
    writes ``output_dir/checkpoint-<step>`` (the model's safetensors weights, optimizer, scheduler, RNG states and
    the trainer state, from which the batch sampler's position follows), keeping the newest
    ``recipe.checkpoint_limit``; a checkpoint counts once its :data:`COMPLETE` marker is written, last.
    ``resume=True`` continues from the newest complete checkpoint (none: from the start) and needs the recipe
    that wrote them (``output_dir/recipe.json``): the resumed run sees the same batches and ends with the same
    weights as an uninterrupted one.

    ``callbacks`` are added to the trainer (e.g. to evaluate on dev every few steps). Progress is one bar over the
    steps (``desc``, the running loss as postfix; none when ``show_progress`` is false).

    Returns:
        The logged training loss of every step (a resumed run: those its checkpoint recorded, then its own).
    """
    from sentence_transformers import CrossEncoder

    from st_extensions.sampler import QueryBalancedBatchSampler

    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a pyterrier_prob.training.Recipe, got {type(recipe).__name__}")
    recipe.check()
    if recipe.checkpoint_every and not output_dir:
        raise ValueError("Recipe.checkpoint_every needs output_dir: the folder the checkpoints go to")
    if resume and not output_dir:
        raise ValueError("resume=True needs output_dir: the folder holding the checkpoints")
    if recipe.gather_across_devices:
        _gather(loss)
    cross = isinstance(model, CrossEncoder)
    trained: nn.Module = model
    if cross:
        if recipe.mode == "frozen":
            raise ValueError("mode 'frozen' is for SentenceTransformer models (the VarCE head: varce.frozen)")
        from sentence_transformers.cross_encoder import CrossEncoderTrainer as Trainer
        from sentence_transformers.cross_encoder import CrossEncoderTrainingArguments as Arguments

        sampler = {}
    else:
        Trainer, Arguments = SentenceTransformerTrainer, SentenceTransformerTrainingArguments
        sampler = {"batch_sampler": QueryBalancedBatchSampler}
        keep = text_columns(train) + (["label"] if "label" in train.column_names else [])
        train = train.select_columns(keep)
    # which checkpoint to resume from (or a refusal, for another recipe) before any cache is built
    checkpoint = _resume_point(output_dir, recipe) if resume else None
    with tempfile.TemporaryDirectory() as tmp:
        if recipe.mode == "frozen":
            from st_extensions.frozen import cached_model

            # encode's inner "Batches" bar only where library bars are wanted (not the command line's default)
            encode_bar = show_progress and library_bars()
            trained = cached_model(model, _texts_of(train), show_progress_bar=encode_bar, cache=encoder_cache)
        elif recipe.mode == "partial" and isinstance(model[0], SplitTransformer):
            # a split-attention cross-encoder: its lower layers read each text alone, so they are cached per text
            # (not per pair) and the joint top layers and the head train on them
            if recipe.train_layers != model[0].joint_layers:
                raise ValueError(
                    f"a SplitTransformer with {model[0].joint_layers} joint layers trains those under 'partial': "
                    f"got train_layers={recipe.train_layers}"
                )
            trainable = {id(p): p.requires_grad for p in model.parameters()}  # given back after training
            folder = state_cache or os.path.join(output_dir or tmp, "states")
            texts = list(dict.fromkeys(t for pair in _pairs_of(train) for t in pair))
            split_state_cache(model, folder, texts, show_progress_bar=show_progress)
        elif recipe.mode == "partial":
            from st_extensions.partial import partial_model

            trainable = {id(p): p.requires_grad for p in model.parameters()}  # given back after training
            folder = state_cache or os.path.join(output_dir or tmp, "states")
            texts = _pairs_of(train) if cross else _texts_of(train)
            trained = partial_model(
                model, recipe.train_layers, texts, cache_dir=folder, show_progress_bar=show_progress
            )
        run_dir = output_dir or os.path.join(tmp, "run")
        if output_dir and not resume:
            _clear_checkpoints(run_dir)
        if output_dir:
            os.makedirs(run_dir, exist_ok=True)
            recipe.save(os.path.join(run_dir, "recipe.json"))
        swap = _loss_on(loss, model, trained) if trained is not model else contextlib.nullcontext()
        with swap:
            # names as the trainer sees them, through the (swapped) loss
            mapping = head_learning_rates(model, loss, recipe.module_learning_rates, recipe.head_learning_rate)
            mapping.update(recipe.learning_rate_mapping)
            saving = (
                {
                    "save_strategy": "steps",
                    "save_steps": recipe.checkpoint_every,
                    "save_total_limit": recipe.checkpoint_limit,
                }
                if recipe.checkpoint_every
                else {"save_strategy": "no"}
            )
            args = Arguments(
                output_dir=run_dir,
                max_steps=recipe.steps,
                per_device_train_batch_size=recipe.batch_size,
                learning_rate=recipe.learning_rate,
                learning_rate_mapping=mapping,
                warmup_steps=recipe.warmup_ratio,  # a float below 1 is a ratio of the steps (transformers >= 5)
                seed=recipe.seed,
                report_to="none",
                **saving,
                logging_steps=1,
                disable_tqdm=True,
                **sampler,
                dataloader_drop_last=True,
                dataloader_pin_memory=torch.cuda.is_available(),
                **_ddp_arguments(),
            )
            # the model-card callback draws its own "Computing widget examples" bar while the trainer is made
            shown = show_progress and library_bars()
            quiet = contextlib.nullcontext() if shown else contextlib.redirect_stderr(io.StringIO())
            with quiet:
                trainer = _trainer_class(Trainer)(model=trained, args=args, train_dataset=train, loss=loss)
            trainer.real_model = model
            for cb in (PrinterCallback, ProgressCallback):
                trainer.remove_callback(cb)
            trainer.add_callback(_LossBar(show_progress, desc))
            trainer.add_callback(_MarkComplete())
            trainer.add_callback(_SamplerEpoch())
            for cb in callbacks:
                trainer.add_callback(cb)
            try:
                trainer.train(resume_from_checkpoint=checkpoint)
            finally:
                if recipe.mode == "partial":  # the lower layers were frozen for the run only
                    for p in model.parameters():
                        p.requires_grad_(trainable.get(id(p), p.requires_grad))
                    if isinstance(model[0], SplitTransformer) and not (state_cache or output_dir):
                        model[0].state_cache = None  # its folder is the temporary one, removed below
    model.eval()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def _ddp_arguments() -> dict[str, Any]:
    """Trainer arguments for several processes (torchrun / accelerate launch): DDP's static graph, and without a
    GPU the CPU flag and gloo (accelerate runs DDP on CPU processes only when told they are CPU ones; otherwise each
    would train alone on its shard)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return {}
    # our losses run the model more than once per step (queries, then documents, which skip the query-side heads) and
    # read heads outside the DDP forward, and the encoder has parameters no loss uses (BERT's pooler): DDP's search
    # for unused parameters marks a head left out of one forward ready there and again in backward. The graph is the
    # same at every step, which DDP's static-graph mode is made for (unused and multiply used parameters alike).
    ddp = {"ddp_static_graph": True}
    return ddp if torch.cuda.is_available() else {**ddp, "use_cpu": True, "ddp_backend": "gloo"}


def _clear_checkpoints(folder: str) -> None:
    """Remove the checkpoints of an earlier run in ``folder`` (a fresh run must not mix with them)."""
    import shutil

    if os.path.isdir(folder):
        for name in os.listdir(folder):
            if re.fullmatch(r"checkpoint-\d+", name):
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)


def _resume_point(folder: str, recipe: Recipe) -> str | None:
    """The newest complete checkpoint in ``folder`` written under ``recipe`` (None: start afresh); checkpoints
    newer than it (interrupted writes) are removed so the trainer's rotation never keeps them over it."""
    import shutil

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
    newest = done[-1]
    step = int(newest.rsplit("-", 1)[1])
    for name in os.listdir(folder):
        m = re.fullmatch(r"checkpoint-(\d+)", name)
        if m and int(m.group(1)) > step:
            shutil.rmtree(os.path.join(folder, name), ignore_errors=True)
    return newest
