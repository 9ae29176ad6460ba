"""On-disk index of Mixture-of-Logits item component embeddings (``shared/papers/mixture-of-logits.txt``, Sec. 3).

MoL scores ``phi(q, x) = sum_p pi_p(q, x) <f_pq(q), g_px(x)>`` (Eqs. 1, 2, 5); the item side Algorithms 1-2
precompute is stored float32 and memmapped: ``comps.f4`` ``(N, P_x, d)``, ``mean.f4`` ``(N, d)`` (TopKAvg's X',
Eq. 6), optional ``feats.f4`` ``(N, F)`` gate features (App. A.3), ``docnos.npids`` and ``pt_meta.json``; written
atomically and checked on loading (:class:`~pyterrier_prob.index.indexer.IndexArtifact`), vectors as given.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyterrier as pt
from npids import Lookup

from pyterrier_prob.index.backends import SearchSettings, build_index, import_faiss
from pyterrier_prob.index.indexer import AtomicIndexer, IndexArtifact, IndexingMode
from pyterrier_prob.index.search import Searcher, cached_searcher
from pyterrier_prob.validation import is_int

__all__ = ["MoLIndex", "MoLIndexer", "as_mol_index"]


class MoLIndex(IndexArtifact, pt.Artifact):
    """An index of MoL item component embeddings on disk (Sec. 3's item side, preprocessed)::

        index = MoLIndex("docs.mol")
        (encoder.doc_encoder() >> index.indexer()).index(dataset.get_corpus_iter())  # or {"docno", "doc_comp"} records

    :meth:`components` is a read-only float32 memmap ``(len(index), num_components, dim)``; :meth:`docnos` an
    ``npids.Lookup`` (``.fwd[docids]`` -> docnos, ``.inv[docnos]`` -> docids, -1 if absent).
    """

    ARTIFACT_TYPE = "mol_index"
    ARTIFACT_FORMAT = "np"
    KIND = "MoL"
    RECORDS = "'docno' and 'doc_comp', e.g. from MoLEncoder(model).doc_encoder()"
    META_INTS = ("doc_count", "num_components", "dim")

    def __init__(self, path: str | os.PathLike, *, verbose: bool = False) -> None:
        super().__init__(path)
        self.verbose = bool(verbose)
        self._reset()

    @property
    def index_path(self) -> Path:
        """The index directory."""
        return Path(self.path)

    # ---- loading -----------------------------------------------------------------------------------------
    def _arrays(self, meta: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
        count, fdim = meta["doc_count"], meta.get("feature_dim")
        if fdim is not None and not (is_int(fdim) and fdim > 0):
            raise ValueError(f"{str(self.index_path / 'pt_meta.json')!r} has invalid feature_dim={fdim!r}")
        files = [("comps.f4", (count, meta["num_components"], meta["dim"])), ("mean.f4", (count, meta["dim"]))]
        return files + ([("feats.f4", (count, fdim))] if fdim is not None else [])

    def _memmap(self, file: str) -> np.memmap:
        """A read-only float32 memmap of one of the index's files (:meth:`_arrays`), opened once."""
        if ("memmap", file) not in self._cache:
            shape = dict(self._arrays(self._load_meta()))[file]
            self._cache["memmap", file] = np.memmap(self.index_path / file, dtype=np.float32, mode="r", shape=shape)
        return self._cache["memmap", file]

    def check_finite(self) -> None:
        """Raise ValueError naming the file, row and docno if a stored array holds nan/inf (read once)."""
        self._check_finite([(file, self._memmap(file)) for file, _ in self._arrays(self._load_meta())])

    def __len__(self) -> int:
        return int(self._load_meta()["doc_count"])

    @property
    def num_components(self) -> int:
        """P_x, the number of component embeddings per document."""
        return int(self._load_meta()["num_components"])

    @property
    def dim(self) -> int:
        """d, the dimension of each component embedding."""
        return int(self._load_meta()["dim"])

    def components(self) -> np.memmap:
        """All documents' component embeddings: read-only float32 memmap ``(len(self), num_components, dim)``."""
        return self._memmap("comps.f4")

    def means(self) -> np.memmap:
        """Each document's mean component embedding (TopKAvg's X', Algorithm 2 line 12): memmap ``(N, dim)``."""
        return self._memmap("mean.f4")

    @property
    def feature_dim(self) -> int | None:
        """F, the dimension of the stored gate features (``None`` when the index holds none)."""
        fdim = self._load_meta().get("feature_dim")
        return None if fdim is None else int(fdim)

    def features(self) -> np.memmap | None:
        """Each document's gate features (App. A.3): memmap ``(N, feature_dim)``, or ``None`` if not indexed."""
        return None if self.feature_dim is None else self._memmap("feats.f4")

    def docnos(self) -> Lookup:
        """The docno store (``npids.Lookup``, as pyterrier-dr's FlexIndex)."""
        if self._docnos is None:
            self._docnos = self._open_docnos(len(self))
        return self._docnos

    # ---- faiss -------------------------------------------------------------------------------------------
    def _part(self, part: int | str) -> tuple[np.ndarray, str]:
        """The vectors of component ``part`` of every document (an int) or of their means (``"mean"``), and a name."""
        if part == "mean":
            return self.means(), "mean"
        if is_int(part) and 0 <= part < self.num_components:
            return self.components()[:, int(part)], f"comp{int(part)}"
        raise ValueError(f"part must be 'mean' or a component in 0..{self.num_components - 1}, got {part!r}")

    def faiss_flat(self, part: int | str = "mean", gpu: bool = False) -> Any:
        """A faiss ``IndexFlatIP`` over component ``part`` of every document or their means (cached; GPU if ``gpu``)."""
        vectors, name = self._part(part)
        key = f"faiss_{name}_{'gpu' if gpu else 'cpu'}"
        if key not in self._cache:
            if gpu:  # pragma: no cover - needs faiss-gpu and a GPU
                self._cache[key] = import_faiss().index_cpu_to_all_gpus(self.faiss_flat(part, False))
            else:
                self._cache[key] = build_index(vectors, "flat", None, SearchSettings())
        return self._cache[key]

    def searcher(self, part: int | str = "mean", backend: str = "exact", **params: Any) -> Searcher:
        """A :class:`~pyterrier_prob.index.search.Searcher` (inner products) over component ``part`` (an int) or the
        means (``"mean"``, TopKAvg's X'), for MoL's candidate stages; ``backend`` and ``params`` as
        :func:`~pyterrier_prob.index.search.make_searcher`, the faiss index cached in ``faiss/<part>/`` and in memory.
        """
        vectors, name = self._part(part)
        self.check_finite()
        return cached_searcher(
            self._cache, ("searcher", name), vectors, backend, self.index_path / "faiss" / name, **params
        )

    # ---- factories ---------------------------------------------------------------------------------------
    def indexer(self, *, mode: IndexingMode | str = IndexingMode.create) -> MoLIndexer:
        """An indexer writing this index; ``mode``: ``"create"`` or ``"overwrite"`` (replace it, atomically)."""
        return MoLIndexer(self, mode=mode)


class MoLIndexer(AtomicIndexer):
    """Writes a :class:`MoLIndex` from records or a frame with ``docno``, ``doc_comp`` (``(P_x, d)``, one shape)
    and optionally ``doc_feat`` (1-D gate features, all documents or none)."""

    VECTOR = "doc_comp"
    OPTIONAL = "doc_feat"
    HINT = "MoLEncoder(model).doc_encoder() >> index.indexer()"

    def _arrays(self, shapes: dict, offset: int, docnos: list, comps: list, feats: list | None) -> dict[str, Any]:
        arr = self._stack(shapes, comps, "doc_comp", offset, docnos, 2, "component shapes")
        out = {"comps.f4": arr, "mean.f4": arr.astype(np.float64).mean(axis=1)}
        if feats is not None:
            out["feats.f4"] = self._stack(shapes, feats, "doc_feat", offset, docnos, 1, "doc_feat dimensions")
        return out

    def _meta(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        (px, dim), fdim = shapes["doc_comp"], shapes.get("doc_feat", (None,))[0]
        return {
            "num_components": int(px),
            "dim": int(dim),
            "feature_dim": None if fdim is None else int(fdim),
            "dtype": "float32",
            "files": {"comps.f4": "(doc_count, num_components, dim)", "mean.f4": "(doc_count, dim)"}
            | ({"feats.f4": "(doc_count, feature_dim)"} if fdim is not None else {}),
            "package_hint": "pyterrier-prob",
        }


def as_mol_index(index: Any) -> MoLIndex:
    """``index`` as a checked :class:`MoLIndex` (itself, or opened from a path); TypeError for anything else."""
    if isinstance(index, (MoLIndex, str, os.PathLike)):
        index = index if isinstance(index, MoLIndex) else MoLIndex(index)
        index._load_meta()
        return index
    raise TypeError(
        f"expected a pyterrier_prob.MoLIndex, got {type(index).__name__}: build one with "
        "MoLIndex(path).indexer().index(records with 'docno' and 'doc_comp') and open it with MoLIndex(path)"
    )
