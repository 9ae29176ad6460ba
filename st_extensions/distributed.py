"""In-batch losses across devices (DDP): the global batch one rank's loss sees, and the collectives it needs.

Under DDP (the sentence-transformers trainer under accelerate / torchrun) every rank computes the loss of its own
rows and the gradients are averaged over the ranks, so the objective is ``mean_r loss_r``. A loss with
``gather_across_devices=True`` makes that mean equal to the loss a single process would compute on the global batch
(rank 0's rows, then rank 1's, ...), as sentence-transformers' ``MultipleNegativesRankingLoss(...,
gather_across_devices=True)`` does:

* the anchors stay local; the candidates (every positive, then every hard-negative column) are all-gathered with
  gradients (:meth:`GlobalBatch.candidates`), column by column, so they are in the single process's order;
* anchor ``i`` of rank ``r`` is row ``r * B + i`` of the global batch: its target (:meth:`GlobalBatch.targets`) and
  the diagonal its judged-negative mask must spare (:attr:`GlobalBatch.offset`);
* the ``label`` keys are gathered without gradient (:meth:`GlobalBatch.labels`), so the masks are built over the
  global batch;
* a mean over anchors is the local mean (every rank has B rows); a mean over a masked set of pairs, whose size
  differs between ranks, is ``world_size * local sum / global count`` (:meth:`GlobalBatch.mean`); a non-linear
  function of a global mean takes the mean from a differentiable all-reduce (:func:`all_reduce_sum`).

Gradients flow through ``torch.distributed.nn`` collectives (the backward of an all-gather sums every rank's
gradient of its slice), so after DDP's averaging the gradient is the single process's. Without an initialised
``torch.distributed``, or with one process, nothing is gathered and the losses compute exactly what they do with
``gather_across_devices=False``.
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
        PartialState = None
    if PartialState is not None and PartialState._shared_state != {}:
        return int(PartialState().num_processes)
    return world_size()


@contextmanager
def _autograd_collectives() -> Iterator[None]:
    """``torch.distributed.nn``'s differentiable collectives (what sentence-transformers' ``all_gather_with_grad``
    uses), without the FutureWarning recent torch versions give for them: their suggested replacements are in a
    private module (``torch.distributed._functional_collectives``)."""
    import torch.distributed.nn  # noqa: F401 -- makes torch.distributed.nn available

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional", category=FutureWarning)
        yield


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient.

    The backward of ``torch.distributed.nn.all_gather`` on gloo receives each slice's gradient into
    ``torch.empty_like(grad)``, which keeps a permuted layout (e.g. the gradient of an ``einsum`` operand), and the
    scatter then fills it as if it were contiguous: the gradients come back scrambled (the loss is right, the
    gradients of a 3-d candidate tensor are not; gloo's scatter ignores strides, pytorch/pytorch#24836, #192920).
    Making them contiguous first avoids it (and NCCL refuses non-contiguous tensors).
    """

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
    """One rank's view of the global batch of an in-batch loss (see the module docstring).

    Attributes:
        size: B, this rank's rows (every rank has as many: the all-gather needs it).
        world_size: the number of ranks whose rows form the global batch (1: no gathering).
        rank: this rank; its rows are rows ``rank * B .. rank * B + B - 1`` of the global batch.
    """

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

    @property
    def global_size(self) -> int:
        """The rows of the global batch."""
        return self.world_size * self.size

    def targets(self, device: torch.device | str | None = None) -> Tensor:
        """The column of each local anchor's positive among the gathered candidates: ``offset + arange(B)``."""
        return torch.arange(self.offset, self.offset + self.size, device=device)

    def candidates(self, columns: Tensor) -> Tensor:
        """The global candidates from this rank's ``columns``: ``n`` columns of B rows stacked along dim 0 (positives,
        then each hard-negative column; any trailing shape), each gathered over the ranks with gradient, in the single
        process's order: column 0 of every rank, then column 1, ..."""
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
        of them (e.g. the pairs left by a judged-negative mask): ``world_size * sum / global count`` (in float32, the
        count all-reduced), so that the mean over the ranks is the global mean. Without gathering: ``values.mean()``.
        """
        if not self.gathers:
            return values.mean()
        count = all_reduce_sum(torch.tensor(float(values.numel()), device=values.device, dtype=torch.float32))
        return (self.world_size * values.sum().float() / count).to(values.dtype)


def global_batch(size: int, gather_across_devices: bool) -> GlobalBatch:
    """The :class:`GlobalBatch` of a loss whose local batch has ``size`` rows: gathered over ``torch.distributed``'s
    ranks when ``gather_across_devices`` and more than one process; otherwise this rank's rows alone."""
    if not gather_across_devices or world_size() == 1:
        return GlobalBatch(int(size))
    return GlobalBatch(int(size), world_size(), rank())
