"""On-disk dense vector index: pyterrier-dr's FlexIndex format, written atomically and validated.

:class:`DenseIndex` subclasses :class:`pyterrier_dr.FlexIndex` and keeps its on-disk format byte for byte
(``pt_meta.json`` with ``type="dense_index"``, ``format="flex"``; raw float32 vectors in ``vecs.f4`` opened
with ``np.memmap``; docnos in ``docnos.npids``), so there is one vector store, not two:

* an index written here is a FlexIndex: ``pt.Artifact.load(path)`` (pyterrier-dr's entry point
  ``dense_index.flex``) opens it, and every pyterrier-dr retriever (``np_retriever``, ``faiss_flat_retriever``,
  ``torch_retriever``, HNSW, ...) works on it;
* the cutoff retrievers of :mod:`pyterrier_prob.pebr.cutoff` accept any FlexIndex, including one built by
  pyterrier-dr itself.

Its :meth:`searcher` (attached by :mod:`pyterrier_prob.index.search`, as pyterrier-dr attaches its retrievers to
FlexIndex) gives the exact scan or a faiss IVF / HNSW / GPU index over these vectors, cached in the folder.

What the subclass adds is what the pEBR cutoffs (``shared/papers/pebr.md``, Sec. 4.1.2 and Appendix A) need
of the store: vectors are L2-normalised at indexing (``normalize=True``, recorded as ``"normalized": true`` in
``pt_meta.json``) so the inner product is the cosine the cutoffs threshold; indexing is atomic (written into
a hidden sibling directory and renamed into place at the end, so an interrupted run never leaves an index
that loads, and an overwrite never leaves the path without one); input is checked (missing ``doc_vec``/``docno``,
vectors stored as text, inconsistent dimensions, non-finite or zero vectors, duplicate docnos, docnos with a NUL
character, which the docno store could not keep apart), each error naming the record and its docno; and loading an
incomplete or corrupt directory raises a clear error naming the file: a ``pt_meta.json`` that is not a JSON object,
files whose sizes differ from those recorded at indexing (a truncated ``docnos.npids``), a docno store that does not
map its docnos back, and non-finite vectors (first and last row on opening, every row before the first search,
:meth:`DenseIndex.check_finite`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt
from npids import Lookup
from pyterrier_dr import FlexIndex, SimFn

from pyterrier_prob.atomic import recover_directory
from pyterrier_prob.index.indexer import (
    AtomicIndexer,
    IndexingMode,
    check_docno_store,
    check_docnos,
    check_sizes,
    missing_message,
    read_meta,
    record_sizes,
)
from pyterrier_prob.validation import stack_arrays

__all__ = ["DenseIndex", "DenseIndexer", "IndexingMode", "as_dense_index"]

_BATCH = 4096
_CHECK_ROWS = 65536  # rows per chunk of check_finite


class DenseIndex(FlexIndex):
    """A dense index on disk (a pyterrier-dr FlexIndex with atomic, validated writes and cosine-ready vectors).

    Build with ``encoder.doc_encoder() >> DenseIndex(path).indexer()`` (``.index(corpus_iter)``), or index
    precomputed ``{"docno", "doc_vec"}`` records or a frame with those columns directly::

        index = DenseIndex("my.flex")
        (encoder.doc_encoder() >> index.indexer()).index(dataset.get_corpus_iter())
        retriever = encoder.query_encoder() >> pyterrier_prob.CDFCutoffRetriever(index, p=0.5)

    Args:
        path: the index directory.
        verbose: progress bars while indexing.

    The vectors are a float32 ``np.memmap`` (:meth:`vectors`, shape ``(len(index), dim)``); :meth:`docnos`
    is pyterrier-dr's ``npids.Lookup`` (``.fwd[docids]`` -> docnos, ``.inv[docnos]`` -> docids, -1 if absent).
    """

    ARTIFACT_TYPE = "dense_index"
    ARTIFACT_FORMAT = "flex"

    def __init__(self, path: str | os.PathLike, *, verbose: bool = False) -> None:
        super().__init__(str(path), sim_fn=SimFn.dot, verbose=verbose)

    # ---- loading -----------------------------------------------------------------------------------------
    def _reset(self) -> None:
        self._meta = None
        self._docnos = None
        self._dvecs = None
        self._cache = {}

    def _check_files(self) -> dict[str, Any]:
        """Read and check ``pt_meta.json`` and the sizes of the files; a clear error when anything is off."""
        path = self.index_path
        recover_directory(path)  # a writer killed mid-swap: the previous version back; stale temporaries removed
        if not path.exists():
            raise FileNotFoundError(
                f"no dense index at {str(path)!r}: build one with DenseIndex(path).indexer().index(records) "
                "(records with 'docno' and 'doc_vec', e.g. from ProbBiEncoder(model).doc_encoder())"
            )
        if not path.is_dir():
            raise ValueError(f"{str(path)!r} is a file, not a dense index directory")
        meta_path = path / "pt_meta.json"
        if not meta_path.exists():
            raise ValueError(
                f"{str(path)!r} is not a complete dense index (no pt_meta.json): an interrupted or foreign "
                "indexing run? Rebuild it with DenseIndex(path).indexer(mode='overwrite')"
            )
        meta = read_meta(meta_path)
        if meta.get("type") != self.ARTIFACT_TYPE or meta.get("format") != self.ARTIFACT_FORMAT:
            raise ValueError(
                f"{str(path)!r} holds an artifact of type={meta.get('type')!r}, format={meta.get('format')!r}, "
                f"not a dense index (type={self.ARTIFACT_TYPE!r}, format={self.ARTIFACT_FORMAT!r})"
            )
        count, dim = meta.get("doc_count"), meta.get("vec_size")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (count, dim)):
            raise ValueError(f"{str(meta_path)!r} has invalid doc_count={count!r} / vec_size={dim!r}")
        vecs = path / "vecs.f4"
        if not vecs.exists() or vecs.stat().st_size != count * dim * 4:
            size = vecs.stat().st_size if vecs.exists() else None
            raise ValueError(
                f"{str(path)!r} is corrupt: vecs.f4 has {size} bytes, pt_meta.json says {count} x {dim} float32 "
                f"({count * dim * 4} bytes)"
            )
        check_sizes(path, meta)  # files whose sizes the indexer recorded (docnos.npids): truncated ones
        if not (path / "docnos.npids").exists():
            raise ValueError(f"{str(path)!r} is corrupt: docnos.npids is missing")
        # a vectors file of the right size holding nan/inf (e.g. zero-filled by a crash, or overwritten): its first
        # and last rows here, every row before the first search (check_finite)
        mm = np.memmap(vecs, dtype=np.float32, mode="r", shape=(count, dim))
        for i in sorted({0, count - 1}):
            if not np.isfinite(mm[i]).all():
                raise ValueError(
                    f"{str(vecs)!r} is corrupt: the vector of row {i} has non-finite values (nan or inf); rebuild "
                    "the index with DenseIndex(path).indexer(mode='overwrite')"
                )
        del mm
        return meta

    def payload(self, return_dvecs: bool = True, return_docnos: bool = True) -> list:
        """FlexIndex's ``(docnos, vectors, meta)`` accessor, with the checks of a complete index first."""
        meta = self._check_files() if self._meta is None else self._meta
        if return_docnos and self._docnos is None:
            store = self.index_path / "docnos.npids"
            try:
                lookup = Lookup(store)
            except Exception as e:  # a truncated store fails in many ways inside npids
                raise ValueError(f"{str(store)!r} is corrupt (truncated?): {type(e).__name__}: {e}") from e
            check_docno_store(lookup, meta["doc_count"], store)
            self._docnos = lookup
        return super().payload(return_dvecs=return_dvecs, return_docnos=return_docnos)

    def check_finite(self) -> None:
        """Raise ValueError naming ``vecs.f4`` and the first row if any vector holds nan/inf.

        Reads every vector once per opened index (in chunks; the answer is cached), as the retrievers of
        :mod:`pyterrier_prob.pebr.cutoff` do before their first search: a corrupt vectors file of the right size
        would otherwise match nothing and return empty results.
        """
        key = "pyterrier_prob.finite"
        if self._cache.get(key):
            return
        vecs = self.vectors()
        for a in range(0, len(vecs), _CHECK_ROWS):
            ok = np.isfinite(np.asarray(vecs[a : a + _CHECK_ROWS])).all(axis=1)
            if not ok.all():
                bad = np.flatnonzero(~ok)
                i = a + int(bad[0])
                raise ValueError(
                    f"{str(self.index_path / 'vecs.f4')!r} is corrupt: the vector of row {i} (docno "
                    f"{str(self.docnos().fwd[i])!r}) has non-finite values (nan or inf); rebuild the index with "
                    "DenseIndex(path).indexer(mode='overwrite')"
                )
        self._cache[key] = True

    @property
    def meta(self) -> dict[str, Any]:
        """The index's ``pt_meta.json``."""
        (meta,) = self.payload(return_dvecs=False, return_docnos=False)
        return meta

    @property
    def dim(self) -> int:
        """Dimension of the indexed vectors."""
        return int(self.meta["vec_size"])

    @property
    def normalized(self) -> bool:
        """Whether the vectors were L2-normalised at indexing (inner product = cosine)."""
        return bool(self.meta.get("normalized", False))

    def vectors(self) -> np.memmap:
        """The indexed vectors, a read-only float32 memmap of shape ``(len(self), self.dim)``."""
        dvecs, _ = self.payload(return_docnos=False)
        return dvecs

    def docno_array(self) -> np.ndarray:
        """All docnos, in index order, as a numpy string array."""
        return self.docnos().fwd[np.arange(len(self))]

    # ---- indexing ----------------------------------------------------------------------------------------
    def indexer(  # type: ignore[override]
        self, *, mode: IndexingMode | str = IndexingMode.create, normalize: bool = True
    ) -> DenseIndexer:
        """An indexer writing this index (``encoder.doc_encoder() >> index.indexer()``).

        Args:
            mode: ``"create"`` (error if the path exists) or ``"overwrite"`` (replace it, atomically).
            normalize: L2-normalise the vectors so that inner product = cosine (what the cutoffs threshold).
        """
        return DenseIndexer(self, mode=mode, normalize=normalize)

    def index(self, inp: Iterable[Mapping[str, Any]] | pd.DataFrame) -> DenseIndex:  # type: ignore[override]
        """Index ``docno``/``doc_vec`` records (or a frame) into a new index at this path."""
        return self.indexer().index(inp)

    def __repr__(self) -> str:
        return f"DenseIndex({str(self.index_path)!r})"


class DenseIndexer(AtomicIndexer):
    """Writes a :class:`DenseIndex`; made by :meth:`DenseIndex.indexer`.

    Input: an iterable of records (dicts) or a DataFrame with ``docno`` (str) and ``doc_vec`` (1-D float
    vectors of one dimension). Everything is written into a hidden temporary directory next to the target and
    renamed into place only once complete; on any error the temporary directory is removed and the path is
    left as it was.
    """

    def __init__(
        self, index: DenseIndex, mode: IndexingMode | str = IndexingMode.create, normalize: bool = True
    ) -> None:
        super().__init__(index, mode)
        self.normalize = bool(normalize)

    def __repr__(self) -> str:
        return f"{self._index!r}.indexer(mode={self.mode.value!r}, normalize={self.normalize})"

    def index_inputs(self) -> list[list[str]]:
        return [["docno", "doc_vec"]]

    def _write_files(self, inp: Iterable[Mapping[str, Any]] | pd.DataFrame, tmp: Path) -> dict[str, Any]:
        count, dim = self._write(inp, tmp)
        return {
            "type": DenseIndex.ARTIFACT_TYPE,
            "format": DenseIndex.ARTIFACT_FORMAT,
            "vec_size": dim,
            "doc_count": count,
            "normalized": self.normalize,
            "package_hint": "pyterrier-dr",
            "file_sizes": record_sizes(tmp),
        }

    def _batches(self, inp: Iterable[Mapping[str, Any]] | pd.DataFrame) -> Iterator[tuple[list, list]]:
        if isinstance(inp, pd.DataFrame):
            missing = [c for c in ("docno", "doc_vec") if c not in inp.columns]
            if missing:
                raise ValueError(_missing_message(missing, list(inp.columns)))
            docnos, vecs = inp["docno"].tolist(), inp["doc_vec"].tolist()
            for i in range(0, len(docnos), _BATCH):
                yield docnos[i : i + _BATCH], vecs[i : i + _BATCH]
            return
        if isinstance(inp, Mapping):
            raise TypeError("index() takes an iterable of records (dicts) or a DataFrame, not a single dict")
        docnos, vecs = [], []
        for rec in inp:
            try:
                docnos.append(rec["docno"])
                vecs.append(rec["doc_vec"])
            except (KeyError, TypeError) as e:
                cols = list(rec) if isinstance(rec, Mapping) else type(rec).__name__
                missing = [c for c in ("docno", "doc_vec") if not isinstance(rec, Mapping) or c not in rec]
                raise ValueError(_missing_message(missing, cols)) from e
            if len(docnos) >= _BATCH:
                yield docnos, vecs
                docnos, vecs = [], []
        if docnos:
            yield docnos, vecs

    def _write(self, inp: Iterable[Mapping[str, Any]] | pd.DataFrame, tmp: Path) -> tuple[int, int]:
        dim: int | None = None
        count = 0
        seen: set[str] = set()
        bar = pt.tqdm(desc=f"indexing {self._index.index_path.name}", unit="doc") if self._index.verbose else None
        try:
            with open(tmp / "vecs.f4", "wb") as fvecs, Lookup.builder(tmp / "docnos.npids") as lookup:
                for docnos, vecs in self._batches(inp):
                    check_docnos(docnos, count, seen)
                    arr, dim = _stack_vectors(vecs, dim, count, docnos)
                    if self.normalize:
                        norms = np.linalg.norm(arr.astype(np.float64), axis=1)
                        zero = np.flatnonzero(norms == 0)
                        if zero.size:
                            raise ValueError(
                                f"doc_vec of record #{count + zero[0]} (docno {docnos[zero[0]]!r}) is all zeros: it "
                                "has no direction and cannot be normalised for cosine retrieval"
                            )
                        arr = (arr / norms[:, None]).astype(np.float32)
                    for docno in docnos:
                        lookup.add(docno)
                    fvecs.write(np.ascontiguousarray(arr, dtype=np.float32).tobytes())
                    count += len(docnos)
                    if bar is not None:
                        bar.update(len(docnos))
                if count == 0:
                    raise ValueError("nothing to index: the input had no records")
                if count == 1:  # npids' fixed-bytes codec divides by zero on a single docno
                    raise ValueError(
                        "a dense index needs at least 2 documents (npids, FlexIndex's docno store, cannot hold one)"
                    )
                fvecs.flush()
                os.fsync(fvecs.fileno())
        finally:
            if bar is not None:
                bar.close()
        assert dim is not None
        return count, dim


def _missing_message(missing: list[str], have: Any) -> str:
    return missing_message(missing, have, "doc_vec", "encoder.doc_encoder() >> index.indexer()")


def _stack_vectors(vecs: list, dim: int | None, offset: int, docnos: list) -> tuple[np.ndarray, int]:
    """Stack a batch of vectors into a float32 (n, dim) array, checking type, shape, dimension and finiteness."""

    def name(i: int) -> str:
        return f"record #{offset + i} (docno={docnos[i]!r})"

    shape = None if dim is None else (dim,)
    arr = stack_arrays(vecs, "doc_vec", name, "DenseIndexer", ndim=1, shape=shape, kind="vector dimensions")
    return arr, int(arr.shape[1])


def as_dense_index(index: Any) -> DenseIndex:
    """``index`` as a :class:`DenseIndex`: itself, or a :class:`DenseIndex` over a FlexIndex's directory.

    Raises:
        TypeError: for anything that is not a :class:`DenseIndex` or :class:`pyterrier_dr.FlexIndex`.
    """
    if isinstance(index, DenseIndex):
        return index
    if isinstance(index, FlexIndex):
        return DenseIndex(index.index_path, verbose=index.verbose)
    raise TypeError(
        f"expected a pyterrier_prob.DenseIndex or pyterrier_dr.FlexIndex, got {type(index).__name__}: "
        "build one with DenseIndex(path).indexer().index(...) or open it with DenseIndex(path)"
    )
