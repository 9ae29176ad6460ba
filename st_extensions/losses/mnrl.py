"""MultipleNegativesRankingLoss with judged-relevant in-batch negatives masked: the baselines' loss.

The dot-product baselines of every experiment train with this loss under the same recipe as the methods
(query-balanced batches, judged negatives masked), so the comparison is fair.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from torch import Tensor

from st_extensions.distributed import global_batch
from st_extensions.judged import JudgedPairs, judged_cross_entropy
from st_extensions.losses._checks import check_not_empty

__all__ = ["MaskedMultipleNegativesRankingLoss"]


class MaskedMultipleNegativesRankingLoss(MultipleNegativesRankingLoss):
    """``MultipleNegativesRankingLoss`` (``query_to_doc``, scale s) with the in-batch negatives that the training qrels
    judge relevant to the anchor left out of its softmax:
    L = -1/B sum_i log( exp(s cos(q_i, d_i+)) / sum_{j not judged for q_i} exp(s cos(q_i, d_j)) ).

    Without ``judged`` (rows with ``label`` of :func:`st_extensions.judged.pair_labels`) it is exactly MNRL;
    ``gather_across_devices`` masks over the DDP global batch, as MNRL's option."""

    def __init__(
        self,
        model: SentenceTransformer,
        scale: float = 20.0,
        judged: JudgedPairs | None = None,
        gather_across_devices: bool = False,
    ) -> None:
        super().__init__(model, scale=scale, gather_across_devices=gather_across_devices)
        self.judged = judged

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None = None) -> Tensor:
        """The loss of a batch; a ``ValueError`` naming the loss for an empty batch, before the model is called."""
        return super().forward(check_not_empty(type(self).__name__, sentence_features), labels)

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None) -> Tensor:
        if len(embeddings) < 2:
            raise ValueError(f"Expected at least 2 embeddings, got {len(embeddings)}")
        batch = global_batch(len(embeddings[0]), self.gather_across_devices)
        logits = self.similarity_fct(embeddings[0], batch.candidates(torch.cat(embeddings[1:]))) * self.scale
        targets = batch.targets(logits.device)
        if self.judged is None or labels is None:
            # MultipleNegativesRankingLoss's own formula ("query_to_doc", "joint"), term for term
            positives = logits[torch.arange(len(logits), device=logits.device), targets]
            return -(positives - torch.logsumexp(logits, dim=1)).mean()
        return judged_cross_entropy(logits, self.judged, labels, batch)

    def get_config_dict(self) -> dict[str, Any]:
        return {**super().get_config_dict(), "judged_pairs": len(self.judged) if self.judged is not None else 0}
