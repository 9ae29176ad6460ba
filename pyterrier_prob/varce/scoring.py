"""Scoring (query, document) pairs with several re-rankers, each distinct pair once per re-ranker (docs/varce.md):
:class:`PairScorer` keeps one re-ranker's E[s] (Eq. 22) and std[s] (Eq. 23) in memory and in a score file;
:class:`SharedLayers` scores partial-recipe re-rankers in one pass through their shared lower layers."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import pandas as pd

from pyterrier_prob.atomic import atomic_write
from pyterrier_prob.varce.distill import score_pairs
from pyterrier_prob.varce.rerank import VarCrossEncoderReranker
from st_extensions.cross_encoder import VarCrossEncoder, predict_sharing_layers
from st_extensions.partial import check_partial_transformer, state_fingerprint

__all__ = ["SCORE_CHUNK", "PairScorer", "SharedLayers", "unscored"]

SCORE_CHUNK = 256  # pairs per progress-bar step


def _no_bar(iterable: Iterable[Any], desc: str, total: int | None = None, unit: str = "it") -> Iterable[Any]:
    return iterable


class PairScorer:
    """Scores (query, document) pairs with one re-ranker, each distinct (collection, query, docno) once: E[s] and std[s]
    (Eq. 22-23) of a VarCrossEncoder, logits (std NaN) of another CrossEncoder. ``cache_path``: a TSV of the scores,
    read back when its first line holds the same ``fingerprint`` (``fresh``: started afresh); ``progress``: ``(iterable,
    desc, total, unit) -> iterable``."""

    def __init__(
        self,
        name: str,
        model: Any,
        batch_size: int = 32,
        cache_path: str | None = None,
        fingerprint: str | None = None,
        fresh: bool = False,
        progress: Callable[..., Any] | None = None,
    ) -> None:
        self.name, self.model, self.batch_size = name, model, int(batch_size)
        self.var = isinstance(model, VarCrossEncoder)
        self._reranker = VarCrossEncoderReranker(model, batch_size=self.batch_size, verbose=False) if self.var else None
        self.cache: dict[tuple[str, str, str], tuple[float, float]] = {}
        self.seconds, self.pairs, self.loaded = 0.0, 0, 0
        self.progress = progress or _no_bar
        self.cache_path = cache_path if fingerprint is not None else None
        self.fingerprint = fingerprint
        if self.cache_path is not None:
            self._open_cache(fresh)

    def _open_cache(self, fresh: bool) -> None:
        head, lines = f"# {self.fingerprint}\n", []
        if not fresh and os.path.isfile(self.cache_path):
            with open(self.cache_path, encoding="utf8") as f:
                lines = f.readlines() if f.readline() == head else []  # another fingerprint: start afresh
        whole = [line for line in lines if line.endswith("\n")]  # a kill mid-append cuts the last line
        for parts in (line.rstrip("\n").split("\t") for line in whole):
            if len(parts) == 5:
                self.cache[(parts[0], parts[1], parts[2])] = (float(parts[3]), float(parts[4]))
        self.loaded = len(self.cache)
        if not lines or len(whole) < len(lines):  # a new file, or appends must not continue a cut line
            atomic_write(self.cache_path, head + "".join(whole))

    def info(self) -> dict[str, Any]:
        """What this scorer did in the run: pairs scored (their seconds, pairs/s) and pairs read from earlier runs."""
        rate = round(self.pairs / self.seconds, 1) if self.seconds else None
        return {
            "pairs_scored": self.pairs,
            "pairs_from_earlier_runs": self.loaded,
            "seconds": round(self.seconds, 1),
            "pairs_per_s": rate,
        }

    def add(self, collection: str, scored: Iterable[tuple[str, str, float, float]], seconds: float = 0.0) -> None:
        """Record ``(query, docno, E[s], std[s])`` scores computed elsewhere (e.g. by :class:`SharedLayers`),
        appending them to the score file."""
        lines = []
        for q, d, m, sd in scored:
            self.cache[(collection, q, d)] = (float(m), float(sd))
            lines.append(f"{collection}\t{q}\t{d}\t{float(m)!r}\t{float(sd)!r}\n")
        self.seconds += seconds
        self.pairs += len(lines)
        if self.cache_path is not None:
            with open(self.cache_path, "a", encoding="utf8") as f:
                f.writelines(lines)

    def score(self, collection: str, cand: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
        """``(E[s], std[s])`` of every row of ``cand`` (``qid, query, docno, text``), in its order."""
        keys = [(collection, q, d) for q, d in zip(cand["query"], cand["docno"])]
        todo = cand[[k not in self.cache for k in keys]].drop_duplicates(["query", "docno"])
        starts = range(0, len(todo), SCORE_CHUNK)
        for start in self.progress(starts, f"scoring {self.name}", len(starts), "chunk") if len(todo) else ():
            part = todo.iloc[start : start + SCORE_CHUNK]
            t0 = time.perf_counter()
            if self.var:
                out = self._reranker(part[["qid", "query", "docno", "text"]])
                new = zip(out["query"], out["docno"], out["score_mean"], out["score_std"])
            else:
                mean, _ = score_pairs(self.model, part["query"].tolist(), part["text"].tolist(), self.batch_size)
                new = zip(part["query"], part["docno"], mean, [math.nan] * len(part))
            self.add(collection, new, time.perf_counter() - t0)
        vals = np.array([self.cache[k] for k in keys], dtype=np.float64).reshape(-1, 2)
        return vals[:, 0], vals[:, 1]


def unscored(collection: str, cand: pd.DataFrame, scorers: Iterable[PairScorer]) -> pd.DataFrame:
    """The distinct (query, docno) rows of ``cand`` that some scorer has not scored yet."""
    scorers = list(scorers)
    keys = zip(cand["query"], cand["docno"])
    todo = np.array([any((collection, q, d) not in sc.cache for sc in scorers) for q, d in keys], bool)
    return cand[todo].drop_duplicates(["query", "docno"]) if len(cand) else cand


class SharedLayers:
    """Re-rankers fine-tuned under the partial recipe keep the base model's embeddings and lower L - N layers, so a
    pair needs those layers once for all of them: :func:`~st_extensions.cross_encoder.predict_sharing_layers` runs
    them once per batch and each model's own top layers and head on their output (each model's ``predict`` scores)."""

    def __init__(self, models: Mapping[str, Any], frozen: int, batch_size: int, progress: Callable[..., Any]) -> None:
        self.models, self.frozen, self.batch_size, self.progress = dict(models), frozen, int(batch_size), progress
        self.pairs = 0

    @classmethod
    def find(
        cls, models: Mapping[str, Any], train_layers: int, batch_size: int, progress: Callable[..., Any] = _no_bar
    ) -> SharedLayers | None:
        """The sharing of ``models`` fine-tuned with their top ``train_layers`` layers (None unless there are several
        and they really share their lower layers)."""
        if len(models) < 2:
            return None
        try:
            backbones = [check_partial_transformer(list(m)[0]) for m in models.values()]
        except (ValueError, TypeError, IndexError):
            return None
        frozen = len(backbones[0].encoder.layer) - int(train_layers)
        prints = {state_fingerprint(list(m)[0], frozen) for m in models.values()}
        return cls(models, frozen, batch_size, progress) if len(prints) == 1 else None

    def prefetch(self, collection: str, cand: pd.DataFrame, scorers: Mapping[str, PairScorer]) -> None:
        """Score, in one pass for all re-rankers, the candidate pairs that some scorer has not scored yet."""
        part = unscored(collection, cand, scorers.values())
        names = [n for n in scorers if n in self.models]
        models = [self.models[n] for n in names]
        starts = range(0, len(part), SCORE_CHUNK * 4)
        bar = self.progress(starts, f"scoring {', '.join(names)} (shared lower layers)", len(starts), "chunk")
        for start in bar if len(part) else ():
            p = part.iloc[start : start + SCORE_CHUNK * 4]
            t0 = time.perf_counter()
            pairs = list(zip(p["query"], p["text"]))
            out = predict_sharing_layers(models, pairs, self.frozen, batch_size=self.batch_size)
            seconds = (time.perf_counter() - t0) / len(names)
            for n, (mean, std) in zip(names, out):
                std = np.full(len(p), math.nan) if std is None else std
                scorers[n].add(collection, zip(p["query"], p["docno"], mean, std), seconds)
            self.pairs += len(p)
