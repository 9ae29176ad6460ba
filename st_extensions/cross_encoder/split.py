"""A split-attention cross-encoder (PreTTR, MacAvaney et al., SIGIR 2020) started from a bi-encoder.

The lower ``L - joint_layers`` layers of a BERT encoder read the query and the document *separately* (each text's
states depend on that text only, so they are computed once per text and can be cached); the top ``joint_layers``
layers read the concatenation ``[query tokens ; document tokens]`` and attend across both, as a cross-encoder's do.
:class:`SegmentInteraction` pools the joint output per segment (mean over the query's and the document's tokens,
each L2-normalised) and writes their element-wise product, scaled by the hidden size, as the pair's feature: its sum
is the cosine of the two segment embeddings, so a linear head whose weights are all ``scale / hidden`` starts as
``scale * cos``. Started from a fine-tuned bi-encoder (mean pooling), the model therefore starts close to that
bi-encoder's ranking; the joint layers then learn what reading both texts at once adds (e.g. by distillation).

Built by :func:`build_split_cross_encoder` as a plain :class:`~sentence_transformers.CrossEncoder` (a linear head,
sentence-transformers' ``Dense(d, 1)``) or a :class:`~st_extensions.cross_encoder.VarCrossEncoder` (the
:class:`~st_extensions.cross_encoder.VariationalHead` on the same feature, Eq. 3-8 of the VarCE paper).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from sentence_transformers import CrossEncoder
from sentence_transformers.base.modules import Dense, Module, Transformer
from torch import Tensor, nn

from st_extensions.cross_encoder.head import Variant, VariationalHead
from st_extensions.cross_encoder.model import VarCrossEncoder
from st_extensions.defaults import default_model_path
from st_extensions.partial import LayerStateCache, check_partial_transformer, run_top_layers

__all__ = [
    "CrossAttentionBias",
    "LinearScoreHead",
    "SegmentInteraction",
    "SplitTransformer",
    "build_split_cross_encoder",
    "split_state_cache",
]

QUERY_MASK = "query_token_mask"
BIAS_FILE = "split_attention.safetensors"


def _pair(x: Any) -> tuple[str, str]:
    if isinstance(x, str) or len(x) != 2:
        raise ValueError(f"a cross-encoder input is a (query, document) pair, got {x!r:.80}")
    return str(x[0]), str(x[1])


class CrossAttentionBias(nn.Module):
    """Per joint layer, the additive attention logit between a query token and a document token (learned; 0 is plain
    joint attention, a very negative value keeps the two texts apart as in the bi-encoder the model started from).
    New parameters: they train at their own ``learning_rate`` (:func:`pyterrier_prob.training.head_learning_rates`)."""

    learning_rate: float = 1e-2

    def __init__(self, layers: int, init: float) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.full((layers,), float(init)))


class LinearScoreHead(Dense):
    """The plain cross-encoder's linear ranker on the pair feature (sentence-transformers' ``Dense(d, 1)`` writing
    ``"scores"``), declaring the learning rate of new parameters (the VarCE head's)."""

    learning_rate: float = VariationalHead.learning_rate


class SplitTransformer(Transformer):
    """A BERT ``Transformer`` whose lower layers read query and document apart and whose top ``joint_layers``
    layers read them together (PreTTR).

    ``preprocess(pairs)`` tokenises queries and documents separately (each cut at ``max_seq_length``; single texts
    are tokenised as by the ``Transformer``); ``forward`` runs the embeddings and lower layers on each side, joins
    the two padded blocks along the token axis and runs the top layers on them, writing ``token_embeddings``,
    the joint ``attention_mask`` and ``query_token_mask`` (1 on the query's tokens). Single-text features run the
    plain ``Transformer`` forward (this is how a :class:`~st_extensions.partial.LayerStateCache` computes a text's
    lower-layer states).

    With ``state_cache`` set (a :class:`~st_extensions.partial.LayerStateCache` of this module's states entering
    layer ``L - joint_layers``, see :func:`split_state_cache`) the lower layers are read from the cache, each text
    computed once: what makes training and re-ranking cheap. The cache is not saved with the model.

    Args:
        model_name_or_path: a BERT encoder or a sentence-transformers model folder (e.g. a fine-tuned bi-encoder).
        joint_layers: how many top layers attend across query and document, 1..L.
        **kwargs: the ``Transformer``'s arguments (``max_seq_length``, ...).
    """

    config_keys: list[str] = [*Transformer.config_keys, "joint_layers", "init_cross_bias"]

    def __init__(
        self, model_name_or_path: str, *, joint_layers: int = 2, init_cross_bias: float = 0.0, **kwargs: Any
    ) -> None:
        super().__init__(model_name_or_path, **kwargs)
        backbone = check_partial_transformer(self)
        num_layers = len(backbone.encoder.layer)
        if isinstance(joint_layers, bool) or not isinstance(joint_layers, int) or not 1 <= joint_layers <= num_layers:
            raise ValueError(f"joint_layers must be an int in 1..{num_layers}, got {joint_layers!r}")
        if not np.isfinite(init_cross_bias) or init_cross_bias > 0:
            raise ValueError(f"init_cross_bias must be a finite value <= 0, got {init_cross_bias!r}")
        self.joint_layers = joint_layers
        self.init_cross_bias = float(init_cross_bias)
        self.cross = CrossAttentionBias(joint_layers, self.init_cross_bias)
        self.state_cache: LayerStateCache | None = None

    def save(self, output_path: str, *args: Any, safe_serialization: bool = True, **kwargs: Any) -> None:
        super().save(output_path, *args, safe_serialization=safe_serialization, **kwargs)
        save_file({"cross_bias": self.cross.bias.detach().cpu().contiguous()}, os.path.join(output_path, BIAS_FILE))

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", **kwargs: Any) -> SplitTransformer:
        module = super().load(model_name_or_path, subfolder=subfolder, **kwargs)
        path = os.path.join(model_name_or_path, subfolder, BIAS_FILE)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: the SplitTransformer's learned cross-attention bias")
        bias = load_file(path)["cross_bias"]
        if bias.shape != module.cross.bias.shape:
            raise ValueError(f"{path} holds {tuple(bias.shape)} biases, the config says {module.joint_layers} layers")
        with torch.no_grad():
            module.cross.bias.copy_(bias)
        return module

    @property
    def split_layer(self) -> int:
        """The first layer that reads query and document together (L - ``joint_layers``)."""
        return len(self.auto_model.encoder.layer) - self.joint_layers

    def preprocess(self, inputs: Sequence[Any], prompt: str | None = None, **kwargs: Any) -> dict[str, Any]:
        inputs = list(inputs)
        if not inputs or all(isinstance(x, str) for x in inputs):
            return super().preprocess(inputs, prompt=prompt, **kwargs) if inputs else {}
        pairs = [_pair(x) for x in inputs]
        queries, documents = [q for q, _ in pairs], [d for _, d in pairs]
        if self.state_cache is not None:
            if prompt:
                raise ValueError("the layer-state cache holds texts without prompts; got a prompt")
            rows = self.state_cache.rows(queries + documents)
            return {
                "query_rows": torch.tensor(rows[: len(pairs)]),
                "document_rows": torch.tensor(rows[len(pairs) :]),
            }
        q = super().preprocess(queries, prompt=prompt, **kwargs)
        d = super().preprocess(documents, **kwargs)
        return {
            "input_ids": q["input_ids"],
            "attention_mask": q["attention_mask"],
            "document_input_ids": d["input_ids"],
            "document_attention_mask": d["attention_mask"],
        }

    def _lower(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """States entering layer ``split_layer`` of one side's texts (embeddings, then the lower layers)."""
        backbone = self.auto_model
        hidden = backbone.embeddings(input_ids=input_ids, token_type_ids=torch.zeros_like(input_ids))
        return run_top_layers(backbone, hidden, attention_mask, 0, stop=self.split_layer)

    def _cached(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        cache = self.state_cache
        rows = rows.tolist()
        lengths = cache.lengths(rows)
        weight = self.auto_model.encoder.layer[self.split_layer].attention.self.query.weight
        states = torch.from_numpy(cache.gather(rows)).to(device=weight.device, dtype=weight.dtype)
        mask = torch.as_tensor(np.arange(states.shape[1])[None, :] < lengths[:, None], device=weight.device)
        return states, mask.long()

    def forward(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        if "query_rows" in features:
            if self.state_cache is None:
                raise ValueError("features hold cache rows but the SplitTransformer has no state_cache")
            q, q_mask = self._cached(features["query_rows"])
            d, d_mask = self._cached(features["document_rows"])
        elif "document_input_ids" in features:
            q_mask, d_mask = features["attention_mask"], features["document_attention_mask"]
            q = self._lower(features["input_ids"], q_mask)
            d = self._lower(features["document_input_ids"], d_mask)
        else:
            return super().forward(features, **kwargs)
        mask = torch.cat([q_mask, d_mask], dim=1)
        is_query = torch.cat([torch.ones_like(q_mask), torch.zeros_like(d_mask)], dim=1).bool()
        hidden = torch.cat([q, d], dim=1)
        cross = (is_query[:, :, None] != is_query[:, None, :]).unsqueeze(1).to(hidden.dtype)  # (B, 1, T, T)
        padding = torch.zeros_like(mask, dtype=hidden.dtype).masked_fill(mask == 0, torch.finfo(hidden.dtype).min)
        for bias, layer in zip(self.cross.bias, self.auto_model.encoder.layer[self.split_layer :]):
            out = layer(hidden, attention_mask=cross * bias.to(hidden.dtype) + padding[:, None, None, :])
            hidden = out[0] if isinstance(out, tuple) else out
        features["token_embeddings"] = hidden
        features["attention_mask"] = mask
        features[QUERY_MASK] = torch.cat([q_mask, torch.zeros_like(d_mask)], dim=1)
        return features


class SegmentInteraction(Module):
    """Pair feature of a :class:`SplitTransformer`'s joint output: ``hidden * normalize(mean_q) * normalize(mean_d)``,
    the element-wise product of the L2-normalised mean token states of the query and of the document (its sum is
    their cosine). Writes ``features["sentence_embedding"]``, shape ``(batch, hidden)``.

    Args:
        embedding_dimension: the hidden size.
    """

    config_keys: list[str] = ["embedding_dimension"]

    def __init__(self, embedding_dimension: int) -> None:
        super().__init__()
        self.embedding_dimension = int(embedding_dimension)

    def forward(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        if QUERY_MASK not in features:
            raise ValueError("SegmentInteraction reads a SplitTransformer's output (no query_token_mask)")
        tokens = features["token_embeddings"]
        mask = features["attention_mask"].to(tokens.dtype)
        q_mask = features[QUERY_MASK].to(tokens.dtype)
        d_mask = mask - q_mask

        def mean(m: Tensor) -> Tensor:
            return (tokens * m.unsqueeze(-1)).sum(1) / m.sum(1, keepdim=True).clamp_min(1.0)

        u_q, u_d = F.normalize(mean(q_mask), dim=-1), F.normalize(mean(d_mask), dim=-1)
        features["sentence_embedding"] = self.embedding_dimension * u_q * u_d
        return features

    def get_embedding_dimension(self) -> int:
        return self.embedding_dimension

    def save(self, output_path: str, *args: Any, **kwargs: Any) -> None:
        self.save_config(output_path)


def build_split_cross_encoder(
    base_model: str | None = None,
    *,
    joint_layers: int = 2,
    init_cross_bias: float = 0.0,
    variant: Variant | None = None,
    scale: float = 20.0,
    max_seq_length: int = 128,
    init_log_var: float = -2.0,
    device: str | None = None,
) -> CrossEncoder:
    """A split-attention cross-encoder (:class:`SplitTransformer` -> :class:`SegmentInteraction` -> head).

    Args:
        base_model: the encoder to start from: a sentence-transformers bi-encoder folder (mean pooling, e.g. the
            distillation teacher) or a Hugging Face BERT folder; default the packaged all-MiniLM-L6-v2.
        joint_layers: top layers that attend across query and document (PreTTR's split point from the top).
        init_cross_bias: the starting additive attention logit between query and document tokens in the joint
            layers (learned): 0 is plain joint attention; e.g. -4 starts the model close to the bi-encoder.
        variant: ``None`` for the plain cross-encoder (linear head: ``Dense(d, 1)``), or a VarCE module
            (``"VAR"``, ``"MEANVAR"``; :class:`VariationalHead`).
        scale: the head starts as ``scale * cos(query, document)`` (decoder weights ``scale / d``; the MEANVAR
            mean branch starts as the identity).
        max_seq_length: tokens per text (query and document each).
        init_log_var: the VarCE variance branch's starting log Sigma per latent unit; with weights
            ``scale / d`` the score's starting std is ``scale * exp(init_log_var / 2) / sqrt(d)``.
        device: where to put the model.

    Returns:
        A ``CrossEncoder`` (or ``VarCrossEncoder``) that saves and loads as any of ours
        (:func:`st_extensions.load_model`).
    """
    path = base_model if base_model is not None else default_model_path()
    transformer = SplitTransformer(
        path, joint_layers=joint_layers, init_cross_bias=init_cross_bias, max_seq_length=max_seq_length
    )
    dim = transformer.get_embedding_dimension()
    transformer.auto_model.config.num_labels = 1
    pool = SegmentInteraction(dim)
    if variant is None:
        head = LinearScoreHead(dim, 1, activation_function=nn.Identity(), module_output_name="scores")
        with torch.no_grad():
            head.linear.weight.fill_(scale / dim)
            head.linear.bias.zero_()
        return CrossEncoder(modules=[transformer, pool, head], device=device, activation_fn=nn.Identity())
    head = VariationalHead(dim, variant=variant, init_log_var=init_log_var)
    with torch.no_grad():
        head.decoder.weight.fill_(scale / dim)
        head.decoder.bias.zero_()
        if head.mean_branch is not None:
            head.mean_branch.weight.copy_(torch.eye(dim))
            head.mean_branch.bias.zero_()
    return VarCrossEncoder(modules=[transformer, pool, head], device=device, activation_fn=nn.Identity())


def split_state_cache(
    model: CrossEncoder, folder: str | None, texts: Sequence[str] = (), *, show_progress_bar: bool = False
) -> LayerStateCache:
    """Attach a per-text cache of the lower layers' states to ``model``'s :class:`SplitTransformer` (computing
    ``texts`` now, any other text on first use) and freeze those layers (embeddings and layers below the split):
    training then updates the joint layers and the head only, and scoring runs each text's lower layers once.

    Args:
        model: a model from :func:`build_split_cross_encoder` (or loaded).
        folder: the cache folder (reused when it holds states of the same lower weights and settings); ``None``: a
            temporary folder.
        texts: queries and documents to compute now.
        show_progress_bar: a bar while computing.
    """
    split = model[0]
    if not isinstance(split, SplitTransformer):
        raise ValueError(f"split_state_cache needs a model whose first module is a SplitTransformer, got {split!r:.80}")
    cache = LayerStateCache(folder, split, split.split_layer, show_progress_bar=show_progress_bar, batch_size=64)
    cache.extend(texts)
    backbone = split.auto_model
    for p in backbone.embeddings.parameters():
        p.requires_grad_(False)
    for layer in backbone.encoder.layer[: split.split_layer]:
        for p in layer.parameters():
            p.requires_grad_(False)
    split.state_cache = cache
    return cache
