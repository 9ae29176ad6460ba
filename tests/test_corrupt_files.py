"""Truncated or corrupted files a run writes or reads -- models, checkpoints, caches, indexes, result files -- give a
clear error naming the file and what to do, never a raw
numpy / safetensors traceback nor silent garbage."""

import json
import os
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from pyterrier_prob import training
from pyterrier_prob.atomic import CorruptFileError
from pyterrier_prob.index import DenseIndex, MoLIndex

DIM, PX, D = 8, 4, 6


def halve(path: Path) -> None:
    """Truncate ``path`` to half its size."""
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def flip(path: Path, at: int, n: int = 4) -> None:
    """Flip ``n`` bytes of ``path`` from offset ``at`` (negative: from the end)."""
    data = bytearray(path.read_bytes())
    at = at % len(data)
    for i in range(at, min(at + n, len(data))):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def names(path: Path, *remedy: str) -> str:
    """A ``match=`` regex: the file's path, then every word of what to do."""
    return re.escape(str(path)) + "".join(f"(.|\n)*{re.escape(r)}" for r in remedy)


# ---- models ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def model_copy(minilm_path, tmp_path):
    """A copy of the packaged MiniLM: its weights copied, the other files linked."""
    dst = tmp_path / "model"
    dst.mkdir()
    for name in os.listdir(minilm_path):
        src = os.path.join(minilm_path, name)
        if name == "model.safetensors":
            (dst / name).write_bytes(Path(src).read_bytes())
        else:
            os.symlink(src, dst / name)
    return dst


@pytest.mark.parametrize("damage", ["truncated", "header flipped"])
def test_model_weights(model_copy, damage):
    from st_extensions import load_model

    weights = model_copy / "model.safetensors"
    halve(weights) if damage == "truncated" else flip(weights, 9)
    with pytest.raises(CorruptFileError, match=names(weights, "delete the model folder", "again")):
        load_model(str(model_copy))


# ---- training checkpoints -------------------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path):
    """A run folder with one complete checkpoint (model weights, optimizer and RNG state as the trainer writes them)."""
    from safetensors.torch import save_file

    recipe = training.Recipe(steps=4, batch_size=4)
    recipe.save(str(tmp_path / "recipe.json"))
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    save_file({"w": torch.randn(64, 64)}, str(ckpt / "model.safetensors"))
    torch.save({"state": {0: {"exp_avg": torch.randn(64, 64)}}}, ckpt / "optimizer.pt")
    torch.save({"python": list(range(100)), "cpu": torch.get_rng_state()}, ckpt / "rng_state.pth")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 2, "log_history": []}))
    (ckpt / training.COMPLETE).write_text(json.dumps({"step": 2}))
    assert training._resume_point(str(tmp_path), recipe) == str(ckpt)
    return tmp_path, ckpt, recipe


@pytest.mark.parametrize(
    "file, damage",
    [
        ("optimizer.pt", "truncated"),
        ("optimizer.pt", "data flipped"),
        ("rng_state.pth", "truncated"),
        ("model.safetensors", "truncated"),
        ("trainer_state.json", "truncated"),
    ],
)
def test_checkpoint(checkpoint, file, damage):
    folder, ckpt, recipe = checkpoint
    halve(ckpt / file) if damage == "truncated" else flip(ckpt / file, 200)
    with pytest.raises(CorruptFileError, match=names(ckpt / file, f"delete '{ckpt}'", "--resume")):
        training._resume_point(str(folder), recipe)


# ---- caches ---------------------------------------------------------------------------------------------------------


def test_cached_features(tmp_path):
    from st_extensions.frozen import CachedEmbeddings

    path = tmp_path / "encoder.safetensors"
    CachedEmbeddings([f"text {i}" for i in range(50)], torch.randn(50, 16)).save_cache(str(path))
    halve(path)
    with pytest.raises(CorruptFileError, match=names(path, "delete it", "rebuilt")):
        CachedEmbeddings.load_cache(str(path))


@pytest.mark.parametrize("file", ["states.bin", "rows.bin", "index.json"])
def test_layer_state_cache(base_model, tmp_path, file):
    from st_extensions.partial import LayerStateCache

    folder = tmp_path / "states"
    cache = LayerStateCache(folder, base_model[0], 4)
    cache.extend([f"a short text number {i}" for i in range(6)])
    if file == "rows.bin":  # the row ends disagree with the committed counts
        flip(folder / file, -8, 8)
        expect = names(folder / file, f"delete '{folder}'")
    else:
        halve(folder / file)
        expect = names(folder / file, f"delete '{folder}'")
    with pytest.raises(CorruptFileError, match=expect):
        LayerStateCache(folder).rows(["a short text number 0"])


def test_teacher_embeddings(tmp_path):
    from pyterrier_prob.varce import distill

    path = tmp_path / "teacher-docs.npy"
    np.save(path, np.ones((40, 8), np.float32))
    halve(path)
    with pytest.raises(CorruptFileError, match=names(path, "delete it")):
        distill.encode(None, ["x"] * 40, str(path))


def test_teacher_score_log_drops_a_cut_last_line(tmp_path):
    """The score log of ``pyterrier-prob varce`` is appended to: a kill mid-append cuts its last line, which is
    dropped (and removed from the file, so later appends start on a line of their own), never read as a number."""
    from pyterrier_prob.varce.scoring import PairScorer

    path = tmp_path / "scores.tsv"
    scorer = PairScorer("m", torch.nn.Identity(), cache_path=str(path), fingerprint="f1")
    scorer.add("c", [("q", "d1", 0.5, 0.25), ("q", "d2", 0.123456, 0.5)])
    text = path.read_text()
    path.write_text(text[: text.rindex("0.123456") + 4])  # '... 0.12' with no std, no newline
    again = PairScorer("m", torch.nn.Identity(), cache_path=str(path), fingerprint="f1")
    assert again.cache == {("c", "q", "d1"): (0.5, 0.25)}
    assert path.read_text().endswith("\n")


# ---- indexes --------------------------------------------------------------------------------------------------------


def unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


@pytest.fixture
def dense(tmp_path):
    docs = pd.DataFrame({"docno": [f"d{i}" for i in range(40)], "doc_vec": list(unit(np.random.randn(40, DIM)))})
    return DenseIndex(tmp_path / "docs.flex").index(docs)


@pytest.fixture
def mol(tmp_path):
    comps = unit(np.random.randn(30, PX, D))
    return MoLIndex(tmp_path / "docs.mol").index(
        pd.DataFrame({"docno": [f"m{i}" for i in range(30)], "doc_comp": list(comps)})
    )


@pytest.mark.parametrize("file", ["vecs.f4", "docnos.npids"])
def test_dense_index(dense, file):
    path = dense.index_path
    halve(path / file)
    with pytest.raises(ValueError, match=f"{re.escape(file)}(.|\n)*rebuild"):
        DenseIndex(path).docno_array()


@pytest.mark.parametrize("file", ["comps.f4", "mean.f4", "docnos.npids"])
def test_mol_index(mol, file):
    path = mol.index_path
    halve(path / file)
    with pytest.raises(ValueError, match=f"{re.escape(file)}(.|\n)*rebuild"):
        MoLIndex(path).docno_array()


def test_index_meta(dense):
    meta = dense.index_path / "pt_meta.json"
    halve(meta)
    with pytest.raises(ValueError, match=names(meta, "corrupt", "rebuild")):
        DenseIndex(dense.index_path).docno_array()


# ---- result files ---------------------------------------------------------------------------------------------------


def test_dev_curve_best_weights(tmp_path):
    """A resumed training's dev curve reads its best point's weights back: a corrupted file is named."""
    from types import SimpleNamespace

    from pyterrier_prob.curves import DevCurve

    path = tmp_path / "curves" / "m.json"
    model = torch.nn.Linear(4, 1)
    curve = DevCurve(1, lambda m: 0.5, str(path))
    curve.on_train_begin(None, SimpleNamespace(global_step=0), None, model=model)
    curve.on_step_end(None, SimpleNamespace(global_step=1, max_steps=2), SimpleNamespace(), model=model)
    best = Path(curve.best_path)
    assert best.is_file() and not [p for p in best.parent.iterdir() if ".tmp" in p.name]
    halve(best)
    state = SimpleNamespace(global_step=2)
    with pytest.raises(CorruptFileError, match=names(best, ".best.safetensors and rerun", "without --resume")):
        DevCurve(1, lambda m: 0.5, str(path)).on_train_begin(None, state, None, model=model)
    halve(path)
    with pytest.raises(CorruptFileError, match=names(path, "delete the curve", "without --resume")):
        DevCurve(1, lambda m: 0.5, str(path)).on_train_begin(None, state, None, model=model)
