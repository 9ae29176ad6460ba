"""Mixture-of-Logits models: build a SentenceTransformer with a MoL head, encode component embeddings.

Ding & Zhai, *Retrieval with Learned Similarities* (WWW'25, ``../shared/papers/mixture-of-logits.txt``):
queries and documents are mapped to P_q and P_x L2-normalised component embeddings (Sec. 2.2, App. A.2),
scored by the gated sum of their P = P_q * P_x inner products (Eq. 1-2) with a learned gate (App. A.3).
The maths and the gate live in :class:`~st_extensions.modules.MixtureOfLogits`; training in
:class:`~st_extensions.losses.MoLLoss`.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Literal, overload

import numpy as np
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.util import batch_to_device
from tqdm.autonotebook import trange

from st_extensions.defaults import default_model_path
from st_extensions.modules.mol import (
    COMPONENT_SOURCES,
    COMPONENTS_KEY,
    FEATURES_KEY,
    TASKS,
    ComponentSource,
    MixtureOfLogits,
    aggregation_token_names,
    install_aggregation_tokens,
)

Task = Literal["query", "document"]


def find_mol(model: torch.nn.Module) -> MixtureOfLogits:
    """The model's :class:`MixtureOfLogits`; a clear error when it has none (or several)."""
    heads = [m for m in model.modules() if isinstance(m, MixtureOfLogits)]
    if not heads:
        raise ValueError(
            f"{type(model).__name__} has no MixtureOfLogits: MoL scoring and MoLLoss need a model built with "
            "st_extensions.build_mol_model(...) (or loaded with st_extensions.load_model)"
        )
    if len(heads) > 1:
        raise ValueError(f"model has {len(heads)} MixtureOfLogits modules, expected exactly one")
    return heads[0]


def _add_aggregation_tokens(transformer: torch.nn.Module, tokens: list[str], seed: int) -> int:
    """Add ``tokens`` to the (copied) encoder's tokenizer and input embeddings; returns their position.

    The new embedding rows are drawn (seeded) from a normal with the vocabulary embeddings' per-dimension
    mean and standard deviation, like transformers' mean-resizing with a diagonal covariance. (Copies of the
    ``[CLS]`` embedding, even noisy ones, make BERT-like encoders output near-identical vectors at all the
    aggregation positions, so the P components would start as one.)
    """
    from tokenizers import AddedToken

    tokenizer = getattr(transformer, "tokenizer", None)
    auto_model = getattr(transformer, "auto_model", None)
    if tokenizer is None or auto_model is None or getattr(tokenizer, "backend_tokenizer", None) is None:
        raise ValueError(
            "component_source='tokens' needs a Transformer input module with a fast tokenizer; "
            "use component_source='heads' for other encoders"
        )
    clash = [t for t in tokens if t in tokenizer.get_vocab()]
    if clash:
        raise ValueError(f"the tokenizer already has tokens {clash}: the base model already has MoL tokens")
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in tokens], special_tokens=True)
    offset = install_aggregation_tokens(tokenizer, tokens)
    old_size = auto_model.get_input_embeddings().weight.shape[0]
    auto_model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    weight = auto_model.get_input_embeddings().weight
    ids = tokenizer.convert_tokens_to_ids(tokens)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        vocab = weight[:old_size].float().cpu()
        sample = vocab.mean(0) + torch.randn(len(ids), weight.shape[1], generator=generator) * vocab.std(0)
        weight[ids] = sample.to(dtype=weight.dtype, device=weight.device)
    return offset


def build_mol_model(
    base_model: str | SentenceTransformer | None = None,
    num_query_components: int = 4,
    num_doc_components: int = 4,
    component_dim: int | None = None,
    component_source: ComponentSource = "tokens",
    gate_hidden_dim: int | None = None,
    gate_features: bool = False,
    head_init: str = "orthogonal",
    pooling_init_logit: float = 8.0,
    max_positions: int | None = None,
    seed: int = 0,
    device: str | None = None,
) -> SentenceTransformer:
    """A SentenceTransformer ending in a :class:`MixtureOfLogits` head (Sec. 2, 2.2; App. A.2, A.3).

    Args:
        base_model: a model name or path (default: the packaged all-MiniLM-L6-v2) or a SentenceTransformer
            whose modules are deep-copied (the new model shares no weights, and no tokenizer, with it).
        num_query_components: P_q.
        num_doc_components: P_x.
        component_dim: d_P (default: the encoder's hidden size for ``"tokens"``, the embedding dimension for
            ``"heads"``).
        component_source: ``"tokens"``: P_q + P_x special aggregation tokens are added to the tokenizer,
            placed after ``[CLS]`` in every input, and read by parameterised pooling (App. A.2);
            ``"heads"``: linear heads on the pooled embedding (encoder unchanged).
        gate_hidden_dim: hidden width of the gating MLP (default ``max(16, 2 P)``).
        gate_features: also feed the query's and document's pooled embeddings to the gate (App. A.3); the
            retriever then needs them too (``encode_components(..., return_features=True)``).
        head_init: ``"heads"`` only: ``"orthogonal"`` or ``"identity"`` (every component starts as the pooled
            embedding plus a little noise, so the untrained MoL scores as the base model; needs d_P = embedding
            dimension, the default), see :class:`MixtureOfLogits`.
        pooling_init_logit: initial logit of each component's own aggregation token in the position pooling.
        max_positions: longest input the position pooling covers (default: the model's ``max_seq_length``).
        seed: seeds the initialisation of the new token embeddings and of the head.
        device: where to put the model.

    Returns:
        The model. ``encode_query`` / ``encode_document`` (and :func:`encode_components`) add
        ``"mol_components"``; ``sentence_embedding`` stays the base model's pooled embedding (which, with
        ``"tokens"``, now also sees the aggregation tokens).

    Raises:
        ValueError: non-positive counts or dimensions, an unknown source, or a base model already with MoL.
    """
    if component_source not in COMPONENT_SOURCES:
        raise ValueError(f"component_source must be one of {COMPONENT_SOURCES}, got {component_source!r}")
    for name, value in (("num_query_components", num_query_components), ("num_doc_components", num_doc_components)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if base_model is None:
        base_model = default_model_path()
    if isinstance(base_model, str):
        from st_extensions.loading import load_model

        base_model = load_model(base_model, device=device)
    if any(isinstance(m, MixtureOfLogits) for m in base_model.modules()):
        raise ValueError("base_model already has a MixtureOfLogits head")
    embedding_dim = base_model.get_embedding_dimension()
    if embedding_dim is None:
        raise ValueError("cannot tell the base model's embedding dimension")
    modules = [copy.deepcopy(m) for m in base_model]
    torch.manual_seed(seed)  # the head's orthogonal initialisations
    head_kwargs: dict = {}
    if component_source == "tokens":
        transformer = modules[0]
        token_dim = transformer.get_embedding_dimension()
        positions = max_positions if max_positions is not None else transformer.max_seq_length
        if positions is None:
            raise ValueError("cannot tell the encoder's max_seq_length: pass max_positions")
        if num_query_components + num_doc_components >= positions:
            raise ValueError(
                f"{num_query_components} + {num_doc_components} aggregation tokens do not fit in inputs of "
                f"{positions} tokens"
            )
        query_tokens, doc_tokens = aggregation_token_names(num_query_components, num_doc_components)
        offset = _add_aggregation_tokens(transformer, query_tokens + doc_tokens, seed)
        head_kwargs = dict(
            token_dim=token_dim,
            max_positions=positions,
            token_offset=offset,
            query_tokens=query_tokens,
            doc_tokens=doc_tokens,
            pooling_init_logit=pooling_init_logit,
        )
        default_dim = token_dim
    else:
        default_dim = embedding_dim
    head = MixtureOfLogits(
        num_query_components=num_query_components,
        num_doc_components=num_doc_components,
        component_dim=default_dim if component_dim is None else component_dim,
        embedding_dim=embedding_dim,
        component_source=component_source,
        gate_hidden_dim=gate_hidden_dim,
        gate_features=gate_features,
        **({"head_init": head_init} if component_source == "heads" else {}),
        **head_kwargs,
    )
    return SentenceTransformer(modules=[*modules, head], device=device or str(base_model.device))


@overload
def encode_components(
    model: SentenceTransformer,
    texts: Sequence[str],
    task: Task,
    batch_size: int = ...,
    show_progress_bar: bool | None = ...,
    return_features: Literal[False] = ...,
) -> np.ndarray: ...


@overload
def encode_components(
    model: SentenceTransformer,
    texts: Sequence[str],
    task: Task,
    batch_size: int = ...,
    show_progress_bar: bool | None = ...,
    *,
    return_features: Literal[True],
) -> tuple[np.ndarray, np.ndarray | None]: ...


def encode_components(
    model: SentenceTransformer,
    texts: Sequence[str],
    task: Task,
    batch_size: int = 32,
    show_progress_bar: bool | None = None,
    return_features: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray | None]:
    """Component embeddings of queries (f_pq) or documents (g_px), L2-normalised (Eq. 2).

    Args:
        model: a model with a :class:`MixtureOfLogits` (see :func:`build_mol_model`).
        texts: query or document texts.
        task: ``"query"`` or ``"document"`` (the model's prompt of that name, if any, is applied as by
            ``encode_query`` / ``encode_document``).
        batch_size: encoding batch size (inputs are length-sorted, as in ``model.encode``).
        show_progress_bar: show a progress bar.
        return_features: also return the gate's side features (App. A.3).

    Returns:
        ``components`` of shape ``(N, P, d_P)`` float32 with unit-norm rows (P = P_q for queries, P_x for
        documents), ordered as ``texts``; with ``return_features=True``, ``(components, features)`` where
        ``features`` is the model's pooled ``sentence_embedding`` ``(N, embedding_dim)`` float32 if the gate uses
        side features (``find_mol(model).gate_features``), else ``None``. Pass them as ``q_features`` /
        ``x_features`` to :meth:`MixtureOfLogits.score_all` and friends.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    mol = find_mol(model)
    texts = list(texts)
    count = mol.num_query_components if task == "query" else mol.num_doc_components
    want_features = return_features and mol.gate_features
    comps: list[torch.Tensor] = []
    feats: list[torch.Tensor] = []
    order = np.argsort([-len(t) for t in texts], kind="stable")
    prompt = (getattr(model, "prompts", None) or {}).get(task) or None
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for start in trange(0, len(texts), batch_size, desc="Batches", disable=not show_progress_bar):
                batch = [texts[i] for i in order[start : start + batch_size]]
                features = batch_to_device(model.preprocess(batch, prompt=prompt, task=task), model.device)
                out = model(features, task=task)
                comps.append(out[COMPONENTS_KEY].float().cpu())
                if want_features:
                    feats.append(out[FEATURES_KEY].float().cpu())
    finally:
        model.train(was_training)
    inverse = np.argsort(order, kind="stable")
    components = torch.cat(comps).numpy()[inverse] if comps else np.zeros((0, count, mol.component_dim), np.float32)
    if not return_features:
        return components
    if not want_features:
        return components, None
    features_np = torch.cat(feats).numpy()[inverse] if feats else np.zeros((0, mol.embedding_dim), np.float32)
    return components, features_np
