"""QueryBalancedBatchSampler under accelerate's sharding: every global batch (the W batches of one optimizer step)
holds distinct queries, and an epoch covers each query at most once over all ranks."""

from __future__ import annotations

from collections import Counter

import pytest
from accelerate.data_loader import BatchSamplerShard
from datasets import Dataset

from st_extensions.judged import pair_labels
from st_extensions.sampler import QueryBalancedBatchSampler


def _dataset(n_queries: int, label: bool = True) -> tuple[Dataset, list[str]]:
    """Query q has 1 + q % 3 rows (its relevant documents)."""
    anchors, positives = [], []
    for q in range(n_queries):
        for d in range(1 + q % 3):
            anchors.append(f"query {q}")
            positives.append(f"document {q}-{d}")
    columns = {"anchor": anchors, "positive": positives}
    if label:
        columns["label"] = pair_labels(anchors, positives)
    return Dataset.from_dict(columns), anchors


def _global_batches(dataset: Dataset, world: int, batch_size: int, drop_last: bool, epoch: int, seed: int = 0):
    """The global batches of one epoch as accelerate gives them: one sampler per rank (same seed, as every rank of a
    DDP run builds its own), set to ``epoch`` as the trainer does, wrapped in ``BatchSamplerShard`` with the defaults
    (split_batches=False, even_batches=True); step s is every rank's s-th batch. With one process accelerate leaves
    the batch sampler as it is (``prepare_data_loader``: "No change if no multiprocess"); wrapped, it is the same
    whenever the epoch has no partial batch."""
    per_rank = []
    for rank in range(world):
        sampler = QueryBalancedBatchSampler(dataset, batch_size, drop_last, seed=seed, world_size=world)
        sampler.set_epoch(epoch)
        shard = BatchSamplerShard(sampler, num_processes=world, process_index=rank)
        batches = list(shard)
        assert len(batches) == len(shard)
        if world == 1:
            sampler.set_epoch(epoch)
            plain = list(sampler)
            if drop_last or len(dataset.unique("anchor")) % batch_size == 0:
                assert batches == plain
            batches = plain
        per_rank.append(batches)
    assert len({len(b) for b in per_rank}) == 1  # every rank takes as many steps
    return [[row for rank_batches in per_rank for row in rank_batches[step]] for step in range(len(per_rank[0]))]


# (n_queries, batch_size): a whole number of rounds; a remainder round; a partial last batch; fewer batches than
# 4 ranks (3 full batches of 2 and one of 1: accelerate would pad from the epoch's start); exactly one global batch
CASES = [(24, 3), (22, 3), (23, 4), (7, 2), (8, 2)]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize(("n_queries", "batch_size"), CASES)
def test_global_batches_hold_distinct_queries(world, drop_last, n_queries, batch_size):
    dataset, anchors = _dataset(n_queries)
    if n_queries < world * batch_size:
        with pytest.raises(ValueError, match="distinct queries"):
            QueryBalancedBatchSampler(dataset, batch_size, drop_last, world_size=world)
        return
    for epoch in range(4):
        steps = _global_batches(dataset, world, batch_size, drop_last, epoch)
        assert steps, "an epoch has at least one step"
        for rows in steps:
            queries = [anchors[i] for i in rows]
            assert len(set(queries)) == len(queries), f"repeated query in a global batch: {queries}"
            if world > 1:
                assert len(rows) == world * batch_size  # full batches on every rank
        per_query = Counter(anchors[i] for rows in steps for i in rows)
        assert max(per_query.values()) == 1  # each query at most once per epoch over all ranks
        if world > 1:  # only the remainder round (< W * batch_size queries) is left out
            assert n_queries - len(per_query) < world * batch_size


def test_the_unfixed_shard_would_repeat_queries():
    """What the multiple-of-W epoch prevents: 7 queries in batches of 2 on 4 ranks with a sampler that does not know
    the world size (as before): accelerate pads the round with the epoch's first rows, so the global batch repeats
    queries."""
    dataset, anchors = _dataset(7)
    rows = []
    for rank in range(4):
        sampler = QueryBalancedBatchSampler(dataset, 2, False, world_size=1)
        sampler.set_epoch(0)
        rows += list(BatchSamplerShard(sampler, num_processes=4, process_index=rank))[0]
    assert len(rows) == 8 and len({anchors[i] for i in rows}) < len(rows)


def test_world_size_defaults_to_the_distributed_state(monkeypatch):
    import st_extensions.sampler as sampler_module

    dataset, _ = _dataset(12)
    assert QueryBalancedBatchSampler(dataset, 4, True).world_size == 1
    monkeypatch.setattr(sampler_module, "data_parallel_world_size", lambda: 2)
    sampler = QueryBalancedBatchSampler(dataset, 4, False)
    assert sampler.world_size == 2 and len(sampler) == 2  # one round of 2 x 4 queries; 4 left out
    with pytest.raises(ValueError, match="3 processes x batch_size=5"):
        QueryBalancedBatchSampler(dataset, 5, True, world_size=3)
    with pytest.raises(ValueError, match="world_size"):
        QueryBalancedBatchSampler(dataset, 4, True, world_size=0)


def test_epoch_comes_from_set_epoch_so_a_resumed_run_draws_the_same_batches():
    dataset, _ = _dataset(20)
    uninterrupted = QueryBalancedBatchSampler(dataset, 4, True, seed=5)
    epochs = [list(uninterrupted) for _ in range(4)]  # no set_epoch: successive __iter__ calls are epochs 0, 1, ...
    assert len({str(e) for e in epochs}) == 4
    trainer_driven = QueryBalancedBatchSampler(dataset, 4, True, seed=5)
    for epoch in range(4):
        trainer_driven.set_epoch(epoch)
        assert list(trainer_driven) == epochs[epoch]
    resumed = QueryBalancedBatchSampler(dataset, 4, True, seed=5)  # a fresh process resuming at epoch 2
    resumed.set_epoch(2)
    assert list(resumed) == epochs[2]
    assert list(resumed) == epochs[3]  # and, without set_epoch, on to the next
    # under sharding the ranks of a resumed run draw what they drew uninterrupted
    for rank in range(2):
        a = QueryBalancedBatchSampler(dataset, 4, True, seed=5, world_size=2)
        a.set_epoch(3)
        b = QueryBalancedBatchSampler(dataset, 4, True, seed=5, world_size=2)
        for epoch in range(4):
            b.set_epoch(epoch)
            last = list(BatchSamplerShard(b, 2, rank))
        assert list(BatchSamplerShard(a, 2, rank)) == last
