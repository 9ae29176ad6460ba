"""Frozen-backbone training of a cross-encoder's head on cached [CLS] features, each (query, document) pair through
the backbone once: :func:`cached_cross_encoder` returns a CrossEncoder of :class:`CachedPairFeatures` and the very
same head (shared), so training it trains the full model's head in place."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from sentence_transformers import CrossEncoder
from sentence_transformers.base.model import BaseModel
from sentence_transformers.base.modules import Dense, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from sentence_transformers.util import batch_to_device
from torch import Tensor, nn

from st_extensions.cross_encoder.model import build_var_cross_encoder
from st_extensions.frozen import CachedEmbeddings, evaluating
from st_extensions.partial import longest_first, pair_key

__all__ = ["CachedPairFeatures", "build_cross_encoder", "cached_cross_encoder", "encode_pairs", "pair_prefix_length"]


class CachedPairFeatures(CachedEmbeddings):
    """:class:`~st_extensions.frozen.CachedEmbeddings` keyed by (query, document) pairs (tuples or lists): writes each
    pair's cached [CLS] vector as ``sentence_embedding``; ``encoder`` computes missing ones (else ``KeyError``). Single
    texts (the model card's per-column measure) preprocess to no features and cannot be scored. Cannot be saved."""

    def __init__(self, pairs: Sequence[Any], embeddings: Tensor, encoder: CrossEncoder | None = None) -> None:
        super().__init__([pair_key(p) for p in pairs], embeddings, encoder)

    def preprocess(self, inputs: Sequence[Any], prompt: str | None = None, **kwargs) -> dict[str, Tensor]:
        if prompt:
            raise ValueError("CachedPairFeatures holds features of pairs without prompts; got a prompt")
        inputs = list(inputs)
        if inputs and all(isinstance(t, str) for t in inputs):
            return {"unpaired_texts": inputs}
        return super().preprocess([pair_key(p) for p in inputs], **kwargs)

    def encode_new(self, pairs: Sequence[Any]) -> Tensor:
        """The [CLS] vectors of ``pairs`` by ``encoder``'s prefix (:func:`encode_pairs`)."""
        return encode_pairs(self.encoder[0], pairs)

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        if "unpaired_texts" in features:
            raise ValueError("a cross-encoder scores (query, document) pairs, got single texts")
        return super().forward(features, **kwargs)

    def __repr__(self) -> str:
        return f"CachedPairFeatures({len(self.index)} pairs, dim={self.table.shape[-1]})"


def pair_prefix_length(model: BaseModel) -> int:
    """Number of leading modules of cross-encoder ``model`` (a ``Transformer`` through the first ``Pooling``) making the
    features its head reads; ValueError without such a pooling or a head after it (use :func:`build_cross_encoder`)."""
    modules = list(model)
    k = next((i + 1 for i, m in enumerate(modules) if isinstance(m, Pooling)), None)
    if k is None or not isinstance(modules[0], Transformer) or k == len(modules):
        names = [type(m).__name__ for m in modules]
        raise ValueError(
            f"frozen-backbone training needs a cross-encoder of Transformer, Pooling and a head, got modules {names} "
            "(a sequence-classification CrossEncoder has no separate head: use build_cross_encoder)"
        )
    return k


@torch.no_grad()
def encode_pairs(
    model: BaseModel, pairs: Sequence[Any], batch_size: int = 64, show_progress_bar: bool = False
) -> Tensor:
    """The pooled [CLS] vectors of ``pairs`` under ``model``'s frozen prefix in eval mode, tokenised as ``predict`` does
    and batched longest first: ``(len(pairs), dim)`` float32 on CPU, in order."""
    prefix = list(model)[: pair_prefix_length(model)]
    pairs = [pair_key(p) for p in pairs]
    if not pairs:
        return torch.zeros(0, prefix[-1].get_embedding_dimension())
    out, positions = [], []
    with evaluating(*prefix), torch.inference_mode():
        for idx in longest_first(pairs, batch_size, "pair features", show_progress_bar):
            features = batch_to_device(model.preprocess([pairs[i] for i in idx]), model.device)
            for m in prefix:
                features = m(features)
            out.append(features["sentence_embedding"].float().cpu())
            positions += idx
    return torch.cat(out)[torch.as_tensor(positions).argsort()]  # back in pair order


def cached_cross_encoder(
    model: CrossEncoder,
    pairs: Sequence[Any] = (),
    cache: CachedPairFeatures | None = None,
    batch_size: int = 64,
    show_progress_bar: bool = False,
) -> CrossEncoder:
    """A CrossEncoder of ``model``'s class made of :class:`CachedPairFeatures` for ``pairs`` and ``model``'s (shared)
    head. ``cache``: one of the same frozen backbone and ``max_seq_length`` to reuse and extend. Unseen pairs go through
    ``model``'s prefix on first use; ``predict`` gives ``model.predict``'s scores, training updates ``model``'s head."""
    k = pair_prefix_length(model)
    cache = CachedPairFeatures([], torch.zeros(0), encoder=model) if cache is None else cache
    if cache.encoder[0] is None:
        cache.encoder[0] = model
    if new := cache.missing([pair_key(p) for p in pairs]):
        cache.extend(new, encode_pairs(model, new, batch_size=batch_size, show_progress_bar=show_progress_bar))
    return type(model)(modules=[cache, *list(model)[k:]], device=str(model.device), activation_fn=model.activation_fn)


def build_cross_encoder(
    base_model: str | BaseModel | None = None, max_seq_length: int | None = None, device: str | None = None
) -> CrossEncoder:
    """The plain cross-encoder baseline: backbone -> [CLS] -> ``Dense(d, 1)`` (a ``CrossEncoder``, sigmoid in
    ``predict``), of the same backbone as :func:`build_var_cross_encoder` (same arguments): both train on one cache."""
    backbone = build_var_cross_encoder(base_model, variant="VAR", max_seq_length=max_seq_length, device=device)
    transformer, pooling = backbone[0], backbone[1]
    head = Dense(pooling.get_embedding_dimension(), 1, activation_function=nn.Identity(), module_output_name="scores")
    return CrossEncoder(modules=[transformer, pooling, head], device=str(backbone.device))
