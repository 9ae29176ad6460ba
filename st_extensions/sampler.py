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

    Pass the class as ``SentenceTransformerTrainingArguments(batch_sampler=QueryBalancedBatchSampler)``. An epoch
    has ``n_queries // batch_size`` batches (one more, partial, without ``drop_last``).

    Raises:
        ValueError: fewer distinct queries than ``batch_size``.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        drop_last: bool,
        valid_label_columns: list[str] | None = None,
        generator: torch.Generator | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(
            dataset,
            batch_size=batch_size,
            drop_last=drop_last,
            valid_label_columns=valid_label_columns,
            generator=generator,
            seed=seed,
        )
        self.groups = query_groups(dataset)
        if len(self.groups) < batch_size:
            raise ValueError(
                f"the training data has {len(self.groups)} distinct queries, fewer than batch_size={batch_size}: "
                "a batch of distinct queries cannot be filled (lower the batch size)"
            )
        rng = random.Random(seed)
        for rows in self.groups:
            rng.shuffle(rows)  # each query's own cycle order
        self._passes = 0

    def __len__(self) -> int:
        n = len(self.groups)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self._passes
        self._passes += 1
        rng = random.Random(self.seed * 1_000_003 + epoch)
        order = list(range(len(self.groups)))
        rng.shuffle(order)
        rows = [self.groups[g][epoch % len(self.groups[g])] for g in order]
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start : start + self.batch_size]
            if len(batch) < self.batch_size and self.drop_last:
                return
            yield batch
