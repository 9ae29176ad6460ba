"""The HNSW graph backend (``hnsw``, faiss ``IndexHNSWFlat``): ``M`` links per node, ``ef_construction`` and
``ef_search`` beams; no GPU version. Every vector is added in one call: HNSW inserts an add's vectors level by level in
a shuffled order, and added in chunks its graph loses half its recall (``docs/scale.md``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from pyterrier_prob.index.backends.base import Backend, SearchSettings, register
from pyterrier_prob.validation import positive_int

__all__ = ["HNSW", "HNSWSettings"]


@dataclass(frozen=True)
class HNSWSettings(SearchSettings):
    """Build: ``M`` (32) and ``ef_construction`` (80). Search: ``ef_search`` (128; at least k)."""

    search_params: ClassVar[tuple[str, ...]] = (*SearchSettings.search_params, "ef_search")

    M: int = 32
    ef_construction: int = 80
    ef_search: int | None = None


class HNSW(Backend):
    """``IndexHNSWFlat`` over float32 vectors."""

    name, settings, gpu, add_batch = "hnsw", HNSWSettings, False, None

    def with_defaults(self, s: HNSWSettings, n: int, d: int) -> tuple[HNSWSettings, dict[str, Any]]:
        build = {"M": positive_int("M", s.M), "efc": positive_int("ef_construction", s.ef_construction)}
        return dataclasses.replace(s, ef_search=128 if s.ef_search is None else s.ef_search), build

    def graph(self, faiss: Any, d: int, s: HNSWSettings) -> Any:
        """The graph index (a subclass: another storage of the vectors)."""
        return faiss.IndexHNSWFlat(d, s.M, faiss.METRIC_INNER_PRODUCT)

    def create(self, faiss: Any, d: int, s: HNSWSettings) -> Any:
        index = self.graph(faiss, d, s)
        index.hnsw.efConstruction = s.ef_construction
        return index

    def check(self, s: HNSWSettings, has_vectors: bool) -> HNSWSettings:
        s = s.checked(self.lossy, has_vectors)
        return dataclasses.replace(s, ef_search=positive_int("ef_search", s.ef_search, allow_none=True))

    @staticmethod
    def ef(index: Any, s: HNSWSettings) -> int:
        return int(s.ef_search or index.hnsw.efSearch)

    def apply(self, index: Any, s: HNSWSettings, k: int) -> None:
        index.hnsw.efSearch = max(self.ef(index, s), k)

    def describe(self, index: Any, s: HNSWSettings) -> list[str]:
        return [f"ef_search={self.ef(index, s)}"]


register(HNSW())
