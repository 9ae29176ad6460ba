"""Mixture-of-Logits models (Ding & Zhai, ``../shared/papers/mixture-of-logits.txt``): build a SentenceTransformer
with a MoL head, encode the component embeddings (Sec. 2.2, Eq. 2). The maths and the gate live in
:class:`~st_extensions.modules.MixtureOfLogits`, training in :class:`~st_extensions.losses.MoLLoss`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import numpy as np
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.util import batch_to_device
from tokenizers import AddedToken
from tqdm.autonotebook import trange

from st_extensions.checks import choice, positive_int
from st_extensions.defaults import base_modules, find_module
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
    return find_module(model, MixtureOfLogits, "MoL scoring and MoLLoss need", "build_mol_model")


@contextmanager
def inference(module: Any) -> Iterator[None]:
    """``torch.inference_mode`` with ``module`` (a model or MoL-like object) in eval mode, its mode restored after."""
    training = getattr(module, "training", None)
    if training and callable(getattr(module, "eval", None)):
        module.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        if training and callable(getattr(module, "train", None)):
            module.train(True)


def _add_aggregation_tokens(transformer: torch.nn.Module, tokens: list[str], seed: int) -> int:
    """Add ``tokens`` to the (copied) encoder's tokenizer and input embeddings, drawn (seeded) from the vocabulary's
    per-dimension mean and std (``docs/mol.md``); returns their position."""
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


def _token_settings(transformer: torch.nn.Module, pq: int, px: int, max_positions: int | None, seed: int) -> dict:
    """The ``MoLConfig`` fields of ``component_source="tokens"``, once the tokens are added to the encoder."""
    positions = max_positions if max_positions is not None else transformer.max_seq_length
    if positions is None:
        raise ValueError("cannot tell the encoder's max_seq_length: pass max_positions")
    if pq + px >= positions:
        raise ValueError(f"{pq} + {px} aggregation tokens do not fit in inputs of {positions} tokens")
    query_tokens, doc_tokens = aggregation_token_names(pq, px)
    offset = _add_aggregation_tokens(transformer, query_tokens + doc_tokens, seed)
    tokens = dict(query_tokens=query_tokens, doc_tokens=doc_tokens)
    return dict(token_dim=transformer.get_embedding_dimension(), max_positions=positions, token_offset=offset, **tokens)


def build_mol_model(
    base_model: str | SentenceTransformer | None = None,
    num_query_components: int = 4,
    num_doc_components: int = 4,
    component_dim: int | None = None,
    component_source: ComponentSource = "tokens",
    *,
    seed: int = 0,
    device: str | None = None,
    **settings: Any,
) -> SentenceTransformer:
    """A SentenceTransformer ending in a :class:`MixtureOfLogits` head (Sec. 2.2; App. A.2, A.3).

    ``base_model``: a name or path (default: the packaged all-MiniLM-L6-v2) or a SentenceTransformer, deep-copied (no
    shared weights or tokenizer). ``component_dim`` d_P defaults to the encoder's hidden size (``"tokens"``: P_q + P_x
    aggregation tokens added after ``[CLS]`` and pooled, App. A.2) or the embedding dimension (``"heads"``: linear heads
    on the pooled embedding). ``seed`` seeds the new token embeddings and the head. ``**settings``: further
    :class:`~st_extensions.modules.mol.MoLConfig` fields (``gate_hidden_dim``, ``gate_features``, ``head_init``,
    ``pooling_init_logit``, ``max_positions``). ``encode_query`` / ``encode_document`` add ``"mol_components"``."""
    choice("component_source", component_source, COMPONENT_SOURCES)
    pq = positive_int("num_query_components", num_query_components)
    px = positive_int("num_doc_components", num_doc_components)
    modules, embedding_dim, device = base_modules(base_model, device, MixtureOfLogits)
    torch.manual_seed(seed)  # the head's orthogonal initialisations
    if component_source == "tokens":
        settings.update(_token_settings(modules[0], pq, px, settings.pop("max_positions", None), seed))
    component_dim = settings.get("token_dim", embedding_dim) if component_dim is None else component_dim
    head = MixtureOfLogits(pq, px, component_dim, embedding_dim, component_source, **settings)
    return SentenceTransformer(modules=[*modules, head], device=device)


def encode_components(
    model: SentenceTransformer,
    texts: Sequence[str],
    task: Task,
    batch_size: int = 32,
    show_progress_bar: bool | None = None,
    return_features: bool = False,
) -> np.ndarray | tuple[np.ndarray, np.ndarray | None]:
    """``(N, P, d_P)`` float32 unit-norm components (Eq. 2) of queries (f_pq, ``task="query"``) or documents (g_px,
    ``"document"``; the model's prompt of that name applied), ordered as ``texts``. With ``return_features``:
    ``(components, features)``, the gate's side features (pooled ``sentence_embedding``, App. A.3) or ``None``
    when the gate reads none."""
    choice("task", task, TASKS)
    batch_size = positive_int("batch_size", batch_size)
    mol = find_mol(model)
    texts = list(texts)
    count = mol.num_query_components if task == "query" else mol.num_doc_components
    want_features = return_features and mol.gate_features
    comps, feats = [], []
    order = np.argsort([-len(t) for t in texts], kind="stable")
    prompt = (getattr(model, "prompts", None) or {}).get(task) or None
    with inference(model):
        for start in trange(0, len(texts), batch_size, desc="Batches", disable=not show_progress_bar):
            batch = [texts[i] for i in order[start : start + batch_size]]
            out = model(batch_to_device(model.preprocess(batch, prompt=prompt, task=task), model.device), task=task)
            comps.append(out[COMPONENTS_KEY].float().cpu())
            if want_features:
                feats.append(out[FEATURES_KEY].float().cpu())
    inverse = np.argsort(order, kind="stable")
    components = torch.cat(comps).numpy()[inverse] if comps else np.zeros((0, count, mol.component_dim), np.float32)
    if not return_features:
        return components
    features = torch.cat(feats).numpy()[inverse] if feats else np.zeros((0, mol.embedding_dim), np.float32)
    return components, features if want_features else None
