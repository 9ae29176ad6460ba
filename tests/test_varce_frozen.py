"""Frozen-backbone training of the (Var)CrossEncoder heads on cached [CLS] features (st_extensions.cross_encoder.frozen)
and the cycling of relevant documents in the re-ranker training rows."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pytest
import torch
from datasets import Dataset
from sentence_transformers import CrossEncoder
from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

from st_extensions import load_model
from st_extensions.cross_encoder import VarCrossEncoder, build_var_cross_encoder
from st_extensions.cross_encoder.frozen import (
    CachedPairFeatures,
    build_cross_encoder,
    cached_cross_encoder,
    pair_prefix_length,
)
from st_extensions.losses import VariationalBCELoss

PAIRS = [
    ("what causes fever", "Fever is usually caused by an infection."),
    ("what causes fever", "The stock market fell sharply on Monday, dragging every index down with it."),
    ("vitamin d deficiency", "Low vitamin D levels are common in winter."),
    ("vitamin d deficiency", "Paris is the capital of France."),
]
ROWS = Dataset.from_dict(
    {
        "query": [q for q, _ in PAIRS] * 2,
        "document": [d for _, d in PAIRS] * 2,
        "label": [1.0, 0.0, 1.0, 0.0] * 2,
    }
)
KINDS = ["VarCE", "CE"]


def _build(base_model, kind: str) -> CrossEncoder:
    torch.manual_seed(0)
    if kind == "CE":
        return build_cross_encoder(base_model, max_seq_length=64, device="cpu")
    model = build_var_cross_encoder(base_model, variant="MEANVAR", max_seq_length=64, device="cpu")
    with torch.no_grad():  # some input dependence of the variance, as after training
        model.head.var_branch.weight.normal_(0, 0.05)
    return model


def _loss(kind: str, model: CrossEncoder):
    return VariationalBCELoss(model, beta=1e-7) if kind == "VarCE" else BinaryCrossEntropyLoss(model)


@pytest.mark.parametrize("kind", KINDS)
def test_cached_scores_equal_the_full_model(base_model, kind, tmp_path):
    model = _build(base_model, kind)
    cached = cached_cross_encoder(model, PAIRS[:3])  # the 4th pair: computed by the backbone on first use
    assert type(cached) is type(model) and isinstance(cached[0], CachedPairFeatures)
    assert list(cached)[1:] == list(model)[pair_prefix_length(model) :]  # the head is shared, not copied
    assert all(a is b for a, b in zip(list(cached)[1:], list(model)[2:]))
    full = model.predict(PAIRS)
    np.testing.assert_allclose(cached.predict(PAIRS), full, atol=1e-5)
    np.testing.assert_allclose(cached.predict([list(p) for p in PAIRS], batch_size=3), full, atol=1e-5)
    assert len(cached[0].index) == len(PAIRS)
    if kind == "VarCE":
        mean, std = model.predict(PAIRS, return_std=True)
        c_mean, c_std = cached.predict(PAIRS, return_std=True)
        np.testing.assert_allclose(c_mean, mean, atol=1e-5)
        np.testing.assert_allclose(c_std, std, atol=1e-5)
    # one cache serves another model on the same backbone; the cache file keeps the pair keys
    other = cached_cross_encoder(_build(base_model, kind), cache=cached[0])
    assert other[0] is cached[0]
    cached[0].save_cache(str(tmp_path / "pairs.safetensors"))
    again = CachedPairFeatures.load_cache(str(tmp_path / "pairs.safetensors"))
    assert again.index == cached[0].index and torch.equal(again.table, cached[0].table)


def test_cache_refuses_what_it_cannot_hold(base_model, minilm_path):
    model = _build(base_model, "VarCE")
    cached = cached_cross_encoder(model, PAIRS)
    cached[0].encoder[0] = None
    with pytest.raises(KeyError, match="not in the frozen-encoder cache"):
        cached.predict([("an unseen query", "an unseen document")])
    with pytest.raises(ValueError, match="single texts"):
        cached(cached.preprocess(["a text without its pair"]))
    seq_cls = CrossEncoder(minilm_path, num_labels=1, device="cpu")  # the classifier sits inside the transformer
    with pytest.raises(ValueError, match="build_cross_encoder"):
        cached_cross_encoder(seq_cls, PAIRS)


@pytest.fixture(scope="module", params=KINDS)
def trained(request, base_model):
    """A model whose head was trained for 3 steps through its cached model: (kind, model, cached, state before)."""
    from pyterrier_prob.training import Recipe, fine_tune

    kind = request.param
    model = _build(base_model, kind)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cached = cached_cross_encoder(model, list(zip(ROWS["query"], ROWS["document"])))
    losses = fine_tune(
        cached,
        _loss(kind, cached),
        ROWS,
        Recipe(mode="full", steps=3, batch_size=4, learning_rate=1e-3),
        show_progress=False,
    )
    assert len(losses) == 3 and all(np.isfinite(losses))
    return kind, model, cached, before


def test_training_the_cached_model_trains_the_head_only(trained):
    kind, model, _, before = trained
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    head = {k for k in before if k.startswith("2.")}
    assert head and changed == head, f"changed {sorted(changed)}"  # every head tensor moved, no backbone one


def test_saved_model_reproduces_the_cached_scores(trained, tmp_path):
    kind, model, cached, _ = trained
    model.save(str(tmp_path / kind))
    loaded = load_model(str(tmp_path / kind), device="cpu")
    assert type(loaded) is (VarCrossEncoder if kind == "VarCE" else CrossEncoder)
    np.testing.assert_allclose(loaded.predict(PAIRS), cached.predict(PAIRS), atol=1e-5)
    identity = torch.nn.Identity()
    np.testing.assert_allclose(
        loaded.predict(PAIRS, activation_fn=identity), cached.predict(PAIRS, activation_fn=identity), atol=1e-5
    )
    if kind == "VarCE":
        np.testing.assert_allclose(
            np.stack(loaded.predict(PAIRS, return_std=True)),
            np.stack(cached.predict(PAIRS, return_std=True)),
            atol=1e-5,
        )


@pytest.mark.parametrize("kind", KINDS)
def test_fine_tune_under_the_frozen_recipe_trains_only_the_head(kind, base_model):
    """``fine_tune(cross_encoder, ..., Recipe(mode="frozen"))`` trains the head on cached [CLS] features of the
    training pairs (``encoder_cache``, reused and extended): every head tensor moves, no backbone one."""
    from pyterrier_prob.training import Recipe, fine_tune

    model = _build(base_model, kind)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cache = cached_cross_encoder(_build(base_model, kind), PAIRS[:2])[0]  # a cache of the same backbone
    recipe = Recipe(mode="frozen", steps=3, batch_size=4, learning_rate=1e-3, head_learning_rate=1e-2)
    losses = fine_tune(model, _loss(kind, model), ROWS, recipe, encoder_cache=cache, show_progress=False)
    assert len(losses) == 3 and all(np.isfinite(losses))
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    head = {k for k in before if k.startswith("2.")}
    assert head and changed == head, f"changed {sorted(changed)}"
    assert len(cache.index) == len(PAIRS)  # the cache was extended with the pairs it lacked
    assert all(p.requires_grad for p in model.parameters())


def test_relevant_documents_cycle_before_repeating(small_beir):
    """Each query's relevant documents come in a seeded order that visits all of them before any repeats."""
    from pyterrier_prob.collections import load_collection
    from pyterrier_prob.varce.data import cross_encoder_training_data, normalise_query

    coll = load_collection(small_beir[0])
    topics, qrels = coll.topics("train"), coll.qrels("train")
    qid_of = {normalise_query(q): str(i) for i, q in zip(topics["qid"], topics["query"])}
    relevant = qrels[qrels["label"] >= 1].groupby("qid")["docno"].apply(set).to_dict()
    texts = coll.doc_texts({d for ds in relevant.values() for d in ds})
    n = len(topics)

    def nothing(topics):  # no first stage: random negatives (the positives are what is tested)
        return pd.DataFrame({"qid": pd.Series(dtype=str), "docno": pd.Series(dtype=str), "rank": []})

    rows, info = cross_encoder_training_data(coll, "train", nothing, n_groups=7 * n, negatives=1, seed=3)
    frame = rows.to_pandas()
    positives: dict[str, list[str]] = {}
    for q, d in zip(frame["query"][::2], frame["document"][::2]):
        positives.setdefault(qid_of[q], []).append(d)
    assert len(positives) == n and all(len(p) == 7 for p in positives.values())  # each query once per round
    several = 0
    for qid, seq in positives.items():
        docs = {texts[d] for d in relevant[str(qid)] if d in texts}
        k = len(docs)
        several += k > 1
        assert set(seq[:k]) == docs, f"query {qid}: not every relevant document before a repeat"
        assert seq == [seq[i % k] for i in range(len(seq))], f"query {qid}: the cycle is not kept across rounds"
    assert several >= 5  # the collection has queries with several relevant documents (up to 6)
    again, _ = cross_encoder_training_data(coll, "train", nothing, n_groups=7 * n, negatives=1, seed=3)
    assert again.to_dict() == rows.to_dict()  # seeded


@pytest.mark.parametrize("kind", KINDS)
def test_partial_recipe_trains_the_top_layer_and_the_head_of_a_cross_encoder(kind, base_model, tmp_path):
    """``fine_tune`` under ``Recipe(mode="partial", train_layers=1)`` on a cross-encoder: the pair states below the
    top layer are cached, only the top layer and the head move, and the lower layers train again afterwards."""
    from pyterrier_prob.training import Recipe, fine_tune

    model = _build(base_model, kind)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    recipe = Recipe(mode="partial", train_layers=1, steps=2, batch_size=4, learning_rate=1e-3)
    fine_tune(model, _loss(kind, model), ROWS, recipe, state_cache=str(tmp_path / "states"), show_progress=False)
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(".layer.5." in k or not k.startswith("0.") for k in changed), sorted(changed)
    assert any(".layer.5." in k for k in changed) and any(not k.startswith("0.") for k in changed)
    assert all(p.requires_grad for p in model.parameters())
    assert os.listdir(tmp_path / "states")
