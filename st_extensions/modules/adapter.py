"""A residual linear adapter on a frozen encoder's pooled embedding, shared by queries and documents."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from st_extensions.checks import positive_int
from st_extensions.modules.safetensors_module import SafetensorsModule

__all__ = ["LinearAdapter"]


class LinearAdapter(SafetensorsModule):
    """``e -> l2_norm(e + W e + b)``, W and b zero at first (the base model, for unit-norm e), on both paths (one
    document index): the projection of the frozen-encoder recipes (``build_pebr_model(..., projection=True)``,
    :func:`st_extensions.frozen.build_adapter_model`), so the embedding space can still move."""

    config_keys: list[str] = ["in_features"]

    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.in_features = positive_int("in_features", in_features)
        self.linear = nn.Linear(in_features, in_features)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, features: dict[str, Tensor | Any], **kwargs) -> dict[str, Any]:
        e = self._checked_embeddings(features["sentence_embedding"], self.in_features)
        features["sentence_embedding"] = nn.functional.normalize(e + self.linear(e), dim=-1)
        return features

    def __repr__(self) -> str:
        return f"LinearAdapter(in_features={self.in_features})"
