"""Fine-tuning with the sentence-transformers trainers on a fixed step budget (the experiments and benchmarks)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import tempfile
from collections.abc import Mapping, Sequence

import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from torch import nn
from tqdm.auto import tqdm
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from st_extensions.frozen import CachedEmbeddings

__all__ = ["fine_tune", "head_learning_rates", "text_columns"]


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


def fine_tune(
    model: SentenceTransformer,
    loss: nn.Module,
    train: Dataset,
    steps: int,
    batch_size: int = 16,
    learning_rate: float = 5e-5,
    seed: int = 0,
    output_dir: str | None = None,
    show_progress: bool = True,
    learning_rate_mapping: dict[str, float] | None = None,
    desc: str = "training",
    frozen: bool = False,
    head_learning_rate: float | None = None,
    encoder_cache: CachedEmbeddings | None = None,
    callbacks: Sequence[TrainerCallback] = (),
    module_learning_rates: Mapping[str, float] | None = None,
) -> list[float]:
    """Train ``model`` in place for ``steps`` optimiser steps of ``batch_size`` training rows.

    A :class:`~sentence_transformers.CrossEncoder` (e.g. a VarCrossEncoder) trains with
    :class:`~sentence_transformers.cross_encoder.CrossEncoderTrainer` on its ``(query, document, label)`` rows as
    given (shuffled, every column kept). Any other model trains with
    :class:`~sentence_transformers.SentenceTransformerTrainer` on query-balanced batches
    (:class:`~st_extensions.sampler.QueryBalancedBatchSampler`: distinct queries per batch, each query's relevant
    documents cycled across epochs), 10% linear warm-up, no checkpoints. Only columns named ``anchor*``,
    ``positive*`` and ``negative*`` are trained on, in their order (so UniERF's ``anchor_<branch>`` /
    ``positive_doc`` / ``negative_<branch>`` layout passes), plus a ``label`` column (the
    :func:`~st_extensions.judged.pair_labels` keys with which the losses mask judged-relevant in-batch negatives).

    Learning rates: the encoder trains at ``learning_rate``; the parameters of every module a builder added train
    at that module's declared ``learning_rate`` (:func:`head_learning_rates`), or at ``head_learning_rate`` when
    given, or at ``module_learning_rates[<module class name>]`` for the classes it names (a recipe's choice, e.g.
    ``{"LinearAdapter": 0.0}``); ``learning_rate_mapping`` (regex on parameter names -> learning rate) overrides
    all of them.

    ``frozen=True`` trains only the added modules, on the encoder outputs of every training text computed once
    (:func:`st_extensions.frozen.cached_model`; ``encoder_cache`` reuses and extends a cache of the same encoder);
    the model is then saved and used exactly as after full training.

    ``callbacks`` are added to the trainer (e.g. to evaluate on dev every few steps).

    Progress is one bar over the steps (``desc``, the running loss as postfix; none when ``show_progress`` is
    false), never a printed line per step.

    Returns:
        The logged training loss of every step.
    """
    if steps <= 0 or batch_size <= 1:
        raise ValueError(f"steps must be > 0 and batch_size > 1, got steps={steps}, batch_size={batch_size}")
    from sentence_transformers import CrossEncoder

    from st_extensions.sampler import QueryBalancedBatchSampler

    cross = isinstance(model, CrossEncoder)
    trained: nn.Module = model
    if cross:
        if frozen:
            raise ValueError("frozen=True is for SentenceTransformer models (the VarCE head: varce.frozen)")
        from sentence_transformers.cross_encoder import CrossEncoderTrainer as Trainer
        from sentence_transformers.cross_encoder import CrossEncoderTrainingArguments as Arguments

        sampler = {}
    else:
        Trainer, Arguments = SentenceTransformerTrainer, SentenceTransformerTrainingArguments
        sampler = {"batch_sampler": QueryBalancedBatchSampler}
        keep = text_columns(train) + (["label"] if "label" in train.column_names else [])
        train = train.select_columns(keep)
        if frozen:
            from st_extensions.frozen import cached_model

            texts = [t for c in text_columns(train) for t in train[c]]
            trained = cached_model(model, texts, show_progress_bar=show_progress, cache=encoder_cache)
    swap = _loss_on(loss, model, trained) if trained is not model else contextlib.nullcontext()
    with tempfile.TemporaryDirectory() as tmp, swap:
        # names as the trainer sees them, through the (swapped) loss
        mapping = head_learning_rates(model, loss, module_learning_rates, head_learning_rate)
        mapping.update(learning_rate_mapping or {})
        args = Arguments(
            output_dir=output_dir or os.path.join(tmp, "run"),
            max_steps=steps,
            per_device_train_batch_size=batch_size,
            learning_rate=learning_rate,
            learning_rate_mapping=mapping,
            warmup_steps=0.1,  # a float below 1 is a ratio of the steps (transformers >= 5)
            seed=seed,
            report_to="none",
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            **sampler,
            dataloader_drop_last=True,
            dataloader_pin_memory=torch.cuda.is_available(),
        )
        # the model-card callback draws its own "Computing widget examples" bar while the trainer is made
        quiet = contextlib.nullcontext() if show_progress else contextlib.redirect_stderr(io.StringIO())
        with quiet:
            trainer = Trainer(model=trained, args=args, train_dataset=train, loss=loss)
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        trainer.add_callback(_LossBar(show_progress, desc))
        for cb in callbacks:
            trainer.add_callback(cb)
        trainer.train()
    model.eval()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]
