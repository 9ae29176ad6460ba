"""Issue #14, bad input: a clear error for every bad input, no silently wrong results, no moment without an index.

Each test feeds the public API one class of hostile input and checks the error type and that the message names the
offending column, row (qid / docno), file or parameter -- or, where the result is well defined (a qid repeated with
the same query), that the result is the right one.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from pyterrier_prob import (
    CDFCutoffRetriever,
    DenseIndex,
    MoLEncoder,
    MoLIndex,
    MoLReranker,
    MoLRetriever,
    ProbBiEncoder,
    ScoreCutoffRetriever,
    TopKRetriever,
    VarCrossEncoderReranker,
)
from pyterrier_prob.evaluation import calibrate_mean_k, retrieved_counts
from st_extensions import atomic

DIM, PQ, PX, D = 8, 2, 3, 6


def unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


@pytest.fixture
def dense(tmp_path):
    rng = np.random.default_rng(0)
    docs = pd.DataFrame({"docno": [f"d{i}" for i in range(40)], "doc_vec": list(unit(rng.normal(size=(40, DIM))))})
    return DenseIndex(tmp_path / "docs.flex").index(docs)


def queries(n=3, seed=1):
    rng = np.random.default_rng(seed)
    return pd.DataFrame(
        {
            "qid": [f"q{i}" for i in range(n)],
            "query": [f"text {i}" for i in range(n)],
            "query_vec": list(unit(rng.normal(size=(n, DIM)))),
            "query_temp": np.linspace(0.05, 0.2, n),
        }
    )


class UniformMoL(torch.nn.Module):
    """MixtureOfLogits-like with uniform gating: phi = the mean of the P dot products."""

    def __init__(self, pq=PQ, px=PX, d=D):
        super().__init__()
        self.num_query_components, self.num_doc_components, self.component_dim = pq, px, d

    def score_candidates(self, q, x, q_features=None, x_features=None):
        return torch.einsum("bqd,bcxd->bcqx", q, x).flatten(2).mean(-1)

    def score_all(self, q, x):
        return self.score_candidates(q, x.unsqueeze(0).expand(q.shape[0], -1, -1, -1))


@pytest.fixture
def mol_index(tmp_path):
    rng = np.random.default_rng(2)
    comps = unit(rng.normal(size=(30, PX, D)))
    return MoLIndex(tmp_path / "docs.mol").index(
        pd.DataFrame({"docno": [f"m{i}" for i in range(30)], "doc_comp": list(comps)})
    )


def mol_queries(n=3, seed=3):
    rng = np.random.default_rng(seed)
    return pd.DataFrame({"qid": [f"q{i}" for i in range(n)], "query_comp": list(unit(rng.normal(size=(n, PQ, D))))})


@pytest.fixture(scope="module")
def var_ce():
    from st_extensions.cross_encoder import build_var_cross_encoder

    return build_var_cross_encoder(device="cpu")


# ---------------------------------------------------------------------------------------------------------------
# duplicate qids
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make", [lambda ix: TopKRetriever(ix, 5), lambda ix: CDFCutoffRetriever(ix, p=0.9, num_results=5)]
)
def test_repeated_qid_with_the_same_query_is_retrieved_once(dense, make):
    q = queries()
    repeated = pd.concat([q, q.iloc[[1, 0, 1]]], ignore_index=True)
    retriever = make(dense)
    want = retriever(q)
    got = retriever(repeated)
    assert not got.duplicated(["qid", "docno"]).any()
    assert (got.groupby("qid")["rank"].apply(lambda r: int((r == 0).sum())) == 1).all()
    cols = ["qid", "docno", "score", "rank"]
    pd.testing.assert_frame_equal(got[cols].reset_index(drop=True), want[cols].reset_index(drop=True))


def test_repeated_qid_with_another_query_vector_is_an_error(dense):
    q = queries()
    other = q.iloc[[0]].assign(query_vec=[q["query_vec"].iloc[1]])
    with pytest.raises(ValueError, match=r"qid 'q0' has conflicting 'query_vec' values in rows 0 and 3"):
        TopKRetriever(dense, 5)(pd.concat([q, other], ignore_index=True))
    other = q.iloc[[2]].assign(query_temp=0.5)
    with pytest.raises(ValueError, match=r"qid 'q2' has conflicting 'query_temp' values in rows 2 and 3"):
        CDFCutoffRetriever(dense, p=0.5)(pd.concat([q, other], ignore_index=True))


def test_rerank_rows_of_one_qid_with_conflicting_vectors_are_an_error(dense):
    q = queries(2)
    cand = q.merge(pd.DataFrame({"docno": ["d1", "d2", "d3"]}), how="cross")
    ok = ScoreCutoffRetriever(dense, threshold=-1.0)(cand)  # the same vector on every row of a qid: fine
    assert len(ok) == 6 and sorted(ok["qid"].unique()) == ["q0", "q1"]
    bad = cand.copy()
    bad.at[4, "query_vec"] = bad.at[0, "query_vec"]  # row 4 belongs to q1
    with pytest.raises(ValueError, match=r"TopKRetriever: qid 'q1' has conflicting 'query_vec' values in rows 3 and 4"):
        TopKRetriever(dense, 5)(bad)
    bad = cand.copy()
    bad.loc[5, "query_temp"] = 0.9
    with pytest.raises(ValueError, match=r"qid 'q1' has conflicting 'query_temp' values in rows 3 and 5"):
        CDFCutoffRetriever(dense, p=0.5)(bad)


def test_mol_repeated_and_conflicting_qids(mol_index):
    mol = UniformMoL()
    q = mol_queries()
    retriever = MoLRetriever(mol_index, mol, method="brute_force", num_results=4)
    want = retriever(q)
    got = retriever(pd.concat([q, q.iloc[[2, 2]]], ignore_index=True))
    assert not got.duplicated(["qid", "docno"]).any()
    pd.testing.assert_frame_equal(got[["qid", "docno", "rank"]], want[["qid", "docno", "rank"]])
    bad = pd.concat([q, q.iloc[[0]].assign(query_comp=[q["query_comp"].iloc[1]])], ignore_index=True)
    with pytest.raises(ValueError, match=r"qid 'q0' has conflicting 'query_comp' values in rows 0 and 3"):
        retriever(bad)
    cand = q.merge(pd.DataFrame({"docno": ["m1", "m2"]}), how="cross")
    cand.at[1, "query_comp"] = cand.at[2, "query_comp"]
    with pytest.raises(ValueError, match=r"MoLReranker: qid 'q0' has conflicting 'query_comp' values in rows 0 and 1"):
        MoLReranker(mol_index, mol)(cand)


# ---------------------------------------------------------------------------------------------------------------
# missing or mistyped fields
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("missing", [None, np.nan])
def test_encoders_name_the_row_of_a_missing_text(base_model, missing):
    enc = ProbBiEncoder(base_model)
    topics = pd.DataFrame({"qid": ["q1", "q2"], "query": pd.Series(["fine", missing], dtype=object)})
    with pytest.raises(ValueError, match=r"ProbQueryEncoder: 'query' of row 1 \(qid='q2'\) is missing"):
        enc.query_encoder()(topics)
    docs = pd.DataFrame({"docno": ["a", "b"], "text": pd.Series([missing, "fine"], dtype=object)})
    with pytest.raises(ValueError, match=r"ProbDocEncoder: 'text' of row 0 \(docno='a'\) is missing"):
        enc.doc_encoder()(docs)
    with pytest.raises(ValueError, match=r"ProbQueryEncoder: 'qid' is missing .* in row 0"):
        enc.query_encoder()(pd.DataFrame({"qid": pd.Series([missing, "q2"], dtype=object), "query": ["a", "b"]}))
    with pytest.raises(ValueError, match=r"query texts\[1\] is"):
        enc.encode_queries(["a", missing])
    mol_enc = MoLEncoder(base_model)  # the text is checked before anything needs a MoL
    with pytest.raises(ValueError, match=r"MoLQueryEncoder: 'query' of row 1 \(qid='q2'\) is missing"):
        mol_enc.query_encoder()(topics)
    with pytest.raises(ValueError, match=r"MoLDocEncoder: 'text' of row 0 \(docno='a'\) is missing"):
        mol_enc.doc_encoder()(docs)
    with pytest.raises(ValueError, match=r"'query' of row 0 \(qid='q1'\) is a int \(5\), not a str"):
        enc.query_encoder()(pd.DataFrame({"qid": ["q1"], "query": pd.Series([5], dtype=object)}))


def test_indexers_name_the_record_of_a_bad_docno_or_vector(tmp_path):
    v = unit(np.random.default_rng(0).normal(size=(3, DIM)))
    cases = [
        ({"docno": ["a", None, "c"], "doc_vec": list(v)}, r"docno of record #1 is missing"),
        (
            {"docno": ["a", "b", "c"], "doc_vec": [v[0], str(v[1]), v[2]]},
            r"'doc_vec' of record #1 \(docno='b'\) is a str",
        ),
        ({"docno": ["a", "b", "c"], "doc_vec": [v[0], v[1], None]}, r"'doc_vec' of record #2 \(docno='c'\) is missing"),
    ]
    for i, (frame, msg) in enumerate(cases):
        with pytest.raises(ValueError, match=msg):
            DenseIndex(tmp_path / f"d{i}.flex").index(pd.DataFrame(frame))
        assert not (tmp_path / f"d{i}.flex").exists()
    comps = unit(np.random.default_rng(0).normal(size=(3, PX, D)))
    with pytest.raises(ValueError, match=r"MoLIndexer: 'doc_comp' of record #2 \(docno='c'\) is a str"):
        MoLIndex(tmp_path / "m.mol").index(
            pd.DataFrame({"docno": ["a", "b", "c"], "doc_comp": [comps[0], comps[1], "[[0.1]]"]})
        )


def test_retrievers_name_the_row_of_a_bad_qid_or_vector(dense, mol_index):
    q = queries()
    as_text = q.assign(query_vec=[str(v.tolist()) for v in q["query_vec"]])  # a CSV round trip
    with pytest.raises(ValueError, match=r"TopKRetriever: 'query_vec' of row 0 \(qid='q0'\) is a str .* parsed back"):
        TopKRetriever(dense, 5)(as_text)
    no_qid = q.assign(qid=pd.Series(["q0", None, "q2"], dtype=object))
    with pytest.raises(ValueError, match=r"TopKRetriever: 'qid' is missing \(None\) in row 1"):
        TopKRetriever(dense, 5)(no_qid)
    with pytest.raises(ValueError, match=r"'query_temp' of row 1 \(qid='q1'\) is missing"):
        CDFCutoffRetriever(dense, p=0.5)(q.assign(query_temp=[0.1, None, 0.1]))
    cand = q.merge(pd.DataFrame({"docno": ["d1", "d2"]}), how="cross")
    cand.loc[3, "docno"] = None
    with pytest.raises(ValueError, match=r"'docno' is missing .* in row 3 \(qid='q1'"):
        TopKRetriever(dense, 5)(cand)
    mq = mol_queries()
    mq.at[1, "query_comp"] = "[[0.1, 0.2]]"
    with pytest.raises(ValueError, match=r"MoLRetriever: 'query_comp' of row 1 \(qid='q1'\) is a str"):
        MoLRetriever(mol_index, UniformMoL(), method="brute_force", num_results=3)(mq)


def test_var_cross_encoder_reranker_refuses_a_candidate_without_text(var_ce):
    cand = pd.DataFrame(
        {"qid": ["q1", "q1"], "query": ["what is x", "what is x"], "docno": ["d1", "d2"], "text": ["x is y", None]}
    )
    with pytest.raises(
        ValueError, match=r"VarCrossEncoderReranker: 'text' of row 1 \(qid='q1', docno='d2'\) is missing"
    ):
        VarCrossEncoderReranker(var_ce, verbose=False)(cand)
    cand = cand.assign(text=["x is y", "y"], query=["what is x", np.nan])
    with pytest.raises(ValueError, match=r"'query' of row 1 \(qid='q1', docno='d2'\) is missing"):
        VarCrossEncoderReranker(var_ce, verbose=False)(cand)


def test_variational_loss_labels_and_empty_batch(var_ce):
    from st_extensions.losses import VariationalBCELoss

    loss = VariationalBCELoss(var_ce)
    pairs = [["q1", "q2"], ["doc a", "doc b"]]
    with pytest.raises(ValueError, match="needs labels .* got None"):
        loss(pairs, None)
    with pytest.raises(ValueError, match="empty batch"):
        loss([[], []], torch.zeros(0))
    with pytest.raises(ValueError, match=r"labels must be numbers in \[0, 1\].*nan.* pair 1"):
        loss(pairs, torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match=r"the document of pair 0 is None"):
        loss([["q1"], [None]], torch.ones(1))


# ---------------------------------------------------------------------------------------------------------------
# index files
# ---------------------------------------------------------------------------------------------------------------


def test_nan_vectors_of_the_right_size_raise_naming_the_file(dense):
    path = dense.index_path
    n, dim = len(dense), dense.dim
    vecs = np.fromfile(path / "vecs.f4", dtype=np.float32).reshape(n, dim)
    vecs[:] = np.nan
    vecs.tofile(path / "vecs.f4")
    with pytest.raises(ValueError, match=r"vecs\.f4' is corrupt: the vector of row 0"):
        DenseIndex(path).vectors()
    vecs = (np.ones((n, dim)) / np.sqrt(dim)).astype(np.float32)
    vecs[7] = np.nan  # first and last rows fine: found before the first search
    vecs.tofile(path / "vecs.f4")
    with pytest.raises(ValueError, match=r"vecs\.f4' is corrupt: the vector of row 7 \(docno 'd7'\)"):
        TopKRetriever(DenseIndex(path), 3)(queries())
    cand = queries(1).merge(pd.DataFrame({"docno": ["d1", "d7"]}), how="cross")  # re-ranking reads only these
    with pytest.raises(ValueError, match=r"vecs\.f4' is corrupt: the vector of row 7 \(docno 'd7'\)"):
        ScoreCutoffRetriever(DenseIndex(path), threshold=-1.0)(cand)


def test_mol_nan_components_raise_naming_the_file(mol_index):
    path = mol_index.index_path
    comps = np.fromfile(path / "comps.f4", dtype=np.float32).reshape(len(mol_index), PX, D)
    comps[5] = np.nan
    comps.tofile(path / "comps.f4")
    with pytest.raises(ValueError, match=r"comps\.f4' is corrupt: row 5 \(docno 'm5'\)"):
        MoLRetriever(MoLIndex(path), UniformMoL(), method="brute_force", num_results=3)(mol_queries())
    cand = mol_queries(1).merge(pd.DataFrame({"docno": ["m1", "m5"]}), how="cross")
    with pytest.raises(ValueError, match=r"comps\.f4' is corrupt: row 5 \(docno 'm5'\)"):
        MoLReranker(MoLIndex(path), UniformMoL())(cand)


@pytest.mark.parametrize("kind", ["dense", "mol"])
def test_meta_that_is_not_an_object_is_named(dense, mol_index, kind):
    index = dense if kind == "dense" else mol_index
    (index.index_path / "pt_meta.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"pt_meta\.json' does not hold a JSON object"):
        (DenseIndex if kind == "dense" else MoLIndex)(index.index_path).docno_array()


@pytest.mark.parametrize("recorded", [True, False])
@pytest.mark.parametrize("kind", ["dense", "mol"])
def test_truncated_docno_store_is_named(dense, mol_index, kind, recorded):
    index = dense if kind == "dense" else mol_index
    path = index.index_path
    if not recorded:  # an index written before sizes were recorded (or by pyterrier-dr): npids' own structure
        meta = json.loads((path / "pt_meta.json").read_text())
        del meta["file_sizes"]
        (path / "pt_meta.json").write_text(json.dumps(meta))
    store = path / "docnos.npids"
    with open(store, "r+b") as f:
        f.truncate(store.stat().st_size - 40)
    with pytest.raises(ValueError, match=r"docnos\.npids'.*(truncated|corrupt)"):
        (DenseIndex if kind == "dense" else MoLIndex)(path).docno_array()


def test_docnos_differing_by_a_nul_are_refused(tmp_path):
    v = unit(np.random.default_rng(0).normal(size=(3, DIM)))
    with pytest.raises(ValueError, match=r"docno of record #1 \('d1\\x00'\) contains a NUL"):
        DenseIndex(tmp_path / "n.flex").index(pd.DataFrame({"docno": ["d1", "d1\x00", "d2"], "doc_vec": list(v)}))
    comps = unit(np.random.default_rng(0).normal(size=(2, PX, D)))
    with pytest.raises(ValueError, match=r"docno of record #0 \('\\x00m'\) contains a NUL"):
        MoLIndex(tmp_path / "n.mol").index(pd.DataFrame({"docno": ["\x00m", "m"], "doc_comp": list(comps)}))


def _linked_model(src: str, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    """A model folder whose files are symlinks to ``src``'s (cheap), except those in ``skip``."""
    dst.mkdir()
    for name in os.listdir(src):
        if name not in skip:
            os.symlink(os.path.join(src, name), dst / name)
    return dst


def test_truncated_safetensors_is_named(minilm_path, tmp_path):
    from st_extensions import load_model
    from st_extensions.modules import QueryDistributionHead

    model = _linked_model(minilm_path, tmp_path / "m", skip=("model.safetensors",))
    with open(os.path.join(minilm_path, "model.safetensors"), "rb") as f:
        (model / "model.safetensors").write_bytes(f.read(4096))
    with pytest.raises(ValueError, match=r"m/model\.safetensors' is (truncated|not a complete safetensors)"):
        load_model(str(model))
    head = QueryDistributionHead(16)
    (tmp_path / "head").mkdir()
    head.save(str(tmp_path / "head"))
    weights = tmp_path / "head" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(ValueError, match=r"head/model\.safetensors' is truncated"):
        QueryDistributionHead.load(str(tmp_path / "head"))
    (tmp_path / "head" / "model.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{")
    with pytest.raises(ValueError, match=r"head/model\.safetensors' is not a complete safetensors file"):
        QueryDistributionHead.load(str(tmp_path / "head"))


# ---------------------------------------------------------------------------------------------------------------
# loading models
# ---------------------------------------------------------------------------------------------------------------


def test_pickled_encoder_weights_are_refused(minilm_path, tmp_path):
    from st_extensions import load_model

    model = _linked_model(minilm_path, tmp_path / "m", skip=("model.safetensors",))
    (model / "pytorch_model.bin").write_bytes(b"not even read")
    with pytest.raises(ValueError, match=r"refusing to load '.*m/pytorch_model\.bin': its weights are pickled"):
        load_model(str(model))


def test_config_declaring_more_layers_than_saved_is_refused(minilm_path, tmp_path):
    from st_extensions import load_model

    model = _linked_model(minilm_path, tmp_path / "m", skip=("config.json",))
    config = json.loads(Path(minilm_path, "config.json").read_text())
    config["num_hidden_layers"] += 2
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"model\.safetensors' lacks \d+ weights .*encoder\.layer\.\{6, 7\}"):
        load_model(str(model), device="cpu")


# ---------------------------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------------------------


def test_sphere_law_dim_must_match_the_index(dense):
    with pytest.raises(ValueError, match=rf"dim=32 .* differs from the {DIM}-dim vectors"):
        CDFCutoffRetriever(dense, p=0.5, dim=32)
    assert CDFCutoffRetriever(dense, p=0.5, dim=DIM).dim == DIM


def test_calibration_refuses_nan_counts():
    with pytest.raises(
        ValueError, match=r"run\(0\.0\): retrieved counts must be finite numbers, got nan for position 1"
    ):
        calibrate_mean_k(lambda x: np.array([1.0, np.nan, 3.0]), 2.0, 0.0, 1.0)
    with pytest.raises(ValueError, match=r"got nan for qid 'b'"):
        calibrate_mean_k(lambda x: {"a": 1, "b": float("nan")}, 2.0, 0.0, 1.0)
    with pytest.raises(ValueError, match=r"got None for qid 'b'"):
        retrieved_counts({"a": 1, "b": None})


# ---------------------------------------------------------------------------------------------------------------
# overwriting an index: killed at every step, the path still loads; stale temporaries are removed
# ---------------------------------------------------------------------------------------------------------------

V1 = [f"old{i}" for i in range(4)]
V2 = [f"new{i}" for i in range(5)]


def _frame(docnos):
    rng = np.random.default_rng(len(docnos))
    return pd.DataFrame({"docno": docnos, "doc_vec": list(unit(rng.normal(size=(len(docnos), DIM))))})


def _write_killed(path: Path, kill_at: int, when: str, exchange: bool) -> int:
    """Overwrite ``path`` with V2 in a forked child that dies (``os._exit``) at its ``kill_at``-th file-system step
    (``os.replace``, atomic swap, ``rmtree``), before or after it; returns the child's exit code (0: not killed)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 0
        try:
            step, rmtree = [0], shutil.rmtree

            def hooked(real):
                def call(*args, **kwargs):
                    n = step[0]
                    step[0] += 1
                    if n == kill_at and when == "before":
                        os._exit(77)
                    if n == kill_at and when == "during" and real is rmtree:  # part of the folder deleted
                        files = [os.path.join(r, f) for r, _, fs in os.walk(args[0]) for f in fs]
                        if files:
                            os.unlink(files[0])
                        os._exit(77)
                    out = real(*args, **kwargs)
                    if n == kill_at and when == "after":
                        os._exit(77)
                    return out

                return call

            os.replace = hooked(os.replace)
            shutil.rmtree = hooked(shutil.rmtree)
            atomic._exchange = hooked(atomic._exchange) if exchange else (lambda a, b: False)
            DenseIndex(path).indexer(mode="overwrite").index(_frame(V2))
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _temporaries(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path.parent) if n.startswith(f".{path.name}."))


def _dead_pid() -> int:
    """The pid of a child process that has already exited (a writer that died)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


@pytest.mark.parametrize("exchange", [True, False], ids=["atomic-swap", "two-renames"])
def test_overwrite_killed_at_every_step_leaves_a_loadable_index(tmp_path, exchange):
    if exchange and not atomic._exchange_supported(tmp_path):
        pytest.skip("this file system cannot swap two paths atomically")
    path = tmp_path / "idx.flex"
    DenseIndex(path).index(_frame(V1))
    seen = set()
    for kill_at in range(8):
        for when in ("before", "during", "after"):
            code = _write_killed(path, kill_at, when, exchange)
            assert code in (0, 77), code
            if exchange:  # an atomic swap: the path holds a complete index at every moment, no recovery needed
                assert (path / "pt_meta.json").exists(), (kill_at, when)
            docnos = DenseIndex(path).docno_array().tolist()  # loading recovers a previous version if need be
            assert docnos in (V1, V2), (kill_at, when, docnos)
            seen.add(tuple(docnos))
            assert _temporaries(path) == [], (kill_at, when)  # the killed writer's temporaries are gone
            assert len(TopKRetriever(DenseIndex(path), 2)(queries(1))) == 2
            DenseIndex(path).indexer(mode="overwrite").index(_frame(V1))  # back to V1 for the next kill
        if code == 0:  # this many steps complete the write: every step has been killed
            break
    else:
        pytest.fail("the writer never completed")
    assert seen == {tuple(V1), tuple(V2)}


def test_overwrite_never_leaves_the_path_empty_for_a_reader(tmp_path):
    if not atomic._exchange_supported(tmp_path):
        pytest.skip("this file system cannot swap two paths atomically")
    path = tmp_path / "idx.flex"
    DenseIndex(path).index(_frame(V1))
    gaps, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            if not (path / "pt_meta.json").exists():
                gaps.append(time.monotonic())

    t = threading.Thread(target=reader)
    t.start()
    try:
        for i in range(15):
            DenseIndex(path).indexer(mode="overwrite").index(_frame(V2 if i % 2 else V1))
    finally:
        stop.set()
        t.join()
    assert gaps == []


def test_stale_temporaries_are_cleaned_and_live_ones_kept(tmp_path):
    path = tmp_path / "idx.flex"
    DenseIndex(path).index(_frame(V1))
    dead = _dead_pid()
    for name in (
        f".idx.flex.tmp-{dead}-0123456789ab",
        f".idx.flex.old-{dead}-ba9876543210",
        ".idx.flex.tmp-aaaabbbbcccc",
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "junk").write_bytes(b"x")
    old = time.time() - 3600
    os.utime(tmp_path / ".idx.flex.tmp-aaaabbbbcccc", (old, old))  # an earlier version's name: no pid, long unlocked
    live = tmp_path / f".idx.flex.tmp-{os.getpid()}-fedcba987654"  # a writer of this process, holding its lock
    live.mkdir()
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert DenseIndex(path).docno_array().tolist() == V1
        assert _temporaries(path) == [live.name]
    finally:
        os.close(fd)
    os.utime(live, (old, old))
    DenseIndex(path).indexer(mode="overwrite").index(_frame(V2))  # the next writer cleans up as well
    assert _temporaries(path) == [] and DenseIndex(path).docno_array().tolist() == V2


def test_a_previous_version_left_aside_is_recovered_on_load(tmp_path):
    """Where the file system cannot swap, a writer killed between its two renames leaves the path missing; loading
    (an index, or a model with st_extensions.load_model) moves the previous version back."""
    path = tmp_path / "idx.flex"
    DenseIndex(path).index(_frame(V1))
    dead = _dead_pid()
    os.rename(path, tmp_path / f".idx.flex.old-{dead}-0123456789ab")
    assert not path.exists()
    assert DenseIndex(path).docno_array().tolist() == V1 and _temporaries(path) == []


def test_a_model_left_aside_is_recovered_by_load_model(minilm_path, tmp_path):
    from st_extensions import load_model

    dead = _dead_pid()
    _linked_model(minilm_path, tmp_path / f".model.old-{dead}-0123456789ab")
    model = load_model(str(tmp_path / "model"), device="cpu")
    assert model.get_embedding_dimension() == 384 and (tmp_path / "model").is_dir()
