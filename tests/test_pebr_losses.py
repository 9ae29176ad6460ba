"""pEBR losses against their closed forms and sentence-transformers twins."""

import math

import pytest
import torch
from helpers import DOCS, QUERIES
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from torch import nn

from st_extensions import QueryDistributionHead, build_pebr_model
from st_extensions.losses import BetaMLELoss, BetaNCELoss, ExpNCELoss

NEGS = [
    "Coffee consumption and mortality.",
    "Sleep duration in teenagers.",
    "Red meat and colon cancer.",
    "Exercise and depression.",
]


def features(model, *columns):
    return [model.preprocess(list(c)) for c in columns]


@pytest.fixture(scope="module")
def exp_model(base_model):
    return build_pebr_model(base_model, family="exp", tau_init=0.05)


@pytest.mark.parametrize("columns", [(QUERIES, DOCS), (QUERIES, DOCS, NEGS)])
def test_expnce_with_constant_head_equals_mnrl(exp_model, columns):
    head = exp_model[-1]
    tau = head.distribution_params(torch.randn(1, head.in_features))[0, 0].item()
    assert tau == pytest.approx(0.05, rel=1e-5)  # zero-initialised weights: every query gets tau_init
    torch.manual_seed(0)
    ours = ExpNCELoss(exp_model)(features(exp_model, *columns), None)
    ref = MultipleNegativesRankingLoss(exp_model, scale=1.0 / tau)(features(exp_model, *columns), None)
    assert ours.item() == pytest.approx(ref.item(), abs=1e-6)
    assert ours.item() > 0.0


def test_expnce_uses_per_query_temperature(base_model):
    """With distinct tau_q the loss is the cross-entropy of cos / tau_q, row by row."""
    model = build_pebr_model(base_model, family="exp")
    with torch.no_grad():
        model[-1].linear.weight.normal_(0, 0.5)
    feats = features(model, QUERIES, DOCS)
    loss = ExpNCELoss(model)(feats, None)
    with torch.no_grad():
        q = model(model.preprocess(QUERIES))["sentence_embedding"]
        d = model(model.preprocess(DOCS))["sentence_embedding"]
        tau = model[-1].distribution_params(q)[:, 0]
        assert tau.max() / tau.min() > 1.05
        cos = torch.nn.functional.normalize(q, dim=-1) @ torch.nn.functional.normalize(d, dim=-1).T
        logits = cos / tau[:, None]
        expected = -(logits.diag() - torch.logsumexp(logits, dim=1)).mean()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)


class EmbeddingIdentity(nn.Module):
    """A stand-in model whose 'sentence_embedding' is given directly, so the cosines can be set exactly."""

    def __init__(self, dim, family):
        super().__init__()
        self.head = QueryDistributionHead(dim, family=family)

    def forward(self, features):
        return features


def loss_and_grads(loss_cls, q, d, family):
    model = EmbeddingIdentity(q.shape[1], family)
    q = q.clone().requires_grad_(True)
    d = d.clone().requires_grad_(True)
    loss = loss_cls(model)([{"sentence_embedding": q}, {"sentence_embedding": d}], None)
    loss.backward()
    return loss, q.grad, d.grad, model.head.linear.weight.grad


@pytest.mark.parametrize("loss_cls,family", [(BetaNCELoss, "beta"), (BetaMLELoss, "beta_mle"), (ExpNCELoss, "exp")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("delta", [1e-7, 0.0])
def test_gradients_finite_near_antipodal(loss_cls, family, dtype, delta):
    """cos(q_0, d_0) = -1 + delta (the positive) and cos(q_1, d_0) = +1: logs of 0 must not leak."""
    c = -1.0 + delta
    s = math.sqrt(max(0.0, 1.0 - c * c))
    q = torch.tensor([[1.0, 0.0, 0.0], [-1.0, 0.0, 0.0], [0.0, 0.0, 1.0]], dtype=dtype)
    d = torch.tensor([[c, s, 0.0], [0.6, 0.8, 0.0], [0.0, 0.6, 0.8]], dtype=dtype)
    cos = torch.nn.functional.normalize(q, dim=-1) @ torch.nn.functional.normalize(d, dim=-1).T
    assert cos[0, 0].item() == pytest.approx(-1.0 + delta, abs=1e-7)
    loss, gq, gd, gw = loss_and_grads(loss_cls, q, d, family)
    assert torch.isfinite(loss)
    for g in (gq, gd, gw):
        assert torch.isfinite(g).all()


def test_betance_closed_form():
    """BetaNCE logits are log((1 + cos) / 2) / tau_q (pEBR Sec. 3.2.2)."""
    torch.manual_seed(1)
    q = torch.nn.functional.normalize(torch.randn(5, 8, dtype=torch.float64), dim=-1)
    d = torch.nn.functional.normalize(torch.randn(5, 8, dtype=torch.float64), dim=-1)
    model = EmbeddingIdentity(8, "beta")
    loss = BetaNCELoss(model)([{"sentence_embedding": q}, {"sentence_embedding": d}], None)
    tau = model.head.distribution_params(q)[:, :1].double()
    logits = torch.log((1 + q @ d.T) / 2) / tau
    expected = torch.nn.functional.cross_entropy(logits, torch.arange(5))
    assert loss.item() == pytest.approx(expected.item(), abs=1e-9)


def test_beta_mle_closed_form():
    """The MLE loss is minus the mean Beta log-density of positives plus that of negatives (Sec. 3.1)."""
    from scipy.stats import beta as beta_law

    torch.manual_seed(2)
    q = torch.nn.functional.normalize(torch.randn(4, 6, dtype=torch.float64), dim=-1)
    d = torch.nn.functional.normalize(torch.randn(4, 6, dtype=torch.float64), dim=-1)
    model = EmbeddingIdentity(6, "beta_mle")
    with torch.no_grad():
        model.head.linear.weight.normal_(0, 0.1)
    loss = BetaMLELoss(model, negative_weight=0.5)([{"sentence_embedding": q}, {"sentence_embedding": d}], None)
    params = model.head.distribution_params(q).detach().double().numpy()
    cos = (q @ d.T).numpy()
    pos, neg = [], []
    for i in range(4):
        for j in range(4):
            a, b = (params[i, 0], params[i, 1]) if i == j else (params[i, 2], params[i, 3])
            # density of the cosine on [-1, 1] = Beta density of z = (1 + cos) / 2, divided by 2
            value = beta_law(a, b).logpdf((1 + cos[i, j]) / 2) - math.log(2)
            (pos if i == j else neg).append(value)
    expected = -(sum(pos) / len(pos) + 0.5 * sum(neg) / len(neg))
    assert loss.item() == pytest.approx(expected, rel=1e-6)  # head parameters are float32


def test_losses_refuse_model_without_head(base_model):
    for loss_cls in (ExpNCELoss, BetaNCELoss, BetaMLELoss):
        with pytest.raises(ValueError, match="no QueryDistributionHead"):
            loss_cls(base_model)


def test_losses_refuse_head_of_other_family():
    with pytest.raises(ValueError, match="family 'exp'"):
        ExpNCELoss(EmbeddingIdentity(4, "beta"))
    with pytest.raises(ValueError, match="family 'beta_mle'"):
        BetaMLELoss(EmbeddingIdentity(4, "exp"))


def test_loss_needs_two_columns():
    q = torch.randn(3, 4)
    with pytest.raises(ValueError, match="anchor, positive"):
        BetaNCELoss(EmbeddingIdentity(4, "beta"))([{"sentence_embedding": q}], None)


def test_config_and_citation(exp_model):
    loss = ExpNCELoss(exp_model)
    assert loss.get_config_dict() == {"family": "exp", "gather_across_devices": False}
    assert ExpNCELoss(exp_model, gather_across_devices=True).get_config_dict()["gather_across_devices"] is True
    assert "pEBR" in loss.citation
    assert BetaMLELoss(EmbeddingIdentity(4, "beta_mle"), negative_weight=2.0).get_config_dict()["negative_weight"] == 2
