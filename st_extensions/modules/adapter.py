"""A residual linear adapter on a frozen encoder's pooled embedding, shared by queries and documents."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from st_extensions.modules.safetensors_module import SafetensorsModule

__all__ = ["LinearAdapter"]


class LinearAdapter(SafetensorsModule):
    """``e -> l2_norm(e + W e + b)`` with ``W`` and ``b`` zero at initialisation: the model starts exactly as the
    base model (for unit-norm ``e``) and learns a linear correction of the embedding space.

    Applied on both the query and the document path, so one document index serves. It is the projection of the
    frozen-encoder recipes (``build_pebr_model(..., projection=True)`` and the dot-product baseline
    :func:`st_extensions.frozen.build_adapter_model`): with the encoder frozen, the embedding space can still move.

    Args:
        in_features: dimension of the pooled embedding.
    """

    config_keys: list[str] = ["in_features"]
    config_file_name = "config.json"
    #: learning rate of the new parameters under :func:`pyterrier_prob.training.fine_tune` (chosen on
    #: nfcorpus/dev, see the README's recipe section)
    learning_rate: float = 3e-4

    def __init__(self, in_features: int) -> None:
        super().__init__()
        if isinstance(in_features, bool) or not isinstance(in_features, int) or in_features <= 0:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}")
        self.in_features = in_features
        self.linear = nn.Linear(in_features, in_features)
        with torch.no_grad():
            self.linear.weight.zero_()
            self.linear.bias.zero_()

    def forward(self, features: dict[str, Tensor | Any], **kwargs) -> dict[str, Any]:
        e = features["sentence_embedding"]
        if e.ndim != 2 or e.shape[-1] != self.in_features:
            raise ValueError(
                f"LinearAdapter expects embeddings of shape (batch, {self.in_features}), got {tuple(e.shape)}"
            )
        e = e.to(self.linear.weight.dtype)
        features["sentence_embedding"] = nn.functional.normalize(e + self.linear(e), dim=-1)
        return features

    def __repr__(self) -> str:
        return f"LinearAdapter(in_features={self.in_features})"
