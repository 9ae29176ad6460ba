"""Frozen-backbone training of a cross-encoder's head on cached [CLS] features, each (query, document) pair through
the backbone once.

A re-ranker here is a frozen *prefix* -- a feature-extraction ``Transformer`` reading ``[CLS] q [SEP] d [SEP]`` and a
``Pooling(d, "cls")`` -- followed by a head: the VarCrossEncoder :class:`~st_extensions.cross_encoder.VariationalHead`,
or, for the plain cross-encoder baseline of :func:`build_cross_encoder`, a linear ranker (sentence-transformers'
``Dense(d, 1)`` writing ``"scores"``, so the baseline saves and loads as any CrossEncoder). :func:`cached_cross_encoder`
computes the prefix's pooled [CLS] vector of every training pair once (eval mode) and returns a CrossEncoder of the
same class made of :class:`CachedPairFeatures` (a look-up of those vectors keyed by the pair) and the very same head
module (shared, not copied): training it with the CE losses and :class:`~sentence_transformers.cross_encoder.
CrossEncoderTrainer` (e.g. :func:`pyterrier_prob.training.fine_tune`) trains the full model's head in place, at a few
milliseconds a step. The full model then saves, loads and predicts exactly as the cached one scored; scoring through
a cached model also runs the backbone once per pair, whichever head reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from sentence_transformers import CrossEncoder
from sentence_transformers.base.model import BaseModel
from sentence_transformers.base.modules import Dense, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from sentence_transformers.util import batch_to_device
from torch import Tensor, nn

from st_extensions.frozen import CachedEmbeddings

__all__ = [
    "CachedPairFeatures",
    "build_cross_encoder",
    "cached_cross_encoder",
    "encode_pairs",
    "pair_prefix_length",
]

Pair = tuple[str, str]


def _key(pair: Any) -> Pair:
    """A (query, document) input as the hashable tuple the cache is keyed by (predict may pass lists)."""
    if isinstance(pair, str) or len(pair) != 2:
        raise ValueError(f"a cross-encoder input is a (query, document) pair, got {pair!r:.80}")
    return tuple(pair)


class CachedPairFeatures(CachedEmbeddings):
    """:class:`~st_extensions.frozen.CachedEmbeddings` keyed by (query, document) pairs: the input module standing in
    for a cross-encoder's frozen ``Transformer`` + ``Pooling``, writing each pair's cached [CLS] vector into
    ``features["sentence_embedding"]``.

    ``encoder`` is a cross-encoder whose prefix computes the vectors of pairs not cached yet (added on first use);
    without one an unknown pair raises ``KeyError``. Pairs may come as tuples or lists. A batch of single texts
    (what the trainer's model card measures, column by column) preprocesses to no features (the card then counts
    characters) and cannot be scored. Training-time stand-in: it cannot be saved (save the full model).
    """

    def __init__(self, pairs: Sequence[Any], embeddings: Tensor, encoder: CrossEncoder | None = None) -> None:
        super().__init__([_key(p) for p in pairs], embeddings, encoder)

    def preprocess(self, inputs: Sequence[Any], prompt: str | None = None, **kwargs) -> dict[str, Tensor]:
        if prompt:
            raise ValueError("CachedPairFeatures holds features of pairs without prompts; got a prompt")
        inputs = list(inputs)
        if inputs and all(isinstance(t, str) for t in inputs):
            return {"unpaired_texts": inputs}
        keys = [_key(p) for p in inputs]
        if self.encoder[0] is not None:
            new = self.missing(keys)
            if new:
                self.extend(new, encode_pairs(self.encoder[0], new))
        return super().preprocess(keys, **kwargs)  # every key is cached now: a pure look-up

    def forward(self, features: dict[str, Any], **kwargs) -> dict[str, Any]:
        if "unpaired_texts" in features:
            raise ValueError("a cross-encoder scores (query, document) pairs, got single texts")
        return super().forward(features, **kwargs)

    def __repr__(self) -> str:
        return f"CachedPairFeatures({len(self.index)} pairs, dim={self.table.shape[-1]})"


def pair_prefix_length(model: BaseModel) -> int:
    """Number of leading modules of the cross-encoder ``model`` that make the features its head reads: a
    ``Transformer`` through the first ``Pooling``.

    Raises:
        ValueError: no ``Pooling`` after a ``Transformer`` (e.g. a Hugging Face sequence-classification
            CrossEncoder, whose classifier is inside the transformer: build the baseline with
            :func:`build_cross_encoder`), or no head after the pooling.
    """
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
    """The pooled [CLS] vectors (``features["sentence_embedding"]``) of ``pairs`` under ``model``'s frozen prefix
    (:func:`pair_prefix_length`), in eval mode: ``(len(pairs), dim)`` float32 on CPU, in the order of ``pairs``.

    The pairs are tokenised as ``model.predict`` does (``model.preprocess``) and batched longest first.
    """
    from tqdm.autonotebook import trange

    k = pair_prefix_length(model)
    prefix = list(model)[:k]
    pairs = [_key(p) for p in pairs]
    if not pairs:
        return torch.zeros(0, prefix[-1].get_embedding_dimension())
    order = np.argsort([-model._input_length(p) for p in pairs], kind="stable")
    was_training = [m.training for m in prefix]
    for m in prefix:
        m.eval()
    out = []
    try:
        with torch.inference_mode():
            for start in trange(0, len(pairs), batch_size, desc="pair features", disable=not show_progress_bar):
                batch = [pairs[i] for i in order[start : start + batch_size]]
                features = batch_to_device(model.preprocess(batch), model.device)
                for m in prefix:
                    features = m(features)
                out.append(features["sentence_embedding"].float().cpu())
    finally:
        for m, mode in zip(prefix, was_training):
            m.train(mode)
    embeddings = torch.empty(len(pairs), out[0].shape[-1])
    embeddings[torch.as_tensor(order)] = torch.cat(out)
    return embeddings


def cached_cross_encoder(
    model: CrossEncoder,
    pairs: Sequence[Any] = (),
    cache: CachedPairFeatures | None = None,
    batch_size: int = 64,
    show_progress_bar: bool = False,
) -> CrossEncoder:
    """A CrossEncoder of ``model``'s class (a VarCrossEncoder or a CrossEncoder) made of :class:`CachedPairFeatures`
    and ``model``'s modules after its frozen prefix (its head: the same module objects, not copies).

    Args:
        model: the full cross-encoder (``Transformer``, ``Pooling(d, "cls")``, head; :func:`pair_prefix_length`).
        pairs: every (query, document) pair the training (or scoring) will feed; duplicates are fine.
        cache: a cache of the same backbone to reuse and extend with the pairs it lacks (one cache serves every
            re-ranker built on the same, frozen backbone with the same ``max_seq_length``; another backbone gives
            wrong features).
        batch_size: pairs per forward pass of the backbone.
        show_progress_bar: show the feature bar.

    The returned model scores any pair: a pair not cached goes through ``model``'s prefix on first use. Its
    ``predict`` (same ``activation_fn``) gives ``model.predict``'s scores; training it (``fine_tune(cached, loss,
    rows)`` or the CrossEncoderTrainer) updates ``model``'s head and leaves the backbone untouched.
    """
    k = pair_prefix_length(model)
    keys = list(dict.fromkeys(_key(p) for p in pairs))
    if cache is None:
        features = encode_pairs(model, keys, batch_size=batch_size, show_progress_bar=show_progress_bar)
        cache = CachedPairFeatures(keys, features, encoder=model)
    else:
        new = cache.missing(keys)
        if new:
            cache.extend(new, encode_pairs(model, new, batch_size=batch_size, show_progress_bar=show_progress_bar))
        if cache.encoder[0] is None:
            cache.encoder[0] = model
    return type(model)(modules=[cache, *list(model)[k:]], device=str(model.device), activation_fn=model.activation_fn)


def build_cross_encoder(
    base_model: str | BaseModel | None = None,
    max_seq_length: int | None = None,
    device: str | None = None,
) -> CrossEncoder:
    """The plain cross-encoder baseline with a separate linear ranker: backbone -> [CLS] -> ``Dense(d, 1)``.

    The same ``Transformer`` + ``Pooling(d, "cls")`` as :func:`~st_extensions.cross_encoder.build_var_cross_encoder`
    (same arguments), then sentence-transformers' ``Dense`` with the identity activation writing ``"scores"``: the
    deterministic s = t^T w + b on the same features as the VarCE head, so both train on the same cached features.
    A plain ``CrossEncoder`` (saved and loaded by sentence-transformers alone; ``predict`` applies the sigmoid by
    default, as for any one-label CrossEncoder).
    """
    from st_extensions.cross_encoder.model import build_var_cross_encoder

    backbone = build_var_cross_encoder(base_model, variant="VAR", max_seq_length=max_seq_length, device=device)
    transformer, pooling = backbone[0], backbone[1]
    dim = pooling.get_embedding_dimension()
    head = Dense(dim, 1, activation_function=nn.Identity(), module_output_name="scores")
    return CrossEncoder(modules=[transformer, pooling, head], device=str(backbone.device))
