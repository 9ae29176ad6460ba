"""Judged-relevant (query, document) pairs, for masking false negatives out of in-batch contrastive losses.

On broad collections many in-batch negatives are judged relevant to the anchor (7.6% on nfcorpus/train). Rows carry
``label = [query key, document key]`` (:func:`text_key`, int64 through the collator); a loss given a
:class:`JudgedPairs` drops those candidates from the anchor's softmax (:meth:`JudgedPairs.mask`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from st_extensions.distributed import GlobalBatch

__all__ = ["JudgedPairs", "text_key", "pair_labels"]

_MULT = 0x9E3779B97F4A7C15 - (1 << 64)  # an odd 64-bit constant as a signed int64; the pair key wraps mod 2**64


def text_key(text: str) -> int:
    """A stable signed 64-bit key of a text (BLAKE2b), the same in every process and run."""
    return int.from_bytes(hashlib.blake2b(str(text).encode("utf-8"), digest_size=8).digest(), "little", signed=True)


def pair_labels(queries: Iterable[str], documents: Iterable[str]) -> list[list[int]]:
    """The ``label`` column of training rows: ``[text_key(query), text_key(document)]`` per row."""
    return [[text_key(q), text_key(d)] for q, d in zip(queries, documents, strict=True)]


def _pair_key(q: Tensor, d: Tensor) -> Tensor:
    return q * _MULT + d  # int64 arithmetic wraps, identically for the table and the batch


class JudgedPairs:
    """A set of judged-relevant (query text, document text) ``pairs``, looked up by :func:`text_key`."""

    def __init__(self, pairs: Iterable[tuple[str, str]]) -> None:
        t = torch.tensor([(text_key(q), text_key(d)) for q, d in pairs], dtype=torch.int64).reshape(-1, 2)
        self.keys = torch.unique(_pair_key(t[:, 0], t[:, 1]))

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return f"JudgedPairs({len(self)} pairs)"

    def mask(
        self, labels: Tensor | None, n_candidates: int, offset: int = 0, n_anchors: int | None = None
    ) -> Tensor | None:
        """``(n_anchors, n_candidates)`` bool: candidate ``j < B`` judged relevant to anchor ``i`` (batch row ``offset +
        i``), ``j != offset + i``; hard-negative columns never. ``labels`` ``(B, 2)`` of :func:`pair_labels` (``None``:
        ``None``); a gathering loss passes global labels, its first row as ``offset`` and local size as ``n_anchors``.
        """
        if labels is None:
            return None
        if not isinstance(labels, Tensor) or labels.ndim != 2 or labels.shape[1] != 2:
            shape = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
            raise ValueError(
                f"judged-negative masking needs a label column of [query key, document key] per row "
                f"(st_extensions.judged.pair_labels), got labels of shape {shape}"
            )
        labels = labels.to(torch.int64)
        batch = labels.shape[0]
        if n_candidates < batch:
            raise ValueError(f"{n_candidates} candidates for a batch of {batch} anchors: expected at least {batch}")
        n_anchors = batch - offset if n_anchors is None else n_anchors
        if offset < 0 or n_anchors < 0 or offset + n_anchors > batch:
            raise ValueError(f"anchor rows {offset}..{offset + n_anchors - 1} are not rows of a batch of {batch}")
        anchors = labels[offset : offset + n_anchors]
        keys = _pair_key(anchors[:, 0:1], labels[None, :, 1])
        mask = torch.isin(keys, self.keys.to(keys.device))
        rows = torch.arange(n_anchors, device=mask.device)
        mask[rows, rows + offset] = False
        if n_candidates > batch:
            mask = torch.cat([mask, mask.new_zeros(n_anchors, n_candidates - batch)], dim=1)
        return mask


def masked_logits(logits: Tensor, judged: JudgedPairs | None, labels: Tensor | None, offset: int = 0) -> Tensor:
    """``logits`` (n_anchors, C) with the judged-relevant in-batch negatives set to -inf (unchanged without
    ``judged``). The anchors are rows ``offset .. offset + n_anchors - 1`` of the batch whose ``labels`` are given
    (:meth:`JudgedPairs.mask`; default: all of them)."""
    if judged is None:
        return logits
    mask = judged.mask(labels, logits.shape[1], offset=offset, n_anchors=logits.shape[0])
    return logits if mask is None else logits.masked_fill(mask.to(logits.device), float("-inf"))


def judged_cross_entropy(
    logits: Tensor, judged: JudgedPairs | None, labels: Tensor | None, batch: GlobalBatch
) -> Tensor:
    """Cross-entropy of each anchor's positive (``batch.targets``) among ``logits``, judged negatives masked (the
    global batch's ``labels`` gathered first)."""
    labels = batch.labels(labels) if judged is not None else labels
    return F.cross_entropy(masked_logits(logits, judged, labels, batch.offset), batch.targets(logits.device))
