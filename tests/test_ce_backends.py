"""The cross-encoders' backbone on ONNX Runtime / OpenVINO (st_extensions.cross_encoder.backends).

An untrained plain cross-encoder and VarCrossEncoder on the packaged MiniLM, ``max_seq_length=32``; their backbones
are byte-identical, so the VarCE's exports serve the CE too (after the fingerprint check), and each export is made
once. (A MiniLM cut to two layers would export faster, but its [CLS] hardly varies across pairs: int8 noise would
swamp the ranking.) fp32 exports must give torch's scores (and VarCE std, Eq. 23); int8 ones must
rank alike but not be the fp32 model under another name.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.stats import spearmanr

pytest.importorskip("onnxruntime")

from st_extensions.cross_encoder import VarCrossEncoder, build_var_cross_encoder, load_cross_encoder  # noqa: E402
from st_extensions.cross_encoder.backends import FILES, _is_fresh  # noqa: E402
from st_extensions.cross_encoder.frozen import build_cross_encoder  # noqa: E402
from st_extensions.cross_encoder.split import build_split_cross_encoder  # noqa: E402

QUERIES = [
    "how do vaccines train the immune system",
    "effects of caffeine on sleep",
    "vitamin d deficiency symptoms",
    "does red meat raise cancer risk",
]
DOCS = [
    "Vaccines expose the immune system to an antigen so that it forms memory B and T cells.",
    "Caffeine blocks adenosine receptors and delays sleep onset when taken in the evening.",
    "Low vitamin D levels are linked to bone pain, muscle weakness and fatigue.",
    "Processed and red meat intake was associated with a higher risk of colorectal cancer.",
    "The stock market closed higher on Tuesday after strong earnings reports.",
    "A recipe for banana bread with walnuts and cinnamon.",
    "Antibodies produced after vaccination neutralise the virus on later exposure.",
    "Sleep deprivation impairs memory consolidation and attention in adults.",
]
PAIRS = [(q, d) for q in QUERIES for d in DOCS]  # 32 pairs


def _tree_hashes(path: str) -> dict[str, str]:
    """sha256 of every file of a saved model outside the export folders."""
    out = {}
    for root, dirs, files in os.walk(path):
        dirs[:] = [d for d in dirs if os.path.relpath(os.path.join(root, d), path) not in ("onnx", "openvino")]
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory, base_model):
    """``{"ce": path, "var": path, "hashes": {...}}``: the two models saved, and their files' hashes."""
    torch.manual_seed(0)
    var = build_var_cross_encoder(base_model, variant="VAR", max_seq_length=32, device="cpu")
    with torch.no_grad():  # a variance branch that depends on [CLS], so that std varies across pairs
        var.head.var_branch.weight.normal_(0.0, 0.05)
    ce = build_cross_encoder(base_model, max_seq_length=32, device="cpu")
    root = tmp_path_factory.mktemp("ce_backends")
    paths = {"ce": str(root / "ce"), "var": str(root / "var")}
    var.save(paths["var"])
    ce.save(paths["ce"])
    hashes = {k: _tree_hashes(p) for k, p in paths.items()}
    return {**paths, "hashes": hashes, "ref": {"var": _scores(var.eval()), "ce": _scores(ce.eval())}}


def _share_exports(saved) -> None:
    """Give the CE the VarCE's exports (same backbone bytes: the fingerprint check accepts them)."""
    for sub in ("onnx", "openvino"):
        src, dst = os.path.join(saved["var"], sub), os.path.join(saved["ce"], sub)
        if os.path.isdir(src):
            shutil.copytree(src, dst, dirs_exist_ok=True)


def _scores(model, pairs=PAIRS):
    """CE: logits; VarCE: (E[s], std[s])."""
    if isinstance(model, VarCrossEncoder):
        return model.predict(pairs, batch_size=32, return_std=True)
    return (model.predict(pairs, batch_size=32, activation_fn=torch.nn.Identity()),)


def test_onnx_fp32_matches_torch_and_int8_ranks_alike(saved, tmp_path):
    for name in ("var", "ce"):
        if name == "ce":
            _share_exports(saved)
        ref = saved["ref"][name]
        model = load_cross_encoder(saved[name], backend="onnx")
        fp32 = _scores(model)
        int8 = _scores(load_cross_encoder(saved[name], backend="onnx", precision="int8"))
        for r, a, q in zip(ref, fp32, int8):  # mean (and std for the VarCE)
            np.testing.assert_allclose(a, r, atol=1e-4, rtol=0)
            assert spearmanr(r, q)[0] > 0.9
            assert np.abs(q - r).max() > 1e-5  # quantised: not the fp32 model
        assert ref[0].std() > 1e-3 and (name == "ce" or ref[1].std() > 1e-4)  # the scores do vary
    assert os.path.isfile(os.path.join(saved["var"], FILES["onnx", "int8"]))
    with pytest.raises(RuntimeError, match="cannot be saved"):
        model.save(str(tmp_path / "resaved"))  # its backbone is a runtime, not torch weights
    assert not os.path.exists(tmp_path / "resaved")


def test_exports_follow_the_torch_weights(saved, tmp_path):
    copy_path = str(tmp_path / "copy")
    shutil.copytree(saved["var"], copy_path)  # new mtimes, same bytes: still fresh
    load_cross_encoder(saved["var"], backend="onnx")
    assert _is_fresh(copy_path, FILES["onnx", "fp32"], {})
    with open(os.path.join(copy_path, "config.json"), "a", encoding="utf8") as f:
        f.write("\n")  # the backbone's files changed: the export is stale
    assert not _is_fresh(copy_path, FILES["onnx", "fp32"], {})


def test_openvino_fp32_matches_torch_and_int8_ranks_alike(saved):
    pytest.importorskip("openvino")
    pytest.importorskip("nncf")
    with pytest.raises(ValueError, match="calibration_pairs"):
        load_cross_encoder(saved["var"], backend="openvino", precision="int8")
    for name in ("var", "ce"):
        if name == "ce":
            _share_exports(saved)
        ref = saved["ref"][name]
        fp32 = _scores(load_cross_encoder(saved[name], backend="openvino"))
        int8 = _scores(
            load_cross_encoder(saved[name], backend="openvino", precision="int8", calibration_pairs=PAIRS[::4])
        )
        for r, a, q in zip(ref, fp32, int8):
            np.testing.assert_allclose(a, r, atol=1e-4, rtol=0)
            assert spearmanr(r, q)[0] > 0.9
            assert np.abs(q - r).max() > 1e-5


def test_reranker_on_onnx_ranks_as_torch(saved):
    from pyterrier_prob.varce import VarCrossEncoderReranker

    cand = pd.DataFrame(
        [(f"q{i}", q, f"d{j}", d) for i, q in enumerate(QUERIES) for j, d in enumerate(DOCS)],
        columns=["qid", "query", "docno", "text"],
    )
    torch_rr = VarCrossEncoderReranker(saved["var"], verbose=False)
    onnx_rr = VarCrossEncoderReranker(saved["var"], backend="onnx", verbose=False)
    assert "backend='onnx'" in repr(onnx_rr)
    a, b = torch_rr(cand), onnx_rr(cand)
    assert a[["qid", "docno", "rank"]].equals(b[["qid", "docno", "rank"]])
    np.testing.assert_allclose(b["score_std"], a["score_std"], atol=1e-4)
    with pytest.raises(ValueError, match="backend"):
        VarCrossEncoderReranker(torch_rr.model, backend="onnx")


def test_bad_arguments(saved, monkeypatch):
    with pytest.raises(ValueError, match="backend"):
        load_cross_encoder(saved["ce"], backend="tensorrt")
    with pytest.raises(ValueError, match="precision"):
        load_cross_encoder(saved["ce"], backend="onnx", precision="fp16")
    with pytest.raises(ValueError, match="precision='int8'"):
        load_cross_encoder(saved["ce"], precision="int8")  # torch runs fp32 only
    with pytest.raises(ValueError, match="device"):
        load_cross_encoder(saved["ce"], backend="onnx", device="cuda")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pyterrier-prob\[onnx\]"):
        load_cross_encoder(saved["ce"], backend="onnx")


def test_torch_weights_are_untouched_by_exports(saved):
    load_cross_encoder(saved["var"], backend="onnx", precision="int8")  # exported already, or now
    for name in ("ce", "var"):
        assert _tree_hashes(saved[name]) == saved["hashes"][name]
        for sub in ("onnx", "openvino"):
            folder = os.path.join(saved[name], sub)
            names = os.listdir(folder) if os.path.isdir(folder) else []
            assert not [n for n in names if n.startswith(".export-")]  # no temporary folder left behind


def test_export_graph_is_the_fusable_one_and_attention_is_restored(saved):
    """The ONNX export runs the encoder with eager attention (the graph ONNX Runtime fuses) and gives the model its own
    attention implementation back; the int8 export has int8 weights (the u8s8 kernels)."""
    onnx = pytest.importorskip("onnx")
    from st_extensions.cross_encoder.backends import _eager_attention

    model = build_cross_encoder(None, max_seq_length=32, device="cpu")
    encoder = model[0].auto_model
    before = encoder.config._attn_implementation
    with _eager_attention(encoder):
        assert encoder.config._attn_implementation == "eager"
    assert encoder.config._attn_implementation == before
    load_cross_encoder(saved["var"], backend="onnx", precision="int8")  # made (or reused) by the tests above
    graph = onnx.load(os.path.join(saved["var"], FILES["onnx", "fp32"]), load_external_data=False).graph
    ops = {n.op_type for n in graph.node}
    assert "Softmax" in ops and "IsNaN" not in ops  # eager attention, not SDPA's guarded softmax
    q = onnx.load(os.path.join(saved["var"], FILES["onnx", "int8"])).graph
    int8_weights = [t for t in q.initializer if t.data_type == onnx.TensorProto.INT8]
    assert len(int8_weights) >= 6 * 6  # every linear layer of the 6 BERT layers, at least
    assert "MatMulInteger" in {n.op_type for n in q.node} or "DynamicQuantizeMatMul" in {n.op_type for n in q.node}


def test_split_attention_cross_encoder_on_runtimes(tmp_path, minilm_path):
    """A split-attention student (lower layers apart, 2 joint layers, kernel pooling over them, the frozen bi-encoder
    path) exports its whole pair path as one graph: ONNX fp32 gives torch's scores, int8 ranks alike but is quantised;
    a change of its learned cross bias makes the export stale; a VarCE reading the score as text gives torch's E[s] and
    std[s]; a model holding a layer-state cache is refused."""
    from st_extensions.cross_encoder.backends import _weights_sha256, export_backbone
    from st_extensions.cross_encoder.split import SCORE_SEPARATOR, split_state_cache

    torch.manual_seed(0)
    path = str(tmp_path / "split")
    model = build_split_cross_encoder(
        minilm_path, bi_encoder_path=True, joint_feature="kernels", max_seq_length=32, device="cpu"
    )
    with torch.no_grad():  # the joint layers' kernel term in the score (it starts at 0)
        model[2].linear.weight[:, 384:].normal_(0.0, 0.05)
    model.save(path)
    ref = _scores(model.eval())[0]
    fp32 = load_cross_encoder(path, backend="onnx")
    np.testing.assert_allclose(_scores(fp32)[0], ref, atol=1e-4, rtol=0)
    assert ref.std() > 1e-2
    int8 = _scores(load_cross_encoder(path, backend="onnx", precision="int8"))[0]
    assert spearmanr(ref, int8)[0] > 0.9 and np.abs(int8 - ref).max() > 1e-5
    onnx = pytest.importorskip("onnx")
    graph = onnx.load(os.path.join(path, FILES["onnx", "fp32"]), load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("Softmax") == 4 * 2 + 2 + 2 and "IsNaN" not in ops  # eager: 4 layers a text, 2 joint, 2 apart
    before = _weights_sha256(path)
    model[0].cross.bias.data += 1.0
    model[0].save(path)  # the SplitTransformer's files only: the cross bias changed
    assert _weights_sha256(path) != before and not _is_fresh(path, FILES["onnx", "fp32"], {})

    var_path = str(tmp_path / "split-var")
    var = build_split_cross_encoder(minilm_path, score_segment=True, variant="VAR", max_seq_length=32, device="cpu")
    with torch.no_grad():
        var.head.var_branch.weight.normal_(0.0, 0.05)
    var.save(var_path)
    pairs = [(q, f"{i * 1.7:.2f}{SCORE_SEPARATOR}{d}") for i, (q, d) in enumerate(PAIRS)]
    ref_mean, ref_std = _scores(var.eval(), pairs)
    mean, std = _scores(load_cross_encoder(var_path, backend="onnx"), pairs)
    np.testing.assert_allclose(mean, ref_mean, atol=1e-4, rtol=0)
    np.testing.assert_allclose(std, ref_std, atol=1e-4, rtol=0)
    assert ref_std.std() > 1e-4
    split_state_cache(model, None)
    with pytest.raises(ValueError, match="layer-state cache"):
        export_backbone(path, "onnx", model=model)  # stale (the bias changed): it would export, but not this model
