"""Atomic index writing shared by :class:`~pyterrier_prob.DenseIndexer` and :class:`~pyterrier_prob.MoLIndexer`.

An index directory is written into a hidden sibling directory, ``pt_meta.json`` last (flushed and fsynced), and
renamed into place only when complete; an existing index (``mode="overwrite"``) is swapped out first and restored
if the rename fails. On any error or interruption the temporary directory is removed and the target is left as it
was, so an interrupted run never leaves a directory that loads.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any

import pandas as pd
import pyterrier as pt

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
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:12]}"
        tmp.mkdir()
        try:
            meta = self._write_files(inp, tmp)
            with open(tmp / "pt_meta.json", "w") as f:
                json.dump(meta, f)
                f.flush()
                os.fsync(f.fileno())
            self._install(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._index._reset()
        return self._index

    def _install(self, tmp: Path, path: Path) -> None:
        """Move the finished index into place (atomic rename; an old index is swapped out first)."""
        self._check_target()  # again: something may have appeared while we were indexing
        if path.exists():
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:12]}"
            os.replace(path, old)
            try:
                os.replace(tmp, path)
            except BaseException:
                os.replace(old, path)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)


def missing_message(missing: list[str], have: Any, vector_column: str, hint: str) -> str:
    """The error for indexer input without ``docno`` or the vector column (with how to make the latter)."""
    extra = f" (encode the documents first: {hint})" if vector_column in missing else ""
    return f"indexer input lacks column(s) {missing}{extra}; got {have}"
