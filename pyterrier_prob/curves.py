"""Learning curves on dev during training: a trainer callback that evaluates every few steps, writes the curve as it
grows, and can hand back the weights of the best dev point (steps chosen on dev, never on test)."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import TrainerCallback

from pyterrier_prob.atomic import atomic_write

__all__ = ["DevCurve"]


class DevCurve(TrainerCallback):
    """Evaluates ``evaluate(model) -> float`` (higher is better, e.g. dev nDCG@10) every ``every`` optimiser steps and
    at the last step; each point ``{"step", "dev", "train_s"}`` is appended to ``path`` (JSON, written atomically) as
    it comes.

    ``model`` is the model the trainer trains (under the frozen and partial recipes the training stand-in, which
    shares its trained modules with the real model and scores exactly as it does up to the cache's storage rounding).
    With ``keep_best`` the trainable parameters at the best point so far are kept (also on disk beside ``path``, so a
    resumed run knows them) and put back into the model when training ends: the model is then the one at the best dev
    step. A resumed run keeps the points up to the step it resumes from; a fresh run (step 0) starts a new curve.

    Args:
        every: steps between evaluations (>= 1).
        evaluate: the dev measure of a model.
        path: the curve's JSON file (None: memory only; then a resume starts afresh).
        keep_best: restore the best point's trainable parameters at the end of training.
        evaluate_at_start: also evaluate before the first step (step 0: the untrained start).
        patience: stop training after this many evaluations without a better dev value (None: never).
    """

    def __init__(
        self,
        every: int,
        evaluate: Callable[[Any], float],
        path: str | os.PathLike | None = None,
        keep_best: bool = True,
        evaluate_at_start: bool = True,
        patience: int | None = None,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}")
        if patience is not None and (isinstance(patience, bool) or not isinstance(patience, int) or patience < 1):
            raise ValueError(f"patience must be an int >= 1 or None, got {patience!r}")
        self.patience = patience
        self.every, self.evaluate = every, evaluate
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
            os.makedirs(os.path.dirname(os.path.abspath(self.path)) or ".", exist_ok=True)
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
            with open(self.path, encoding="utf8") as f:
                self.points = [p for p in json.load(f).get("points", []) if p["step"] <= step]
            self.train_s = max((p["train_s"] for p in self.points), default=0.0)
            best = self.best_point()
            if self.keep_best and best is not None and best["step"] == step and model is not None:
                self.best = self._trainable(model)  # the checkpoint resumed from is the best point
            elif self.keep_best and best is not None and os.path.isfile(self.best_path):
                from safetensors.torch import load_file

                self.best = load_file(self.best_path)
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
        if not self.keep_best or model is None:
            return
        best = self.best_point()
        if best is None or self.best is None:
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
                from safetensors.torch import save_file

                os.makedirs(os.path.dirname(os.path.abspath(self.best_path)) or ".", exist_ok=True)
                tmp = f"{self.best_path}.tmp"
                save_file(self.best, tmp)
                os.replace(tmp, self.best_path)
        self._write()
