"""BM25 from PISA as the experiments use it: its native log kept off the console and its rows in one fixed order
(:class:`OrderedBM25`), so that two runs over one index give the same frame row for row."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt

from pyterrier_prob.console import native_output_to

__all__ = ["OrderedBM25", "in_query_order"]


def in_query_order(run: pd.DataFrame, queries: pd.DataFrame) -> pd.DataFrame:
    """``run`` with its queries in the order of ``queries`` and each query's rows by ``rank`` (a stable sort; a qid
    not in ``queries`` goes last, in the order it came).

    PISA's multi-threaded batch retrieval writes each query's results where the thread that ran it finishes, so the
    same index and queries give the same lists in another row order from one call to the next. Every figure summed
    over rows in their order -- a Platt fit, an ECE, a mean over queries -- then differs in its last bits between a
    run and a rerun that reuses its index."""
    if run.empty:
        return run.reset_index(drop=True)
    position = {q: i for i, q in reversed(list(enumerate(queries["qid"])))}  # a repeated qid: its first place
    where = run["qid"].map(position).fillna(len(position)).to_numpy(np.int64)
    order = np.lexsort((run["rank"].to_numpy(), where))
    return run.iloc[order].reset_index(drop=True)


class OrderedBM25(pt.Transformer):
    """A PISA retriever (``inner``: e.g. ``PisaIndex.bm25(num_results=k)``) whose native output goes to the file
    ``log`` while it runs (PISA prints on fds 1 and 2) and whose result comes :func:`in_query_order`."""

    def __init__(self, inner: Any, log: str) -> None:
        self.inner, self.log = inner, log

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        with native_output_to(self.log, fds=(1, 2)):
            out = self.inner.transform(inp)
        return in_query_order(out, inp)

    def __repr__(self) -> str:
        return repr(self.inner)
