"""Fine-tuning with the sentence-transformers trainer on a fixed step budget (used by the CLI and benchmarks)."""

from __future__ import annotations

import os
import tempfile

import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.base.sampler import BatchSamplers
from torch import nn


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
) -> list[float]:
    """Train ``model`` in place for ``steps`` optimiser steps of ``batch_size`` (anchor, positive) pairs.

    Uses :class:`~sentence_transformers.SentenceTransformerTrainer` with ``BatchSamplers.NO_DUPLICATES``
    (a query with many relevant documents never meets itself as an in-batch negative), 10% linear warm-up,
    no checkpoints. Only columns named ``anchor*``, ``positive*`` and ``negative*`` are kept, in their order (so
    UniERF's ``anchor_<branch>`` / ``positive_doc`` / ``negative_<branch>`` layout passes; ``qid`` is dropped).
    ``learning_rate_mapping`` (regex on parameter names -> learning rate) trains new heads faster than the encoder.

    Returns:
        The logged training loss of every step.
    """
    if steps <= 0 or batch_size <= 1:
        raise ValueError(f"steps must be > 0 and batch_size > 1, got steps={steps}, batch_size={batch_size}")
    keep = [c for c in train.column_names if c.startswith(("anchor", "positive", "negative"))]
    train = train.select_columns(keep)
    with tempfile.TemporaryDirectory() as tmp:
        args = SentenceTransformerTrainingArguments(
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
            batch_sampler=BatchSamplers.NO_DUPLICATES,
            disable_tqdm=not show_progress,
            dataloader_drop_last=True,
            dataloader_pin_memory=torch.cuda.is_available(),
        )
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train, loss=loss)
        trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]
