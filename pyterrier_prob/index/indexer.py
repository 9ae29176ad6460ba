"""The base of the on-disk indexes (:class:`IndexArtifact`) and of their writers (:class:`AtomicIndexer`).

An index directory is written through :func:`pyterrier_prob.atomic.atomic_directory` (``pt_meta.json`` last, renamed
into place only when complete); loading checks the files against ``pt_meta.json`` (type, sizes, the docno store,
non-finite rows) and raises a clear error naming the file."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt
from npids import Lookup

from pyterrier_prob.atomic import atomic_directory, atomic_write, recover_directory
from pyterrier_prob.validation import is_int, is_missing, stack_arrays

__all__ = ["AtomicIndexer", "IndexArtifact", "IndexingMode"]

_BATCH = 4096  # records per batch of an indexer
_CHECK_ROWS = 16384  # rows per chunk of check_finite


class IndexingMode(Enum):
    """What an index's ``indexer()`` does when the path already holds something."""

    create = "create"
    overwrite = "overwrite"


class IndexArtifact:
    """What DenseIndex and MoLIndex share: checking a directory against ``pt_meta.json``, opening its docno store,
    scanning its float32 files (:meth:`_arrays`) for nan/inf; a subclass sets the class attributes below."""

    ARTIFACT_TYPE: str
    ARTIFACT_FORMAT: str
    KIND: str  # "dense", "MoL"
    RECORDS: str  # what to index, for the error on a missing path
    META_INTS: tuple[str, ...]
    ROW = "row"  # how the errors name a row of the arrays ("the vector of row" for a dense index)
    index_path: Path
    _meta: dict[str, Any] | None
    _cache: dict[Any, Any]

    def _arrays(self, meta: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
        """The float32 files of the index and their shapes."""
        raise NotImplementedError

    def _reset(self) -> None:
        """Forget what was read from disk (after indexing: the next use re-opens and re-checks the index)."""
        self._meta, self._docnos, self._dvecs, self._cache = None, None, None, {}

    def _load_meta(self) -> dict[str, Any]:
        """``pt_meta.json``, checked with the files on first use (a clear error when anything is off)."""
        if self._meta is None:
            self._meta = self._open_meta()
        return self._meta

    @property
    def meta(self) -> dict[str, Any]:
        """The index's ``pt_meta.json``."""
        return dict(self._load_meta())

    def index(self, inp: Iterable[Mapping[str, Any]] | pd.DataFrame) -> Any:
        """Index records (or a frame) into a new index at this path."""
        return self.indexer().index(inp)  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.index_path)!r})"

    def _rebuild(self) -> str:
        return f"rebuild the index with {type(self).__name__}(path).indexer(mode='overwrite')"

    def _open_meta(self) -> dict[str, Any]:
        """Read and check ``pt_meta.json`` and the files; a clear error when anything is off."""
        path, name = self.index_path, type(self).__name__
        recover_directory(path)  # a writer killed mid-swap: the previous version back; stale temporaries removed
        if not path.exists():
            raise FileNotFoundError(
                f"no {self.KIND} index at {str(path)!r}: build one with {name}(path).indexer().index(records) "
                f"(records with {self.RECORDS})"
            )
        if not path.is_dir():
            raise ValueError(f"{str(path)!r} is a file, not a {self.KIND} index directory")
        meta_path = path / "pt_meta.json"
        if not meta_path.exists():
            raise ValueError(
                f"{str(path)!r} is not a complete {self.KIND} index (no pt_meta.json): an interrupted or foreign "
                f"indexing run? Rebuild it with {name}(path).indexer(mode='overwrite')"
            )
        try:
            meta = json.loads(meta_path.read_text(encoding="utf8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(
                f"{str(meta_path)!r} is not valid JSON: the index is corrupt ({e}); {self._rebuild()}"
            ) from e
        if not isinstance(meta, dict):
            raise ValueError(
                f"{str(meta_path)!r} does not hold a JSON object (got {type(meta).__name__}): the index is corrupt"
            )
        if (meta.get("type"), meta.get("format")) != (self.ARTIFACT_TYPE, self.ARTIFACT_FORMAT):
            raise ValueError(
                f"{str(path)!r} holds an artifact of type={meta.get('type')!r}, format={meta.get('format')!r}, not a "
                f"{self.KIND} index (type={self.ARTIFACT_TYPE!r}, format={self.ARTIFACT_FORMAT!r})"
            )
        if not all(is_int(meta.get(k)) and meta[k] > 0 for k in self.META_INTS):
            raise ValueError(
                f"{str(meta_path)!r} has invalid " + " / ".join(f"{k}={meta.get(k)!r}" for k in self.META_INTS)
            )
        self._check_files(meta)
        return meta

    def _check_files(self, meta: dict[str, Any]) -> None:
        """The files have the sizes ``pt_meta.json`` gives them and finite first and last rows."""
        path, arrays = self.index_path, self._arrays(meta)
        for file, shape in arrays:
            f, want = path / file, int(np.prod(shape)) * 4
            size = f.stat().st_size if f.exists() else None
            if size != want:
                raise ValueError(
                    f"{str(path)!r} is corrupt: {file} has {size} bytes, pt_meta.json says "
                    f"{' x '.join(map(str, shape))} float32 ({want} bytes); " + self._rebuild()
                )
        sizes = meta.get("file_sizes")  # the sizes the indexer recorded: truncated files (docnos.npids)
        for file, want in sizes.items() if isinstance(sizes, Mapping) else ():
            f = path / str(file)
            have = f.stat().st_size if f.is_file() else None
            if have != want:
                state = "is missing" if have is None else f"has {have} bytes, pt_meta.json records {want}"
                raise ValueError(f"{str(f)!r} {state}: the index is corrupt (truncated?); rebuild it")
        if not (path / "docnos.npids").exists():
            raise ValueError(f"{str(path)!r} is corrupt: docnos.npids is missing")
        for file, shape in arrays:  # right size but nan/inf (zero-filled by a crash, overwritten): first, last rows
            ends = np.memmap(path / file, dtype=np.float32, mode="r", shape=shape)[[0, -1]]  # a copy: the map closes
            for i, row in zip((0, shape[0] - 1), ends):
                if not np.isfinite(row).all():
                    raise ValueError(
                        f"{str(path / file)!r} is corrupt: {self.ROW} {i} has non-finite values (nan or inf); "
                        + self._rebuild()
                    )

    def _open_docnos(self, count: int) -> Lookup:
        """The docno store (``npids.Lookup``, as pyterrier-dr's FlexIndex), checked to hold ``count`` docnos."""
        store = self.index_path / "docnos.npids"
        try:  # a truncated store fails in many ways inside npids: here, not in a later search
            lookup = Lookup(store)
            n, rows = len(lookup), np.unique(np.array([0, count - 1], dtype=np.int64))
            if n == count:  # the first and last docno map back to their rows
                back = np.asarray(lookup.inv[np.asarray(lookup.fwd[rows], dtype=str)], dtype=np.int64).reshape(-1)
        except Exception as e:
            raise ValueError(f"{str(store)!r} is corrupt (truncated?): {type(e).__name__}: {e}") from e
        if n != count:
            raise ValueError(f"{str(store)!r} is corrupt: {n} docnos for {count} documents")
        if not np.array_equal(back, rows):
            raise ValueError(f"{str(store)!r} is corrupt (truncated?): its docnos do not map back to their rows")
        return lookup

    def docno_array(self) -> np.ndarray:
        """All docnos, in index order, as an object array (read once per opened index)."""
        if "pyterrier_prob.docnos" not in self._cache:
            docnos = self.docnos().fwd[np.arange(len(self))]  # type: ignore[attr-defined]
            self._cache["pyterrier_prob.docnos"] = np.asarray(docnos, dtype=object)
        return self._cache["pyterrier_prob.docnos"]

    def docids_of(self, docnos: Iterable[str]) -> np.ndarray:
        """Rows of the index of ``docnos`` (int64; -1 for docnos not in the index)."""
        arr = np.asarray(docnos if isinstance(docnos, np.ndarray) else list(docnos), dtype=str)
        return np.asarray(self.docnos().inv[arr], dtype=np.int64).reshape(-1) if arr.size else np.zeros(0, np.int64)

    def candidate_docids(self, docnos: Any, hint: str) -> np.ndarray:
        """The rows of candidates' ``docnos``; a ValueError ending in ``hint`` when some are not in the index."""
        docids = self.docids_of(np.asarray(docnos, dtype=str))
        if (docids < 0).any():
            raise ValueError(
                f"{int((docids < 0).sum())} candidate docno(s) are not in {self!r} (e.g. "
                f"{np.asarray(docnos)[docids < 0][:3].tolist()}): {hint}"
            )
        return docids

    def _check_finite(self, arrays: Iterable[tuple[str, np.ndarray]]) -> None:
        """Raise ValueError naming the file, row and docno if a row of ``arrays`` holds nan/inf (once per opened
        index, before the first search: a corrupt file would otherwise match nothing or give nan scores)."""
        if self._cache.get("pyterrier_prob.finite"):
            return
        for file, arr in arrays:
            for a in range(0, len(arr), _CHECK_ROWS):
                block = np.asarray(arr[a : a + _CHECK_ROWS])
                ok = np.isfinite(block.reshape(len(block), -1)).all(axis=1)
                if not ok.all():
                    i = a + int(np.flatnonzero(~ok)[0])
                    raise ValueError(
                        f"{str(self.index_path / file)!r} is corrupt: {self.ROW} {i} (docno "
                        f"{str(self.docnos().fwd[i])!r}) has non-finite values (nan or inf); " + self._rebuild()
                    )
        self._cache["pyterrier_prob.finite"] = True


class AtomicIndexer(pt.Indexer):
    """Base of the indexers: input records or a frame with ``docno``, :attr:`VECTOR` and optionally
    :attr:`OPTIONAL` (all or none), read by :meth:`_batches`; :meth:`_write_files` writes and returns the meta."""

    VECTOR: str
    OPTIONAL: str | None = None
    HINT: str  # how to make the vector column

    def __init__(self, index: Any, mode: IndexingMode | str = IndexingMode.create) -> None:
        self._index = index
        self.mode = IndexingMode(mode)

    def __repr__(self) -> str:
        return f"{self._index!r}.indexer(mode={self.mode.value!r})"

    def index_inputs(self) -> list[list[str]]:
        return [["docno", self.VECTOR]]

    def _arrays(self, shapes: dict, offset: int, docnos: list, vecs: list, extra: list | None) -> dict[str, Any]:
        """The rows of a batch (records ``offset, ...``) for each float32 file of the index (:meth:`_stack` them)."""
        raise NotImplementedError

    def _meta(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        """The index-specific metadata for ``pt_meta.json`` of documents whose columns have ``shapes``."""
        raise NotImplementedError

    def _write_files(self, inp: Iterable[Mapping[str, Any]] | pd.DataFrame, tmp: Path) -> dict[str, Any]:
        """Write the docno store and the float32 files of :meth:`_arrays` into ``tmp``; return the metadata."""
        shapes: dict[str, tuple[int, ...]] = {}
        with ExitStack() as stack:
            files: dict[str, Any] = {}
            for offset, docnos, vecs, extra in self._records(inp, tmp):
                for file, arr in self._arrays(shapes, offset, docnos, vecs, extra).items():
                    if file not in files:
                        files[file] = stack.enter_context(open(tmp / file, "wb"))
                    files[file].write(np.ascontiguousarray(arr, dtype=np.float32).tobytes())
                total = offset + len(docnos)
            for f in files.values():
                f.flush()
                os.fsync(f.fileno())
        idx = self._index
        return {"type": idx.ARTIFACT_TYPE, "format": idx.ARTIFACT_FORMAT, "doc_count": total, **self._meta(shapes)}

    def _check_target(self) -> None:
        path = self._index.index_path
        if path.exists() and self.mode == IndexingMode.create:
            raise FileExistsError(
                f"{str(path)!r} already exists; use {type(self._index).__name__}(path).indexer(mode='overwrite') "
                "to replace it"
            )

    def index(self, inp: Iterable[Mapping[str, Any]] | pd.DataFrame) -> Any:
        """Consume the records and write the index; returns the (re-opened) index."""
        path = self._index.index_path
        self._check_target()
        with atomic_directory(path, overwrite=self.mode == IndexingMode.overwrite) as tmp:
            meta = self._write_files(inp, tmp)
            # the files' sizes, checked on loading (a truncated docno store loads, then fails in a search)
            meta["file_sizes"] = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
            atomic_write(tmp / "pt_meta.json", json.dumps(meta))  # last: a directory without it never loads
            self._check_target()  # again: something may have appeared while we were indexing
        self._index._reset()
        return self._index

    def _missing(self, missing: list[str], have: Any) -> ValueError:
        """The error for input without ``docno`` or the vector column (with how to make the latter)."""
        extra = f" (encode the documents first: {self.HINT})" if self.VECTOR in missing else ""
        return ValueError(f"indexer input lacks column(s) {missing}{extra}; got {have}")

    def _batches(self, inp: Iterable[Mapping[str, Any]] | pd.DataFrame) -> Iterator[tuple[list, list, list | None]]:
        """``(docnos, vectors, optional column or None)`` per batch of :data:`_BATCH` records."""
        need, opt = ("docno", self.VECTOR), self.OPTIONAL
        if isinstance(inp, pd.DataFrame):  # its rows as records
            if missing := [c for c in need if c not in inp.columns]:
                raise self._missing(missing, list(inp.columns))
            cols = [c for c in (*need, opt) if c is not None and c in inp.columns]
            inp = (dict(zip(cols, row)) for row in zip(*(inp[c].tolist() for c in cols)))
        elif isinstance(inp, Mapping):
            raise TypeError("index() takes an iterable of records (dicts) or a DataFrame, not a single dict")
        docnos, vecs, extra = [], [], []
        has_opt: bool | None = None
        for rec in inp:
            if not isinstance(rec, Mapping) or any(c not in rec for c in need):
                have = list(rec) if isinstance(rec, Mapping) else type(rec).__name__
                raise self._missing([c for c in need if not isinstance(rec, Mapping) or c not in rec], have)
            if opt is not None and has_opt is None:
                has_opt = opt in rec
            elif opt is not None and has_opt != (opt in rec):
                raise ValueError(
                    f"the record with docno {rec.get('docno')!r} {'lacks' if has_opt else 'has'} {opt}: give "
                    f"gate features ({opt}) for all documents or none"
                )
            docnos.append(rec["docno"])
            vecs.append(rec[self.VECTOR])
            if has_opt:
                extra.append(rec[opt])
            if len(docnos) >= _BATCH:
                yield docnos, vecs, extra if has_opt else None
                docnos, vecs, extra = [], [], []
        if docnos:
            yield docnos, vecs, extra if has_opt else None

    def _records(
        self, inp: Iterable[Mapping[str, Any]] | pd.DataFrame, tmp: Path
    ) -> Iterator[tuple[int, list, list, list | None]]:
        """``(offset, docnos, vectors, optional or None)`` per batch, the docnos checked and written to the docno
        store; after the last batch, at least two documents (npids' limit)."""
        count, seen = 0, set()
        verbose, name = self._index.verbose, self._index.index_path.name
        with (
            Lookup.builder(tmp / "docnos.npids") as lookup,
            pt.tqdm(desc=f"indexing {name}", unit="doc", disable=not verbose) as bar,
        ):
            for docnos, vecs, extra in self._batches(inp):
                check_docnos(docnos, count, seen)
                yield count, docnos, vecs, extra
                for docno in docnos:
                    lookup.add(docno)
                count += len(docnos)
                bar.update(len(docnos))
            if count == 0:
                raise ValueError("nothing to index: the input had no records")
            if count == 1:  # npids' fixed-bytes codec divides by zero on a single docno
                raise ValueError(
                    f"a {self._index.KIND} index needs at least 2 documents (npids, FlexIndex's docno store, cannot "
                    "hold one)"
                )

    def _stack(self, shapes: dict, values: list, column: str, offset: int, docnos: list, ndim: int, kind: str) -> Any:
        """A batch of ``ndim``-d arrays of ``column`` stacked into checked float32 ``(n, *shape)``, ``shape`` that of
        the first batch (kept in ``shapes``); errors name the record and its docno."""

        def name(i: int) -> str:
            return f"record #{offset + i} (docno={docnos[i]!r})"

        arr = stack_arrays(values, column, name, type(self).__name__, ndim=ndim, shape=shapes.get(column), kind=kind)
        shapes[column] = arr.shape[1:]
        return arr


# ---- index files ------------------------------------------------------------------------------------------------


def check_docnos(docnos: list, offset: int, seen: set[str]) -> None:
    """Docnos of records ``offset, offset + 1, ...``: str, no NUL character, not seen before (``seen`` grows)."""
    for i, docno in enumerate(docnos):
        if not isinstance(docno, str):
            what = "missing" if is_missing(docno) else "not a str"
            raise ValueError(
                f"docno must be a str: docno of record #{offset + i} is {what} ({docno!r}, {type(docno).__name__})"
            )
        if "\x00" in docno:
            raise ValueError(
                f"docno of record #{offset + i} ({docno!r}) contains a NUL character, which the docno store (npids) "
                "cannot keep apart ('d1' and 'd1\\x00' would be one docno): remove it"
            )
        if docno in seen:
            raise ValueError(f"duplicate docno {docno!r} (record #{offset + i}): docnos must be unique in an index")
        seen.add(docno)
