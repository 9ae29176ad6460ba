"""On-disk dense vector index: pyterrier-dr's FlexIndex format, written atomically and validated.

:class:`DenseIndex` is a :class:`pyterrier_dr.FlexIndex` byte for byte (``pt_meta.json``, ``vecs.f4``,
``docnos.npids``): every pyterrier-dr retriever works on it, and the retrievers here accept any FlexIndex. It adds what
pEBR's cutoffs (Sec. 4.1.2, Appendix A) need: L2-normalised vectors (inner product = the cosine they threshold),
atomic indexing, checked input and clear errors on a corrupt directory. ``searcher()`` is attached by
:mod:`pyterrier_prob.index.search` (``docs/scale.md``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from pyterrier_dr import FlexIndex, SimFn

from pyterrier_prob.index.indexer import AtomicIndexer, IndexArtifact, IndexingMode

__all__ = ["DenseIndex", "DenseIndexer", "IndexingMode", "as_dense_index"]


class DenseIndex(IndexArtifact, FlexIndex):
    """A dense index on disk (a pyterrier-dr FlexIndex with atomic, validated writes and cosine-ready vectors)::

        index = DenseIndex("my.flex")
        (encoder.doc_encoder() >> index.indexer()).index(dataset.get_corpus_iter())  # or {"docno", "doc_vec"} records
        retriever = encoder.query_encoder() >> pyterrier_prob.CDFCutoffRetriever(index, p=0.5)

    :meth:`vectors` is a float32 memmap ``(len(index), dim)``; :meth:`docnos` pyterrier-dr's ``npids.Lookup``.
    """

    ARTIFACT_TYPE = "dense_index"
    ARTIFACT_FORMAT = "flex"
    KIND = "dense"
    RECORDS = "'docno' and 'doc_vec', e.g. from ProbBiEncoder(model).doc_encoder()"
    META_INTS = ("doc_count", "vec_size")
    ROW = "the vector of row"

    def __init__(self, path: str | os.PathLike, *, verbose: bool = False) -> None:
        super().__init__(str(path), sim_fn=SimFn.dot, verbose=verbose)

    # ---- loading -----------------------------------------------------------------------------------------
    def _arrays(self, meta: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
        return [("vecs.f4", (meta["doc_count"], meta["vec_size"]))]

    def payload(self, return_dvecs: bool = True, return_docnos: bool = True) -> list:
        """FlexIndex's ``(docnos, vectors, meta)`` accessor, with the checks of a complete index first."""
        meta = self._load_meta()
        if return_docnos and self._docnos is None:
            self._docnos = self._open_docnos(meta["doc_count"])
        return super().payload(return_dvecs=return_dvecs, return_docnos=return_docnos)

    def check_finite(self) -> None:
        """Raise ValueError naming ``vecs.f4``, the row and its docno if a vector holds nan/inf (read once)."""
        self._check_finite([("vecs.f4", self.vectors())])

    @property
    def dim(self) -> int:
        """Dimension of the indexed vectors."""
        return int(self._load_meta()["vec_size"])

    @property
    def normalized(self) -> bool:
        """Whether the vectors were L2-normalised at indexing (inner product = cosine)."""
        return bool(self._load_meta().get("normalized", False))

    def vectors(self) -> np.memmap:
        """The indexed vectors, a read-only float32 memmap of shape ``(len(self), self.dim)``."""
        return self.payload(return_docnos=False)[0]

    # ---- indexing ----------------------------------------------------------------------------------------
    def indexer(  # type: ignore[override]
        self, *, mode: IndexingMode | str = IndexingMode.create, normalize: bool = True
    ) -> DenseIndexer:
        """An indexer writing this index; ``mode``: ``"create"`` or ``"overwrite"`` (replace it, atomically);
        ``normalize``: L2-normalise the vectors (inner product = cosine, what the cutoffs threshold)."""
        return DenseIndexer(self, mode=mode, normalize=normalize)


class DenseIndexer(AtomicIndexer):
    """Writes a :class:`DenseIndex` from records or a frame with ``docno`` and ``doc_vec`` (1-D, one dimension)."""

    VECTOR = "doc_vec"
    HINT = "encoder.doc_encoder() >> index.indexer()"

    def __init__(
        self, index: DenseIndex, mode: IndexingMode | str = IndexingMode.create, normalize: bool = True
    ) -> None:
        super().__init__(index, mode)
        self.normalize = bool(normalize)

    def __repr__(self) -> str:
        return f"{self._index!r}.indexer(mode={self.mode.value!r}, normalize={self.normalize})"

    def _arrays(self, shapes: dict, offset: int, docnos: list, vecs: list, extra: list | None) -> dict[str, Any]:
        arr = self._stack(shapes, vecs, "doc_vec", offset, docnos, 1, "vector dimensions")
        if self.normalize:
            norms = np.linalg.norm(arr.astype(np.float64), axis=1)
            if (zero := np.flatnonzero(norms == 0)).size:
                raise ValueError(
                    f"doc_vec of record #{offset + zero[0]} (docno {docnos[zero[0]]!r}) is all zeros: it "
                    "has no direction and cannot be normalised for cosine retrieval"
                )
            arr = arr / norms[:, None]
        return {"vecs.f4": arr}

    def _meta(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        return {"vec_size": int(shapes["doc_vec"][0]), "normalized": self.normalize, "package_hint": "pyterrier-dr"}


def as_dense_index(index: Any) -> DenseIndex:
    """``index`` as a :class:`DenseIndex` (itself, or over a FlexIndex's directory); TypeError for anything else."""
    if isinstance(index, DenseIndex):
        return index
    if isinstance(index, FlexIndex):
        return DenseIndex(index.index_path, verbose=index.verbose)
    raise TypeError(
        f"expected a pyterrier_prob.DenseIndex or pyterrier_dr.FlexIndex, got {type(index).__name__}: "
        "build one with DenseIndex(path).indexer().index(...) or open it with DenseIndex(path)"
    )
