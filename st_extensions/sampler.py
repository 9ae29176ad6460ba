"""Query-balanced batches for the sentence-transformers trainer: distinct queries, relevant documents cycled.

Drawing training pairs uniformly lets broad queries dominate (on nfcorpus/train 56% of the pairs come from the
broadest 10% of the queries) and puts a query beside itself in a batch, where its own relevant documents become
its negatives. :class:`QueryBalancedBatchSampler` makes every epoch one pass over the *queries*: each query gives
one row, its next relevant document (each query's rows are cycled across epochs in a seeded order), and the
queries are shuffled and cut into batches, so the queries of a batch are distinct.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch
from datasets import Dataset
from sentence_transformers.base.sampler import DefaultBatchSampler

from st_extensions.distributed import data_parallel_world_size

__all__ = ["QueryBalancedBatchSampler", "query_groups"]


def query_groups(dataset: Dataset) -> list[list[int]]:
    """Row indices of ``dataset`` grouped by query, in first-appearance order: by the ``label`` column's first
    entry (the query key of :func:`st_extensions.judged.pair_labels`) when there is one, else by the first
    column's text."""
    if "label" in dataset.column_names and isinstance(dataset[0]["label"], (list, tuple)):
        keys = [row[0] for row in dataset["label"]]
    else:
        keys = dataset[dataset.column_names[0]]
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


class QueryBalancedBatchSampler(DefaultBatchSampler):
    """Batches of distinct queries; one row per query per epoch, each query's rows cycled across epochs.

    Pass the class as ``SentenceTransformerTrainingArguments(batch_sampler=QueryBalancedBatchSampler)``. On one
    process an epoch has ``n_queries // batch_size`` batches (one more, partial, without ``drop_last``).

    Under several processes (accelerate / torchrun DDP) the trainer wraps the sampler in accelerate's
    ``BatchSamplerShard``: rank r takes batches r, r + W, r + 2W, ... and one optimizer step sees W batches, the
    global batch. The queries are then kept distinct across the global batch: an epoch is the largest whole number of
    rounds of W full batches, ``(n_queries // (W * batch_size)) * W`` batches (the remainder, a different set of
    queries each epoch, is left out, whatever ``drop_last``), so the shard never pads the last round with batches from
    the epoch's start, which would repeat queries within a global batch (when an epoch has fewer than W batches) and
    within the epoch.

    The epoch is the one the trainer sets (:meth:`set_epoch`, called before every epoch, also when a run resumes
    from a checkpoint); without ``set_epoch`` every ``__iter__`` starts the next epoch (0, 1, 2, ...). Under several
    processes transformers does not reach this sampler in the epoch a run resumes in the middle of (its ``set_epoch``
    goes to accelerate's ``BatchSamplerShard`` after ``skip_first_batches``); :func:`pyterrier_prob.training.fine_tune`
    adds a callback that sets the epoch through the wrappers at every epoch's start. A bare trainer that resumes a
    multi-process run mid-epoch draws that one epoch as epoch 0.

    Args:
        dataset: the training rows; grouped by query (:func:`query_groups`).
        batch_size: rows per batch (per process).
        drop_last: on one process, leave out the last, partial batch.
        valid_label_columns: as for ``DefaultBatchSampler`` (unused).
        generator: as for ``DefaultBatchSampler`` (unused: the order follows ``seed`` and the epoch).
        seed: seeds the query order of every epoch and each query's document cycle.
        world_size: W, the number of processes the batches are sharded over; ``None``: accelerate's, else
            torch.distributed's (:func:`st_extensions.distributed.data_parallel_world_size`), 1 when not distributed.

    Raises:
        ValueError: fewer distinct queries than ``world_size * batch_size`` (a global batch of distinct queries
            cannot be filled).
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        drop_last: bool,
        valid_label_columns: list[str] | None = None,
        generator: torch.Generator | None = None,
        seed: int = 0,
        world_size: int | None = None,
    ) -> None:
        super().__init__(
            dataset,
            batch_size=batch_size,
            drop_last=drop_last,
            valid_label_columns=valid_label_columns,
            generator=generator,
            seed=seed,
        )
        if world_size is None:
            world_size = data_parallel_world_size()
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        self.world_size = world_size
        self.groups = query_groups(dataset)
        if len(self.groups) < world_size * batch_size:
            if world_size > 1:
                raise ValueError(
                    f"the training data has {len(self.groups)} distinct queries, fewer than {world_size} processes x "
                    f"batch_size={batch_size}: a global batch of distinct queries cannot be filled (lower the batch "
                    "size or the number of processes)"
                )
            raise ValueError(
                f"the training data has {len(self.groups)} distinct queries, fewer than batch_size={batch_size}: "
                "a batch of distinct queries cannot be filled (lower the batch size)"
            )
        rng = random.Random(seed)
        for rows in self.groups:
            rng.shuffle(rows)  # each query's own cycle order

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next ``__iter__`` draws (the trainer calls it before every epoch)."""
        super().set_epoch(int(epoch))

    def __len__(self) -> int:
        n = len(self.groups)
        if self.world_size > 1:
            return n // (self.world_size * self.batch_size) * self.world_size
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """The batches of ``epoch`` (all of them, before any sharding over processes)."""
        rng = random.Random(self.seed * 1_000_003 + epoch)
        order = list(range(len(self.groups)))
        rng.shuffle(order)
        rows = [self.groups[g][epoch % len(self.groups[g])] for g in order]
        batches = [rows[start : start + self.batch_size] for start in range(0, len(rows), self.batch_size)]
        return batches[: len(self)]

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        self.epoch = epoch + 1  # the next __iter__ without set_epoch draws the next epoch
        return iter(self.epoch_batches(epoch))
