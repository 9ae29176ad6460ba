"""In-batch losses across devices (DDP): the global batch one rank's loss sees, and the collectives it needs.

With ``gather_across_devices=True`` the mean of the ranks' losses is the one-process loss on the global batch, as
``MultipleNegativesRankingLoss(..., gather_across_devices=True)``; without an initialised ``torch.distributed``
nothing is gathered (``docs/recipes.md``).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "GlobalBatch",
    "all_gather_no_grad",
    "all_gather_with_grad",
    "all_reduce_sum",
    "data_parallel_world_size",
    "global_batch",
    "rank",
    "world_size",
]


def _initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """The number of processes of ``torch.distributed``'s default group; 1 when it is not initialised."""
    return dist.get_world_size() if _initialised() else 1


def rank() -> int:
    """This process's rank in ``torch.distributed``'s default group; 0 when it is not initialised."""
    return dist.get_rank() if _initialised() else 0


def data_parallel_world_size() -> int:
    """The number of processes the trainer shards the batches over: accelerate's ``PartialState`` when it is
    initialised (the trainer's accelerator), else ``torch.distributed``'s world size, else 1."""
    try:
        from accelerate.state import PartialState
    except ImportError:  # pragma: no cover - accelerate comes with the trainer
        return world_size()
    return int(PartialState().num_processes) if PartialState._shared_state != {} else world_size()


@contextmanager
def _autograd_collectives() -> Iterator[None]:
    """``torch.distributed.nn``'s differentiable collectives, without the FutureWarning recent torch versions give for
    them (their suggested replacements are in a private module)."""
    import torch.distributed.nn  # noqa: F401 -- makes torch.distributed.nn available

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional", category=FutureWarning)
        yield


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: gloo's all_gather backward scatters a permuted-layout
    gradient as if contiguous, scrambling it (pytorch/pytorch#24836, #192920); NCCL refuses it."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def all_gather_with_grad(tensor: Tensor) -> Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order; the gradient of each rank's slice flows back to
    that rank's tensor, summed over the ranks whose losses used it (``torch.distributed.nn.all_gather``). A tensor that
    needs no gradient is gathered without. Without distribution: ``tensor`` itself."""
    if world_size() == 1:
        return tensor
    if not tensor.requires_grad:
        return all_gather_no_grad(tensor)
    with _autograd_collectives():
        parts = torch.distributed.nn.all_gather(tensor.contiguous())
    return torch.cat([_ContiguousGrad.apply(p) for p in parts], dim=0)


def all_gather_no_grad(tensor: Tensor) -> Tensor:
    """Every rank's ``tensor`` concatenated along dim 0 in rank order, without gradient (e.g. the ``label`` keys).
    Without distribution: ``tensor`` itself."""
    if world_size() == 1:
        return tensor
    tensor = tensor.detach().contiguous()
    parts = [torch.empty_like(tensor) for _ in range(world_size())]
    dist.all_gather(parts, tensor)
    return torch.cat(parts, dim=0)


def all_reduce_sum(tensor: Tensor) -> Tensor:
    """The sum of ``tensor`` over the ranks, differentiable: the gradient of every rank's use of the sum flows back to
    each rank's summand (``torch.distributed.nn.all_reduce``); without gradient for a tensor that needs none.
    Without distribution: ``tensor`` itself."""
    if world_size() == 1:
        return tensor
    if not tensor.requires_grad:
        out = tensor.detach().clone()
        dist.all_reduce(out)
        return out
    with _autograd_collectives():
        return torch.distributed.nn.all_reduce(tensor)


@dataclass(frozen=True)
class GlobalBatch:
    """One rank's view of the global batch: ``size`` B rows per rank, ``world_size`` ranks (1: no gathering), ``rank``,
    whose rows are ``rank * B .. rank * B + B - 1`` of the global batch."""

    size: int
    world_size: int = 1
    rank: int = 0

    @property
    def gathers(self) -> bool:
        """Whether the loss gathers across ranks (more than one rank)."""
        return self.world_size > 1

    @property
    def offset(self) -> int:
        """The global row of this rank's first anchor."""
        return self.rank * self.size

    def targets(self, device: torch.device | str | None = None) -> Tensor:
        """The column of each local anchor's positive among the gathered candidates: ``offset + arange(B)``."""
        return torch.arange(self.offset, self.offset + self.size, device=device)

    def candidates(self, columns: Tensor) -> Tensor:
        """The global candidates from this rank's ``columns`` (``n`` columns of B rows stacked along dim 0, any trailing
        shape), each column gathered over the ranks with gradient, in the single process's order: column 0 of every
        rank, then column 1, ..."""
        if not self.gathers:
            return columns
        if columns.shape[0] % self.size:
            raise ValueError(f"{columns.shape[0]} candidate rows are not whole columns of the batch size {self.size}")
        return torch.cat([all_gather_with_grad(c) for c in columns.split(self.size, dim=0)], dim=0)

    def labels(self, labels: Tensor | None) -> Tensor | None:
        """The global batch's ``label`` rows (gathered without gradient); ``None`` stays ``None``."""
        if labels is None or not self.gathers:
            return labels
        return all_gather_no_grad(labels.to(torch.int64))

    def mean(self, values: Tensor) -> Tensor:
        """This rank's share of the mean of ``values`` over the global batch when each rank holds a different number
        of them (e.g. after a judged-negative mask): ``world_size * sum / global count``; else ``values.mean()``."""
        if not self.gathers:
            return values.mean()
        count = all_reduce_sum(torch.tensor(float(values.numel()), device=values.device, dtype=torch.float32))
        return (self.world_size * values.sum().float() / count).to(values.dtype)


def global_batch(size: int, gather_across_devices: bool) -> GlobalBatch:
    """The :class:`GlobalBatch` of a loss whose local batch has ``size`` rows: gathered over ``torch.distributed``'s
    ranks when ``gather_across_devices`` and more than one process; otherwise this rank's rows alone."""
    return GlobalBatch(int(size), world_size(), rank()) if gather_across_devices else GlobalBatch(int(size))
