"""The query-distribution head, pEBR models, the guarded loader, and a short real training run."""

import json
import shutil

import numpy as np
import pytest
import torch
from helpers import tiny_training_args

from st_extensions import (
    BetaCosine,
    ExpCosine,
    QueryDistributionHead,
    build_pebr_model,
    encode_queries,
    load_model,
    query_distribution,
)
from st_extensions.losses import BetaNCELoss

QUERIES = ["vitamin d and bone health", "statins side effects", "breast cancer diet"]


@pytest.mark.parametrize("family,k", [("exp", 1), ("beta", 1), ("beta_mle", 4)])
def test_head_initialisation_and_bounds(family, k):
    head = QueryDistributionHead(16, family=family, tau_init=0.05)
    params = head.distribution_params(torch.randn(7, 16))
    assert params.shape == (7, k)
    init = [1 / 0.05, 1, 1, 1] if family == "beta_mle" else [0.05]
    np.testing.assert_allclose(params.detach().numpy(), np.tile(init, (7, 1)), rtol=1e-5)
    with torch.no_grad():
        head.linear.weight.fill_(1e3)  # saturate: still finite and inside the bounds
    params = head.distribution_params(torch.cat([torch.ones(2, 16), -torch.ones(2, 16)]))
    lo, hi = (head.param_min, head.param_max) if family == "beta_mle" else (head.tau_min, head.tau_max)
    assert torch.isfinite(params).all()
    assert (params >= lo * (1 - 1e-6)).all() and (params <= hi * (1 + 1e-6)).all()


def test_head_errors():
    with pytest.raises(ValueError, match="family"):
        QueryDistributionHead(8, family="gauss")
    with pytest.raises(ValueError, match="tau_init"):
        QueryDistributionHead(8, tau_init=0.0)
    with pytest.raises(ValueError, match="tau_init"):
        QueryDistributionHead(8, tau_init=float("nan"))
    with pytest.raises(ValueError, match="tau_min < tau_init < tau_max"):
        QueryDistributionHead(8, tau_init=2.0)
    head = QueryDistributionHead(8)
    with pytest.raises(ValueError, match=r"shape \(batch, 8\)"):
        head.distribution_params(torch.randn(3, 5))


def test_documents_skip_the_head_queries_get_it(base_model):
    model = build_pebr_model(base_model, family="beta")
    docs = model.encode_document(["a document about statins"], output_value=None)
    assert "query_distribution" not in docs[0]
    np.testing.assert_allclose(
        model.encode_document(["a document about statins"]),
        base_model.encode_document(["a document about statins"]),
        atol=1e-6,
    )
    emb, params = encode_queries(model, QUERIES)
    assert emb.shape == (3, 384) and params.shape == (3, 1)
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(emb, base_model.encode_query(QUERIES), atol=1e-6)
    dist = query_distribution(model, QUERIES)
    assert isinstance(dist, BetaCosine)
    np.testing.assert_allclose(dist.alpha, 1 / params[:, 0])
    assert isinstance(query_distribution(build_pebr_model(base_model, family="exp"), QUERIES, dim=384), ExpCosine)


def test_query_distribution_needs_head(base_model):
    with pytest.raises(ValueError, match="no QueryDistributionHead"):
        query_distribution(base_model, QUERIES)


def _saved(tmp_path, base_model, family="beta_mle"):
    model = build_pebr_model(base_model, family=family)
    with torch.no_grad():
        model[-1].linear.weight.normal_(0, 0.05)
    path = str(tmp_path / "model")
    model.save(path)
    return model, path


def test_save_load_roundtrip_is_exact(tmp_path, base_model):
    model, path = _saved(tmp_path, base_model)
    files = {p.name for p in (tmp_path / "model").rglob("*")}
    assert "pytorch_model.bin" not in files
    loaded = load_model(path)
    assert isinstance(loaded[-1], QueryDistributionHead) and loaded[-1].family == "beta_mle"
    e1, p1 = encode_queries(model, QUERIES)
    e2, p2 = encode_queries(loaded, QUERIES)
    np.testing.assert_array_equal(p1, p2)
    np.testing.assert_array_equal(e1, e2)


def _edit_modules(path, fn):
    with open(f"{path}/modules.json") as f:
        modules = json.load(f)
    fn(modules)
    with open(f"{path}/modules.json", "w") as f:
        json.dump(modules, f)


def test_load_model_refuses_foreign_classes(tmp_path, base_model):
    _, path = _saved(tmp_path, base_model)
    _edit_modules(path, lambda m: m[-1].update(type="evil_pkg.modules.Backdoor"))
    with pytest.raises(ValueError, match="evil_pkg.modules.Backdoor"):
        load_model(path)
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model(path, trust_remote_code=True)


def test_load_model_refuses_repository_code(tmp_path, base_model):
    _, path = _saved(tmp_path, base_model)
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    config["auto_map"] = {"AutoModel": "modeling_evil.EvilModel"}
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="auto_map"):
        load_model(path)


def test_load_model_errors_on_corrupt_or_missing(tmp_path, base_model):
    with pytest.raises(ValueError, match="no modules.json"):
        load_model(str(tmp_path))
    _, path = _saved(tmp_path, base_model)
    head_dir = next(p for p in (tmp_path / "model").iterdir() if p.is_dir() and "QueryDistributionHead" in p.name)
    (head_dir / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        load_model(path)


def test_load_model_detects_dimension_mismatch(tmp_path, base_model):
    _, path = _saved(tmp_path, base_model)
    head_dir = next(p for p in (tmp_path / "model").iterdir() if p.is_dir() and "QueryDistributionHead" in p.name)
    config = json.loads((head_dir / "config.json").read_text())
    config["in_features"] = 128
    (head_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="do not match"):
        load_model(path)


@pytest.mark.slow
def test_trainer_few_steps_on_nfcorpus_save_reload_identical_tau(tmp_path, base_model):
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.base.sampler import BatchSamplers

    from pyterrier_prob.data import training_pairs

    train = training_pairs("irds:beir/nfcorpus/train", max_pairs=64, seed=0).remove_columns("qid")
    model = build_pebr_model(base_model, family="beta")
    args = tiny_training_args(
        SentenceTransformerTrainingArguments,
        tmp_path,
        max_steps=4,
        per_device_train_batch_size=8,
        learning_rate=1e-4,
        batch_sampler=BatchSamplers.NO_DUPLICATES,
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train, loss=BetaNCELoss(model))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and all(np.isfinite(losses))

    dev_queries = [
        "Do Cholesterol Statin Drugs Cause Breast Cancer?",
        "vitamin D",
        "How Doctors Responded",
        "Exploiting Cancer's Sweet Tooth",
    ]
    tau_before_save = query_distribution(model, dev_queries).alpha
    assert np.ptp(1 / tau_before_save) > 0  # the head was trained: queries no longer share tau_init
    path = str(tmp_path / "trained")
    model.save(path)
    reloaded = load_model(path)
    np.testing.assert_array_equal(query_distribution(reloaded, dev_queries).alpha, tau_before_save)
    shutil.rmtree(path)


def test_documents_encoded_over_two_processes_equal_one(tmp_path, base_model, minilm_path):
    """ProbBiEncoder(devices=[...]): sentence-transformers' multi-process encoding gives the same vectors."""
    from pyterrier_prob import ProbBiEncoder

    texts = [f"document {i} about {w}" for i, w in enumerate(["heart", "diet", "cancer", "sleep", "vitamin d"] * 4)]
    one = ProbBiEncoder(base_model).encode_docs(texts)
    two = ProbBiEncoder(minilm_path, devices=["cpu", "cpu"]).encode_docs(texts)
    np.testing.assert_allclose(one, two, atol=1e-5)
    with pytest.raises(ValueError, match="devices must be a non-empty list of device names"):
        ProbBiEncoder(base_model, devices="cpu")
