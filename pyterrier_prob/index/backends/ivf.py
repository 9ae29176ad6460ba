"""Inverted-file faiss backends (``ivf_flat``, ``ivf_fp16``, ``ivf_sq8``, ``ivf_pq``): the documents in ``nlist``
lists around k-means centroids, ``nprobe`` lists searched; with ``probe_margin`` a range search probes, per query,
every list whose centroid scores at least ``t_q - probe_margin`` (``docs/scale.md``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from pyterrier_prob.index.backends.base import Backend, SearchSettings, own_quantizer, register
from pyterrier_prob.validation import finite_float, positive_int

__all__ = ["IVF", "IVFSettings"]


@dataclass(frozen=True)
class IVFSettings(SearchSettings):
    """Build: ``nlist`` (default 4·√n as a power of two, at most n / 39), ``train_size`` (max(64·nlist, 65,536), at
    most n), ``pq_m`` (``ivf_pq``: dim / 8 sub-quantisers of 8 bits; must divide dim). Search: ``nprobe`` (nlist /
    16) and ``probe_margin`` (None: ``nprobe`` lists for every query)."""

    search_params: ClassVar[tuple[str, ...]] = (*SearchSettings.search_params, "nprobe", "probe_margin")

    nlist: int | None = None
    train_size: int | None = None
    pq_m: int | None = None
    nprobe: int | None = None
    probe_margin: float | None = None


class IVF(Backend):
    """One IVF index type; ``codes``: ``flat``, ``fp16``, ``sq8`` or ``pq``."""

    settings = IVFSettings

    def __init__(self, codes: str) -> None:
        self.codes, self.name, self.lossy = codes, f"ivf_{codes}", codes != "flat"

    def with_defaults(self, s: IVFSettings, n: int, d: int) -> tuple[IVFSettings, dict[str, Any]]:
        auto = max(1, min(1 << max(2, round(math.log2(4 * math.sqrt(n)))), n // 39))
        nlist = positive_int("nlist", auto if s.nlist is None else s.nlist)
        if nlist > n:
            raise ValueError(f"nlist={nlist} exceeds the {n} vectors")
        train = min(n, positive_int("train_size", s.train_size or max(64 * nlist, 65536)))
        pq_m = positive_int("pq_m", s.pq_m or max(1, d // 8)) if self.codes == "pq" else None
        nprobe = s.nprobe if s.nprobe is not None else max(1, nlist // 16)
        s = dataclasses.replace(s, nlist=nlist, train_size=train, pq_m=pq_m, nprobe=nprobe)
        return s, {"nlist": nlist, "train": train, "seed": s.seed, "m": pq_m}

    def create(self, faiss: Any, d: int, s: IVFSettings) -> Any:
        metric, quantizer = faiss.METRIC_INNER_PRODUCT, faiss.IndexFlatIP(d)
        if self.codes == "flat":
            index = faiss.IndexIVFFlat(quantizer, d, s.nlist, metric)
        elif self.codes == "pq":
            if d % s.pq_m:
                raise ValueError(f"pq_m={s.pq_m} must divide the dimension {d}")
            index = faiss.IndexIVFPQ(quantizer, d, s.nlist, s.pq_m, 8, metric)
        else:
            qtype = {"fp16": faiss.ScalarQuantizer.QT_fp16, "sq8": faiss.ScalarQuantizer.QT_8bit}[self.codes]
            index = faiss.IndexIVFScalarQuantizer(quantizer, d, s.nlist, qtype, metric)
        return own_quantizer(index, quantizer)

    def check(self, s: IVFSettings, has_vectors: bool) -> IVFSettings:
        s = s.checked(self.lossy, has_vectors)
        return dataclasses.replace(
            s,
            nprobe=positive_int("nprobe", s.nprobe, allow_none=True),
            probe_margin=finite_float("probe_margin", s.probe_margin, allow_none=True),
        )

    @staticmethod
    def nprobe(index: Any, s: IVFSettings) -> int:
        return int(s.nprobe or index.nprobe)

    def apply(self, index: Any, s: IVFSettings, k: int) -> None:
        index.nprobe = self.nprobe(index, s)

    def describe(self, index: Any, s: IVFSettings) -> list[str]:
        margin = [f"probe_margin={s.probe_margin:g}"] if s.probe_margin is not None else []
        return [f"nprobe={self.nprobe(index, s)}", *margin]

    def range_pairs(self, searcher: Any, Q: np.ndarray, t: np.ndarray, radius: np.ndarray) -> list | None:
        """With ``probe_margin``: per query, every list whose centroid scores ``>= t_q - probe_margin`` (at least
        ``nprobe``) searched by ``range_search_preassigned``; the lists probed land in ``searcher.last_probes``."""
        s, index = searcher.settings, searcher.cpu_index
        if s.probe_margin is None:
            return None
        nlist = int(index.nlist)
        Dc, Ic = index.quantizer.search(Q, nlist)
        need = np.maximum((Dc >= (t - s.probe_margin)[:, None]).sum(axis=1), min(self.nprobe(index, s), nlist))
        saved_nprobe, saved_mode = index.nprobe, index.parallel_mode
        index.parallel_mode = 1  # one query at a time: faiss' threads share its lists
        parts = []
        try:
            for i in range(Q.shape[0]):
                index.nprobe = int(need[i])
                _, D, ids = index.range_search_preassigned(
                    Q[i : i + 1], float(radius[i]), Ic[i : i + 1, : need[i]], Dc[i : i + 1, : need[i]]
                )
                parts.append((D, ids))
        finally:
            index.nprobe, index.parallel_mode = saved_nprobe, saved_mode
        searcher.last_probes = need
        return parts


for _codes in ("flat", "fp16", "sq8", "pq"):
    register(IVF(_codes))
