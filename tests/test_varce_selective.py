"""Query-level selective prediction: risk-coverage curves, AURC / E-AURC, the query-performance predictors and MC
dropout, against closed forms."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from pyterrier_prob.varce.selective import (
    aurc,
    e_aurc,
    mc_dropout_std,
    nqc,
    risk_coverage,
    selective_table,
    top_k_mean,
    wig,
)
from st_extensions.cross_encoder.split import build_split_cross_encoder


def test_risk_coverage_and_aurc_closed_forms():
    risk = pd.Series([0.2, 0.8, 0.5], index=["a", "b", "c"])
    conf = pd.Series([1.0, 3.0, 2.0], index=["b", "a", "c"])  # aligned on the qids: a 3, c 2, b 1
    curve = risk_coverage(risk, conf)
    np.testing.assert_allclose(curve["coverage"], [1 / 3, 2 / 3, 1])
    np.testing.assert_allclose(curve["risk"], [0.2, 0.35, 0.5])
    assert aurc(risk, conf) == pytest.approx(0.35)
    assert e_aurc(risk, conf) == pytest.approx(0.0)  # the best order
    worst = aurc([0.2, 0.8, 0.5], [1, 3, 2])  # the order b (0.8), c (0.5), a (0.2): the worst
    assert worst == pytest.approx((0.8 + 0.65 + 0.5) / 3)
    # ties count as any order with equal chance: all tied is the mean risk at every coverage
    np.testing.assert_allclose(risk_coverage([0.2, 0.8, 0.5], [1, 1, 1])["risk"], [0.5, 0.5, 0.5])
    tie = risk_coverage([0.0, 1.0, 0.5], [2, 2, 1])["risk"]  # the first two tied: 0.5 each, then 0.5
    np.testing.assert_allclose(tie, [0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match="finite"):
        aurc([0.1, np.nan], [1, 2])
    with pytest.raises(ValueError, match="one value per query"):
        aurc([0.1, 0.2], [1])


def test_first_stage_predictors_closed_forms():
    run = pd.DataFrame(
        {"qid": ["q1"] * 4 + ["q2"] * 3, "score": [4.0, 2.0, 1.0, 1.0, 3.0, 3.0, 3.0], "x": [1, 2, 3, 4, 5, 6, 7]}
    )
    # NQC: sd of the top k over |mean of the candidates|
    assert nqc(run, k=2)["q1"] == pytest.approx(1.0 / 2.0)
    assert nqc(run, k=2)["q2"] == pytest.approx(0.0)
    # WIG: (mean of the top k - mean of the candidates) / sqrt(query words)
    w = wig(run, {"q1": "two words", "q2": "one"}, k=1)
    assert w["q1"] == pytest.approx((4.0 - 2.0) / np.sqrt(2)) and w["q2"] == pytest.approx(0.0)
    assert top_k_mean(run, "x", k=2).to_dict() == {"q1": 1.5, "q2": 5.5}


def test_selective_table_references_and_common_queries():
    risk = pd.Series([0.1, 0.9, 0.4, 0.6], index=list("abcd"))
    good, bad = -risk, risk
    table = selective_table(risk, {"good": good, "bad": bad.drop("d")})
    assert table["queries"] == 3  # the queries every confidence covers
    assert table["random"] == pytest.approx(np.mean([0.1, 0.9, 0.4]))
    assert table["e_aurc"]["good"] == pytest.approx(0.0) and table["e_aurc"]["bad"] > 0
    assert table["aurc"]["good"] == table["optimal"] < table["random"] < table["aurc"]["bad"]
    assert table["curves"]["good"]["risk"] == pytest.approx([0.1, 0.25, 0.4667], abs=1e-4)


def test_mc_dropout_spread(minilm_path):
    """Dropout on: the scores vary between passes (seeded: the same spread twice); the model is left as it was;
    a model whose dropout is all p = 0 is refused."""
    model = build_split_cross_encoder(minilm_path, joint_layers=1)
    model.eval()
    q, d = ["vitamin d bones", "statins"], ["Vitamin D and bone density in older adults.", "Statins lower LDL."]
    spread = mc_dropout_std(model, q, d, passes=4, seed=3)
    assert spread.shape == (2,) and (spread > 0).all()
    np.testing.assert_array_equal(spread, mc_dropout_std(model, q, d, passes=4, seed=3))
    assert not any(m.training for m in model.modules())
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    with pytest.raises(ValueError, match="no dropout"):
        mc_dropout_std(model, q, d)
