"""VarCrossEncoder (shared/papers/var-cross-encoder.md): head, loss, save/load, predict(return_std), reranker."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import tiny_training_args

from st_extensions import load_model
from st_extensions.cross_encoder import VarCrossEncoder, VariationalHead, build_var_cross_encoder, find_var_head
from st_extensions.losses import VariationalBCELoss
from st_extensions.losses.varce import gaussian_kl

PAIRS = [
    ("what causes fever", "Fever is usually caused by an infection."),
    ("what causes fever", "The stock market fell sharply on Monday."),
    ("vitamin d deficiency", "Low vitamin D levels are common in winter."),
    ("vitamin d deficiency", "Paris is the capital of France."),
]


def _model(base_model, variant="VAR", **kw):
    torch.manual_seed(0)
    model = build_var_cross_encoder(base_model, variant=variant, max_seq_length=64, device="cpu", **kw)
    with torch.no_grad():  # give the variance branch some input dependence, as after training
        head = model.head
        if head.var_branch is not None:
            head.var_branch.weight.normal_(0, 0.05)
    return model


def _set_sigma_to_zero(head: VariationalHead) -> None:
    with torch.no_grad():
        head.var_branch.weight.zero_()
        head.var_branch.bias.fill_(head.min_log_var)


# ---- head ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["VAR", "MEANVAR", "MEAN"])
def test_head_shapes_and_modules(variant):
    torch.manual_seed(0)
    head = VariationalHead(8, variant=variant)
    t = torch.randn(5, 8)
    mean, var = head.distribution(t)
    assert mean.shape == var.shape == (5, 8) and (var > 0).all()
    if variant == "VAR":  # mu = [CLS], Sigma learned (starts at the prior's I)
        torch.testing.assert_close(mean, t)
        torch.testing.assert_close(var, torch.ones(5, 8))
    if variant == "MEAN":  # [CLS] is the (log-)variance, mu learned
        torch.testing.assert_close(var, torch.exp(t))
        assert head.var_branch is None
    head.eval()
    out = head({"sentence_embedding": t})
    assert out["scores"].shape == out["score_var"].shape == (5, 1)
    torch.testing.assert_close(out["scores"], mean @ head.decoder.weight.T + head.decoder.bias)  # Eq. 22
    torch.testing.assert_close(out["score_var"], var @ (head.decoder.weight**2).T)  # Eq. 23


def test_head_latent_dim_and_errors():
    head = VariationalHead(8, variant="meanvarm", latent_dim=3)
    assert head.variant == "MEANVAR" and head.distribution(torch.randn(2, 8))[0].shape == (2, 3)
    with pytest.raises(ValueError, match="latent_dim must equal in_features"):
        VariationalHead(8, variant="VAR", latent_dim=3)
    with pytest.raises(ValueError, match="variant must be one of"):
        VariationalHead(8, variant="gauss")
    with pytest.raises(ValueError, match="init_log_var"):
        VariationalHead(8, init_log_var=50.0)
    with pytest.raises(ValueError, match=r"shape \(batch, 8\)"):
        head.distribution(torch.randn(2, 5))


def test_kl_closed_form_matches_monte_carlo():
    torch.manual_seed(0)
    mean = torch.randn(3, 4, dtype=torch.float64)
    var = torch.rand(3, 4, dtype=torch.float64) * 2 + 0.1
    kl = gaussian_kl(mean, var)  # Eq. 17
    p = torch.distributions.Normal(mean, var.sqrt())
    r = torch.distributions.Normal(torch.zeros_like(mean), torch.ones_like(mean))
    torch.testing.assert_close(kl, torch.distributions.kl_divergence(p, r).sum(-1))
    z = p.sample((200_000,))
    mc = (p.log_prob(z) - r.log_prob(z)).sum(-1).mean(0)  # E_p[log p(z|t) - log r(z)], Eq. 11
    np.testing.assert_allclose(mc.numpy(), kl.numpy(), rtol=0.03, atol=0.01)
    assert torch.all(gaussian_kl(torch.zeros(2, 4), torch.ones(2, 4)) == 0)  # KL(N(0, I) || N(0, I)) = 0


def test_sampled_scores_have_the_closed_form_moments():
    torch.manual_seed(0)
    head = VariationalHead(6, variant="MEANVAR")
    with torch.no_grad():
        head.var_branch.weight.normal_(0, 0.3)
    t = torch.randn(2, 6)
    mean, var = head.distribution(t)
    expected, score_var = head.score_moments(mean, var)
    s = head.decode(head.sample(mean, var, 100_000)).squeeze(-1)  # z = mu + Sigma^1/2 eps, s = z^T W + b
    np.testing.assert_allclose(s.mean(0).detach().numpy(), expected.squeeze(-1).detach().numpy(), atol=0.02)
    np.testing.assert_allclose(s.var(0).detach().numpy(), score_var.squeeze(-1).detach().numpy(), rtol=0.03)


def test_sigma_to_zero_gives_the_mean_score():
    head = VariationalHead(6, variant="MEANVAR", min_log_var=-60.0)
    _set_sigma_to_zero(head)
    t = torch.randn(4, 6)
    mean, _ = head.distribution(t)
    mu_w = mean @ head.decoder.weight.T + head.decoder.bias
    head.train()
    torch.testing.assert_close(head({"sentence_embedding": t})["scores"], mu_w)  # a sample with Sigma ~ 0
    head.eval()
    assert torch.equal(head({"sentence_embedding": t})["scores"], mu_w)


# ---- the model ----------------------------------------------------------------------------------------------


def test_predict_with_std(base_model):
    model = _model(base_model, "MEANVAR")
    assert isinstance(model, VarCrossEncoder) and model.num_labels == 1
    scores = model.predict(PAIRS)
    mean, std = model.predict(PAIRS, return_std=True, batch_size=3)
    np.testing.assert_allclose(mean, scores, rtol=1e-5, atol=1e-6)
    assert mean.shape == std.shape == (len(PAIRS),) and np.all(std >= 0) and np.all(np.isfinite(std))
    # by hand from the features: E[s] = mu^T W + b, std = sqrt(W^T Sigma W)
    model.eval()
    with torch.no_grad():
        out = model(model.preprocess(PAIRS))
        w = model.head.decoder.weight
        by_hand_std = torch.sqrt(out["latent_var"] @ (w * w).T).squeeze(-1).numpy()
        by_hand_mean = model.head.decode(out["latent_mean"]).squeeze(-1).numpy()
    np.testing.assert_allclose(std, by_hand_std, rtol=1e-5)
    np.testing.assert_allclose(mean, by_hand_mean, rtol=1e-5, atol=1e-6)
    one = model.predict(PAIRS[0], return_std=True)
    assert np.isclose(one[0], mean[0], atol=1e-5) and np.isclose(one[1], std[0], rtol=1e-5)
    empty = model.predict([], return_std=True)
    assert len(empty[0]) == len(empty[1]) == 0
    t_mean, t_std = model.predict(PAIRS, return_std=True, convert_to_tensor=True)
    assert isinstance(t_mean, torch.Tensor) and t_std.shape == (len(PAIRS),)
    with pytest.raises(ValueError, match="activation_fn"):
        model.predict(PAIRS, return_std=True, activation_fn=torch.nn.Sigmoid())


def test_save_load_roundtrip_is_exact(tmp_path, base_model):
    model = _model(base_model, "VAR")
    path = str(tmp_path / "varce")
    model.save(path)
    files = {p.name for p in (tmp_path / "varce").rglob("*")}
    assert "pytorch_model.bin" not in files and "model.safetensors" in files
    loaded = load_model(path)
    assert isinstance(loaded, VarCrossEncoder) and find_var_head(loaded).variant == "VAR"
    assert isinstance(loaded.activation_fn, torch.nn.Identity)
    m1, s1 = model.predict(PAIRS, return_std=True)
    m2, s2 = loaded.predict(PAIRS, return_std=True)
    np.testing.assert_array_equal(m1, m2)
    np.testing.assert_array_equal(s1, s2)
    direct = VarCrossEncoder(path, device="cpu")  # our head resolves without trust_remote_code
    np.testing.assert_array_equal(direct.predict(PAIRS), m1)


def test_load_model_refuses_foreign_classes_and_pickles(tmp_path, base_model):
    model = _model(base_model, "MEAN")
    path = tmp_path / "varce"
    model.save(str(path))
    modules = json.loads((path / "modules.json").read_text())
    head_dir = path / modules[-1]["path"]
    modules[-1]["type"] = "evil_pkg.heads.Backdoor"
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="evil_pkg.heads.Backdoor"):
        load_model(str(path))
    modules[-1]["type"] = "st_extensions.cross_encoder.head.VariationalHead"
    (path / "modules.json").write_text(json.dumps(modules))
    (head_dir / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        load_model(str(path))


def test_model_errors(base_model):
    with pytest.raises(ValueError, match="no VariationalHead"):
        find_var_head(base_model)
    with pytest.raises(ValueError, match="already has a VariationalHead"):
        build_var_cross_encoder(_model(base_model))
    with pytest.raises(TypeError, match="base_model"):
        build_var_cross_encoder(torch.nn.Identity())  # type: ignore[arg-type]


# ---- the loss -----------------------------------------------------------------------------------------------


def test_variational_bce_is_bce_at_beta_zero_and_sigma_zero(base_model):
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

    model = _model(base_model, "MEANVAR", min_log_var=-60.0)
    _set_sigma_to_zero(model.head)
    model.eval()  # no dropout: both losses see the same [CLS]
    inputs = [[q for q, _ in PAIRS], [d for _, d in PAIRS]]
    labels = torch.tensor([1.0, 0.0, 1.0, 0.0])
    ours = VariationalBCELoss(model, beta=0.0, num_samples=1)(inputs, labels)
    twin = BinaryCrossEntropyLoss(model)(inputs, labels)
    torch.testing.assert_close(ours, twin, rtol=1e-6, atol=1e-6)
    # beta adds beta * mean KL (Eq. 10, 17), the prediction term unchanged
    with torch.no_grad():
        out = model(model.preprocess(PAIRS))
    kl = gaussian_kl(out["latent_mean"], out["latent_var"]).mean()
    with_kl = VariationalBCELoss(model, beta=1e-3, num_samples=3)(inputs, labels)
    torch.testing.assert_close(with_kl, twin + 1e-3 * kl, rtol=1e-5, atol=1e-5)


def test_variational_bce_monte_carlo_and_gradients(base_model):
    model = _model(base_model, "VAR")
    model.eval()
    inputs = [[q for q, _ in PAIRS], [d for _, d in PAIRS]]
    labels = torch.tensor([1, 0, 1, 0])
    loss = VariationalBCELoss(model, beta=1e-6, num_samples=4)
    value = loss(inputs, labels)
    value.backward()
    head = model.head
    assert torch.isfinite(value) and head.var_branch.weight.grad is not None and head.decoder.weight.grad is not None
    assert loss.get_config_dict() == {
        "beta": 1e-6,
        "num_samples": 4,
        "pos_weight": None,
        "variant": "VAR",
        "latent_dim": 384,
    }
    assert "Khodabakhsh" in loss.citation
    with pytest.raises(ValueError, match="labels"):
        loss(inputs, torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="two non-label columns"):
        loss([inputs[0]], labels)


def test_variational_bce_errors(base_model):
    model = _model(base_model)
    with pytest.raises(ValueError, match="beta"):
        VariationalBCELoss(model, beta=-1.0)
    with pytest.raises(ValueError, match="num_samples"):
        VariationalBCELoss(model, num_samples=0)
    with pytest.raises(ValueError, match="CrossEncoder"):
        VariationalBCELoss(base_model)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["VAR", "MEANVAR", "MEAN"])
def test_all_modules_train_with_cross_encoder_trainer(tmp_path, base_model, variant):
    from datasets import Dataset
    from sentence_transformers.cross_encoder import CrossEncoderTrainer, CrossEncoderTrainingArguments

    model = _model(base_model, variant)
    before = {k: v.clone() for k, v in model.head.state_dict().items()}
    train = Dataset.from_dict(
        {"query": [q for q, _ in PAIRS] * 3, "document": [d for _, d in PAIRS] * 3, "label": [1, 0, 1, 0] * 3}
    )
    args = tiny_training_args(CrossEncoderTrainingArguments, tmp_path, seed=0)
    loss = VariationalBCELoss(model, beta=1e-6, num_samples=2)
    CrossEncoderTrainer(model=model, args=args, train_dataset=train, loss=loss).train()
    after = model.head.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    mean, std = model.predict(PAIRS, return_std=True)
    assert np.all(np.isfinite(mean)) and np.all(std >= 0)
    path = str(tmp_path / "trained")
    model.save(path)
    m2, s2 = load_model(path).predict(PAIRS, return_std=True)
    np.testing.assert_array_equal(mean, m2)
    np.testing.assert_array_equal(std, s2)


# ---- the PyTerrier re-ranker ----------------------------------------------------------------------------------


def _candidates() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "qid": ["1", "1", "2", "2"],
            "query": [q for q, _ in PAIRS],
            "docno": ["d1", "d2", "d3", "d4"],
            "text": [d for _, d in PAIRS],
            "score": [4.0, 3.0, 2.0, 1.0],
            "rank": [0, 1, 0, 1],
        }
    )


def test_reranker_adds_score_and_std(base_model):
    from pyterrier_prob import VarCrossEncoderReranker

    model = _model(base_model, "MEANVAR")
    rr = VarCrossEncoderReranker(model, batch_size=3)
    out = rr(_candidates())
    assert {"score", "score_mean", "score_std", "rank", "docno", "text"} <= set(out.columns) and len(out) == 4
    np.testing.assert_array_equal(out["score"], out["score_mean"])  # risk = 0
    mean, std = model.predict(PAIRS, return_std=True)
    got = out.set_index("docno")
    np.testing.assert_allclose(got.loc[["d1", "d2", "d3", "d4"], "score"], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got.loc[["d1", "d2", "d3", "d4"], "score_std"], std, rtol=1e-5)
    for _, g in out.groupby("qid"):
        assert list(g["rank"]) == list(range(len(g))) and g["score"].is_monotonic_decreasing
    assert "VarCrossEncoderReranker" in repr(rr) and "risk=0.0" in repr(rr)


def test_reranker_risk_ordering(base_model):
    from pyterrier_prob import VarCrossEncoderReranker

    model = _model(base_model, "MEANVAR")
    mean, std = model.predict(PAIRS, return_std=True)
    lam = 3.0
    out = VarCrossEncoderReranker(model, risk=lam)(_candidates())
    np.testing.assert_allclose(out["score"], out["score_mean"] - lam * out["score_std"], rtol=1e-5, atol=1e-6)
    for _, g in out.groupby("qid"):
        assert g["score"].is_monotonic_decreasing
    # a hand-made case where the risk term flips the order: same mean, larger std ranks lower for lam > 0
    from pyterrier_prob.varce.rerank import risk_adjusted

    s = risk_adjusted(np.array([1.0, 1.0]), np.array([0.1, 2.0]), 0.5)
    assert s[0] > s[1]
    with pytest.raises(ValueError, match="risk"):
        VarCrossEncoderReranker(model, risk=float("nan"))


def test_reranker_empty_frame_and_missing_text(base_model):
    import pyterrier as pt

    from pyterrier_prob import VarCrossEncoderReranker

    rr = VarCrossEncoderReranker(_model(base_model))
    empty = rr(_candidates().iloc[:0])
    assert len(empty) == 0 and {"score", "score_std", "rank"} <= set(empty.columns)
    with pytest.raises(pt.validate.InputValidationError, match="text"):
        rr(_candidates().drop(columns="text"))
    with pytest.raises(ValueError, match="VariationalHead"):
        VarCrossEncoderReranker(torch.nn.Linear(2, 2))  # type: ignore[arg-type]
