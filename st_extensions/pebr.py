"""pEBR models (Zhang et al., ``../shared/papers/pebr.md``): the query tower also predicts the law of the cosine
similarity of the query's relevant items (Sec. 3.1-3.2), from which a per-query cutoff is derived (Appendix A,
:mod:`st_extensions.distributions`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from sentence_transformers import SentenceTransformer

from st_extensions.defaults import base_modules, find_module
from st_extensions.distributions import BetaCosine, ExpCosine
from st_extensions.modules.adapter import LinearAdapter
from st_extensions.modules.query_distribution import OUTPUT_KEY, Family, QueryDistributionHead


def find_head(model: torch.nn.Module) -> QueryDistributionHead:
    """The model's :class:`QueryDistributionHead`; a clear error when it has none (or several)."""
    return find_module(model, QueryDistributionHead, "the pEBR losses and query_distribution need", "build_pebr_model")


def build_pebr_model(
    base_model: str | SentenceTransformer | None = None,
    family: Family = "beta",
    tau_init: float = 0.05,
    device: str | None = None,
    projection: bool = False,
    **head_kwargs,
) -> SentenceTransformer:
    """A SentenceTransformer whose query path ends in a :class:`QueryDistributionHead` of ``family`` (``"exp"``,
    ``"beta"``, ``"beta_mle"``), every temperature starting at ``tau_init``.

    ``base_model``: name, path or model (copied; default the packaged MiniLM). ``projection`` adds a residual,
    zero-initialised :class:`~st_extensions.modules.LinearAdapter` before the head so the space trains with a frozen
    encoder. ``encode_query(..., output_value="query_distribution")`` also yields the parameters."""
    modules, dim, device = base_modules(base_model, device, QueryDistributionHead)
    head = QueryDistributionHead(dim, family=family, tau_init=tau_init, **head_kwargs)
    adapter = [LinearAdapter(dim)] if projection else []
    return SentenceTransformer(modules=[*modules, *adapter, head], device=device)


def encode_queries(
    model: SentenceTransformer, queries: Sequence[str], batch_size: int = 32, show_progress_bar: bool | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(embeddings (Q, dim) float32, params (Q, k) float64)`` of ``queries`` in one pass (k = 1, tau_q; 4 for
    beta_mle)."""
    head = find_head(model)
    queries = list(queries)
    if not queries:
        return np.zeros((0, model.get_embedding_dimension()), np.float32), np.zeros((0, head.num_params))
    outputs = model.encode_query(queries, batch_size=batch_size, output_value=None, show_progress_bar=show_progress_bar)
    embeddings = torch.stack([o["sentence_embedding"] for o in outputs]).float().cpu().numpy()
    params = torch.stack([o[OUTPUT_KEY] for o in outputs]).double().cpu().numpy()
    return embeddings, params


def distribution_from_params(params: np.ndarray, family: Family, dim: int | None = None) -> ExpCosine | BetaCosine:
    """The relevant-item law for params ``(Q, k)`` of ``family``: ExpCosine(tau_q); BetaCosine(1 / tau_q, 1) (Eq. 3);
    ``beta_mle``: BetaCosine(alpha+, beta+) (Sec. 3.1)."""
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
    """The per-query relevant-item law (ExpCosine / BetaCosine, one parameter per query) a pEBR model predicts for
    ``queries``: ``dim=None`` the 1-D law of Sec. 3.2, else Appendix A's; ``.cutoff(p)`` gives each threshold."""
    _, params = encode_queries(model, queries, batch_size=batch_size)
    return distribution_from_params(params, find_head(model).family, dim=dim)
