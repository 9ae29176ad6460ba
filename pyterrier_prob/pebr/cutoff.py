"""pEBR's variable-depth retrieval (Sec. 4.1.2, Appendix A): :class:`~pyterrier_prob.dense.DenseRetriever` s with
per-query ``t_q = F_q^{-1}(1 - p)`` (:class:`CDFCutoffRetriever`) or one cosine for all queries
(:class:`ScoreCutoffRetriever`); DSSM-topk is :class:`~pyterrier_prob.dense.TopKRetriever`. See ``docs/pebr.md``.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pandas as pd

from pyterrier_prob.dense import PARAM_COLUMNS, DenseRetriever
from pyterrier_prob.validation import (
    EmptyRetrievalWarning,
    choice,
    finite_float,
    float_column,
    positive_int,
    user_stacklevel,
)
from st_extensions.distributions import BetaCosine, ExpCosine

EMPTY_WARN_MIN_QUERIES = 5
"""A CDF cutoff warns when more than half of the queries of a first-stage call, and at least this many, get nothing."""

__all__ = ["CDFCutoffRetriever", "ScoreCutoffRetriever"]


class CDFCutoffRetriever(DenseRetriever):
    """pEBR's probabilistic cutoff (Sec. 4.1.2 "pEBR", Appendix A): keep ``cos(q, d) >= t_q = F_q^{-1}(1 - p)``.

    F_q: the query's relevant-item cosine law from the frame (``query_temp`` for ``"beta"``, Eq. 3, and ``"exp"``,
    Sec. 3.2.1; ``query_alpha``, ``query_beta`` for ``"beta_mle"``, Sec. 3.1); a share ``p`` of it lies above t_q,
    so larger p, deeper lists, capped at ``num_results``. ``dim``: ``None`` for the 1-D law, the embedding dimension
    for the sphere-corrected law (Eq. 4); ``options`` as for :class:`~pyterrier_prob.dense.DenseRetriever`. Choose p
    on dev queries (``calibrate_mean_k``, ``RecallTargetCutoff``); an ``EmptyRetrievalWarning`` says when most
    queries of a call retrieve nothing::

        pipeline = encoder.query_encoder() >> CDFCutoffRetriever(index, p=0.5, family=encoder.family)
    """

    def __init__(
        self,
        index: Any,
        p: float = 0.5,
        family: str = "beta",
        dim: int | None = None,
        num_results: int | None = 1000,
        **options: Any,
    ) -> None:
        super().__init__(index, num_results, **options)
        self.p = finite_float("p", p, low=0.0, high=1.0, low_open=True, high_open=True)
        self.family = choice("family", family, tuple(PARAM_COLUMNS))
        self.dim = positive_int("dim", dim, allow_none=True, minimum=2)
        if self.index.index_path.exists():
            self._check_dim()

    def _check_dim(self) -> None:
        """The sphere-corrected law's ``dim`` is the index's vector dimension."""
        if self.dim is not None and self.dim != self.index.dim:
            raise ValueError(
                f"dim={self.dim} (the sphere-corrected law's embedding dimension, Appendix A) differs from the "
                f"{self.index.dim}-dim vectors of {self.index!r}: pass dim={self.index.dim} (or None for the 1-D law)"
            )

    def _columns(self) -> list[str]:
        return ["query_vec", *PARAM_COLUMNS[self.family][:2]]  # beta_mle: the law of the relevant items

    def _hint(self) -> str:
        return (
            f"the {self.family!r} cutoff reads each query's distribution parameters from the frame; encode the "
            f"queries with ProbBiEncoder(model).query_encoder() where model has a {self.family!r} "
            "QueryDistributionHead (st_extensions.build_pebr_model(..., family=...))"
        )

    def _params(self) -> str:
        return f"p={self.p}, family={self.family!r}, dim={self.dim}, "

    def distribution(self, queries: pd.DataFrame) -> ExpCosine | BetaCosine:
        """The per-query relevant-item laws of the rows of ``queries``."""
        self._check_dim()
        cols = self._columns()[1:]
        values = [float_column(queries, c, type(self).__name__) for c in cols]
        try:
            if self.family == "exp":
                return ExpCosine(values[0], dim=self.dim)
            if self.family == "beta":
                return BetaCosine.from_temperature(values[0], dim=self.dim)
            return BetaCosine(values[0], values[1], dim=self.dim)
        except ValueError as e:
            raise ValueError(f"bad distribution parameters in columns {cols}: {e}") from e

    def _thresholds(self, queries: pd.DataFrame) -> np.ndarray:
        return np.asarray(self.distribution(queries).cutoff(self.p), dtype=np.float64).reshape(-1)

    def _check_counts(self, counts: np.ndarray) -> None:
        """Warn when more than half of a call's queries (at least :data:`EMPTY_WARN_MIN_QUERIES`) retrieve nothing."""
        n = len(counts)
        empty = int(np.count_nonzero(np.asarray(counts) == 0))
        if n >= EMPTY_WARN_MIN_QUERIES and 2 * empty > n:
            warnings.warn(
                f"CDFCutoffRetriever: {empty} of {n} queries retrieved no document at level p={self.p:g} (the "
                f"{self.family!r} law puts their thresholds t_q above every document's cosine). An "
                "uncalibrated p rarely fits a model: pick it on dev queries with "
                "pyterrier_prob.evaluation.calibrate_mean_k (the level at which the mean depth is k) or cut a deeper "
                "ranking with RecallTargetCutoff (pyterrier_prob.pebr.rlt; the level that meets a recall target)",
                EmptyRetrievalWarning,
                stacklevel=user_stacklevel(),
            )


class ScoreCutoffRetriever(DenseRetriever):
    """DSSM-score (Sec. 4.1.2): Appendix A's ``S_{t,K}`` with one finite cosine ``threshold`` for all queries,
    capped at ``num_results``; ``options`` as for :class:`CDFCutoffRetriever`."""

    def __init__(self, index: Any, threshold: float, num_results: int | None = 1000, **options: Any) -> None:
        super().__init__(index, num_results, **options)
        self.threshold = finite_float("threshold", threshold)

    def _params(self) -> str:
        return f"threshold={self.threshold}, "

    def _thresholds(self, queries: pd.DataFrame) -> np.ndarray:
        return np.full(len(queries), self.threshold)
