"""Training recipes (#12): query-balanced batches, judged-negative masking, head learning rates, frozen mode."""

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset

from st_extensions.frozen import CachedEmbeddings, build_adapter_model, cached_model, frozen_prefix_length
from st_extensions.judged import JudgedPairs, pair_labels, text_key
from st_extensions.sampler import QueryBalancedBatchSampler


def _rows(n_queries=12, seed=0):
    """Queries with 1..5 relevant documents; some documents relevant to several queries."""
    rng = random.Random(seed)
    anchors, positives = [], []
    for q in range(n_queries):
        for d in rng.sample(range(20), 1 + q % 5):
            anchors.append(f"query {q}")
            positives.append(f"document {d}")
    return anchors, positives


def test_judged_mask_matches_brute_force():
    anchors, positives = _rows()
    judged = JudgedPairs(zip(anchors, positives))
    pairs = set(zip(anchors, positives))
    rng = random.Random(1)
    idx = rng.sample(range(len(anchors)), 10)
    labels = torch.tensor(pair_labels([anchors[i] for i in idx], [positives[i] for i in idx]))
    mask = judged.mask(labels, 13)
    assert mask.shape == (10, 13) and not mask[:, 10:].any()
    for i in range(10):
        for j in range(10):
            assert bool(mask[i, j]) == (i != j and (anchors[idx[i]], positives[idx[j]]) in pairs)
    assert mask.any()  # the fixture has shared documents / repeated queries, so something is masked
    assert judged.mask(None, 13) is None
    with pytest.raises(ValueError, match="label column"):
        judged.mask(torch.zeros(10), 10)
    assert text_key("abc") == text_key("abc") != text_key("abd")


def _brute_masked_ce(logits: torch.Tensor, forbidden: set[tuple[int, int]]) -> float:
    total = 0.0
    for i in range(logits.shape[0]):
        kept = [logits[i, j].item() for j in range(logits.shape[1]) if (i, j) not in forbidden]
        total += -(logits[i, i].item() - math.log(sum(math.exp(v) for v in kept)))
    return total / logits.shape[0]


def _cached(model, texts, dim=384, seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = F.normalize(torch.randn(len(texts), dim, generator=g), dim=-1)
    return cached_model(model, cache=CachedEmbeddings(texts, emb))


@pytest.mark.parametrize("which", ["mnrl", "expnce", "betance", "mol"])
def test_masked_losses_equal_brute_force_masked_cross_entropy(which, base_model):
    from st_extensions import build_mol_model, build_pebr_model
    from st_extensions.losses import BetaNCELoss, ExpNCELoss, MaskedMultipleNegativesRankingLoss, MoLLoss

    anchors = ["q0", "q1", "q2", "q3", "q4"]
    positives = ["d0", "d1", "d0", "d3", "d4"]  # d0 is relevant to q0 and q2
    judged = JudgedPairs([*zip(anchors, positives), ("q1", "d3"), ("q4", "d1")])
    if which == "mnrl":
        model = build_adapter_model(base_model)
        loss_cls = MaskedMultipleNegativesRankingLoss
    elif which == "mol":
        model = build_mol_model(base_model, 2, 2, component_source="heads", component_dim=16)
        loss_cls = MoLLoss
    else:
        model = build_pebr_model(base_model, family="exp" if which == "expnce" else "beta")
        with torch.no_grad():  # make tau_q query dependent
            torch.nn.init.normal_(model[-1].linear.weight, std=0.01)
        loss_cls = ExpNCELoss if which == "expnce" else BetaNCELoss
    cm = _cached(model, anchors + sorted(set(positives)))
    kwargs = {"alpha": 0.0} if which == "mol" else {}
    loss = loss_cls(cm, judged=judged, **kwargs)
    plain = loss_cls(cm, **kwargs)
    feats = [cm.preprocess(anchors), cm.preprocess(positives)]
    labels = torch.tensor(pair_labels(anchors, positives))
    got = loss(feats, labels).item()
    # brute force: the unmasked logits (from the plain loss's own pieces), then a hand-written masked CE
    with torch.no_grad():
        if which == "mnrl":
            q, d = cm(cm.preprocess(anchors))["sentence_embedding"], cm(cm.preprocess(positives))["sentence_embedding"]
            logits = 20.0 * F.normalize(q, dim=-1) @ F.normalize(d, dim=-1).T
        elif which == "mol":
            scores, _ = plain.scores_and_gates(feats)
            logits = 20.0 * scores
        else:
            cos, params = plain.cosines_and_params(feats)
            logits = (cos if which == "expnce" else plain.log_z(cos)) / params[:, :1]
    pairs = set(judged_pairs_list := [*zip(anchors, positives), ("q1", "d3"), ("q4", "d1")])
    forbidden = {(i, j) for i in range(5) for j in range(5) if i != j and (anchors[i], positives[j]) in pairs}
    assert forbidden == {(0, 2), (2, 0), (1, 3), (4, 1)} and len(judged_pairs_list) == 7
    assert got == pytest.approx(_brute_masked_ce(logits, forbidden), rel=1e-5)
    assert plain(feats, labels).item() == pytest.approx(_brute_masked_ce(logits, set()), rel=1e-5)
    assert got < plain(feats, labels).item()


def test_unierf_infonce_is_masked(base_model):
    from st_extensions import build_unierf_model
    from st_extensions.losses import UniERFLoss

    model = build_unierf_model(base_model, branches=("semantic",))
    anchors, positives = ["q0", "q1", "q2"], ["d0", "d1", "d0"]
    cm = _cached(model, anchors + ["d0", "d1"])
    judged = JudgedPairs(zip(anchors, positives))
    cols = ["anchor_semantic", "positive_doc"]
    kw = dict(columns=cols, use_positive=False, use_triplet=False, use_diversity=False)
    feats = [cm.preprocess(anchors), cm.preprocess(positives)]
    labels = torch.tensor(pair_labels(anchors, positives))
    masked = UniERFLoss(cm, judged=judged, **kw).loss_terms(feats, labels)["infonce"].item()
    with torch.no_grad():
        h = model[-1].embed(cm(cm.preprocess(anchors))["sentence_embedding"], "semantic")
        d = F.normalize(cm(cm.preprocess(positives))["sentence_embedding"], dim=-1)
        logits = h @ d.T / 0.05
    assert masked == pytest.approx(_brute_masked_ce(logits, {(0, 2), (2, 0)}), rel=1e-5)


def test_balanced_batches_have_distinct_queries_and_cycle_documents():
    anchors, positives = _rows(n_queries=12)
    ds = Dataset.from_dict({"anchor": anchors, "positive": positives, "label": pair_labels(anchors, positives)})
    sampler = QueryBalancedBatchSampler(ds, batch_size=4, drop_last=True, seed=3)
    assert len(sampler) == 3
    seen: dict[str, list[str]] = {}
    for _epoch in range(10):
        batches = list(sampler)
        assert len(batches) == 3
        rows = [i for b in batches for i in b]
        assert len({anchors[i] for i in rows}) == 12  # every query once per epoch
        for b in batches:
            assert len({anchors[i] for i in b}) == len(b) == 4
        for i in rows:
            seen.setdefault(anchors[i], []).append(positives[i])
    for q in set(anchors):  # each query's documents cycled: all of them appear, each as often (+-1)
        docs = [p for a, p in zip(anchors, positives) if a == q]
        counts = [seen[q].count(d) for d in set(docs)]
        assert set(seen[q]) == set(docs) and max(counts) - min(counts) <= 1
    # without a label column the first column groups the rows
    plain = QueryBalancedBatchSampler(ds.select_columns(["anchor", "positive"]), 4, True, seed=3)
    assert [len({anchors[i] for i in b}) for b in plain] == [4, 4, 4]
    with pytest.raises(ValueError, match="distinct queries"):
        QueryBalancedBatchSampler(ds, batch_size=13, drop_last=True)


def test_frozen_mode_trains_heads_and_matches_the_full_forward_and_round_trips(base_model, small_beir, tmp_path):
    from pyterrier_prob.collections import load_collection
    from pyterrier_prob.data import judged_pairs, training_pairs
    from pyterrier_prob.training import Recipe, fine_tune, head_learning_rates
    from st_extensions import build_pebr_model, load_model
    from st_extensions.losses import BetaNCELoss

    coll = load_collection(small_beir[0])
    train = training_pairs(coll, "train")
    model = build_pebr_model(base_model, family="beta", projection=True)
    assert frozen_prefix_length(model) == 3
    encoder_before = {k: v.clone() for k, v in model[0].state_dict().items()}
    loss = BetaNCELoss(model, judged=judged_pairs(coll, "train"))
    mapping = head_learning_rates(model, loss)
    assert mapping and all(".auto_model." not in k for k in mapping)
    assert sorted(mapping.values()) == sorted([model[3].learning_rate] * 2 + [model[4].learning_rate] * 2)
    losses = fine_tune(model, loss, train, Recipe(mode="frozen", steps=30, batch_size=8), show_progress=False)
    assert len(losses) == 30 and all(np.isfinite(losses))
    assert loss.model is model  # the stand-in is gone after training
    for k, v in model[0].state_dict().items():
        assert torch.equal(v, encoder_before[k])  # the encoder did not move
    assert model[3].linear.weight.abs().sum() > 0 and model[4].linear.weight.abs().sum() > 0
    texts = list(train["anchor"][:6])
    full = model.encode_query(texts, output_value=None)
    cm = cached_model(model, texts)
    stand_in = cm.encode_query(texts, output_value=None)
    for a, b in zip(full, stand_in):
        torch.testing.assert_close(a["sentence_embedding"], b["sentence_embedding"], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(a["query_distribution"], b["query_distribution"], atol=1e-5, rtol=1e-4)
    model.save(str(tmp_path / "m"))
    loaded = load_model(str(tmp_path / "m"))
    again = loaded.encode_query(texts, output_value=None)
    for a, b in zip(full, again):
        torch.testing.assert_close(a["sentence_embedding"], b["sentence_embedding"])
        torch.testing.assert_close(a["query_distribution"], b["query_distribution"])
    docs = list(train["positive"][:4])
    np.testing.assert_allclose(model.encode_document(docs), loaded.encode_document(docs), atol=1e-6)


def test_module_learning_rates_by_class(base_model, small_beir):
    """A recipe's per-class rate: 0 keeps the adapter exactly as built while the head trains; the mapping names
    each class's parameters with its rate; an unknown class is an error naming it."""
    from pyterrier_prob.collections import load_collection
    from pyterrier_prob.data import judged_pairs, training_pairs
    from pyterrier_prob.training import Recipe, fine_tune, head_learning_rates
    from st_extensions import build_pebr_model
    from st_extensions.losses import BetaMLELoss

    coll = load_collection(small_beir[0])
    model = build_pebr_model(base_model, family="beta_mle", projection=True)
    loss = BetaMLELoss(model, judged=judged_pairs(coll, "train"))
    rates = head_learning_rates(model, loss, {"LinearAdapter": 0.0}, default=1e-3)
    assert sorted(rates.values()) == [0.0, 0.0, 1e-3, 1e-3]
    assert all(v == 0.0 for k, v in rates.items() if ".3.linear." in k)
    with pytest.raises(ValueError, match="MixtureOfLogits"):
        head_learning_rates(model, loss, {"MixtureOfLogits": 1e-3})
    adapter, head = model[3].linear.weight.clone(), model[4].linear.weight.clone()
    train = training_pairs(coll, "train")
    fine_tune(
        model,
        loss,
        train,
        Recipe(mode="frozen", steps=10, batch_size=8, module_learning_rates={"LinearAdapter": 0.0}),
        show_progress=False,
    )
    assert torch.equal(model[3].linear.weight, adapter) and not torch.equal(model[4].linear.weight, head)


def test_cached_embeddings_errors_and_cache_round_trip(tmp_path):
    cache = CachedEmbeddings(["a", "b"], torch.eye(2))
    with pytest.raises(KeyError, match="not in the frozen-encoder cache"):
        cache.preprocess(["c"])
    cache.extend(["c"], torch.ones(1, 2))
    cache.save_cache(str(tmp_path / "c.safetensors"))
    back = CachedEmbeddings.load_cache(str(tmp_path / "c.safetensors"))
    assert back.index == {"a": 0, "b": 1, "c": 2} and torch.equal(back.table, cache.table)
    with pytest.raises(ValueError, match="encoder prefix"):
        frozen_prefix_length(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_recipe_description_names_the_rates_that_train():
    """Under frozen nothing trains at the encoder's rate: the description names the added modules' rates only."""
    from pyterrier_prob.training import Recipe

    frozen = Recipe("frozen", 10, 4, 5e-5).describe()
    assert frozen.endswith("10 steps of 4, the added modules at their declared rates.") and "5e-05" not in frozen
    assert Recipe("frozen", 10, 4, 5e-5, head_learning_rate=1e-3).describe().endswith("the added modules at 0.001.")
    partial = Recipe("partial", 10, 4, 5e-5, train_layers=1).describe()
    assert partial.endswith("10 steps of 4 at lr 5e-05 (added modules at their declared rates).")
