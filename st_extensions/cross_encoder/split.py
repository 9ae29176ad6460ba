"""A split-attention cross-encoder (PreTTR, MacAvaney et al., SIGIR 2020) started from a bi-encoder. The lower ``L -
joint_layers`` layers read query and document apart (cacheable per text), the top ``joint_layers`` read them together;
:class:`SegmentInteraction`'s feature sums to their cosine, so a head of weights ``scale / hidden`` starts as ``scale *
cos``, close to the bi-encoder (``docs/varce.md``)."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from sentence_transformers import CrossEncoder
from sentence_transformers.base.modules import Dense, Module, Transformer
from sentence_transformers.util import batch_to_device
from torch import Tensor, nn

from st_extensions.checks import finite_float
from st_extensions.cross_encoder.head import Variant, VariationalHead
from st_extensions.cross_encoder.model import VarCrossEncoder
from st_extensions.defaults import default_model_path
from st_extensions.loading import register_module
from st_extensions.partial import (
    LayerStateCache,
    check_layers,
    check_partial_transformer,
    freeze_lower_layers,
    pair_key,
    run_top_layers,
)

__all__ = [
    "CrossAttentionBias",
    "KernelInteraction",
    "LinearScoreHead",
    "SCORE_SEPARATOR",
    "SegmentInteraction",
    "SplitTransformer",
    "build_split_cross_encoder",
    "cross_attention_mass",
    "joint_term",
    "kernel_pooling",
    "score_parts",
    "split_state_cache",
]

QUERY_MASK = "query_token_mask"
SEPARATE = "separate_token_embeddings"
#: The bi-encoder path's mean token state of each pair's query and document side, ``(batch, hidden)`` each: what
#: :func:`segment_product` reads of :data:`SEPARATE`, written instead of it in eval mode where the lower layers come
#: from the cache.
SEPARATE_MEANS = "separate_segment_means"
#: Each joint layer's output, bottom to top (the last is ``token_embeddings``).
JOINT_STATES = "joint_layer_states"
BIAS_FILE = "split_attention.safetensors"
SEPARATE_FILE = "bi_encoder_path.safetensors"
#: Between the first stage's score and the document in a score-as-text input: ``"12.34 [SEP] document"``.
SCORE_SEPARATOR = " [SEP] "


class CrossAttentionBias(nn.Module):
    """Per joint layer, the additive attention logit between a query token and a document token (learned; 0 is plain
    joint attention, a very negative value keeps the two texts apart as in the bi-encoder the model started from).
    New parameters: they train at their own ``learning_rate`` (:func:`pyterrier_prob.training.head_learning_rates`)."""

    learning_rate: float = 1e-2

    def __init__(self, layers: int, init: float) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.full((layers,), float(init)))


@register_module
class LinearScoreHead(Dense):
    """The plain cross-encoder's linear ranker on the pair feature (sentence-transformers' ``Dense(d, 1)`` writing
    ``"scores"``), declaring the learning rate of new parameters (the VarCE head's)."""

    learning_rate: float = VariationalHead.learning_rate


@register_module
class SplitTransformer(Transformer):
    """A BERT ``Transformer`` whose lower layers read query and document apart and whose top ``joint_layers`` read them
    together (PreTTR), with a learned query-document attention logit starting at ``init_cross_bias`` (<= 0); it writes
    ``token_embeddings``, the joint ``attention_mask`` and ``query_token_mask`` (lower layers from ``state_cache`` when
    :func:`split_state_cache` set one). Single texts run the plain ``Transformer`` forward."""

    config_keys: list[str] = [
        *Transformer.config_keys, "joint_layers", "init_cross_bias", "score_segment", "bi_encoder_path"
    ]  # fmt: skip
    #: Settings of the joint layers only: the lower layers' cached states do not depend on them.
    top_only_keys: tuple[str, ...] = ("joint_layers", "init_cross_bias", "score_segment", "bi_encoder_path")

    def __init__(
        self,
        model_name_or_path: str,
        *,
        joint_layers: int = 2,
        init_cross_bias: float = 0.0,
        score_segment: bool = False,
        bi_encoder_path: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(model_name_or_path, **kwargs)
        num_layers = len(check_partial_transformer(self).encoder.layer)
        self.joint_layers = check_layers("joint_layers", joint_layers, 1, num_layers, num_layers)
        self.init_cross_bias = finite_float("init_cross_bias", init_cross_bias, high=0.0)
        self.score_segment = bool(score_segment)
        self.bi_encoder_path = bool(bi_encoder_path)
        self.cross = CrossAttentionBias(joint_layers, self.init_cross_bias)
        # a frozen copy of the top layers: each text read apart, as the bi-encoder the model starts from
        self.separate = (
            nn.ModuleList(copy.deepcopy(self.auto_model.encoder.layer[self.split_layer :]))
            if (self.bi_encoder_path)
            else None
        )
        if self.separate is not None:
            self.separate.requires_grad_(False)
        self._state_cache: LayerStateCache | None = None
        #: the bi-encoder path's mean token state per cache row, kept in eval mode (frozen layers without dropout on
        #: cached inputs: a constant of the text); emptied when another state cache is set
        self._separate_means: dict[int, Tensor] = {}
        #: False: the bi-encoder path runs per pair in eval mode too (what the per-text cache saves, measured by
        #: ``benchmarks/joint_speed.py``)
        self.cache_separate = True
        #: runs the pair path on another runtime (:func:`st_extensions.cross_encoder.load_cross_encoder`): tokenised
        #: pairs -> this module's pair outputs (``token_embeddings``, ``attention_mask``, ``query_token_mask``,
        #: each joint layer's states and the bi-encoder path's); None: torch
        self.runtime: Callable[[dict[str, Any]], dict[str, Any]] | None = None

    def save(self, output_path: str, *args: Any, safe_serialization: bool = True, **kwargs: Any) -> None:
        super().save(output_path, *args, safe_serialization=safe_serialization, **kwargs)
        save_file({"cross_bias": self.cross.bias.detach().cpu().contiguous()}, os.path.join(output_path, BIAS_FILE))
        if self.separate is not None:
            state = {k: v.detach().cpu().contiguous() for k, v in self.separate.state_dict().items()}
            save_file(state, os.path.join(output_path, SEPARATE_FILE))

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", **kwargs: Any) -> SplitTransformer:
        module = super().load(model_name_or_path, subfolder=subfolder, **kwargs)
        path = os.path.join(model_name_or_path, subfolder, BIAS_FILE)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path} is missing: the SplitTransformer's learned cross-attention bias")
        bias = load_file(path)["cross_bias"]
        if bias.shape != module.cross.bias.shape:
            raise ValueError(f"{path} holds {tuple(bias.shape)} biases, the config says {module.joint_layers} layers")
        module.cross.load_state_dict({"bias": bias})
        if module.separate is not None:
            path = os.path.join(model_name_or_path, subfolder, SEPARATE_FILE)
            if not os.path.exists(path):
                raise FileNotFoundError(f"{path} is missing: the SplitTransformer's frozen bi-encoder layers")
            module.separate.load_state_dict(load_file(path))
        return module

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._separate_means = {}  # computed with the weights being replaced
        super()._load_from_state_dict(*args, **kwargs)

    @property
    def state_cache(self) -> LayerStateCache | None:
        """The lower layers' states per text (:func:`split_state_cache`), or None: computed per batch."""
        return self._state_cache

    @state_cache.setter
    def state_cache(self, cache: LayerStateCache | None) -> None:
        self._state_cache = cache
        self._separate_means = {}  # its rows name other texts now

    @property
    def split_layer(self) -> int:
        """The first layer that reads query and document together (L - ``joint_layers``)."""
        return len(self.auto_model.encoder.layer) - self.joint_layers

    def split_score(self, document: str) -> tuple[str, str]:
        """``(score text, document)`` of a score-as-text input ``"<score> [SEP] <document>"`` (a ValueError without
        the separator)."""
        score, sep, rest = document.partition(SCORE_SEPARATOR)
        if not sep:
            raise ValueError(
                f"this cross-encoder reads the first stage's score as text: a document must come as "
                f"'<score>{SCORE_SEPARATOR}<text>', got {document!r:.60}"
            )
        return score, rest

    def cache_texts(self, pairs: Sequence[Any]) -> list[str]:
        """The distinct texts whose lower-layer states the pairs need (queries and documents; a score read as text is
        computed on the fly, so one document's states serve every score it comes with)."""
        texts = (t for x in pairs for t in self._texts(pair_key(x)))
        return list(dict.fromkeys(texts))

    def _texts(self, pair: tuple[str, str]) -> tuple[str, str]:
        return (pair[0], self.split_score(pair[1])[1]) if self.score_segment else pair

    def preprocess(self, inputs: Sequence[Any], prompt: str | None = None, **kwargs: Any) -> dict[str, Any]:
        inputs = list(inputs)
        if not inputs or all(isinstance(x, str) for x in inputs):
            return super().preprocess(inputs, prompt=prompt, **kwargs) if inputs else {}
        pairs = [pair_key(x) for x in inputs]
        out: dict[str, Any] = {}
        if self.score_segment:
            scores = [self.split_score(d)[0] for _, d in pairs]
            f = super().preprocess(scores, **kwargs)
            out = {"score_input_ids": f["input_ids"], "score_attention_mask": f["attention_mask"]}
        texts = [self._texts(p) for p in pairs]
        queries, documents = [q for q, _ in texts], [d for _, d in texts]
        if self.state_cache is not None:
            if prompt:
                raise ValueError("the layer-state cache holds texts without prompts; got a prompt")
            rows = self.state_cache.rows(queries + documents)
            out |= {"query_rows": torch.tensor(rows[: len(pairs)]), "document_rows": torch.tensor(rows[len(pairs) :])}
            return out
        q = super().preprocess(queries, prompt=prompt, **kwargs)
        d = super().preprocess(documents, **kwargs)
        side = {f"{name}{k}": f[k] for name, f in (("", q), ("document_", d)) for k in ("input_ids", "attention_mask")}
        return out | side

    def _lower(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """States entering layer ``split_layer`` of one side's texts (embeddings, then the lower layers)."""
        backbone = self.auto_model
        hidden = backbone.embeddings(input_ids=input_ids, token_type_ids=torch.zeros_like(input_ids))
        return run_top_layers(backbone, hidden, attention_mask, 0, stop=self.split_layer)

    def _cached(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        rows = rows.tolist()
        lengths = self.state_cache.lengths(rows)
        weight = self.auto_model.encoder.layer[self.split_layer].attention.self.query.weight
        states = torch.from_numpy(self.state_cache.gather(rows)).to(device=weight.device, dtype=weight.dtype)
        mask = torch.as_tensor(np.arange(states.shape[1])[None, :] < lengths[:, None], device=weight.device)
        return states, mask.long()

    def joint_inputs(self, features: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor] | None:
        """The states entering the first joint layer (query tokens then document tokens), their attention mask and
        which tokens are the query's, for a batch of pairs (None: a batch of single texts)."""
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
            return None
        if "score_input_ids" in features:  # the score read as text: a segment after the query's, on its side
            s_mask = features["score_attention_mask"].to(q_mask.device)
            s = self._lower(features["score_input_ids"].to(q_mask.device), s_mask).to(q.dtype)
            q, q_mask = torch.cat([q, s], dim=1), torch.cat([q_mask, s_mask.to(q_mask.dtype)], dim=1)
        is_query = torch.cat([torch.ones_like(q_mask), torch.zeros_like(d_mask)], dim=1).bool()
        return torch.cat([q, d], dim=1), torch.cat([q_mask, d_mask], dim=1), is_query

    def run_joint(
        self,
        hidden: Tensor,
        mask: Tensor,
        is_query: Tensor,
        observe: Callable[..., None] | None = None,
        outputs: list[Tensor] | None = None,
    ) -> Tensor:
        """The top ``joint_layers`` layers over the joint sequence; ``observe(i, layer, hidden, additive_mask)`` sees
        the input of joint layer ``i`` (what :func:`cross_attention_mass` measures); ``outputs`` collects each joint
        layer's output."""
        cross = (is_query[:, :, None] != is_query[:, None, :]).unsqueeze(1).to(hidden.dtype)  # (B, 1, T, T)
        padding = torch.zeros_like(mask, dtype=hidden.dtype).masked_fill(mask == 0, torch.finfo(hidden.dtype).min)
        for i, (bias, layer) in enumerate(zip(self.cross.bias, self.auto_model.encoder.layer[self.split_layer :])):
            additive = cross * bias.to(hidden.dtype) + padding[:, None, None, :]
            if observe is not None:
                observe(i, layer, hidden, additive)
            out = layer(hidden, attention_mask=additive)
            hidden = out[0] if isinstance(out, tuple) else out
            if outputs is not None:
                outputs.append(hidden)
        return hidden

    def run_separate(self, hidden: Tensor, mask: Tensor, is_query: Tensor) -> Tensor:
        """The frozen copy of the top layers over the same sequence with no attention between the two texts: each text
        read apart, token for token what the bi-encoder the model started from computes (``bi_encoder_path``)."""
        if self.separate is None:
            raise ValueError("this SplitTransformer has no bi-encoder path (bi_encoder_path=False)")
        low = torch.finfo(hidden.dtype).min
        apart = (is_query[:, :, None] != is_query[:, None, :]) | (mask == 0)[:, None, :]  # (B, T, T)
        additive = torch.zeros_like(apart, dtype=hidden.dtype).masked_fill(apart, low)
        with torch.no_grad():
            for layer in self.separate:
                out = layer(hidden, attention_mask=additive[:, None])
                hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def _separate_mean(self, hidden: Tensor, mask: Tensor) -> Tensor:
        """The bi-encoder path over texts ``(n, T, hidden)`` each read alone (:meth:`run_separate` with one segment):
        the mean of its output over each text's tokens ``(n, hidden)``."""
        return masked_mean(self.run_separate(hidden, mask, torch.ones_like(mask, dtype=torch.bool)), mask)

    def _separate_side(self, rows: list[int], hidden: Tensor, mask: Tensor) -> Tensor:
        """:meth:`_separate_mean` of one side of a batch, each cache row computed once (the first pair holding it)
        and kept: in eval mode the frozen path's output depends only on the text."""
        known = self._separate_means
        first = {row: i for i, row in reversed(list(enumerate(rows))) if row not in known}
        if first:
            at = list(first.values())
            width = int(mask[at].sum(1).max())
            for row, mean in zip(first, self._separate_mean(hidden[at, :width], mask[at, :width])):
                known[row] = mean
        return torch.stack([known[row] for row in rows]).to(device=hidden.device, dtype=hidden.dtype)  # if moved

    def separate_means(self, features: dict[str, Any], hidden: Tensor, mask: Tensor, is_query: Tensor) -> Tensor:
        """The bi-encoder path's mean token state of each pair's query side and document side, ``(2, batch,
        hidden)``, from the per-text cache (pairs that came as cache rows, in eval mode; a query side that also reads
        a score as text is computed per pair): the values :func:`segment_product` takes of :meth:`run_separate`'s
        output, to float rounding, at a cost per distinct text instead of per pair. In training mode the path runs
        per pair, as its layers' dropout is then on."""
        width = int(is_query[0].sum())  # the query side first, in every pair
        q_side, d_side = (hidden[:, :width], mask[:, :width]), (hidden[:, width:], mask[:, width:])
        d = self._separate_side(features["document_rows"].tolist(), *d_side)
        if "score_input_ids" in features:  # the query side holds the score's tokens too: one per pair
            q = self._separate_mean(*q_side)
        else:
            q = self._separate_side(features["query_rows"].tolist(), *q_side)
        return torch.stack([q, d])

    def forward(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        if self.runtime is not None and "document_input_ids" in features:
            features.update(self.runtime(features))
            return features
        joint = self.joint_inputs(features)
        if joint is None:
            return super().forward(features, **kwargs)
        hidden, mask, is_query = joint
        if self.separate is not None and "query_rows" in features and self.cache_separate and not self.training:
            features[SEPARATE_MEANS] = self.separate_means(features, hidden, mask, is_query)
        elif self.separate is not None:
            features[SEPARATE] = self.run_separate(hidden, mask, is_query)
        features[JOINT_STATES] = []
        features["token_embeddings"] = self.run_joint(hidden, mask, is_query, outputs=features[JOINT_STATES])
        features["attention_mask"] = mask
        features[QUERY_MASK] = (mask.bool() & is_query).long()
        return features


def segment_product(tokens: Tensor, q_mask: Tensor, mask: Tensor, scale: float) -> Tensor:
    """``scale * normalize(mean_q) * normalize(mean_d)`` of a pair's token states ``(batch, hidden)``: its sum is
    ``scale`` times the cosine of the query's and the document's mean tokens (``q_mask``: the query's tokens)."""
    return means_product(masked_mean(tokens, q_mask), masked_mean(tokens, mask - q_mask), scale)


def masked_mean(tokens: Tensor, mask: Tensor) -> Tensor:
    """The mean of ``tokens`` ``(batch, T, hidden)`` over the positions ``mask`` marks ``(batch, T)``; 0 where none."""
    m = mask.to(tokens.dtype).unsqueeze(-1)
    return (tokens * m).sum(1) / m.sum(1).clamp_min(1.0)


def means_product(mean_q: Tensor, mean_d: Tensor, scale: float) -> Tensor:
    """``scale * normalize(mean_q) * normalize(mean_d)`` (:func:`segment_product` of given means)."""
    return scale * F.normalize(mean_q, dim=-1) * F.normalize(mean_d, dim=-1)


def separate_product(features: dict[str, Any], q_mask: Tensor, mask: Tensor, scale: float) -> Tensor:
    """:func:`segment_product` of the bi-encoder path, from its per-side means where the SplitTransformer wrote them
    (:data:`SEPARATE_MEANS`, the cached path), else from its token states (:data:`SEPARATE`)."""
    if SEPARATE_MEANS in features:
        return means_product(*features[SEPARATE_MEANS], scale)
    return segment_product(features[SEPARATE], q_mask, mask, scale)


def has_separate(features: dict[str, Any]) -> bool:
    """Whether a SplitTransformer's output holds its bi-encoder path (token states or per-side means)."""
    return SEPARATE in features or SEPARATE_MEANS in features


@register_module
class SegmentInteraction(Module):
    """Pair feature ``scale * normalize(mean_q) * normalize(mean_d)`` of a :class:`SplitTransformer`'s output (its sum
    is ``scale`` times the query-document cosine; ``scale`` defaults to ``hidden``), written as ``sentence_embedding``
    ``(batch, hidden)``; with ``bi_encoder_path`` the same feature of the frozen bi-encoder path first, then the joint
    layers': ``(batch, 2 * hidden)``."""

    config_keys: list[str] = ["embedding_dimension", "bi_encoder_path", "scale"]

    def __init__(self, embedding_dimension: int, bi_encoder_path: bool = False, scale: float | None = None) -> None:
        super().__init__()
        self.embedding_dimension = int(embedding_dimension)
        self.bi_encoder_path = bool(bi_encoder_path)
        self.scale = float(self.embedding_dimension if scale is None else finite_float("scale", scale, low=0.0))

    def _feature(self, tokens: Tensor, q_mask: Tensor, mask: Tensor) -> Tensor:
        return segment_product(tokens, q_mask, mask, self.scale)

    def forward(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        if QUERY_MASK not in features:
            raise ValueError("SegmentInteraction reads a SplitTransformer's output (no query_token_mask)")
        if self.bi_encoder_path and not has_separate(features):
            raise ValueError("SegmentInteraction(bi_encoder_path=True) reads a SplitTransformer with a bi-encoder path")
        tokens = features["token_embeddings"]
        q_mask, mask = features[QUERY_MASK].to(tokens.dtype), features["attention_mask"].to(tokens.dtype)
        joint = self._feature(tokens, q_mask, mask)
        if self.bi_encoder_path:
            joint = torch.cat([separate_product(features, q_mask, mask, self.scale), joint], dim=-1)
        features["sentence_embedding"] = joint
        return features

    def get_embedding_dimension(self) -> int:
        return self.embedding_dimension * (2 if self.bi_encoder_path else 1)

    def save(self, output_path: str, *args: Any, **kwargs: Any) -> None:
        self.save_config(output_path)


#: KNRM's kernel means (Xiong et al., SIGIR 2017, Sec. 3): exact match at 1, then soft matches 0.9 ... -0.9.
KERNEL_MUS = (1.0, 0.9, 0.7, 0.5, 0.3, 0.1, -0.1, -0.3, -0.5, -0.7, -0.9)
#: The exact-match kernel's width; the soft kernels' is :data:`KERNEL_SIGMA`.
EXACT_SIGMA, KERNEL_SIGMA = 1e-3, 0.1


def kernel_pooling(
    tokens: Tensor, q_mask: Tensor, mask: Tensor, mus: Sequence[float], sigmas: Sequence[float]
) -> Tensor:
    """KNRM's kernel pooling (Xiong et al., SIGIR 2017, Eq. 3-5) of one layer's pair states ``(batch, T, hidden)``:
    the cosine ``M_ij`` of each query token ``i`` with each document token ``j``, the soft term frequency
    ``K_k(i) = sum_j exp(-(M_ij - mu_k)^2 / (2 sigma_k^2))`` per kernel, and ``log(1 + K_k(i))`` averaged over the
    query's tokens: ``(batch, len(mus))``. ``log1p`` where KNRM takes ``log`` saturates as BM25's TF does and stays
    finite on a document with no match; the average over query tokens keeps the feature's scale apart from the query's
    length (within a query the ranking is the same as KNRM's sum). Only the positions that hold a query token in some
    pair of the batch are rows of ``M``, and only those that hold a document token in some pair its columns:
    ``(batch, Lq, Ld, K)`` where every token against every token would be ``(batch, T, T, K)``."""
    n = F.normalize(tokens, dim=-1)
    d_mask = (mask - q_mask).to(n.dtype)
    rows = q_mask.bool().any(0).nonzero().squeeze(1)  # positions that are a query token somewhere in the batch
    cols = d_mask.bool().any(0).nonzero().squeeze(1)  # ... a document token
    sim = n[:, rows] @ n[:, cols].transpose(1, 2)  # (B, Lq, Ld): rows: query tokens, columns: document tokens
    mu = torch.as_tensor(mus, dtype=n.dtype, device=n.device)
    sigma = torch.as_tensor(sigmas, dtype=n.dtype, device=n.device)
    k = torch.exp(-((sim.unsqueeze(-1) - mu) ** 2) / (2 * sigma**2)) * d_mask[:, None, cols, None]  # (B, Lq, Ld, K)
    soft_tf = torch.log1p(k.sum(2))  # (B, Lq, K)
    return masked_mean(soft_tf, q_mask[:, rows])


@register_module
class KernelInteraction(Module):
    """Pair feature of a ``bi_encoder_path`` :class:`SplitTransformer`: the frozen bi-encoder path's ``scale *
    normalize(mean_q) * normalize(mean_d)`` (its sum is ``scale * cos``), then per joint layer the kernel pooling of its
    query-document token similarities (:func:`kernel_pooling`, CEDR-KNRM: MacAvaney et al., SIGIR 2019, Sec. 3.2,
    on each layer that reads both texts), times ``scale`` so that its weights train at the pace of the cosine's;
    written as ``sentence_embedding`` ``(batch, hidden + joint_layers * len(mus))``."""

    config_keys: list[str] = ["embedding_dimension", "joint_layers", "mus", "sigmas", "scale"]

    def __init__(
        self,
        embedding_dimension: int,
        joint_layers: int,
        mus: Sequence[float] = KERNEL_MUS,
        sigmas: Sequence[float] | None = None,
        scale: float = 20.0,
    ) -> None:
        super().__init__()
        self.embedding_dimension, self.joint_layers = int(embedding_dimension), int(joint_layers)
        self.mus = [finite_float("mus", m, low=-1.0, high=1.0) for m in mus]
        sigmas = [EXACT_SIGMA if m == 1.0 else KERNEL_SIGMA for m in self.mus] if sigmas is None else sigmas
        self.sigmas = [finite_float("sigmas", x, low=1e-6) for x in sigmas]
        if not self.mus or len(self.sigmas) != len(self.mus):
            raise ValueError(f"KernelInteraction needs one sigma per kernel mean: {len(self.mus)} mus, {len(sigmas)}")
        self.scale = finite_float("scale", scale, low=0.0)

    def forward(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        if not has_separate(features) or JOINT_STATES not in features:
            raise ValueError("KernelInteraction reads a SplitTransformer built with bi_encoder_path=True")
        states = features[JOINT_STATES]
        q_mask, mask = features[QUERY_MASK].to(states[-1].dtype), features["attention_mask"].to(states[-1].dtype)
        parts = [separate_product(features, q_mask, mask, self.scale)]
        parts += [self.scale * kernel_pooling(x, q_mask, mask, self.mus, self.sigmas) for x in states]
        features["sentence_embedding"] = torch.cat(parts, dim=-1)
        return features

    def get_embedding_dimension(self) -> int:
        return self.embedding_dimension + self.joint_layers * len(self.mus)

    def save(self, output_path: str, *args: Any, **kwargs: Any) -> None:
        self.save_config(output_path)


def build_split_cross_encoder(
    base_model: str | None = None,
    *,
    joint_layers: int = 2,
    init_cross_bias: float = 0.0,
    score_segment: bool = False,
    bi_encoder_path: bool = False,
    joint_feature: str = "cosine",
    variant: Variant | None = None,
    scale: float = 20.0,
    max_seq_length: int = 128,
    init_log_var: float = -2.0,
    device: str | None = None,
) -> CrossEncoder:
    """A split-attention cross-encoder (:class:`SplitTransformer` -> :class:`SegmentInteraction` -> head) that saves and
    loads as ours (:func:`st_extensions.load_model`). ``base_model``: a bi-encoder (mean pooling) or BERT folder
    (default the packaged all-MiniLM-L6-v2); ``variant``: ``None`` (``Dense(d, 1)``) or a VarCE module; the head starts
    as ``scale * cos(query, document)``; ``init_log_var`` sets the starting score std ``scale * exp(init_log_var / 2) /
    sqrt(d)``; ``max_seq_length`` per text; ``score_segment``: each document comes as ``"<score> [SEP] <text>"`` (the
    first stage's score as text, Askari et al., ECIR 2023) and the score's tokens join the query's side of the joint
    layers, their lower layers computed on the fly so that the document's cached states serve every score;
    ``bi_encoder_path``: a frozen copy of the top layers also reads each text apart, and the score is ``scale * cos``
    of that bi-encoder path plus a linear term of the joint layers' feature whose weights start at 0, so the model
    starts exactly as the bi-encoder while its joint layers attend across the pair from the first step (the residual
    a cross-encoder adds to the bi-encoder is what trains); its feature carries ``scale`` and the head's weights start
    at 1 (bi-encoder path) and 0 (joint), so that the head's optimiser steps are small beside its weights (a MEANVAR's
    mean branch starts as the identity and trains at the head's rate divided by its width, ``mean_branch_rate``);
    ``joint_feature``: what the joint layers' term reads, ``"cosine"`` (their pooled segments' product) or
    ``"kernels"`` (:class:`KernelInteraction`: kernel pooling of each joint layer's token similarities; needs
    ``bi_encoder_path``)."""
    if joint_feature not in ("cosine", "kernels"):
        raise ValueError(f"joint_feature must be 'cosine' or 'kernels', got {joint_feature!r}")
    if joint_feature == "kernels" and not bi_encoder_path:
        raise ValueError("joint_feature='kernels' needs bi_encoder_path=True (the score's bi-encoder part)")
    path = base_model if base_model is not None else default_model_path()
    transformer = SplitTransformer(
        path,
        joint_layers=joint_layers,
        init_cross_bias=init_cross_bias,
        score_segment=score_segment,
        bi_encoder_path=bi_encoder_path,
        max_seq_length=max_seq_length,
    )
    dim = transformer.get_embedding_dimension()
    if joint_feature == "kernels":
        interaction: Module = KernelInteraction(dim, joint_layers, scale=scale)
    else:
        interaction = SegmentInteraction(dim, bi_encoder_path=bi_encoder_path, scale=scale if bi_encoder_path else None)
    features = interaction.get_embedding_dimension()
    transformer.auto_model.config.num_labels = 1
    if variant is None:
        head = LinearScoreHead(features, 1, activation_function=nn.Identity(), module_output_name="scores")
        decoder, mean_branch, model_class = head.linear, None, CrossEncoder
    else:
        head = VariationalHead(features, variant=variant, init_log_var=init_log_var)
        if head.mean_branch is not None:  # started as the identity (below): the head's rate / width (VariationalHead)
            head.mean_branch_rate = 1.0 / features
        decoder, mean_branch, model_class = head.decoder, head.mean_branch, VarCrossEncoder
    with torch.no_grad():
        decoder.weight.fill_(scale / interaction.scale)
        if bi_encoder_path:  # the joint layers' term starts at 0: the score is the bi-encoder path's
            decoder.weight[:, dim:] = 0.0
        decoder.bias.zero_()
        if mean_branch is not None:
            mean_branch.weight.copy_(torch.eye(features))
            mean_branch.bias.zero_()
    return model_class(modules=[transformer, interaction, head], device=device, activation_fn=nn.Identity())


def split_state_cache(
    model: CrossEncoder, folder: str | None, texts: Sequence[str] = (), *, show_progress_bar: bool = False
) -> LayerStateCache:
    """Attach a cache of the lower layers' states per text to ``model``'s :class:`SplitTransformer` (``texts`` now, the
    rest on first use; ``folder`` reused when it holds the same states, ``None``: temporary) and freeze those layers."""
    split = model[0]
    if not isinstance(split, SplitTransformer):
        raise ValueError(f"split_state_cache needs a model whose first module is a SplitTransformer, got {split!r:.80}")
    cache = LayerStateCache(folder, split, split.split_layer, show_progress_bar=show_progress_bar, batch_size=64)
    cache.extend(texts)
    freeze_lower_layers(split.auto_model, split.split_layer)
    split.state_cache = cache
    return cache


def attention_probabilities(layer: nn.Module, hidden: Tensor, additive_mask: Tensor) -> Tensor:
    """Softmax attention weights ``(batch, heads, T, T)`` of a BERT ``layer`` on ``hidden`` under ``additive_mask``
    (``softmax(Q K^T / sqrt(d_head) + mask)``, Vaswani et al. 2017, Eq. 1), computed from its own projections."""
    attn = layer.attention.self
    shape = (*hidden.shape[:-1], -1, attn.attention_head_size)
    q = attn.query(hidden).view(shape).transpose(1, 2)
    k = attn.key(hidden).view(shape).transpose(1, 2)
    return torch.softmax(q @ k.transpose(-1, -2) / attn.attention_head_size**0.5 + additive_mask, dim=-1)


@torch.no_grad()
def cross_attention_mass(model: CrossEncoder, pairs: Sequence[tuple[str, str]], batch_size: int = 32) -> list[dict]:
    """Per joint layer of a split cross-encoder, over ``pairs``: the attention mass a query token puts on the
    document's tokens (``query_to_document``) and a document token on the query's (``document_to_query``), averaged
    over heads, tokens and pairs, beside the share uniform attention over the pair's tokens would give
    (``uniform_*``: the other text's tokens over all). A mass near 0 means the layer reads each text apart."""
    split = model[0]
    if not isinstance(split, SplitTransformer):
        raise ValueError(f"cross_attention_mass needs a SplitTransformer model, got {type(split).__name__}")
    if not pairs:
        raise ValueError("cross_attention_mass needs at least one (query, document) pair")
    sums = np.zeros((split.joint_layers, 4))
    tokens = np.zeros(2)

    def observe(i: int, layer: nn.Module, hidden: Tensor, additive: Tensor) -> None:
        probs = attention_probabilities(layer, hidden, additive).mean(1)  # (B, T, T), heads averaged
        for j, (rows, cols) in enumerate(((is_q, is_d), (is_d, is_q))):
            on_other = (probs * cols[:, None, :]).sum(-1)  # (B, T): each token's mass on the other text
            share = cols.sum(-1, keepdim=True) / (is_q + is_d).sum(-1, keepdim=True)  # uniform attention's
            sums[i, j] += float((on_other * rows).sum())
            sums[i, 2 + j] += float((share * rows).sum())

    was_training = split.training
    split.eval()
    try:
        for start in range(0, len(pairs), batch_size):
            features = batch_to_device(split.preprocess(list(pairs[start : start + batch_size])), model.device)
            hidden, mask, is_query = split.joint_inputs(features)
            is_q = (is_query & mask.bool()).to(hidden.dtype)
            is_d = (~is_query & mask.bool()).to(hidden.dtype)
            tokens += [float(is_q.sum()), float(is_d.sum())]
            split.run_joint(hidden, mask, is_query, observe)
    finally:
        split.train(was_training)
    names = ("query_to_document", "document_to_query", "uniform_query_to_document", "uniform_document_to_query")
    return [
        {"layer": split.split_layer + i, **{n: float(sums[i, j] / tokens[j % 2]) for j, n in enumerate(names)}}
        for i in range(split.joint_layers)
    ]


def score_parts(model: CrossEncoder, pairs: Sequence[tuple[str, str]], batch_size: int = 32) -> tuple[Tensor, Tensor]:
    """Per pair, a ``bi_encoder_path`` student's score (E[s] for a VarCE) and its bi-encoder path's part: the score is
    linear in the pair feature, so that part is the score with the joint half of the feature set to 0 (the joint
    layers' part is the difference)."""
    split, interaction, head = model[0], model[1], model[2]
    if not (isinstance(split, SplitTransformer) and split.bi_encoder_path):
        raise ValueError("score_parts and joint_term need a split cross-encoder built with bi_encoder_path=True")
    if not pairs:
        raise ValueError("score_parts and joint_term need at least one (query, document) pair")
    dim, full, bi = split.get_embedding_dimension(), [], []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(pairs), batch_size):
                features = batch_to_device(split.preprocess(list(pairs[start : start + batch_size])), model.device)
                features = interaction(split(features))
                apart = dict(features, sentence_embedding=features["sentence_embedding"].clone())
                apart["sentence_embedding"][:, dim:] = 0.0
                full.append(head(features)["scores"].reshape(-1))
                bi.append(head(apart)["scores"].reshape(-1))
    finally:
        model.train(was_training)
    return torch.cat(full), torch.cat(bi)


def joint_term(model: CrossEncoder, pairs: Sequence[tuple[str, str]], batch_size: int = 32) -> dict[str, float]:
    """How much of a ``bi_encoder_path`` student's score its joint layers make, over ``pairs`` (:func:`score_parts`):
    the standard deviation over the pairs of the score and of each part, and ``joint_share``: the joint part's over
    the score's (0: the model ranks as its bi-encoder path)."""
    full, bi = score_parts(model, pairs, batch_size)
    s, b = full.double(), bi.double()
    std = {"score_std": float(s.std()), "bi_encoder_std": float(b.std()), "joint_std": float((s - b).std())}
    return {"pairs": len(s), **std, "joint_share": std["joint_std"] / max(std["score_std"], 1e-12)}
