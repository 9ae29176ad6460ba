"""MultipleNegativesRankingLoss with judged-relevant in-batch negatives masked: the baselines' loss.

The dot-product baselines of every experiment train with this loss under the same recipe as the methods
(query-balanced batches, judged negatives masked), so the comparison is fair.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from sentence_transformers.losses import MultipleNegativesRankingLoss
from torch import Tensor

from st_extensions.judged import JudgedPairs, masked_logits

__all__ = ["MaskedMultipleNegativesRankingLoss"]


class MaskedMultipleNegativesRankingLoss(MultipleNegativesRankingLoss):
    """InfoNCE over in-batch and hard negatives (``MultipleNegativesRankingLoss``, ``query_to_doc``) in which the
    in-batch negatives that the training qrels judge relevant to the anchor are left out of its softmax:

        L = -1/B sum_i log( exp(s cos(q_i, d_i+)) / sum_{j not judged for q_i} exp(s cos(q_i, d_j)) ).

    Without ``judged`` (or without a ``label`` column) it is exactly ``MultipleNegativesRankingLoss(model, scale)``.

    Args:
        model: any SentenceTransformer.
        scale: s, the inverse temperature.
        judged: judged-relevant pairs; rows carry ``label = [query key, document key]``
            (:func:`st_extensions.judged.pair_labels`).
    """

    def __init__(self, model: SentenceTransformer, scale: float = 20.0, judged: JudgedPairs | None = None) -> None:
        super().__init__(model, scale=scale)
        self.judged = judged

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None) -> Tensor:
        if self.judged is None or labels is None:
            return super().compute_loss_from_embeddings(embeddings, labels)
        anchors, candidates = embeddings[0], torch.cat(embeddings[1:])
        logits = masked_logits(self.scale * self.similarity_fct(anchors, candidates), self.judged, labels)
        return F.cross_entropy(logits, torch.arange(len(anchors), device=logits.device))

    def get_config_dict(self) -> dict[str, Any]:
        return {**super().get_config_dict(), "judged_pairs": len(self.judged) if self.judged is not None else 0}
