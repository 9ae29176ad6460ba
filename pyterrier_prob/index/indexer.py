"""The base of the index writers (:class:`~pyterrier_prob.index.DenseIndexer`, ``MoLIndexer``).

An index directory is written through :func:`pyterrier_prob.atomic.atomic_directory`: into a hidden sibling
directory, ``pt_meta.json`` last (flushed and fsynced), renamed into place only when complete; an existing index
(``mode="overwrite"``) is swapped out first and restored if the rename fails. On any error or interruption the
temporary directory is removed and the target is left as it was, so an interrupted run never leaves a directory
that loads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any

import pandas as pd
import pyterrier as pt

from pyterrier_prob.atomic import atomic_directory, atomic_write

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
