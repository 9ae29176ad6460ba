"""The Mixture-of-Logits training loss (Ding & Zhai, ``../shared/papers/mixture-of-logits.txt``, Eq. 3-4): sampled
softmax over the MoL similarity plus the mutual-information load-balancing loss."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.losses.merged_forward import merge_feature_batches
from torch import Tensor, nn

from st_extensions.checks import finite_float, positive_float
from st_extensions.distributed import global_batch
from st_extensions.judged import JudgedPairs, judged_cross_entropy
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
    """Sampled softmax over the Mixture-of-Logits similarity plus alpha * L_MI (Ding & Zhai, Eqs. 3-4).

    ``L = -1/B sum_i log(exp(s phi(q_i, x_i+)) / sum_j exp(s phi(q_i, x_j))) + alpha * L_MI`` over the candidates
    x_j (the batch's positives, then its hard negatives), s = ``scale``, L_MI over the gates of all B x C pairs
    (:func:`~st_extensions.modules.mol.mutual_information_loss`, clamped at ``eps``); with P_q = P_x = 1 it is
    ``MultipleNegativesRankingLoss``. ``judged`` leaves in-batch negatives judged relevant out of the softmax;
    ``gather_across_devices`` contrasts with the DDP global batch. Inputs: (anchor, positive[, negative_1, ...]),
    no labels; the anchor takes the query path. Example::

        model = build_mol_model(num_query_components=4, num_doc_components=4, component_dim=64)
        train = Dataset.from_dict({"anchor": ["q1", "q2"], "positive": ["d1", "d2"]})
        SentenceTransformerTrainer(model=model, train_dataset=train, loss=MoLLoss(model)).train()
    """

    citation = MOL_CITATION

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
        self.mol, self.model = find_mol(model), model
        self.alpha = finite_float("alpha", alpha, low=0.0)
        self.scale = positive_float("scale", scale)
        self.eps = finite_float("eps", eps, low=0.0, high=1e-3, low_open=True, high_open=True)
        self.judged, self.gather_across_devices = judged, bool(gather_across_devices)

    def _encode(self, features: list[dict[str, Any]], task: str) -> tuple[Tensor, Tensor | None]:
        """Components (and gate features) of one or more columns, in one merged forward where possible."""
        merged = merge_feature_batches(features) if len(features) > 1 else features[0]
        outputs = [self.model(f, task=task) for f in ([merged] if merged is not None else features)]
        components = torch.cat([o[COMPONENTS_KEY] for o in outputs])
        side = torch.cat([o[FEATURES_KEY] for o in outputs]) if self.mol.gate_features else None
        return components, side

    def scores_and_gates(self, sentence_features: Iterable[dict[str, Tensor]]) -> tuple[Tensor, Tensor]:
        """``phi (B, C)`` of each anchor and every candidate, and the gates ``pi (B, C, P)``; anchor i's positive is
        candidate i (``rank * B + i`` when gathering across devices)."""
        features = check_not_empty("MoLLoss", sentence_features)
        if len(features) < 2:
            raise ValueError(f"MoLLoss needs (anchor, positive[, negative_1, ...]) columns, got {len(features)}")
        q, qf = self._encode(features[:1], "query")
        x, xf = self._encode(features[1:], "document")
        batch = global_batch(len(q), self.gather_across_devices)
        return self.mol.mixture_all(q, batch.candidates(x), qf, None if xf is None else batch.candidates(xf))

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None) -> Tensor:
        scores, gates = self.scores_and_gates(sentence_features)
        batch = global_batch(len(scores), self.gather_across_devices)
        loss = judged_cross_entropy(self.scale * scores, self.judged, labels, batch)
        return loss + self.alpha * mutual_information_loss(gates, eps=self.eps, batch=batch) if self.alpha else loss

    def get_config_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "scale": self.scale, "gather_across_devices": self.gather_across_devices}
