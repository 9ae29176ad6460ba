"""Tests of pyterrier_prob.pebr.calibration: calibrated per-query cosine laws (issue #13), PIT, likelihood-ratio cutoff.

All data are synthetic: relevant cosines drawn from a known log-linear Beta law (the model of CalibratedLaw)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import optimize, special, stats

from pyterrier_prob.pebr import calibration as cal
from pyterrier_prob.pebr.calibration import (
    CalibratedLaw,
    beta_mle_laws,
    likelihood_ratio_cutoff,
    mean_log_density,
    model_law,
    pit_summary,
    pit_values,
)
from st_extensions.distributions import BetaCosine, ExpCosine

# true coefficients on phi = [1, log theta...] for log(a - m+), log(b - m+)
TRUE = {
    "beta": (np.array([1.0, -0.5]), np.array([0.5, 0.3])),
    "exp": (np.array([1.0, -0.5]), np.array([0.5, 0.3])),
    "beta_mle": (np.array([0.5, 0.6, -0.2]), np.array([0.3, 0.1, 0.4])),
}


def synthetic(family: str, n_queries: int, seed: int, dim: int | None = None, max_rel: int = 20):
    """(params, relevant cosine lists, true z-parameters a, b) from the log-linear Beta law with TRUE coefficients."""
    rng = np.random.default_rng(seed)
    if family == "beta_mle":
        params = np.exp(rng.uniform(np.log([1.0, 0.5, 0.5, 0.5]), np.log([30.0, 5.0, 5.0, 5.0]), (n_queries, 4)))
        theta = np.log(params[:, :2])
    else:
        params = np.exp(rng.uniform(math.log(0.02), math.log(0.3), (n_queries, 1)))
        theta = np.log(params)
    x = np.concatenate([np.ones((n_queries, 1)), theta], axis=1)
    off = 0.0 if dim is None else max((dim - 3) / 2, 0.0)
    wa, wb = TRUE[family]
    a, b = np.exp(x @ wa) + off, np.exp(x @ wb) + off
    counts = rng.integers(1, max_rel + 1, n_queries)
    rel = [2.0 * rng.beta(a[i], b[i], counts[i]) - 1.0 for i in range(n_queries)]
    return params, rel, a, b


# ---------------------------------------------------------------------------------------------------------
# maximum likelihood fit
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("weighting", ["query", "pair"])
@pytest.mark.parametrize(("family", "dim"), [("beta", None), ("exp", None), ("beta_mle", None), ("beta", 9)])
def test_mle_recovers_known_coefficients(family, dim, weighting):
    """3000 queries, 1-20 relevant documents each (~31k pairs). The sandwich standard errors are ~0.01-0.13 here
    (asserted, so the check has teeth), and test_stderr_matches_spread_over_seeds checks they are honest; a
    correct estimator is within 4 SE of the truth per coefficient except with probability 6e-5 (normal tail)."""
    params, rel, _, _ = synthetic(family, 3000, seed=1, dim=dim)
    fit = CalibratedLaw(family, dim=dim, weighting=weighting).fit(params, rel)
    assert fit.converged_
    wa, wb = TRUE[family]
    for est, se, true in ((fit.coef_a_, fit.stderr_a_, wa), (fit.coef_b_, fit.stderr_b_, wb)):
        assert np.all(se < 0.15), se
        assert np.all(np.abs(est - true) <= 4 * se), (est, true, se)
    names = fit.coefficients().index.tolist()
    assert names[0] == "1" and names[1] in ("log tau", "log alpha+")


def test_stderr_matches_spread_over_seeds():
    """The sandwich standard errors match the spread of the estimates over 40 independent data sets: with 40 seeds
    the sample SD of each coefficient has relative error ~ 1/sqrt(2 * 39) = 11%, so a factor [0.7, 1.4] is ~3 SD."""
    est, ses = [], []
    for seed in range(40):
        params, rel, _, _ = synthetic("beta", 400, seed=100 + seed, max_rel=8)
        fit = CalibratedLaw("beta").fit(params, rel)
        est.append(np.concatenate([fit.coef_a_, fit.coef_b_]))
        ses.append(np.concatenate([fit.stderr_a_, fit.stderr_b_]))
    ratio = np.std(est, axis=0, ddof=1) / np.mean(ses, axis=0)
    assert np.all((ratio > 0.7) & (ratio < 1.4)), ratio


def test_extra_features_and_constant_feature():
    params, rel, _, _ = synthetic("beta", 2000, seed=2)
    rng = np.random.default_rng(3)
    f = rng.normal(size=2000)
    # add an effect of f on a: redraw with log a += 0.4 f
    x = np.c_[np.ones(2000), np.log(params[:, 0])]
    a, b = np.exp(x @ TRUE["beta"][0] + 0.4 * f), np.exp(x @ TRUE["beta"][1])
    rel = [2 * rng.beta(a[i], b[i], len(rel[i])) - 1 for i in range(2000)]
    feats = pd.DataFrame({"f": f, "const": 3.0})
    fit = CalibratedLaw("beta").fit(params, rel, features=feats)
    tab = fit.coefficients()
    assert tab.index.tolist() == ["1", "log tau", "f", "const"]
    assert abs(tab.loc["f", "a"] - 0.4) <= 4 * tab.loc["f", "a_stderr"]
    assert abs(tab.loc["f", "b"]) <= 4 * tab.loc["f", "b_stderr"]
    assert fit.constant_features_ == ["const"]
    assert tab.loc["const", "a"] == 0 and math.isnan(tab.loc["const", "a_stderr"])
    law = fit.law(params, features=feats)
    assert isinstance(law, BetaCosine) and law.n_queries == 2000
    with pytest.raises(ValueError, match="differ from those of the fit"):
        fit.law(params)


def test_loglik_is_scipy_beta_and_matches_law_logpdf():
    """loglik_ (scipy.stats.beta.logpdf) equals the mean BetaCosine.logpdf of the law, and the fit beats the truth
    on its own data only by a little (it is the maximum) and the model's own law (Eq. 3) clearly."""
    params, rel, a, b = synthetic("beta", 1500, seed=4)
    fit = CalibratedLaw("beta", weighting="pair").fit(params, rel)
    assert fit.loglik_ == pytest.approx(mean_log_density(fit.law(params), rel, weighting="pair"), rel=1e-10)
    truth = mean_log_density(BetaCosine(a, b), rel, weighting="pair")
    assert truth <= fit.loglik_ < truth + 0.01
    assert mean_log_density(model_law(params, "beta"), rel, weighting="pair") < fit.loglik_ - 0.03


def test_sphere_geometry_law_and_low_dims():
    """dim=n: law() is BetaCosine(dim=n) whose z-parameters are the fitted a_q, b_q; dim 2 and 3 equal the line fit."""
    params, rel, a, b = synthetic("beta", 1500, seed=5, dim=9)
    fit = CalibratedLaw("beta", dim=9).fit(params, rel)
    law = fit.law(params)
    assert law.dim == 9
    za, zb = law.z_params
    assert np.all(za > 3) and np.all(zb > 3)  # m = 3
    assert np.median(np.abs(za / a - 1)) < 0.05 and np.median(np.abs(zb / b - 1)) < 0.05
    params, rel, _, _ = synthetic("beta", 500, seed=6)
    line = CalibratedLaw("beta").fit(params, rel)
    for dim in (2, 3):
        other = CalibratedLaw("beta", dim=dim).fit(params, rel)
        np.testing.assert_allclose(other.coef_a_, line.coef_a_, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(other.law(params).z_params, line.law(params).z_params, rtol=1e-5)
        assert other.law(params).cdf(0.5) == pytest.approx(line.law(params).cdf(0.5), rel=1e-5)


def test_frame_params_and_include_negative():
    params, rel, _, _ = synthetic("beta_mle", 800, seed=7)
    frame = pd.DataFrame(params, columns=["query_alpha", "query_beta", "query_alpha_neg", "query_beta_neg"])
    a = CalibratedLaw("beta_mle").fit(frame, rel)
    b = CalibratedLaw("beta_mle").fit(params, rel)
    np.testing.assert_allclose(a.coef_a_, b.coef_a_)
    c = CalibratedLaw("beta_mle", include_negative=True).fit(params, rel)
    assert c.feature_names_ == ["1", "log alpha+", "log beta+", "log alpha-", "log beta-"]
    assert np.all(np.abs(c.coef_a_[3:]) <= 4 * c.stderr_a_[3:])  # no effect in the data


# ---------------------------------------------------------------------------------------------------------
# PIT
# ---------------------------------------------------------------------------------------------------------


def test_pit_uniform_under_fitted_law_not_under_wrong_law():
    """Held-out queries of the same law (~10.5k pairs): under the fitted law the PIT is as uniform as under the true
    law -- the KS distance D exceeds the true law's by at most 0.008 (estimation error from 2000 training queries
    moves the PIT by ~0.005) and the p-value is not tiny (> 1e-3; under the null it is uniform, and for this fixed
    seed the *true* law's is 0.01 by chance) -- and the tails hold ~1% each; under the head's own law (alpha =
    1/tau, beta = 1, Eq. 3) and under a law shifted by 0.05 in cosine the KS test rejects overwhelmingly."""
    params, rel, _, _ = synthetic("beta", 2000, seed=8)
    fit = CalibratedLaw("beta").fit(params, rel)
    test_params, test_rel, a, b = synthetic("beta", 1000, seed=9)
    s = pit_summary(pit_values(fit.law(test_params), test_rel))
    true = pit_summary(pit_values(BetaCosine(a, b), test_rel))
    assert s["n"] == sum(len(r) for r in test_rel)
    assert s["ks_pvalue"] > 1e-3 and s["ks_statistic"] < true["ks_statistic"] + 0.008
    assert 0.005 < s["below_tail"] < 0.02 and 0.005 < s["above_tail"] < 0.02
    assert abs(s["central_90"] - 0.9) < 0.01 and abs(s["mean"] - 0.5) < 0.01
    wrong = pit_summary(pit_values(model_law(test_params, "beta"), test_rel))
    assert wrong["ks_pvalue"] < 1e-10
    shifted = [np.clip(r + 0.05, -1, 1) for r in test_rel]
    assert pit_summary(pit_values(fit.law(test_params), shifted))["ks_pvalue"] < 1e-10


def test_weighted_pit_summary_is_the_summary_of_replicated_values():
    """Integer weights w_i equal replicating value i w_i times (the unweighted summary, KS from scipy); equal weights
    equal no weights; query_weights give every query the total weight 1 / Q."""
    from pyterrier_prob.pebr.calibration import query_weights

    rng = np.random.default_rng(11)
    u = np.round(rng.uniform(size=60), 2)  # ties included
    w = rng.integers(1, 5, size=60)
    weighted = pit_summary(u, weights=w)
    replicated = pit_summary(np.repeat(u, w))
    for key in ("ks_statistic", "mean", "below_tail", "above_tail", "central_50", "central_90"):
        assert weighted[key] == pytest.approx(replicated[key], abs=1e-12), key
    assert np.isnan(weighted["ks_pvalue"])
    assert pit_summary(u, weights=np.ones(60))["ks_statistic"] == pytest.approx(pit_summary(u)["ks_statistic"])
    qw = query_weights([[0.1, 0.2, 0.3], [0.5], [0.0, 0.4]])
    np.testing.assert_allclose(qw, [1 / 3, 1 / 3, 1 / 3, 1.0, 0.5, 0.5])
    with pytest.raises(ValueError, match="weights must be 60 finite values"):
        pit_summary(u, weights=np.ones(59))


def _one(law, i):
    """Query i's law alone."""
    if isinstance(law, ExpCosine):
        return ExpCosine(law.tau[i], dim=law.dim)
    return BetaCosine(law.alpha[i], law.beta[i], dim=law.dim)


def test_pit_values_blocks_match_per_query_cdf(monkeypatch):
    """pit_values evaluates queries in padded blocks; with tiny blocks the values equal per-query cdf calls, for the
    1-D and sphere laws of both families."""
    rng = np.random.default_rng(10)
    rel = [rng.uniform(-0.5, 0.9, k) for k in rng.integers(1, 12, 25)]
    laws = [
        ExpCosine(rng.uniform(0.05, 0.5, 25)),
        ExpCosine(rng.uniform(0.05, 0.5, 25), dim=8),
        BetaCosine(rng.uniform(1, 20, 25), rng.uniform(0.5, 3, 25), dim=16),
    ]
    monkeypatch.setattr(cal, "_PAIR_BLOCK", 30)
    for law in laws:
        expected = np.concatenate([_one(law, i).cdf(r) for i, r in enumerate(rel)])
        np.testing.assert_allclose(pit_values(law, rel), expected, rtol=1e-12, atol=1e-14)
    # one law for all queries (scalar parameters)
    np.testing.assert_allclose(pit_values(BetaCosine(3.0, 2.0), rel), BetaCosine(3.0, 2.0).cdf(np.concatenate(rel)))


# ---------------------------------------------------------------------------------------------------------
# serialisation
# ---------------------------------------------------------------------------------------------------------


def test_to_dict_from_dict_round_trip():
    params, rel, _, _ = synthetic("beta_mle", 600, seed=11)
    feats = {"f": np.linspace(-1, 1, 600), "c": np.ones(600)}  # "c" constant: nan standard errors -> None
    fit = CalibratedLaw("beta_mle", dim=12, weighting="pair").fit(params, rel, features=feats)
    text = json.dumps(fit.to_dict(), allow_nan=False)
    back = CalibratedLaw.from_dict(json.loads(text))
    assert repr(back) == repr(fit)
    np.testing.assert_array_equal(back.coef_a_, fit.coef_a_)
    np.testing.assert_array_equal(back.coef_b_, fit.coef_b_)
    np.testing.assert_array_equal(back.covariance_, fit.covariance_)  # nan where nan
    assert back.feature_names_ == fit.feature_names_ and back.constant_features_ == ["c"]
    assert back.loglik_ == fit.loglik_ and back.n_pairs_ == fit.n_pairs_
    np.testing.assert_array_equal(back.law(params, feats).cutoff(0.9), fit.law(params, feats).cutoff(0.9))
    with pytest.raises(ValueError, match="not a serialised CalibratedLaw"):
        CalibratedLaw.from_dict({"kind": "something else"})
    with pytest.raises(ValueError, match="version"):
        CalibratedLaw.from_dict({**fit.to_dict(), "version": 99})


# ---------------------------------------------------------------------------------------------------------
# likelihood-ratio cutoff
# ---------------------------------------------------------------------------------------------------------


def _brute_force_rising_crossings(ap, bp, an, bn, lam, n_grid=100_001):
    """Per query and level: the grid brackets (u_i, u_{i+1}) where log f+ - log f- rises through lambda, on a grid of
    u = logit(z) over [-36, 36], with the densities from scipy.stats.beta; and whether g >= lambda at the left end."""
    u = np.linspace(-36.0, 36.0, n_grid)
    z = special.expit(u)
    g = stats.beta.logpdf(z[None, :], ap[:, None], bp[:, None]) - stats.beta.logpdf(
        z[None, :], an[:, None], bn[:, None]
    )
    out = []
    for q in range(ap.size):
        row = []
        for level in lam:
            above = g[q] >= level
            rising = np.flatnonzero(~above[:-1] & above[1:])
            row.append(([(u[i], u[i + 1]) for i in rising], bool(above[0])))
        out.append(row)
    return out


def test_likelihood_ratio_cutoff_matches_brute_force_grid():
    rng = np.random.default_rng(12)
    q = 60
    ap, bp, an, bn = np.exp(rng.uniform(np.log(0.3), np.log(40.0), (4, q)))
    lam = np.array([-3.0, 0.0, 2.0])
    rel, irr = BetaCosine(ap, bp), BetaCosine(an, bn)
    t, status = likelihood_ratio_cutoff(rel, irr, np.broadcast_to(lam, (q, 3)), return_status=True)
    assert t.shape == (q, 3) and status.shape == (q, 3)
    brute = _brute_force_rising_crossings(ap, bp, an, bn, lam)
    seen = set()
    for i in range(q):
        for j in range(3):
            crossings, left_above = brute[i][j]
            seen.add(status[i, j])
            if crossings:
                assert len(crossings) == 1 and status[i, j] == "crossing"
                lo, hi = crossings[0]  # in logit(z)
                assert np.tanh(lo / 2) - 1e-12 <= t[i, j] <= np.tanh(hi / 2) + 1e-12, (i, j, t[i, j], crossings)

                # the root of log f+ - log f- = lambda by Brent's method on the bracket, in logit(z) (where the
                # grid lives: x near 1 has too few floats), with the densities from scipy.stats
                def g(u, i=i, j=j):
                    z = special.expit(u)
                    return stats.beta.logpdf(z, ap[i], bp[i]) - stats.beta.logpdf(z, an[i], bn[i]) - lam[j]

                root = optimize.brentq(g, lo, hi, xtol=1e-13)
                assert t[i, j] == pytest.approx(np.tanh(root / 2), abs=1e-10)
            else:
                assert np.isinf(t[i, j]) and status[i, j] != "crossing"
                if t[i, j] == -np.inf:
                    assert left_above and status[i, j] == "all"
    assert {"crossing", "all"} <= seen
    # a larger level never lowers the threshold
    assert np.all(np.diff(np.where(np.isfinite(t), t, np.sign(t) * 2), axis=1) >= 0)


def test_likelihood_ratio_cutoff_cases_and_geometry():
    # increasing ratio: relevant Beta(8, 2) vs irrelevant Beta(2, 2)
    t, s = likelihood_ratio_cutoff(BetaCosine(8.0, 2.0), BetaCosine(2.0, 2.0), 0.0, return_status=True)
    assert s == "crossing" and -1 < t < 1
    # inverted: relevant law below the irrelevant one
    t, s = likelihood_ratio_cutoff(BetaCosine(2.0, 8.0), BetaCosine(8.0, 2.0), 0.0, return_status=True)
    assert s == "inverted" and t == np.inf
    # identical laws: ratio 1 everywhere
    t, s = likelihood_ratio_cutoff(BetaCosine(3.0, 3.0), BetaCosine(3.0, 3.0), [-0.1, 0.1], return_status=True)
    assert list(s) == ["all", "none"] and list(t) == [-np.inf, np.inf]
    # concave (A, B > 0) with a level above the maximum ratio: nothing
    t, s = likelihood_ratio_cutoff(BetaCosine(20.0, 5.0), BetaCosine(2.0, 1.0), 50.0, return_status=True)
    assert s == "none" and t == np.inf
    # sphere geometry: the factor (1 - x^2)^m cancels in the ratio, so the threshold is where the sphere laws'
    # densities cross; from a beta_mle head's parameters
    params = np.array([[8.0, 2.0, 2.0, 2.0], [12.0, 1.5, 1.0, 3.0]])
    rel, irr = beta_mle_laws(params, dim=20)
    t = likelihood_ratio_cutoff(rel, irr, 0.5)
    np.testing.assert_allclose(np.asarray(rel.logpdf(t)) - np.asarray(irr.logpdf(t)), 0.5, atol=1e-8)


# ---------------------------------------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------------------------------------


def test_bad_input_errors_name_the_problem():
    params, rel, _, _ = synthetic("beta", 20, seed=13)
    fit = CalibratedLaw("beta")
    with pytest.raises(ValueError, match="not fitted"):
        fit.law(params)
    with pytest.raises(ValueError, match="mismatched lengths.*19 queries but params have 20"):
        fit.fit(params, rel[:-1])
    with pytest.raises(ValueError, match="query 3 must be finite"):
        fit.fit(params, [r if i != 3 else np.array([0.1, np.nan]) for i, r in enumerate(rel)])
    with pytest.raises(ValueError, match="query 2 must be finite"):
        fit.fit(params, [r if i != 2 else np.array([np.inf]) for i, r in enumerate(rel)])
    with pytest.raises(ValueError, match="query 5 has no relevant cosines"):
        fit.fit(params, [r if i != 5 else [] for i, r in enumerate(rel)])
    with pytest.raises(ValueError, match=r"query 1 must lie in \[-1, 1\]"):
        fit.fit(params, [r if i != 1 else np.array([1.5]) for i, r in enumerate(rel)])
    with pytest.raises(ValueError, match="one array of cosines per query"):
        fit.fit(params, {"q1": [0.1]})
    bad = params.copy()
    bad[4, 0] = -1.0
    with pytest.raises(ValueError, match=r"finite and > 0.*query 4, query_temp"):
        fit.fit(bad, rel)
    with pytest.raises(ValueError, match=r"shape \(queries, 4\)"):
        CalibratedLaw("beta_mle").fit(params, rel)
    with pytest.raises(ValueError, match="lacks the 'beta_mle' parameter column"):
        CalibratedLaw("beta_mle").fit(pd.DataFrame({"query_temp": params[:, 0]}), rel)
    with pytest.raises(ValueError, match="features have 3 rows but params have 20"):
        fit.fit(params, rel, features=np.zeros((3, 1)))
    with pytest.raises(ValueError, match="features must be finite.*query 0, feature 'x0'"):
        fit.fit(params, rel, features=np.full(20, np.nan))
    with pytest.raises(ValueError, match="family must be one of"):
        CalibratedLaw("gauss")
    with pytest.raises(ValueError, match="weighting must be"):
        CalibratedLaw("beta", weighting="doc")
    with pytest.raises(ValueError, match="include_negative needs a beta_mle head"):
        CalibratedLaw("beta", include_negative=True)
    with pytest.raises(ValueError, match="dim must be an int >= 2 or None"):
        CalibratedLaw("beta", dim=1)
    law = model_law(params, "beta")
    with pytest.raises(ValueError, match="has 20 queries but the law has 3 per-query laws"):
        pit_values(BetaCosine(np.ones(3), 1.0), rel)
    with pytest.raises(ValueError, match="law must be an ExpCosine or BetaCosine"):
        pit_values(fit, rel)
    with pytest.raises(ValueError, match=r"PIT values must lie in \[0, 1\]"):
        pit_summary([0.5, 1.2])
    with pytest.raises(ValueError, match="pit is empty"):
        pit_summary([])
    with pytest.raises(ValueError, match="mismatched dimensions: log_ratio"):
        likelihood_ratio_cutoff(law, law, np.zeros(7))
    with pytest.raises(ValueError, match="share the geometry"):
        likelihood_ratio_cutoff(BetaCosine(2.0, 1.0), BetaCosine(2.0, 1.0, dim=8))
    with pytest.raises(ValueError, match="two BetaCosine laws"):
        likelihood_ratio_cutoff(ExpCosine(0.1), BetaCosine(2.0, 1.0))
    with pytest.raises(ValueError, match="log_ratio must not be nan"):
        likelihood_ratio_cutoff(law, law, np.nan)


# ---------------------------------------------------------------------------------------------------------
# plot
# ---------------------------------------------------------------------------------------------------------


def test_pit_plot_writes_png(tmp_path):
    from pyterrier_prob.plots import pit_plot

    params, rel, _, _ = synthetic("beta", 300, seed=14)
    fit = CalibratedLaw("beta").fit(params, rel)
    pits = {"before (model law)": pit_values(model_law(params, "beta"), rel), "after": pit_values(fit.law(params), rel)}
    out = pit_plot(pits, tmp_path / "pit.png")
    data = (tmp_path / "pit.png").read_bytes()
    assert out == str(tmp_path / "pit.png") and data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    with pytest.raises(ValueError, match="non-empty mapping"):
        pit_plot({}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="must be a non-empty array in"):
        pit_plot({"bad": [0.2, np.nan]}, tmp_path / "x.png")
