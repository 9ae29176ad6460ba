"""On-disk index of Mixture-of-Logits component embeddings (``shared/papers/mixture-of-logits.txt``, Sec. 3).

MoL scores a query q and an item x as ``phi(q, x) = sum_p pi_p(q, x) <f_pq(q), g_px(x)>`` over the
``P = P_q x P_x`` pairs of the query's P_q and the item's P_x component embeddings (Eqs. 1, 2, 5). What the
retrieval algorithms of Sec. 3 need from the item side is stored here, precomputed ("Can be preprocessed",
Algorithm 1 line 3 and Algorithm 2 lines 7 and 12):

* ``comps.f4``: every item's P_x component embeddings g_px(x), raw float32, shape ``(N, P_x, d)``, opened with
  ``np.memmap`` (:meth:`MoLIndex.components`);
* ``mean.f4``: their mean over components ``sum_px g_px(x) / P_x``, float32 ``(N, d)`` -- the item side of
  TopKAvg (Algorithm 2 line 12, Eq. 6; :meth:`MoLIndex.means`);
* ``feats.f4`` (optional): each document's gate features, float32 ``(N, F)``, for MoL gates that also read
  query- and item-side features (App. A.3; ``gate_features=True`` in :mod:`st_extensions.mol`), indexed from a
  ``doc_feat`` column (:meth:`MoLEncoder.doc_encoder <pyterrier_prob.MoLEncoder.doc_encoder>` adds it for such
  models);
* ``docnos.npids``: docnos, stored with npids exactly as pyterrier-dr's FlexIndex stores them;
* ``pt_meta.json``: ``type="mol_index"``, ``format="np"``, ``doc_count``, ``num_components`` (P_x), ``dim`` (d),
  ``feature_dim`` (F, or null).

Writing is atomic, as for :class:`~pyterrier_prob.DenseIndex`: everything goes to a hidden sibling directory,
``pt_meta.json`` last, and the directory is renamed into place only when complete, so an interrupted run never
leaves a loadable index. Inputs are checked (shapes, finiteness, duplicate docnos) and loading an incomplete,
corrupt or foreign directory raises a clear error. Vectors are stored as given (the MoL encoders of
:mod:`st_extensions.mol` already L2-normalise them, Eq. 2); they are not re-normalised here.

The per-component faiss indexes the retrievers search (:meth:`MoLIndex.faiss_component`,
:meth:`MoLIndex.faiss_mean`) are built on first use and cached on the object; each holds an in-memory copy of
its ``(N, d)`` slice (faiss' flat indexes own their vectors).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt
from npids import Lookup

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
from pyterrier_prob.index.search import Searcher, import_faiss
from pyterrier_prob.validation import stack_arrays

__all__ = ["MoLIndex", "MoLIndexer", "as_mol_index"]

_BATCH = 4096
_CHECK_ROWS = 16384  # documents per chunk of check_finite


class MoLIndex(pt.Artifact):
    """An index of MoL item component embeddings on disk (Sec. 3's item side, preprocessed).

    Build with ``encoder.doc_encoder() >> MoLIndex(path).indexer()`` (``.index(corpus_iter)``), or index
    precomputed ``{"docno", "doc_comp"}`` records (``doc_comp``: a ``(P_x, d)`` array) or a frame::

        index = MoLIndex("docs.mol")
        (encoder.doc_encoder() >> index.indexer()).index(dataset.get_corpus_iter())
        pipeline = encoder.query_encoder() >> index.retriever(encoder.mol, method="exact", num_results=10)

    Args:
        path: the index directory.
        verbose: progress bars while indexing.

    ``len(index)`` is the number of documents; :meth:`components` is a read-only float32 memmap of shape
    ``(len(index), num_components, dim)``; :meth:`docnos` is an ``npids.Lookup`` (``.fwd[docids]`` -> docnos,
    ``.inv[docnos]`` -> docids, -1 if absent).
    """

    ARTIFACT_TYPE = "mol_index"
    ARTIFACT_FORMAT = "np"

    def __init__(self, path: str | os.PathLike, *, verbose: bool = False) -> None:
        super().__init__(path)
        self.verbose = bool(verbose)
        self._reset()

    @property
    def index_path(self) -> Path:
        """The index directory."""
        return Path(self.path)

    def _reset(self) -> None:
        self._meta: dict[str, Any] | None = None
        self._comps: np.memmap | None = None
        self._means: np.memmap | None = None
        self._feats: np.memmap | None = None
        self._docnos: Lookup | None = None
        self._cache: dict[str, Any] = {}

    # ---- loading -----------------------------------------------------------------------------------------
    def _load_meta(self) -> dict[str, Any]:
        """Read and check ``pt_meta.json`` and the sizes of the files; a clear error when anything is off."""
        if self._meta is not None:
            return self._meta
        path = self.index_path
        recover_directory(path)  # a writer killed mid-swap: the previous version back; stale temporaries removed
        if not path.exists():
            raise FileNotFoundError(
                f"no MoL index at {str(path)!r}: build one with MoLIndex(path).indexer().index(records) "
                "(records with 'docno' and 'doc_comp', e.g. from MoLEncoder(model).doc_encoder())"
            )
        if not path.is_dir():
            raise ValueError(f"{str(path)!r} is a file, not a MoL index directory")
        meta_path = path / "pt_meta.json"
        if not meta_path.exists():
            raise ValueError(
                f"{str(path)!r} is not a complete MoL index (no pt_meta.json): an interrupted or foreign indexing "
                "run? Rebuild it with MoLIndex(path).indexer(mode='overwrite')"
            )
        meta = read_meta(meta_path)
        if meta.get("type") != self.ARTIFACT_TYPE or meta.get("format") != self.ARTIFACT_FORMAT:
            raise ValueError(
                f"{str(path)!r} holds an artifact of type={meta.get('type')!r}, format={meta.get('format')!r}, "
                f"not a MoL index (type={self.ARTIFACT_TYPE!r}, format={self.ARTIFACT_FORMAT!r})"
            )
        count, comps, dim = meta.get("doc_count"), meta.get("num_components"), meta.get("dim")
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (count, comps, dim)):
            raise ValueError(
                f"{str(meta_path)!r} has invalid doc_count={count!r} / num_components={comps!r} / dim={dim!r}"
            )
        fdim = meta.get("feature_dim")
        if fdim is not None and (isinstance(fdim, bool) or not isinstance(fdim, int) or fdim < 1):
            raise ValueError(f"{str(meta_path)!r} has invalid feature_dim={fdim!r}")
        files = [("comps.f4", (count, comps, dim)), ("mean.f4", (count, dim))]
        if fdim is not None:
            files.append(("feats.f4", (count, fdim)))
        for name, shape in files:
            f = path / name
            want = int(np.prod(shape)) * 4
            size = f.stat().st_size if f.exists() else None
            if size != want:
                raise ValueError(
                    f"{str(path)!r} is corrupt: {name} has {size} bytes, pt_meta.json says "
                    f"{' x '.join(map(str, shape))} float32 ({want} bytes)"
                )
        check_sizes(path, meta)  # files whose sizes the indexer recorded (docnos.npids): truncated ones
        if not (path / "docnos.npids").exists():
            raise ValueError(f"{str(path)!r} is corrupt: docnos.npids is missing")
        for name, shape in files:  # right size but nan/inf (zero-filled by a crash, overwritten): first, last rows
            mm = np.memmap(path / name, dtype=np.float32, mode="r", shape=shape)
            for i in sorted({0, count - 1}):
                if not np.isfinite(mm[i]).all():
                    raise ValueError(
                        f"{str(path / name)!r} is corrupt: row {i} has non-finite values (nan or inf); rebuild the "
                        "index with MoLIndex(path).indexer(mode='overwrite')"
                    )
            del mm
        self._meta = meta
        return meta

    def check_finite(self) -> None:
        """Raise ValueError naming the file and row if a stored component, mean or feature holds nan/inf.

        Reads the index once per opened index (in chunks; the answer is cached), as the retrievers and re-rankers
        do before their first search: a corrupt file of the right size would otherwise give nan scores.
        """
        if self._cache.get("finite"):
            return
        arrays = [("comps.f4", self.components()), ("mean.f4", self.means())]
        if self.features() is not None:
            arrays.append(("feats.f4", self.features()))
        for name, arr in arrays:
            for a in range(0, len(arr), _CHECK_ROWS):
                block = np.asarray(arr[a : a + _CHECK_ROWS])
                ok = np.isfinite(block.reshape(len(block), -1)).all(axis=1)
                if not ok.all():
                    i = a + int(np.flatnonzero(~ok)[0])
                    docno = str(self.docnos().fwd[i])
                    raise ValueError(
                        f"{str(self.index_path / name)!r} is corrupt: row {i} (docno {docno!r}) has "
                        "non-finite values (nan or inf); rebuild the index with "
                        "MoLIndex(path).indexer(mode='overwrite')"
                    )
        self._cache["finite"] = True

    @property
    def meta(self) -> dict[str, Any]:
        """The index's ``pt_meta.json``."""
        return dict(self._load_meta())

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
        if self._comps is None:
            meta = self._load_meta()
            shape = (meta["doc_count"], meta["num_components"], meta["dim"])
            self._comps = np.memmap(self.index_path / "comps.f4", dtype=np.float32, mode="r", shape=shape)
        return self._comps

    def means(self) -> np.memmap:
        """Each document's mean component embedding (TopKAvg's X', Algorithm 2 line 12): memmap ``(N, dim)``."""
        if self._means is None:
            meta = self._load_meta()
            shape = (meta["doc_count"], meta["dim"])
            self._means = np.memmap(self.index_path / "mean.f4", dtype=np.float32, mode="r", shape=shape)
        return self._means

    @property
    def feature_dim(self) -> int | None:
        """F, the dimension of the stored gate features (``None`` when the index holds none)."""
        fdim = self._load_meta().get("feature_dim")
        return None if fdim is None else int(fdim)

    def features(self) -> np.memmap | None:
        """Each document's gate features (App. A.3): memmap ``(N, feature_dim)``, or ``None`` if not indexed."""
        if self.feature_dim is None:
            return None
        if self._feats is None:
            shape = (len(self), self.feature_dim)
            self._feats = np.memmap(self.index_path / "feats.f4", dtype=np.float32, mode="r", shape=shape)
        return self._feats

    def docnos(self) -> Lookup:
        """The docno store (``npids.Lookup``, as pyterrier-dr's FlexIndex)."""
        if self._docnos is None:
            n = len(self)
            path = self.index_path / "docnos.npids"
            try:
                lookup = Lookup(path)
            except Exception as e:  # a truncated store fails in many ways inside npids
                raise ValueError(f"{str(path)!r} is corrupt (truncated?): {type(e).__name__}: {e}") from e
            check_docno_store(lookup, n, path)
            self._docnos = lookup
        return self._docnos

    def docno_array(self) -> np.ndarray:
        """All docnos, in index order, as an object array (cached)."""
        if "docnos" not in self._cache:
            self._cache["docnos"] = np.asarray(self.docnos().fwd[np.arange(len(self))], dtype=object)
        return self._cache["docnos"]

    def docids_of(self, docnos: Iterable[str]) -> np.ndarray:
        """Rows of the index of ``docnos`` (int64; -1 for docnos not in the index)."""
        arr = np.asarray(list(docnos) if not isinstance(docnos, np.ndarray) else docnos, dtype=str)
        if not arr.size:
            return np.zeros(0, np.int64)
        return np.asarray(self.docnos().inv[arr], dtype=np.int64).reshape(-1)

    # ---- faiss -------------------------------------------------------------------------------------------
    def faiss_component(self, px: int, gpu: bool = False) -> Any:
        """A faiss ``IndexFlatIP`` over component ``px`` of every document (cached; on GPU if ``gpu``)."""
        if not 0 <= px < self.num_components:
            raise IndexError(f"component {px} out of range: the index has {self.num_components} components")
        key = f"faiss_comp_{px}_{'gpu' if gpu else 'cpu'}"
        if key not in self._cache:
            if gpu:
                self._cache[key] = _to_gpu(self.faiss_component(px, gpu=False))
            else:
                comps = self.components()
                self._cache[key] = _flat_ip(lambda a, b: comps[a:b, px], len(self), self.dim)
        return self._cache[key]

    def faiss_mean(self, gpu: bool = False) -> Any:
        """A faiss ``IndexFlatIP`` over the documents' mean component embeddings (cached; on GPU if ``gpu``)."""
        key = f"faiss_mean_{'gpu' if gpu else 'cpu'}"
        if key not in self._cache:
            if gpu:
                self._cache[key] = _to_gpu(self.faiss_mean(gpu=False))
            else:
                means = self.means()
                self._cache[key] = _flat_ip(lambda a, b: means[a:b], len(self), self.dim)
        return self._cache[key]

    def searcher(self, part: int | str = "mean", backend: str = "exact", **params: Any) -> Searcher:
        """A :class:`~pyterrier_prob.index.search.Searcher` over component ``part`` of every document (an int) or
        over their means (``"mean"``, TopKAvg's X'): inner products, as Algorithms 1-2 search them.

        ``backend`` and ``params`` as :func:`~pyterrier_prob.index.search.make_searcher` (``"ivf_flat"``,
        ``nprobe=...``, ``"hnsw"``, ...); a faiss index is built once and cached in this folder
        (``faiss/<part>/``, written atomically) and in memory. :class:`~pyterrier_prob.MoLRetriever` takes
        ``searcher={"backend": ..., **params}`` to run its candidate stages on it (Sec. 4's ANN candidate retrieval).
        """
        from pyterrier_prob.index.search import SEARCH_PARAMS, make_searcher

        if part == "mean":
            vectors, name = self.means(), "mean"
        elif isinstance(part, (int, np.integer)) and not isinstance(part, bool) and 0 <= part < self.num_components:
            vectors, name = self.components()[:, int(part)], f"comp{int(part)}"
        else:
            raise ValueError(f"part must be 'mean' or a component in 0..{self.num_components - 1}, got {part!r}")
        search_params = {k: params.pop(k) for k in SEARCH_PARAMS if k in params}
        key = ("searcher", name, backend, tuple(sorted(params.items())))
        if key not in self._cache:
            self.check_finite()
            self._cache[key] = make_searcher(vectors, backend, cache_dir=self.index_path / "faiss" / name, **params)
        out = self._cache[key]
        return out.with_params(**search_params) if search_params else out

    # ---- factories ---------------------------------------------------------------------------------------
    def indexer(self, *, mode: IndexingMode | str = IndexingMode.create) -> MoLIndexer:
        """An indexer writing this index (``encoder.doc_encoder() >> index.indexer()``).

        Args:
            mode: ``"create"`` (error if the path exists) or ``"overwrite"`` (replace it, atomically).
        """
        return MoLIndexer(self, mode=mode)

    def index(self, inp: Iterable[Mapping[str, Any]] | pd.DataFrame) -> MoLIndex:
        """Index ``docno``/``doc_comp`` records (or a frame) into a new index at this path."""
        return self.indexer().index(inp)

    def __repr__(self) -> str:
        return f"MoLIndex({str(self.index_path)!r})"


def _flat_ip(rows: Any, n: int, dim: int) -> Any:
    faiss = import_faiss()

    index = faiss.IndexFlatIP(dim)
    for a in range(0, n, 65536):
        index.add(np.ascontiguousarray(rows(a, min(n, a + 65536)), dtype=np.float32))
    return index


def _to_gpu(index: Any) -> Any:  # pragma: no cover - needs faiss-gpu and a GPU
    faiss = import_faiss()

    return faiss.index_cpu_to_all_gpus(index)


class MoLIndexer(AtomicIndexer):
    """Writes a :class:`MoLIndex`; made by :meth:`MoLIndex.indexer`.

    Input: an iterable of records (dicts) or a DataFrame with ``docno`` (str) and ``doc_comp`` (a
    ``(P_x, d)`` float array, the same shape for every document), and optionally ``doc_feat`` (a 1-D float
    vector, the gate's document features; all documents or none). Everything is written into a hidden temporary
    directory next to the target and renamed into place only once complete; on any error (or interruption) the
    temporary directory is removed and the path is left as it was.
    """

    def __repr__(self) -> str:
        return f"{self._index!r}.indexer(mode={self.mode.value!r})"

    def index_inputs(self) -> list[list[str]]:
        return [["docno", "doc_comp"]]

    def _write_files(self, inp: Iterable[Mapping[str, Any]] | pd.DataFrame, tmp: Path) -> dict[str, Any]:
        count, shape, fdim = self._write(inp, tmp)
        return {
            "type": MoLIndex.ARTIFACT_TYPE,
            "format": MoLIndex.ARTIFACT_FORMAT,
            "doc_count": count,
            "num_components": shape[0],
            "dim": shape[1],
            "feature_dim": fdim,
            "dtype": "float32",
            "files": {"comps.f4": "(doc_count, num_components, dim)", "mean.f4": "(doc_count, dim)"}
            | ({"feats.f4": "(doc_count, feature_dim)"} if fdim is not None else {}),
            "file_sizes": record_sizes(tmp),
            "package_hint": "pyterrier-prob",
        }

    def _batches(self, inp: Iterable[Mapping[str, Any]] | pd.DataFrame) -> Iterator[tuple[list, list, list | None]]:
        if isinstance(inp, pd.DataFrame):
            missing = [c for c in ("docno", "doc_comp") if c not in inp.columns]
            if missing:
                raise ValueError(_missing_message(missing, list(inp.columns)))
            docnos, comps = inp["docno"].tolist(), inp["doc_comp"].tolist()
            feats = inp["doc_feat"].tolist() if "doc_feat" in inp.columns else None
            for i in range(0, len(docnos), _BATCH):
                yield docnos[i : i + _BATCH], comps[i : i + _BATCH], None if feats is None else feats[i : i + _BATCH]
            return
        if isinstance(inp, Mapping):
            raise TypeError("index() takes an iterable of records (dicts) or a DataFrame, not a single dict")
        docnos, comps, feats = [], [], []
        has_feat: bool | None = None
        for rec in inp:
            if not isinstance(rec, Mapping) or "docno" not in rec or "doc_comp" not in rec:
                cols = list(rec) if isinstance(rec, Mapping) else type(rec).__name__
                missing = [c for c in ("docno", "doc_comp") if not isinstance(rec, Mapping) or c not in rec]
                raise ValueError(_missing_message(missing, cols))
            if has_feat is None:
                has_feat = "doc_feat" in rec
            elif has_feat != ("doc_feat" in rec):
                raise ValueError(
                    f"the record with docno {rec.get('docno')!r} {'lacks' if has_feat else 'has'} doc_feat: give "
                    "gate features (doc_feat) for all documents or none"
                )
            docnos.append(rec["docno"])
            comps.append(rec["doc_comp"])
            if has_feat:
                feats.append(rec["doc_feat"])
            if len(docnos) >= _BATCH:
                yield docnos, comps, feats if has_feat else None
                docnos, comps, feats = [], [], []
        if docnos:
            yield docnos, comps, feats if has_feat else None

    def _write(
        self, inp: Iterable[Mapping[str, Any]] | pd.DataFrame, tmp: Path
    ) -> tuple[int, tuple[int, int], int | None]:
        shape: tuple[int, int] | None = None
        fdim: int | None = None
        ffeats = None
        count = 0
        seen: set[str] = set()
        bar = pt.tqdm(desc=f"indexing {self._index.index_path.name}", unit="doc") if self._index.verbose else None
        try:
            with ExitStack() as stack:
                fcomps = stack.enter_context(open(tmp / "comps.f4", "wb"))
                fmean = stack.enter_context(open(tmp / "mean.f4", "wb"))
                lookup = stack.enter_context(Lookup.builder(tmp / "docnos.npids"))
                for docnos, comps, feats in self._batches(inp):
                    check_docnos(docnos, count, seen)
                    arr, shape = _stack_components(comps, shape, count, docnos)
                    if (feats is not None) != (ffeats is not None) and count:
                        raise ValueError("give doc_feat (gate features) for all documents or none")
                    if feats is not None:
                        farr, fdim = _stack_features(feats, fdim, count, docnos)
                        if ffeats is None:
                            ffeats = stack.enter_context(open(tmp / "feats.f4", "wb"))
                        ffeats.write(np.ascontiguousarray(farr).tobytes())
                    for docno in docnos:
                        lookup.add(docno)
                    fcomps.write(np.ascontiguousarray(arr, dtype=np.float32).tobytes())
                    mean = arr.astype(np.float64).mean(axis=1).astype(np.float32)
                    fmean.write(np.ascontiguousarray(mean).tobytes())
                    count += len(docnos)
                    if bar is not None:
                        bar.update(len(docnos))
                if count == 0:
                    raise ValueError("nothing to index: the input had no records")
                if count == 1:  # npids' fixed-bytes codec divides by zero on a single docno
                    raise ValueError(
                        "a MoL index needs at least 2 documents (npids, FlexIndex's docno store, cannot hold one)"
                    )
                for f in (fcomps, fmean, ffeats):
                    if f is None:
                        continue
                    f.flush()
                    os.fsync(f.fileno())
        finally:
            if bar is not None:
                bar.close()
        assert shape is not None
        return count, shape, fdim


def _missing_message(missing: list[str], have: Any) -> str:
    return missing_message(missing, have, "doc_comp", "MoLEncoder(model).doc_encoder() >> index.indexer()")


def _stack_components(
    comps: list, shape: tuple[int, int] | None, offset: int, docnos: list
) -> tuple[np.ndarray, tuple[int, int]]:
    """Stack a batch of ``(P_x, d)`` arrays into float32 ``(n, P_x, d)``, checking type, shapes and finiteness."""

    def name(i: int) -> str:
        return f"record #{offset + i} (docno={docnos[i]!r})"

    arr = stack_arrays(comps, "doc_comp", name, "MoLIndexer", ndim=2, shape=shape, kind="component shapes")
    return arr, (int(arr.shape[1]), int(arr.shape[2]))


def _stack_features(feats: list, fdim: int | None, offset: int, docnos: list) -> tuple[np.ndarray, int]:
    """Stack a batch of 1-D gate feature vectors into float32 ``(n, F)``, checking type, shapes and finiteness."""

    def name(i: int) -> str:
        return f"record #{offset + i} (docno={docnos[i]!r})"

    shape = None if fdim is None else (fdim,)
    arr = stack_arrays(feats, "doc_feat", name, "MoLIndexer", ndim=1, shape=shape, kind="doc_feat dimensions")
    return arr, int(arr.shape[1])


def as_mol_index(index: Any) -> MoLIndex:
    """``index`` as a :class:`MoLIndex` (itself, or opened from a path), checking that it is one.

    Raises:
        TypeError: for anything else (e.g. a :class:`~pyterrier_prob.DenseIndex`).
        ValueError / FileNotFoundError: for a path that does not hold a complete MoL index.
    """
    if isinstance(index, MoLIndex):
        index._load_meta()
        return index
    if isinstance(index, (str, os.PathLike)):
        out = MoLIndex(index)
        out._load_meta()
        return out
    raise TypeError(
        f"expected a pyterrier_prob.MoLIndex, got {type(index).__name__}: build one with "
        "MoLIndex(path).indexer().index(records with 'docno' and 'doc_comp') and open it with MoLIndex(path)"
    )
