"""predict_sharing_layers: several cross-encoders scored through their shared lower layers once equal each model's
own predict (CE and VarCE, means and stds), and models whose lower layers differ are refused."""

import numpy as np
import pytest
import torch

from st_extensions.cross_encoder import build_var_cross_encoder
from st_extensions.cross_encoder.frozen import build_cross_encoder
from st_extensions.cross_encoder.model import predict_sharing_layers

PAIRS = [
    ("vitamin d and bone health", "Vitamin D supplements were given to older adults for two years."),
    ("statins muscle pain", "Myalgia is the most common side effect of statin therapy in trials."),
    ("red meat colon cancer", "Processed meat intake was associated with colorectal cancer risk."),
    ("sleep", "A short one."),
    ("green tea", "Catechins in green tea were studied in a randomised trial of weight loss over twelve weeks."),
]


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    ce = build_cross_encoder(None, max_seq_length=48, device="cpu")
    var = build_var_cross_encoder(None, variant="VAR", max_seq_length=48, device="cpu")
    meanvar = build_var_cross_encoder(None, variant="MEANVAR", max_seq_length=48, device="cpu")
    with torch.no_grad():  # different top layers, as after partial training of the top 2 of 6
        for i, m in enumerate((ce, var, meanvar)):
            for layer in m[0].auto_model.encoder.layer[4:]:
                for p in layer.parameters():
                    p.add_(0.01 * (i + 1) * torch.randn_like(p))
    return ce, var, meanvar


def test_equals_each_models_predict(models):
    ce, var, meanvar = models
    out = predict_sharing_layers([ce, var, meanvar], PAIRS, 4, batch_size=2)
    ref_ce = ce.predict(PAIRS, activation_fn=torch.nn.Identity())
    np.testing.assert_allclose(out[0][0], ref_ce, rtol=1e-5, atol=1e-5)
    assert out[0][1] is None
    for (mean, std), m in zip(out[1:], (var, meanvar)):
        ref_mean, ref_std = m.predict(PAIRS, return_std=True)
        np.testing.assert_allclose(mean, ref_mean, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(std, ref_std, rtol=1e-5, atol=1e-6)
    assert not np.allclose(out[1][0], out[2][0])  # the models really differ


def test_refuses_models_whose_lower_layers_differ(models):
    ce, var, _ = models
    with pytest.raises(ValueError, match="do not share"):
        predict_sharing_layers([ce, var], PAIRS, 5)  # layer 4 differs between them
    with pytest.raises(ValueError, match="frozen_layers"):
        predict_sharing_layers([ce], PAIRS, 6)
