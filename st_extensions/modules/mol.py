"""The Mixture-of-Logits (MoL) head: component embeddings and the learned gating, saved inside the model.

Ding & Zhai, *Retrieval with Learned Similarities* (WWW'25, ``../shared/papers/mixture-of-logits.txt``).
MoL scores a query q and a document x with P = P_q * P_x gated inner products of L2-normalised low-rank
"component" embeddings f_pq(q), g_px(x) in R^{d_P} (Eq. 1-2)::

    phi(q, x) = sum_{pq, px} pi_{pq,px}(q, x) < f_pq(q) / ||f_pq(q)||, g_px(x) / ||g_px(x)|| >

with gating weights pi(q, x) >= 0 summing to 1. Throughout, the P pairs are flattened **pq-major**:
pair ``p = pq * P_x + px``, i.e. ``dots.reshape(..., P_q, P_x)[..., pq, px]``.

The core maths are pure functions (:func:`component_dots`, :func:`component_dots_all`, :func:`mixture_scores`,
:func:`entropy`, :func:`mutual_information_loss`); :class:`MixtureOfLogits` holds the parameters (component
construction of Sec. 2.2 / App. A.2 and the gating MLP of App. A.3).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from st_extensions.distributed import GlobalBatch, all_reduce_sum
from st_extensions.modules.safetensors_module import SafetensorsModule

ComponentSource = Literal["tokens", "heads"]
COMPONENT_SOURCES: tuple[str, ...] = ("tokens", "heads")
TASKS: tuple[str, ...] = ("query", "document")
#: ``features`` key the module writes on the query / document path: (batch, P_q or P_x, d_P), L2-normalised.
COMPONENTS_KEY = "mol_components"
#: ``features`` key read as the gate's query- / document-side features (App. A.3) when ``gate_features``.
FEATURES_KEY = "sentence_embedding"


# --------------------------------------------------------------------------------------------------
# Pure functions (Eq. 1-4)
# --------------------------------------------------------------------------------------------------


def component_dots(q_components: Tensor, x_components: Tensor) -> Tensor:
    """The P = P_q * P_x inner products <f_pq(q), g_px(x)> of each query with its own candidates.

    Args:
        q_components: ``(B, P_q, d)``.
        x_components: ``(B, C, P_x, d)``: C candidates per query.

    Returns:
        ``(B, C, P_q * P_x)``, pq-major (pair ``p = pq * P_x + px``).
    """
    b, c, px = x_components.shape[:3]
    return torch.einsum("bqd,bcxd->bcqx", q_components, x_components).reshape(b, c, q_components.shape[1] * px)


def component_dots_all(q_components: Tensor, x_components: Tensor) -> Tensor:
    """The component inner products of every query with every document of a shared set.

    Args:
        q_components: ``(B, P_q, d)``.
        x_components: ``(N, P_x, d)``.

    Returns:
        ``(B, N, P_q * P_x)``, pq-major.
    """
    n, px = x_components.shape[:2]
    b, pq = q_components.shape[:2]
    return torch.einsum("bqd,nxd->bnqx", q_components, x_components).reshape(b, n, pq * px)


def mixture_scores(weights: Tensor, dots: Tensor) -> Tensor:
    """phi = sum_p pi_p <f_p, g_p> (Eq. 1) for gating weights and inner products of shape ``(..., P)``."""
    return (weights * dots).sum(-1)


def entropy(probs: Tensor, dim: int = -1, eps: float = 1e-12) -> Tensor:
    """Shannon entropy -sum p log p along ``dim`` (natural log); p is clamped to ``eps`` inside the log so
    that a zero probability contributes 0 with finite gradients."""
    return -(probs * torch.log(probs.clamp_min(eps))).sum(dim)


def mutual_information_loss(weights: Tensor, eps: float = 1e-12, batch: GlobalBatch | None = None) -> Tensor:
    """The load-balancing loss L_MI = -H(p) + H(p | (q, x)) of Eq. 3.

    Every leading index of ``weights`` (shape ``(..., P)``, rows summing to 1) is one (q, x) pair, all pairs
    equally likely: H(p) is the entropy of the batch-average gate p(p) = mean_{(q,x)} pi_p(q, x) (the load on
    each component pair, to be spread evenly), H(p | (q, x)) the average entropy of the per-pair gates (to be
    kept low, i.e. sparse). L_MI = -I(p; (q, x)) <= 0; it is 0 when P = 1 or when every pair gets the same
    gate.

    ``batch``: the global batch of a loss that gathers across devices (:class:`st_extensions.distributed.GlobalBatch`)
    when ``weights`` are this rank's pairs (its anchors x the global candidates). H(p) is not linear in the pairs, so
    the batch-average gate is summed over the ranks by a differentiable all-reduce, and the value is this rank's share
    of L_MI over every pair of the global batch: the mean over the ranks is the single-process L_MI.
    """
    flat = weights.reshape(-1, weights.shape[-1])
    if batch is None or not batch.gathers:
        return -entropy(flat.mean(0), eps=eps) + entropy(flat, eps=eps).mean()
    count = all_reduce_sum(torch.tensor(float(flat.shape[0]), device=flat.device, dtype=torch.float32))
    marginal = (all_reduce_sum(flat.sum(0).float()) / count).to(flat.dtype)
    return -entropy(marginal, eps=eps) + batch.mean(entropy(flat, eps=eps))


# --------------------------------------------------------------------------------------------------
# Aggregation tokens (Sec. 2.2, App. A.2)
# --------------------------------------------------------------------------------------------------


def aggregation_token_names(num_query_components: int, num_doc_components: int) -> tuple[list[str], list[str]]:
    """Default names of the special aggregation tokens Q_1..Q_Pq and X_1..X_Px."""
    return (
        [f"[MOL_Q{i + 1}]" for i in range(num_query_components)],
        [f"[MOL_X{i + 1}]" for i in range(num_doc_components)],
    )


def install_aggregation_tokens(tokenizer: Any, tokens: Sequence[str]) -> int:
    """Make ``tokenizer`` place ``tokens`` (already in its vocabulary) right after its leading special tokens.

    Rewrites the fast tokenizer's post-processor so every single-text input becomes
    ``prefix tokens text suffix`` (for BERT: ``[CLS] Q_1..Q_Pq X_1..X_Px text [SEP]``); truncation keeps room
    for them. Idempotent. Returns the position of the first aggregation token (1 for BERT).

    Raises:
        ValueError: a slow tokenizer, a token the tokenizer does not know, or a result that does not check out.
    """
    from tokenizers import processors

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            "MoL aggregation tokens need a fast (tokenizers-backed) tokenizer; use component_source='heads' otherwise"
        )
    tokens = list(tokens)
    ids = tokenizer.convert_tokens_to_ids(tokens)
    unknown = [
        t for t, i in zip(tokens, ids) if i is None or (i == tokenizer.unk_token_id and t != tokenizer.unk_token)
    ]
    if unknown:
        raise ValueError(
            f"the tokenizer lacks the MoL aggregation tokens {unknown}: the saved tokenizer does not belong to this "
            "MixtureOfLogits module (build the model with st_extensions.build_mol_model)"
        )
    probe = "mixture of logits"
    content = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    start = next((i for i in range(len(full) - len(content) + 1) if full[i : i + len(content)] == content), None)
    if start is None:
        raise ValueError("cannot locate the text among the tokenizer's special tokens to insert the MoL tokens")
    agg = set(ids)
    prefix = [i for i in full[:start] if i not in agg]
    suffix = full[start + len(content) :]
    prefix_tokens = tokenizer.convert_ids_to_tokens(prefix)
    suffix_tokens = tokenizer.convert_ids_to_tokens(suffix)
    special = {t: i for t, i in zip(prefix_tokens + suffix_tokens + tokens, prefix + suffix + ids)}
    backend.post_processor = processors.TemplateProcessing(
        single=[*prefix_tokens, *tokens, "$A", *suffix_tokens],
        pair=[*prefix_tokens, *tokens, "$A", *suffix_tokens, "$B:1", *(f"{t}:1" for t in suffix_tokens)],
        special_tokens=list(special.items()),
    )
    if tokenizer(probe)["input_ids"] != prefix + ids + content + suffix:
        raise ValueError("the tokenizer did not accept the MoL aggregation-token template")
    return len(prefix)


# --------------------------------------------------------------------------------------------------
# Gating (App. A.3)
# --------------------------------------------------------------------------------------------------


class MoLGate(nn.Module):
    """pi(q, x) = softmax(W_2 SiLU(W_d dots + W_q u(q) + W_x v(x) + b_1) + b_2) (App. A.3).

    A two-layer SiLU MLP over the concatenation [dots; u(q); v(x)] of the P component inner products and,
    optionally, query- and document-side features; the first layer is split by input so that the
    feature parts are computed once per query and once per document, not once per pair. The output
    layer starts at zero: every pair starts with the uniform gate 1 / P.
    """

    def __init__(self, num_logits: int, hidden_dim: int, feature_dim: int | None = None) -> None:
        super().__init__()
        self.dots = nn.Linear(num_logits, hidden_dim)
        self.query = nn.Linear(feature_dim, hidden_dim, bias=False) if feature_dim else None
        self.document = nn.Linear(feature_dim, hidden_dim, bias=False) if feature_dim else None
        self.out = nn.Linear(hidden_dim, num_logits)
        with torch.no_grad():
            self.out.weight.zero_()
            self.out.bias.zero_()

    def forward(self, dots: Tensor, q_hidden: Tensor | None = None, x_hidden: Tensor | None = None) -> Tensor:
        """Gating weights ``(..., P)`` from ``dots (..., P)`` and feature parts broadcastable to ``(..., hidden)``."""
        h = self.dots(dots)
        if q_hidden is not None:
            h = h + q_hidden
        if x_hidden is not None:
            h = h + x_hidden
        return torch.softmax(self.out(F.silu(h)), dim=-1)


# --------------------------------------------------------------------------------------------------
# The module
# --------------------------------------------------------------------------------------------------


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


class MixtureOfLogits(SafetensorsModule):
    """Mixture-of-Logits head: P_q query and P_x document component embeddings and the gate pi (Eq. 1-2).

    Component embeddings (Sec. 2.2, App. A.2), L2-normalised (Eq. 2), shape ``(batch, P, d_P)``:

    - ``component_source="tokens"``: the tokenizer places P_q + P_x special aggregation tokens
      ``Q_1..Q_Pq X_1..X_Px`` after its leading special tokens of *every* input (``[CLS] Q.. X.. text [SEP]``;
      one shared encoder, so the tokenization does not depend on the task). Component p of a side is a
      *parameterised pooling* of the encoder's token outputs h_t: for each p, a distribution over positions
      ``w_p = softmax_t(A h_0 + a)[p]`` computed from the first position's output h_0 (a linear map
      ``(D,) -> (max_positions, P)``, masked to the real tokens), then ``f_p = W sum_t w_{p,t} h_t`` with a
      per-side projection W ``D -> d_P`` (identity when d_P = D). A starts at zero and a at
      ``pooling_init_logit`` on the position of the side's p-th aggregation token, so each component
      starts as (mostly) the output of its own aggregation token.
    - ``component_source="heads"``: linear heads on the pooled ``sentence_embedding``,
      ``f_p = W_p e + b_p`` (orthogonal init, zero bias); the encoder and tokenizer are left as they are.

    Gate (App. A.3): :class:`MoLGate`, a two-layer SiLU MLP over the P = P_q * P_x inner products and, with
    ``gate_features=True``, the query's and document's ``sentence_embedding`` (the model's pooled
    embedding) as side features; softmax over P.

    On the query path (``task="query"``: ``model.encode_query``, or ``model(features, task="query")``) the
    module writes ``features["mol_components"]`` (B, P_q, d_P), on the document path (B, P_x, d_P); with no
    task it does nothing. ``sentence_embedding`` is left as the base model computes it.

    Args:
        num_query_components: P_q.
        num_doc_components: P_x.
        component_dim: d_P.
        embedding_dim: dimension of the pooled ``sentence_embedding`` (heads input, gate features).
        component_source: ``"tokens"`` or ``"heads"``.
        token_dim: hidden size of the encoder's token outputs (``"tokens"`` only).
        max_positions: longest input the position pooling covers (``"tokens"`` only).
        token_offset: position of the first aggregation token (``"tokens"`` only; 1 after ``[CLS]``).
        query_tokens, doc_tokens: the aggregation token strings (``"tokens"`` only).
        pooling_init_logit: initial position logit of each component's own aggregation token.
        gate_hidden_dim: hidden width of the gating MLP (default ``max(16, 2 P)``).
        gate_features: feed the pooled query and document embeddings to the gate (App. A.3).
        head_init: ``"heads"`` only: ``"orthogonal"`` (each head an independent orthogonal map) or ``"identity"``
            (each head the identity plus Gaussian noise of std ``head_init_std``; needs d_P = embedding_dim): every
            component then starts as the pooled embedding, so at initialisation phi(q, x) is the base model's
            cosine (a MoL that starts where the dot-product model starts; the noise breaks the heads' symmetry).
        head_init_std: that noise.
    """

    config_keys: list[str] = [
        "num_query_components",
        "num_doc_components",
        "component_dim",
        "embedding_dim",
        "component_source",
        "token_dim",
        "max_positions",
        "token_offset",
        "query_tokens",
        "doc_tokens",
        "pooling_init_logit",
        "gate_hidden_dim",
        "gate_features",
        "head_init",
        "head_init_std",
    ]
    config_file_name = "config.json"
    #: learning rate of this module's parameters under :func:`pyterrier_prob.training.fine_tune` (the encoder keeps
    #: the trainer's); chosen on nfcorpus train/dev by ``benchmarks/recipe_search.py`` (README, training recipes)
    learning_rate: float = 3e-4
    forward_kwargs = {"task"}

    def __init__(
        self,
        num_query_components: int,
        num_doc_components: int,
        component_dim: int,
        embedding_dim: int,
        component_source: ComponentSource = "tokens",
        token_dim: int | None = None,
        max_positions: int | None = None,
        token_offset: int = 1,
        query_tokens: Sequence[str] | None = None,
        doc_tokens: Sequence[str] | None = None,
        pooling_init_logit: float = 8.0,
        gate_hidden_dim: int | None = None,
        gate_features: bool = False,
        head_init: str = "orthogonal",
        head_init_std: float = 0.01,
    ) -> None:
        super().__init__()
        self.num_query_components = _positive_int("num_query_components", num_query_components)
        self.num_doc_components = _positive_int("num_doc_components", num_doc_components)
        self.component_dim = _positive_int("component_dim", component_dim)
        self.embedding_dim = _positive_int("embedding_dim", embedding_dim)
        if component_source not in COMPONENT_SOURCES:
            raise ValueError(f"component_source must be one of {COMPONENT_SOURCES}, got {component_source!r}")
        self.component_source = component_source
        num_logits = self.num_query_components * self.num_doc_components
        self.gate_hidden_dim = _positive_int(
            "gate_hidden_dim", max(16, 2 * num_logits) if gate_hidden_dim is None else gate_hidden_dim
        )
        self.gate_features = bool(gate_features)
        if head_init not in ("orthogonal", "identity"):
            raise ValueError(f"head_init must be 'orthogonal' or 'identity', got {head_init!r}")
        if not (isinstance(head_init_std, (int, float)) and math.isfinite(head_init_std) and head_init_std >= 0):
            raise ValueError(f"head_init_std must be finite and >= 0, got {head_init_std!r}")
        self.head_init, self.head_init_std = head_init, float(head_init_std)
        if not (isinstance(pooling_init_logit, (int, float)) and math.isfinite(pooling_init_logit)):
            raise ValueError(f"pooling_init_logit must be a finite number, got {pooling_init_logit!r}")
        self.pooling_init_logit = float(pooling_init_logit)

        pq, px, d = self.num_query_components, self.num_doc_components, self.component_dim
        if component_source == "tokens":
            self.token_dim = _positive_int("token_dim", token_dim)
            self.max_positions = _positive_int("max_positions", max_positions)
            if isinstance(token_offset, bool) or not isinstance(token_offset, int) or token_offset < 0:
                raise ValueError(f"token_offset must be an int >= 0, got {token_offset!r}")
            self.token_offset = token_offset
            if token_offset + pq + px > self.max_positions:
                raise ValueError(
                    f"{pq} + {px} aggregation tokens after offset {token_offset} do not fit in "
                    f"max_positions={self.max_positions}"
                )
            default_q, default_x = aggregation_token_names(pq, px)
            self.query_tokens = list(default_q if query_tokens is None else query_tokens)
            self.doc_tokens = list(default_x if doc_tokens is None else doc_tokens)
            if len(self.query_tokens) != pq or len(self.doc_tokens) != px:
                raise ValueError(
                    f"need {pq} query and {px} document aggregation tokens, "
                    f"got {len(self.query_tokens)} and {len(self.doc_tokens)}"
                )
            if len(set(self.query_tokens + self.doc_tokens)) != pq + px:
                raise ValueError("the aggregation tokens must be distinct")
            self.query_pool = nn.Linear(self.token_dim, pq * self.max_positions)
            self.doc_pool = nn.Linear(self.token_dim, px * self.max_positions)
            for pool, start, count in ((self.query_pool, token_offset, pq), (self.doc_pool, token_offset + pq, px)):
                with torch.no_grad():
                    pool.weight.zero_()
                    bias = torch.zeros(count, self.max_positions)
                    bias[torch.arange(count), start + torch.arange(count)] = self.pooling_init_logit
                    pool.bias.copy_(bias.flatten())
            self.query_proj = self._projection(self.token_dim, d)
            self.doc_proj = self._projection(self.token_dim, d)
        else:
            for name, value in (("token_dim", token_dim), ("max_positions", max_positions)):
                if value is not None:
                    raise ValueError(f"{name} is for component_source='tokens' only, got {value!r}")
            if query_tokens or doc_tokens:
                raise ValueError("aggregation tokens are for component_source='tokens' only")
            self.token_dim = self.max_positions = None
            self.token_offset = 0
            self.query_tokens, self.doc_tokens = [], []
            if head_init == "identity" and d != self.embedding_dim:
                raise ValueError(
                    f"head_init='identity' needs component_dim == embedding_dim ({self.embedding_dim}), got {d}"
                )
            self.query_heads = self._heads(self.embedding_dim, pq, d, head_init, self.head_init_std)
            self.doc_heads = self._heads(self.embedding_dim, px, d, head_init, self.head_init_std)
        self.gate_net = MoLGate(num_logits, self.gate_hidden_dim, self.embedding_dim if self.gate_features else None)
        # ids of the aggregation tokens, resolved against the model's tokenizer in on_model_ready
        self.register_buffer("aggregation_token_ids", torch.zeros(0, dtype=torch.long), persistent=False)

    @staticmethod
    def _projection(in_dim: int, out_dim: int) -> nn.Module:
        if in_dim == out_dim:
            return nn.Identity()
        proj = nn.Linear(in_dim, out_dim, bias=False)
        nn.init.orthogonal_(proj.weight)
        return proj

    @staticmethod
    def _heads(in_dim: int, count: int, out_dim: int, init: str = "orthogonal", std: float = 0.01) -> nn.Linear:
        heads = nn.Linear(in_dim, count * out_dim)
        with torch.no_grad():
            for p in range(count):
                block = heads.weight[p * out_dim : (p + 1) * out_dim]
                if init == "identity":
                    block.copy_(torch.eye(out_dim, in_dim) + std * torch.randn(out_dim, in_dim))
                else:
                    nn.init.orthogonal_(block)
            heads.bias.zero_()
        return heads

    # ---------------------------------------------------------------- attributes

    @property
    def num_components(self) -> int:
        """P = P_q * P_x, the number of gated inner products."""
        return self.num_query_components * self.num_doc_components

    def _device_dtype(self) -> tuple[torch.device, torch.dtype]:
        w = self.gate_net.out.weight
        return w.device, w.dtype

    # ---------------------------------------------------------------- model hooks

    def on_model_ready(self, model: Any) -> None:
        """Install the aggregation tokens in the model's tokenizer (``"tokens"``) and resolve their ids.

        Raises:
            ValueError: the tokenizer lacks the tokens, puts them elsewhere, or the encoder's vocabulary is too small.
        """
        if self.component_source != "tokens":
            return
        tokenizer = getattr(model, "tokenizer", None)
        if tokenizer is None:
            raise ValueError("MixtureOfLogits with component_source='tokens' needs a model with a tokenizer")
        offset = install_aggregation_tokens(tokenizer, self.query_tokens + self.doc_tokens)
        if offset != self.token_offset:
            raise ValueError(
                f"the tokenizer places the MoL aggregation tokens at position {offset}, but the module's position "
                f"pooling was built for position {self.token_offset}"
            )
        ids = tokenizer.convert_tokens_to_ids(self.query_tokens + self.doc_tokens)
        embeddings = getattr(getattr(model[0], "auto_model", None), "get_input_embeddings", lambda: None)()
        if embeddings is not None and max(ids) >= embeddings.num_embeddings:
            raise ValueError(
                f"aggregation token id {max(ids)} is outside the encoder's {embeddings.num_embeddings} input embeddings"
            )
        self.aggregation_token_ids = torch.tensor(ids, dtype=torch.long, device=self.aggregation_token_ids.device)

    # ---------------------------------------------------------------- components

    def pooling_weights(self, features: dict[str, Any], task: str) -> Tensor:
        """The parameterised pooling's distributions over positions, ``(B, P, L)`` (``"tokens"`` only)."""
        if self.component_source != "tokens":
            raise ValueError("pooling_weights is for component_source='tokens'")
        return self._pool(features, task)[1]

    def _pool(self, features: dict[str, Any], task: str) -> tuple[Tensor, Tensor]:
        tokens = features.get("token_embeddings")
        mask = features.get("attention_mask")
        if not isinstance(tokens, Tensor) or tokens.ndim != 3 or not isinstance(mask, Tensor) or mask.ndim != 2:
            raise ValueError(
                "MixtureOfLogits (component_source='tokens') needs padded 'token_embeddings' (B, L, D) and "
                "'attention_mask' (B, L) from the encoder"
            )
        b, length, dim = tokens.shape
        if dim != self.token_dim:
            raise ValueError(f"token embeddings have dimension {dim}, the MoL pooling was built for {self.token_dim}")
        if length > self.max_positions:
            raise ValueError(
                f"inputs of {length} tokens exceed the MoL pooling's max_positions={self.max_positions}: "
                f"set model.max_seq_length <= {self.max_positions}"
            )
        ids = features.get("input_ids")
        n_agg = self.num_query_components + self.num_doc_components
        if self.aggregation_token_ids.numel():
            where = slice(self.token_offset, self.token_offset + n_agg)
            if (
                not isinstance(ids, Tensor)
                or ids.shape[:2] != (b, length)
                or length < self.token_offset + n_agg
                or not bool((ids[:, where] == self.aggregation_token_ids.to(ids.device)).all())
            ):
                raise ValueError(
                    "the inputs do not carry the MoL aggregation tokens at positions "
                    f"{self.token_offset}..{self.token_offset + n_agg - 1}: tokenize with the model's own "
                    "(MoL-aware) tokenizer, model.preprocess(...), with right padding"
                )
        if task == "query":
            pool, count = self.query_pool, self.num_query_components
        else:
            pool, count = self.doc_pool, self.num_doc_components
        logits = pool(tokens[:, 0].to(pool.weight.dtype)).view(b, count, self.max_positions)[:, :, :length]
        logits = logits.masked_fill(~mask.bool()[:, None, :], float("-inf"))
        weights = torch.softmax(logits, dim=-1)
        return torch.einsum("bpl,bld->bpd", weights, tokens.to(weights.dtype)), weights

    def components(self, features: dict[str, Any], task: str) -> Tensor:
        """L2-normalised component embeddings (Eq. 2) of a forward's output ``features``.

        Args:
            features: the encoder's output (``token_embeddings``, ``attention_mask``, ``input_ids`` for
                ``"tokens"``; ``sentence_embedding`` for ``"heads"``).
            task: ``"query"`` (f_pq, ``(B, P_q, d_P)``) or ``"document"`` (g_px, ``(B, P_x, d_P)``).
        """
        if task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {task!r}")
        d = self.component_dim
        if self.component_source == "tokens":
            pooled, _ = self._pool(features, task)
            out = (self.query_proj if task == "query" else self.doc_proj)(pooled)
        else:
            emb = features.get(FEATURES_KEY)
            if not isinstance(emb, Tensor) or emb.ndim != 2 or emb.shape[1] != self.embedding_dim:
                shape = tuple(emb.shape) if isinstance(emb, Tensor) else None
                raise ValueError(
                    f"MixtureOfLogits heads need 'sentence_embedding' of shape (B, {self.embedding_dim}), got {shape}"
                )
            heads = self.query_heads if task == "query" else self.doc_heads
            out = heads(emb.to(heads.weight.dtype)).view(len(emb), -1, d)
        return F.normalize(out, dim=-1)

    def forward(self, features: dict[str, Any], task: str | None = None, **kwargs) -> dict[str, Any]:
        task = task or features.get("task")
        if task in TASKS:
            features[COMPONENTS_KEY] = self.components(features, task)
        return features

    # ---------------------------------------------------------------- scoring

    def _check_components(self, name: str, value: Tensor, count: int, ndim: int, check_finite: bool) -> Tensor:
        if not isinstance(value, Tensor):
            value = torch.as_tensor(np.asarray(value))
        if value.ndim != ndim or value.shape[-2] != count or value.shape[-1] != self.component_dim:
            lead = {3: "B" if name.startswith("q") else "N", 4: "B, C"}.get(ndim, "...")
            raise ValueError(
                f"{name} must have shape ({lead}, {count}, {self.component_dim}), got "
                f"{tuple(value.shape)}: this MixtureOfLogits has P_q={self.num_query_components}, "
                f"P_x={self.num_doc_components}, d_P={self.component_dim}"
            )
        if check_finite and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{name} contains NaN or infinite values")
        device, dtype = self._device_dtype()
        return value.to(device=device, dtype=dtype)

    def _check_features(
        self, name: str, value: Tensor | None, lead: tuple[int, ...], check_finite: bool
    ) -> Tensor | None:
        if not self.gate_features:
            return None
        if value is None:
            raise ValueError(
                f"this MoL gate uses query- and document-side features (gate_features=True): pass {name} "
                "(encode_components(..., return_features=True))"
            )
        if not isinstance(value, Tensor):
            value = torch.as_tensor(np.asarray(value))
        if tuple(value.shape) != (*lead, self.embedding_dim):
            raise ValueError(f"{name} must have shape {(*lead, self.embedding_dim)}, got {tuple(value.shape)}")
        if check_finite and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{name} contains NaN or infinite values")
        device, dtype = self._device_dtype()
        return value.to(device=device, dtype=dtype)

    def _feature_hidden(self, q_features: Tensor | None, x_features: Tensor | None) -> tuple[Tensor | None, ...]:
        if not self.gate_features:
            return None, None
        return self.gate_net.query(q_features), self.gate_net.document(x_features)

    def mixture(
        self,
        q_components: Tensor,
        x_components: Tensor,
        q_features: Tensor | None = None,
        x_features: Tensor | None = None,
        check_finite: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """Scores and gates for per-query candidates: ``(phi (B, C), pi (B, C, P))``; see :meth:`score_candidates`."""
        q = self._check_components("q_components", q_components, self.num_query_components, 3, check_finite)
        x = self._check_components("x_components", x_components, self.num_doc_components, 4, check_finite)
        if x.shape[0] != q.shape[0]:
            raise ValueError(f"x_components has {x.shape[0]} queries' candidates, q_components {q.shape[0]} queries")
        qf = self._check_features("q_features", q_features, (q.shape[0],), check_finite)
        xf = self._check_features("x_features", x_features, tuple(x.shape[:2]), check_finite)
        q_hidden, x_hidden = self._feature_hidden(qf, xf)
        dots = component_dots(q, x)
        weights = self.gate_net(dots, None if q_hidden is None else q_hidden[:, None], x_hidden)
        return mixture_scores(weights, dots), weights

    def gate(
        self,
        q_components: Tensor,
        x_components: Tensor,
        q_features: Tensor | None = None,
        x_features: Tensor | None = None,
    ) -> Tensor:
        """The gating weights pi_{pq,px}(q, x) (App. A.3), ``(B, C, P_q * P_x)``, pq-major, rows summing to 1.

        Args:
            q_components: ``(B, P_q, d_P)`` L2-normalised query components (not re-normalised here).
            x_components: ``(B, C, P_x, d_P)`` L2-normalised components of each query's C candidates.
            q_features: ``(B, embedding_dim)`` query features, needed iff ``gate_features``; else ignored.
            x_features: ``(B, C, embedding_dim)`` document features, needed iff ``gate_features``; else ignored.

        Inputs are moved to the module's device and dtype; results live there.

        Raises:
            ValueError: wrong component counts, dimensions, batch sizes, or non-finite values.
        """
        return self.mixture(q_components, x_components, q_features, x_features)[1]

    def score_candidates(
        self,
        q_components: Tensor,
        x_components: Tensor,
        q_features: Tensor | None = None,
        x_features: Tensor | None = None,
    ) -> Tensor:
        """The MoL similarity phi(q, x) = sum_{pq,px} pi_{pq,px}(q, x) <f_pq(q), g_px(x)> (Eq. 1-2), ``(B, C)``.

        Same arguments as :meth:`gate`; pair p = pq * P_x + px (pq-major).
        """
        return self.mixture(q_components, x_components, q_features, x_features)[0]

    @torch.no_grad()
    def score_all(
        self,
        q_components: Tensor,
        x_components: Tensor,
        q_features: Tensor | None = None,
        x_features: Tensor | None = None,
        chunk_size: int = 4096,
    ) -> Tensor:
        """phi(q, x) (Eq. 1) of every query against every document of a shared set, ``(B, N)``.

        Args:
            q_components: ``(B, P_q, d_P)``.
            x_components: ``(N, P_x, d_P)``.
            q_features: ``(B, embedding_dim)``, needed iff ``gate_features``.
            x_features: ``(N, embedding_dim)``, needed iff ``gate_features``.
            chunk_size: documents per chunk (peak memory ~ B * chunk_size * (P + gate_hidden_dim) floats).

        For retrieval: runs without gradients (:meth:`mixture_all` is the differentiable, unchunked form).
        Inputs are moved to the module's device and dtype; results live there.
        """
        q = self._check_components("q_components", q_components, self.num_query_components, 3, True)
        x = self._check_components("x_components", x_components, self.num_doc_components, 3, True)
        chunk_size = _positive_int("chunk_size", chunk_size)
        qf = self._check_features("q_features", q_features, (q.shape[0],), True)
        xf = self._check_features("x_features", x_features, (x.shape[0],), True)
        q_hidden, x_hidden = self._feature_hidden(qf, xf)
        q_hidden = None if q_hidden is None else q_hidden[:, None]
        scores = []
        for start in range(0, x.shape[0], chunk_size):
            dots = component_dots_all(q, x[start : start + chunk_size])
            xh = None if x_hidden is None else x_hidden[None, start : start + chunk_size]
            scores.append(mixture_scores(self.gate_net(dots, q_hidden, xh), dots))
        if not scores:
            return torch.zeros(q.shape[0], 0, device=q.device, dtype=q.dtype)
        return torch.cat(scores, dim=1)

    def mixture_all(
        self,
        q_components: Tensor,
        x_components: Tensor,
        q_features: Tensor | None = None,
        x_features: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Unchunked :meth:`score_all` that also returns the gates: ``(phi (B, N), pi (B, N, P))`` (for training)."""
        q = self._check_components("q_components", q_components, self.num_query_components, 3, False)
        x = self._check_components("x_components", x_components, self.num_doc_components, 3, False)
        qf = self._check_features("q_features", q_features, (q.shape[0],), False)
        xf = self._check_features("x_features", x_features, (x.shape[0],), False)
        q_hidden, x_hidden = self._feature_hidden(qf, xf)
        dots = component_dots_all(q, x)
        weights = self.gate_net(
            dots, None if q_hidden is None else q_hidden[:, None], None if x_hidden is None else x_hidden[None]
        )
        return mixture_scores(weights, dots), weights

    def __repr__(self) -> str:
        return (
            f"MixtureOfLogits(P_q={self.num_query_components}, P_x={self.num_doc_components}, "
            f"d_P={self.component_dim}, source={self.component_source!r}, gate_features={self.gate_features})"
        )
