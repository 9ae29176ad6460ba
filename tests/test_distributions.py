"""Tests of st_extensions.distributions: the per-query cosine laws of pEBR (Sec. 3.2, Appendix A)."""

from __future__ import annotations

import math
import time
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, special, stats

from st_extensions.distributions import BetaCosine, ExpCosine, _exp_cdf_1d, _ExpSphereQuadrature

TAUS = [0.01, 0.05, 0.3, 1.0, 5.0]
DIMS = [None, 3, 8, 128, 384, 1024]
BETA_PARAMS = [(1.0, 1.0), (3.0, 1.0), (20.0, 1.0), (100.0, 1.0), (0.5, 0.7), (2.5, 7.0), (8.0, 2.0)]

LAWS = [pytest.param(("exp", (tau,), dim), id=f"exp-tau{tau}-dim{dim}") for tau in TAUS for dim in DIMS] + [
    pytest.param(("beta", ab, dim), id=f"beta-{ab[0]}-{ab[1]}-dim{dim}") for ab in BETA_PARAMS for dim in DIMS
]


def make(spec):
    family, params, dim = spec
    return ExpCosine(*params, dim=dim) if family == "exp" else BetaCosine(*params, dim=dim)


# ---------------------------------------------------------------------------------------------------------
# an independent reference: scipy.integrate.quad of the paper's (unnormalised) integrand, Eq. 4
# ---------------------------------------------------------------------------------------------------------


def reference(spec):
    """(log-integrand, breakpoints): the unnormalised log density of Eq. 4 and points around its mass."""
    family, params, dim = spec
    m = 0.0 if dim is None else (dim - 3) / 2
    if family == "exp":
        (tau,) = params
        mode = 1.0 if m <= 0 else -m * tau + math.sqrt(m * m * tau * tau + 1.0)
        sigma = tau if m <= 0 else 1.0 / math.sqrt(2 * m * (1 + mode**2) / (1 - mode**2) ** 2)
        sigma = min(sigma, 0.5)

        def logf(x):
            with np.errstate(divide="ignore"):
                return x / tau + m * np.log1p(-x * x)
    else:
        alpha, beta = params
        a, b = alpha + m, beta + m
        mode = 2 * a / (a + b) - 1  # the mean, in x
        sigma = min(0.5, 2 * math.sqrt(a * b / ((a + b) ** 2 * (a + b + 1))))

        def logf(x):
            with np.errstate(divide="ignore"):
                return (alpha - 1) * np.log((1 + x) / 2) + (beta - 1) * np.log((1 - x) / 2) + m * np.log1p(-x * x)

    pts = mode + sigma * np.array([-40, -20, -10, -6, -3, -2, -1, -0.5, 0, 0.5, 1, 2, 3, 6, 10, 20, 40])
    pts = np.unique(pts[(pts > -1 + 1e-6) & (pts < 1 - 1e-6)])
    grid = np.linspace(-1 + 1e-9, 1 - 1e-9, 20001)
    top = np.max(logf(np.concatenate([grid, pts])))
    return (lambda x: float(np.exp(logf(x) - top))), pts


def quad(f, lo, hi, pts):
    inner = [p for p in pts if lo < p < hi]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", integrate.IntegrationWarning)
        return integrate.quad(f, lo, hi, points=inner or None, limit=1000, epsabs=1e-15, epsrel=1e-12)[0]


# ---------------------------------------------------------------------------------------------------------
# CDF shape, inversion, agreement with quadrature of the paper's integrand
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", LAWS)
def test_cdf_monotone_with_exact_endpoints(spec):
    law = make(spec)
    t = np.concatenate([np.linspace(-1.0, 1.0, 20001), -1 + np.logspace(-15, -1, 50), 1 - np.logspace(-15, -1, 50)])
    t.sort()
    c = law.cdf(t)
    assert np.all(np.isfinite(c))
    assert np.all((c >= 0) & (c <= 1))
    assert np.all(np.diff(c) >= -2 * np.finfo(float).eps)  # up to rounding of scipy's betainc (one ulp)
    if spec[0] == "exp":
        assert np.all(np.diff(c) >= 0)  # exactly monotone
    assert law.cdf(-1.0) == 0.0 and law.cdf(1.0) == 1.0
    assert law.cdf(-1.5) == 0.0 and law.cdf(1.5) == 1.0
    assert c[len(c) // 2] > 0 or law.cdf(0.999) > 0  # not identically zero
    assert law.ppf(0.0) == -1.0 and law.ppf(1.0) == 1.0


@pytest.mark.parametrize("spec", LAWS)
def test_ppf_inverts_cdf(spec):
    law = make(spec)
    t = np.linspace(-1.0, 1.0, 4001)
    c = law.cdf(t)
    keep = (c >= 1e-9) & (c <= 1 - 1e-9)
    assert keep.sum() >= 3
    np.testing.assert_allclose(law.ppf(c[keep]), t[keep], rtol=0, atol=1e-6)
    q = np.sort(np.concatenate([np.logspace(-9, -1, 30), np.linspace(0.1, 0.9, 33), 1 - np.logspace(-9, -1, 30)]))
    x = law.ppf(q)
    assert np.all(np.diff(x) >= 0)
    # F(ppf(q)) = q up to the float spacing of x (near +-1 a law may put more than 1e-11 within one ulp)
    with np.errstate(over="ignore"):
        slack = law.pdf(x) * 4 * np.spacing(np.abs(x))
    assert np.all(np.abs(law.cdf(x) - q) <= 1e-11 + slack)


@pytest.mark.parametrize("spec", LAWS)
def test_cdf_and_pdf_match_quadrature_of_paper_integrand(spec):
    law = make(spec)
    f, pts = reference(spec)
    z = quad(f, -1.0, 1.0, pts)
    ts = np.unique(np.concatenate([law.ppf([1e-4, 0.02, 0.3, 0.5, 0.7, 0.98, 0.9999]), [-0.5, 0.0, 0.5, 0.9]]))
    ref = np.array([quad(f, -1.0, t, pts) / z for t in ts])
    np.testing.assert_allclose(law.cdf(ts), ref, rtol=0, atol=1e-9)  # measured agreement: < 1e-11
    xs = law.ppf([0.05, 0.5, 0.95])
    dens = np.array([f(x) for x in xs]) / z
    np.testing.assert_allclose(law.pdf(xs), dens, rtol=1e-6)
    np.testing.assert_allclose(law.logpdf(xs), np.log(dens), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# closed forms
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tau", [0.1, 0.3, 1.0, 5.0, 50.0])
def test_exp_1d_matches_paper_formula(tau):
    t = np.linspace(-1, 1, 101)
    paper = (np.exp(t / tau) - np.exp(-1 / tau)) / (np.exp(1 / tau) - np.exp(-1 / tau))  # Sec. 3.2.1
    law = ExpCosine(tau)
    np.testing.assert_allclose(law.cdf(t), paper, rtol=1e-12, atol=1e-15)
    q = np.linspace(0, 1, 51)
    np.testing.assert_allclose(law.ppf(q), tau * np.log(q * np.exp(1 / tau) + (1 - q) * np.exp(-1 / tau)), atol=1e-12)
    np.testing.assert_allclose(law.pdf(t), np.exp(t / tau) / (tau * (np.exp(1 / tau) - np.exp(-1 / tau))), rtol=1e-12)
    np.testing.assert_allclose(ExpCosine(tau, dim=3).cdf(t), law.cdf(t), rtol=0, atol=0)  # sphere factor = 1


def test_exp_1d_small_tau_is_stable_and_exact():
    # e^{1/tau} overflows for tau = 1e-3; the law is then ~ 1 - Exp(1/tau) near x = 1
    for tau in [1e-3, 1e-6]:
        law = ExpCosine(tau)
        d = np.array([0.0, tau, 5 * tau, 30 * tau])
        np.testing.assert_allclose(law.cdf(1 - d), np.exp(-d / tau), rtol=1e-9)
        np.testing.assert_allclose(law.ppf([0.5, 1e-3]), 1 + tau * np.log([0.5, 1e-3]), rtol=0, atol=1e-15)
        np.testing.assert_allclose(law.pdf(1.0), 1 / tau, rtol=1e-12)
        assert law.cdf(-1.0) == 0.0 and law.cdf(0.0) == 0.0


@pytest.mark.parametrize("tau", [1e-3, 0.01, 0.3, 5.0, 100.0])
def test_sphere_quadrature_engine_is_exact_on_the_closed_form(tau):
    # m = 0 (dim = 3) has the closed form: the numerical engine used for the other dims must reproduce it
    engine = _ExpSphereQuadrature(np.array([tau]), 0.0)
    t = np.concatenate([np.linspace(-1, 1, 2001), 1 - np.logspace(-14, -1, 40)])
    rows = np.zeros(t.size, dtype=np.intp)
    np.testing.assert_allclose(engine.cdf(rows, t), _exp_cdf_1d(t, np.float64(tau)), rtol=0, atol=1e-13)
    q = np.linspace(0.001, 0.999, 99)
    np.testing.assert_allclose(engine.ppf(np.zeros(q.size, dtype=np.intp), q), ExpCosine(tau).ppf(q), atol=1e-12)


@pytest.mark.parametrize("dim", [4, 8, 128, 384])
@pytest.mark.parametrize("tau", [0.05, 0.3, 1.0, 5.0])
def test_exp_sphere_normaliser_matches_bessel(dim, tau):
    # int_{-1}^1 e^{x/tau} (1 - x^2)^m dx = sqrt(pi) Gamma(m + 1) (2 tau)^(m + 1/2) I_{m + 1/2}(1 / tau)
    m = (dim - 3) / 2
    ive = special.ive(m + 0.5, 1 / tau)
    if not 1e-290 < ive < np.inf:
        pytest.skip("Bessel function out of floating-point range")
    log_z = 0.5 * math.log(math.pi) + special.gammaln(m + 1) + (m + 0.5) * math.log(2 * tau) + math.log(ive) + 1 / tau
    x = np.array([-0.5, 0.0, 0.1, 0.5, 0.9])
    expected = x / tau + m * np.log1p(-x * x) - log_z
    np.testing.assert_allclose(ExpCosine(tau, dim=dim).logpdf(x), expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("dim", [None, 3, 8, 384, 1024])
@pytest.mark.parametrize("alpha", [0.5, 1.0, 3.0, 20.0, 250.0])
def test_beta_matches_closed_forms_and_scipy_stats(alpha, dim):
    m = 0.0 if dim is None else (dim - 3) / 2
    t = np.linspace(-1, 1, 201)
    q = np.linspace(0, 1, 101)
    law = BetaCosine(alpha, 1.0, dim=dim)
    if dim is None:  # beta = 1 closed form: F = z^alpha, z = q^(1 / alpha)
        z = (1 + t) / 2
        np.testing.assert_allclose(law.cdf(t), z**alpha, rtol=1e-13, atol=1e-300)
        np.testing.assert_allclose(law.ppf(q), 2 * q ** (1 / alpha) - 1, rtol=0, atol=1e-13)
    for beta in [1.0, 0.7, 4.0]:
        law = BetaCosine(alpha, beta, dim=dim)
        ref = stats.beta(alpha + m, beta + m, loc=-1, scale=2)
        np.testing.assert_allclose(law.cdf(t), ref.cdf(t), rtol=1e-10, atol=1e-14)
        np.testing.assert_allclose(law.ppf(q[1:-1]), ref.ppf(q[1:-1]), rtol=0, atol=1e-10)
        inner = t[1:-1]
        np.testing.assert_allclose(law.logpdf(inner), ref.logpdf(inner), rtol=1e-10, atol=1e-10)


def test_beta_from_temperature_is_eq3():
    tau = np.array([0.05, 0.2, 1.0])
    law = BetaCosine.from_temperature(tau, dim=384)
    np.testing.assert_allclose(law.alpha, 1 / tau)
    np.testing.assert_allclose(law.beta, 1.0)
    assert law.dim == 384
    a, b = law.z_params
    np.testing.assert_allclose(a, 1 / tau + 190.5)
    np.testing.assert_allclose(b, 191.5)


def test_uniform_special_case():
    t = np.linspace(-1, 1, 11)
    np.testing.assert_allclose(BetaCosine(1.0, 1.0).cdf(t), (t + 1) / 2, atol=1e-15)  # F_{1,1} (Sec. 3.2.2)
    np.testing.assert_allclose(BetaCosine(1.0, 1.0).pdf(t), 0.5, rtol=1e-14)


def test_dim_2_circle():
    # on the circle the cosine of a uniform direction has the arcsine law: F(t) = 1 - arccos(t) / pi
    t = np.linspace(-0.999, 0.999, 101)
    arcsine = 1 - np.arccos(t) / np.pi
    np.testing.assert_allclose(BetaCosine(1.0, 1.0, dim=2).cdf(t), arcsine, atol=1e-13)
    np.testing.assert_allclose(ExpCosine(1e8, dim=2).cdf(t), arcsine, atol=1e-7)
    law = ExpCosine(0.2, dim=2)
    f, pts = reference(("exp", (0.2,), 2))
    z = quad(f, -1, 1, pts)
    for x in [-0.9, 0.0, 0.7, 0.999]:
        assert law.cdf(x) == pytest.approx(quad(f, -1, x, pts) / z, abs=1e-9)


# ---------------------------------------------------------------------------------------------------------
# per-query vectorisation and broadcasting
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", [None, 3, 8, 384])
@pytest.mark.parametrize("family", ["exp", "beta", "beta_scalar_beta"])
def test_vectorised_equals_loop_over_scalar_laws(family, dim):
    rng = np.random.default_rng(0)
    n_q = 7
    tau = rng.uniform(0.01, 2.0, n_q)
    if family == "exp":
        law = ExpCosine(tau, dim=dim)
        single = [ExpCosine(v, dim=dim) for v in tau]
    elif family == "beta":
        alpha, beta = 1 / tau, rng.uniform(0.6, 5.0, n_q)
        law = BetaCosine(alpha, beta, dim=dim)
        single = [BetaCosine(a, b, dim=dim) for a, b in zip(alpha, beta)]
    else:
        law = BetaCosine(1 / tau, 2.0, dim=dim)
        single = [BetaCosine(a, 2.0, dim=dim) for a in 1 / tau]
    assert len(law) == n_q and law.n_queries == n_q and law.shape == (n_q,)

    t_one = rng.uniform(-1, 1, n_q)
    t_many = rng.uniform(-1, 1, (n_q, 5))
    q_many = rng.uniform(0, 1, (n_q, 5))
    expect_scalar = np.array([s.cdf(0.3) for s in single])
    assert law.cdf(0.3).shape == (n_q,)
    np.testing.assert_allclose(law.cdf(0.3), expect_scalar, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(law.cdf(t_one), [s.cdf(v) for s, v in zip(single, t_one)], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(law.cdf(t_many), [s.cdf(row) for s, row in zip(single, t_many)], rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(law.ppf(q_many), [s.ppf(row) for s, row in zip(single, q_many)], rtol=0, atol=1e-13)
    np.testing.assert_allclose(law.pdf(t_many), [s.pdf(row) for s, row in zip(single, t_many)], rtol=1e-12)
    np.testing.assert_allclose(law.cutoff(0.9), [s.cutoff(0.9) for s in single], rtol=0, atol=1e-13)
    assert law.cdf(t_many).shape == (n_q, 5)
    assert law.ppf(0.5).shape == (n_q,)
    # scalar parameters broadcast like numpy, whatever the shape of t
    grid = rng.uniform(-1, 1, (3, 4))
    out = single[0].cdf(grid)
    assert out.shape == (3, 4)
    np.testing.assert_allclose(out, np.vectorize(lambda v: single[0].cdf(v))(grid), rtol=1e-13, atol=1e-15)
    assert np.ndim(single[0].cdf(0.1)) == 0


def test_broadcast_of_q_k_matches_columnwise():
    law = ExpCosine([0.02, 0.1, 0.5], dim=128)
    t = np.linspace(-0.5, 0.9, 12).reshape(3, 4)
    full = law.cdf(t)
    for k in range(4):
        np.testing.assert_allclose(full[:, k], law.cdf(t[:, k]), rtol=1e-14, atol=0)


def test_empty_batch():
    law = ExpCosine(np.array([]), dim=64)
    assert len(law) == 0
    assert law.cdf(0.3).shape == (0,)
    assert law.cutoff(0.5).shape == (0,)


# ---------------------------------------------------------------------------------------------------------
# cutoffs
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [LAWS[i] for i in range(0, len(LAWS), 3)])
def test_cutoff_semantics(spec):
    law = make(spec)
    ps = np.array([0.99, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4])  # Table 3
    cut = np.array([law.cutoff(p) for p in ps])
    assert np.all(np.diff(cut) > 0)  # smaller p, higher threshold, fewer items
    np.testing.assert_array_equal(cut, [law.ppf(1 - p) for p in ps])
    np.testing.assert_allclose(1 - law.cdf(cut), ps, atol=1e-11)  # P(x >= t_q) = p


def test_cutoff_per_query_and_retrieves_more_with_larger_p():
    rng = np.random.default_rng(1)
    tau = rng.uniform(0.02, 0.5, 20)
    for law in [ExpCosine(tau), ExpCosine(tau, dim=384), BetaCosine.from_temperature(tau, dim=384)]:
        hi, lo = law.cutoff(0.99), law.cutoff(0.4)
        assert hi.shape == (20,) and np.all(hi < lo)
        p = rng.uniform(0.05, 0.95, 20)
        np.testing.assert_allclose(law.cutoff(p), law.ppf(1 - p), atol=0)
        np.testing.assert_allclose(1 - law.cdf(law.cutoff(p)), p, atol=1e-11)
    # flatter laws (larger tau) give lower thresholds
    law = ExpCosine(np.sort(tau), dim=384)
    assert np.all(np.diff(law.cutoff(0.9)) < 0)


# ---------------------------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.0, 1.0, -0.1, 1.5, float("nan"), [0.5, 1.0]])
@pytest.mark.parametrize("law", [ExpCosine(0.1), ExpCosine(0.1, dim=8), BetaCosine(5.0, dim=8)], ids=str)
def test_cutoff_rejects_p_outside_open_unit_interval(law, p):
    with pytest.raises(ValueError, match=r"p must lie strictly inside \(0, 1\)"):
        law.cutoff(p)


@pytest.mark.parametrize("q", [-0.1, 1.5, float("nan"), [0.2, 2.0]])
def test_ppf_rejects_q_outside_unit_interval(q):
    with pytest.raises(ValueError, match=r"q must lie in \[0, 1\]"):
        ExpCosine(0.1).ppf(q)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf"), -float("inf")])
def test_rejects_non_finite_or_non_positive_parameters(bad):
    for make_law, name in [
        (lambda v: ExpCosine(v), "tau"),
        (lambda v: ExpCosine([0.1, v, 0.2], dim=8), "tau"),
        (lambda v: BetaCosine(v), "alpha"),
        (lambda v: BetaCosine([1.0, v]), "alpha"),
        (lambda v: BetaCosine(2.0, v), "beta"),
        (lambda v: BetaCosine(2.0, [v, 1.0], dim=16), "beta"),
        (lambda v: BetaCosine.from_temperature(v), "tau"),
    ]:
        with pytest.raises(ValueError, match=f"{name} must be finite and > 0"):
            make_law(bad)


def test_rejects_bad_parameter_shapes():
    with pytest.raises(ValueError, match="tau must be a scalar or a 1-D array"):
        ExpCosine(np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"mismatched dimensions: alpha has shape \(3,\) but beta has shape \(2,\)"):
        BetaCosine(np.ones(3), np.ones(2))
    with pytest.raises(ValueError, match="tau must be"):
        ExpCosine("warm")


@pytest.mark.parametrize("dim", [0, 1, -4, 2.5, 3.0, "384", True])
def test_rejects_bad_dim(dim):
    with pytest.raises(ValueError, match="dim must be an int >= 2 or None"):
        ExpCosine(0.1, dim=dim)
    with pytest.raises(ValueError, match="dim must be an int >= 2 or None"):
        BetaCosine(2.0, dim=dim)


def test_dim_2_beta_needs_alpha_beta_above_half():
    with pytest.raises(ValueError, match=r"alpha must be > 0.5 for dim=2"):
        BetaCosine(0.5, 1.0, dim=2)
    with pytest.raises(ValueError, match=r"beta must be > 0.5 for dim=2"):
        BetaCosine(2.0, [1.0, 0.3], dim=2)
    assert np.isfinite(BetaCosine(0.6, 0.6, dim=2).cdf(0.2))
    assert ExpCosine(0.3, dim=np.int64(2)).dim == 2


@pytest.mark.parametrize(
    "law",
    [ExpCosine(np.full(3, 0.1)), ExpCosine(np.full(3, 0.1), dim=64), BetaCosine(np.full(3, 2.0), 1.0)],
    ids=str,
)
def test_mismatched_dimensions(law):
    for t in [np.zeros(5), np.zeros((4, 2)), np.zeros(1)]:
        with pytest.raises(ValueError, match=rf"mismatched dimensions: t has shape \({t.shape[0]},.*3 per-query"):
            law.cdf(t)
    with pytest.raises(ValueError, match=r"mismatched dimensions: q has shape \(2,\)"):
        law.ppf([0.1, 0.2])
    with pytest.raises(ValueError, match=r"mismatched dimensions: p has shape \(4,\)"):
        law.cutoff(np.full(4, 0.5))
    with pytest.raises(ValueError, match=r"mismatched dimensions: x has shape \(2,\)"):
        law.pdf([0.1, 0.2])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_rejects_non_finite_t_and_x(bad):
    for law in [ExpCosine(0.1), ExpCosine([0.1, 0.2], dim=8), BetaCosine(3.0, 2.0, dim=8)]:
        with pytest.raises(ValueError, match="t must be finite"):
            law.cdf(bad)
        with pytest.raises(ValueError, match="t must be finite"):
            law.cdf(np.array([[0.1, bad], [0.2, 0.3]])[: law.n_queries or 2])
        with pytest.raises(ValueError, match="x must be finite"):
            law.pdf(bad)
        with pytest.raises(ValueError, match="x must be finite"):
            law.logpdf(bad)


# ---------------------------------------------------------------------------------------------------------
# stability and speed
# ---------------------------------------------------------------------------------------------------------


def test_stability_small_tau_large_dim_many_queries():
    rng = np.random.default_rng(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow / invalid-value warnings either
        single = ExpCosine(0.01, dim=1024)
        assert np.isfinite(single.cutoff(0.9)) and -1 < single.cutoff(0.9) < 1
        tau = rng.uniform(0.01, 1.0, 1000)
        start = time.perf_counter()
        law = ExpCosine(tau, dim=1024)
        grid = np.tile(np.linspace(-0.99, 0.99, 50), (1000, 1))
        c = law.cdf(grid)
        cut = law.cutoff(0.95)
        x = law.ppf(rng.uniform(0, 1, 1000))
        dens = law.pdf(grid)
        elapsed = time.perf_counter() - start
    for arr in (c, cut, x, dens):
        assert np.all(np.isfinite(arr))
    np.testing.assert_allclose(law.cdf(cut), 0.05, atol=1e-11)
    assert elapsed < 3.0, elapsed  # typically ~0.1 s


@pytest.mark.parametrize("dim", [None, 2, 3, 4, 1024, 8192])
@pytest.mark.parametrize("tau", [1e-4, 1e-3, 0.01, 10.0, 1e3, 1e6])
def test_extreme_parameters_give_finite_results(tau, dim):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        laws = [ExpCosine(tau, dim=dim)]
        if dim != 2 or 1 / tau > 0.5:
            laws.append(BetaCosine.from_temperature(tau, dim=dim))
        for law in laws:
            q = np.array([1e-6, 0.1, 0.5, 0.9, 1 - 1e-6])
            x = law.ppf(q)
            assert np.all(np.isfinite(x)) and np.all(np.diff(x) >= 0)
            c = law.cdf(np.linspace(-1, 1, 201))
            assert np.all(np.isfinite(c)) and np.all(np.diff(c) >= 0)
            assert np.all(np.isfinite(law.logpdf(np.linspace(-0.99, 0.99, 21))))
            mid = law.ppf(0.5)
            if -1 < mid < 1:  # else the law is narrower than the float spacing near +-1
                assert abs(law.cdf(mid) - 0.5) < 1e-9


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    tau=st.floats(0.005, 20.0),
    dim=st.sampled_from([None, 2, 4, 5, 16, 300, 768, 1024]),
    q=st.floats(1e-6, 1 - 1e-6),
)
def test_property_cdf_of_ppf(tau, dim, q):
    for law in [ExpCosine(tau, dim=dim), BetaCosine(max(1 / tau, 0.6), 1.5, dim=dim)]:
        x = law.ppf(q)
        assert -1 <= x <= 1
        if -1 < x < 1:
            assert law.cdf(x) == pytest.approx(q, abs=1e-10)
        elif x == -1:  # the q-quantile lies within one float spacing of -1 (e.g. Beta with alpha + m = 0.1 on
            assert law.cdf(np.nextafter(-1.0, 0.0)) >= q - 1e-10  # the circle): the next float is past it
        else:
            assert law.cdf(np.nextafter(1.0, 0.0)) <= q + 1e-10


def test_quantile_inside_one_float_spacing_of_minus_one():
    """Beta(alpha + m = 0.1, 1) on the circle puts 1.6% of its mass below z = 2**-60: ppf says -1, cdf(-1) = 0."""
    law = BetaCosine(0.6, 1.5, dim=2)
    assert law.ppf(2.0**-6) == -1.0
    assert law.cdf(np.nextafter(-1.0, 0.0)) == pytest.approx((2.0**-53 / 2) ** 0.1, rel=1e-6)


# ---------------------------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------------------------


def test_properties_and_repr():
    law = ExpCosine([0.1, 0.2], dim=384)
    assert law.dim == 384 and len(law) == 2 and law.n_queries == 2
    np.testing.assert_array_equal(law.tau, [0.1, 0.2])
    assert "ExpCosine" in repr(law) and "dim=384" in repr(law)
    scalar = ExpCosine(0.05)
    assert scalar.tau == 0.05 and scalar.dim is None and scalar.n_queries is None and scalar.shape == ()
    with pytest.raises(TypeError):
        len(scalar)
    beta = BetaCosine(np.linspace(1, 50, 100), 2.0, dim=8)
    assert beta.beta == 2.0 and len(beta) == 100
    assert "BetaCosine" in repr(beta) and "100 values" in repr(beta)
    with pytest.raises(ValueError):  # parameters are read-only
        law.tau[0] = 1.0
