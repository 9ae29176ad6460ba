"""Calibrated per-query cosine laws for pEBR, their PIT diagnostics, and a likelihood-ratio cutoff (issue #13).

pEBR (``shared/papers/pebr.md``) reads each query's cutoff ``t_q = F_q^{-1}(1 - p)`` off the law F_q its head
predicts for the cosines of the query's relevant items (Sec. 3.2, Sec. 4.1.2, Appendix A). That law is what the
loss *trains*, not a fitted description of where relevant cosines lie: on nfcorpus 97% of relevant pairs fall below
the law's 1% quantile, so p has no probabilistic meaning. This module

* fits, on calibration (dev) qrels and by maximum likelihood, a map from the head's per-query parameters (plus any
  per-query features) to a Beta law of the relevant cosines (:class:`CalibratedLaw`; Sec. 3.2.2's Beta law on
  [-1, 1], with Appendix A's sphere geometry as an option), so that ``CalibratedLaw.law(params).cutoff(p)`` is a
  threshold whose p is calibrated;
* measures calibration with the probability integral transform: for a law that describes the relevant cosines,
  ``F_q(cos(q, d+))`` is uniform on [0, 1] (:func:`pit_values`, :func:`pit_summary`; the plot is
  :func:`pyterrier_prob.plots.pit_plot`);
* for ``beta_mle`` heads, which predict the law of the relevant *and* of the other items (Sec. 3.1), gives the
  Bayes / Neyman-Pearson cutoff where the likelihood ratio of the two laws crosses a level
  (:func:`likelihood_ratio_cutoff`).

Inputs: ``params`` are the head's outputs per query, as :func:`st_extensions.encode_queries` returns them
(array ``(Q, k)``: ``k = 1`` tau_q for ``exp``/``beta``; ``k = 4`` alpha+, beta+, alpha-, beta- for ``beta_mle``)
or a frame with the family's :data:`~pyterrier_prob.pebr.PARAM_COLUMNS` (as
:class:`~pyterrier_prob.pebr.ProbBiEncoder` writes them). ``relevant_cosines_per_query`` is a sequence with, per
query (in the order of ``params``), the cosines between the query and its judged-relevant documents.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike, NDArray
from scipy import optimize, special, stats

from pyterrier_prob.pebr.encoders import PARAM_COLUMNS
from st_extensions.distributions import BetaCosine, ExpCosine
from st_extensions.pebr import distribution_from_params

__all__ = [
    "CalibratedLaw",
    "beta_mle_laws",
    "likelihood_ratio_cutoff",
    "log_likelihood_ratio",
    "mean_log_density",
    "model_law",
    "pit_summary",
    "pit_values",
    "query_weights",
    "take_queries",
]

Family = Literal["exp", "beta", "beta_mle"]
Weighting = Literal["query", "pair"]
FloatLike = float | NDArray[np.float64]

#: Relevant cosines may exceed [-1, 1] by this much (float32 rounding of unit-vector dot products); they are
#: clipped to [-1, 1]. Anything further out is an error.
COSINE_TOLERANCE = 1e-4
#: In the likelihood, z = (1 + cos) / 2 is clipped to [Z_EPS, 1 - Z_EPS], so a cosine of exactly +-1 (a duplicate
#: document) has a finite log density.
Z_EPS = 1e-12
_ETA_CLIP = 25.0  # log-parameters are clipped to [-25, 25]: Beta parameters in [1.4e-11, 7.2e10]
_PAIR_BLOCK = 1 << 20  # padded (queries x K) cells evaluated at once by pit_values / mean_log_density
_SERIAL = "pyterrier_prob.pebr.CalibratedLaw"
_SERIAL_VERSION = 1


# --------------------------------------------------------------------------------------------------------
# input checking
# --------------------------------------------------------------------------------------------------------


def _check_family(family: Any) -> str:
    if family not in PARAM_COLUMNS:
        raise ValueError(f"family must be one of {tuple(PARAM_COLUMNS)}, got {family!r}")
    return str(family)


def _check_dim(dim: Any) -> int | None:
    if dim is None:
        return None
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 2:
        raise ValueError(f"dim must be None (1-D law, Sec. 3.2) or the embedding dimension (an int >= 2), got {dim!r}")
    return int(dim)


def _param_matrix(params: Any, family: str) -> NDArray[np.float64]:
    """The head's parameters as a float array (Q, k), checked finite and > 0."""
    cols = PARAM_COLUMNS[family]
    if isinstance(params, pd.DataFrame):
        missing = [c for c in cols if c not in params.columns]
        if missing:
            raise ValueError(f"params frame lacks the {family!r} parameter column(s) {missing}; it has {list(params)}")
        arr = params[list(cols)].to_numpy(dtype=np.float64)
    else:
        try:
            arr = np.array(params, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"params must be a numeric array (queries, k) or a frame with {cols}") from exc
        if arr.ndim == 1 and len(cols) == 1:
            arr = arr[:, None]
        if arr.ndim != 2 or arr.shape[1] != len(cols):
            raise ValueError(
                f"params of a {family!r} head must have shape (queries, {len(cols)}) ({', '.join(cols)}), "
                f"got {arr.shape}"
            )
    bad = ~(np.isfinite(arr) & (arr > 0))
    if bad.any():
        r, c = (int(v[0]) for v in np.nonzero(bad))
        raise ValueError(
            f"params must be finite and > 0: {int(bad.sum())} bad value(s), first {arr[r, c]!r} (query {r}, {cols[c]})"
        )
    return arr


def _feature_matrix(features: Any, n: int) -> tuple[NDArray[np.float64], list[str]]:
    """Extra per-query features as (n, k) with names; ``None`` -> (n, 0)."""
    if features is None:
        return np.zeros((n, 0)), []
    if isinstance(features, pd.Series):
        features = features.to_frame()
    if isinstance(features, pd.DataFrame):
        names = [str(c) for c in features.columns]
        try:
            arr = features.to_numpy(dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"features must be numeric, got columns with dtypes {dict(features.dtypes)}") from exc
    elif isinstance(features, Mapping):
        names = [str(k) for k in features]
        cols = [np.asarray(v, dtype=np.float64).reshape(-1) for v in features.values()]
        if len({c.size for c in cols}) > 1:
            raise ValueError(f"features: columns of different lengths {[c.size for c in cols]}")
        arr = np.stack(cols, axis=1) if cols else np.zeros((n, 0))
    else:
        try:
            arr = np.array(features, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError("features must be None, a numeric array (queries, k), a frame or a mapping") from exc
        if arr.ndim == 1:
            arr = arr[:, None]
        if arr.ndim != 2:
            raise ValueError(f"features must have shape (queries, k), got {arr.shape}")
        names = [f"x{j}" for j in range(arr.shape[1])]
    if arr.shape[0] != n:
        raise ValueError(f"mismatched lengths: features have {arr.shape[0]} rows but params have {n} queries")
    if not np.all(np.isfinite(arr)):
        r, c = (int(v[0]) for v in np.nonzero(~np.isfinite(arr)))
        raise ValueError(f"features must be finite: {arr[r, c]!r} at query {r}, feature {names[c]!r}")
    return arr, names


def _relevant_lists(
    relevant: Any, n: int | None = None, against: str = "params have {n} queries"
) -> list[NDArray[np.float64]]:
    """Per-query relevant cosines as 1-D float arrays, each non-empty, finite and in [-1, 1] (up to the tolerance)."""
    if isinstance(relevant, (str, bytes, Mapping)) or not isinstance(relevant, (Sequence, np.ndarray, pd.Series)):
        raise ValueError(
            "relevant_cosines_per_query must be a sequence (list, Series, object array) with one array of cosines "
            f"per query, in the order of params; got {type(relevant).__name__}"
        )
    items = list(relevant.to_numpy() if isinstance(relevant, pd.Series) else relevant)
    if n is not None and len(items) != n:
        raise ValueError(
            f"mismatched lengths: relevant_cosines_per_query has {len(items)} queries but " + against.format(n=n)
        )
    out = []
    for i, v in enumerate(items):
        try:
            arr = np.asarray(v, dtype=np.float64).reshape(-1)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"relevant cosines of query {i} are not numbers: {v!r}") from exc
        if arr.size == 0:
            raise ValueError(
                f"query {i} has no relevant cosines: every calibration query needs at least one judged-relevant "
                "document (drop queries without relevant documents first)"
            )
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"relevant cosines of query {i} must be finite, got {arr[~np.isfinite(arr)][0]!r}")
        if np.any(np.abs(arr) > 1.0 + COSINE_TOLERANCE):
            raise ValueError(
                f"relevant cosines of query {i} must lie in [-1, 1], got {arr[np.abs(arr) > 1 + COSINE_TOLERANCE][0]!r}"
            )
        out.append(np.clip(arr, -1.0, 1.0))
    return out


# --------------------------------------------------------------------------------------------------------
# the model's own (uncalibrated) law
# --------------------------------------------------------------------------------------------------------


def model_law(params: Any, family: Family, dim: int | None = None) -> ExpCosine | BetaCosine:
    """The relevant-item law the head itself predicts (the *uncalibrated*, "before" law).

    ``exp``: truncated exponential (Sec. 3.2.1); ``beta``: Beta with alpha = 1 / tau_q, beta = 1 (Eq. 3);
    ``beta_mle``: Beta(alpha+, beta+) (Sec. 3.1); 1-D (``dim=None``) or sphere-corrected (``dim=n``, Eq. 4).
    """
    family = _check_family(family)
    return distribution_from_params(_param_matrix(params, family), family, dim=_check_dim(dim))


def beta_mle_laws(params: Any, dim: int | None = None) -> tuple[BetaCosine, BetaCosine]:
    """(relevant, irrelevant) laws of a ``beta_mle`` head (Sec. 3.1): Beta(alpha+, beta+) and Beta(alpha-, beta-)."""
    p = _param_matrix(params, "beta_mle")
    dim = _check_dim(dim)
    return BetaCosine(p[:, 0], p[:, 1], dim=dim), BetaCosine(p[:, 2], p[:, 3], dim=dim)


# --------------------------------------------------------------------------------------------------------
# the calibrated law
# --------------------------------------------------------------------------------------------------------


def _suff_stats(lists: list[NDArray[np.float64]]) -> tuple[NDArray, NDArray, NDArray]:
    """Per query: n_q, sum log z, sum log(1 - z), with z = (1 + cos) / 2 clipped to [Z_EPS, 1 - Z_EPS]."""
    n = np.array([c.size for c in lists], dtype=np.float64)
    z = np.clip((1.0 + np.concatenate(lists)) / 2.0, Z_EPS, 1.0 - Z_EPS)
    starts = np.concatenate([[0], np.cumsum(n[:-1])]).astype(np.intp)
    return n, np.add.reduceat(np.log(z), starts), np.add.reduceat(np.log1p(-z), starts)


class CalibratedLaw:
    """Per-query Beta law of the relevant cosines, fitted by maximum likelihood on calibration queries.

    Model (the Beta law of Sec. 3.2.2 on [-1, 1], with parameters that are log-linear in the head's outputs): for
    query q with relevant cosines x, z = (1 + x) / 2 ~ Beta(a_q, b_q) independently, where

        log(a_q - m+) = w_a . phi_q,   log(b_q - m+) = w_b . phi_q,
        phi_q = [1, log theta_q, features_q],

    theta_q being the head's parameters -- tau_q for ``exp`` and ``beta`` heads; alpha+_q, beta+_q for
    ``beta_mle`` (and alpha-_q, beta-_q too with ``include_negative=True``) -- and ``features_q`` optional extra
    per-query features, used as given (e.g. log query length, the top-1 cosine). The law family is Beta for all
    three heads: for an ``exp`` head Beta(a, 1) with large a is close to its truncated exponential law, and b
    frees the left tail. The head's law is nested: a ``beta`` head's own law is w_a = (0, -1), w_b = (0, 0).

    Geometry (``dim``):

    * ``dim=None`` (line, Sec. 3.2): m+ = 0 and the fitted Beta(a_q, b_q) *is* the law of the observed cosine;
      :meth:`law` returns ``BetaCosine(a_q, b_q)``. The recommended choice: a calibrated law is fitted to observed
      cosines directly, so the sphere factor of Appendix A, which converts a density h on the sphere into the law
      of the cosine, is not needed; the geometry only matters for the *uncalibrated* law (:func:`model_law`).
    * ``dim=n`` (sphere, Appendix A): the fitted object is the density h(x) ~ Beta(alpha_q, beta_q) of a
      q-isotropic law on the sphere of R^n, and the cosine's law carries the surface factor (1 - x^2)^m,
      m = (n - 3) / 2 (Eq. 4), i.e. z ~ Beta(alpha_q + m, beta_q + m) (:attr:`BetaCosine.z_params`). This costs
      nothing extra (the factor folds into the exponents) and :meth:`law` returns ``BetaCosine(alpha_q, beta_q,
      dim=n)``, which is exact. With m+ = max(m, 0) the parameterisation is alpha_q = exp(w_a . phi_q) + m+ - m
      (so for n = 2, where m = -1/2, alpha_q > 1/2 as the sphere law needs; n = 2 and n = 3 give the line law).
      Caveat: the family then forces a_q, b_q >= m, a cosine law with standard deviation at most about
      1 / sqrt(n) (0.05 for n = 384); relevant cosines of a real model usually spread more, so the sphere fit is
      usually worse -- compare :meth:`score` of both.

    Weighting (``weighting``): the fit maximises ``sum_q w_q sum_{d in R_q} log f_q(x_qd)`` with

    * ``"query"`` (default): w_q = 1 / |R_q|, each query's log-likelihood averaged over its relevant documents, so
      every calibration query counts once and broad queries with hundreds of relevant documents do not dominate
      (a weighted M-estimator: still consistent if the model is right, since the weights depend only on |R_q|);
    * ``"pair"``: w_q = 1, the plain likelihood of all relevant pairs (efficient if the model is right and pairs
      are independent given the query).

    The log-likelihood depends on the data only through n_q, sum log z and sum log(1 - z) per query, so a fit
    costs O(queries) per iteration. It is maximised exactly (``scipy.optimize.minimize``, trust-region Newton with
    the analytic gradient and Hessian in standardised features); :attr:`loglik_` is then recomputed with
    ``scipy.stats.beta.logpdf`` over all pairs. Standard errors are the sandwich (query-clustered) ones,
    ``A^{-1} B A^{-1}`` with A the Hessian and B the sum of squared per-query scores, valid for both weightings
    and for relevant documents correlated within a query. A feature that is constant on the calibration queries
    is not identified: its coefficients are 0 and its standard errors nan (:attr:`constant_features_`).

    Args:
        family: the head's family, ``"exp"``, ``"beta"`` or ``"beta_mle"`` (what ``params`` hold).
        dim: ``None`` (line) or the embedding dimension n (sphere), see above.
        weighting: ``"query"`` or ``"pair"``, see above.
        include_negative: ``beta_mle`` only: also use log alpha-, log beta- as features.

    Example::

        cal = CalibratedLaw("beta").fit(dev_params, dev_relevant_cosines)
        thresholds = cal.law(test_params).cutoff(0.9)       # keeps ~90% of each query's relevant cosines
        pit_summary(pit_values(cal.law(test_params), test_relevant_cosines))
    """

    def __init__(
        self,
        family: Family = "beta",
        dim: int | None = None,
        weighting: Weighting = "query",
        include_negative: bool = False,
    ) -> None:
        self.family = _check_family(family)
        self.dim = _check_dim(dim)
        if weighting not in ("query", "pair"):
            raise ValueError(f"weighting must be 'query' or 'pair', got {weighting!r}")
        self.weighting = weighting
        if include_negative and self.family != "beta_mle":
            raise ValueError("include_negative needs a beta_mle head (only it predicts the irrelevant law)")
        self.include_negative = bool(include_negative)
        self.coef_a_: NDArray[np.float64] | None = None
        self.coef_b_: NDArray[np.float64] | None = None
        self.feature_names_: list[str] = []
        self.covariance_: NDArray[np.float64] | None = None
        self.constant_features_: list[str] = []
        self.n_queries_ = 0
        self.n_pairs_ = 0
        self.loglik_ = math.nan
        self.converged_ = False
        self.n_iter_ = 0
        self.message_ = ""

    # ---- geometry --------------------------------------------------------------------------------------
    @property
    def _m(self) -> float:
        """m = (n - 3) / 2 of the sphere factor (Eq. 4); 0 on the line."""
        return 0.0 if self.dim is None else (self.dim - 3) / 2.0

    @property
    def _offset(self) -> float:
        """m+ = max(m, 0): a_q = exp(eta) + m+ in z."""
        return max(self._m, 0.0)

    # ---- design ----------------------------------------------------------------------------------------
    def _theta_names(self) -> list[str]:
        if self.family in ("exp", "beta"):
            return ["log tau"]
        names = ["log alpha+", "log beta+"]
        return names + (["log alpha-", "log beta-"] if self.include_negative else [])

    def _design(self, params: Any, features: Any) -> tuple[NDArray[np.float64], list[str]]:
        p = _param_matrix(params, self.family)
        theta = np.log(p[:, : len(self._theta_names())])
        extra, names = _feature_matrix(features, p.shape[0])
        design = np.concatenate([np.ones((p.shape[0], 1)), theta, extra], axis=1)
        return design, ["1", *self._theta_names(), *names]

    # ---- fitting ---------------------------------------------------------------------------------------
    def fit(self, params: Any, relevant_cosines_per_query: Any, features: Any = None) -> CalibratedLaw:
        """Fit the coefficients by maximum likelihood on calibration queries.

        Args:
            params: the head's parameters per query, ``(Q, k)`` or a frame with the family's parameter columns.
            relevant_cosines_per_query: Q arrays, the cosines of each query's relevant documents (each non-empty).
            features: optional extra per-query features: ``(Q, j)`` array, frame or ``{name: values}``.

        Returns:
            ``self``, with :attr:`coef_a_`, :attr:`coef_b_`, :attr:`covariance_`, :attr:`loglik_`, ...
        """
        design, names = self._design(params, features)
        if design.shape[0] == 0:
            raise ValueError("no calibration queries: params is empty")
        lists = _relevant_lists(relevant_cosines_per_query, design.shape[0], "params have {n} queries")
        n, s1, s2 = _suff_stats(lists)
        wq = 1.0 / n if self.weighting == "query" else np.ones_like(n)
        total = float(np.sum(wq * n))

        # standardise the non-constant features (better conditioning); constant ones are dropped (coefficient 0)
        mu, sd = design[:, 1:].mean(axis=0), design[:, 1:].std(axis=0)
        const = sd <= 1e-12 * np.maximum(1.0, np.abs(mu))
        keep = np.concatenate([[True], ~const])
        xs = design.copy()
        xs[:, 1:] = (design[:, 1:] - mu) / np.where(const, 1.0, sd)
        xs = xs[:, keep]
        k = xs.shape[1]
        off = self._offset

        def parts(w: NDArray[np.float64]) -> tuple:
            """(da/deta, db/deta, a, b, ll_q, dll/da, dll/db) per query; eta clipped (derivative 0 beyond the clip)."""
            raw_a, raw_b = xs @ w[:k], xs @ w[k:]
            eta_a, eta_b = np.clip(raw_a, -_ETA_CLIP, _ETA_CLIP), np.clip(raw_b, -_ETA_CLIP, _ETA_CLIP)
            a, b = np.exp(eta_a) + off, np.exp(eta_b) + off
            ea = np.where(raw_a == eta_a, np.exp(eta_a), 0.0)
            eb = np.where(raw_b == eta_b, np.exp(eta_b), 0.0)
            ll = (a - 1.0) * s1 + (b - 1.0) * s2 - n * special.betaln(a, b)
            dab = special.digamma(a + b)
            la = s1 - n * (special.digamma(a) - dab)  # d ll / d a
            lb = s2 - n * (special.digamma(b) - dab)
            return ea, eb, a, b, ll, la, lb

        def fun(w: NDArray[np.float64]) -> float:
            return -float(np.sum(wq * parts(w)[4])) / total

        def jac(w: NDArray[np.float64]) -> NDArray[np.float64]:
            ea, eb, _, _, _, la, lb = parts(w)
            return -np.concatenate([xs.T @ (wq * ea * la), xs.T @ (wq * eb * lb)]) / total

        def hess_blocks(w: NDArray[np.float64]) -> tuple[NDArray, NDArray, NDArray]:
            ea, eb, a, b, _, la, lb = parts(w)
            tab = special.polygamma(1, a + b)
            haa = ea * ea * (-n * (special.polygamma(1, a) - tab)) + ea * la
            hbb = eb * eb * (-n * (special.polygamma(1, b) - tab)) + eb * lb
            hab = ea * eb * n * tab
            return haa, hbb, hab

        def hess(w: NDArray[np.float64]) -> NDArray[np.float64]:
            haa, hbb, hab = hess_blocks(w)
            h = np.empty((2 * k, 2 * k))
            h[:k, :k] = xs.T @ (xs * (wq * haa)[:, None])
            h[k:, k:] = xs.T @ (xs * (wq * hbb)[:, None])
            h[:k, k:] = xs.T @ (xs * (wq * hab)[:, None])
            h[k:, :k] = h[:k, k:].T
            return -h / total

        # start: pooled (weighted) method of moments of z, no slopes
        z = (1.0 + np.concatenate(lists)) / 2.0
        wz = np.repeat(wq, n.astype(np.intp))
        zm = float(np.average(z, weights=wz))
        zv = max(float(np.average((z - zm) ** 2, weights=wz)), 1e-8)
        kappa = max(zm * (1.0 - zm) / zv - 1.0, 1e-3)
        w0 = np.zeros(2 * k)
        w0[0] = math.log(max(zm * kappa - off, 0.5))
        w0[k] = math.log(max((1.0 - zm) * kappa - off, 0.5))
        res = optimize.minimize(fun, w0, jac=jac, hess=hess, method="trust-exact", options={"gtol": 1e-9})
        if not res.success:  # rare: polish with quasi-Newton from where the trust region stopped
            res2 = optimize.minimize(fun, res.x, jac=jac, method="BFGS", options={"gtol": 1e-9})
            if res2.fun <= res.fun:
                res2.nit += res.nit
                res = res2
        w = res.x

        # sandwich covariance in standardised coordinates, then back to the raw features
        ea, eb, _, _, _, la, lb = parts(w)
        scores = np.concatenate([xs * (wq * ea * la)[:, None], xs * (wq * eb * lb)[:, None]], axis=1)
        a_mat = hess(w) * total
        a_inv = np.linalg.pinv(a_mat)
        cov_s = a_inv @ (scores.T @ scores) @ a_inv
        p = design.shape[1]
        t_map = np.zeros((p, k))  # raw coefficient = t_map @ standardised coefficient
        kept = np.flatnonzero(keep)
        for j_s, j in enumerate(kept):
            if j == 0:
                t_map[0, j_s] = 1.0
            else:
                t_map[j, j_s] = 1.0 / sd[j - 1]
                t_map[0, j_s] = -mu[j - 1] / sd[j - 1]
        t_full = np.zeros((2 * p, 2 * k))
        t_full[:p, :k], t_full[p:, k:] = t_map, t_map
        coef = t_full @ w
        cov = t_full @ cov_s @ t_full.T
        dropped = np.concatenate([~keep, ~keep])
        cov[dropped, :] = np.nan
        cov[:, dropped] = np.nan

        self.coef_a_, self.coef_b_ = coef[:p], coef[p:]
        self.feature_names_ = names
        self.covariance_ = cov
        self.constant_features_ = [nm for nm, c in zip(names[1:], const) if c]
        self.n_queries_, self.n_pairs_ = len(lists), int(n.sum())
        self.converged_ = bool(res.success) or float(np.max(np.abs(jac(w)))) < 1e-6
        self.n_iter_ = int(res.nit)
        self.message_ = str(res.message)
        self.loglik_ = self.score(params, lists, features)
        return self

    # ---- prediction ------------------------------------------------------------------------------------
    def _check_fitted(self) -> None:
        if self.coef_a_ is None or self.coef_b_ is None:
            raise ValueError("CalibratedLaw is not fitted: call .fit(params, relevant_cosines_per_query) first")

    def law(self, params: Any, features: Any = None) -> BetaCosine:
        """The calibrated relevant-cosine law of each query (one :class:`BetaCosine` with Q parameters).

        ``.cutoff(p)`` is each query's threshold keeping a share p of its relevant documents (in expectation, if
        the calibration holds); ``.cdf`` gives the PIT. With ``dim=n`` the law is the sphere-corrected one.
        """
        self._check_fitted()
        design, names = self._design(params, features)
        if names != self.feature_names_:
            raise ValueError(f"features {names[1:]} differ from those of the fit {self.feature_names_[1:]}")
        ea = np.exp(np.clip(design @ self.coef_a_, -_ETA_CLIP, _ETA_CLIP))
        eb = np.exp(np.clip(design @ self.coef_b_, -_ETA_CLIP, _ETA_CLIP))
        shift = self._offset - self._m  # alpha_q = a_q - m with a_q = exp(eta) + m+
        return BetaCosine(ea + shift, eb + shift, dim=self.dim)

    def score(self, params: Any, relevant_cosines_per_query: Any, features: Any = None) -> float:
        """Weighted mean log density of the relevant cosines under :meth:`law` (the fit's weighting; nats per pair).

        Computed with ``scipy.stats.beta.logpdf`` in z, plus the Jacobian log(1/2) of x -> z, so it is comparable
        with :func:`mean_log_density` of any other law (e.g. the uncalibrated one, or the other geometry).
        """
        law = self.law(params, features)
        lists = _relevant_lists(relevant_cosines_per_query, law.n_queries, "params have {n} queries")
        n = np.array([c.size for c in lists])
        a, b = (np.repeat(np.asarray(v, dtype=np.float64), n) for v in law.z_params)
        z = np.clip((1.0 + np.concatenate(lists)) / 2.0, Z_EPS, 1.0 - Z_EPS)
        logd = stats.beta.logpdf(z, a, b) - math.log(2.0)
        w = np.repeat(1.0 / n if self.weighting == "query" else np.ones(n.size), n)
        return float(np.sum(w * logd) / np.sum(w))

    # ---- reporting and serialisation -------------------------------------------------------------------
    @property
    def stderr_a_(self) -> NDArray[np.float64]:
        """Sandwich standard errors of :attr:`coef_a_` (nan for constant features)."""
        self._check_fitted()
        return np.sqrt(np.diag(self.covariance_)[: len(self.coef_a_)])

    @property
    def stderr_b_(self) -> NDArray[np.float64]:
        """Sandwich standard errors of :attr:`coef_b_`."""
        self._check_fitted()
        return np.sqrt(np.diag(self.covariance_)[len(self.coef_a_) :])

    def coefficients(self) -> pd.DataFrame:
        """The fitted coefficients and their standard errors, one row per feature of phi_q."""
        self._check_fitted()
        return pd.DataFrame(
            {"a": self.coef_a_, "a_stderr": self.stderr_a_, "b": self.coef_b_, "b_stderr": self.stderr_b_},
            index=pd.Index(self.feature_names_, name="feature"),
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (plain lists and numbers; nan as ``None``); see :meth:`from_dict`."""
        self._check_fitted()

        def clean(arr: NDArray[np.float64]) -> list:
            return [None if not math.isfinite(v) else float(v) for v in np.asarray(arr, dtype=np.float64).ravel()]

        return {
            "kind": _SERIAL,
            "version": _SERIAL_VERSION,
            "family": self.family,
            "dim": self.dim,
            "weighting": self.weighting,
            "include_negative": self.include_negative,
            "feature_names": list(self.feature_names_),
            "coef_a": clean(self.coef_a_),
            "coef_b": clean(self.coef_b_),
            "covariance": clean(self.covariance_),
            "constant_features": list(self.constant_features_),
            "n_queries": self.n_queries_,
            "n_pairs": self.n_pairs_,
            "loglik": None if not math.isfinite(self.loglik_) else float(self.loglik_),
            "converged": self.converged_,
            "n_iter": self.n_iter_,
        }

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> CalibratedLaw:
        """Rebuild a fitted :class:`CalibratedLaw` from :meth:`to_dict` output."""
        if not isinstance(state, Mapping) or state.get("kind") != _SERIAL:
            raise ValueError(f"not a serialised CalibratedLaw (expected kind {_SERIAL!r})")
        if state.get("version") != _SERIAL_VERSION:
            raise ValueError(
                f"unsupported CalibratedLaw version {state.get('version')!r} (this code: {_SERIAL_VERSION})"
            )
        obj = cls(state["family"], state["dim"], state["weighting"], state["include_negative"])

        def arr(key: str) -> NDArray[np.float64]:
            return np.array([math.nan if v is None else v for v in state[key]], dtype=np.float64)

        names = list(state["feature_names"])
        obj.coef_a_, obj.coef_b_ = arr("coef_a"), arr("coef_b")
        if not (len(names) == obj.coef_a_.size == obj.coef_b_.size) or not np.all(np.isfinite(obj.coef_a_)):
            raise ValueError("corrupt CalibratedLaw state: coefficients and feature names disagree or are not finite")
        p2 = 2 * len(names)
        obj.covariance_ = arr("covariance").reshape(p2, p2)
        obj.feature_names_ = names
        obj.constant_features_ = list(state.get("constant_features", []))
        obj.n_queries_, obj.n_pairs_ = int(state["n_queries"]), int(state["n_pairs"])
        obj.loglik_ = math.nan if state.get("loglik") is None else float(state["loglik"])
        obj.converged_, obj.n_iter_ = bool(state["converged"]), int(state["n_iter"])
        return obj

    def __repr__(self) -> str:
        fitted = "unfitted" if self.coef_a_ is None else f"fitted on {self.n_queries_} queries"
        return (
            f"CalibratedLaw(family={self.family!r}, dim={self.dim}, weighting={self.weighting!r}, "
            f"include_negative={self.include_negative}; {fitted})"
        )


# --------------------------------------------------------------------------------------------------------
# per-pair evaluation of a per-query law; PIT
# --------------------------------------------------------------------------------------------------------


def take_queries(law: ExpCosine | BetaCosine, idx: NDArray[np.intp]) -> ExpCosine | BetaCosine:
    """The per-query laws of the queries ``idx`` (positions), as a law of the same kind and geometry."""
    if isinstance(law, BetaCosine):
        q = law.n_queries
        return BetaCosine(
            np.broadcast_to(np.asarray(law.alpha), (q,))[idx], np.broadcast_to(np.asarray(law.beta), (q,))[idx], law.dim
        )
    return ExpCosine(np.asarray(law.tau)[idx], law.dim)


def _n_of(law: Any) -> int | None:
    if not isinstance(law, (ExpCosine, BetaCosine)):
        raise ValueError(f"law must be an ExpCosine or BetaCosine (one per query), got {type(law).__name__}")
    return law.n_queries


def _per_pair(law: Any, lists: list[NDArray[np.float64]], method: str) -> NDArray[np.float64]:
    """``law.<method>`` (``"cdf"`` or ``"logpdf"``) of every relevant cosine, with query q's law for query q's list,
    concatenated in query order. Queries are evaluated in blocks of similar list length (padded (rows, K) arrays)."""
    if not isinstance(law, (ExpCosine, BetaCosine)):
        raise ValueError(f"law must be an ExpCosine or BetaCosine (one per query), got {type(law).__name__}")
    flat = np.concatenate(lists)
    if law.n_queries is None:
        return np.asarray(getattr(law, method)(flat), dtype=np.float64)
    if law.n_queries != len(lists):
        raise ValueError(
            f"mismatched lengths: the law has {law.n_queries} per-query parameters but "
            f"relevant_cosines_per_query has {len(lists)} queries"
        )
    counts = np.array([c.size for c in lists])
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    out = np.empty(flat.size)
    order = np.argsort(counts, kind="stable")
    i, budget = 0, _PAIR_BLOCK
    while i < order.size:
        j = i + 1
        while j < order.size and (j + 1 - i) * counts[order[j]] <= budget:
            j += 1
        idx = order[i:j]
        width = int(counts[idx].max())
        pad = np.zeros((idx.size, width))
        for r, q in enumerate(idx):
            pad[r, : counts[q]] = lists[q]
        vals = np.asarray(getattr(take_queries(law, idx), method)(pad), dtype=np.float64).reshape(idx.size, width)
        for r, q in enumerate(idx):
            out[starts[q] : starts[q] + counts[q]] = vals[r, : counts[q]]
        i = j
    return out


def pit_values(law: ExpCosine | BetaCosine, relevant_cosines_per_query: Any) -> NDArray[np.float64]:
    """Probability integral transform F_q(cos(q, d)) of every relevant pair (queries in order, then documents).

    ``law`` has one law per query (any :class:`ExpCosine`/:class:`BetaCosine`, e.g. :func:`model_law` or
    :meth:`CalibratedLaw.law`) or scalar parameters (one law for all). If the law describes the relevant cosines,
    the values are uniform on [0, 1]; values piling up near 0 mean relevant documents lie below where the law puts
    them (then ``cutoff(p)`` keeps far fewer than a share p). Exactly: a PIT value is the share of the law *below*
    the relevant document, so ``cutoff(p)`` keeps the document iff PIT >= 1 - p.
    """
    lists = _relevant_lists(relevant_cosines_per_query, _n_of(law), "the law has {n} per-query laws")
    return _per_pair(law, lists, "cdf")


def mean_log_density(
    law: ExpCosine | BetaCosine, relevant_cosines_per_query: Any, weighting: Weighting = "query"
) -> float:
    """Weighted mean log density (nats per relevant pair) of the relevant cosines under ``law`` (weights as in
    :class:`CalibratedLaw`); compares laws and geometries on held-out queries (higher is better)."""
    if weighting not in ("query", "pair"):
        raise ValueError(f"weighting must be 'query' or 'pair', got {weighting!r}")
    lists = _relevant_lists(relevant_cosines_per_query, _n_of(law), "the law has {n} per-query laws")
    logd = _per_pair(law, lists, "logpdf")
    n = np.array([c.size for c in lists])
    w = np.repeat(1.0 / n if weighting == "query" else np.ones(n.size), n)
    return float(np.sum(w * logd) / np.sum(w))


def query_weights(relevant_cosines_per_query: Any) -> NDArray[np.float64]:
    """Per-pair weights 1 / |R_q| (in :func:`pit_values` order), so that every query counts once: the weighting of
    mean per-query recall (SetR, the conformal recall loss) and of ``CalibratedLaw(weighting="query")``."""
    n = np.array([c.size for c in _relevant_lists(relevant_cosines_per_query)], dtype=np.float64)
    return np.repeat(1.0 / n, n.astype(np.intp))


def pit_summary(pit: ArrayLike, tail: float = 0.01, weights: ArrayLike | None = None) -> dict[str, float]:
    """Calibration summary of PIT values (ideal: uniform on [0, 1]).

    Returns ``n``; ``ks_statistic`` and ``ks_pvalue`` of ``scipy.stats.kstest`` against U(0, 1); ``mean`` (ideal
    0.5); ``below_tail`` / ``above_tail``: the share of values below ``tail`` / above ``1 - tail`` (ideal ``tail``
    each; the issue's "97% below the 1% quantile" is ``below_tail = 0.97``); ``central_50`` / ``central_90``: the
    share inside the central 50% / 90% interval (ideal 0.5 / 0.9).

    With ``weights`` (one per value, e.g. :func:`query_weights`: every query once) every figure is the weighted
    one: the KS statistic is ``sup_u |W(u) - u|`` of the weighted empirical CDF W, and ``ks_pvalue`` is nan (the
    weighted statistic has no standard null law).

    The KS p-value treats the pairs as independent; relevant documents of one query share that query's law, so
    with many documents per query it is optimistic -- read the statistic, and the tail shares, first.
    """
    u = np.asarray(pit, dtype=np.float64).reshape(-1)
    if u.size == 0:
        raise ValueError("pit is empty")
    if not np.all((u >= 0.0) & (u <= 1.0)):
        raise ValueError("PIT values must lie in [0, 1] (and not be nan)")
    if not (isinstance(tail, numbers.Real) and 0.0 < tail < 0.5):
        raise ValueError(f"tail must be a number in (0, 0.5), got {tail!r}")
    if weights is None:
        ks = stats.kstest(u, "uniform")
        d, pvalue, w = float(ks.statistic), float(ks.pvalue), np.full(u.size, 1.0 / u.size)
    else:
        w = np.asarray(weights, dtype=np.float64).reshape(-1)
        if w.shape != u.shape or not np.all(np.isfinite(w) & (w >= 0)) or w.sum() <= 0:
            raise ValueError(f"weights must be {u.size} finite values >= 0 with a positive sum (one per PIT value)")
        w = w / w.sum()
        order = np.argsort(u, kind="stable")
        us, cw = u[order], np.cumsum(w[order])
        last = np.r_[us[1:] != us[:-1], True]  # the weighted ECDF at each distinct value
        us, cw = us[last], cw[last]
        d = float(max(np.max(cw - us), np.max(us - np.r_[0.0, cw[:-1]])))
        pvalue = math.nan
    return {
        "n": int(u.size),
        "ks_statistic": d,
        "ks_pvalue": pvalue,
        "mean": float(np.sum(w * u)),
        "below_tail": float(np.sum(w * (u < tail))),
        "above_tail": float(np.sum(w * (u > 1.0 - tail))),
        "central_50": float(np.sum(w * ((u >= 0.25) & (u <= 0.75)))),
        "central_90": float(np.sum(w * ((u >= 0.05) & (u <= 0.95)))),
        "tail": float(tail),
    }


# --------------------------------------------------------------------------------------------------------
# likelihood-ratio cutoff (beta_mle)
# --------------------------------------------------------------------------------------------------------


def _lr_coefficients(relevant: BetaCosine, irrelevant: BetaCosine) -> tuple[NDArray, NDArray, NDArray]:
    """(A, B, C) with log f+(x) - log f-(x) = A log z + B log(1 - z) + C, z = (1 + x) / 2."""
    if not isinstance(relevant, BetaCosine) or not isinstance(irrelevant, BetaCosine):
        raise ValueError("the likelihood-ratio cutoff needs two BetaCosine laws (relevant, irrelevant)")
    if relevant.dim != irrelevant.dim:
        raise ValueError(f"relevant and irrelevant laws must share the geometry: dim {relevant.dim}, {irrelevant.dim}")
    if relevant.shape != irrelevant.shape:
        raise ValueError(f"mismatched lengths: relevant law has shape {relevant.shape}, irrelevant {irrelevant.shape}")
    ap, bp = (np.asarray(v, dtype=np.float64) for v in relevant.z_params)
    an, bn = (np.asarray(v, dtype=np.float64) for v in irrelevant.z_params)
    return ap - an, bp - bn, special.betaln(an, bn) - special.betaln(ap, bp)


def log_likelihood_ratio(relevant: BetaCosine, irrelevant: BetaCosine, x: ArrayLike) -> FloatLike:
    """log f+(x) - log f-(x) per query (shapes as in :meth:`BetaCosine.cdf`), for cosines strictly inside (-1, 1)."""
    return np.asarray(relevant.logpdf(x)) - np.asarray(irrelevant.logpdf(x))


_STATUS = np.array(["crossing", "all", "none", "inverted"])


def likelihood_ratio_cutoff(
    relevant: BetaCosine, irrelevant: BetaCosine, log_ratio: ArrayLike = 0.0, *, return_status: bool = False
) -> NDArray[np.float64] | tuple[NDArray[np.float64], NDArray[np.str_]]:
    """Per-query cosine threshold where the likelihood ratio of the relevant and irrelevant laws reaches a level.

    The rule keeps document d for query q iff ``log f+_q(x) - log f-_q(x) >= lambda`` with x = cos(q, d), f+ and
    f- the relevant and irrelevant laws (a ``beta_mle`` head's Beta(alpha+, beta+) and Beta(alpha-, beta-),
    Sec. 3.1, :func:`beta_mle_laws`; or a calibrated relevant law). With prior odds pi / (1 - pi) of relevance,
    ``lambda = -log(pi / (1 - pi))`` is the Bayes rule P(relevant | x) >= 1/2 (the relevant density times the
    prior ratio equals the irrelevant density at the threshold); as a free level, lambda is what a calibration
    step tunes (larger lambda, higher threshold, fewer documents). In the sphere geometry both laws carry the same
    factor (1 - x^2)^m, which cancels: the ratio, and so the threshold, is the line one up to its normalising
    constants (handled exactly through :attr:`BetaCosine.z_params`).

    With z = (1 + x) / 2, ``g(z) = A log z + B log(1 - z) + C`` (A = a+ - a-, B = b+ - b-), which is monotone or
    has a single turning point, so the set where g >= lambda is an interval or the complement of one. A cutoff
    keeps a head of the cosine ranking, so per query:

    * ``"crossing"``: the threshold is the cosine where g rises through lambda -- the only crossing if g is
      increasing (A >= 0 >= B); the *lower* one if g is concave (A, B > 0: very high cosines, beyond the upper
      crossing, are kept too); the *upper* one if g is convex (A, B < 0: the low-cosine branch is not kept);
    * ``"all"``: g >= lambda on all of the head's range (from the crossing side): threshold ``-inf``;
    * ``"none"``: g < lambda everywhere it could be crossed from below: threshold ``+inf`` (nothing kept);
    * ``"inverted"``: g is decreasing (A <= 0 <= B, the relevant law sits *below* the irrelevant one), so no head
      of the ranking satisfies the rule unless g >= lambda everywhere (then ``-inf`` and status ``"all"``);
      otherwise ``+inf``.

    The crossing is found by bisection in logit(z) to float precision (``|g(t) - lambda|`` at the rounding level).

    Args:
        relevant, irrelevant: :class:`BetaCosine` laws with the same shape (one per query) and ``dim``.
        log_ratio: lambda, a scalar, one per query ``(Q,)``, or ``(Q, L)`` (L levels per query).
        return_status: also return the per-threshold status (array of the strings above).

    Returns:
        Thresholds (shape of ``log_ratio`` broadcast against the queries), and optionally the status array.
    """
    a_coef, b_coef, c_coef = _lr_coefficients(relevant, irrelevant)
    try:
        lam = np.asarray(log_ratio, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"log_ratio must be a number or an array of numbers, got {log_ratio!r}") from exc
    if np.any(np.isnan(lam)):
        raise ValueError("log_ratio must not be nan")
    if a_coef.ndim == 0:  # one law for all: numpy broadcasting
        shape, pshape = lam.shape, ()
    elif lam.ndim == 0:
        shape, pshape = a_coef.shape, a_coef.shape
    elif lam.shape[0] == a_coef.shape[0]:
        shape, pshape = lam.shape, a_coef.shape + (1,) * (lam.ndim - 1)
    else:
        raise ValueError(
            f"mismatched dimensions: log_ratio has shape {lam.shape} but the laws have {a_coef.shape[0]} queries; "
            f"pass a scalar, an array of shape ({a_coef.shape[0]},) or ({a_coef.shape[0]}, L)"
        )
    lam = np.broadcast_to(lam, shape).astype(np.float64)
    big_a, big_b, big_c = (np.broadcast_to(v.reshape(pshape), shape) for v in (a_coef, b_coef, c_coef))
    big_u = 80.0  # logit(z) range: tanh(40) == 1.0 in float64, so [-80, 80] spans every float cosine

    def h(u: NDArray[np.float64]) -> NDArray[np.float64]:
        # log z = -log(1 + e^-u), log(1 - z) = -log(1 + e^u)
        with np.errstate(invalid="ignore"):
            return -big_a * np.logaddexp(0.0, -u) - big_b * np.logaddexp(0.0, u) + big_c - lam

    inc = (big_a >= 0) & (big_b <= 0) & ~((big_a == 0) & (big_b == 0))
    dec = (big_a <= 0) & (big_b >= 0) & ~((big_a == 0) & (big_b == 0))
    concave = (big_a > 0) & (big_b > 0)
    convex = (big_a < 0) & (big_b < 0)
    flat = (big_a == 0) & (big_b == 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        u_star = np.clip(np.log(np.abs(big_a)) - np.log(np.abs(big_b)), -big_u, big_u)  # turning point, logit z*
    lo = np.where(convex, u_star, -big_u)
    hi = np.where(concave, u_star, big_u)
    h_lo, h_hi = h(lo), h(hi)

    status = np.zeros(shape, dtype=np.intp)  # 0 crossing, 1 all, 2 none, 3 inverted
    out = np.full(shape, np.nan)
    searchable = inc | concave | convex
    all_ = searchable & (h_lo >= 0)
    none_ = searchable & ~all_ & (h_hi < 0)
    cross = searchable & ~all_ & ~none_
    h_top = h(np.full(shape, big_u))
    dec_all = (dec | flat) & (h_top >= 0)
    status[all_ | dec_all] = 1
    status[none_ | (flat & ~dec_all)] = 2
    status[dec & ~dec_all] = 3
    out[all_ | dec_all] = -np.inf
    out[~cross & ~(all_ | dec_all)] = np.inf

    # bisection on [lo, hi] where h is increasing, h(lo) < 0 <= h(hi)
    a_, b_ = lo.copy(), hi.copy()
    for _ in range(200):
        mid = 0.5 * (a_ + b_)
        up = h(mid) >= 0
        b_ = np.where(cross & up, mid, b_)
        a_ = np.where(cross & ~up, mid, a_)
        if np.all(~cross | (b_ - a_ <= 4e-16 * np.maximum(1.0, np.abs(b_)))):
            break
    out = np.where(cross, np.tanh(b_ / 2.0), out)  # x = 2 sigmoid(u) - 1; b_ satisfies h >= 0
    out = out if out.ndim else out[()]
    if return_status:
        return out, _STATUS[status]
    return out
