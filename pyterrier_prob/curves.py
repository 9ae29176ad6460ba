"""Learning curves on dev during training: a trainer callback that evaluates every few steps, writes the curve as it
grows, and can hand back the weights of the best dev point (steps chosen on dev, never on test)."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import ir_measures
import numpy as np
import pandas as pd
import torch
from safetensors.torch import load_file, save
from transformers import TrainerCallback

from pyterrier_prob.atomic import atomic_write, read_checked
from pyterrier_prob.training import read_json
from st_extensions.checks import positive_int

__all__ = ["DevCurve", "DevRetrieval", "cosine_scores", "curve_summaries"]

#: what to do with a corrupted curve file of a run being resumed
REMEDY = "delete the curve's .json and .best.safetensors and rerun the training without --resume"


def _read_points(path: str) -> list[dict[str, float]]:
    return list(read_json(path)["points"])


class DevCurve(TrainerCallback):
    """Evaluates ``evaluate(model) -> float`` (higher is better) every ``every`` optimiser steps, at the last step and
    (``evaluate_at_start``) at step 0, appending each point to ``path`` (JSON; None: memory only). With ``keep_best``
    the trainable parameters at the best point (also on disk) are put back when training ends; ``patience``: stop
    after this many evaluations without a better value. A resumed run keeps the points up to its step."""

    def __init__(
        self,
        every: int,
        evaluate: Callable[[Any], float],
        path: str | os.PathLike | None = None,
        keep_best: bool = True,
        evaluate_at_start: bool = True,
        patience: int | None = None,
    ) -> None:
        self.every, self.evaluate = positive_int("every", every), evaluate
        self.patience = positive_int("patience", patience, allow_none=True)
        self.path = os.fspath(path) if path is not None else None
        self.keep_best, self.evaluate_at_start = bool(keep_best), bool(evaluate_at_start)
        self.points: list[dict[str, float]] = []
        self.best: dict[str, torch.Tensor] | None = None
        self.train_s = 0.0
        self._t: float | None = None

    # ---- files
    @property
    def best_path(self) -> str | None:
        return None if self.path is None else f"{os.path.splitext(self.path)[0]}.best.safetensors"

    def _write(self) -> None:
        if self.path is not None:
            atomic_write(self.path, json.dumps({"points": self.points, "best": self.best_point()}, indent=1))

    def best_point(self) -> dict[str, float] | None:
        """The point with the highest dev value (the earliest among ties), or None before any evaluation."""
        finite = [p for p in self.points if math.isfinite(p["dev"])]
        return max(finite, key=lambda p: (p["dev"], -p["step"])) if finite else None

    # ---- the trainer's events
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        step = int(state.global_step)
        self.points, self.best, self.train_s = [], None, 0.0
        if step and self.path is not None and os.path.isfile(self.path):  # resumed: keep what came before
            self.points = [p for p in read_checked(self.path, _read_points, REMEDY) if p["step"] <= step]
            self.train_s = max((p["train_s"] for p in self.points), default=0.0)
            best = self.best_point()
            if self.keep_best and best is not None and best["step"] == step and model is not None:
                self.best = self._trainable(model)  # the checkpoint resumed from is the best point
            elif self.keep_best and best is not None and os.path.isfile(self.best_path):
                self.best = read_checked(self.best_path, load_file, REMEDY)
        if step == 0 and self.evaluate_at_start and model is not None:
            self._record(0, model)

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self._t is not None:
            self.train_s += time.perf_counter() - self._t
        step = int(state.global_step)
        if model is not None and (step % self.every == 0 or step == state.max_steps):
            self._record(step, model)
            best = self.best_point()
            if self.patience is not None and best is not None:
                if sum(p["step"] > best["step"] for p in self.points) >= self.patience:
                    control.should_training_stop = True

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not self.keep_best or model is None or self.best is None:  # no point evaluated yet
            return
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in self.best.items():
                params[name].copy_(value.to(params[name].device, params[name].dtype))

    # ---- one point
    @staticmethod
    def _trainable(model: Any) -> dict[str, torch.Tensor]:
        return {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}

    def _record(self, step: int, model: Any) -> None:
        if any(p["step"] == step for p in self.points):
            return
        was_training = model.training
        try:
            value = float(self.evaluate(model))
        finally:
            model.train(was_training)
        self.points.append({"step": step, "dev": value, "train_s": round(self.train_s, 3)})
        if self.keep_best and self.best_point() is self.points[-1]:
            self.best = self._trainable(model)
            if self.best_path is not None:
                atomic_write(self.best_path, save(self.best))
        self._write()


def curve_summaries(
    folder: str, measures: Mapping[str, str], recipes: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """name -> summary of the saved :class:`DevCurve` ``folder/<name>.json`` of each system in ``measures`` (name ->
    dev measure): best step and value, evaluations, ``stopped_by`` (``"patience"`` before the recipe's steps)."""
    out = {}
    for name, measure in measures.items():
        path = os.path.join(folder, f"{name}.json")
        try:
            curve = read_json(path)
        except (OSError, ValueError):
            continue
        points, best = curve.get("points") or [], curve.get("best") or {}
        last = points[-1]["step"] if points else 0
        out[name] = {
            "measure": measure,
            "best_step": best.get("step"),
            "best_dev": best.get("dev"),
            "evaluations": len(points),
            "stopped_by": "patience" if last < recipes.get(name, {}).get("steps", 0) else "steps",
            "curve": path,
        }
    return out


def cosine_scores(model: Any, topics: pd.DataFrame, docs: list[str]) -> np.ndarray:
    """``(queries, docs)`` cosine similarities of a bi-encoder's ``encode_query`` / ``encode_document`` embeddings."""
    kw = {"batch_size": 64, "normalize_embeddings": True, "convert_to_numpy": True}
    return model.encode_query(topics["query"].tolist(), **kw) @ model.encode_document(list(docs), **kw).T


class DevRetrieval:
    """``model -> mean dev measure`` of exact search over a fixed candidate ``pool`` (docno -> text) for the dev
    ``topics`` (a :class:`DevCurve`'s ``evaluate``); ``score(model, topics, texts)``: default :func:`cosine_scores`."""

    def __init__(
        self,
        topics: pd.DataFrame,
        qrels: pd.DataFrame,
        pool: Mapping[str, str],
        measure: str = "nDCG@10",
        score: Callable[[Any, pd.DataFrame, list[str]], Any] | None = None,
    ) -> None:
        self.topics, self.measure = topics.astype({"qid": str}), ir_measures.parse_measure(measure)
        q = qrels.astype({"qid": str, "docno": str})
        self.qrels = [ir_measures.Qrel(a, b, int(c)) for a, b, c in q[["qid", "docno", "label"]].itertuples(False)]
        self.docnos, self.texts = list(pool), list(pool.values())
        self.score = score or cosine_scores

    def __call__(self, model: Any) -> float:
        with torch.no_grad():
            scores = np.asarray(self.score(model, self.topics, self.texts), dtype=np.float32)
        k = min(100, scores.shape[1])
        top = np.argpartition(-scores, k - 1, axis=1)[:, :k] if k else np.zeros((len(scores), 0), int)
        run = [
            ir_measures.ScoredDoc(qid, self.docnos[j], float(scores[i, j]))
            for i, qid in enumerate(self.topics["qid"])
            for j in top[i]
        ]
        values = {m.query_id: m.value for m in ir_measures.iter_calc([self.measure], self.qrels, run)}
        return float(np.mean([values.get(q, 0.0) for q in self.topics["qid"]])) if len(self.topics) else 0.0
