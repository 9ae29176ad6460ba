"""Query-balanced batches for the sentence-transformers trainer: every epoch one pass over the distinct queries, one
row each with its next relevant document (cycled across epochs), so that broad queries do not dominate and a batch
never holds a query twice (``docs/recipes.md``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch
from datasets import Dataset
from sentence_transformers.base.sampler import DefaultBatchSampler

from st_extensions.checks import positive_int
from st_extensions.distributed import data_parallel_world_size

__all__ = ["QueryBalancedBatchSampler", "query_groups"]


def query_groups(dataset: Dataset) -> list[list[int]]:
    """Row indices of ``dataset`` grouped by query, in first-appearance order: by the ``label`` column's first entry
    (the query key of :func:`st_extensions.judged.pair_labels`) when there is one, else by the first column's text."""
    if "label" in dataset.column_names and isinstance(dataset[0]["label"], (list, tuple)):
        keys = [row[0] for row in dataset["label"]]
    else:
        keys = dataset[dataset.column_names[0]]
    groups: dict = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return list(groups.values())


class QueryBalancedBatchSampler(DefaultBatchSampler):
    """Batches of distinct queries; one row per query per epoch, its rows cycled across epochs (order by ``seed``).

    Use as ``SentenceTransformerTrainingArguments(batch_sampler=QueryBalancedBatchSampler)``. One process: an epoch has
    ``n_queries // batch_size`` batches (+1 partial without ``drop_last``); W processes (``world_size``, default
    :func:`st_extensions.distributed.data_parallel_world_size`): ``(n_queries // (W * batch_size)) * W``, so a global
    batch's queries stay distinct. The epoch is the trainer's (:meth:`set_epoch`), else each ``__iter__`` starts the
    next. ``valid_label_columns`` and ``generator`` are unused. ValueError: fewer queries than ``world_size *
    batch_size``."""

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
        super().__init__(dataset, batch_size, drop_last, valid_label_columns, generator, seed)
        world_size = positive_int("world_size", data_parallel_world_size() if world_size is None else world_size)
        self.world_size = world_size
        self.groups = query_groups(dataset)
        if len(self.groups) < world_size * batch_size:
            many = world_size > 1
            limit = f"{world_size} processes x batch_size={batch_size}" if many else f"batch_size={batch_size}"
            fix = "the batch size or the number of processes" if many else "the batch size"
            raise ValueError(
                f"the training data has {len(self.groups)} distinct queries, fewer than {limit}: a "
                f"{'global ' if many else ''}batch of distinct queries cannot be filled (lower {fix})"
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
