"""Indexes shared through PyTerrier's Artifact packaging, offline (issue 33, "Sharing"): ``build_package`` writes the
``.tar.lz4`` and its ``.json`` that ``to_hf`` uploads, and ``from_url`` downloads, checks and unpacks them as
``from_hf`` does (an ``hf:`` URL resolves to such an https URL): here from a local HTTP server. The index loaded back
gives the same retrieval results. Loading a shared model refuses pickled weights:
``tests/test_bad_input.py::test_pickled_encoder_weights_are_refused``."""

from __future__ import annotations

import functools
import http.server
import threading

import numpy as np
import pandas as pd
import pyterrier as pt
import pytest
from pyterrier_dr import FlexIndex

from pyterrier_prob.index import DenseIndex, MoLIndex, as_dense_index


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


@pytest.fixture
def share(tmp_path, monkeypatch):
    """A folder served over HTTP on localhost (the stand-in for the Hub) and a fresh PyTerrier artifact cache."""
    monkeypatch.setenv("PYTERRIER_HOME", str(tmp_path / "pt-home"))
    folder = tmp_path / "share"
    folder.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield folder, f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def _hits(index, queries):
    """The top 5 of each query (docnos, scores, offsets): dense vectors, or a MoL index's component means."""
    searcher = index.searcher() if isinstance(index, DenseIndex) else index.searcher("mean")
    hits = searcher.search(queries, num_results=5)
    return list(index.docnos().fwd[hits.docids]), hits.scores, hits.offsets


def _same_hits(a, b):
    assert list(a[0]) == list(b[0])
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[2], b[2])


def test_dense_index_round_trips_through_a_package(tmp_path, share):
    folder, url = share
    rng = np.random.default_rng(0)
    vecs = _unit(rng.normal(size=(40, 8)))
    index = DenseIndex(tmp_path / "docs.flex")
    index.indexer().index(pd.DataFrame({"docno": [f"d{i}" for i in range(40)], "doc_vec": list(vecs)}))
    queries = _unit(rng.normal(size=(3, 8)))
    package = index.build_package(str(folder / "docs.flex.tar.lz4"), verbose=False)
    assert package.endswith(".tar.lz4") and (folder / "docs.flex.tar.lz4.json").is_file()

    loaded = DenseIndex.from_url(f"{url}/docs.flex.tar.lz4")  # our class: DenseIndex.from_url / from_hf
    assert type(loaded) is DenseIndex and loaded.index_path != index.index_path
    np.testing.assert_array_equal(loaded.vectors(), index.vectors())
    _same_hits(_hits(loaded, queries), _hits(index, queries))

    # any PyTerrier user: the index is pyterrier-dr's FlexIndex format, which our retrievers accept as it is
    generic = pt.Artifact.from_url(f"{url}/docs.flex.tar.lz4")
    assert isinstance(generic, FlexIndex)
    _same_hits(_hits(as_dense_index(generic), queries), _hits(index, queries))


def test_mol_index_round_trips_through_a_package(tmp_path, share):
    folder, url = share
    rng = np.random.default_rng(1)
    comps = _unit(rng.normal(size=(30, 4, 8)))
    index = MoLIndex(tmp_path / "docs.mol")
    index.indexer().index(pd.DataFrame({"docno": [f"m{i}" for i in range(30)], "doc_comp": list(comps)}))
    index.build_package(str(folder / "docs.mol.tar.lz4"), verbose=False)

    loaded = pt.Artifact.from_url(f"{url}/docs.mol.tar.lz4")  # found through our "mol_index.np" entry point
    assert type(loaded) is MoLIndex and len(loaded) == 30 and loaded.num_components == 4
    np.testing.assert_array_equal(loaded.components(), index.components())
    queries = _unit(rng.normal(size=(3, 8)))
    _same_hits(_hits(loaded, queries), _hits(index, queries))
    assert type(pt.Artifact.load(str(index.index_path))) is MoLIndex


def test_a_tampered_package_is_refused(tmp_path, share):
    folder, url = share
    index = DenseIndex(tmp_path / "docs.flex")
    index.indexer().index(pd.DataFrame({"docno": ["a", "b"], "doc_vec": list(_unit(np.eye(2, 4)))}))
    package = folder / "docs.flex.tar.lz4"
    index.build_package(str(package), verbose=False)
    data = bytearray(package.read_bytes())
    data[len(data) // 2] ^= 0xFF
    package.write_bytes(bytes(data))
    with pytest.raises(Exception, match="(?i)sha256|hash|checksum"):
        DenseIndex.from_url(f"{url}/docs.flex.tar.lz4")
