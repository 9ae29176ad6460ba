"""Every loss refuses an empty batch with a ValueError naming the loss, before the model is called."""

from __future__ import annotations

import pytest
import torch

from st_extensions import build_mol_model, build_pebr_model, build_unierf_model
from st_extensions.cross_encoder import build_var_cross_encoder
from st_extensions.losses import (
    BetaMLELoss,
    BetaNCELoss,
    ExpNCELoss,
    MaskedMultipleNegativesRankingLoss,
    MoLLoss,
    UniERFLoss,
    VariationalBCELoss,
)
from st_extensions.losses._checks import check_not_empty, feature_rows


def _pebr(family, loss_cls):
    return lambda base: (m := build_pebr_model(base, family=family), loss_cls(m), 2)


LOSSES = {
    "ExpNCELoss": _pebr("exp", ExpNCELoss),
    "BetaNCELoss": _pebr("beta", BetaNCELoss),
    "BetaMLELoss": _pebr("beta_mle", BetaMLELoss),
    "MaskedMultipleNegativesRankingLoss": lambda base: (base, MaskedMultipleNegativesRankingLoss(base), 3),
    "MoLLoss": lambda base: (m := build_mol_model(base, 2, 2, component_dim=8), MoLLoss(m), 2),
    "UniERFLoss": lambda base: (
        m := build_unierf_model(base, branches=("semantic", "trigger"), device="cpu"),
        UniERFLoss(m),
        3,  # anchor_semantic, anchor_trigger, positive_doc
    ),
}


def _no_model_call(model):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was called on an empty batch")

    return model.register_forward_pre_hook(refuse)


@pytest.mark.parametrize("name", list(LOSSES))
def test_empty_batch_is_a_clear_error_before_the_model(name, base_model):
    model, loss, columns = LOSSES[name](base_model)
    empty = [model.preprocess([]) for _ in range(columns)]
    assert all(feature_rows(f) == 0 for f in empty)
    hook = _no_model_call(model)
    try:
        with pytest.raises(ValueError, match=rf"^{name} got an empty batch \(0 rows"):
            loss(empty, None)
        # one empty column among full ones: named, with the other columns' row count
        full = [model.preprocess(["a query", "another query"]) for _ in range(columns - 1)]
        with pytest.raises(
            ValueError,
            match=rf"^{name} got an empty batch in column\(s\) \[{columns - 1}\] \(0 rows\) "
            r"while column 0 has 2",
        ):
            loss([*full, model.preprocess([])], None)
    finally:
        hook.remove()


def test_variational_bce_empty_batch_before_the_model(base_model):
    model = build_var_cross_encoder(base_model, variant="VAR", max_seq_length=32, device="cpu")
    hook = _no_model_call(model)
    try:
        with pytest.raises(ValueError, match=r"^VariationalBCELoss got an empty batch \(0 rows"):
            VariationalBCELoss(model)([[], []], torch.zeros(0))
    finally:
        hook.remove()


def test_feature_rows_and_check():
    ids = torch.zeros(3, 5, dtype=torch.long)
    assert feature_rows({"input_ids": ids, "attention_mask": ids}) == 3
    assert feature_rows({"task": "query", "sentence_embedding": torch.zeros(4, 8)}) == 4
    assert feature_rows({"unpaired_texts": ["a", "b"]}) == 2  # a cache look-up's raw texts
    assert feature_rows({}) == 0 and feature_rows({"input_ids": ids[:0]}) == 0
    assert feature_rows({"task": "query"}) is None  # unknown: not checked
    features = check_not_empty("L", iter([{"input_ids": ids}, {"task": "query"}]))  # a generator is consumed once
    assert len(features) == 2 and features[0]["input_ids"] is ids
