"""Flat faiss backends: every document scored, from float32 vectors (``flat``) or fp16 codes (``flat_fp16``)."""

from __future__ import annotations

from typing import Any

from pyterrier_prob.index.backends.base import Backend, SearchSettings, register

__all__ = ["Flat", "FlatFP16"]


class Flat(Backend):
    """``IndexFlatIP``: the exact scan in faiss (GPU version: ``gpu_flat``)."""

    name = "flat"

    def create(self, faiss: Any, d: int, s: SearchSettings) -> Any:
        return faiss.IndexFlatIP(d)


class FlatFP16(Backend):
    """``IndexScalarQuantizer`` with fp16 codes: half the memory, re-scored from the exact vectors by default."""

    name, lossy = "flat_fp16", True

    def create(self, faiss: Any, d: int, s: SearchSettings) -> Any:
        return faiss.IndexScalarQuantizer(d, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)


register(Flat())
register(FlatFP16())
