"""The claims file (pyterrier_prob.experiments.claims): paired t-tests on per-query values, rows replaced by key,
written atomically."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from scipy.stats import ttest_rel

from pyterrier_prob.experiments.claims import paired_claim, record_claims, write_claims


def _values(seed: int, shift: float = 0.0) -> dict[str, float]:
    rng = np.random.default_rng(seed)
    return {f"q{i}": float(v) for i, v in enumerate(rng.uniform(0, 1, 30) + shift)}


def test_paired_claim_is_scipys_paired_t_test_on_the_common_queries():
    a, b = _values(0, 0.1), _values(1)
    b.pop("q0")  # a query only one side has is left out
    row = paired_claim("mol", "mol_vs_dot", "MoL", "bi-encoder", "nDCG@10", a, b)
    qids = sorted(b)
    assert row["queries"] == 29
    assert row["value"] == pytest.approx(np.mean([a[q] for q in qids]))
    assert row["baseline_value"] == pytest.approx(np.mean([b[q] for q in qids]))
    assert row["p"] == pytest.approx(ttest_rel([a[q] for q in qids], [b[q] for q in qids]).pvalue)
    assert paired_claim("p", "c", "s", "b", "m", a, a)["p"] is None  # no difference: undefined
    with pytest.raises(ValueError, match="no query in common"):
        paired_claim("p", "c", "s", "b", "m", {"x": 1.0}, {"y": 1.0})


def test_rows_are_added_and_replaced_by_key(tmp_path):
    path = tmp_path / "results" / "claims.json"
    cfg = SimpleNamespace(claims_json=str(path), recipe="partial", command="pyterrier-prob mol --recipe partial")
    first = paired_claim("mol", "mol_vs_dot", "MoL", "bi-encoder", "nDCG@10", _values(0, 0.2), _values(1))
    other = {**first, "metric": "R@100"}
    record_claims(cfg, [first, other])
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 2 and {r["recipe"] for r in rows} == {"partial"}
    assert rows[0]["command"] == cfg.command and rows[0]["device"]
    record_claims(cfg, [{**first, "value": 0.5}])  # same (paper, claim, recipe, system, metric): replaced
    write_claims(path, [{**first, "recipe": "frozen", "device": "cpu", "command": "x"}])  # another recipe: added
    rows = json.loads(path.read_text())["rows"]
    assert len(rows) == 3
    assert [r["value"] for r in rows if r["recipe"] == "partial" and r["metric"] == "nDCG@10"] == [0.5]
    assert not [p for p in path.parent.iterdir() if ".tmp" in p.name]  # no partial file left behind
    assert record_claims(SimpleNamespace(claims_json=None), [first]) is None


def test_a_file_that_is_not_a_claims_file_is_refused(tmp_path):
    path = tmp_path / "claims.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a claims file"):
        write_claims(path, [])


def test_pebr_claims_take_the_rule_best_on_calibration_not_on_test():
    import pandas as pd

    from pyterrier_prob.experiments.pebr import cutoff_claims

    # at k=50 the rule best on test ("recall-gain", 0.33) is not the one best on calibration ("CDF cutoff")
    matched = pd.DataFrame(
        {
            "name": ["top-k", "CDF cutoff", "recall-gain cutoff", "oracle depth (qrels known)"] * 2,
            "k": [50] * 4 + [100] * 4,
            "test_mean_depth": [50.0, 52.5, 48.0, 50.0, 100.0, 97.3, 103.7, 100.0],
            "SetR": [0.30, 0.31, 0.33, 0.50, 0.40, 0.39, 0.42, 0.60],
            "calibration_SetR": [0.28, 0.35, 0.30, np.nan, 0.41, 0.40, 0.45, np.nan],
            "topk_SetR_at_same_depth": [0.30, 0.305, 0.295, 0.30, 0.40, 0.398, 0.419, 0.40],
            "p_vs_topk_at_same_depth": [np.nan, 0.2, 0.5, 0.0, np.nan, 0.6, 0.04, 0.0],
        }
    )
    rows = cutoff_claims(SimpleNamespace(test_topics=pd.DataFrame({"qid": ["1", "2", "3"]})), matched)
    # the baseline is top-k at the chosen rule's own test mean depth, never top-k at k
    got = [
        (r["claim"], r["rule"], r["depth"], r["value"], r["baseline_value"], r["p"], r["calibration_SetR"])
        for r in rows
    ]
    assert got == [
        ("cutoff_vs_topk_k50", "CDF cutoff", 52.5, 0.31, 0.305, 0.2, 0.35),
        ("cutoff_vs_topk_k100", "recall-gain cutoff", 103.7, 0.42, 0.419, 0.04, 0.45),
    ]
    assert {r["metric"] for r in rows} == {"SetR"} and {r["queries"] for r in rows} == {3}
