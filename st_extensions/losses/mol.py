"""The Mixture-of-Logits training loss (Ding & Zhai, ``../shared/papers/mixture-of-logits.txt``, Eq. 3-4).

Sampled softmax over the MoL similarity with in-batch (and optional hard) negatives plus the mutual-information
load-balancing loss. The gate and the component construction are the model's
:class:`~st_extensions.modules.MixtureOfLogits`, so what is learned is saved with the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.losses.merged_forward import merge_feature_batches
from torch import Tensor, nn

from st_extensions.distributed import global_batch
from st_extensions.judged import JudgedPairs, masked_logits
from st_extensions.losses._checks import check_not_empty
from st_extensions.modules.mol import COMPONENTS_KEY, FEATURES_KEY, mutual_information_loss
from st_extensions.mol import find_mol

MOL_CITATION = """
@inproceedings{ding2025retrieval,
    title={Retrieval with Learned Similarities},
    author={Bailu Ding and Jiaqi Zhai},
    booktitle={Proceedings of the ACM Web Conference 2025 (WWW '25)},
    year={2025},
    doi={10.1145/3696410.3714822},
}
"""


class MoLLoss(nn.Module):
    """Sampled softmax over the Mixture-of-Logits similarity plus alpha * L_MI (Ding & Zhai, Eq. 4).

    For anchors q_i, candidates x_j (every positive in the batch, then every hard negative, column by column)
    and the MoL similarity phi (Eq. 1-2) of the model's :class:`~st_extensions.modules.MixtureOfLogits`,

        L = -1/B sum_i log( exp(s phi(q_i, x_i+)) / sum_j exp(s phi(q_i, x_j)) ) + alpha * L_MI,

    with the load-balancing loss L_MI = -H(p) + H(p | (q, x)) (Eq. 3,
    :func:`~st_extensions.modules.mol.mutual_information_loss`) taken over the gates pi(q_i, x_j) of all
    B x C (anchor, candidate) pairs of the batch. The scale s = 1 / temperature turns phi, which lies in
    [-1, 1] for unit-norm components, into logits, as in ``MultipleNegativesRankingLoss``.

    With P_q = P_x = 1 the gate is the constant 1 and L_MI = 0, so the loss is exactly
    ``MultipleNegativesRankingLoss(model, scale=s)`` on the single query/document components (with
    ``component_source="heads"`` and identity heads, on the model's own embeddings). With a constant gate
    (as at initialisation) phi is the mean of the P inner products and L_MI = 0.

    Args:
        model: a SentenceTransformer built with :func:`~st_extensions.build_mol_model`.
        alpha: weight of L_MI (the paper's alpha; default 0.001).
        scale: s, the inverse temperature of the sampled softmax.
        eps: probabilities are clamped to ``eps`` inside the logs of L_MI.
        judged: judged-relevant pairs of the training qrels; with rows carrying a ``label`` column
            (:func:`st_extensions.judged.pair_labels`) the in-batch negatives they judge relevant to the anchor
            are left out of its softmax (they stay in L_MI, which only balances the gate).
        gather_across_devices: under DDP, gather the candidates' components (and gate features) of every device
            with gradients, so each anchor is scored against the whole global batch, as
            ``MultipleNegativesRankingLoss(..., gather_across_devices=True)``; the judged negatives are masked and
            L_MI's average gate is taken over the global batch (:mod:`st_extensions.distributed`), so the mean over
            the devices' losses is the single-process loss on the global batch. Without ``torch.distributed`` (or
            with one process) nothing is gathered.

    Requirements:
        1. The model has a :class:`~st_extensions.modules.MixtureOfLogits` head.
        2. (anchor, positive) pairs or (anchor, positive, negative_1, ..., negative_n) tuples; the anchor is
           encoded on the query path, all other columns on the document path (no ``router_mapping``
           needed).

    Inputs:
        +-------------------------------------------------+--------+
        | Inputs                                          | Labels |
        +=================================================+========+
        | (anchor, positive) pairs                        | none   |
        +-------------------------------------------------+--------+
        | (anchor, positive, negative_1, ..., negative_n) | none   |
        +-------------------------------------------------+--------+

    Example:
        ::

            from datasets import Dataset
            from sentence_transformers import SentenceTransformerTrainer
            from st_extensions import build_mol_model
            from st_extensions.losses import MoLLoss

            model = build_mol_model(num_query_components=4, num_doc_components=4, component_dim=64)
            train = Dataset.from_dict({"anchor": ["q1", "q2"], "positive": ["d1", "d2"]})
            SentenceTransformerTrainer(model=model, train_dataset=train, loss=MoLLoss(model)).train()
    """

    def __init__(
        self,
        model: SentenceTransformer,
        alpha: float = 0.001,
        scale: float = 20.0,
        eps: float = 1e-12,
        judged: JudgedPairs | None = None,
        gather_across_devices: bool = False,
    ) -> None:
        super().__init__()
        self.mol = find_mol(model)
        if not (math.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"alpha must be finite and >= 0, got {alpha}")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"scale must be finite and > 0, got {scale}")
        if not (0 < eps < 1e-3):
            raise ValueError(f"eps must be in (0, 1e-3), got {eps}")
        self.model = model
        self.alpha = float(alpha)
        self.scale = float(scale)
        self.eps = float(eps)
        self.judged = judged
        self.gather_across_devices = bool(gather_across_devices)

    def _encode(self, features: list[dict[str, Any]], task: str) -> tuple[Tensor, Tensor | None]:
        """Components (and gate features) of one or more columns, in one merged forward where possible."""
        merged = merge_feature_batches(features) if len(features) > 1 else features[0]
        outputs = [self.model(f, task=task) for f in ([merged] if merged is not None else features)]
        components = torch.cat([o[COMPONENTS_KEY] for o in outputs])
        side = torch.cat([o[FEATURES_KEY] for o in outputs]) if self.mol.gate_features else None
        return components, side

    def scores_and_gates(self, sentence_features: Iterable[dict[str, Tensor]]) -> tuple[Tensor, Tensor]:
        """``phi (B, C)`` between each anchor and every candidate (anchor i's positive is candidate i) and
        the gates ``pi (B, C, P)``. With ``gather_across_devices`` under DDP the candidates are those of the global
        batch and anchor i's positive is candidate ``rank * B + i`` (:class:`st_extensions.distributed.GlobalBatch`).
        """
        features = check_not_empty("MoLLoss", sentence_features)
        if len(features) < 2:
            raise ValueError(f"MoLLoss needs (anchor, positive[, negative_1, ...]) columns, got {len(features)}")
        q, qf = self._encode(features[:1], "query")
        x, xf = self._encode(features[1:], "document")
        batch = global_batch(len(q), self.gather_across_devices)
        x = batch.candidates(x)
        xf = None if xf is None else batch.candidates(xf)
        return self.mol.mixture_all(q, x, qf, xf)

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None) -> Tensor:
        scores, gates = self.scores_and_gates(sentence_features)
        batch = global_batch(len(scores), self.gather_across_devices)
        labels = batch.labels(labels) if self.judged is not None else labels
        logits = masked_logits(self.scale * scores, self.judged, labels, offset=batch.offset)
        loss = F.cross_entropy(logits, batch.targets(scores.device))
        if self.alpha:
            loss = loss + self.alpha * mutual_information_loss(gates, eps=self.eps, batch=batch)
        return loss

    def get_config_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "scale": self.scale, "gather_across_devices": self.gather_across_devices}

    @property
    def citation(self) -> str:
        return MOL_CITATION
