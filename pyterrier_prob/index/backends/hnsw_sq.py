"""HNSW over 8-bit scalar-quantised codes (``hnsw_sq8``, faiss ``IndexHNSWSQ``): the graph of ``hnsw`` with a quarter
of its vector memory; the codes are lossy, so candidates are re-scored from the exact vectors by default."""

from __future__ import annotations

from typing import Any

from pyterrier_prob.index.backends.base import register
from pyterrier_prob.index.backends.hnsw import HNSW, HNSWSettings

__all__ = ["HNSWSQ8"]


class HNSWSQ8(HNSW):
    """``IndexHNSWSQ`` with ``QT_8bit`` codes (trained on the vectors' per-dimension ranges)."""

    name, lossy = "hnsw_sq8", True

    def graph(self, faiss: Any, d: int, s: HNSWSettings) -> Any:
        return faiss.IndexHNSWSQ(d, faiss.ScalarQuantizer.QT_8bit, s.M, faiss.METRIC_INNER_PRODUCT)


register(HNSWSQ8())
