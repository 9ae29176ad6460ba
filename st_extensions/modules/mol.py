"""The Mixture-of-Logits head (Ding & Zhai, ``../shared/papers/mixture-of-logits.txt``), saved inside the model:
phi(q, x) = sum_{pq, px} pi_{pq,px}(q, x) <f_pq(q), g_px(x)> over L2-normalised components (Eqs. 1-2), the P pairs
flattened pq-major (``p = pq * P_x + px``). How it works: ``docs/mol.md``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import processors
from torch import Tensor, nn

from st_extensions.checks import choice, finite_float, non_negative_int, positive_int
from st_extensions.distributed import GlobalBatch, all_reduce_sum
from st_extensions.modules.safetensors_module import SafetensorsModule

ComponentSource = Literal["tokens", "heads"]
OptTensor = Tensor | None
COMPONENT_SOURCES: tuple[str, ...] = ("tokens", "heads")
TASKS: tuple[str, ...] = ("query", "document")
#: ``features`` key the module writes on the query / document path: (batch, P_q or P_x, d_P), L2-normalised.
COMPONENTS_KEY = "mol_components"
#: ``features`` key read as the gate's query- / document-side features (App. A.3) when ``gate_features``.
FEATURES_KEY = "sentence_embedding"


# ---- Pure functions (Eq. 1-4)
def component_dots(q_components: Tensor, x_components: Tensor) -> Tensor:
    """The P = P_q * P_x inner products <f_pq(q), g_px(x)> of each query ``(B, P_q, d)`` with its own C candidates
    ``(B, C, P_x, d)``: ``(B, C, P_q * P_x)``, pq-major (pair ``p = pq * P_x + px``)."""
    return torch.einsum("bqd,bcxd->bcqx", q_components, x_components).flatten(2)


def component_dots_all(q_components: Tensor, x_components: Tensor) -> Tensor:
    """The component inner products of every query ``(B, P_q, d)`` with every document ``(N, P_x, d)`` of a shared
    set: ``(B, N, P_q * P_x)``, pq-major."""
    return torch.einsum("bqd,nxd->bnqx", q_components, x_components).flatten(2)


def mixture_scores(weights: Tensor, dots: Tensor) -> Tensor:
    """phi = sum_p pi_p <f_p, g_p> (Eq. 1) for gating weights and inner products of shape ``(..., P)``."""
    return (weights * dots).sum(-1)


def entropy(probs: Tensor, dim: int = -1, eps: float = 1e-12) -> Tensor:
    """Shannon entropy -sum p log p along ``dim`` (natural log); p is clamped to ``eps`` inside the log so
    that a zero probability contributes 0 with finite gradients."""
    return -(probs * torch.log(probs.clamp_min(eps))).sum(dim)


def mutual_information_loss(weights: Tensor, eps: float = 1e-12, batch: GlobalBatch | None = None) -> Tensor:
    """The load-balancing loss L_MI = -H(p) + H(p | (q, x)) = -I(p; (q, x)) <= 0 of Eq. 3 over the gates
    ``weights (..., P)`` (each leading index one equally likely pair): H(p) is the entropy of the batch-average gate
    (balanced load), H(p | (q, x)) the mean per-pair entropy (sparse gates). With a gathering loss's ``batch``
    (:class:`~st_extensions.distributed.GlobalBatch`) the average gate is all-reduced over the ranks (H(p) is not
    linear in the pairs) and the value is this rank's share: the mean over the ranks is the single-process L_MI."""
    flat = weights.reshape(-1, weights.shape[-1])
    if batch is None or not batch.gathers:
        return -entropy(flat.mean(0), eps=eps) + entropy(flat, eps=eps).mean()
    count = all_reduce_sum(torch.tensor(float(flat.shape[0]), device=flat.device, dtype=torch.float32))
    marginal = (all_reduce_sum(flat.sum(0).float()) / count).to(flat.dtype)
    return -entropy(marginal, eps=eps) + batch.mean(entropy(flat, eps=eps))


# ---- Aggregation tokens (Sec. 2.2, App. A.2)
def aggregation_token_names(num_query_components: int, num_doc_components: int) -> tuple[list[str], list[str]]:
    """Default names of the special aggregation tokens Q_1..Q_Pq and X_1..X_Px."""
    return (
        [f"[MOL_Q{i + 1}]" for i in range(num_query_components)],
        [f"[MOL_X{i + 1}]" for i in range(num_doc_components)],
    )


def install_aggregation_tokens(tokenizer: Any, tokens: Sequence[str]) -> int:
    """Rewrite the fast tokenizer's post-processor to place ``tokens`` (already in its vocabulary) after its leading
    special tokens (BERT: ``[CLS] Q_1..Q_Pq X_1..X_Px text [SEP]``); idempotent. Returns the first token's position
    (1 for BERT); ValueError for a slow tokenizer, unknown tokens or a template that does not check out."""
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
    prefix_tokens, suffix_tokens = tokenizer.convert_ids_to_tokens(prefix), tokenizer.convert_ids_to_tokens(suffix)
    special = {t: i for t, i in zip(prefix_tokens + suffix_tokens + tokens, prefix + suffix + ids)}
    backend.post_processor = processors.TemplateProcessing(
        single=[*prefix_tokens, *tokens, "$A", *suffix_tokens],
        pair=[*prefix_tokens, *tokens, "$A", *suffix_tokens, "$B:1", *(f"{t}:1" for t in suffix_tokens)],
        special_tokens=list(special.items()),
    )
    if tokenizer(probe)["input_ids"] != prefix + ids + content + suffix:
        raise ValueError("the tokenizer did not accept the MoL aggregation-token template")
    return len(prefix)


# ---- Gating (App. A.3)
class MoLGate(nn.Module):
    """pi(q, x) = softmax(W_2 SiLU(W_d dots + W_q u(q) + W_x v(x) + b_1) + b_2) (App. A.3), uniform at the start (zero
    output layer); the feature parts are computed once per query and once per document, not once per pair."""

    def __init__(self, num_logits: int, hidden_dim: int, feature_dim: int | None = None) -> None:
        super().__init__()
        self.dots = nn.Linear(num_logits, hidden_dim)
        self.query = nn.Linear(feature_dim, hidden_dim, bias=False) if feature_dim else None
        self.document = nn.Linear(feature_dim, hidden_dim, bias=False) if feature_dim else None
        self.out = nn.Linear(hidden_dim, num_logits)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, dots: Tensor, q_hidden: Tensor | None = None, x_hidden: Tensor | None = None) -> Tensor:
        """Gating weights ``(..., P)`` from ``dots (..., P)`` and feature parts broadcastable to ``(..., hidden)``."""
        h = self.dots(dots)
        for part in (q_hidden, x_hidden):
            h = h if part is None else h + part
        return torch.softmax(self.out(F.silu(h)), dim=-1)


@dataclass
class MoLConfig:
    """The settings of a :class:`MixtureOfLogits`, checked; saved flat in the module's ``config.json``. ``"tokens"``
    only: ``token_dim`` (encoder hidden size), ``max_positions``, ``token_offset`` (first aggregation token's
    position), ``query_tokens`` / ``doc_tokens``, ``pooling_init_logit``, ``token_layer`` (trainable aggregation-token
    offsets added to the states entering that encoder layer; None: none). ``"heads"`` only: ``head_init="identity"``
    (d_P = embedding_dim) starts each head at the identity plus noise of std ``head_init_std`` (``docs/mol.md``)."""

    num_query_components: int
    num_doc_components: int
    component_dim: int
    embedding_dim: int
    component_source: ComponentSource = "tokens"
    token_dim: int | None = None
    max_positions: int | None = None
    token_offset: int = 1
    query_tokens: Sequence[str] | None = None
    doc_tokens: Sequence[str] | None = None
    pooling_init_logit: float = 8.0
    gate_hidden_dim: int | None = None
    gate_features: bool = False
    head_init: str = "orthogonal"
    head_init_std: float = 0.01
    token_layer: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_query_components", "num_doc_components", "component_dim", "embedding_dim"):
            setattr(self, name, positive_int(name, getattr(self, name)))
        choice("component_source", self.component_source, COMPONENT_SOURCES)
        pq, px = self.num_query_components, self.num_doc_components
        hidden = max(16, 2 * pq * px) if self.gate_hidden_dim is None else self.gate_hidden_dim
        self.gate_hidden_dim = positive_int("gate_hidden_dim", hidden)
        self.gate_features = bool(self.gate_features)
        choice("head_init", self.head_init, ("orthogonal", "identity"))
        self.head_init_std = finite_float("head_init_std", self.head_init_std, low=0.0)
        self.pooling_init_logit = finite_float("pooling_init_logit", self.pooling_init_logit)
        if self.component_source == "heads":
            for name in ("token_dim", "max_positions", "query_tokens", "doc_tokens", "token_layer"):
                if getattr(self, name) not in (None, [], ()):
                    raise ValueError(f"{name} is for component_source='tokens' only, got {getattr(self, name)!r}")
            if self.head_init == "identity" and self.component_dim != self.embedding_dim:
                raise ValueError(
                    f"head_init='identity' needs component_dim == embedding_dim ({self.embedding_dim}), "
                    f"got {self.component_dim}"
                )
            self.token_offset, self.query_tokens, self.doc_tokens = 0, [], []
            return
        self.token_dim = positive_int("token_dim", self.token_dim)
        self.max_positions = positive_int("max_positions", self.max_positions)
        self.token_offset = non_negative_int("token_offset", self.token_offset)
        self.token_layer = non_negative_int("token_layer", self.token_layer, allow_none=True)
        if self.token_offset + pq + px > self.max_positions:
            raise ValueError(
                f"{pq} + {px} aggregation tokens after offset {self.token_offset} do not fit in "
                f"max_positions={self.max_positions}"
            )
        default_q, default_x = aggregation_token_names(pq, px)
        self.query_tokens = list(default_q if self.query_tokens is None else self.query_tokens)
        self.doc_tokens = list(default_x if self.doc_tokens is None else self.doc_tokens)
        if len(self.query_tokens) != pq or len(self.doc_tokens) != px:
            raise ValueError(
                f"need {pq} query and {px} document aggregation tokens, "
                f"got {len(self.query_tokens)} and {len(self.doc_tokens)}"
            )
        if len(set(self.query_tokens + self.doc_tokens)) != pq + px:
            raise ValueError("the aggregation tokens must be distinct")


class MixtureOfLogits(SafetensorsModule):
    """Mixture-of-Logits head: P_q query and P_x document component embeddings and the gate pi (Eq. 1-2). Components
    (Sec. 2.2, App. A.2) come from aggregation tokens (``component_source="tokens"``) or linear heads on the pooled
    embedding (``"heads"``); the gate is :class:`MoLGate` (App. A.3). With ``task`` the module writes
    ``features["mol_components"]`` ((B, P_q, d_P) or (B, P_x, d_P)). Arguments: :class:`MoLConfig`'s fields."""

    config_keys: list[str] = [f.name for f in fields(MoLConfig)]
    forward_kwargs = {"task"}

    def __init__(self, *args: Any, **settings: Any) -> None:
        super().__init__()
        for key, value in asdict(MoLConfig(*args, **settings)).items():
            setattr(self, key, value)
        pq, px, d = self.num_query_components, self.num_doc_components, self.component_dim
        if self.component_source == "tokens":
            self.query_pool = self._pooling(pq, self.token_offset)
            self.doc_pool = self._pooling(px, self.token_offset + pq)
            self.query_proj = self._projection(self.token_dim, d)
            self.doc_proj = self._projection(self.token_dim, d)
            if self.token_layer is not None:  # trainable token inputs, zero at the start (the base model's states)
                self.token_shift = nn.Parameter(torch.zeros(pq + px, self.token_dim))
        else:
            self.query_heads = self._heads(self.embedding_dim, pq, d, self.head_init, self.head_init_std)
            self.doc_heads = self._heads(self.embedding_dim, px, d, self.head_init, self.head_init_std)
        self.gate_net = MoLGate(pq * px, self.gate_hidden_dim, self.embedding_dim if self.gate_features else None)
        # ids of the aggregation tokens, resolved against the model's tokenizer in on_model_ready
        self.register_buffer("aggregation_token_ids", torch.zeros(0, dtype=torch.long), persistent=False)

    def _pooling(self, count: int, start: int) -> nn.Linear:
        """A side's position pooling: zero weights, logit ``pooling_init_logit`` on component p's own token."""
        pool = nn.Linear(self.token_dim, count * self.max_positions)
        with torch.no_grad():
            pool.weight.zero_()
            bias = torch.zeros(count, self.max_positions)
            bias[torch.arange(count), start + torch.arange(count)] = self.pooling_init_logit
            pool.bias.copy_(bias.flatten())
        return pool

    @staticmethod
    def _projection(in_dim: int, out_dim: int) -> nn.Module:
        if in_dim == out_dim:
            return nn.Identity()
        proj = nn.Linear(in_dim, out_dim, bias=False)
        nn.init.orthogonal_(proj.weight)
        return proj

    @staticmethod
    def _heads(in_dim: int, count: int, out_dim: int, init: str, std: float) -> nn.Linear:
        heads = nn.Linear(in_dim, count * out_dim)
        with torch.no_grad():
            for block in heads.weight.view(count, out_dim, in_dim):
                if init == "identity":
                    block.copy_(torch.eye(out_dim, in_dim) + std * torch.randn(out_dim, in_dim))
                else:
                    nn.init.orthogonal_(block)
            heads.bias.zero_()
        return heads

    def on_model_ready(self, model: Any) -> None:
        """Install the aggregation tokens in the model's tokenizer (``"tokens"``) and resolve their ids."""
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
        if self.token_layer is not None:
            self._install_token_shift(model[0])

    def _install_token_shift(self, transformer: Any) -> None:
        """Hook :meth:`_shift_tokens` once before layer ``token_layer`` of the (stand-in's) BERT backbone."""
        backbone = getattr(transformer, "auto_model", None) or getattr(transformer.transformer, "auto_model", None)
        layers = getattr(getattr(backbone, "encoder", None), "layer", None)
        if layers is None or self.token_layer >= len(layers):
            raise ValueError(
                f"token_layer={self.token_layer} needs a BERT-like encoder (encoder.layer) with more layers, got "
                f"{type(backbone).__name__} with {None if layers is None else len(layers)}"
            )
        layer = layers[self.token_layer]
        if not any(getattr(h, "__self__", None) is self for h in layer._forward_pre_hooks.values()):
            layer.register_forward_pre_hook(self._shift_tokens, with_kwargs=True)

    def _shift_tokens(self, layer: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Add ``token_shift`` to the aggregation tokens' states entering the hooked layer: a trainable input above the
        layers a partial recipe caches (an input embedding would change every cached state through attention)."""
        hidden = args[0] if args else kwargs["hidden_states"]
        start, stop = self.token_offset, self.token_offset + len(self.token_shift)
        if hidden.shape[1] < stop:
            return None
        shifted = hidden[:, start:stop] + self.token_shift.to(hidden.device, hidden.dtype)
        hidden = torch.cat([hidden[:, :start], shifted, hidden[:, stop:]], dim=1)
        return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

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
        ids, agg = features.get("input_ids"), self.aggregation_token_ids
        start, stop = self.token_offset, self.token_offset + len(agg)
        if len(agg) and not (
            isinstance(ids, Tensor)
            and ids.shape[:2] == (b, length)
            and length >= stop
            and bool((ids[:, start:stop] == agg.to(ids.device)).all())
        ):
            raise ValueError(
                f"the inputs do not carry the MoL aggregation tokens at positions {start}..{stop - 1}: tokenize with "
                "the model's own (MoL-aware) tokenizer, model.preprocess(...), with right padding"
            )
        pool = self.query_pool if task == "query" else self.doc_pool
        logits = pool(tokens[:, 0].to(pool.weight.dtype)).view(b, -1, self.max_positions)[:, :, :length]
        logits = logits.masked_fill(~mask.bool()[:, None, :], float("-inf"))
        weights = torch.softmax(logits, dim=-1)
        return torch.einsum("bpl,bld->bpd", weights, tokens.to(weights.dtype)), weights

    def components(self, features: dict[str, Any], task: str) -> Tensor:
        """L2-normalised components (Eq. 2) of the encoder's output ``features``: f_pq ``(B, P_q, d_P)`` for
        ``task="query"``, g_px ``(B, P_x, d_P)`` for ``"document"``."""
        choice("task", task, TASKS)
        if self.component_source == "tokens":
            out = (self.query_proj if task == "query" else self.doc_proj)(self._pool(features, task)[0])
        else:
            emb = self._checked_embeddings(features.get(FEATURES_KEY), self.embedding_dim, "'sentence_embedding'")
            heads = self.query_heads if task == "query" else self.doc_heads
            out = heads(emb).view(len(emb), -1, self.component_dim)
        return F.normalize(out, dim=-1)

    def forward(self, features: dict[str, Any], task: str | None = None, **kwargs) -> dict[str, Any]:
        task = task or features.get("task")
        if task in TASKS:
            features[COMPONENTS_KEY] = self.components(features, task)
        return features

    def _input(self, name: str, value: Any, shape: tuple[int | str, ...], check_finite: bool) -> Tensor:
        """``value`` as a tensor on the module's device and dtype, of ``shape`` (a str: any size, named so)."""
        if not isinstance(value, Tensor):
            value = torch.as_tensor(np.asarray(value))
        if value.ndim != len(shape) or any(isinstance(s, int) and v != s for v, s in zip(value.shape, shape)):
            sizes = f"P_q={self.num_query_components}, P_x={self.num_doc_components}, d_P={self.component_dim}"
            about = f": this MixtureOfLogits has {sizes}" if name.endswith("components") else ""
            raise ValueError(f"{name} must have shape ({', '.join(map(str, shape))}), got {tuple(value.shape)}{about}")
        if check_finite and not bool(torch.isfinite(value).all()):
            raise ValueError(f"{name} contains NaN or infinite values")
        w = self.gate_net.out.weight
        return value.to(device=w.device, dtype=w.dtype)

    def _inputs(self, shared: bool, check_finite: bool, *inputs: Any) -> tuple[Tensor | None, ...]:
        """Checked ``(q, x, q_hidden, x_hidden)``; x: each query's candidates, or (``shared``) documents for all."""
        q_components, x_components, q_features, x_features = inputs
        pq, px, d = self.num_query_components, self.num_doc_components, self.component_dim
        q = self._input("q_components", q_components, ("B", pq, d), check_finite)
        x = self._input("x_components", x_components, ("N", px, d) if shared else ("B", "C", px, d), check_finite)
        if not shared and x.shape[0] != q.shape[0]:
            raise ValueError(f"x_components has {x.shape[0]} queries' candidates, q_components {q.shape[0]} queries")
        if not self.gate_features:
            return q, x, None, None
        if missing := [name for name, v in (("q_features", q_features), ("x_features", x_features)) if v is None]:
            raise ValueError(
                f"this MoL gate uses query- and document-side features (gate_features=True): pass {missing[0]} "
                "(encode_components(..., return_features=True))"
            )
        qf = self._input("q_features", q_features, (q.shape[0], self.embedding_dim), check_finite)
        xf = self._input("x_features", x_features, (*x.shape[: 1 if shared else 2], self.embedding_dim), check_finite)
        x_hidden = self.gate_net.document(xf)
        return q, x, self.gate_net.query(qf)[:, None], x_hidden[None] if shared else x_hidden

    def _mix(self, dots: Tensor, q_hidden: Tensor | None, x_hidden: Tensor | None) -> tuple[Tensor, Tensor]:
        weights = self.gate_net(dots, q_hidden, x_hidden)
        return mixture_scores(weights, dots), weights

    def mixture(
        self,
        q_components: Tensor,
        x_components: Tensor,
        q_features: OptTensor = None,
        x_features: OptTensor = None,
        check_finite: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """Scores and gates for per-query candidates: ``(phi (B, C), pi (B, C, P))``; arguments as :meth:`gate`."""
        q, x, qh, xh = self._inputs(False, check_finite, q_components, x_components, q_features, x_features)
        return self._mix(component_dots(q, x), qh, xh)

    def gate(
        self, q_components: Tensor, x_components: Tensor, q_features: OptTensor = None, x_features: OptTensor = None
    ) -> Tensor:
        """The gates pi_{pq,px}(q, x) (App. A.3), ``(B, C, P_q * P_x)``, pq-major, rows summing to 1, of unit-norm
        ``q_components (B, P_q, d_P)`` and each query's C candidates ``x_components (B, C, P_x, d_P)``; features
        ``(B, embedding_dim)``, ``(B, C, embedding_dim)`` iff ``gate_features``. Inputs move to the module's device
        and dtype; wrong shapes or non-finite values raise ValueError."""
        return self.mixture(q_components, x_components, q_features, x_features)[1]

    def score_candidates(
        self, q_components: Tensor, x_components: Tensor, q_features: OptTensor = None, x_features: OptTensor = None
    ) -> Tensor:
        """phi(q, x) = sum_{pq,px} pi_{pq,px}(q, x) <f_pq(q), g_px(x)> (Eq. 1-2), ``(B, C)``; arguments as
        :meth:`gate` (pair p = pq * P_x + px, pq-major)."""
        return self.mixture(q_components, x_components, q_features, x_features)[0]

    @torch.no_grad()
    def score_all(
        self,
        q_components: Tensor,
        x_components: Tensor,
        q_features: OptTensor = None,
        x_features: OptTensor = None,
        chunk_size: int = 4096,
    ) -> Tensor:
        """phi(q, x) (Eq. 1) of every query ``(B, P_q, d_P)`` against every document ``(N, P_x, d_P)``, ``(B, N)``
        (features ``(B, F)``, ``(N, F)`` iff ``gate_features``): no gradients, ``chunk_size`` documents at a time;
        :meth:`mixture_all` is the differentiable, unchunked form."""
        chunk_size = positive_int("chunk_size", chunk_size)
        q, x, qh, xh = self._inputs(True, True, q_components, x_components, q_features, x_features)
        scores = []
        for a in range(0, x.shape[0], chunk_size):
            x_hidden = None if xh is None else xh[:, a : a + chunk_size]
            scores.append(self._mix(component_dots_all(q, x[a : a + chunk_size]), qh, x_hidden)[0])
        return torch.cat(scores, dim=1) if scores else torch.zeros(q.shape[0], 0, device=q.device, dtype=q.dtype)

    def mixture_all(
        self, q_components: Tensor, x_components: Tensor, q_features: OptTensor = None, x_features: OptTensor = None
    ) -> tuple[Tensor, Tensor]:
        """Unchunked :meth:`score_all` that also returns the gates: ``(phi (B, N), pi (B, N, P))`` (for training)."""
        q, x, qh, xh = self._inputs(True, False, q_components, x_components, q_features, x_features)
        return self._mix(component_dots_all(q, x), qh, xh)

    def __repr__(self) -> str:
        return (
            f"MixtureOfLogits(P_q={self.num_query_components}, P_x={self.num_doc_components}, "
            f"d_P={self.component_dim}, source={self.component_source!r}, gate_features={self.gate_features})"
        )
