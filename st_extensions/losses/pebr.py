"""pEBR losses (Zhang et al., ``../shared/papers/pebr.md``): ExpNCE, BetaNCE (Sec. 3.2) and the MLE of Sec. 3.1.

All three read the query's distribution parameters from the model's
:class:`~st_extensions.modules.QueryDistributionHead`, so the learned per-query law is saved with the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.losses.merged_forward import embed_columns
from torch import Tensor, nn

from st_extensions.checks import finite_float
from st_extensions.distributed import global_batch
from st_extensions.judged import JudgedPairs, judged_cross_entropy
from st_extensions.losses._checks import check_not_empty
from st_extensions.pebr import find_head

PEBR_CITATION = """
@misc{zhang2024pebr,
    title={pEBR: A Probabilistic Approach to Embedding Based Retrieval},
    author={Han Zhang and Yunjiang Jiang and Mingming Li and Haowei Yuan and Yiming Qiu and Wen-Yun Yang},
    year={2024},
    archivePrefix={arXiv},
}
"""


class _PEBRLoss(nn.Module):
    """Shared set-up: find the head, embed the columns, in-batch cosine matrix, per-query parameters."""

    family: str = ""
    citation = PEBR_CITATION

    def __init__(
        self,
        model: SentenceTransformer,
        eps: float = 1e-6,
        judged: JudgedPairs | None = None,
        gather_across_devices: bool = False,
    ) -> None:
        super().__init__()
        head = find_head(model)
        if head.family != self.family:
            raise ValueError(
                f"{type(self).__name__} needs a QueryDistributionHead of family {self.family!r}, but the model's "
                f"head is {head.family!r}: build the model with build_pebr_model(..., family={self.family!r})"
            )
        self.model, self.head = model, head
        self.eps = finite_float("eps", eps, low=0.0, high=0.5, low_open=True, high_open=True)
        self.judged, self.gather_across_devices = judged, bool(gather_across_devices)

    def cosines_and_params(self, sentence_features: Iterable[dict[str, Tensor]]) -> tuple[Tensor, Tensor]:
        """``cos (B, B * (1 + n_neg))`` between each anchor and every candidate (anchor i's positive is candidate i;
        with ``gather_across_devices`` the global batch's, at ``rank * B + i``) and the anchors' params ``(B, k)``."""
        name = type(self).__name__
        embeddings = embed_columns(self.model, check_not_empty(name, sentence_features))
        if len(embeddings) < 2:
            raise ValueError(f"{name} needs (anchor, positive[, negative_1, ...]) columns, got {len(embeddings)}")
        anchors = embeddings[0]
        candidates = global_batch(len(anchors), self.gather_across_devices).candidates(torch.cat(embeddings[1:]))
        cos = F.normalize(anchors, dim=-1) @ F.normalize(candidates, dim=-1).T
        return cos, self.head.distribution_params(anchors)

    def log_z(self, cos: Tensor) -> Tensor:
        """log((1 + cos) / 2), the log of Sec. 3.2.2's Beta variable z clamped to ``[eps, 1]`` (finite at cos = -1)."""
        return torch.log(((1.0 + cos) * 0.5).clamp(self.eps, 1.0))

    def nce(self, logits: Tensor, labels: Tensor | None) -> Tensor:
        """Cross-entropy of each anchor's positive among ``logits`` (judged negatives masked), global batch aware."""
        return judged_cross_entropy(logits, self.judged, labels, global_batch(len(logits), self.gather_across_devices))

    def get_config_dict(self) -> dict[str, Any]:
        return {"family": self.family, "eps": self.eps, "gather_across_devices": self.gather_across_devices}


class ExpNCELoss(_PEBRLoss):
    """ExpNCE (pEBR Sec. 3.2.1): InfoNCE on ``cos(q_i, d_j) / tau_{q_i}``, tau_q from the model's head (family "exp").

    L = -1/B sum_i log( exp(cos(q_i, d_i+) / tau_i) / sum_j exp(cos(q_i, d_j) / tau_i) ): the relevant items of q follow
    :class:`~st_extensions.distributions.ExpCosine`; a constant tau gives ``MultipleNegativesRankingLoss(scale=1/tau)``.
    Inputs: (anchor, positive[, negative_1, ...]) columns, no labels. ``judged`` (judged-relevant in-batch negatives
    left out of the softmax), ``gather_across_devices`` (the DDP global batch) and an example: ``docs/pebr.md``."""

    family = "exp"

    def __init__(
        self, model: SentenceTransformer, judged: JudgedPairs | None = None, gather_across_devices: bool = False
    ) -> None:
        super().__init__(model, judged=judged, gather_across_devices=gather_across_devices)

    def get_config_dict(self) -> dict[str, Any]:
        return {"family": self.family, "gather_across_devices": self.gather_across_devices}

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None) -> Tensor:
        cos, params = self.cosines_and_params(sentence_features)
        return self.nce(cos / params[:, :1], labels)


class BetaNCELoss(_PEBRLoss):
    """BetaNCE (pEBR Sec. 3.2.2): InfoNCE on log z / tau_q, z = (1 + cos) / 2 clamped to ``[eps, 1]``.

    After training the relevant items of q follow Beta(1 / tau_q, 1) in z (Eq. 3,
    :class:`~st_extensions.distributions.BetaCosine`). Head family "beta"; inputs and options as :class:`ExpNCELoss`."""

    family = "beta"

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None) -> Tensor:
        cos, params = self.cosines_and_params(sentence_features)
        return self.nce(self.log_z(cos) / params[:, :1], labels)


def beta_log_density(cos: Tensor, alpha: Tensor, beta: Tensor, eps: float) -> Tensor:
    """log of the Beta(alpha, beta) density of the cosine (pEBR Sec. 3.2.2), z = (1 + cos) / 2 in [eps, 1 - eps]."""
    z = ((1.0 + cos) * 0.5).clamp(eps, 1.0 - eps)
    log_beta_fn = torch.lgamma(alpha) + torch.lgamma(beta) - torch.lgamma(alpha + beta)
    return (alpha - 1.0) * torch.log(z) + (beta - 1.0) * torch.log1p(-z) - log_beta_fn - math.log(2.0)


class BetaMLELoss(_PEBRLoss):
    """The maximum-likelihood estimator of pEBR Sec. 3.1 with query-dependent Beta laws (head family "beta_mle").

    L = -[ mean_i log f_i(cos(q_i, d_i+)) + w * mean_{i, j != i} log h_i(cos(q_i, d_ij)) ], f and h the Beta densities
    (:func:`beta_log_density`) of the relevant / irrelevant cosines, ``w = negative_weight``; every non-positive
    candidate is irrelevant (``judged`` removes judged-relevant ones). Point-wise, so it ranks worse than the NCE losses
    (the paper). Needs batch size > 1 or hard negatives; inputs as :class:`ExpNCELoss`."""

    family = "beta_mle"

    def __init__(
        self,
        model: SentenceTransformer,
        negative_weight: float = 1.0,
        eps: float = 1e-6,
        judged: JudgedPairs | None = None,
        gather_across_devices: bool = False,
    ) -> None:
        super().__init__(model, eps=eps, judged=judged, gather_across_devices=gather_across_devices)
        self.negative_weight = finite_float("negative_weight", negative_weight, low=0.0)

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None) -> Tensor:
        cos, params = self.cosines_and_params(sentence_features)
        batch = global_batch(len(cos), self.gather_across_devices)
        if cos.shape[1] < 2:
            raise ValueError("BetaMLELoss needs at least one irrelevant candidate: use batch size > 1")
        a_pos, b_pos, a_neg, b_neg = (params[:, k : k + 1] for k in range(4))
        positive = torch.zeros_like(cos, dtype=torch.bool)
        positive[torch.arange(len(cos), device=cos.device), batch.targets(cos.device)] = True
        irrelevant = ~positive
        if self.judged is not None and labels is not None:
            judged = self.judged.mask(batch.labels(labels), cos.shape[1], offset=batch.offset, n_anchors=len(cos))
            irrelevant &= ~judged.to(cos.device)
        log_f = beta_log_density(cos, a_pos, b_pos, self.eps)[positive]
        log_h = beta_log_density(cos, a_neg, b_neg, self.eps)[irrelevant]
        # the judged mask leaves each rank a different number of irrelevant pairs: mean over the global count
        return -(log_f.mean() + self.negative_weight * batch.mean(log_h))

    def get_config_dict(self) -> dict[str, Any]:
        return {**super().get_config_dict(), "negative_weight": self.negative_weight}
