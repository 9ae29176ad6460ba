"""Mixture-of-Logits (Ding & Zhai, WWW'25): the maths (Eq. 1-4), the MoL head, MoLLoss, save/load, training."""

import copy
import json
import math

import numpy as np
import pytest
import torch
from helpers import DOCS, QUERIES, tiny_training_args
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

from st_extensions import MixtureOfLogits, build_mol_model, encode_components, find_mol, load_model
from st_extensions.losses import MoLLoss
from st_extensions.modules.mol import (
    COMPONENTS_KEY,
    component_dots,
    component_dots_all,
    entropy,
    mixture_scores,
    mutual_information_loss,
)

NEGS = ["Coffee consumption and mortality.", "Sleep duration in teenagers.", "Red meat and colon cancer.", "Yoga."]


def unit(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(*shape, generator=g, dtype=dtype), dim=-1)


def perturb(module, std=0.5, seed=0):
    """Random parameters everywhere, so the gate is far from uniform."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)


def standalone(pq=2, px=3, d=5, features=False, dtype=torch.float64):
    """A MixtureOfLogits outside any model (heads source), with a non-trivial gate."""
    mol = MixtureOfLogits(pq, px, d, embedding_dim=6, component_source="heads", gate_features=features).to(dtype)
    perturb(mol)
    return mol


def features(model, *columns):
    return [model.preprocess(list(c)) for c in columns]


@pytest.fixture(scope="module")
def tokens_model(base_model):
    return build_mol_model(base_model, num_query_components=2, num_doc_components=3, component_dim=8).eval()


@pytest.fixture(scope="module")
def heads_model(base_model):
    model = build_mol_model(
        base_model, num_query_components=2, num_doc_components=2, component_dim=16, component_source="heads"
    )
    return model.eval()


# ------------------------------------------------------------------ pure maths


def test_table6_worked_example():
    """App. B, Table 6: phi = sum_p pi_p <f_p, g_p> for items a..e of a fixed query (P = 2)."""
    dots = torch.tensor([[1, 1], [0.8, 0], [0, 0.8], [0.7, 0], [0.2, 0.2]])
    pi = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.5, 0.5], [1, 0], [0.5, 0.5]])
    torch.testing.assert_close(mixture_scores(pi, dots), torch.tensor([1.0, 0.4, 0.4, 0.7, 0.2]))


def test_component_dots_are_pq_major():
    q, x = unit(2, 3, 4, seed=1), unit(2, 5, 2, 4, seed=2)
    dots = component_dots(q, x)
    assert dots.shape == (2, 5, 6)
    for b in range(2):
        for c in range(5):
            for pq in range(3):
                for px in range(2):
                    assert dots[b, c, pq * 2 + px].item() == pytest.approx(float(q[b, pq] @ x[b, c, px]), abs=1e-12)
    shared = unit(5, 2, 4, seed=3)
    torch.testing.assert_close(component_dots_all(q, shared), component_dots(q, shared.expand(2, -1, -1, -1)))


@pytest.mark.parametrize("with_features", [False, True])
def test_score_candidates_is_eq1_brute_force(with_features):
    mol = standalone(features=with_features)
    q, x = unit(3, 2, 5, seed=4), unit(3, 4, 3, 5, seed=5)
    qf, xf = (unit(3, 6, seed=6), unit(3, 4, 6, seed=7)) if with_features else (None, None)
    scores = mol.score_candidates(q, x, qf, xf)
    pi = mol.gate(q, x, qf, xf)
    assert scores.shape == (3, 4) and pi.shape == (3, 4, 6)
    assert pi.std() > 0.01  # a non-trivial gate
    for b in range(3):
        for c in range(4):
            phi = sum(
                pi[b, c, pq * 3 + px].item() * float(q[b, pq] @ x[b, c, px]) for pq in range(2) for px in range(3)
            )
            assert scores[b, c].item() == pytest.approx(phi, abs=1e-12)
    torch.testing.assert_close(scores, torch.einsum("bcp,bcp->bc", pi, component_dots(q, x)))


def test_gate_is_a_distribution_and_starts_uniform():
    mol = standalone(pq=3, px=2, features=True)
    q, x, qf, xf = unit(4, 3, 5, seed=8), unit(4, 7, 2, 5, seed=9), unit(4, 6, seed=10), unit(4, 7, 6, seed=11)
    pi = mol.gate(q * 3, x, qf, xf)  # even for components off the sphere
    assert (pi >= 0).all() and (pi <= 1).all()
    torch.testing.assert_close(pi.sum(-1), torch.ones(4, 7, dtype=pi.dtype))
    fresh = MixtureOfLogits(3, 2, 5, embedding_dim=6, component_source="heads").double()
    torch.testing.assert_close(fresh.gate(q, x), torch.full((4, 7, 6), 1 / 6, dtype=torch.float64))
    torch.testing.assert_close(fresh.score_candidates(q, x), component_dots(q, x).mean(-1))


@pytest.mark.parametrize("with_features", [False, True])
def test_score_all_equals_score_candidates_at_any_chunk_size(with_features):
    mol = standalone(features=with_features)
    q, x = unit(3, 2, 5, seed=12), unit(7, 3, 5, seed=13)
    qf, xf = (unit(3, 6, seed=14), unit(7, 6, seed=15)) if with_features else (None, None)
    xf_b = None if xf is None else xf.expand(3, -1, -1)
    expected = mol.score_candidates(q, x.expand(3, -1, -1, -1), qf, xf_b)
    for chunk in (1, 3, 7, 100):
        torch.testing.assert_close(mol.score_all(q, x, qf, xf, chunk_size=chunk), expected)
    scores, gates = mol.mixture_all(q, x, qf, xf)
    torch.testing.assert_close(scores, expected)
    torch.testing.assert_close(gates, mol.gate(q, x.expand(3, -1, -1, -1), qf, xf_b))
    assert mol.score_all(q, x[:0], qf, None if xf is None else xf[:0]).shape == (3, 0)
    assert not mol.score_all(q, x, qf, xf).requires_grad


def test_mutual_information_loss_matches_eq3():
    g = torch.Generator().manual_seed(16)
    pi = torch.softmax(torch.randn(2, 3, 4, generator=g, dtype=torch.float64) * 2, dim=-1)
    rows = [pi[b, c].tolist() for b in range(2) for c in range(3)]
    marginal = [sum(r[p] for r in rows) / len(rows) for p in range(4)]
    h_p = -sum(m * math.log(m) for m in marginal)
    h_p_given_qx = sum(-sum(v * math.log(v) for v in r) for r in rows) / len(rows)
    assert mutual_information_loss(pi).item() == pytest.approx(-h_p + h_p_given_qx, abs=1e-12)
    assert mutual_information_loss(pi).item() < 0  # = -I(p; (q, x))
    # P = 1, or the same gate for every pair: no information, L_MI = 0
    assert mutual_information_loss(torch.ones(3, 5, 1)).item() == 0.0
    assert mutual_information_loss(pi[:1, :1].expand(4, 5, 4)).item() == pytest.approx(0.0, abs=1e-12)
    # sparse, balanced gates reach the minimum -log P; zero probabilities stay finite
    one_hot = torch.eye(4, dtype=torch.float64).reshape(2, 2, 4).requires_grad_(True)
    loss = mutual_information_loss(one_hot)
    assert loss.item() == pytest.approx(-math.log(4), abs=1e-9)
    loss.backward()
    assert torch.isfinite(one_hot.grad).all()
    assert entropy(torch.tensor([0.5, 0.5])).item() == pytest.approx(math.log(2))


# ------------------------------------------------------------------ the model


@pytest.mark.parametrize("fixture", ["tokens_model", "heads_model"])
@pytest.mark.parametrize("task", ["query", "document"])
def test_components_shapes_and_unit_norm(request, fixture, task):
    model = request.getfixturevalue(fixture)
    mol = find_mol(model)
    comps = encode_components(model, QUERIES if task == "query" else DOCS, task, batch_size=3)
    count = mol.num_query_components if task == "query" else mol.num_doc_components
    assert comps.dtype == np.float32 and comps.shape == (4, count, mol.component_dim)
    np.testing.assert_allclose(np.linalg.norm(comps, axis=-1), 1.0, atol=1e-6)
    assert encode_components(model, [], task).shape == (0, count, mol.component_dim)
    comps2, feats = encode_components(model, QUERIES if task == "query" else DOCS, task, return_features=True)
    assert feats is None  # gate_features=False: the gate takes no side features
    np.testing.assert_allclose(comps2, comps, atol=1e-5)  # batch composition does not matter
    assert (np.abs(comps[:, 0] - comps[:, 1]).max(-1) > 1e-3).all()  # components differ


def test_query_and_document_paths(tokens_model, base_model):
    single = encode_components(tokens_model, QUERIES[:1], "query")
    np.testing.assert_allclose(encode_components(tokens_model, QUERIES, "query")[:1], single, atol=1e-5)
    out = tokens_model.encode_query(QUERIES[:2], output_value=None)
    assert out[0][COMPONENTS_KEY].shape == (2, 8)
    assert COMPONENTS_KEY not in tokens_model.encode(QUERIES[:1], output_value=None)[0]  # no task: untouched
    # heads leave the encoder alone: sentence embeddings are the base model's
    heads = build_mol_model(base_model, 1, 2, component_dim=4, component_source="heads")
    np.testing.assert_allclose(heads.encode_document(DOCS), base_model.encode_document(DOCS), atol=1e-6)


def test_aggregation_tokens_in_every_input(tokens_model, base_model):
    tok = tokens_model.tokenizer
    agg = tok.convert_tokens_to_ids(["[MOL_Q1]", "[MOL_Q2]", "[MOL_X1]", "[MOL_X2]", "[MOL_X3]"])
    ids = tokens_model.preprocess(["hello world"])["input_ids"][0].tolist()
    assert ids == [tok.cls_token_id, *agg, *tok("hello world", add_special_tokens=False)["input_ids"], tok.sep_token_id]
    long_ids = tokens_model.preprocess(["word " * 1000])["input_ids"]
    assert long_ids.shape[1] == tokens_model.max_seq_length and long_ids[0, 1:6].tolist() == agg
    assert len(base_model.tokenizer) + 5 == len(tok)  # the base model's tokenizer is not touched
    assert "[MOL_Q1]" not in base_model.tokenizer.get_vocab()
    # each component starts as (mostly) its own aggregation token's output (App. A.2)
    mol = find_mol(tokens_model)
    with torch.no_grad():
        out = tokens_model(tokens_model.preprocess(QUERIES))
        for task, positions in (("query", [1, 2]), ("document", [3, 4, 5])):
            weights = mol.pooling_weights(out, task)
            assert (weights.argmax(-1) == torch.tensor(positions)).all() and (weights.max(-1).values > 0.9).all()
            torch.testing.assert_close(weights.sum(-1), torch.ones(4, len(positions)))


def test_inputs_without_aggregation_tokens_are_refused(tokens_model, base_model):
    plain = base_model.preprocess(QUERIES)  # the base tokenizer: no MoL tokens
    with torch.no_grad(), pytest.raises(ValueError, match="aggregation tokens at positions"):
        tokens_model(plain, task="query")


# ------------------------------------------------------------------ the loss


@pytest.mark.parametrize("columns", [(QUERIES, DOCS), (QUERIES, DOCS, NEGS)])
@pytest.mark.parametrize("alpha", [0.0, 0.001])
def test_loss_with_one_component_is_mnrl(base_model, columns, alpha):
    """P_q = P_x = 1: pi = 1, L_MI = 0; identity heads make phi the model's cosine, so MoLLoss = MNRL."""
    model = build_mol_model(base_model, 1, 1, component_dim=384, component_source="heads").eval()
    mol = find_mol(model)
    with torch.no_grad():
        for heads in (mol.query_heads, mol.doc_heads):
            heads.weight.copy_(torch.eye(384))
            heads.bias.zero_()
    ours = MoLLoss(model, alpha=alpha, scale=20.0)(features(model, *columns), None)
    ref = MultipleNegativesRankingLoss(model, scale=20.0)(features(model, *columns), None)
    assert ours.item() == pytest.approx(ref.item(), abs=1e-6)
    assert ours.item() > 0


def test_loss_with_constant_gate_is_mean_of_dots(heads_model):
    """At initialisation pi = 1 / P: phi is the mean of the P inner products and L_MI = 0 (Eq. 3-4)."""
    loss = MoLLoss(heads_model, alpha=0.5, scale=10.0)(features(heads_model, QUERIES, DOCS), None)
    q = torch.tensor(encode_components(heads_model, QUERIES, "query"))
    x = torch.tensor(encode_components(heads_model, DOCS, "document"))
    logits = 10.0 * component_dots_all(q, x).mean(-1)
    expected = torch.nn.functional.cross_entropy(logits, torch.arange(4))
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)


@pytest.mark.parametrize("source", ["tokens", "heads"])
def test_loss_with_hard_negatives_and_learned_gate(base_model, source):
    """Candidates are all positives, then every hard negative; the gate is learned and side-fed."""
    model = build_mol_model(
        base_model, 2, 2, component_dim=8, component_source=source, gate_features=source == "heads"
    ).eval()
    mol = find_mol(model)
    perturb(mol.gate_net, std=1.0)
    loss = MoLLoss(model, alpha=0.3, scale=15.0)(features(model, QUERIES, DOCS, NEGS), None)
    q, qf = encode_components(model, QUERIES, "query", return_features=True)
    x, xf = encode_components(model, DOCS + NEGS, "document", return_features=True)
    as_t = [None if a is None else torch.tensor(a) for a in (q, x, qf, xf)]
    with torch.no_grad():
        scores, gates = mol.mixture_all(*as_t)
    assert scores.shape == (4, 8) and gates.std() > 0.01
    expected = torch.nn.functional.cross_entropy(15.0 * scores, torch.arange(4)) + 0.3 * mutual_information_loss(gates)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    torch.testing.assert_close(mol.score_all(*as_t), scores)


def test_loss_gradients_reach_encoder_gate_and_tokens(tokens_model):
    mol = find_mol(tokens_model)
    tokens_model.zero_grad()
    MoLLoss(tokens_model, alpha=0.1)(features(tokens_model, QUERIES, DOCS), None).backward()
    assert mol.gate_net.out.weight.grad.abs().sum() > 0
    assert mol.query_pool.weight.grad.abs().sum() > 0 and mol.doc_proj.weight.grad.abs().sum() > 0
    emb_grad = tokens_model[0].auto_model.get_input_embeddings().weight.grad
    agg = mol.aggregation_token_ids
    assert (emb_grad[agg].abs().sum(-1) > 0).all()
    tokens_model.zero_grad()


def test_loss_config_citation_and_errors(heads_model, base_model):
    loss = MoLLoss(heads_model)
    assert loss.get_config_dict() == {"alpha": 0.001, "scale": 20.0, "gather_across_devices": False}
    assert "Retrieval with Learned Similarities" in loss.citation
    with pytest.raises(ValueError, match="no MixtureOfLogits"):
        MoLLoss(base_model)
    with pytest.raises(ValueError, match="alpha"):
        MoLLoss(heads_model, alpha=-1.0)
    with pytest.raises(ValueError, match="scale"):
        MoLLoss(heads_model, scale=float("nan"))
    with pytest.raises(ValueError, match="anchor, positive"):
        loss(features(heads_model, QUERIES), None)


# ------------------------------------------------------------------ errors


def test_build_errors(base_model):
    with pytest.raises(ValueError, match="num_query_components"):
        build_mol_model(base_model, 0, 2)
    with pytest.raises(ValueError, match="num_doc_components"):
        build_mol_model(base_model, 2, True)
    with pytest.raises(ValueError, match="component_dim"):
        build_mol_model(base_model, 2, 2, component_dim=0, component_source="heads")
    with pytest.raises(ValueError, match="component_source"):
        build_mol_model(base_model, 2, 2, component_source="cls")
    with pytest.raises(ValueError, match="already has a MixtureOfLogits"):
        build_mol_model(build_mol_model(base_model, 1, 1, component_dim=4, component_source="heads"))
    with pytest.raises(ValueError, match="do not fit"):
        build_mol_model(base_model, 200, 100, component_dim=4, max_positions=256)
    with pytest.raises(ValueError, match="need 2 query and 1 document"):
        MixtureOfLogits(2, 1, 4, 8, token_dim=8, max_positions=16, query_tokens=["[A]"], doc_tokens=["[B]"])
    with pytest.raises(ValueError, match="max_positions is for component_source='tokens' only"):
        MixtureOfLogits(2, 1, 4, 8, component_source="heads", max_positions=16)
    with pytest.raises(ValueError, match="no MixtureOfLogits"):
        find_mol(base_model)
    with pytest.raises(ValueError, match="no MixtureOfLogits"):
        encode_components(base_model, QUERIES, "query")


def test_scoring_errors(heads_model):
    mol = standalone(pq=2, px=3, d=5, features=True)
    q, x, qf, xf = unit(2, 2, 5), unit(2, 4, 3, 5), unit(2, 6), unit(2, 4, 6)
    with pytest.raises(ValueError, match=r"q_components must have shape \(B, 2, 5\)"):
        mol.score_candidates(unit(2, 3, 5), x, qf, xf)  # wrong P_q
    with pytest.raises(ValueError, match=r"x_components must have shape \(B, C, 3, 5\)"):
        mol.score_candidates(q, unit(2, 4, 2, 5), qf, xf)  # wrong P_x
    with pytest.raises(ValueError, match="P_q=2, P_x=3, d_P=5"):
        mol.gate(q, unit(2, 4, 3, 4), qf, xf)  # wrong d_P
    with pytest.raises(ValueError, match=r"x_components must have shape \(N, 3, 5\)"):
        mol.score_all(q, x, qf, xf)  # per-query candidates passed to score_all
    with pytest.raises(ValueError, match="candidates"):
        mol.score_candidates(q, unit(3, 4, 3, 5), qf, xf)
    bad = q.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        mol.score_candidates(bad, x, qf, xf)
    with pytest.raises(ValueError, match="NaN or infinite"):
        mol.score_all(q, torch.full((3, 3, 5), float("inf"), dtype=torch.float64), qf, unit(3, 6))
    with pytest.raises(ValueError, match="gate_features=True"):
        mol.score_candidates(q, x)
    with pytest.raises(ValueError, match=r"x_features must have shape \(2, 4, 6\)"):
        mol.score_candidates(q, x, qf, unit(2, 4, 7))
    with pytest.raises(ValueError, match="chunk_size"):
        mol.score_all(q, x[0], qf, xf[0], chunk_size=0)
    with pytest.raises(ValueError, match="task"):
        encode_components(heads_model, QUERIES, "passage")


# ------------------------------------------------------------------ save / load


@pytest.mark.parametrize("source", ["tokens", "heads"])
def test_save_load_roundtrip_is_exact(tmp_path, base_model, source):
    model = build_mol_model(base_model, 2, 3, component_dim=8, component_source=source, gate_features=True)
    perturb(find_mol(model), std=0.05)
    path = str(tmp_path / "model")
    model.save(path)
    assert not any(p.suffix == ".bin" for p in (tmp_path / "model").rglob("*"))
    loaded = load_model(path)
    mol, mol2 = find_mol(model), find_mol(loaded)
    assert mol2.get_config_dict() == mol.get_config_dict()
    q, qf = encode_components(model, QUERIES, "query", return_features=True)
    x, xf = encode_components(model, DOCS + NEGS, "document", return_features=True)
    q2, qf2 = encode_components(loaded, QUERIES, "query", return_features=True)
    x2, xf2 = encode_components(loaded, DOCS + NEGS, "document", return_features=True)
    for a, b in ((q, q2), (x, x2), (qf, qf2), (xf, xf2)):
        np.testing.assert_array_equal(a, b)
    s1 = mol.score_all(*map(torch.tensor, (q, x, qf, xf)))
    s2 = mol2.score_all(*map(torch.tensor, (q2, x2, qf2, xf2)))
    assert torch.equal(s1, s2)
    assert loaded.preprocess(["a"])["input_ids"].tolist() == model.preprocess(["a"])["input_ids"].tolist()


def _mol_dir(tmp_path):
    return next(p for p in (tmp_path / "model").iterdir() if p.is_dir() and "MixtureOfLogits" in p.name)


@pytest.fixture()
def saved_tokens_model(tmp_path, base_model):
    model = build_mol_model(base_model, 2, 2, component_dim=8)
    model.save(str(tmp_path / "model"))
    return str(tmp_path / "model")


def test_load_refuses_missing_weights(tmp_path, saved_tokens_model):
    (_mol_dir(tmp_path) / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        load_model(saved_tokens_model)


@pytest.mark.parametrize("key,value", [("component_dim", 16), ("num_doc_components", 3), ("gate_features", True)])
def test_load_refuses_shape_mismatch(tmp_path, saved_tokens_model, key, value):
    config_path = _mol_dir(tmp_path) / "config.json"
    config = json.loads(config_path.read_text())
    config[key] = value
    if key == "num_doc_components":
        config["doc_tokens"].append("[MOL_X3]")
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="do not match its config"):
        load_model(saved_tokens_model)


def test_load_refuses_tokenizer_without_the_tokens(tmp_path, saved_tokens_model):
    config_path = _mol_dir(tmp_path) / "config.json"
    config = json.loads(config_path.read_text())
    config["query_tokens"] = ["[OTHER_Q1]", "[OTHER_Q2]"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="lacks the MoL aggregation tokens"):
        load_model(saved_tokens_model)


# ------------------------------------------------------------------ training


@pytest.mark.slow
@pytest.mark.parametrize("source", ["tokens", "heads"])
def test_trainer_few_steps_then_save_load_identical(tmp_path, base_model, source):
    from datasets import Dataset
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments

    model = build_mol_model(base_model, 2, 2, component_dim=8, component_source=source, gate_features=True)
    train = Dataset.from_dict({"anchor": QUERIES * 2, "positive": DOCS * 2})
    args = tiny_training_args(SentenceTransformerTrainingArguments, tmp_path)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train, loss=MoLLoss(model, alpha=0.01))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(np.isfinite(losses))
    mol = find_mol(model)
    assert mol.gate_net.out.weight.abs().sum() > 0  # the trainer optimised the head saved with the model

    path = str(tmp_path / "trained")
    model.save(path)
    loaded = load_model(path)
    q, qf = encode_components(model, QUERIES, "query", return_features=True)
    x, xf = encode_components(model, DOCS, "document", return_features=True)
    q2, qf2 = encode_components(loaded, QUERIES, "query", return_features=True)
    x2, xf2 = encode_components(loaded, DOCS, "document", return_features=True)
    np.testing.assert_array_equal(q, q2)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(qf, qf2)
    np.testing.assert_array_equal(xf, xf2)
    s1 = mol.score_all(*map(torch.tensor, (q, x, qf, xf)))
    assert torch.equal(s1, find_mol(loaded).score_all(*map(torch.tensor, (q2, x2, qf2, xf2))))


def test_token_layer_offsets_train_under_partial_and_the_embedding_table_does_not(base_model, tmp_path):
    """The aggregation tokens' trainable inputs (token_layer = L - train_layers, above the cached layers) change in a
    few partial steps, the frozen embedding table does not; the offsets save and load with the model, and states
    cached after they moved still give the full model's outputs (the cache holds the states before them)."""
    from datasets import Dataset

    from pyterrier_prob.training import Recipe, fine_tune
    from st_extensions.partial import partial_model

    model = build_mol_model(base_model, 2, 2, component_dim=16, token_layer=5, seed=0, device="cpu")
    model.max_seq_length = 32
    mol, table = find_mol(model), model[0].auto_model.get_input_embeddings().weight.detach().clone()
    assert torch.equal(mol.token_shift, torch.zeros(4, 384))
    rows = Dataset.from_dict({"anchor": QUERIES * 2, "positive": DOCS * 2})
    recipe = Recipe(mode="partial", train_layers=1, steps=3, batch_size=4)
    fine_tune(model, MoLLoss(model), rows, recipe, output_dir=str(tmp_path / "run"), show_progress=False)
    assert mol.token_shift.abs().sum() > 0  # the token inputs trained ...
    assert torch.equal(model[0].auto_model.get_input_embeddings().weight, table)  # ... the embedding table did not
    model.save(str(tmp_path / "m"))
    loaded = load_model(str(tmp_path / "m"), device="cpu")
    assert torch.equal(find_mol(loaded).token_shift, mol.token_shift)
    texts = ["a text no cache has seen", "another new one"]
    full = encode_components(loaded, texts, "document")
    np.testing.assert_allclose(encode_components(model.eval(), texts, "document"), full, atol=1e-6)
    stand_in = partial_model(loaded, 1, dtype="float32").eval()
    np.testing.assert_allclose(encode_components(stand_in, texts, "document"), full, atol=1e-4)


def test_token_layer_below_the_trained_layers_or_with_heads_is_refused(base_model):
    from st_extensions.partial import partial_model

    low = build_mol_model(base_model, 2, 2, component_dim=16, token_layer=2, seed=0, device="cpu")
    with pytest.raises(ValueError, match="hooks the cache cannot hold"):
        partial_model(low, 1)
    with pytest.raises(ValueError, match="token_layer"):
        build_mol_model(base_model, 2, 2, component_source="heads", token_layer=0, device="cpu")
    with pytest.raises(ValueError, match="token_layer"):
        build_mol_model(base_model, 2, 2, component_dim=16, token_layer=6, device="cpu")


def test_state_cache_folder_follows_the_states(base_model, tmp_path):
    """The harness keeps one layer-state folder per set of states: the same for models whose frozen part is the same
    (pooled heads on the base model, its copy), another for MoL's aggregation tokens or another split point."""
    from pyterrier_prob.experiments.harness import CommonConfig, Harness
    from pyterrier_prob.training import Recipe

    h = Harness("t", CommonConfig(output=str(tmp_path / "o"), quiet=True))
    top2 = Recipe(mode="partial", train_layers=2, steps=1, batch_size=4)
    base = copy.deepcopy(base_model)
    heads = build_mol_model(base_model, 2, 2, component_source="heads", component_dim=8, seed=0, device="cpu")
    tokens = build_mol_model(base_model, 2, 2, component_dim=16, token_layer=4, seed=0, device="cpu")
    for m in (base, heads, tokens):
        m.max_seq_length = 128  # as the harness sets it before training
    path = h.state_cache_path(top2, base)
    assert path == h.state_cache_path(top2, heads)
    assert path.startswith(h.path("cache", "states-minilm-128-top2-"))
    assert h.state_cache_path(top2, tokens) != path
    assert h.state_cache_path(Recipe(mode="partial", train_layers=1, steps=1, batch_size=4), base) != path
