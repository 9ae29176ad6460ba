"""Distillation into split-attention cross-encoders: the model, the VarCE distillation loss, pools and rows, the
calibration and uncertainty measures, training under the partial recipe."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import assert_same_figures, pisa_threads_finish_backwards
from safetensors.torch import load_file
from sentence_transformers import SentenceTransformer

from pyterrier_prob.experiments.harness import slug
from pyterrier_prob.experiments.varce_distill import STUDENTS
from pyterrier_prob.fusion import interpolate
from pyterrier_prob.varce import calibration as cal
from pyterrier_prob.varce import distill
from pyterrier_prob.varce.analysis import uncertainty_stats
from pyterrier_prob.varce.pseudo_queries import drop_sources, pseudo_queries
from st_extensions.cross_encoder.split import (
    attention_probabilities,
    build_split_cross_encoder,
    cross_attention_mass,
    joint_term,
    split_state_cache,
)
from st_extensions.loading import load_model
from st_extensions.losses import VariationalMarginMSELoss

PAIRS = [
    ("what is diabetes", "Diabetes is a disease of high blood sugar caused by insulin problems."),
    ("vitamin d and bones", "Pandas are bears that eat bamboo in China."),
    ("statins heart", "Statins lower cholesterol and reduce heart attack risk in adults with high LDL levels."),
]


@pytest.fixture(scope="module")
def bi_encoder(minilm_path):
    return SentenceTransformer(minilm_path, device="cpu")


def test_closed_cross_attention_is_the_bi_encoder(minilm_path, bi_encoder):
    """With query-document attention shut (a very negative cross bias) the split model scores scale * cosine of the
    bi-encoder it was built from, for the CE and both VarCEs (E[s])."""
    q = bi_encoder.encode([p[0] for p in PAIRS], normalize_embeddings=True)
    d = bi_encoder.encode([p[1] for p in PAIRS], normalize_embeddings=True)
    expected = 20.0 * (q * d).sum(1)
    for variant in (None, "VAR", "MEANVAR"):
        model = build_split_cross_encoder(minilm_path, init_cross_bias=-1e4, variant=variant, scale=20.0)
        np.testing.assert_allclose(model.predict(PAIRS), expected, atol=1e-4)


def test_bi_encoder_path_starts_as_the_bi_encoder_with_open_joint_layers(minilm_path, bi_encoder, tmp_path):
    """With ``bi_encoder_path`` the model scores exactly scale * cosine of the bi-encoder at the start though its joint
    layers attend across the pair (bias 0); the joint term's weights start at 0 and train (so do the joint layers),
    the frozen copy does not; a trained model round-trips through save and load."""
    q = bi_encoder.encode([p[0] for p in PAIRS], normalize_embeddings=True)
    d = bi_encoder.encode([p[1] for p in PAIRS], normalize_embeddings=True)
    expected = 20.0 * (q * d).sum(1)
    for variant in (None, "VAR", "MEANVAR"):
        model = build_split_cross_encoder(minilm_path, bi_encoder_path=True, variant=variant, scale=20.0)
        np.testing.assert_allclose(model.predict(PAIRS), expected, atol=1e-4)
    assert model[0].cross.bias.tolist() == [0.0, 0.0] and model[1].get_embedding_dimension() == 2 * 384
    assert cross_attention_mass(model, PAIRS)[0]["query_to_document"] > 0.3  # the joint layers do attend across
    assert not any(p.requires_grad for p in model[0].separate.parameters())
    assert all(p.requires_grad for p in model[0].auto_model.encoder.layer[4].parameters())
    model = build_split_cross_encoder(minilm_path, bi_encoder_path=True, scale=20.0)
    start = joint_term(model, PAIRS)
    assert start["joint_std"] == 0 and start["joint_share"] == 0
    assert start["score_std"] == pytest.approx(float(np.std(expected, ddof=1)), rel=1e-3)
    decoder = model[2].linear
    assert torch.all(decoder.weight[0, 384:] == 0) and torch.all(decoder.weight[0, :384] == 1)  # feature: 20 u_q u_d
    # one step of gradient reaches the joint term and the joint layers, not the frozen copy
    features = model.preprocess(PAIRS[:2])
    loss = model(features)["scores"].sum()
    loss.backward()
    assert decoder.weight.grad[0, 384:].abs().sum() > 0
    assert model[0].auto_model.encoder.layer[5].attention.self.query.weight.grad.abs().sum() == 0  # its term weighs 0
    assert all(p.grad is None for p in model[0].separate.parameters())
    with torch.no_grad():  # a trained-looking model: the joint term weighs in, the joint layers differ from the copy
        decoder.weight[0, 384:] = 0.01
        model[0].auto_model.encoder.layer[5].output.dense.bias.add_(0.1)
    before = model.predict(PAIRS)
    assert np.abs(before - expected).max() > 1e-3
    moved = joint_term(model, PAIRS)
    assert moved["joint_share"] > 0 and moved["score_std"] == pytest.approx(float(np.std(before, ddof=1)), rel=1e-3)
    model.save(str(tmp_path / "m"))
    loaded = load_model(str(tmp_path / "m"))
    np.testing.assert_allclose(loaded.predict(PAIRS), before, atol=1e-5)
    torch.testing.assert_close(loaded[0].separate.state_dict(), model[0].separate.state_dict())


def test_open_cross_attention_changes_scores(minilm_path):
    closed = build_split_cross_encoder(minilm_path, init_cross_bias=-1e4).predict(PAIRS)
    opened = build_split_cross_encoder(minilm_path, init_cross_bias=0.0).predict(PAIRS)
    assert np.abs(closed - opened).max() > 0.1


def test_attention_probabilities_are_the_layers_own(minilm_path):
    """The weights :func:`attention_probabilities` computes, applied to the layer's values, give the layer's own
    self-attention output (closed form ``softmax(QK^T / sqrt(d) + mask) V``), cross bias and padding included."""
    model = build_split_cross_encoder(minilm_path, joint_layers=1, init_cross_bias=-1.5)
    split = model[0]
    seen = {}

    def observe(i, layer, hidden, additive):
        seen["probs"] = attention_probabilities(layer, hidden, additive)
        seen["out"] = layer.attention.self(hidden, attention_mask=additive)[0]
        attn = layer.attention.self
        shape = (*hidden.shape[:-1], -1, attn.attention_head_size)
        seen["v"] = attn.value(hidden).view(shape).transpose(1, 2)

    with torch.no_grad():
        hidden, mask, is_query = split.joint_inputs(split.preprocess(PAIRS))
        assert (mask == 0).any()  # padding is in play
        split.run_joint(hidden, mask, is_query, observe)
    expected = (seen["probs"] @ seen["v"]).transpose(1, 2).reshape(seen["out"].shape)
    torch.testing.assert_close(expected, seen["out"], atol=1e-5, rtol=1e-5)


def test_cross_attention_mass_closed_forms(minilm_path):
    """With the joint layers' query projection zeroed every logit is the cross bias b, so a query token puts
    ``n_d e^b / (n_q + n_d e^b)`` on the document (uniform attention at b = 0, the uniform share); a shut door
    (b = -1e4) leaves no mass on the other text; the built student's attention is open (above 10% of the uniform
    share in every joint layer)."""
    pair = [PAIRS[2]]
    for bias in (0.0, -2.0):
        model = build_split_cross_encoder(minilm_path, joint_layers=2, init_cross_bias=bias)
        n_q, n_d = (len(model[0].tokenizer(t)["input_ids"]) for t in pair[0])
        open_ = cross_attention_mass(model, pair)
        assert [m["layer"] for m in open_] == [4, 5]
        assert open_[0]["uniform_query_to_document"] == pytest.approx(n_d / (n_q + n_d))
        assert all(m["query_to_document"] > 0.1 * m["uniform_query_to_document"] for m in open_)
        with torch.no_grad():
            for layer in model[0].auto_model.encoder.layer[4:]:
                layer.attention.self.query.weight.zero_()
                layer.attention.self.query.bias.zero_()
        for m in cross_attention_mass(model, pair):
            e = np.exp(bias)
            assert m["query_to_document"] == pytest.approx(n_d * e / (n_q + n_d * e), abs=1e-5)
            assert m["document_to_query"] == pytest.approx(n_q * e / (n_d + n_q * e), abs=1e-5)
    shut = cross_attention_mass(build_split_cross_encoder(minilm_path, init_cross_bias=-1e4), PAIRS)
    assert max(max(m["query_to_document"], m["document_to_query"]) for m in shut) < 1e-6
    with pytest.raises(ValueError, match="at least one"):
        cross_attention_mass(model, [])


def test_pseudo_queries_titles_spans_and_their_documents():
    corpus = {
        "d2": "Vitamin D and bone health\n" + " ".join(f"w{i}" for i in range(40)),
        "d1": "Statins\nOne word title is too short for a query but the body gives a span of words to cut from here",
        "d3": "no title here: " + " ".join(f"x{i}" for i in range(30)),
        "d4": "What is diabetes\nshort body",
    }
    made = pseudo_queries(corpus, ["title", "span"], span_words=(3, 5), seed=1, exclude=["WHAT is  diabetes"])
    assert made["qid"].is_unique and set(made["kind"]) == {"title", "span"}
    titles = made[made["kind"] == "title"]
    # d1's title is one word, d4's is excluded
    assert titles[["source", "query"]].values.tolist() == [["d2", "Vitamin D and bone health"]]
    spans = made[made["kind"] == "span"].set_index("source")
    assert sorted(spans.index) == ["d1", "d2", "d3"]  # d4's body is shorter than twice the longest span
    for docno, row in spans.iterrows():
        words = row["query"].split()
        assert 3 <= len(words) <= 5 and row["query"] in " ".join(corpus[docno].split("\n")[-1].split())
        assert row["qid"] == f"pq-span-{docno}"
    assert not any(q.startswith("Vitamin") for q in spans["query"])  # spans come from the body
    again = pseudo_queries(corpus, ["title", "span"], span_words=(3, 5), seed=1, exclude=["what is diabetes"])
    pd.testing.assert_frame_equal(made, again)  # seeded
    pool = pd.DataFrame({"qid": ["pq-span-d1", "pq-span-d1", "q7"], "docno": ["d1", "d2", "d1"]})
    assert drop_sources(pool, made).values.tolist() == [["pq-span-d1", "d2"], ["q7", "d1"]]
    with pytest.raises(ValueError, match="choose from"):
        pseudo_queries(corpus, ["summary"])


def test_score_segment_reads_the_score_and_shares_the_documents_states(minilm_path, tmp_path):
    """A student that reads the first stage's score as text: the score's tokens join the query's side, so one document's
    cached lower-layer states serve every score (the cache holds queries and documents only); scored from the cache
    or from the texts, the same; another score, another prediction; saved and loaded, the same model."""
    from pyterrier_prob.varce.rerank import score_as_text

    model = build_split_cross_encoder(minilm_path, score_segment=True, variant="VAR")
    docs = score_as_text([p[1] for p in PAIRS], [7.5, 3.25, 12.0])
    pairs = [(p[0], d) for p, d in zip(PAIRS, docs)]
    plain, _ = model.predict(pairs, return_std=True)
    other, _ = model.predict([(q, "0.10 [SEP] " + p[1]) for q, p in zip([p[0] for p in PAIRS], PAIRS)], return_std=True)
    assert np.abs(plain - other).max() > 1e-3  # the score is read
    assert model[0].cache_texts(pairs) == [t for p in PAIRS for t in p]  # no score in the cached texts
    cache = split_state_cache(model, str(tmp_path / "states"), model[0].cache_texts(pairs))
    cached, _ = model.predict(pairs, return_std=True)
    np.testing.assert_allclose(cached, plain, atol=2e-2)  # fp16 states
    model.predict([(PAIRS[0][0], "99.00 [SEP] " + PAIRS[0][1])])
    assert not cache.missing([PAIRS[0][1]]) and len(cache) == 6  # a new score: no new document states
    with pytest.raises(ValueError, match="reads the first stage's score as text"):
        model.predict([PAIRS[0]])
    model.save_pretrained(str(tmp_path / "m"))
    again = load_model(str(tmp_path / "m"))
    assert again[0].score_segment
    np.testing.assert_allclose(again.predict(pairs, return_std=True)[0], plain, atol=1e-5)


def test_cached_lower_layers_match_and_round_trip(minilm_path, tmp_path):
    model = build_split_cross_encoder(minilm_path, init_cross_bias=-3.0, variant="MEANVAR")
    with torch.no_grad():
        model[0].cross.bias.copy_(torch.tensor([-2.5, -1.0]))
    mean, std = model.predict(PAIRS, return_std=True)
    cache = split_state_cache(model, str(tmp_path / "states"), [t for p in PAIRS for t in p])
    assert len(cache) == 6
    cached_mean, cached_std = model.predict(PAIRS, return_std=True)
    np.testing.assert_allclose(cached_mean, mean, atol=2e-3)  # fp16 states
    np.testing.assert_allclose(cached_std, std, atol=1e-4)
    # the lower layers are frozen, the joint ones and the cross bias train
    backbone = model[0].auto_model
    assert not any(p.requires_grad for p in backbone.encoder.layer[3].parameters())
    assert all(p.requires_grad for p in backbone.encoder.layer[4].parameters())
    assert model[0].cross.bias.requires_grad
    model[0].state_cache = None
    model.save(str(tmp_path / "m"))
    loaded = load_model(str(tmp_path / "m"))
    assert type(loaded).__name__ == "VarCrossEncoder"
    torch.testing.assert_close(loaded[0].cross.bias, model[0].cross.bias)
    loaded_mean, loaded_std = loaded.predict(PAIRS, return_std=True)
    np.testing.assert_allclose(loaded_mean, mean, atol=1e-5)
    np.testing.assert_allclose(loaded_std, std, atol=1e-6)


def test_bi_encoder_path_from_the_per_text_cache_is_the_per_pair_path(minilm_path, tmp_path):
    """In eval mode, pairs that come as cache rows take the frozen bi-encoder path's per-side means from a per-text
    cache: the same feature as :func:`segment_product` of :meth:`run_separate` (to float rounding), each distinct text
    computed once over any batches, a score read as text computed per pair on the query side; in training mode (dropout
    on) the path runs per pair; another state cache or loaded weights empty it."""
    from pyterrier_prob.varce.rerank import score_as_text
    from st_extensions.cross_encoder.split import SEPARATE, SEPARATE_MEANS, segment_product, separate_product

    pairs = [*PAIRS, (PAIRS[0][0], PAIRS[2][1]), (PAIRS[2][0], PAIRS[0][1]), PAIRS[1]]
    for score in (False, True):
        model = build_split_cross_encoder(
            minilm_path, bi_encoder_path=True, joint_feature="kernels", variant="VAR", score_segment=score
        )
        given = [(q, d) for q, d in zip([p[0] for p in pairs], score_as_text([p[1] for p in pairs], range(6)))]
        given = given if score else pairs
        split = model[0]
        split_state_cache(model, str(tmp_path / f"states-{score}"), split.cache_texts(given))
        computed: list[int] = []

        def counted(h, m, computed=computed, mean=split._separate_mean):
            computed.append(len(h))
            return mean(h, m)

        split._separate_mean = counted
        model.eval()
        for batch in (given[:2], given[2:5], given):  # texts first seen in batches of other shapes
            features = split.preprocess(batch)
            hidden, mask, is_query = split.joint_inputs(dict(features))
            out = split(dict(features))
            assert SEPARATE_MEANS in out and SEPARATE not in out
            q_mask = out["query_token_mask"].float()
            got = separate_product(out, q_mask, out["attention_mask"].float(), 20.0)
            expected = segment_product(split.run_separate(hidden, mask, is_query), q_mask, mask.float(), 20.0)
            torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)
        # 3 queries and 3 documents, each once; with the score as text the query side is per pair (2 + 3 + 6 pairs)
        assert len(split._separate_means) == (3 if score else 6)
        assert (sum(computed) == 3 + 2 + 3 + 6) if score else (sum(computed) == 6)
        model.load_state_dict(model.state_dict())  # other weights: computed again
        assert split._separate_means == {}
        split(split.preprocess(given[:2]))
        split.cache_separate = False
        assert SEPARATE in split(split.preprocess(given[:2]))  # switched off: per pair in eval mode too
        split.cache_separate = True
        model.train()
        assert SEPARATE in split(split.preprocess(given[:2])) and SEPARATE_MEANS not in split(split.preprocess(given))
        split_state_cache(model, str(tmp_path / f"other-{score}"), split.cache_texts(given[:1]))
        assert split._separate_means == {}


def test_split_model_checks(minilm_path, tmp_path):
    with pytest.raises(ValueError, match="joint_layers"):
        build_split_cross_encoder(minilm_path, joint_layers=7)
    with pytest.raises(ValueError, match="init_cross_bias"):
        build_split_cross_encoder(minilm_path, init_cross_bias=1.0)
    model = build_split_cross_encoder(minilm_path)
    model[0].state_cache = None
    model.save(str(tmp_path / "m"))
    (tmp_path / "m" / "split_attention.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="split_attention.safetensors"):
        load_model(str(tmp_path / "m"))


def test_variational_margin_mse_loss(minilm_path):
    """Margin-MSE on E[s], the margin's Gaussian NLL under Var[s] (mean and W detached) and beta * KL."""
    torch.manual_seed(0)
    model = build_split_cross_encoder(minilm_path, init_cross_bias=-4.0, variant="MEANVAR", init_log_var=-1.0)
    loss_fn = VariationalMarginMSELoss(model, beta=0.5, nll_weight=2.0)
    queries = [p[0] for p in PAIRS]
    docs0, docs1 = [p[1] for p in PAIRS], [p[1] for p in PAIRS[::-1]]
    labels = torch.tensor([[2.0, -1.0], [0.5, 0.0], [1.0, 1.5]])
    loss = loss_fn([queries, docs0, docs1], labels)
    m0, v0, kl0 = loss_fn.moments(list(zip(queries, docs0)))
    m1, v1, kl1 = loss_fn.moments(list(zip(queries, docs1)))
    margin, target = m0 - m1, labels[:, 0] - labels[:, 1]
    mse = (margin - target).pow(2).mean()
    nll = 0.5 * ((margin - target).pow(2) / (v0 + v1) + torch.log(v0 + v1)).mean()
    expected = mse + 2.0 * nll + 0.5 * torch.cat([kl0, kl1]).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    # the likelihood term trains the variance only: with it alone the decoder gets no gradient
    model.zero_grad()
    only_nll = VariationalMarginMSELoss(model, beta=0.0, nll_weight=1.0)
    (only_nll([queries, docs0, docs1], labels) - (m0 - m1 - target).pow(2).mean().detach()).backward()
    head = model.head
    assert head.var_branch.weight.grad is not None and head.var_branch.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="labels of shape"):
        loss_fn([queries, docs0, docs1], torch.zeros(3, 3))
    with pytest.raises(ValueError, match="empty batch"):
        loss_fn([[], [], []], torch.zeros(0, 2))


def test_candidate_pool_and_teacher_scores():
    bm25 = pd.DataFrame({"qid": ["1"] * 4, "docno": ["a", "b", "c", "d"], "score": [9.0, 8.0, 7.0, 6.0]})
    dense = pd.DataFrame({"qid": ["1"] * 3, "docno": ["e", "a", "c"], "dense": [0.9, 0.8, 0.1]})
    pool = distill.candidate_pool(bm25, dense, depth=2)
    assert sorted(pool["docno"]) == ["a", "b", "e"]  # BM25 top 2 (a, b) and dense top 2 (e, a)
    assert dict(zip(pool["docno"], pool["bm25"])) == {"a": 9.0, "b": 8.0, "e": 0.0}  # e: no BM25 match
    q_emb = np.array([[1.0, 0.0]])
    d_emb = np.array([[0.6, 0.8], [1.0, 0.0], [0.0, 1.0]])
    pool = distill.add_cosines(pool, ["1"], q_emb, ["a", "b", "e"], d_emb)
    assert dict(zip(pool["docno"], pool["dense"])) == {"a": 0.6, "b": 1.0, "e": 0.0}
    np.testing.assert_allclose(
        distill.teacher_scores(pool, 0.3), interpolate(pool["qid"], pool["bm25"], pool["dense"], 0.3)
    )
    with pytest.raises(ValueError, match="no document embedding for docno 'zz'"):
        distill.add_cosines(pool.assign(docno=["a", "b", "zz"]), ["1"], q_emb, ["a", "b", "e"], d_emb)


def test_teacher_in_student_units_ranks_as_the_fused_teacher_and_starts_at_the_students_score():
    """Per query the fused teacher times scale * sd_q(cos) / alpha plus a constant: the same ranking and margins in
    proportion; the cosine part is scale * cos (alpha 1: exactly the student's starting score)."""
    rng = np.random.default_rng(0)
    pool = pd.DataFrame(
        {"qid": np.repeat(["1", "2", "3"], 7), "dense": rng.uniform(0, 1, 21), "bm25": rng.gamma(2, 3, 21)}
    )
    pool.loc[pool["qid"] == "3", "bm25"] = 4.0  # a query whose BM25 scores are all equal: its z-scores are 0
    for alpha in (0.3, 0.8, 1.0):
        fused, mine = distill.teacher_scores(pool, alpha), distill.teacher_in_student_units(pool, alpha, 10.0)
        for _, g in pool.groupby("qid"):
            i = g.index.to_numpy()
            sd = g["dense"].std(ddof=0)
            np.testing.assert_allclose(np.diff(mine[i]), 10.0 * sd / alpha * np.diff(fused[i]), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(mine[pool["qid"] == "3"], 10.0 * pool.loc[pool["qid"] == "3", "dense"])
    np.testing.assert_allclose(distill.teacher_in_student_units(pool, 1.0, 7.0), 7.0 * pool["dense"])
    with pytest.raises(ValueError, match="alpha must lie in"):
        distill.teacher_in_student_units(pool, 0.0, 10.0)


def test_lexical_share_closed_forms():
    """Within each query z(bm25) and z(dense) are orthogonal with equal norms, so z(a z_b + b z_d) = (a z_b + b z_d) /
    sqrt(a^2 + b^2) in every query and the least-squares weights are exactly (a, b) / sqrt(a^2 + b^2), r2 1."""
    b, d = np.array([1.0, -1.0, 1.0, -1.0]), np.array([1.0, 1.0, -1.0, -1.0])  # orthogonal, mean 0, sd 1
    frame = pd.DataFrame({"qid": np.repeat(["1", "2"], 4), "bm25": np.r_[b, 5 + 2 * b], "dense": np.r_[d, 0.3 * d]})
    zb, zd = np.r_[b, b], np.r_[d, d]
    for a, c in ((3.0, 4.0), (1.0, 0.0), (0.0, 2.0), (-1.0, 1.0)):
        got = distill.lexical_share(frame, 7.0 + a * zb + c * zd)  # an offset changes no z-score
        norm = np.hypot(a, c)
        assert got["w_bm25"] == pytest.approx(a / norm) and got["w_dense"] == pytest.approx(c / norm)
        assert got["r2"] == pytest.approx(1.0) and got["bm25_share"] == pytest.approx(abs(a) / (abs(a) + abs(c)))
    noise = distill.lexical_share(frame, np.r_[b * d, b * d])  # orthogonal to both halves
    assert noise["r2"] == pytest.approx(0.0, abs=1e-12)
    assert np.isnan(distill.lexical_share(frame, np.ones(8))["bm25_share"])  # nothing to explain


def test_choose_teacher_picks_the_better_signal():
    # query 1: BM25 puts the relevant doc last, the dense score first -> alpha 1 is best
    pool = pd.DataFrame({"qid": ["1"] * 3, "docno": ["r", "x", "y"], "bm25": [1.0, 5.0, 4.0], "dense": [0.9, 0.1, 0.2]})
    qrels = pd.DataFrame({"qid": ["1"], "docno": ["r"], "label": [1]})
    chosen = distill.choose_teacher(pool, qrels, alphas=(0.0, 0.5, 0.8, 1.0))
    # z-scores: r is first from alpha 0.8 on (0.8 * 1.40 - 0.2 * 1.37 > x's 0.8 * -0.84 + 0.2 * 0.98), not at 0.5
    assert chosen["alpha"] == 0.8  # the smallest weight among ties
    assert chosen["dev"][0.0] < chosen["dev"][0.5] < chosen["dev"][0.8] == chosen["dev"][1.0] == 1.0


def test_distillation_rows():
    rng = np.random.default_rng(0)
    pool = pd.DataFrame(
        {
            "qid": np.repeat(["1", "2", "3"], 20),
            "docno": [f"d{i}" for i in range(60)],
            "teacher": rng.normal(size=60),
        }
    )
    texts = {f"d{i}": f"text {i}" for i in range(60)}
    rows = distill.distillation_rows(pool, {"1": "q1", "2": "q2", "3": "q3"}, texts, 7, negatives=3, top=5)
    assert len(rows) == 7 and rows.column_names == ["query", *[f"document_{j}" for j in range(4)], "label"]
    assert sorted(rows["query"][:3]) == ["q1", "q2", "q3"]  # a round visits every query once
    by_text = dict(zip((texts[d] for d in pool["docno"]), pool["teacher"]))
    for row in rows:
        q = row["query"][1]
        top5 = set(pool[pool["qid"] == q].nlargest(5, "teacher")["docno"].map(texts))
        assert row["document_0"] in top5
        assert all(row[f"document_{j}"] not in top5 for j in (1, 2, 3))
        assert row["label"] == pytest.approx([by_text[row[f"document_{j}"]] for j in range(4)])
    pool["bm25"] = np.arange(60) / 4.0
    scored_rows = distill.distillation_rows(
        pool, {"1": "q1", "2": "q2", "3": "q3"}, texts, 7, top=5, score_column="bm25"
    )
    for plain, row in zip(rows, scored_rows):  # the same draws, each text after its BM25 score
        for j in range(4):
            docno = f"d{plain[f'document_{j}'].split()[1]}"
            assert (
                row[f"document_{j}"]
                == f"{pool.set_index('docno').at[docno, 'bm25']:.2f} [SEP] {plain[f'document_{j}']}"
            )
    with pytest.raises(ValueError, match=r"more than top=20 candidates \(at most 20\).*--pool-depth"):
        distill.distillation_rows(pool, {"1": "q1", "2": "q2", "3": "q3"}, texts, 7, top=20)  # was an endless loop


def test_ece_and_platt():
    prob = np.array([0.1, 0.1, 0.9, 0.9])
    label = np.array([0, 1, 1, 1])
    # two equal-mass bins: |0.1 - 0.5| and |0.9 - 1.0|, each half the pairs
    assert cal.expected_calibration_error(prob, label, bins=2) == pytest.approx(0.5 * 0.4 + 0.5 * 0.1)
    rng = np.random.default_rng(0)
    s = rng.normal(size=20000)
    y = rng.random(20000) < 1 / (1 + np.exp(-(2.0 * s - 1.0)))
    a, b = cal.fit_platt(s, y)
    assert a == pytest.approx(2.0, abs=0.1) and b == pytest.approx(-1.0, abs=0.1)
    p_sure = cal.relevance_probability(np.array([3.0]), (a, b))
    p_unsure = cal.relevance_probability(np.array([3.0]), (a, b), std=np.array([2.0]))
    assert 0.5 < p_unsure[0] < p_sure[0]  # integrating a Gaussian score out moves the probability towards 1/2


def test_ranking_calibration_pairs_fit_and_error():
    """preference_pairs against a brute-force loop (top 3 per query, pairs with different labels, the higher-scored
    first); fit_preference recovers a Bradley-Terry slope; a model calibrated by construction has a small ranking
    calibration error and a miscalibrated one (its differences scaled by 5) a large one."""
    frame = pd.DataFrame({"qid": list("aaaabbb"), "docno": list("1234567"), "s": [0.3, 0.9, 0.1, 0.5, 2.0, 1.0, 3.0]})
    frame["s_std"] = [0.1, 0.2, 0.3, 0.4, 1.0, 1.0, 2.0]
    qrels = pd.DataFrame({"qid": list("aaab"), "docno": ["2", "1", "4", "6"], "label": [2, 1, 1, 1]})
    got = cal.preference_pairs(frame, qrels, "s", "s_std", depth=3)
    expected = []
    for q in "ab":
        g = frame[frame["qid"] == q].sort_values("s", ascending=False).head(3)
        lab = {d: g_ for qq, d, g_ in qrels.itertuples(index=False) if qq == q}
        rows = list(g.itertuples(index=False))
        for x in range(len(rows)):
            for y in range(x + 1, len(rows)):
                hi, lo = rows[x], rows[y]
                if lab.get(hi.docno, 0) != lab.get(lo.docno, 0):
                    agree = float(lab.get(hi.docno, 0) > lab.get(lo.docno, 0))
                    expected.append((hi.s - lo.s, hi.s_std**2 + lo.s_std**2, agree))
    np.testing.assert_allclose(got[["delta", "var", "agree"]].to_numpy(), np.array(expected))
    assert cal.preference_probability(np.array([1.0]), 2.0)[0] == pytest.approx(1 / (1 + np.exp(-2.0)))
    rng = np.random.default_rng(0)
    delta = np.abs(rng.normal(size=20000))
    agree = (rng.random(20000) < 1 / (1 + np.exp(-1.5 * delta))).astype(float)
    assert cal.fit_preference(delta, agree) == pytest.approx(1.5, abs=0.1)
    pairs = pd.DataFrame({"delta": delta, "var": 0.0, "agree": agree})
    good = cal.ranking_calibration(pairs.iloc[:10000], pairs.iloc[10000:])
    assert good["a"] == pytest.approx(1.5, abs=0.15) and good["rce"] < 0.02 and "rce_without_std" not in good
    worse = cal.expected_calibration_error(cal.preference_probability(delta[10000:], 7.5), agree[10000:])
    assert worse > 0.1
    with_std = cal.ranking_calibration(pairs.assign(var=1.0).iloc[:10000], pairs.assign(var=1.0).iloc[10000:])
    assert with_std["rce_without_std"] == pytest.approx(good["rce"], abs=1e-6)


def test_uncertainty_spread_and_hard_queries():
    """One measure of the spread of std[s] and of whether uncertain queries are hard (analysis.uncertainty_stats,
    which the distillation's report uses too); a share with a zero denominator is NaN, not 0."""
    ranks = [0, 1, 0, 1]
    run = pd.DataFrame({"qid": list("aabb"), "rank": ranks, "score_mean": 0.0, "score_std": [1.0, 1.0, 3.0, 3.0]})
    spread = uncertainty_stats(run, pd.Series([0.5, 0.4], index=list("ab")))
    assert spread["std_between_queries_sd"] == pytest.approx(1.0)
    assert spread["std_within_query_cv_median"] == 0.0
    assert spread["std_between_query_variance_share"] == pytest.approx(1.0)
    assert np.isnan(
        uncertainty_stats(run.assign(score_std=2.0), pd.Series([0.5, 0.4], index=list("ab")))[
            "std_between_query_variance_share"
        ]
    )
    std = [1, 1, 2, 2, 3, 3.0]
    run = pd.DataFrame({"qid": list("aabbcc"), "rank": [0, 1] * 3, "score_mean": [2, 1] * 3, "score_std": std})
    ndcg = pd.Series([0.9, 0.5, 0.1], index=list("abc"))
    out = uncertainty_stats(run, ndcg)
    assert out["rho_top10_std_vs_nDCG@10"] == pytest.approx(-1.0) and out["n_queries"] == 3


@pytest.mark.slow
def test_fine_tune_split_student_under_partial(minilm_path, tmp_path):
    """fine_tune trains a split student's joint layers, cross bias and head on per-text cached states; the lower
    layers stay as they were; a train_layers other than the joint layers is refused."""
    from sentence_transformers.cross_encoder.losses import MarginMSELoss

    from pyterrier_prob.training import Recipe, fine_tune

    model = build_split_cross_encoder(minilm_path, init_cross_bias=-4.0)
    lower = {k: v.clone() for k, v in model[0].auto_model.encoder.layer[0].state_dict().items()}
    joint = {k: v.clone() for k, v in model[0].auto_model.encoder.layer[5].state_dict().items()}
    from datasets import Dataset

    rows = Dataset.from_dict(
        {
            "query": [p[0] for p in PAIRS] * 2,
            "document_0": [p[1] for p in PAIRS] * 2,
            "document_1": [p[1] for p in PAIRS[::-1]] * 2,
            "label": [[1.0, 0.0]] * 6,
        }
    )
    with pytest.raises(ValueError, match="joint layers"):
        fine_tune(model, MarginMSELoss(model), rows, Recipe(mode="partial", steps=2, batch_size=3, train_layers=1))
    recipe = Recipe(mode="partial", steps=2, batch_size=3, train_layers=2, learning_rate=1e-3)
    fine_tune(model, MarginMSELoss(model), rows, recipe, state_cache=str(tmp_path / "s"), show_progress=False)
    after_lower = model[0].auto_model.encoder.layer[0].state_dict()
    after_joint = model[0].auto_model.encoder.layer[5].state_dict()
    assert all(torch.equal(lower[k], after_lower[k]) for k in lower)
    assert any(not torch.equal(joint[k], after_joint[k]) for k in joint)
    assert float(model[0].cross.bias.detach()[0]) != -4.0
    # without a cache folder the states live in a temporary folder: the model is left without the cache
    fine_tune(model, MarginMSELoss(model), rows, recipe, show_progress=False)
    assert model[0].state_cache is None
    assert model.predict(PAIRS[:1]).shape == (1,)


def test_teacher_options_that_cannot_apply_are_refused(tmp_path, small_beir):
    """--teacher is a mode of varce: the frozen recipe, --steps 0 and the options of the label recipe's stages
    (robustness, negative mining) are refused, each naming its option; a missing teacher folder names it."""
    from pyterrier_prob.cli import build_parser
    from pyterrier_prob.experiments import varce, varce_distill

    def config(*argv):
        return varce.config_from_args(build_parser("varce").parse_args(["--teacher", "T", *argv]))

    partial_ = ["--recipe", "partial", "--output", str(tmp_path / "o")]
    assert varce_distill.joint_layers(config(*partial_)) == 1  # --train-layers: default 1 joint layer
    assert varce_distill.joint_layers(config(*partial_, "--train-layers", "1")) == 1
    with pytest.raises(ValueError, match="--recipe partial"):
        varce_distill.check_options(config("--output", str(tmp_path), "--recipe", "frozen"))
    with pytest.raises(ValueError, match="--steps 0"):
        varce_distill.check_options(config(*partial_, "--steps", "0"))
    plain = ["--output", str(tmp_path), "--teacher", "none"]
    for argv, message in (
        (["--students", "CE"], "--students chooses distilled students: not under --teacher none"),
        (["--input-score"], "--input-score trains distilled students"),
        (["--pseudo-queries", "title"], "--pseudo-queries trains distilled students"),
    ):
        with pytest.raises(ValueError, match=message):
            varce.config_from_args(build_parser("varce").parse_args([*plain, *argv])).check()
    with pytest.raises(ValueError, match="names a student twice"):
        config(*partial_, "--students", "CE", "CE").check()
    for bad in ("0", "-1e-3", "nan"):
        with pytest.raises(ValueError, match="--head-lr must be a finite number > 0"):
            config(*partial_, f"--head-lr={bad}").check()
    with pytest.raises(ValueError, match="--cross-bias-lr must be a finite number >= 0"):
        config(*partial_, "--cross-bias-lr=-1").check()
    cfg = config(*partial_)
    cfg.check()  # --train-layers left out under --teacher: the students' default, 1 joint layer
    assert cfg.train_layers == 1
    # plain ``pyterrier-prob varce`` distils (a teacher fine-tuned in the run); --teacher none: the label recipe
    cfg = varce.config_from_args(build_parser("varce").parse_args([]))
    cfg.check()
    want = ("partial", "partial", 50, 16, 1e-4, 1, ("CE", "VarCE-VAR"))
    assert (cfg.teacher, cfg.recipe, cfg.steps, cfg.batch_size, cfg.lr, cfg.train_layers, cfg.students) == want
    assert (cfg.dev_every, cfg.teacher_steps, cfg.teacher_dev_every, cfg.mc_dropout) == (25, 100, 100, 0)
    cfg = varce.config_from_args(build_parser("varce").parse_args(["--teacher", "none"]))
    cfg.check()
    assert (cfg.teacher, cfg.recipe, cfg.steps, cfg.batch_size, cfg.lr, cfg.train_layers) == (
        None,
        "frozen",
        1000,
        64,
        5e-5,
        None,
    )
    assert cfg.dev_every == 100  # the label recipe's dev points: a tenth of its steps (a distilling run: half)
    cfg = varce.config_from_args(build_parser("varce").parse_args(["--steps", "7", "--recipe", "partial"]))
    cfg.check()  # given values stay
    assert (cfg.recipe, cfg.steps, cfg.dev_every) == ("partial", 7, 3)
    for argv in (["--robust-queries", "5"], ["--negatives-from", "bm25"], ["--positive-depth", "5"]):
        with pytest.raises(ValueError, match=f"{argv[0]} does not apply under --teacher"):
            varce_distill.check_options(config(*partial_, *argv))
    folder, _ = small_beir
    with pytest.raises(FileNotFoundError, match="not a saved sentence-transformers model"):
        varce_distill.run(config(*partial_, "--dataset", str(folder), "--steps", "2", "--batch-size", "4"))


def _teacher_argv(folder, teacher, out, *extra):
    argv = ["varce", "--dataset", str(folder), "--teacher", teacher, "--recipe", "partial", "--train-layers", "1"]
    argv += ["--steps", "2", "--batch-size", "4", "--max-seq-length", "32", "--depth", "20", "--pool-depth", "12"]
    argv += ["--students", *STUDENTS]  # every student (a plain run trains the CE and VarCE-VAR)
    return argv + ["--dev-queries", "4", "--dev-depth", "3", "--output", str(out), "--quiet", *extra]


def test_teacher_run_end_to_end(small_beir, small_beir_no_train_no_dev, minilm_path, tmp_path):
    """``pyterrier-prob varce --teacher``: students trained for 2 steps through the harness, every collection's rows,
    the teacher's weight chosen on dev, the learning curves and the report's splits / recipe / zero-shot lines; a
    rerun with --reuse reuses every stage and reports the very same figures (BM25's threads finishing in another
    order); --max-queries and --ood-queries set the evaluated queries."""
    from pyterrier_prob.cli import main

    folder, info = small_beir
    ood, ood_info = small_beir_no_train_no_dev
    out = tmp_path / "distill"
    argv = _teacher_argv(folder, minilm_path, out, "--ood", str(ood), "--ood-queries", "3", "--ood-depth", "10")
    argv += ["--max-queries", "5", "--extra-depths", "5", "--risks", "0", "1", "--pseudo-queries", "title", "span"]
    argv += ["--mc-dropout", "2"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    pseudo = summary["teacher"]["pseudo_queries"]
    assert pseudo["kinds"] == ["title", "span"] and min(pseudo["queries"].values()) > 0
    (path,) = (out / "teacher").rglob("*-pseudo-pool-*.parquet")
    made = pd.read_parquet(path)
    assert made["qid"].str.startswith("pq-").all()
    assert len(made) == pseudo["pool_pairs"] and summary["teacher"]["pool_queries"] > info["queries"]["train"]
    assert not (made["qid"].str.split("-", n=2).str[2] == made["docno"]).any()  # no query meets its own document
    assert summary["joint_layers"] == 1
    assert set(summary["scoring"]) == set(STUDENTS) and all(v["pairs_scored"] > 0 for v in summary["scoring"].values())
    from scipy.stats import ttest_rel

    for row in summary["rows"]:  # the per-query values recompute every row's mean, test and interval
        if row["depth"] != (20 if row["collection"] == str(folder) else 10):
            continue
        per = {n: pd.Series(v) for n, v in summary["per_query"][row["collection"]].items()}
        mine, bi, bm25 = per[row["system"]], per["Teacher (bi-encoder)"], per["BM25"]
        assert row["nDCG@10"] == pytest.approx(mine.mean(), abs=1e-12)
        if row["p_vs_bi_encoder"] is not None:
            assert row["p_vs_bi_encoder"] == pytest.approx(ttest_rel(mine, bi).pvalue)
        if row["ci95_vs_bm25"] is not None:
            ci = ttest_rel(mine, bm25).confidence_interval(0.95)
            assert row["ci95_vs_bm25"] == pytest.approx([ci.low, ci.high])
        student = row["system"] in STUDENTS
        assert (row["joint_layers"] == 1) if student else row["joint_layers"] is None
        assert row["input_score"] is None and (row["cross_attention_mass"] is not None) == student
    chosen = {r["system"] for r in summary["rows"] if r["chosen_on_dev"]}
    assert chosen == {"CE"}  # every student's dev curve ties at step 0: the first
    for label, n in ((str(folder), 5), (str(ood), 3)):  # selective prediction per collection and student
        tables = summary["aurc"][label]
        assert set(tables) == set(STUDENTS)
        for name, t in tables.items():
            confidences = {"score (top 10)", "NQC (BM25)", "WIG (BM25)", "MC dropout (top 10)"}
            assert set(t["aurc"]) == confidences | ({"std[s] (top 10)"} if name != "CE" else set())
            assert 0 < t["queries"] <= n and all(len(c["risk"]) == t["queries"] for c in t["curves"].values())
            assert all(t["optimal"] <= a + 1e-12 for a in t["aurc"].values())
    assert set(summary["std_shift"]) == {"VarCE-MEANVAR", "VarCE-VAR"}
    assert (out / "risk_coverage.png").stat().st_size > 0
    assert 0 <= summary["std_shift"]["VarCE-VAR"][str(ood)]["p"] <= 1
    for name in STUDENTS:  # the attention between the texts, as built and as kept: open from the start
        mass = summary["cross_attention_mass"][name]
        assert mass["pairs"] == summary["dev_candidates"] and len(mass["step_0"]) == len(mass["kept"]) == 1
        assert 0.1 * mass["step_0"][0]["uniform_query_to_document"] < mass["step_0"][0]["query_to_document"] < 1
    by_alpha = {float(a): v for a, v in summary["teacher"]["dev_nDCG@10_by_alpha"].items()}
    alpha = summary["teacher"]["alpha"]
    fused = f"Teacher (bi-encoder + BM25, alpha {alpha})"
    assert list(summary["lexical_share"]) == list(summary["evaluated"])  # how far each ranker follows BM25
    for shares in summary["lexical_share"].values():
        assert list(shares) == [fused, *STUDENTS]
        assert all(0 <= v["r2"] <= 1 + 1e-12 and 0 <= v["bm25_share"] <= 1 for v in shares.values())
    best = max(by_alpha.values())
    assert alpha == min(a for a, v in by_alpha.items() if v == best)  # the best on dev, ties to the smaller
    systems = ["BM25", "Teacher (bi-encoder)", f"Teacher (bi-encoder + BM25, alpha {alpha})", *STUDENTS]
    rows = pd.DataFrame(summary["rows"])
    assert rows["system"].tolist() == systems * 4  # the dataset at depth 20 and 5 (--extra-depths), the --ood at 10, 5
    assert rows["depth"].tolist() == [20] * 6 + [5] * 6 + [10] * 6 + [5] * 6
    assert rows["queries"].tolist() == [5] * 12 + [3] * 12  # --max-queries 5, --ood-queries 3
    assert rows["nDCG@10"].between(0, 1).all() and rows["ece"].notna().sum() == len(STUDENTS)
    evaluated = summary["evaluated"]
    assert [e["zero_shot"] for e in evaluated.values()] == [False, True]
    assert [e["queries_available"] for e in evaluated.values()] == [
        info["queries"]["test"],
        ood_info["queries"]["test"],
    ]
    assert {float(r) for r in summary["uncertainty"][str(folder)]["VarCE-VAR"]["risk_dev"]} == {0.0, 1.0}  # --risks
    assert summary["data"]["train"].endswith("/train") and summary["data"]["calibration"].endswith("/dev")
    assert set(summary["recipes"]) == {f"distilled-{s}" for s in STUDENTS}  # the harness trained them
    assert all(
        r["mode"] == "partial" and r["train_layers"] == 1 and r["steps"] == 2 for r in summary["recipes"].values()
    )
    assert 0 < summary["dev_candidates"] <= 4 * 3
    for name in STUDENTS:
        curve = json.loads((out / "curves" / f"distilled-{name}.json").read_text())
        assert summary["dev_curves"][name] == curve and [p["step"] for p in curve["points"]] == [0, 1, 2]
        assert (out / "models" / f"distilled-{name}" / "README.md").is_file()  # the model card
        assert summary["train_steps_per_s"][f"distilled-{name}"] > 0
    assert not (out / "models" / "CE").exists()  # a plain run's folder
    # 2 steps never beat the start on dev (ties keep step 0): the report says the students kept are untrained
    assert summary["kept_untrained"] == list(STUDENTS)
    report = (out / "results.md").read_text()
    assert f"no dev point after step 0 beat the start for {', '.join(STUDENTS)}" in report
    assert f"Trained on {folder}/train; calibration/dev: {folder}/dev; test: {folder}/test (5 queries)." in report
    assert "Recipe of distilled-CE, distilled-VarCE-MEANVAR, distilled-VarCE-VAR: **partial**" in report
    assert f"zero-shot: {ood}" in report and "chosen on dev (" in report and "chosen on dev: each student's" in report
    assert f"Selective prediction on {ood} (" in report and "- VarCE-VAR (" in report  # AURCs, attention mass
    assert f"| {fused} | {summary['lexical_share'][str(folder)][fused]['bm25_share']:.3f} (" in report
    assert f"pseudo-queries: {sum(pseudo['queries'].values())} cut from" in report
    teacher_files = sorted(p.name.rsplit("-", 1)[0] for p in (out / "teacher").rglob("*.npy"))
    assert teacher_files == sorted([f"{slug(str(f), '_')}-{w}" for f in (folder, ood) for w in ("docs", "queries")]
                                   + [f"{slug(str(folder), '_')}-queries"] * 3)  # dev, train, pseudo  # fmt: skip
    assert not [p for p in out.rglob(".*") if re.search(r"\.\w+-\d+-[0-9a-f]{12}$", p.name)]  # no temporary left
    mc_files = sorted((out / "scores").glob("mc-dropout-*.json"))  # per student and collection, read back below
    assert len(mc_files) == 2 * len(STUDENTS)
    stamps = {p.name: p.stat().st_mtime_ns for p in mc_files}

    with pisa_threads_finish_backwards():  # BM25's queries in another order: everything reused, the same figures
        assert main([*argv, "--reuse"]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert not [k for k in again["timings_s"] if k.startswith("train_")]  # nothing trained again
    for key in ("rows", "dev_curves", "teacher", "calibration", "uncertainty", "dev_candidates", "kept_untrained",
                "cross_attention_mass", "aurc", "std_shift", "lexical_share"):  # fmt: skip
        assert_same_figures(again[key], summary[key])
    assert again["train_steps_per_s"] == summary["train_steps_per_s"]  # a reused student reports its training's
    assert {p.name: p.stat().st_mtime_ns for p in mc_files} == stamps  # the MC-dropout passes were not run again


def test_teacher_rerun_with_other_steps_retrains_and_plain_runs_keep_their_own_models(
    small_beir, minilm_path, tmp_path
):
    """A --reuse rerun with other --steps, rates and --teacher-units trains the students again
    (their settings differ); a plain (label) run in the same folder trains its own models (models/CE, ...) and leaves
    the distilled ones alone."""
    from pyterrier_prob.cli import main

    folder, _ = small_beir
    out = tmp_path / "both"
    argv = _teacher_argv(folder, minilm_path, out, "--max-queries", "3", "--ood-queries", "3")
    assert main(argv) == 0
    settings = json.loads((out / "models" / "distilled-CE" / "train_settings.json").read_text())
    rates = ["--head-lr", "0.02", "--cross-bias-lr", "0"]
    assert main([*argv, "--reuse", "--steps", "3", *rates, "--teacher-units", "student"]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert {f"train_distilled-{s}" for s in STUDENTS} <= set(again["timings_s"])  # retrained, not reused
    retrained = json.loads((out / "models" / "distilled-CE" / "train_settings.json").read_text())
    assert (settings["settings"]["recipe"]["steps"], retrained["settings"]["recipe"]["steps"]) == (2, 3)
    wanted = {"LinearScoreHead": 0.02, "CrossAttentionBias": 0.0}
    assert "module_learning_rates" not in settings["settings"]
    assert retrained["settings"]["module_learning_rates"] == wanted
    assert "teacher_units" not in settings["settings"] and retrained["settings"]["teacher_units"] == "student"
    assert retrained["settings"]["recipe"]["module_learning_rates"] == wanted  # the head's and the bias's own
    var = json.loads((out / "models" / "distilled-VarCE-VAR" / "train_settings.json").read_text())["settings"]
    assert var["recipe"]["module_learning_rates"] == {"VariationalHead": 0.02, "CrossAttentionBias": 0.0}
    bias = load_file(str(out / "models" / "distilled-CE" / "split_attention.safetensors"))
    assert all(float(t.abs().max()) == 0.0 for t in bias.values())  # rate 0: kept at --init-cross-bias (0)
    assert [p["step"] for p in again["dev_curves"]["CE"]["points"]] == [0, 1, 2, 3]

    plain = ["varce", "--dataset", str(folder), "--teacher", "none", "--recipe", "partial", "--train-layers", "1"]
    plain += ["--steps", "2"]
    plain += ["--batch-size", "4", "--max-seq-length", "32", "--depth", "5", "--max-queries", "3", "--robust-queries"]
    plain += ["0", "--dev-queries", "0", "--negatives-from", "bm25", "--output", str(out), "--quiet", "--reuse"]
    assert main(plain) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert {"train_CE", "train_VarCE-MEANVAR", "train_VarCE-VAR"} <= set(summary["timings_s"])  # its own, trained
    assert (out / "models" / "CE" / "modules.json").is_file() and (out / "models" / "distilled-CE").is_dir()
    assert json.loads((out / "models" / "distilled-CE" / "train_settings.json").read_text()) == retrained


def test_score_as_text_in_the_reranker(minilm_path):
    """``input_score=True``: the re-ranker scores ``"<score> [SEP] <text>"``, the first stage's score read as text
    (Askari et al. 2023), the same as scoring those texts; without a score column it says what is missing."""
    from pyterrier_prob.varce.rerank import VarCrossEncoderReranker, score_as_text

    assert score_as_text(["a b", "c"], [12.345, -1]) == ["12.35 [SEP] a b", "-1.00 [SEP] c"]
    with pytest.raises(ValueError, match="non-finite score at row 1"):
        score_as_text(["a", "b"], [1.0, np.inf])
    model = build_split_cross_encoder(minilm_path, variant="VAR")
    cand = pd.DataFrame({"qid": ["q1"] * 3, "query": [PAIRS[0][0]] * 3, "docno": ["a", "b", "c"]})
    cand = cand.assign(text=[p[1] for p in PAIRS], score=[7.0, 3.5, 1.25], rank=[0, 1, 2])
    reranker = VarCrossEncoderReranker(model, verbose=False, input_score=True)
    out = reranker(cand).set_index("docno")
    texts = score_as_text(cand["text"].tolist(), cand["score"].to_numpy())
    mean, _ = model.predict(list(zip(cand["query"], texts)), return_std=True)
    np.testing.assert_allclose(out.loc[["a", "b", "c"], "score_mean"], mean, rtol=1e-5, atol=1e-5)
    plain = VarCrossEncoderReranker(model, verbose=False)(cand).set_index("docno")
    assert not np.allclose(plain.loc[["a", "b", "c"], "score_mean"], mean)  # the score text is read
    assert "input_score=True" in repr(reranker)
    with pytest.raises(Exception, match=r"missing \['score'\].*retrieve first"):
        reranker(cand.drop(columns=["score"]))


def test_teacher_run_with_score_as_text(small_beir, minilm_path, tmp_path):
    """--input-score adds the two score-as-text students in rows of their own (the plain rows stay, and only they
    can be chosen on dev); their models are trained on score-prefixed rows."""
    from pyterrier_prob.cli import main
    from pyterrier_prob.experiments.varce_distill import INPUT_SCORE, SCORE_STUDENTS

    folder, _ = small_beir
    out = tmp_path / "scored"
    argv = _teacher_argv(folder, minilm_path, out, "--max-queries", "3", "--input-score", "--mc-dropout", "0")
    assert main([*argv, "--students", "CE"]) == 0  # --students: the plain CE alone
    summary = json.loads((out / "summary.json").read_text())
    rows = pd.DataFrame(summary["rows"])
    assert rows["system"].tolist()[-3:] == ["CE", *SCORE_STUDENTS] and summary["students"] == {
        s: f"distilled-{s}" for s in ["CE", *SCORE_STUDENTS]
    }
    for row in summary["rows"]:
        assert row["input_score"] == (INPUT_SCORE if row["system"] in SCORE_STUDENTS else None)
    assert rows[rows["chosen_on_dev"]]["system"].tolist() == ["CE"]
    for s in SCORE_STUDENTS:
        settings = json.loads((out / "models" / f"distilled-{s}" / "train_settings.json").read_text())["settings"]
        assert settings["input_score"] == INPUT_SCORE
        assert set(summary["aurc"][str(folder)]) == {"CE", *SCORE_STUDENTS}
    assert (
        "input_score"
        not in json.loads((out / "models" / "distilled-CE" / "train_settings.json").read_text())["settings"]
    )


def test_kernel_pooling_brute_force_and_kernel_student_starts_as_the_bi_encoder(minilm_path, bi_encoder, tmp_path):
    """``kernel_pooling`` against a loop over query and document tokens (KNRM, Eq. 3-5 with log1p and the query-token
    average); a ``joint_feature="kernels"`` student scores 20 * cos of its bi-encoder at the start, its kernel weights
    get gradient, the feature has 384 + J * 11 columns, and a trained-looking model round-trips."""
    from st_extensions.cross_encoder.split import KERNEL_MUS, kernel_pooling

    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(2, 7, 5, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    q_mask = torch.tensor([[1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0]])
    mus, sigmas = [1.0, 0.5, -0.2], [1e-3, 0.1, 0.3]
    got = kernel_pooling(tokens, q_mask, mask, mus, sigmas)
    n = tokens / tokens.norm(dim=-1, keepdim=True)
    for b in range(2):
        qi = [i for i in range(7) if q_mask[b, i]]
        di = [j for j in range(7) if mask[b, j] and not q_mask[b, j]]
        for k, (mu, s) in enumerate(zip(mus, sigmas)):
            per = [np.log1p(sum(np.exp(-((float(n[b, i] @ n[b, j]) - mu) ** 2) / (2 * s * s)) for j in di)) for i in qi]
            assert float(got[b, k]) == pytest.approx(float(np.mean(per)), rel=1e-9, abs=1e-12)
    # a position that is padding in every pair changes nothing; a pair without document tokens pools log1p(0) = 0
    padded = torch.cat([tokens, torch.randn(2, 1, 5, generator=g, dtype=torch.float64)], dim=1)
    pad = torch.zeros(2, 1, dtype=torch.long)
    wider = kernel_pooling(padded, torch.cat([q_mask, pad], 1), torch.cat([mask, pad], 1), mus, sigmas)
    torch.testing.assert_close(wider, got, rtol=1e-12, atol=1e-12)
    no_doc = kernel_pooling(tokens, q_mask, q_mask, mus, sigmas)
    assert torch.equal(no_doc, torch.zeros_like(no_doc))
    # an exact copy of a query token in the document counts once in the exact-match kernel
    copy = tokens.clone()
    copy[0, 2] = copy[0, 0] * 3.0
    assert float(kernel_pooling(copy, q_mask, mask, [1.0], [1e-3])[0, 0]) >= np.log1p(1.0) / 2 - 1e-9

    q = bi_encoder.encode([p[0] for p in PAIRS], normalize_embeddings=True)
    d = bi_encoder.encode([p[1] for p in PAIRS], normalize_embeddings=True)
    expected = 20.0 * (q * d).sum(1)
    for variant in (None, "VAR"):
        model = build_split_cross_encoder(
            minilm_path, bi_encoder_path=True, joint_feature="kernels", variant=variant, scale=20.0
        )
        np.testing.assert_allclose(model.predict(PAIRS), expected, atol=1e-4)
    assert model[1].get_embedding_dimension() == 384 + 2 * len(KERNEL_MUS)
    model = build_split_cross_encoder(minilm_path, bi_encoder_path=True, joint_feature="kernels", scale=20.0)
    decoder = model[2].linear
    model(model.preprocess(PAIRS[:2]))["scores"].sum().backward()
    assert decoder.weight.grad[0, 384:].abs().sum() > 0
    with torch.no_grad():
        decoder.weight[0, 384:] = 0.05
    before = model.predict(PAIRS)
    assert np.abs(before - expected).max() > 1e-3 and joint_term(model, PAIRS)["joint_share"] > 0
    model.save(str(tmp_path / "k"))
    np.testing.assert_allclose(load_model(str(tmp_path / "k")).predict(PAIRS), before, atol=1e-5)
    with pytest.raises(ValueError, match="bi_encoder_path=True"):
        build_split_cross_encoder(minilm_path, joint_feature="kernels")


def test_meanvar_mean_branch_trains_at_the_head_rate_over_its_width(minilm_path, tmp_path):
    """A kernel MEANVAR student's identity-started mean branch trains at the head's rate / width (``mean_branch_rate``,
    saved with the head): one Adam step moves its effective kernel weights (decoder @ mean branch) by about the head's
    rate, as a CE's linear head moves, where the branch at the head's own rate moves them by ~width times that."""
    from pyterrier_prob.training import head_learning_rates

    lr = 1e-3

    def effective_kernel_step(model) -> float:
        head = model[2]
        loss = VariationalMarginMSELoss(model)
        by_name = dict(loss.named_parameters())
        mapping = head_learning_rates(model, loss)
        groups = [{"params": [by_name[k[1:-1].replace("\\", "")]], "lr": v} for k, v in mapping.items()]
        opt = torch.optim.Adam(groups)

        def eff() -> torch.Tensor:
            return (head.decoder.weight @ head.mean_branch.weight)[0, 384:].detach().clone()

        before = eff()
        rows = [[PAIRS[0][0], PAIRS[2][0]], [PAIRS[0][1], PAIRS[2][1]], [PAIRS[1][1], PAIRS[0][1]]]
        loss(rows, torch.tensor([[2.0, -1.0], [0.5, 1.5]])).backward()
        opt.step()
        return float((eff() - before).abs().max()), mapping

    torch.manual_seed(0)
    model = build_split_cross_encoder(minilm_path, bi_encoder_path=True, joint_feature="kernels", variant="MEANVAR")
    width = model[1].get_embedding_dimension()
    assert model[2].mean_branch_rate == pytest.approx(1.0 / width)
    step, mapping = effective_kernel_step(model)
    rates = {k[1:-1].replace("\\", ""): v for k, v in mapping.items()}
    assert sorted(v for k, v in rates.items() if ".mean_branch." in k) == pytest.approx([lr / width] * 2)
    assert sorted(v for k, v in rates.items() if ".decoder." in k or ".var_branch." in k) == [lr] * 4
    assert step <= 2.5 * lr  # the decoder's own step (lr) + the branch's (lr / width a weight, over width): 1.95 here
    torch.manual_seed(0)  # the rate before: each of the branch's width weights moves by lr
    fresh = build_split_cross_encoder(minilm_path, bi_encoder_path=True, joint_feature="kernels", variant="MEANVAR")
    fresh[2].mean_branch_rate = 1.0
    assert effective_kernel_step(fresh)[0] > 50 * lr  # 1 + width (385) times lr here
    model.save(str(tmp_path / "mv"))
    assert load_model(str(tmp_path / "mv"))[2].mean_branch_rate == pytest.approx(1.0 / width)
    assert not build_split_cross_encoder(minilm_path, variant="VAR")[2].parameter_rate_scales


def test_a_model_folders_fingerprint_ignores_its_card(tmp_path):
    """``--teacher FOLDER``'s fingerprint (what decides ``--reuse``) stays when a run rewrites the model card with its
    figures, and changes when a file of the model changes."""
    import os

    from pyterrier_prob.experiments.varce_train import folder_fingerprint

    (tmp_path / "model.safetensors").write_bytes(b"w")
    (tmp_path / "README.md").write_text("card")
    before = folder_fingerprint(str(tmp_path), 128)
    os.utime(tmp_path / "README.md", (1e9, 1e9))
    (tmp_path / "README.md").write_text("card with a run's figures")
    assert folder_fingerprint(str(tmp_path), 128) == before
    assert folder_fingerprint(str(tmp_path), 256) != before
    os.utime(tmp_path / "model.safetensors", (1e9, 1e9))
    assert folder_fingerprint(str(tmp_path), 128) != before


def test_score_pairs_gives_a_plain_cross_encoders_logits(minilm_path):
    """A plain CrossEncoder's ``predict`` applies a sigmoid by default; ``score_pairs`` promises the logit."""
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(minilm_path, num_labels=1, device="cpu")
    scores, std = distill.score_pairs(model, [q for q, _ in PAIRS], [d for _, d in PAIRS])
    features = model.tokenizer([q for q, _ in PAIRS], [d for _, d in PAIRS], padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model.model(**features).logits[:, 0].numpy()
    assert std is None
    np.testing.assert_allclose(scores, logits, rtol=1e-4, atol=1e-5)
    assert not np.allclose(scores, 1 / (1 + np.exp(-logits)), atol=1e-3)  # not the sigmoid


def test_teacher_only_trains_the_teacher_alone_and_reuses_it(small_beir, minilm_path, tmp_path, capsys):
    """``pyterrier-prob varce --teacher-only`` (:func:`varce_distill.make_teacher`): ``--teacher partial``'s bi-encoder
    trained into the output folder and nothing else (no student, no pool, no summary), its folder printed; run again
    with the same settings it is reused, not trained again. Under another ``--teacher`` it is refused."""
    from pyterrier_prob.cli import build_parser, main
    from pyterrier_prob.experiments import varce, varce_distill

    folder, _ = small_beir
    out = tmp_path / "t"
    argv = ["--dataset", str(folder), "--teacher", "partial", "--recipe", "partial", "--teacher-steps", "2"]
    argv += ["--teacher-batch-size", "4", "--teacher-dev-every", "1", "--max-seq-length", "32", "--model", minilm_path]
    argv += ["--steps", "2", "--output", str(out), "--quiet", "--reuse"]
    made = str(out / "models" / varce_distill.TEACHER)
    assert main(["varce", *argv, "--teacher-only"]) == 0
    assert f"--teacher {made}" in capsys.readouterr().out
    weights = out / "models" / varce_distill.TEACHER / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert json.loads((out / "models" / varce_distill.TEACHER / "train_settings.json").read_text())
    assert sorted(p.name for p in (out / "models").iterdir()) == [varce_distill.TEACHER]
    assert not (out / "summary.json").exists()
    assert [p["step"] for p in json.loads((out / "curves" / f"{varce_distill.TEACHER}.json").read_text())["points"]]
    cfg = varce.config_from_args(build_parser("varce").parse_args(argv))
    assert varce_distill.make_teacher(cfg) == made and weights.stat().st_mtime_ns == stamp  # reused
    argv[argv.index("partial")] = made
    assert main(["varce", *argv, "--teacher-only"]) == 2
    assert f"--teacher-only trains --teacher partial's bi-encoder, not --teacher {made}" in capsys.readouterr().err
