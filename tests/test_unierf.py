"""UniERF (issue #6): branch heads, the loss of Eq. 28-32, differentiated negatives, merged multi-branch retrieval."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pandas as pd
import pyterrier as pt
import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_training_args
from torch import nn

from pyterrier_prob import DenseIndex, MultiBranchRetriever, TriggerText, UniERFEncoder
from pyterrier_prob.unierf.analysis import merged_run
from pyterrier_prob.unierf.branches import branch_quotas, merge_branch_lists, query_vec_column, unierf_training_data
from st_extensions import (
    MultiBranchQueryEncoder,
    branch_text,
    build_unierf_dataset,
    build_unierf_model,
    encode_branches,
    load_model,
    unierf_columns,
)
from st_extensions.losses import UniERFLoss
from st_extensions.losses.unierf import diversity_loss
from st_extensions.unierf import parse_unierf_columns

BRANCHES = ["semantic", "trigger"]

# --------------------------------------------------------------------------------------------------------
# the module
# --------------------------------------------------------------------------------------------------------


def test_module_outputs_are_normalised_and_start_near_identity():
    head = MultiBranchQueryEncoder(16, ["a", "b", "c"], init_std=0.01, seed=3)
    e = torch.randn(5, 16)
    all_ = head.embed(e)
    assert all_.shape == (5, 3, 16)
    torch.testing.assert_close(all_.norm(dim=-1), torch.ones(5, 3))
    torch.testing.assert_close(head.embed(e, "b"), all_[:, 1])
    # identity plus small noise: every branch starts close to the normalised input, but not equal to the others
    cos = (all_ * F.normalize(e, dim=-1)[:, None]).sum(-1)
    assert cos.min() > 0.95
    assert not torch.allclose(all_[:, 0], all_[:, 1])
    exact = MultiBranchQueryEncoder(16, ["a"], init_std=0.0)
    torch.testing.assert_close(exact.embed(e, "a"), F.normalize(e, dim=-1))


def test_module_forward_query_path_only():
    head = MultiBranchQueryEncoder(8, ["a", "b"])
    e = torch.randn(3, 8)
    out = head({"sentence_embedding": e.clone()}, task="query")
    assert out["branch_embeddings"].shape == (3, 2, 8)
    torch.testing.assert_close(out["sentence_embedding"], e)  # unchanged without branch=
    doc = head({"sentence_embedding": e.clone()}, task="document")
    assert "branch_embeddings" not in doc
    picked = head({"sentence_embedding": e.clone()}, task="query", branch="b")
    torch.testing.assert_close(picked["sentence_embedding"], head.embed(e, "b"))
    with pytest.raises(ValueError, match="document path"):
        head({"sentence_embedding": e.clone()}, task="document", branch="b")


def test_module_errors():
    with pytest.raises(ValueError, match="at least one"):
        MultiBranchQueryEncoder(8, [])
    with pytest.raises(ValueError, match="no underscores"):
        MultiBranchQueryEncoder(8, ["semantic_2"])
    with pytest.raises(ValueError, match="reserved"):
        MultiBranchQueryEncoder(8, ["random"])
    with pytest.raises(ValueError, match="distinct"):
        MultiBranchQueryEncoder(8, ["a", "a"])
    with pytest.raises(ValueError, match="sequence of names"):
        MultiBranchQueryEncoder(8, "semantic")
    with pytest.raises(ValueError, match="positive int"):
        MultiBranchQueryEncoder(0, ["a"])
    head = MultiBranchQueryEncoder(8, ["a", "b"])
    with pytest.raises(ValueError, match="unknown branch 'c'"):
        head.embed(torch.randn(2, 8), "c")
    with pytest.raises(ValueError, match=r"shape \(batch, 8\)"):
        head.embed(torch.randn(2, 9))


# --------------------------------------------------------------------------------------------------------
# model, encoding, save / load
# --------------------------------------------------------------------------------------------------------

TEXTS = {
    "semantic": ["statins and breast cancer", "vitamin d"],
    "trigger": [branch_text(["vitamin d", "Vitamin D supplements and bone health in the elderly."])],
}


@pytest.fixture(scope="module")
def unierf_model(base_model):
    return build_unierf_model(base_model, branches=BRANCHES, init_std=0.05, seed=1, device="cpu")


def test_documents_use_the_shared_tower_queries_get_branches(unierf_model, base_model):
    docs = ["Statins lower cholesterol.", "Vitamin D and bones."]
    np.testing.assert_allclose(unierf_model.encode_document(docs), base_model.encode_document(docs), atol=1e-6)
    emb = encode_branches(unierf_model, TEXTS)
    assert {b: v.shape for b, v in emb.items()} == {"semantic": (2, 384), "trigger": (1, 384)}
    for v in emb.values():
        assert v.dtype == np.float32
        np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    # encode_branches = the head applied to the base model's pooled query embedding
    head = unierf_model[-1]
    pooled = torch.from_numpy(base_model.encode_query(TEXTS["semantic"]))
    np.testing.assert_allclose(emb["semantic"], head.embed(pooled, "semantic").detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(
        unierf_model.encode_query(TEXTS["semantic"], branch="semantic"), emb["semantic"], atol=1e-6
    )
    # branches differ: different heads
    other = encode_branches(unierf_model, {"trigger": TEXTS["semantic"]})["trigger"]
    assert not np.allclose(other, emb["semantic"], atol=1e-3)
    assert encode_branches(unierf_model, {"semantic": []})["semantic"].shape == (0, 384)


def test_encode_branches_errors(unierf_model, base_model):
    with pytest.raises(ValueError, match="unknown branch 'context'"):
        encode_branches(unierf_model, {"context": ["q"]})
    with pytest.raises(ValueError, match="single string"):
        encode_branches(unierf_model, {"semantic": "q"})
    with pytest.raises(ValueError, match="no MultiBranchQueryEncoder"):
        encode_branches(base_model, {"semantic": ["q"]})
    with pytest.raises(ValueError, match="already has"):
        build_unierf_model(unierf_model)
    with pytest.raises(ValueError, match="no underscores"):
        build_unierf_model(base_model, branches=["my_branch"])


def test_save_load_roundtrip_gives_identical_branch_embeddings(tmp_path, unierf_model):
    path = str(tmp_path / "unierf")
    unierf_model.save(path)
    reloaded = load_model(path, device="cpu")
    head = reloaded[-1]
    assert isinstance(head, MultiBranchQueryEncoder) and head.branches == BRANCHES
    before, after = encode_branches(unierf_model, TEXTS), encode_branches(reloaded, TEXTS)
    for b in TEXTS:
        np.testing.assert_array_equal(after[b], before[b])
    assert not any(p.name.endswith(".bin") for p in (tmp_path / "unierf").rglob("*"))


def test_load_refuses_mismatched_head_weights(tmp_path, unierf_model):
    import json

    path = tmp_path / "unierf"
    unierf_model.save(str(path))
    head_dir = next(p for p in path.iterdir() if p.name.endswith("MultiBranchQueryEncoder"))
    config = json.loads((head_dir / "config.json").read_text())
    config["branches"] = ["semantic", "trigger", "context"]
    (head_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="do not match"):
        load_model(str(path))
    config["branches"], config["in_features"] = BRANCHES, 128
    (head_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="do not match"):
        load_model(str(path))


# --------------------------------------------------------------------------------------------------------
# the loss, term by term against Eq. 28-32
# --------------------------------------------------------------------------------------------------------


def _unit(rng, *shape):
    x = rng.standard_normal(shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _hand_terms(H, P, negs, tags, beta, gamma, tau, tau_div, delta, alpha):
    """Eq. 28-31 element by element (numpy): H branch -> (B, d), P (B, d), negs [(B, d)] with tags."""
    B = len(P)
    pos_l = trip_l = info_l = 0.0
    for b, h in H.items():
        pool = [P[j] for j in range(B)]
        for n, t in zip(negs, tags):
            if t is None or t == b:
                pool += [n[j] for j in range(B)]
        pos_b, trip, info = 0.0, [], 0.0
        for i in range(B):
            s_pos = float(h[i] @ P[i])
            pos_b += max(beta - s_pos, 0.0)  # Eq. 28
            others = [float(h[i] @ c) for k, c in enumerate(pool) if k != i]
            trip += [max(s - s_pos + gamma, 0.0) for s in others]  # Eq. 29
            info += -math.log(math.exp(s_pos / tau) / sum(math.exp(float(h[i] @ c) / tau) for c in pool))  # Eq. 30
        pos_l += pos_b / B
        trip_l += sum(trip) / len(trip) if trip else 0.0
        info_l += info / B
    names = list(H)
    div = 0.0
    for i in range(B):
        total = 1.0
        for a in range(len(names)):
            for c in range(a + 1, len(names)):
                s = float(H[names[a]][i] @ H[names[c]][i])
                total += math.exp(tau_div * max(s - alpha, 0.0) * (s - delta))  # Eq. 31
        div += math.log(total)
    return {"positive": pos_l, "triplet": trip_l, "infonce": info_l, "diversity": div / B}


def _standin(branches, dim=8, init_std=0.0):
    """A model with a MultiBranchQueryEncoder that passes ``sentence_embedding`` through (no encoder)."""
    return nn.Sequential(MultiBranchQueryEncoder(dim, branches, init_std=init_std))


def _features(*arrays):
    return [{"sentence_embedding": torch.tensor(a, dtype=torch.float64).float()} for a in arrays]


HYPER = dict(beta=0.5, gamma=0.1, tau=0.05, tau_div=32.0, delta=0.8, alpha=0.6)


def _loss(model, **kw):
    return UniERFLoss(
        model,
        positive_threshold=HYPER["beta"],
        triplet_margin=HYPER["gamma"],
        temperature=HYPER["tau"],
        diversity_scale=HYPER["tau_div"],
        diversity_margin=HYPER["delta"],
        diversity_threshold=HYPER["alpha"],
        **kw,
    )


@pytest.mark.parametrize("layout", ["pairs", "hard", "random_and_hard"])
def test_each_term_matches_the_papers_equations(layout):
    rng = np.random.default_rng(0)
    B, d = 5, 8
    model = _standin(["semantic", "trigger", "context"], dim=d)
    branches = ["semantic", "trigger", "context"]
    anchors = {b: _unit(rng, B, d) for b in branches}
    # make the branches of a query similar, so that some pairs are above alpha (diversity term non-trivial)
    anchors["trigger"] = _unit(rng, B, d) * 0.3 + anchors["semantic"]
    anchors["trigger"] /= np.linalg.norm(anchors["trigger"], axis=1, keepdims=True)
    P = _unit(rng, B, d)
    if layout == "pairs":
        negs, tags = [], []
    elif layout == "hard":
        negs, tags = [_unit(rng, B, d) for _ in branches], list(branches)
    else:
        negs, tags = [_unit(rng, B, d) for _ in range(4)], [None, *branches]
    columns = unierf_columns(branches, random_negative=layout == "random_and_hard", hard_negatives=layout != "pairs")
    assert parse_unierf_columns(columns, branches)[1] == tags
    expected = _hand_terms(anchors, P, negs, tags, **HYPER)
    for cols in (columns, None):  # explicit layout, and inferred from the number of columns
        loss = _loss(model, columns=cols)
        feats = _features(*(anchors[b] for b in branches), P, *negs)
        terms = loss.loss_terms(feats)
        for name, value in expected.items():
            assert float(terms[name].detach()) == pytest.approx(value, rel=1e-4, abs=1e-5), name
        assert float(loss(feats, None).detach()) == pytest.approx(sum(expected.values()), rel=1e-4)
    assert abs(expected["diversity"] - math.log(1 + 3)) > 1e-3  # some pairs are above alpha


def test_heads_are_applied_to_the_anchors():
    rng = np.random.default_rng(1)
    model = _standin(BRANCHES, init_std=0.3)
    head = model[0]
    loss = UniERFLoss(model)
    a, t, p = _unit(rng, 4, 8), _unit(rng, 4, 8), _unit(rng, 4, 8)
    terms = loss.loss_terms(_features(a, t, p))
    H = {
        "semantic": head.embed(torch.tensor(a).float(), "semantic"),
        "trigger": head.embed(torch.tensor(t).float(), "trigger"),
    }
    ref = loss.terms_from_embeddings(H, torch.tensor(p).float(), [], [])
    for name in terms:
        torch.testing.assert_close(terms[name], ref[name])


def test_diversity_hand_values_and_gradient_truncated_below_alpha():
    tau, delta, alpha = 32.0, 0.8, 0.6

    def loss_at(theta: float) -> tuple[float, float, float]:
        th = torch.tensor(theta, dtype=torch.float64, requires_grad=True)
        h = torch.stack(
            [
                torch.stack([torch.ones((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)]),
                torch.stack([torch.cos(th), torch.sin(th)]),
            ]
        )[None]
        value = diversity_loss(h, tau, delta, alpha)
        value.backward()
        return float(value.detach()), float(th.grad), math.cos(theta)

    # below alpha: log(1 + exp(0)) and exactly zero gradient
    for s in (0.59, 0.3, -0.5):
        value, grad, _ = loss_at(math.acos(s))
        assert value == pytest.approx(math.log(2.0))
        assert grad == 0.0
    # above alpha: Eq. 31 with eta = s - alpha, and d/ds = tau * eta * sigmoid(x) (eta a constant, as in Circle Loss)
    for s in (0.65, 0.8, 0.95):
        theta = math.acos(s)
        value, grad, _ = loss_at(theta)
        x = tau * (s - alpha) * (s - delta)
        assert value == pytest.approx(math.log(1 + math.exp(x)), rel=1e-9)
        dlds = tau * (s - alpha) / (1 + math.exp(-x))
        assert grad == pytest.approx(dlds * -math.sin(theta), rel=1e-9)  # ds/dtheta = -sin(theta)
        assert grad < 0  # minimising opens the angle: the branches move apart
    # the paper's values: s = 0.9 -> log(1 + exp(32 * 0.3 * 0.1))
    value, _, _ = loss_at(math.acos(0.9))
    assert value == pytest.approx(math.log(1 + math.exp(0.96)))
    # one branch: no pair, no loss
    assert float(diversity_loss(torch.randn(3, 1, 4), tau, delta, alpha)) == 0.0


def test_diversity_gradient_reaches_the_heads_only_above_alpha():
    model = _standin(BRANCHES, dim=4, init_std=0.0)
    loss = UniERFLoss(model, use_positive=False, use_triplet=False, use_infonce=False)
    p = torch.eye(4)[:2]
    far = [torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]]), torch.tensor([[0, 0, 1.0, 0], [0, 0, 0, 1.0]])]
    model.zero_grad()
    loss(_features(far[0].numpy(), far[1].numpy(), p.numpy()), None).backward()
    assert all(float(q.grad.abs().sum()) == 0.0 for q in model.parameters())
    close = [far[0], far[0] + 0.1 * far[1]]
    model.zero_grad()
    loss(_features(close[0].numpy(), close[1].numpy(), p.numpy()), None).backward()
    assert sum(float(q.grad.abs().sum()) for q in model.parameters()) > 0


@pytest.mark.parametrize("off", ["positive", "triplet", "infonce", "diversity"])
def test_switching_a_term_off_removes_exactly_that_term(off):
    rng = np.random.default_rng(2)
    model = _standin(BRANCHES, init_std=0.1)
    base = _unit(rng, 6, 8)
    feats = _features(base, base + 0.2 * _unit(rng, 6, 8), _unit(rng, 6, 8), _unit(rng, 6, 8), _unit(rng, 6, 8))
    full = _loss(model)
    terms = full.loss_terms(feats)
    assert all(float(v.detach()) > 0 for v in terms.values())
    ablated = _loss(model, **{f"use_{off}": False})
    diff = float((full(feats, None) - ablated(feats, None)).detach())
    assert diff == pytest.approx(float(terms[off].detach()), rel=1e-5, abs=1e-6)
    assert ablated.get_config_dict()[f"use_{off}"] is False


def test_loss_errors_and_config():
    model = _standin(BRANCHES)
    with pytest.raises(ValueError, match="no MultiBranchQueryEncoder"):
        UniERFLoss(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="switched off"):
        UniERFLoss(model, use_positive=False, use_triplet=False, use_infonce=False, use_diversity=False)
    with pytest.raises(ValueError, match="temperature"):
        UniERFLoss(model, temperature=0.0)
    with pytest.raises(ValueError, match="unknown branch 'context'"):
        UniERFLoss(model, columns=["anchor_semantic", "anchor_context", "positive_doc"])
    with pytest.raises(ValueError, match="neither anchor"):
        UniERFLoss(model, columns=["anchor_semantic", "anchor_trigger", "positive_doc", "qid"])
    with pytest.raises(ValueError, match="positive column"):
        UniERFLoss(model, columns=["anchor_semantic", "anchor_trigger", "negative_random"])
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="cannot read a batch of 4 columns"):
        UniERFLoss(model).loss_terms(_features(*(_unit(rng, 2, 8) for _ in range(4))))
    loss = UniERFLoss(model, columns=unierf_columns(BRANCHES))
    with pytest.raises(ValueError, match="batch has 3 input columns"):
        loss.loss_terms(_features(*(_unit(rng, 2, 8) for _ in range(3))))
    config = loss.get_config_dict()
    assert config["diversity_threshold"] == 0.6 and config["diversity_margin"] == 0.8  # Sec. 5.3.2
    assert "jiang2025unierf" in loss.citation


# --------------------------------------------------------------------------------------------------------
# training rows (Sec. 4.3)
# --------------------------------------------------------------------------------------------------------

DOCS = {f"d{i}": f"document number {i}" for i in range(40)}


def test_build_dataset_layout_and_negatives():
    n = 30
    anchors = {"semantic": [f"q{i}" for i in range(n)], "trigger": [f"q{i} [SEP] t{i}" for i in range(n)]}
    positives = [f"d{i}" for i in range(n)]
    hard = {"semantic": [["d30", "d31"]] * n, "trigger": [["d35"]] * (n - 1) + [[]]}
    exclude = [{"d31", f"d{(i + 1) % 40}"} for i in range(n)]
    ds = build_unierf_dataset(anchors, positives, DOCS, hard_negatives=hard, exclude=exclude, seed=0)
    assert (
        ds.column_names
        == unierf_columns(BRANCHES)
        == [
            "anchor_semantic",
            "anchor_trigger",
            "positive_doc",
            "negative_random",
            "negative_semantic",
            "negative_trigger",
        ]
    )
    text_to_doc = {v: k for k, v in DOCS.items()}
    for i, row in enumerate(ds):
        assert row["anchor_trigger"] == anchors["trigger"][i] and row["positive_doc"] == DOCS[positives[i]]
        negs = {c: text_to_doc[row[c]] for c in ("negative_random", "negative_semantic", "negative_trigger")}
        assert not ({positives[i], *exclude[i]} & set(negs.values()))
        if i < n - 1:  # the last row excludes d30 and d31 too: it falls back to a random negative
            assert negs["negative_semantic"] == "d30"  # d31 is excluded
            assert negs["negative_trigger"] == "d35"
    # deterministic
    again = build_unierf_dataset(anchors, positives, DOCS, hard_negatives=hard, exclude=exclude, seed=0)
    assert again.to_dict() == ds.to_dict()
    # same-category random negatives
    categories = {d: ("even" if int(d[1:]) % 2 == 0 else "odd") for d in DOCS}
    cat = build_unierf_dataset(anchors, positives, DOCS, categories=categories, same_category_share=1.0)
    assert cat.column_names == ["anchor_semantic", "anchor_trigger", "positive_doc", "negative_random"]
    for i, row in enumerate(cat):
        assert categories[text_to_doc[row["negative_random"]]] == categories[positives[i]]


def test_build_dataset_errors():
    anchors = {"semantic": ["q0", "q1"]}
    with pytest.raises(ValueError, match="one text per example"):
        build_unierf_dataset(anchors, ["d0"], DOCS)
    with pytest.raises(ValueError, match="unknown branches"):
        build_unierf_dataset(anchors, ["d0", "d1"], DOCS, hard_negatives={"trigger": [[], []]})
    with pytest.raises(ValueError, match="not in doc_texts"):
        build_unierf_dataset(anchors, ["d0", "x"], DOCS)
    with pytest.raises(ValueError, match="no underscores"):
        build_unierf_dataset({"a_b": ["q0"]}, ["d0"], DOCS)


# --------------------------------------------------------------------------------------------------------
# merging the branches
# --------------------------------------------------------------------------------------------------------


def test_quotas_largest_remainder():
    assert branch_quotas(10, [1, 1]).tolist() == [5, 5]
    assert branch_quotas(10, [1, 1, 1]).tolist() == [4, 3, 3]
    assert branch_quotas(10, [3, 1]).tolist() == [8, 2]  # 7.5 / 2.5: tie on the remainder, the earlier branch
    assert branch_quotas(7, [0.5, 0.3, 0.2]).tolist() == [4, 2, 1]
    for b in range(1, 30):
        assert branch_quotas(b, [0.2, 0.7, 0.1]).sum() == b
    with pytest.raises(ValueError, match="> 0"):
        branch_quotas(10, [1, 0])


def _lists(*docs):
    return [(np.asarray(d), np.linspace(1, 0, len(d))) for d in docs]


def test_merged_run_splits_the_budget_by_weights():
    a = {"q": (np.array([f"a{i}" for i in range(20)], dtype=object), np.linspace(1, 0, 20))}
    b = {"q": (np.array([f"b{i}" for i in range(20)], dtype=object), np.linspace(2, 1, 20))}
    for weights, want in (((0.2, 0.8), (2, 8)), (None, (5, 5)), ((0.7, 0.3), (7, 3))):
        run, shared = merged_run([a, b], 10, weights)
        got = run["docno"].str[0].value_counts()
        assert (got.get("a", 0), got.get("b", 0)) == want and shared == 0.0
        assert list(run["rank"]) == list(range(10)) and run["score"].is_monotonic_decreasing


def test_merge_lists_quotas_dedup_and_refill():
    # disjoint lists: each branch claims exactly its quota
    merged = merge_branch_lists(_lists(range(0, 20), range(100, 120)), 10, [7, 3])
    assert Counter(m[3] for m in merged) == {0: 7, 1: 3}
    assert {m[0] for m in merged} == set(range(7)) | set(range(100, 103))
    # identical lists: every document found by both, the budget is the top of the shared list
    merged = merge_branch_lists(_lists(range(20), range(20)), 10, [5, 5])
    assert sorted(m[0] for m in merged) == list(range(10))
    assert all(m[2] == [0, 1] for m in merged) and Counter(m[3] for m in merged) == {0: 5, 1: 5}
    # overlap frees slots that the branches' next candidates fill: still exactly the budget, no duplicates
    merged = merge_branch_lists(_lists([1, 2, 3, 4, 5, 6, 7, 8], [2, 1, 9, 10, 11, 12]), 6, [3, 3])
    docs = [m[0] for m in merged]
    assert len(docs) == 6 == len(set(docs))
    assert Counter(m[3] for m in merged) == {0: 3, 1: 3}
    finders = {m[0]: m[2] for m in merged}
    assert finders[1] == finders[2] == [0, 1] and finders[9] == [1]
    # a branch that runs out leaves its slots to the others
    merged = merge_branch_lists(_lists([1, 2], range(10, 30)), 6, [3, 3])
    assert len(merged) == 6 and Counter(m[3] for m in merged) == {0: 2, 1: 4}
    # fewer candidates than the budget: the union
    merged = merge_branch_lists(_lists([1, 2], [2, 3]), 6, [3, 3])
    assert sorted(m[0] for m in merged) == [1, 2, 3]
    # best score kept
    merged = merge_branch_lists([(np.array([5]), np.array([0.2])), (np.array([5]), np.array([0.9]))], 2, [1, 1])
    assert merged == [(5, pytest.approx(0.9), [0, 1], 0)]


N_DOCS, DIM, NQ = 300, 16, 6


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    rng = np.random.default_rng(7)
    docs = _unit(rng, N_DOCS, DIM).astype(np.float32)
    path = tmp_path_factory.mktemp("unierf") / "docs.flex"
    index = DenseIndex(path).index(pd.DataFrame({"docno": [f"d{i}" for i in range(N_DOCS)], "doc_vec": list(docs)}))
    sem = _unit(rng, NQ, DIM).astype(np.float32)
    trig = (sem + 0.8 * _unit(rng, NQ, DIM)).astype(np.float32)  # related to the semantic vector: overlapping lists
    frame = pd.DataFrame(
        {
            "qid": [f"q{i}" for i in range(NQ)],
            "query": [f"query {i}" for i in range(NQ)],
            "query_vec_semantic": list(sem),
            "query_vec_trigger": list(trig / np.linalg.norm(trig, axis=1, keepdims=True)),
        }
    )
    return index, docs, frame


def test_multi_branch_retriever_budget_dedup_branch_column(dense):
    index, docs, frame = dense
    for budget, weights in ((10, None), (25, [3, 1]), (7, {"trigger": 2.0})):
        retriever = MultiBranchRetriever(index, BRANCHES, num_results=budget, weights=weights)
        out = retriever(frame)
        assert list(out.columns[:4]) == ["qid", "query", "query_vec_semantic", "query_vec_trigger"]
        assert {"docno", "docid", "score", "rank", "branch"} <= set(out.columns)
        assert out.groupby("qid").size().eq(budget).all()  # exactly the budget
        assert not out.duplicated(["qid", "docno"]).any()  # dedup
        quotas = branch_quotas(budget, retriever.weights)
        for qi, (_, group) in enumerate(out.groupby("qid", sort=False)):
            assert group["rank"].tolist() == list(range(budget))
            assert (np.diff(group["score"].to_numpy()) <= 0).all()
            q = {b: frame.loc[qi, query_vec_column(b)] for b in BRANCHES}
            cos = {b: docs @ (q[b] / np.linalg.norm(q[b])) for b in BRANCHES}
            full = {b: np.argsort(-cos[b], kind="stable") for b in BRANCHES}
            lists = [(full[b][:budget], cos[b][full[b][:budget]]) for b in BRANCHES]
            merged = merge_branch_lists(lists, budget, quotas)
            assert Counter(m[3] for m in merged) == dict(zip(range(2), quotas.tolist()))  # quotas honoured
            expect = {f"d{m[0]}": "|".join(BRANCHES[f] for f in m[2]) for m in merged}
            assert dict(zip(group["docno"], group["branch"])) == expect
            for docno, score, names in zip(group["docno"], group["score"], group["branch"]):
                d = int(docno[1:])
                # the best cosine of the branches that found it, and each of them has it in its top-B
                assert score == pytest.approx(max(float(cos[b][d]) for b in names.split("|")), abs=1e-5)
                assert all(d in full[b][:budget] for b in names.split("|"))
        assert (out["branch"] == "semantic|trigger").any()  # the fixture's branches overlap


def test_rank_cutoff_fixes_the_total_budget(dense):
    index, _, frame = dense
    retriever = MultiBranchRetriever(index, BRANCHES, num_results=50)
    cut = retriever % 8
    assert isinstance(cut, MultiBranchRetriever) and cut.num_results == 8 and retriever.num_results == 50
    assert cut.quotas == {"semantic": 4, "trigger": 4}
    expected = MultiBranchRetriever(index, BRANCHES, num_results=8)(frame)
    pd.testing.assert_frame_equal(cut(frame), expected)
    assert (retriever % 500).num_results == 50
    pipeline = pt.apply.generic(lambda df: df) >> retriever
    fused = (pipeline % 8).compile()
    pd.testing.assert_frame_equal(fused(frame), expected)
    assert repr(cut) == f"MultiBranchRetriever({index!r}, branches=['semantic', 'trigger'], num_results=8)"


def test_repeated_qids_are_retrieved_once(dense):
    """A qid repeated with identical branch vectors gives the result of one row; different vectors under one qid
    are an error naming the qid and the column (no duplicate (qid, docno) rows, no two rank-0 rows)."""
    index, _, frame = dense
    retriever = MultiBranchRetriever(index, BRANCHES, num_results=6)
    expected = retriever(frame)
    doubled = pd.concat([frame, frame.copy()], ignore_index=True)
    pd.testing.assert_frame_equal(retriever(doubled), expected)
    clash = pd.concat([frame, frame.iloc[[1]].assign(query_vec_trigger=[frame.loc[0, "query_vec_trigger"]])])
    with pytest.raises(ValueError, match=r"q1.*query_vec_trigger|query_vec_trigger.*q1"):
        retriever(clash.reset_index(drop=True))


def test_retriever_empty_frames_and_errors(dense):
    index, _, frame = dense
    retriever = MultiBranchRetriever(index, BRANCHES, num_results=5, drop_query_vec=True)
    empty = retriever(frame.iloc[:0])
    assert len(empty) == 0 and {"qid", "docno", "score", "rank", "branch"} <= set(empty.columns)
    assert "query_vec_semantic" not in empty.columns
    assert "query_vec_semantic" not in retriever(frame).columns
    with pytest.raises(pt.validate.InputValidationError, match=r"missing \['query_vec_trigger'\]"):
        retriever(frame.drop(columns="query_vec_trigger"))
    with pytest.raises(pt.validate.InputValidationError, match="first-stage"):
        retriever(frame.assign(docno="d1"))
    bad = frame.assign(query_vec_trigger=[np.ones(DIM + 1, np.float32)] * NQ)
    with pytest.raises(ValueError, match="dimension mismatch"):
        retriever(bad)
    with pytest.raises(ValueError, match="no underscores"):
        MultiBranchRetriever(index, ["semantic", "bad_name"])
    with pytest.raises(ValueError, match="unknown branches"):
        MultiBranchRetriever(index, BRANCHES, weights={"context": 1.0})
    with pytest.raises(ValueError, match="one weight per branch"):
        MultiBranchRetriever(index, BRANCHES, weights=[1.0])


# --------------------------------------------------------------------------------------------------------
# PyTerrier encoders and trigger documents
# --------------------------------------------------------------------------------------------------------


def _fake_bm25(ranking):
    """A first stage returning ``ranking[qid]`` (docnos, best first) with decreasing scores."""

    def run(df):
        rows = [
            {"qid": q, "query": query, "docno": d, "score": float(len(ranking[q]) - r), "rank": r}
            for q, query in zip(df["qid"], df["query"])
            for r, d in enumerate(ranking.get(q, []))
        ]
        return pd.DataFrame(rows, columns=["qid", "query", "docno", "score", "rank"])

    return pt.apply.generic(run)


def test_trigger_text_takes_the_top_document():
    bm25 = _fake_bm25({"q1": ["d3", "d1"], "q2": ["d7"]})
    topics = pd.DataFrame({"qid": ["q1", "q2", "q3", "q1"], "query": ["a", "b", "c", "a"]})
    out = TriggerText(bm25, DOCS)(topics)
    assert out["trigger_docno"].tolist() == ["d3", "d7", None, "d3"]
    assert out["trigger_text"].tolist() == [DOCS["d3"], DOCS["d7"], "", DOCS["d3"]]
    loader = pt.apply.generic(lambda df: df.assign(text=[DOCS[d].upper() for d in df["docno"]]))
    assert TriggerText(bm25, loader, rank=1)(topics)["trigger_text"].tolist()[0] == DOCS["d1"].upper()
    empty = TriggerText(bm25, DOCS)(topics.iloc[:0])
    assert len(empty) == 0 and {"trigger_docno", "trigger_text"} <= set(empty.columns)


def test_unierf_encoder_adds_one_vector_per_branch(unierf_model, base_model):
    encoder = UniERFEncoder(unierf_model)
    assert encoder.input_columns == ["query", "trigger_text"]
    topics = pd.DataFrame(
        {"qid": ["1", "2"], "query": ["vitamin d", "statins"], "trigger_text": ["Vitamin D and bones.", None]}
    )
    out = encoder.query_encoder()(topics)
    expected = encode_branches(
        unierf_model,
        {
            "semantic": ["vitamin d", "statins"],
            "trigger": [branch_text(["vitamin d", "Vitamin D and bones."]), "statins"],  # None: the query alone
        },
    )
    for b in BRANCHES:
        np.testing.assert_allclose(np.stack(out[query_vec_column(b)]), expected[b], atol=1e-6)
    empty = encoder.query_encoder()(topics.iloc[:0])
    assert len(empty) == 0 and {"query_vec_semantic", "query_vec_trigger"} <= set(empty.columns)
    with pytest.raises(pt.validate.InputValidationError, match="TriggerText"):
        encoder.query_encoder()(topics.drop(columns="trigger_text"))
    with pytest.raises(ValueError, match="no input columns for branch 'extra'"):
        UniERFEncoder(build_unierf_model(base_model, branches=["semantic", "extra"]))
    with pytest.raises(ValueError, match="unknown branch 'context'"):
        UniERFEncoder(unierf_model, branches=["context"])
    docs = encoder.doc_encoder()(pd.DataFrame({"docno": ["a"], "text": ["Vitamin D and bones."]}))
    np.testing.assert_allclose(docs["doc_vec"][0], unierf_model.encode_document(["Vitamin D and bones."])[0], atol=1e-6)


# --------------------------------------------------------------------------------------------------------
# mining the differentiated negatives
# --------------------------------------------------------------------------------------------------------


def test_training_data_mines_branch_specific_negatives(dense):
    index, docs, _ = dense
    texts = {f"d{i}": f"text {i}" for i in range(N_DOCS)}
    ranking = {f"q{i}": [f"d{j}" for j in range(10 * i, 10 * i + 20)] for i in range(3)}
    topics = pd.DataFrame(
        {
            "qid": ["q0", "q1", "q2"],
            "query": ["alpha?", "beta", "gamma"],
            "trigger_docno": ["d0", "d10", "d20"],
            "trigger_text": ["text 0", "text 10", "text 20"],
        }
    )
    qrels = pd.DataFrame(
        {"qid": ["q0", "q0", "q1", "q2"], "docno": ["d19", "d18", "d11", "d299"], "label": [1, 0, 2, 1]}
    )
    ds = unierf_training_data(topics, qrels, texts, retriever=_fake_bm25(ranking), index=index, depth=20, tail=0.3)
    assert ds.column_names == unierf_columns(BRANCHES) and len(ds) == 3
    back = {v: k for k, v in texts.items()}
    by_pos = {back[r["positive_doc"]]: r for r in ds}
    assert set(by_pos) == {"d19", "d11", "d299"}
    for positive, qid in (("d19", "q0"), ("d11", "q1"), ("d299", "q2")):
        row = by_pos[positive]
        i = int(qid[1:])
        assert row["anchor_trigger"] == branch_text([topics.loc[i, "query"], topics.loc[i, "trigger_text"]])
        cands = [d for d in ranking[qid] if d not in {positive}]
        # semantic: the low-score tail of the query's ranking (relevant documents excluded)
        sem = back[row["negative_semantic"]]
        assert sem in cands[-math.ceil(0.3 * len(cands)) :]
        # trigger: among the ranking, the least similar to the trigger document
        trig_doc = int(topics.loc[i, "trigger_docno"][1:])
        pool = [d for d in cands if d != topics.loc[i, "trigger_docno"]]
        sims = {d: float(docs[int(d[1:])] @ docs[trig_doc]) for d in pool}
        tail = sorted(pool, key=lambda d: sims[d])[: math.ceil(0.3 * len(pool))]
        assert back[row["negative_trigger"]] in tail
    with pytest.raises(ValueError, match="TriggerText"):
        unierf_training_data(
            topics.drop(columns="trigger_docno"), qrels, texts, retriever=_fake_bm25(ranking), index=index
        )
    with pytest.raises(ValueError, match="need a retriever"):
        unierf_training_data(topics, qrels, texts)
    with pytest.raises(ValueError, match="index="):
        unierf_training_data(topics, qrels, texts, retriever=_fake_bm25(ranking))
    plain = unierf_training_data(topics, qrels, texts, hard_negatives=False)
    assert plain.column_names == ["anchor_semantic", "anchor_trigger", "positive_doc", "negative_random"]


# --------------------------------------------------------------------------------------------------------
# training with the sentence-transformers trainer
# --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_trainer_few_steps_then_retrieve(tmp_path, base_model):
    from sentence_transformers import SentenceTransformerTrainer, SentenceTransformerTrainingArguments
    from sentence_transformers.base.sampler import BatchSamplers

    topics_text = [
        "vitamin d bones",
        "statins cholesterol",
        "green tea cancer",
        "sugar diabetes",
        "fish oil heart",
        "salt blood pressure",
        "soy breast cancer",
        "coffee liver",
    ]
    texts = {f"d{i}": f"A study of {t} in adults, part {i % 3}." for i, t in enumerate(topics_text * 3)}
    texts.update({f"x{i}": f"Unrelated note {i} about gardening and weather." for i in range(8)})
    topics = pd.DataFrame({"qid": [str(i) for i in range(8)], "query": topics_text})
    qrels = pd.DataFrame({"qid": [str(i % 8) for i in range(24)], "docno": [f"d{i}" for i in range(24)], "label": 1})
    ranking = {str(q): [f"d{q + 8 * k}" for k in range(3)] + [f"x{j}" for j in range(8)] for q in range(8)}
    bm25 = _fake_bm25(ranking)
    topics = TriggerText(bm25, texts)(topics)
    train = unierf_training_data(topics, qrels, texts, retriever=bm25, hard_negatives=["semantic"], seed=0)
    assert train.column_names == unierf_columns(BRANCHES, hard_negatives=["semantic"])

    model = build_unierf_model(base_model, branches=BRANCHES, device="cpu")
    before = {n: p.detach().clone() for n, p in model[-1].named_parameters()}
    loss = UniERFLoss(model, columns=train.column_names)
    args = tiny_training_args(SentenceTransformerTrainingArguments, tmp_path, batch_sampler=BatchSamplers.NO_DUPLICATES)
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train, loss=loss)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(np.isfinite(losses))
    assert any(not torch.equal(p, before[n]) for n, p in model[-1].named_parameters())  # the heads trained

    path = str(tmp_path / "trained")
    model.save(path)
    encoder = UniERFEncoder(path)
    index = (encoder.doc_encoder() >> DenseIndex(tmp_path / "docs.flex").indexer()).index(
        [{"docno": d, "text": t} for d, t in texts.items()]
    )
    pipeline = encoder.query_encoder() >> MultiBranchRetriever(index, encoder.branches, num_results=100) % 6
    out = pipeline(topics)
    assert out.groupby("qid").size().eq(6).all() and not out.duplicated(["qid", "docno"]).any()
    again = encode_branches(load_model(path), encoder.branch_texts(topics))
    for b in BRANCHES:
        np.testing.assert_array_equal(np.stack(encoder.query_encoder()(topics)[query_vec_column(b)]), again[b])
