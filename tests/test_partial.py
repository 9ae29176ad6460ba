"""Partial fine-tuning (st_extensions.partial): the top N layers of a BERT Transformer train on the lower layers'
hidden states cached on disk.

Tolerances (all-MiniLM-L6-v2, max_seq_length 32, CPU; measured maxima in brackets):
- forward, fp16 cache: |stand-in - full| <= 1e-3 on normalised embeddings and cross-encoder logits [~1e-4];
- forward, fp32 cache: <= 1e-5 [~2e-7] (not bitwise: the batches are padded to other lengths than when cached);
- gradients of an MNRL loss, per parameter tensor: ||stand-in - full|| <= r * ||full|| + 1e-6 with r = 1e-4 for the
  fp32 cache [~2e-6] and r = 1e-2 for fp16 [~6e-4];
- the attention mask handed to the top layers: identical (torch.equal) to BertModel's, sdpa and eager.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
from datasets import Dataset
from helpers import tiny_training_args
from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, SentenceTransformerTrainingArguments
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

from st_extensions import load_model
from st_extensions.frozen import build_adapter_model
from st_extensions.partial import (
    LayerStateCache,
    PartialTransformer,
    check_partial_transformer,
    layer_attention_mask,
    partial_model,
)

TEXTS = [
    "what causes fever",
    "Fever is usually caused by an infection.",
    "vitamin d deficiency",
    "Low vitamin D levels are common in winter, when the days are short and people spend little time outdoors.",
    "Paris is the capital of France.",
    "The stock market fell sharply on Monday, dragging every index down with it, and a long sentence that is "
    "certainly longer than thirty-two word pieces so that it gets truncated.",
]
QUERIES, DOCS = TEXTS[0::2], TEXTS[1::2]


@pytest.fixture
def model(base_model):
    """A fresh adapter model (all-MiniLM-L6-v2 + a LinearAdapter with random weights), max_seq_length 32, eval."""
    torch.manual_seed(0)
    m = build_adapter_model(base_model, device="cpu")
    m.max_seq_length = 32
    with torch.no_grad():
        m[-1].linear.weight.normal_(0, 0.05)
    return m.eval()


def _layers(m):
    return m[0].auto_model.encoder.layer


@pytest.mark.parametrize("n", [1, 2, 6])
def test_forward_equals_the_full_model(model, n):
    full = model.encode(TEXTS, convert_to_tensor=True)
    stand_in = partial_model(model, n, TEXTS[:4]).eval()  # the other two: computed on first use
    assert isinstance(stand_in[0], PartialTransformer) and stand_in[0].transformer is model[0]
    assert all(a is b for a, b in zip(list(stand_in)[1:], list(model)[1:]))  # shared, not copied
    assert stand_in[0].frozen_layers == 6 - n and stand_in[0].cache.frozen_layers == 6 - n
    got = stand_in.encode(TEXTS, convert_to_tensor=True, batch_size=4)
    assert len(stand_in[0].cache) == len(TEXTS)
    torch.testing.assert_close(got, full, atol=1e-3, rtol=0)
    exact = partial_model(model, n, TEXTS, dtype="float32").eval()
    torch.testing.assert_close(exact.encode(TEXTS, convert_to_tensor=True, batch_size=5), full, atol=1e-5, rtol=0)
    # features as the Transformer module writes them: token_embeddings + attention_mask + input_ids (real tokens)
    f_full, f_part = model.preprocess(TEXTS), exact.preprocess(TEXTS)
    assert torch.equal(f_full["input_ids"], f_part["input_ids"])
    assert torch.equal(f_full["attention_mask"], f_part["attention_mask"])
    with torch.no_grad():
        t_full, t_part = model[0](f_full)["token_embeddings"], exact[0](f_part)["token_embeddings"]
    real = f_full["attention_mask"].bool()
    torch.testing.assert_close(t_part[real], t_full[real], atol=1e-4, rtol=0)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_mask_is_bert_models_own(model, impl):
    backbone = model[0].auto_model
    backbone.set_attn_implementation(impl)
    seen = {}

    def hook(module, args, kwargs):
        seen["hidden"], seen["mask"] = args[0], args[1]

    for texts in (TEXTS, ["a b", "c d"]):  # padded, and no padding (sdpa and eager then pass no mask)
        seen.clear()
        handle = _layers(model)[3].register_forward_pre_hook(hook, with_kwargs=True)
        features = model.preprocess(texts)
        with torch.no_grad():
            model(features)
        handle.remove()
        mine = layer_attention_mask(backbone, seen["hidden"], features["attention_mask"])
        if seen["mask"] is None:
            assert mine is None
        else:
            assert mine.dtype == seen["mask"].dtype and torch.equal(mine, seen["mask"])
    stand_in = partial_model(model, 3, TEXTS, dtype="float32").eval()
    torch.testing.assert_close(
        stand_in.encode(TEXTS, convert_to_tensor=True), model.encode(TEXTS, convert_to_tensor=True), atol=1e-5, rtol=0
    )


def _grads(m, loss_model):
    loss = MultipleNegativesRankingLoss(loss_model, scale=20.0)
    m.zero_grad(set_to_none=True)
    loss([loss_model.preprocess(QUERIES), loss_model.preprocess(DOCS)], None).backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("n", "dtype"), [(1, "float32"), (2, "float32"), (2, "float16")])
def test_gradients_equal_the_full_model_with_frozen_lower_layers(model, n, dtype):
    stand_in = partial_model(model, n, TEXTS, dtype=dtype).eval()  # also freezes model's lower layers
    backbone = model[0].auto_model
    assert not any(p.requires_grad for p in backbone.embeddings.parameters())
    assert not any(p.requires_grad for layer in _layers(model)[: 6 - n] for p in layer.parameters())
    assert all(p.requires_grad for layer in _layers(model)[6 - n :] for p in layer.parameters())
    full = _grads(model, model)  # the full model, embeddings + lower layers frozen, eval mode
    part = _grads(model, stand_in)
    assert set(part) == set(full)
    names = set(full)
    assert any(k.startswith(f"0.model.encoder.layer.{6 - n}.") for k in names)
    assert any(k.startswith("3.") for k in names)  # the LinearAdapter
    assert not any(k.startswith(f"0.model.encoder.layer.{i}.") for i in range(6 - n) for k in names)
    assert not any(k.startswith("0.model.embeddings.") for k in names)
    # per tensor, relative to its norm; the attention key biases' gradients are exactly 0 in exact arithmetic
    # (softmax ignores a shift) and ~2e-8 of rounding noise here: the absolute term covers them
    rel = 1e-4 if dtype == "float32" else 1e-2
    for k in names:
        assert (part[k] - full[k]).norm() <= rel * full[k].norm() + 1e-6, k


def test_trainer_steps_train_the_top_layers_in_place(model, tmp_path):
    n = 2
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stand_in = partial_model(model, n, TEXTS, cache_dir=tmp_path / "states")
    train = Dataset.from_dict({"anchor": QUERIES + QUERIES[:1], "positive": DOCS + DOCS[:1]})
    args = tiny_training_args(SentenceTransformerTrainingArguments, tmp_path, disable_tqdm=True)
    trainer = SentenceTransformerTrainer(
        model=stand_in, args=args, train_dataset=train, loss=MultipleNegativesRankingLoss(stand_in)
    )
    trainer.train()
    assert len([h for h in trainer.state.log_history if "loss" in h]) == 3
    after = model.state_dict()
    frozen = ("0.model.embeddings.",) + tuple(f"0.model.encoder.layer.{i}." for i in range(6 - n))
    top = tuple(f"0.model.encoder.layer.{i}." for i in range(6 - n, 6))
    for k, v in before.items():
        if k.startswith(frozen):
            assert torch.equal(after[k], v), k  # bit-identical
    assert any(not torch.equal(after[k], v) for k, v in before.items() if k.startswith(top))
    assert not torch.equal(after["3.linear.weight"], before["3.linear.weight"])

    model.eval()
    path = str(tmp_path / "trained")
    model.save(path)
    assert not any(f in os.listdir(path) for f in ("states.bin", "index.json"))
    expected = model.encode(TEXTS, convert_to_tensor=True)
    for loaded in (SentenceTransformer(path, device="cpu", trust_remote_code=True), load_model(path, device="cpu")):
        torch.testing.assert_close(loaded.encode(TEXTS, convert_to_tensor=True), expected, atol=1e-6, rtol=0)
    with pytest.raises(NotImplementedError, match="save the full model"):
        stand_in.save(str(tmp_path / "stand-in"))


def test_cache_is_reused_refused_or_rebuilt(model, tmp_path):
    folder = tmp_path / "states"
    first = partial_model(model, 2, TEXTS + TEXTS[:2], cache_dir=folder)[0].cache
    assert first.computed == len(TEXTS) and len(first) == len(TEXTS)
    files = [".lock", "index.json", "keys.bin", "meta.json", "rows.bin", "states.bin", "tokens.bin"]
    assert sorted(os.listdir(folder)) == files  # no temporary file left
    assert os.path.getsize(folder / "states.bin") == first.nbytes() == sum(first.lengths(range(6))) * 384 * 2

    # same folder and settings: read, not recomputed; the same rows, token ids and states
    again = LayerStateCache(folder, model[0], 4)
    assert again.computed == 0 and len(again) == len(TEXTS)
    for text in TEXTS:
        (r1,), (r2,) = first.rows([text]), again.rows([text])
        assert np.array_equal(first.token_ids(r1), again.token_ids(r2))
        assert np.array_equal(first.states(r1), again.states(r2))
    stand_in = partial_model(model, 2, TEXTS, cache_dir=folder)
    assert stand_in[0].cache.computed == 0
    other = LayerStateCache(folder, model[0], 4)  # open while the next one extends the folder
    # extended with the texts it lacks; a crashed writer's bytes beyond the index are ignored, then dropped
    for name in ("states.bin", "tokens.bin", "keys.bin", "rows.bin"):
        with open(folder / name, "ab") as f:
            f.write(b"\x07" * 1000)
    grown = partial_model(model, 2, [*TEXTS, "a new text"], cache_dir=folder)[0].cache
    assert grown.computed == 1 and len(LayerStateCache(folder)) == len(TEXTS) + 1
    assert os.path.getsize(folder / "states.bin") == grown.nbytes()
    assert os.path.getsize(folder / "rows.bin") == 16 * (len(TEXTS) + 1)
    (row,) = LayerStateCache(folder).rows(["a new text"])
    other.rows(["a new text"])
    assert other.computed == 0  # caught up with what the other cache committed, under the lock
    assert np.array_equal(LayerStateCache(folder).token_ids(row), model.preprocess(["a new text"])["input_ids"][0])

    # other settings: refused, or rebuilt on request
    with pytest.raises(ValueError, match="other settings"):
        partial_model(model, 1, TEXTS, cache_dir=folder)
    with pytest.raises(ValueError, match="other settings"):
        partial_model(model, 2, TEXTS, cache_dir=folder, dtype="float32")
    model.max_seq_length = 16
    with pytest.raises(ValueError, match="max_seq_length"):
        partial_model(model, 2, TEXTS, cache_dir=folder)
    with pytest.raises(ValueError, match="max_seq_length"):
        partial_model(model, 2, cache=grown)
    model.max_seq_length = 32
    with pytest.raises(ValueError, match="input of layer 4"):
        partial_model(model, 3, cache=grown)
    rebuilt = partial_model(model, 1, TEXTS[:2], cache_dir=folder, overwrite=True)[0].cache
    assert rebuilt.computed == 2 and len(rebuilt) == 2 and rebuilt.frozen_layers == 5

    # no encoder: a text not cached raises KeyError naming it
    read_only = LayerStateCache(folder)
    assert read_only.encoder is None and read_only.frozen_layers == 5
    with pytest.raises(KeyError, match="never seen before"):
        PartialTransformer(model[0], read_only).preprocess(["never seen before"])
    strict = partial_model(model, 1, cache=read_only, encode_missing=False)
    strict.encode(TEXTS[:2])
    with pytest.raises(KeyError, match="never seen before"):
        strict.encode(["never seen before"])
    lenient = partial_model(model, 1, cache=LayerStateCache(folder))  # given the encoder: computed on first use
    lenient.encode(["never seen before"])
    assert "never seen before" in LayerStateCache(folder)  # ... and committed for the next reader
    with pytest.raises(ValueError, match="no layer-state cache"):
        LayerStateCache(tmp_path / "empty")


def test_refused_models_and_arguments(model, tmp_path):
    for bad in (0, 7, -1, True, 2.0):
        with pytest.raises(ValueError, match=r"train_layers.*L=6"):
            partial_model(model, bad)
    for bad in (0, -2, 1.5, True):  # given a cache or not, a bad batch size is named before any work
        with pytest.raises(ValueError, match=r"batch_size must be a positive int"):
            partial_model(model, 1, batch_size=bad)
    with pytest.raises(ValueError, match="sentence-transformers Transformer"):
        check_partial_transformer(model[1])
    stand_in = partial_model(model, 1, TEXTS[:1])
    with pytest.raises(ValueError, match="prompt"):
        stand_in.encode(TEXTS[:1], prompt="query: ")
    with pytest.raises(ValueError, match="max_length"):
        stand_in.preprocess(TEXTS[:1], max_length=8)
    decoder = copy.deepcopy(model)
    decoder[0].auto_model.config.is_decoder = True
    with pytest.raises(ValueError, match="decoders"):
        partial_model(decoder, 1)


# ------------------------------------------------------------------------------------------------- cross-encoders

PAIRS = [
    ("what causes fever", "Fever is usually caused by an infection."),
    ("what causes fever", "The stock market fell sharply on Monday, dragging every index down with it."),
    ("vitamin d deficiency", "Low vitamin D levels are common in winter."),
    ("vitamin d deficiency", "Paris is the capital of France."),
]


@pytest.mark.parametrize("kind", ["VarCE", "CE"])
def test_cross_encoder_scores_equal_the_full_model(base_model, kind, tmp_path):
    from st_extensions.cross_encoder import build_var_cross_encoder
    from st_extensions.cross_encoder.frozen import build_cross_encoder

    torch.manual_seed(0)
    build = build_var_cross_encoder if kind == "VarCE" else build_cross_encoder
    ce = build(base_model, max_seq_length=32, device="cpu").eval()
    full = ce.predict(PAIRS)
    for n in (1, 6):
        stand_in = partial_model(ce, n, PAIRS[:3], cache_dir=tmp_path / f"pairs{n}")
        assert type(stand_in) is type(ce) and stand_in[0].cache.pairs
        assert all(a is b for a, b in zip(list(stand_in)[1:], list(ce)[1:]))
        np.testing.assert_allclose(stand_in.predict(PAIRS), full, atol=1e-3)
        np.testing.assert_allclose(stand_in.predict([list(p) for p in PAIRS], batch_size=3), full, atol=1e-3)
        exact = partial_model(ce, n, PAIRS, dtype="float32")
        np.testing.assert_allclose(exact.predict(PAIRS), full, atol=1e-5)
    if kind == "VarCE":
        mean, std = ce.predict(PAIRS, return_std=True)
        c_mean, c_std = stand_in.predict(PAIRS, return_std=True)
        np.testing.assert_allclose(c_mean, mean, atol=1e-3)
        np.testing.assert_allclose(c_std, std, atol=1e-3)
    with pytest.raises(ValueError, match="other settings"):  # a pair cache is not a text cache
        LayerStateCache(tmp_path / "pairs6", ce[0], 0)
    with pytest.raises(ValueError, match="pair"):
        stand_in.predict([("only one",)])

    # a few CrossEncoderTrainer steps through the stand-in train the top layers and the head, nothing below
    from sentence_transformers.cross_encoder import CrossEncoderTrainer, CrossEncoderTrainingArguments
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

    before = {k: v.clone() for k, v in ce.state_dict().items()}
    stand_in = partial_model(ce, 2, PAIRS)
    rows = Dataset.from_dict(
        {"query": [q for q, _ in PAIRS], "document": [d for _, d in PAIRS], "label": [1.0, 0.0, 1.0, 0.0]}
    )
    args = tiny_training_args(CrossEncoderTrainingArguments, tmp_path, max_steps=2, disable_tqdm=True)
    CrossEncoderTrainer(model=stand_in, args=args, train_dataset=rows, loss=BinaryCrossEntropyLoss(stand_in)).train()
    after = ce.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(
        k.startswith(("0.model.encoder.layer.4.", "0.model.encoder.layer.5.", "2.")) for k in changed
    )
    assert any(k.startswith("2.") for k in changed)
