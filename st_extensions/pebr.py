"""pEBR models: build a SentenceTransformer with a query-distribution head, read a query's distribution.

Zhang et al., pEBR (``../shared/papers/pebr.md``): the query tower also predicts the law of the cosine
similarity of the query's relevant items (Sec. 3.1-3.2), from which a per-query cutoff is derived
(Appendix A, :mod:`st_extensions.distributions`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch
from sentence_transformers import SentenceTransformer

from st_extensions.defaults import default_model_path
from st_extensions.distributions import BetaCosine, ExpCosine
from st_extensions.modules.adapter import LinearAdapter
from st_extensions.modules.query_distribution import OUTPUT_KEY, Family, QueryDistributionHead


def find_head(model: torch.nn.Module) -> QueryDistributionHead:
    """The model's :class:`QueryDistributionHead`; a clear error when it has none."""
    heads = [m for m in model.modules() if isinstance(m, QueryDistributionHead)]
    if not heads:
        raise ValueError(
            f"{type(model).__name__} has no QueryDistributionHead: the pEBR losses and query_distribution need "
            "a model built with st_extensions.build_pebr_model(...) (or loaded with st_extensions.load_model)"
        )
    if len(heads) > 1:
        raise ValueError(f"model has {len(heads)} QueryDistributionHeads, expected exactly one")
    return heads[0]


def build_pebr_model(
    base_model: str | SentenceTransformer | None = None,
    family: Family = "beta",
    tau_init: float = 0.05,
    device: str | None = None,
    projection: bool = False,
    **head_kwargs,
) -> SentenceTransformer:
    """A SentenceTransformer whose query path ends in a :class:`QueryDistributionHead`.

    Args:
        base_model: a model name or path (e.g. the packaged MiniLM, the default) or a SentenceTransformer
            whose modules are copied (the new model shares no weights with it).
        family: ``"exp"`` (ExpNCE), ``"beta"`` (BetaNCE) or ``"beta_mle"`` (MLE, Sec. 3.1).
        tau_init: every query's temperature at initialisation.
        device: where to put the model.
        projection: put a :class:`~st_extensions.modules.LinearAdapter` (residual, zero-initialised, shared by
            queries and documents) before the head, so that with a frozen encoder the embedding space still
            trains (:func:`st_extensions.frozen.cached_model`).
        **head_kwargs: further :class:`QueryDistributionHead` arguments (bounds, ``scale``).

    Returns:
        The model: documents are embedded as by ``base_model``; ``encode_query`` also yields the
        distribution parameters (``output_value="query_distribution"``).
    """
    if base_model is None:
        base_model = default_model_path()
    if isinstance(base_model, str):
        from st_extensions.loading import load_model

        base_model = load_model(base_model, device=device)
    if any(isinstance(m, QueryDistributionHead) for m in base_model.modules()):
        raise ValueError("base_model already has a QueryDistributionHead")
    dim = base_model.get_embedding_dimension()
    if dim is None:
        raise ValueError("cannot tell the base model's embedding dimension")
    head = QueryDistributionHead(dim, family=family, tau_init=tau_init, **head_kwargs)
    modules = [copy.deepcopy(m) for m in base_model]
    if projection:
        modules.append(LinearAdapter(dim))
    return SentenceTransformer(modules=[*modules, head], device=device or str(base_model.device))


def encode_queries(
    model: SentenceTransformer, queries: Sequence[str], batch_size: int = 32, show_progress_bar: bool | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Embed queries and predict their distribution parameters in one pass.

    Returns:
        ``(embeddings (Q, dim) float32, params (Q, k) float64)``; ``k = 1`` (tau_q) for ``exp``/``beta``,
        ``k = 4`` (alpha+, beta+, alpha-, beta-) for ``beta_mle``.
    """
    find_head(model)
    queries = list(queries)
    if not queries:
        return np.zeros((0, model.get_embedding_dimension()), np.float32), np.zeros((0, find_head(model).num_params))
    outputs = model.encode_query(queries, batch_size=batch_size, output_value=None, show_progress_bar=show_progress_bar)
    embeddings = torch.stack([o["sentence_embedding"] for o in outputs]).float().cpu().numpy()
    params = torch.stack([o[OUTPUT_KEY] for o in outputs]).double().cpu().numpy()
    return embeddings, params


def distribution_from_params(params: np.ndarray, family: Family, dim: int | None = None) -> ExpCosine | BetaCosine:
    """The relevant-item cosine law for predicted parameters ``(Q, k)`` of a head of ``family``.

    ``exp``: :class:`ExpCosine` (tau_q); ``beta``: :class:`BetaCosine` with alpha = 1 / tau_q, beta = 1
    (Eq. 3); ``beta_mle``: :class:`BetaCosine` (alpha+, beta+) of the relevant items (Sec. 3.1).
    """
    params = np.asarray(params, dtype=np.float64)
    if params.ndim != 2:
        raise ValueError(f"params must have shape (queries, k), got {params.shape}")
    if family == "exp":
        return ExpCosine(params[:, 0], dim=dim)
    if family == "beta":
        return BetaCosine.from_temperature(params[:, 0], dim=dim)
    if family == "beta_mle":
        if params.shape[1] != 4:
            raise ValueError(f"beta_mle needs 4 parameters per query, got {params.shape[1]}")
        return BetaCosine(params[:, 0], params[:, 1], dim=dim)
    raise ValueError(f"unknown family {family!r}")


def query_distribution(
    model: SentenceTransformer, queries: Sequence[str], dim: int | None = None, batch_size: int = 32
) -> ExpCosine | BetaCosine:
    """The per-query relevant-item distribution a pEBR model predicts for ``queries``.

    Args:
        model: a model with a :class:`QueryDistributionHead` (see :func:`build_pebr_model`).
        queries: query texts.
        dim: ``None`` for the one-dimensional law of Sec. 3.2, or the embedding dimension for
            Appendix A's sphere-corrected law.
        batch_size: encoding batch size.

    Returns:
        :class:`ExpCosine` (``exp``) or :class:`BetaCosine` (``beta``, ``beta_mle``) with one parameter per
        query; ``.cutoff(p)`` gives each query's cosine threshold.
    """
    _, params = encode_queries(model, queries, batch_size=batch_size)
    return distribution_from_params(params, find_head(model).family, dim=dim)
