"""Fine-tuning with the sentence-transformers trainers on a fixed step budget (the experiments and benchmarks)."""

from __future__ import annotations

import contextlib
import io
import os
import tempfile

import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.base.sampler import BatchSamplers
from torch import nn
from tqdm.auto import tqdm
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

__all__ = ["fine_tune"]


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
) -> list[float]:
    """Train ``model`` in place for ``steps`` optimiser steps of ``batch_size`` training rows.

    A :class:`~sentence_transformers.CrossEncoder` (e.g. a VarCrossEncoder) trains with
    :class:`~sentence_transformers.cross_encoder.CrossEncoderTrainer` on its ``(query, document, label)`` rows as
    given (shuffled, every column kept). Any other model trains with
    :class:`~sentence_transformers.SentenceTransformerTrainer` with ``BatchSamplers.NO_DUPLICATES``
    (a query with many relevant documents never meets itself as an in-batch negative), 10% linear warm-up,
    no checkpoints. Only columns named ``anchor*``, ``positive*`` and ``negative*`` are kept, in their order (so
    UniERF's ``anchor_<branch>`` / ``positive_doc`` / ``negative_<branch>`` layout passes; ``qid`` is dropped).
    ``learning_rate_mapping`` (regex on parameter names -> learning rate) trains new heads faster than the encoder.
    Progress is one bar over the steps (``desc``, the running loss as postfix; none when ``show_progress`` is
    false), never a printed line per step.

    Returns:
        The logged training loss of every step.
    """
    if steps <= 0 or batch_size <= 1:
        raise ValueError(f"steps must be > 0 and batch_size > 1, got steps={steps}, batch_size={batch_size}")
    from sentence_transformers import CrossEncoder

    cross = isinstance(model, CrossEncoder)
    if cross:
        from sentence_transformers.cross_encoder import CrossEncoderTrainer as Trainer
        from sentence_transformers.cross_encoder import CrossEncoderTrainingArguments as Arguments

        sampler = {}
    else:
        Trainer, Arguments = SentenceTransformerTrainer, SentenceTransformerTrainingArguments
        sampler = {"batch_sampler": BatchSamplers.NO_DUPLICATES}
        keep = [c for c in train.column_names if c.startswith(("anchor", "positive", "negative"))]
        train = train.select_columns(keep)
    with tempfile.TemporaryDirectory() as tmp:
        args = Arguments(
            output_dir=output_dir or os.path.join(tmp, "run"),
            max_steps=steps,
            per_device_train_batch_size=batch_size,
            learning_rate=learning_rate,
            learning_rate_mapping=learning_rate_mapping or {},
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
            trainer = Trainer(model=model, args=args, train_dataset=train, loss=loss)
        for cb in (PrinterCallback, ProgressCallback):
            trainer.remove_callback(cb)
        trainer.add_callback(_LossBar(show_progress, desc))
        trainer.train()
    model.eval()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]
