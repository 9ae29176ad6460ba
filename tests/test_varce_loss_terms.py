"""``benchmarks/varce_loss_terms.py``'s parameter groups and its table, on a made-up results file: the table's
figures are the means over the batches, and the NLL / Margin-MSE ratio is the ratio of those means."""

from __future__ import annotations

import pytest
from helpers import load_benchmark


@pytest.fixture(scope="module")
def terms():
    return load_benchmark("varce_loss_terms")


def test_every_parameter_falls_in_one_group(terms):
    assert terms.group_of("2.mean_branch.weight") == "head: mean branch and decoder"
    assert terms.group_of("2.decoder.bias") == "head: mean branch and decoder"
    assert terms.group_of("2.var_branch.0.weight") == "head: variance branch"
    assert terms.group_of("0.auto_model.encoder.layer.5.attention.self.query.weight") == "encoder"


def test_the_table_gives_the_means_over_batches(terms):
    def batch(mse: float, nll: float, cos: float | None) -> dict:
        head = {"grad_norm_margin_mse": 10.0, "grad_norm_nll": 0.0, "cosine": None}
        var = {"grad_norm_margin_mse": 0.0, "grad_norm_nll": 0.5, "cosine": None}
        enc = {"grad_norm_margin_mse": mse, "grad_norm_nll": nll, "cosine": cos}
        return {"groups": dict(zip(terms.GROUPS, (head, var, enc)))}

    result = {
        "models": {"m": {"per_batch": [batch(2.0, 1.0, 0.2), batch(4.0, 0.5, -0.1)], "kernel_weight_max_abs": 0.0871}},
        "ce": "ce",
        "ce_kernel_weight_max_abs": 0.08,
    }
    rows = terms.table(result)
    assert rows[2] == "| m | head: mean branch and decoder | 10 | 0 | 0 | — | 0.087 |"
    assert rows[3] == "| m | head: variance branch | 0 | 0.5 | — | — |  |"
    assert rows[4] == "| m | encoder | 3 | 0.75 | 0.25 | +0.050 |  |"  # means 3 and 0.75; cosine mean 0.05
    assert rows[5] == "| CE (ce) | linear head | | | | | 0.080 |"
