"""The base of the index writers (:class:`~pyterrier_prob.index.DenseIndexer`, ``MoLIndexer``).

An index directory is written through :func:`pyterrier_prob.atomic.atomic_directory`: into a hidden sibling
directory, ``pt_meta.json`` last (flushed and fsynced), renamed into place only when complete; an existing index
(``mode="overwrite"``) is swapped out first and restored if the rename fails. On any error or interruption the
temporary directory is removed and the target is left as it was, so an interrupted run never leaves a directory
that loads. Replacing an index never leaves its path without a complete one (see :mod:`pyterrier_prob.atomic`).

It also holds the checks of index files against what ``pt_meta.json`` says (a JSON value that is not an object,
truncated files) and of docnos; the checks of input frames are in :mod:`pyterrier_prob.validation`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt

from pyterrier_prob.atomic import atomic_directory, atomic_write
from pyterrier_prob.validation import _missing

__all__ = ["AtomicIndexer", "IndexingMode"]


class IndexingMode(Enum):
    """What an index's ``indexer()`` does when the path already holds something."""

    create = "create"
    overwrite = "overwrite"


class AtomicIndexer(pt.Indexer):
    """Base of the indexers: subclasses write their files with :meth:`_write_files` and return ``pt_meta.json``."""

    def __init__(self, index: Any, mode: IndexingMode | str = IndexingMode.create) -> None:
        self._index = index
        self.mode = IndexingMode(mode)

    def _write_files(self, inp: Iterable[Mapping[str, Any]] | pd.DataFrame, tmp: Path) -> dict[str, Any]:
        """Write the index files into ``tmp``; return the metadata for ``pt_meta.json``."""
        raise NotImplementedError

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
            atomic_write(tmp / "pt_meta.json", json.dumps(meta))  # last: a directory without it never loads
            self._check_target()  # again: something may have appeared while we were indexing
        self._index._reset()
        return self._index


def missing_message(missing: list[str], have: Any, vector_column: str, hint: str) -> str:
    """The error for indexer input without ``docno`` or the vector column (with how to make the latter)."""
    extra = f" (encode the documents first: {hint})" if vector_column in missing else ""
    return f"indexer input lacks column(s) {missing}{extra}; got {have}"


# ---- index files ------------------------------------------------------------------------------------------------


def check_docnos(docnos: list, offset: int, seen: set[str]) -> None:
    """Docnos of records ``offset, offset + 1, ...``: str, no NUL character, not seen before (``seen`` grows)."""
    for i, docno in enumerate(docnos):
        if not isinstance(docno, str):
            what = "missing" if _missing(docno) else "not a str"
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


def read_meta(meta_path: Path) -> dict[str, Any]:
    """An index's ``pt_meta.json``, which must hold a JSON object; a ValueError naming the file otherwise."""
    try:
        with open(meta_path, encoding="utf8") as f:
            meta = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(meta_path)!r} is not valid JSON: the index is corrupt ({e})") from e
    if not isinstance(meta, dict):
        raise ValueError(
            f"{str(meta_path)!r} does not hold a JSON object (got {type(meta).__name__}): the index is corrupt"
        )
    return meta


def record_sizes(folder: Path) -> dict[str, int]:
    """The sizes of the files written so far into an index folder, for ``pt_meta.json`` (checked on loading)."""
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != "pt_meta.json"}


def check_sizes(path: Path, meta: Mapping[str, Any]) -> None:
    """The files whose sizes ``pt_meta.json`` records (``file_sizes``) have them; a ValueError naming the file."""
    sizes = meta.get("file_sizes")
    if not isinstance(sizes, Mapping):
        return
    for name, want in sizes.items():
        f = path / str(name)
        have = f.stat().st_size if f.is_file() else None
        if have != want:
            state = "is missing" if have is None else f"has {have} bytes, pt_meta.json records {want}"
            raise ValueError(f"{str(f)!r} {state}: the index is corrupt (truncated?); rebuild it")


def check_docno_store(lookup: Any, count: int, path: Path) -> None:
    """An opened docno store (``npids.Lookup``) holds ``count`` docnos and maps its first and last docno back to
    their rows; a ValueError naming the file otherwise (a truncated store fails here, not in a later search)."""
    try:
        n = len(lookup)
        rows = np.unique(np.array([0, count - 1], dtype=np.int64))
        if n == count:
            docnos = np.asarray(lookup.fwd[rows], dtype=object)
            back = np.asarray(lookup.inv[docnos], dtype=np.int64).reshape(-1)
    except Exception as e:  # npids reads past the end of a truncated file in many ways
        raise ValueError(f"{str(path)!r} is corrupt (truncated?): {type(e).__name__}: {e}") from e
    if n != count:
        raise ValueError(f"{str(path)!r} is corrupt: {n} docnos for {count} documents")
    if not np.array_equal(back, rows):
        raise ValueError(f"{str(path)!r} is corrupt (truncated?): its docnos do not map back to their rows")
