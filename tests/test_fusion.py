"""Score interpolation with the first stage (pyterrier_prob.fusion): closed forms, the transformer, bad input."""

import numpy as np
import pandas as pd
import pyterrier as pt
import pytest

from pyterrier_prob.fusion import ScoreInterpolation, choose_alpha, interpolate, zscore_per_query


def test_zscore_per_query_closed_form():
    q = ["a", "a", "a", "b", "b", "c"]
    s = [1.0, 2.0, 3.0, 10.0, 10.0, 5.0]
    z = zscore_per_query(q, s)
    sd = np.sqrt(2 / 3)
    np.testing.assert_allclose(z, [-1 / sd, 0.0, 1 / sd, 0.0, 0.0, 0.0])  # constant query and one-row query: 0
    rng = np.random.default_rng(0)
    s2 = rng.normal(size=40) * 7 + 3
    z2 = zscore_per_query(["x"] * 40, s2)
    np.testing.assert_allclose(z2, (s2 - s2.mean()) / s2.std(), rtol=1e-12)
    np.testing.assert_allclose(zscore_per_query(["x"] * 40, 5 * s2 - 2), z2, atol=1e-12)  # scale-free


def test_interpolate_endpoints_and_mix():
    q = ["a"] * 4 + ["b"] * 3
    first = np.array([4.0, 3.0, 2.0, 1.0, 9.0, 8.0, 1.0])
    second = np.array([-1.0, 0.0, 2.0, 1.0, 0.1, 0.3, 0.2])
    np.testing.assert_allclose(interpolate(q, first, second, 0.0), zscore_per_query(q, first))
    np.testing.assert_allclose(interpolate(q, first, second, 1.0), zscore_per_query(q, second))
    mix = interpolate(q, first, second, 0.25)
    np.testing.assert_allclose(mix, 0.25 * zscore_per_query(q, second) + 0.75 * zscore_per_query(q, first))


class _Reverse(pt.Transformer):
    """A re-ranker that scores each candidate by minus its first-stage score (the reverse order)."""

    def transform(self, inp):
        return inp.assign(score=-inp["score"] * 2.0 + 1.0)


def _candidates():
    return pd.DataFrame(
        {
            "qid": ["1"] * 3 + ["2"] * 2,
            "query": ["q one"] * 3 + ["q two"] * 2,
            "docno": ["d1", "d2", "d3", "d1", "d4"],
            "score": [3.0, 2.0, 1.0, 5.0, 4.0],
            "rank": [0, 1, 2, 0, 1],
        }
    )


def test_score_interpolation_transformer():
    cand = _candidates()
    first_only = ScoreInterpolation(_Reverse(), alpha=0.0)(cand)
    assert list(first_only["docno"]) == ["d1", "d2", "d3", "d1", "d4"]
    second_only = ScoreInterpolation(_Reverse(), alpha=1.0)(cand)
    assert list(second_only["docno"]) == ["d3", "d2", "d1", "d4", "d1"]
    assert list(second_only["rank"]) == [0, 1, 2, 0, 1]
    mid = ScoreInterpolation(_Reverse(), alpha=0.3)(cand)
    np.testing.assert_allclose(mid["score"], [0.4 * 1.224744871391589, 0.0, -0.4 * 1.224744871391589, 0.4, -0.4])
    np.testing.assert_allclose(
        mid.set_index(["qid", "docno"]).loc[("1", "d1"), "first_score"], 3.0
    )  # the first stage's score kept
    assert {"first_score", "reranker_score", "query"} <= set(mid.columns)
    assert "alpha=0.3" in repr(ScoreInterpolation(_Reverse(), alpha=0.3))
    empty = ScoreInterpolation(_Reverse(), alpha=0.3)(cand.iloc[:0])
    assert empty.empty


def test_score_interpolation_bad_input():
    with pytest.raises(ValueError, match="alpha"):
        ScoreInterpolation(_Reverse(), alpha=1.5)
    with pytest.raises(ValueError, match="alpha"):
        ScoreInterpolation(_Reverse(), alpha=True)
    with pytest.raises(TypeError, match="Transformer"):
        ScoreInterpolation(lambda x: x, alpha=0.5)
    with pytest.raises(ValueError, match=r"\['score'\]"):
        ScoreInterpolation(_Reverse(), 0.5)(_candidates().drop(columns=["score"]))
    dup = pd.concat([_candidates(), _candidates().iloc[:1]], ignore_index=True)
    with pytest.raises(ValueError, match="occurs twice"):
        ScoreInterpolation(_Reverse(), 0.5)(dup)

    class Drops(pt.Transformer):
        def transform(self, inp):
            return inp.iloc[1:]

    with pytest.raises(ValueError, match="every candidate"):
        ScoreInterpolation(Drops(), 0.5)(_candidates())
    with pytest.raises(ValueError, match="row 1 .*finite"):
        zscore_per_query(["a", "a"], [1.0, np.nan])
    with pytest.raises(ValueError, match="length"):
        zscore_per_query(["a"], [1.0, 2.0])


def test_choose_alpha_picks_the_best_and_the_smaller_on_ties():
    best, values = choose_alpha(lambda a: -((a - 0.3) ** 2))
    assert best == 0.3 and len(values) == 11
    best, _ = choose_alpha(lambda a: 1.0, alphas=(0.5, 0.2, 0.9))
    assert best == 0.2
    with pytest.raises(ValueError, match="empty"):
        choose_alpha(lambda a: 0.0, alphas=())
