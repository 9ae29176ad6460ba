"""Per-query laws of the query/relevant-item cosine similarity and the cutoffs they give (pEBR).

pEBR (``shared/papers/pebr.md``) gives every query q a law of the cosine x in [-1, 1] to its relevant items and
retrieves the items above ``t_q = F_q^{-1}(1 - p)`` (:meth:`~_CosineLaw.cutoff`, Sec. 3.2, 4.4.2): :class:`ExpCosine`
(ExpNCE, Sec. 3.2.1) and :class:`BetaCosine` (BetaNCE, Sec. 3.2.2). ``dim=None`` is the 1-D law; ``dim=n`` Appendix
A's sphere-corrected law (Eq. 4). Parameters are a scalar or one per query. Geometry and accuracy: ``docs/pebr.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cached_property

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import special

from st_extensions.checks import positive_int

__all__ = ["BetaCosine", "ExpCosine"]

FloatOrArray = float | NDArray[np.float64]
_Aligned = tuple[NDArray[np.float64], tuple[int, ...]]  # values, the shape the parameters take to broadcast

_LOG2 = math.log(2.0)


# ---- validation and broadcasting helpers ---------------------------------------------------------------


def _as_param(value: ArrayLike, name: str) -> NDArray[np.float64]:
    """A distribution parameter as a read-only float array of shape () or (Q,), finite and > 0."""
    try:
        arr = np.array(value, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a positive number or a 1-D array of them, got {value!r}") from exc
    if arr.ndim > 1:
        raise ValueError(f"{name} must be a scalar or a 1-D array (one value per query), got shape {arr.shape}")
    bad = ~(np.isfinite(arr) & (arr > 0))
    if np.any(bad):
        if arr.ndim == 0:
            raise ValueError(f"{name} must be finite and > 0, got {float(arr)!r}")
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"{name} must be finite and > 0, got {int(bad.sum())} bad value(s) in the array "
            f"(first: {float(arr[i])!r} at index {i})"
        )
    arr.setflags(write=False)
    return arr


def _out(arr: NDArray[np.float64]) -> FloatOrArray:
    """Results and parameters: a numpy float (a ``float``) for 0-d ones, the array otherwise."""
    arr = np.asarray(arr, dtype=np.float64)
    return arr[()] if arr.ndim == 0 else arr


class _CosineLaw:
    """Shared machinery: parameter shape, dimension, broadcasting of inputs against per-query parameters.

    A law implements ``_logpdf`` (on x clipped to [-1, 1]), ``_cdf`` and ``_ppf`` on inputs aligned by :meth:`align`
    (parameters reshaped to its ``pshape``)."""

    _shape: tuple[int, ...]
    _dim: int | None

    def __init__(self, dim: int | None) -> None:
        self._dim = positive_int("dim", dim, allow_none=True, minimum=2)

    @property
    def dim(self) -> int | None:
        """Embedding dimension n of Appendix A's sphere-corrected law; ``None``: the 1-D law of Sec. 3.2."""
        return self._dim

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the parameters: ``()`` for a single law, ``(Q,)`` for one law per query."""
        return self._shape

    @property
    def n_queries(self) -> int | None:
        """Number of per-query laws Q, or ``None`` when the parameters are scalars."""
        return self._shape[0] if self._shape else None

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError(f"{type(self).__name__} with scalar parameters has no len(); see n_queries")
        return self._shape[0]

    @property
    def _m(self) -> float:
        """Exponent (n - 3) / 2 of the sphere factor (1 - x^2)^m (Eq. 4); 0 for the 1-D law."""
        return 0.0 if self._dim is None else (self._dim - 3) / 2.0

    def align(self, values: ArrayLike, name: str) -> _Aligned:
        """``(values as a float array, the shape the parameters take to broadcast against it)``: scalar parameters as
        numpy; Q per-query parameters accept a scalar, (Q,) or (Q, K, ...) (leading axis = queries), else a ValueError
        naming ``name``."""
        try:
            v = np.asarray(values, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name} must be a number or an array of numbers, got {values!r}") from exc
        if not self._shape:
            return v, ()
        q = self._shape[0]
        if v.ndim == 0:
            return np.broadcast_to(v, (q,)), (q,)
        if v.shape[0] != q:
            raise ValueError(
                f"mismatched dimensions: {name} has shape {v.shape} but the distribution has {q} per-query "
                f"parameters (shape ({q},)); pass a scalar, an array of shape ({q},) or of shape ({q}, K)"
            )
        return v, (q,) + (1,) * (v.ndim - 1)

    def _checked(self, values: ArrayLike, name: str, ok: Callable, rule: str) -> _Aligned:
        """:meth:`align`, then a ValueError ``f"{name} must {rule}"`` unless ``ok(values)`` holds everywhere."""
        v, pshape = self.align(values, name)
        if not np.all(ok(v)):
            raise ValueError(f"{name} must {rule}")
        return v, pshape

    def _finite(self, values: ArrayLike, name: str) -> _Aligned:
        return self._checked(values, name, np.isfinite, "be finite (got nan or inf)")

    def logpdf(self, x: ArrayLike) -> FloatOrArray:
        """Log density of the cosine at ``x`` (-inf outside [-1, 1])."""
        v, pshape = self._finite(x, "x")
        out = self._logpdf(np.clip(v, -1.0, 1.0), pshape)
        return _out(np.where((v >= -1.0) & (v <= 1.0), out, -np.inf))

    def pdf(self, x: ArrayLike) -> FloatOrArray:
        """Density of the cosine at ``x`` (0 outside [-1, 1])."""
        return np.exp(self.logpdf(x))

    def cdf(self, t: ArrayLike) -> FloatOrArray:
        """F_q(t) = P(x <= t) (Sec. 3.2.1 / 3.2.2; Eq. 4 with ``dim``): 0 below -1, 1 above 1; shapes: :meth:`align`."""
        v, pshape = self._finite(t, "t")
        return _out(np.clip(self._cdf(v, pshape), 0.0, 1.0))

    def ppf(self, q: ArrayLike) -> FloatOrArray:
        """Quantile function F_q^{-1}(q) for ``q`` in [0, 1], ppf(0) = -1, ppf(1) = 1; shapes as in :meth:`cdf`."""
        v, pshape = self._checked(q, "q", lambda v: (v >= 0.0) & (v <= 1.0), "lie in [0, 1] (and not be nan)")
        out = np.clip(self._ppf(v, pshape), -1.0, 1.0)
        return _out(np.where(v == 0.0, -1.0, np.where(v == 1.0, 1.0, out)))

    def cutoff(self, p: ArrayLike) -> FloatOrArray:
        """Per-query threshold ``t_q = ppf(1 - p)``, so ``P(x >= t_q) = p`` (Sec. 4.4.2): a larger ``p`` in (0, 1) keeps
        more items (Table 3)."""
        inside = "lie strictly inside (0, 1): it is the share of the relevant-item law kept"
        v, _ = self._checked(p, "p", lambda v: (v > 0.0) & (v < 1.0), inside)  # also rejects nan
        return self.ppf(1.0 - v)


def _fmt(arr: NDArray[np.float64]) -> str:
    if arr.ndim == 0:
        return repr(float(arr))
    if arr.size <= 6:
        return "array([" + ", ".join(f"{v:.6g}" for v in arr) + "])"
    return f"array of {arr.size} values in [{arr.min():.6g}, {arr.max():.6g}]"


# ---- ExpNCE: truncated exponential law -----------------------------------------------------------------


def _exp_cdf_1d(t: NDArray[np.float64], tau: NDArray[np.float64]) -> NDArray[np.float64]:
    """(e^{t/tau} - e^{-1/tau}) / (e^{1/tau} - e^{-1/tau}) (Sec. 3.2.1), overflow-free for any tau > 0."""
    t = np.clip(t, -1.0, 1.0)
    return np.exp((t - 1.0) / tau) * np.expm1(-(t + 1.0) / tau) / np.expm1(-2.0 / tau)


def _exp_ppf_1d(q: NDArray[np.float64], tau: NDArray[np.float64]) -> NDArray[np.float64]:
    """Inverse of :func:`_exp_cdf_1d`: 1 + tau log(q + (1 - q) e^{-2/tau}), via log-sum-exp for tau < 1, else log1p."""
    with np.errstate(divide="ignore", invalid="ignore"):
        small = np.logaddexp(np.log(q), np.log1p(-q) - 2.0 / tau)
        large = np.log1p((1.0 - q) * np.expm1(-2.0 / tau))
    return 1.0 + tau * np.where(tau < 1.0, small, large)


def _log_cosh(s: NDArray[np.float64]) -> NDArray[np.float64]:
    a = np.abs(s)
    return a + np.log1p(np.exp(-2.0 * a)) - _LOG2


def _bsearch(edges: NDArray[np.float64], rows: NDArray[np.intp], v: NDArray[np.float64]) -> NDArray[np.intp]:
    """Per point i the largest j in [0, P - 1] with ``edges[rows[i], j] <= v[i]`` (0 if none), vectorised."""
    lo = np.zeros(v.shape, dtype=np.intp)
    hi = np.full(v.shape, edges.shape[1] - 1, dtype=np.intp)
    while True:
        active = hi - lo > 1
        if not active.any():
            return lo
        mid = (lo + hi) // 2
        below = edges[rows, mid] <= v
        lo = np.where(active & below, mid, lo)
        hi = np.where(active & ~below, mid, hi)


class _ExpSphereQuadrature:
    """CDF and quantiles of the density ~ exp(x / tau) (1 - x^2)^m on [-1, 1], m >= -1/2 (Appendix A, m = (n - 3) / 2):
    Gauss-Legendre panels in s = artanh(x) either side of the mode, quantiles by safeguarded Newton (``docs/pebr.md``).
    """

    def __init__(
        self, tau: NDArray[np.float64], m: float, n_panels: int = 64, order: int = 20, level: float = 60.0
    ) -> None:
        if m < -0.5:
            raise ValueError("the sphere factor exponent m must be >= -1/2")
        tau = np.asarray(tau, dtype=np.float64).reshape(-1)
        self.tau, self.m, self.k2 = tau, float(m), 2.0 * float(m) + 2.0
        half = n_panels // 2
        self.n_panels = 2 * half
        nodes, weights = np.polynomial.legendre.leggauss(order)
        self._u = (nodes + 1.0) / 2.0  # nodes on [0, 1]
        self._w = weights / 2.0  # weights on [0, 1]

        # mode s* of G and the curvature scale there: G''(s*) = -(2m + 2)(1 + x*^2)
        c = (self.m + 1.0) * tau
        r = np.hypot(c, 1.0)
        x_star = 1.0 / (c + r)
        with np.errstate(divide="ignore"):
            s_small_c = 0.5 * (np.log(c + r + 1.0) - np.log(c) - np.log1p(c / (r + 1.0)))
        s_star = np.where(c >= 0.5, np.arctanh(np.minimum(x_star, 0.5)), s_small_c)
        self.s_star, self.g_star = s_star, self._g(s_star, tau)
        sigma = 1.0 / np.sqrt(self.k2 * (1.0 + x_star * x_star))

        s_lo, s_hi = self._crossing(-1.0, sigma, level), self._crossing(+1.0, sigma, level)
        self.s_lo, self.s_hi = s_lo, s_hi
        frac = np.linspace(0.0, 1.0, half + 1)
        left = s_lo[:, None] + (s_star - s_lo)[:, None] * frac[None, :]
        right = s_star[:, None] + (s_hi - s_star)[:, None] * frac[None, :]
        left[:, -1] = s_star
        right[:, -1] = s_hi
        self.edges = np.concatenate([left, right[:, 1:]], axis=1)  # (R, P + 1)

        # panel masses of exp(G - G*), by chunks of rows to bound memory
        masses = np.empty((tau.size, self.n_panels))
        step = max(1, 2**20 // (self.n_panels * order))
        for i in range(0, tau.size, step):
            edges = self.edges[i : i + step]
            masses[i : i + step] = self._partial(np.arange(i, i + len(edges))[:, None], edges[:, :-1], edges[:, 1:])
        cum = np.zeros((tau.size, self.n_panels + 1))
        np.cumsum(masses, axis=1, out=cum[:, 1:])
        self.total = cum[:, -1].copy()
        self.cum = cum / self.total[:, None]
        self.cum[:, -1] = 1.0

    def _g(self, s: NDArray[np.float64], tau: NDArray[np.float64]) -> NDArray[np.float64]:
        """G(s) = (tanh s - 1) / tau - (2m + 2) log cosh s, with tanh s - 1 = -2 expit(-2 s)."""
        return -2.0 * special.expit(-2.0 * s) / tau - self.k2 * _log_cosh(s)

    def _crossing(self, direction: float, sigma: NDArray[np.float64], level: float) -> NDArray[np.float64]:
        """The point on the ``direction`` side of s* where G - G* = -level (G is unimodal)."""
        tau, s0, g0 = self.tau, self.s_star, self.g_star
        step = np.maximum(sigma, 1e-8)
        for _ in range(200):
            beyond = self._g(s0 + direction * step, tau) - g0 <= -level
            if beyond.all():
                break
            step = np.where(beyond, step, 2.0 * step)
        inner, outer = np.zeros_like(step), step
        for _ in range(60):
            mid = 0.5 * (inner + outer)
            above = self._g(s0 + direction * mid, tau) - g0 > -level
            inner = np.where(above, mid, inner)
            outer = np.where(above, outer, mid)
        return s0 + direction * outer

    def _partial(self, rows: NDArray[np.intp], a: NDArray[np.float64], s: NDArray[np.float64]) -> NDArray:
        """int_a^s exp(G - G*) by one Gauss-Legendre rule on [a, s] (one panel); ``rows`` broadcast to a's shape."""
        h = s - a
        pts = a[..., None] + h[..., None] * self._u
        vals = np.exp(self._g(pts, self.tau[rows][..., None]) - self.g_star[rows][..., None])
        return h * (vals @ self._w)

    def log_norm(self) -> NDArray[np.float64]:
        """log int_{-1}^1 exp((x - 1) / tau) (1 - x^2)^m dx per row."""
        return self.g_star + np.log(self.total)

    def cdf(self, rows: NDArray[np.intp], t: NDArray[np.float64]) -> NDArray[np.float64]:
        with np.errstate(divide="ignore"):
            s = np.arctanh(np.clip(t, -1.0, 1.0))  # t >= 1: inf
        out = np.where(s >= self.s_hi[rows], 1.0, 0.0)
        idx = np.flatnonzero((s > self.s_lo[rows]) & (s < self.s_hi[rows]))
        for i in range(0, idx.size, 2**16):
            sel = idx[i : i + 2**16]
            r, si = rows[sel], s[sel]
            j = _bsearch(self.edges, r, si)
            val = self.cum[r, j] + self._partial(r, self.edges[r, j], si) / self.total[r]
            out[sel] = np.minimum(val, self.cum[r, j + 1])
        return out

    def ppf(self, rows: NDArray[np.intp], q: NDArray[np.float64]) -> NDArray[np.float64]:
        out = np.where(q >= 1.0, 1.0, -1.0)
        idx = np.flatnonzero((q > 0.0) & (q < 1.0))
        for i in range(0, idx.size, 2**16):
            sel = idx[i : i + 2**16]
            out[sel] = np.tanh(self._ppf_s(rows[sel], q[sel]))
        return out

    def _ppf_s(self, rows: NDArray[np.intp], q: NDArray[np.float64]) -> NDArray[np.float64]:
        j = _bsearch(self.cum, rows, q)
        a, b = self.edges[rows, j], self.edges[rows, j + 1]
        mass = (self.cum[rows, j + 1] - self.cum[rows, j]) * self.total[rows]
        target = np.clip((q - self.cum[rows, j]) * self.total[rows], 0.0, mass)
        with np.errstate(divide="ignore", invalid="ignore"):
            s = a + (b - a) * np.where(mass > 0, target / mass, 0.5)
        lo, hi = a.copy(), b.copy()
        active = np.arange(q.size)
        for _ in range(100):
            if active.size == 0:
                break
            ra, sa = rows[active], s[active]
            f = self._partial(ra, a[active], sa) - target[active]
            dens = np.exp(self._g(sa, self.tau[ra]) - self.g_star[ra])
            lo[active] = np.where(f < 0, sa, lo[active])
            hi[active] = np.where(f > 0, sa, hi[active])
            with np.errstate(divide="ignore", invalid="ignore"):
                new = sa - f / dens
            bad = ~((new > lo[active]) & (new < hi[active]))
            new = np.where(bad, 0.5 * (lo[active] + hi[active]), new)
            new = np.where(f == 0, sa, new)
            tol = 4e-15 * (1.0 + np.abs(sa))
            done = (np.abs(new - sa) <= tol) | (hi[active] - lo[active] <= tol)
            s[active] = new
            active = active[~done]
        return s


class ExpCosine(_CosineLaw):
    """Truncated exponential law of the cosine (ExpNCE, Sec. 3.2.1), temperature ``tau`` > 0 scalar or one per query.

    ``dim=None``: density ``exp(x / tau) / (tau (e^{1/tau} - e^{-1/tau}))`` on [-1, 1], CDF and inverse overflow-free.
    ``dim=n >= 2``: Appendix A's law (Eq. 4), ~ ``exp(x / tau) (1 - x^2)^((n - 3) / 2)`` (vMF cosine marginal); n = 3 is
    closed form, other n use :class:`_ExpSphereQuadrature` (built on first use)."""

    def __init__(self, tau: ArrayLike, dim: int | None = None) -> None:
        super().__init__(dim)
        self._tau = _as_param(tau, "tau")
        self._shape = self._tau.shape

    @property
    def tau(self) -> FloatOrArray:
        """Temperature(s) tau_q."""
        return _out(self._tau)

    def __repr__(self) -> str:
        return f"ExpCosine(tau={_fmt(self._tau)}, dim={self._dim})"

    @property
    def _closed_form(self) -> bool:
        return self._dim is None or self._dim == 3

    @cached_property
    def _table(self) -> _ExpSphereQuadrature:
        return _ExpSphereQuadrature(self._tau.reshape(-1), self._m)

    def _apply(self, v: NDArray[np.float64], pshape: tuple[int, ...], closed_form: Callable, table: str) -> NDArray:
        """``closed_form(v, tau)``, else the quadrature table's ``table`` method on every value of ``v`` (aligned by
        :meth:`align`) with its row."""
        if self._closed_form:
            return closed_form(v, self._tau.reshape(pshape))
        if not self._shape:
            rows = np.zeros(v.size, dtype=np.intp)
        else:
            rows = np.repeat(np.arange(self._shape[0]), v.size // self._shape[0] if self._shape[0] else 0)
        return getattr(self._table, table)(rows, np.ascontiguousarray(v).reshape(-1)).reshape(v.shape)

    def _logpdf(self, x: NDArray[np.float64], pshape: tuple[int, ...]) -> NDArray[np.float64]:
        tau = self._tau.reshape(pshape)
        if self._closed_form:
            return (x - 1.0) / tau - np.log(tau) - np.log(-np.expm1(-2.0 / tau))
        log_norm = self._table.log_norm().reshape(pshape) if self._shape else self._table.log_norm()[0]
        with np.errstate(divide="ignore"):
            return (x - 1.0) / tau + self._m * (np.log1p(x) + np.log1p(-x)) - log_norm

    def _cdf(self, t: NDArray[np.float64], pshape: tuple[int, ...]) -> NDArray[np.float64]:
        return self._apply(t, pshape, _exp_cdf_1d, "cdf")

    def _ppf(self, q: NDArray[np.float64], pshape: tuple[int, ...]) -> NDArray[np.float64]:
        return self._apply(q, pshape, _exp_ppf_1d, "ppf")


# ---- BetaNCE: Beta law on [-1, 1] ----------------------------------------------------------------------


class BetaCosine(_CosineLaw):
    """Beta law of the cosine moved to [-1, 1] (BetaNCE, Sec. 3.2.2); ``alpha``, ``beta`` > 0 scalars or one per query.

    ``dim=None``: z = (1 + x) / 2 ~ Beta(alpha, beta) (after BetaNCE alpha = 1 / tau_q, beta = 1, Eq. 3:
    :meth:`from_temperature`). ``dim=n >= 2`` (Eq. 4): z ~ Beta(alpha + (n - 3) / 2, beta + (n - 3) / 2)
    (:attr:`z_params`; n = 2 needs alpha, beta > 1/2)."""

    def __init__(self, alpha: ArrayLike, beta: ArrayLike = 1.0, dim: int | None = None) -> None:
        super().__init__(dim)
        self._alpha, self._beta = _as_param(alpha, "alpha"), _as_param(beta, "beta")
        a_shape, b_shape = self._alpha.shape, self._beta.shape
        if len(a_shape) == 1 and len(b_shape) == 1 and a_shape != b_shape:
            raise ValueError(f"mismatched dimensions: alpha has shape {a_shape} but beta has shape {b_shape}")
        self._shape = np.broadcast_shapes(a_shape, b_shape)
        self._a, self._b = (np.array(np.broadcast_to(p + self._m, self._shape)) for p in (self._alpha, self._beta))
        for name, eff in (("alpha", self._a), ("beta", self._b)):
            if np.any(eff <= 0):
                raise ValueError(
                    f"{name} must be > {-self._m:g} for dim={self._dim}: the law of z is Beta({name} + (n - 3) / 2)"
                )
            eff.setflags(write=False)

    @classmethod
    def from_temperature(cls, tau: ArrayLike, dim: int | None = None) -> BetaCosine:
        """The law BetaNCE training leaves for a learned temperature: alpha = 1 / tau_q, beta = 1 (Eq. 3)."""
        return cls(1.0 / _as_param(tau, "tau"), 1.0, dim=dim)

    @property
    def alpha(self) -> FloatOrArray:
        """alpha parameter(s) of the law h (as given, before the sphere correction)."""
        return _out(self._alpha)

    @property
    def beta(self) -> FloatOrArray:
        """beta parameter(s) of the law h (as given, before the sphere correction)."""
        return _out(self._beta)

    @property
    def z_params(self) -> tuple[FloatOrArray, FloatOrArray]:
        """(a, b) with z = (1 + x) / 2 ~ Beta(a, b): (alpha, beta) + (n - 3) / 2, or (alpha, beta) if 1-D."""
        return _out(self._a), _out(self._b)

    def __repr__(self) -> str:
        return f"BetaCosine(alpha={_fmt(self._alpha)}, beta={_fmt(self._beta)}, dim={self._dim})"

    def _logpdf(self, x: NDArray[np.float64], pshape: tuple[int, ...]) -> NDArray[np.float64]:
        a, b = self._a.reshape(pshape), self._b.reshape(pshape)
        with np.errstate(divide="ignore", invalid="ignore"):
            out = special.xlogy(a - 1.0, (1.0 + x) / 2.0) + special.xlogy(b - 1.0, (1.0 - x) / 2.0)
            return out - special.betaln(a, b) - _LOG2

    def _cdf(self, t: NDArray[np.float64], pshape: tuple[int, ...]) -> NDArray[np.float64]:
        a, b = self._a.reshape(pshape), self._b.reshape(pshape)
        tc = np.clip(t, -1.0, 1.0)
        z, w = (1.0 + tc) / 2.0, (1.0 - tc) / 2.0
        with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
            out = special.betainc(a, b, z)
            out = np.where(a == 1.0, -np.expm1(b * np.log(w)), out)
            out = np.where(b == 1.0, np.exp(a * np.log(z)), out)
        return np.where(t <= -1.0, 0.0, np.where(t >= 1.0, 1.0, out))

    def _ppf(self, q: NDArray[np.float64], pshape: tuple[int, ...]) -> NDArray[np.float64]:
        a, b = self._a.reshape(pshape), self._b.reshape(pshape)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
            lower = 2.0 * special.betaincinv(a, b, q) - 1.0  # accurate near x = -1
            upper = 1.0 - 2.0 * special.betaincinv(b, a, 1.0 - q)  # accurate near x = 1
            out = np.where(q <= 0.5, lower, upper)
            out = np.where(a == 1.0, -1.0 - 2.0 * np.expm1(np.log1p(-q) / b), out)
            out = np.where(b == 1.0, 1.0 + 2.0 * np.expm1(np.log(q) / a), out)
        return out
