"""Calibrated per-query cosine laws for pEBR, their PIT diagnostics, and a likelihood-ratio cutoff (issue #13).

pEBR (``shared/papers/pebr.md``) cuts each query at ``t_q = F_q^{-1}(1 - p)`` of its head's law (Sec. 3.2), which the
loss trains but which does not describe where relevant cosines lie. :class:`CalibratedLaw` fits a per-query Beta law of
the relevant cosines on dev qrels (Sec. 3.2.2; Appendix A's sphere as an option), :func:`pit_values` /
:func:`pit_summary` measure calibration, and :func:`likelihood_ratio_cutoff` cuts ``beta_mle`` heads (Sec. 3.1).
``params``: the head's outputs per query (``(Q, k)`` or a frame with :data:`~pyterrier_prob.dense.PARAM_COLUMNS`);
``relevant_cosines_per_query``: per query, the cosines of its judged-relevant documents. Details: ``docs/pebr.md``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import pandas as pd
from numpy.typing import ArrayLike, NDArray
from scipy import linalg, optimize, special, stats

from pyterrier_prob.dense import PARAM_COLUMNS
from pyterrier_prob.validation import choice, finite_float, positive_int
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

#: Relevant cosines may exceed [-1, 1] by this much (float32 rounding) and are clipped; further out is an error.
COSINE_TOLERANCE = 1e-4
#: z = (1 + cos) / 2 is clipped to [Z_EPS, 1 - Z_EPS]: a cosine of +-1 (a duplicate document) has a finite density.
Z_EPS = 1e-12
_ETA_CLIP = 25.0  # log-parameters are clipped to [-25, 25]: Beta parameters in [1.4e-11, 7.2e10]
_PAIR_BLOCK = 1 << 20  # padded (queries x K) cells evaluated at once by pit_values / mean_log_density
_SERIAL = "pyterrier_prob.pebr.CalibratedLaw"
_SERIAL_VERSION = 1
_WEIGHTINGS = ("query", "pair")
_INIT_STATE = ("family", "dim", "weighting", "include_negative")  # CalibratedLaw's state, as to_dict writes it
_ARRAY_STATE = ("coef_a", "coef_b", "covariance")
_PLAIN_STATE = ("feature_names", "constant_features", "n_queries", "n_pairs", "converged", "n_iter")


def _nan_to_none(values: Any) -> list[float | None]:
    """Flat list of floats with nan / inf as ``None`` (JSON)."""
    return [float(v) if math.isfinite(v) else None for v in np.asarray(values, dtype=np.float64).ravel()]


# --- input checking -------------------------------------------------------------------------------------------------


def _matrix(values: Any, message: str) -> NDArray[np.float64]:
    """``values`` as a float array, a 1-D one as one column; ``ValueError(message)`` if they are not numbers."""
    try:
        arr = np.array(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(message) from exc
    return arr[:, None] if arr.ndim == 1 else arr


def _param_matrix(params: Any, family: str) -> NDArray[np.float64]:
    """The head's parameters as a float array (Q, k), checked finite and > 0."""
    cols = PARAM_COLUMNS[family]
    if isinstance(params, pd.DataFrame):
        if missing := [c for c in cols if c not in params.columns]:
            raise ValueError(f"params frame lacks the {family!r} parameter column(s) {missing}; it has {list(params)}")
        arr = params[list(cols)].to_numpy(dtype=np.float64)
    else:
        arr = _matrix(params, f"params must be a numeric array (queries, k) or a frame with {cols}")
        if arr.ndim != 2 or arr.shape[1] != len(cols):
            raise ValueError(
                f"params of a {family!r} head must have shape (queries, {len(cols)}) ({', '.join(cols)}), "
                f"got {np.shape(params)}"
            )
    if (bad := ~(np.isfinite(arr) & (arr > 0))).any():
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
        arr = _matrix(features, f"features must be numeric, got columns with dtypes {dict(features.dtypes)}")
    elif isinstance(features, Mapping):
        names = [str(k) for k in features]
        cols = [np.asarray(v, dtype=np.float64).reshape(-1) for v in features.values()]
        if len({c.size for c in cols}) > 1:
            raise ValueError(f"features: columns of different lengths {[c.size for c in cols]}")
        arr = np.stack(cols, axis=1) if cols else np.zeros((n, 0))
    else:
        arr = _matrix(features, "features must be None, a numeric array (queries, k), a frame or a mapping")
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
        for bad, want in ((~np.isfinite(arr), "be finite"), (np.abs(arr) > 1.0 + COSINE_TOLERANCE, "lie in [-1, 1]")):
            if bad.any():
                raise ValueError(f"relevant cosines of query {i} must {want}, got {arr[bad][0]!r}")
        out.append(np.clip(arr, -1.0, 1.0))
    return out


def _law_lists(law: Any, relevant: Any) -> list[NDArray[np.float64]]:
    """:func:`_relevant_lists` checked against a per-query law (one list per law when the law has Q of them)."""
    if not isinstance(law, (ExpCosine, BetaCosine)):
        raise ValueError(f"law must be an ExpCosine or BetaCosine (one per query), got {type(law).__name__}")
    return _relevant_lists(relevant, law.n_queries, "the law has {n} per-query laws")


def _z(lists: list[NDArray[np.float64]]) -> NDArray[np.float64]:
    """z = (1 + cos) / 2 of every relevant pair, clipped to [Z_EPS, 1 - Z_EPS]."""
    return np.clip((1.0 + np.concatenate(lists)) / 2.0, Z_EPS, 1.0 - Z_EPS)


def _pair_weights(lists: list[NDArray[np.float64]], weighting: str) -> NDArray[np.float64]:
    """Per-pair weights: 1 / |R_q| (``"query"``: every query counts once) or 1 (``"pair"``)."""
    n = np.array([c.size for c in lists], dtype=np.float64)
    return np.repeat(1.0 / n if weighting == "query" else np.ones(n.size), n.astype(np.intp))


# --- the model's own (uncalibrated) law -----------------------------------------------------------------------------


def model_law(params: Any, family: Family, dim: int | None = None) -> ExpCosine | BetaCosine:
    """The relevant-item law the head itself predicts (the uncalibrated law): ``exp`` truncated exponential (Sec.
    3.2.1), ``beta`` Beta(1 / tau_q, 1) (Eq. 3), ``beta_mle`` Beta(alpha+, beta+) (Sec. 3.1); ``dim=n``: the sphere (Eq.
    4)."""
    family = choice("family", family, tuple(PARAM_COLUMNS))  # dim is checked by the law (None: the line; n: the sphere)
    return distribution_from_params(_param_matrix(params, family), family, dim=dim)


def beta_mle_laws(params: Any, dim: int | None = None) -> tuple[BetaCosine, BetaCosine]:
    """(relevant, irrelevant) laws of a ``beta_mle`` head (Sec. 3.1): Beta(alpha+, beta+) and Beta(alpha-, beta-)."""
    p = _param_matrix(params, "beta_mle")
    return BetaCosine(p[:, 0], p[:, 1], dim=dim), BetaCosine(p[:, 2], p[:, 3], dim=dim)


# --- the calibrated law ---------------------------------------------------------------------------------------------


def _suff_stats(lists: list[NDArray[np.float64]]) -> tuple[NDArray, NDArray, NDArray]:
    """Per query: n_q, sum log z, sum log(1 - z), with z = (1 + cos) / 2 clipped to [Z_EPS, 1 - Z_EPS]."""
    n = np.array([c.size for c in lists], dtype=np.float64)
    z = _z(lists)
    starts = np.concatenate([[0], np.cumsum(n[:-1])]).astype(np.intp)
    return n, np.add.reduceat(np.log(z), starts), np.add.reduceat(np.log1p(-z), starts)


def _standardise(design: NDArray[np.float64]) -> tuple[NDArray, NDArray, NDArray]:
    """``(xs, const, t_map)``: the standardised design without constant features, their mask, raw = ``t_map @ xs``."""
    mu, sd = design[:, 1:].mean(axis=0), design[:, 1:].std(axis=0)
    const = sd <= 1e-12 * np.maximum(1.0, np.abs(mu))
    keep = np.flatnonzero(np.concatenate([[True], ~const]))
    scale = np.where(const, 1.0, sd)
    t_map = np.diag(np.r_[1.0, 1.0 / scale])
    t_map[0, 1:] = -mu / scale
    xs = np.concatenate([design[:, :1], (design[:, 1:] - mu) / scale], axis=1)
    return xs[:, keep], const, t_map[:, keep]


class _BetaLikelihood:
    """Weighted log-likelihood of :class:`CalibratedLaw` in standardised features; analytic gradient, Hessian."""

    def __init__(self, xs: NDArray, stats_: tuple[NDArray, NDArray, NDArray], wq: NDArray, offset: float) -> None:
        self.xs, self.wq, self.off = xs, wq, offset
        self.n, self.s1, self.s2 = stats_
        self.k = xs.shape[1]
        self.total = float(np.sum(wq * self.n))

    def parts(self, w: NDArray[np.float64]) -> tuple:
        """(da/deta, db/deta, a, b, ll_q, dll/da, dll/db) per query; eta clipped (derivative 0 beyond the clip)."""
        raw_a, raw_b = self.xs @ w[: self.k], self.xs @ w[self.k :]
        eta_a, eta_b = np.clip(raw_a, -_ETA_CLIP, _ETA_CLIP), np.clip(raw_b, -_ETA_CLIP, _ETA_CLIP)
        a, b = np.exp(eta_a) + self.off, np.exp(eta_b) + self.off
        ea = np.where(raw_a == eta_a, np.exp(eta_a), 0.0)
        eb = np.where(raw_b == eta_b, np.exp(eta_b), 0.0)
        ll = (a - 1.0) * self.s1 + (b - 1.0) * self.s2 - self.n * special.betaln(a, b)
        dab = special.digamma(a + b)
        la = self.s1 - self.n * (special.digamma(a) - dab)  # d ll / d a
        lb = self.s2 - self.n * (special.digamma(b) - dab)
        return ea, eb, a, b, ll, la, lb

    def fun(self, w: NDArray[np.float64]) -> float:
        return -float(np.sum(self.wq * self.parts(w)[4])) / self.total

    def scores(self, w: NDArray[np.float64]) -> NDArray[np.float64]:
        """Per-query weighted scores (queries, 2k): the gradient of each query's term."""
        ea, eb, _, _, _, la, lb = self.parts(w)
        return np.concatenate([self.xs * (self.wq * ea * la)[:, None], self.xs * (self.wq * eb * lb)[:, None]], axis=1)

    def jac(self, w: NDArray[np.float64]) -> NDArray[np.float64]:
        return -self.scores(w).sum(axis=0) / self.total

    def hess(self, w: NDArray[np.float64]) -> NDArray[np.float64]:
        ea, eb, a, b, _, la, lb = self.parts(w)
        tab = special.polygamma(1, a + b)
        haa = ea * ea * (-self.n * (special.polygamma(1, a) - tab)) + ea * la
        hbb = eb * eb * (-self.n * (special.polygamma(1, b) - tab)) + eb * lb
        h_ab = self._gram(ea * eb * self.n * tab)
        return -np.block([[self._gram(haa), h_ab], [h_ab.T, self._gram(hbb)]]) / self.total

    def _gram(self, v: NDArray[np.float64]) -> NDArray[np.float64]:
        """``xs^T diag(wq * v) xs``: one (k, k) block of the Hessian."""
        return self.xs.T @ (self.xs * (self.wq * v)[:, None])

    def start(self, z: NDArray[np.float64]) -> NDArray[np.float64]:
        """The pooled (weighted) method-of-moments fit of z, no slopes."""
        wz = np.repeat(self.wq, self.n.astype(np.intp))
        zm = float(np.average(z, weights=wz))
        zv = max(float(np.average((z - zm) ** 2, weights=wz)), 1e-8)
        kappa = max(zm * (1.0 - zm) / zv - 1.0, 1e-3)
        w0 = np.zeros(2 * self.k)
        w0[0] = math.log(max(zm * kappa - self.off, 0.5))
        w0[self.k] = math.log(max((1.0 - zm) * kappa - self.off, 0.5))
        return w0

    def maximise(self, w0: NDArray[np.float64]) -> optimize.OptimizeResult:
        """Trust-region Newton; in the rare failure, polished with quasi-Newton from where it stopped."""
        res = optimize.minimize(
            self.fun, w0, jac=self.jac, hess=self.hess, method="trust-exact", options={"gtol": 1e-9}
        )
        if not res.success:
            res2 = optimize.minimize(self.fun, res.x, jac=self.jac, method="BFGS", options={"gtol": 1e-9})
            if res2.fun <= res.fun:
                res2.nit += res.nit
                res = res2
        return res

    def sandwich(self, w: NDArray[np.float64]) -> NDArray[np.float64]:
        """Query-clustered covariance ``A^{-1} B A^{-1}`` (A the Hessian, B the sum of squared per-query scores)."""
        scores = self.scores(w)
        a_inv = np.linalg.pinv(self.hess(w) * self.total)
        return a_inv @ (scores.T @ scores) @ a_inv


class CalibratedLaw:
    """Per-query Beta law of the relevant cosines, fitted by maximum likelihood on calibration queries.

    z = (1 + x) / 2 ~ Beta(a_q, b_q) with ``log(a_q - m+) = w_a . phi_q``, ``log(b_q - m+) = w_b . phi_q``, ``phi_q =
    [1, log theta_q, features_q]`` (theta_q: the head's parameters; ``include_negative``: also ``beta_mle``'s alpha-,
    beta-). ``dim=None``: the line (m+ = 0, recommended); ``dim=n``: Appendix A's sphere (Eq. 4). ``weighting``:
    ``"query"`` (each query once) or ``"pair"``. Standard errors: query-clustered sandwich. Details: ``docs/pebr.md``.

    Example::

        cal = CalibratedLaw("beta").fit(dev_params, dev_relevant_cosines)
        thresholds = cal.law(test_params).cutoff(0.9)       # keeps ~90% of each query's relevant cosines
        pit_summary(pit_values(cal.law(test_params), test_relevant_cosines))"""

    def __init__(
        self,
        family: Family = "beta",
        dim: int | None = None,
        weighting: Weighting = "query",
        include_negative: bool = False,
    ) -> None:
        self.family = choice("family", family, tuple(PARAM_COLUMNS))
        self.dim = positive_int("dim", dim, allow_none=True, minimum=2)
        self.weighting = choice("weighting", weighting, _WEIGHTINGS)
        if include_negative and self.family != "beta_mle":
            raise ValueError("include_negative needs a beta_mle head (only it predicts the irrelevant law)")
        self.include_negative = bool(include_negative)
        self.coef_a_: NDArray[np.float64] | None = None
        self.coef_b_: NDArray[np.float64] | None = None
        self.covariance_: NDArray[np.float64] | None = None
        self.feature_names_: list[str] = []
        self.constant_features_: list[str] = []
        self.n_queries_ = self.n_pairs_ = self.n_iter_ = 0
        self.loglik_, self.converged_, self.message_ = math.nan, False, ""

    @property
    def _m(self) -> float:
        """m = (n - 3) / 2 of the sphere factor (Eq. 4); 0 on the line. a_q = exp(eta) + m+ in z, m+ = max(m, 0)."""
        return 0.0 if self.dim is None else (self.dim - 3) / 2.0

    def _theta_names(self) -> list[str]:
        if self.family != "beta_mle":
            return ["log tau"]
        return ["log alpha+", "log beta+", *(["log alpha-", "log beta-"] if self.include_negative else [])]

    def _design(self, params: Any, features: Any) -> tuple[NDArray[np.float64], list[str]]:
        p = _param_matrix(params, self.family)
        theta = np.log(p[:, : len(self._theta_names())])
        extra, names = _feature_matrix(features, p.shape[0])
        return np.concatenate([np.ones((p.shape[0], 1)), theta, extra], axis=1), ["1", *self._theta_names(), *names]

    def fit(self, params: Any, relevant_cosines_per_query: Any, features: Any = None) -> CalibratedLaw:
        """Fit by maximum likelihood (trust-region Newton) on Q calibration queries; ``features``: optional extra
        per-query features (``(Q, j)`` array, frame or ``{name: values}``). Returns ``self``."""
        design, names = self._design(params, features)
        if design.shape[0] == 0:
            raise ValueError("no calibration queries: params is empty")
        lists = _relevant_lists(relevant_cosines_per_query, design.shape[0])
        stats_ = _suff_stats(lists)
        n = stats_[0]
        xs, const, t_map = _standardise(design)
        wq = 1.0 / n if self.weighting == "query" else np.ones_like(n)
        model = _BetaLikelihood(xs, stats_, wq, max(self._m, 0.0))
        res = model.maximise(model.start((1.0 + np.concatenate(lists)) / 2.0))
        w = res.x
        t_full = linalg.block_diag(t_map, t_map)  # back from the standardised coordinates to the raw features
        coef, cov = t_full @ w, t_full @ model.sandwich(w) @ t_full.T
        dropped = np.concatenate([[False], const, [False], const])
        cov[dropped] = cov[:, dropped] = np.nan
        self.coef_a_, self.coef_b_ = np.split(coef, 2)
        self.feature_names_, self.covariance_ = names, cov
        self.constant_features_ = [nm for nm, c in zip(names[1:], const) if c]
        self.n_queries_, self.n_pairs_ = len(lists), int(n.sum())
        self.converged_ = bool(res.success) or float(np.max(np.abs(model.jac(w)))) < 1e-6
        self.n_iter_, self.message_ = int(res.nit), str(res.message)
        self.loglik_ = self.score(params, lists, features)
        return self

    def _check_fitted(self) -> None:
        if self.coef_a_ is None or self.coef_b_ is None:
            raise ValueError("CalibratedLaw is not fitted: call .fit(params, relevant_cosines_per_query) first")

    def law(self, params: Any, features: Any = None) -> BetaCosine:
        """The calibrated relevant-cosine law of each query (one :class:`BetaCosine` with Q parameters): ``.cutoff(p)``
        keeps a share p of each query's relevant documents (if the calibration holds), ``.cdf`` gives the PIT."""
        self._check_fitted()
        design, names = self._design(params, features)
        if names != self.feature_names_:
            raise ValueError(f"features {names[1:]} differ from those of the fit {self.feature_names_[1:]}")
        shift = max(self._m, 0.0) - self._m  # alpha_q = a_q - m with a_q = exp(eta) + m+
        ea, eb = (np.exp(np.clip(design @ c, -_ETA_CLIP, _ETA_CLIP)) + shift for c in (self.coef_a_, self.coef_b_))
        return BetaCosine(ea, eb, dim=self.dim)

    def score(self, params: Any, relevant_cosines_per_query: Any, features: Any = None) -> float:
        """Weighted mean log density (nats per pair) of the relevant cosines under :meth:`law`, in x (comparable with
        :func:`mean_log_density`)."""
        law = self.law(params, features)
        lists = _relevant_lists(relevant_cosines_per_query, law.n_queries)
        n = np.array([c.size for c in lists])
        a, b = (np.repeat(np.asarray(v, dtype=np.float64), n) for v in law.z_params)
        w = _pair_weights(lists, self.weighting)
        return float(np.sum(w * (stats.beta.logpdf(_z(lists), a, b) - math.log(2.0))) / np.sum(w))

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
        state: dict[str, Any] = {"kind": _SERIAL, "version": _SERIAL_VERSION}
        state |= {k: getattr(self, k) for k in _INIT_STATE}
        state |= {k: _nan_to_none(getattr(self, k + "_")) for k in _ARRAY_STATE}
        state |= {k: getattr(self, k + "_") for k in _PLAIN_STATE}
        state["loglik"] = _nan_to_none(self.loglik_)[0]
        return state

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> CalibratedLaw:
        """Rebuild a fitted :class:`CalibratedLaw` from :meth:`to_dict` output."""
        if not isinstance(state, Mapping) or state.get("kind") != _SERIAL:
            raise ValueError(f"not a serialised CalibratedLaw (expected kind {_SERIAL!r})")
        if state.get("version") != _SERIAL_VERSION:
            raise ValueError(
                f"unsupported CalibratedLaw version {state.get('version')!r} (this code: {_SERIAL_VERSION})"
            )
        obj = cls(*(state[k] for k in _INIT_STATE))
        for k in _ARRAY_STATE:
            setattr(obj, k + "_", np.array([math.nan if v is None else v for v in state[k]], dtype=np.float64))
        names = obj.feature_names_ = list(state["feature_names"])
        if not (len(names) == obj.coef_a_.size == obj.coef_b_.size) or not np.all(np.isfinite(obj.coef_a_)):
            raise ValueError("corrupt CalibratedLaw state: coefficients and feature names disagree or are not finite")
        obj.covariance_ = obj.covariance_.reshape(2 * len(names), 2 * len(names))
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


# --- per-pair evaluation of a per-query law; PIT --------------------------------------------------------------------


def take_queries(law: ExpCosine | BetaCosine, idx: NDArray[np.intp]) -> ExpCosine | BetaCosine:
    """The per-query laws of the queries ``idx`` (positions), as a law of the same kind and geometry."""
    if isinstance(law, BetaCosine):
        alpha, beta = (np.broadcast_to(np.asarray(v), (law.n_queries,))[idx] for v in (law.alpha, law.beta))
        return BetaCosine(alpha, beta, law.dim)
    return ExpCosine(np.asarray(law.tau)[idx], law.dim)


def _per_pair(law: ExpCosine | BetaCosine, lists: list[NDArray[np.float64]], method: str) -> NDArray[np.float64]:
    """``law.<method>`` (``"cdf"``/``"logpdf"``) of each query's cosines under its law, in blocks of padded lists."""
    flat = np.concatenate(lists)
    if law.n_queries is None:
        return np.asarray(getattr(law, method)(flat), dtype=np.float64)
    counts = np.array([c.size for c in lists])
    out: list[NDArray[np.float64]] = [flat[:0]] * len(lists)
    order = np.argsort(counts, kind="stable")
    i = 0
    while i < order.size:
        j = i + 1
        while j < order.size and (j + 1 - i) * counts[order[j]] <= _PAIR_BLOCK:
            j += 1
        idx = order[i:j]
        width = int(counts[idx].max())
        pad = np.zeros((idx.size, width))
        pad[np.arange(width) < counts[idx, None]] = np.concatenate([lists[q] for q in idx])
        vals = np.asarray(getattr(take_queries(law, idx), method)(pad), dtype=np.float64).reshape(idx.size, width)
        for r, q in enumerate(idx):
            out[q] = vals[r, : counts[q]]
        i = j
    return np.concatenate(out)


def pit_values(law: ExpCosine | BetaCosine, relevant_cosines_per_query: Any) -> NDArray[np.float64]:
    """Probability integral transform F_q(cos(q, d)) of every relevant pair (queries in order, then documents).

    ``law`` has one law per query (e.g. :func:`model_law`, :meth:`CalibratedLaw.law`) or one for all. Uniform on [0, 1]
    when the law describes the relevant cosines; ``cutoff(p)`` keeps a document iff its PIT >= 1 - p."""
    return _per_pair(law, _law_lists(law, relevant_cosines_per_query), "cdf")


def mean_log_density(
    law: ExpCosine | BetaCosine, relevant_cosines_per_query: Any, weighting: Weighting = "query"
) -> float:
    """Weighted mean log density (nats per relevant pair) of the relevant cosines under ``law`` (weights as in
    :class:`CalibratedLaw`); compares laws and geometries on held-out queries (higher is better)."""
    choice("weighting", weighting, _WEIGHTINGS)
    lists = _law_lists(law, relevant_cosines_per_query)
    w = _pair_weights(lists, weighting)
    return float(np.sum(w * _per_pair(law, lists, "logpdf")) / np.sum(w))


def query_weights(relevant_cosines_per_query: Any) -> NDArray[np.float64]:
    """Per-pair weights 1 / |R_q| (in :func:`pit_values` order), so that every query counts once: the weighting of
    mean per-query recall (SetR, the conformal recall loss) and of ``CalibratedLaw(weighting="query")``."""
    return _pair_weights(_relevant_lists(relevant_cosines_per_query), "query")


def pit_summary(pit: ArrayLike, tail: float = 0.01, weights: ArrayLike | None = None) -> dict[str, float]:
    """Calibration summary of PIT values (ideal: uniform on [0, 1]).

    Returns ``n``, ``ks_statistic`` / ``ks_pvalue`` (``scipy.stats.kstest`` against U(0, 1)), ``mean`` (ideal 0.5),
    ``below_tail`` / ``above_tail`` (share below ``tail`` / above ``1 - tail``; ideal ``tail``), ``central_50`` /
    ``central_90`` (ideal 0.5 / 0.9) and ``tail``. With ``weights`` (e.g. :func:`query_weights`) every figure is
    weighted and ``ks_pvalue`` is nan; the p-value treats pairs as independent, so read the statistic first."""
    u = np.asarray(pit, dtype=np.float64).reshape(-1)
    if u.size == 0:
        raise ValueError("pit is empty")
    if not np.all((u >= 0.0) & (u <= 1.0)):
        raise ValueError("PIT values must lie in [0, 1] (and not be nan)")
    tail = finite_float("tail", tail, low=0.0, high=0.5, low_open=True, high_open=True)
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
        d, pvalue = float(max(np.max(cw - us), np.max(us - np.r_[0.0, cw[:-1]]))), math.nan
    return {
        "n": int(u.size),
        "ks_statistic": d,
        "ks_pvalue": pvalue,
        "mean": float(np.sum(w * u)),
        "below_tail": float(np.sum(w * (u < tail))),
        "above_tail": float(np.sum(w * (u > 1.0 - tail))),
        "central_50": float(np.sum(w * ((u >= 0.25) & (u <= 0.75)))),
        "central_90": float(np.sum(w * ((u >= 0.05) & (u <= 0.95)))),
        "tail": tail,
    }


# --- likelihood-ratio cutoff (beta_mle) -----------------------------------------------------------------------------


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


def log_likelihood_ratio(relevant: BetaCosine, irrelevant: BetaCosine, x: ArrayLike) -> float | NDArray[np.float64]:
    """log f+(x) - log f-(x) per query (shapes as in :meth:`BetaCosine.cdf`), for cosines strictly inside (-1, 1)."""
    return np.asarray(relevant.logpdf(x)) - np.asarray(irrelevant.logpdf(x))


_STATUS = np.array(["crossing", "all", "none", "inverted"])
_U_MAX = 80.0  # logit(z) range: tanh(40) == 1.0 in float64, so [-80, 80] spans every float cosine


def _lr_gap(u: NDArray[np.float64], a: NDArray, b: NDArray, c: NDArray, lam: NDArray) -> NDArray[np.float64]:
    """g - lambda at logit(z) = u, with log z = -log(1 + e^-u) and log(1 - z) = -log(1 + e^u)."""
    with np.errstate(invalid="ignore"):
        return -a * np.logaddexp(0.0, -u) - b * np.logaddexp(0.0, u) + c - lam


def likelihood_ratio_cutoff(
    relevant: BetaCosine, irrelevant: BetaCosine, log_ratio: ArrayLike = 0.0, *, return_status: bool = False
) -> NDArray[np.float64] | tuple[NDArray[np.float64], NDArray[np.str_]]:
    """Per-query cosine threshold where the likelihood ratio of the relevant and irrelevant laws reaches ``log_ratio``.

    Keeps d for q iff ``log f+_q(x) - log f-_q(x) >= lambda`` (x = cos(q, d); f+, f-: :class:`BetaCosine` laws of the
    same shape and ``dim``, e.g. :func:`beta_mle_laws`, Sec. 3.1); ``lambda = -log(pi / (1 - pi))`` is the Bayes rule
    for prior odds pi / (1 - pi). ``log_ratio``: a scalar, ``(Q,)`` or ``(Q, L)``. The status per threshold
    (``return_status``) is ``"crossing"``, ``"all"`` (-inf), ``"none"`` or ``"inverted"`` (+inf); rules in
    ``docs/pebr.md``. Crossings are bisected in logit(z) to float precision."""
    coefs = _lr_coefficients(relevant, irrelevant)
    lam, pshape = relevant.align(log_ratio, "log_ratio")  # thresholds' shape: the queries', or log_ratio's (Q, L)
    if np.any(np.isnan(lam)):
        raise ValueError("log_ratio must not be nan")
    big_a, big_b, big_c = (np.broadcast_to(v.reshape(pshape), lam.shape) for v in coefs)
    zero = (big_a == 0) & (big_b == 0)
    inc = (big_a >= 0) & (big_b <= 0) & ~zero
    dec = (big_a <= 0) & (big_b >= 0) & ~zero
    concave = (big_a > 0) & (big_b > 0)
    convex = (big_a < 0) & (big_b < 0)
    with np.errstate(divide="ignore", invalid="ignore"):  # the turning point, logit z*
        u_star = np.clip(np.log(np.abs(big_a)) - np.log(np.abs(big_b)), -_U_MAX, _U_MAX)
    lo = np.where(convex, u_star, -_U_MAX)
    hi = np.where(concave, u_star, _U_MAX)
    searchable = inc | concave | convex
    all_ = searchable & (_lr_gap(lo, big_a, big_b, big_c, lam) >= 0)
    none_ = searchable & ~all_ & (_lr_gap(hi, big_a, big_b, big_c, lam) < 0)
    cross = searchable & ~all_ & ~none_
    dec_all = (dec | zero) & (_lr_gap(np.full(lam.shape, _U_MAX), big_a, big_b, big_c, lam) >= 0)
    # 0 crossing, 1 all, 2 none, 3 inverted (disjoint masks); the crossings' thresholds are bisected below
    status = np.select([all_ | dec_all, none_ | (zero & ~dec_all), dec & ~dec_all], [1, 2, 3], 0)
    out = np.where(status == 1, -np.inf, np.inf)
    a_, b_ = lo.copy(), hi.copy()  # bisection on [lo, hi] where g is increasing, g(lo) < lambda <= g(hi)
    for _ in range(200):
        mid = 0.5 * (a_ + b_)
        up = _lr_gap(mid, big_a, big_b, big_c, lam) >= 0
        b_ = np.where(cross & up, mid, b_)
        a_ = np.where(cross & ~up, mid, a_)
        if np.all(~cross | (b_ - a_ <= 4e-16 * np.maximum(1.0, np.abs(b_)))):
            break
    out = np.where(cross, np.tanh(b_ / 2.0), out)  # x = 2 sigmoid(u) - 1; b_ satisfies g >= lambda
    out = out if out.ndim else out[()]
    return (out, _STATUS[status]) if return_status else out
