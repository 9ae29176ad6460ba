"""Re-ranking with a VarCrossEncoder (``shared/papers/var-cross-encoder.md``): expected score and its spread.

VarCrossEncoder is a re-ranker (Sec. 4.4, 4.5.3): it scores the candidates of a first stage, e.g.
``bm25 % 100 >> dataset.text_loader() >> VarCrossEncoderReranker(model)``. Each (query, document) pair gets
the Gaussian score of its latent, with mean E[s] = mu^T W + b (Eq. 22) and variance W^T Sigma W (Eq. 23); the
paper ranks by the mean. ``risk = lambda`` ranks by the risk-adjusted ``E[s] - lambda * std[s]`` instead
(mean-variance ranking: lambda > 0 penalises uncertain documents, lambda < 0 favours them).

Loaded from a path, the model's backbone can run on ONNX Runtime or OpenVINO, in fp32 or int8
(``VarCrossEncoderReranker(path, backend="onnx", precision="int8")``, through
:func:`st_extensions.cross_encoder.load_cross_encoder`); the head, and so E[s] and std[s], stay in torch.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt

from pyterrier_prob.validation import check_ids, check_texts

__all__ = ["VarCrossEncoderReranker", "risk_adjusted"]


def risk_adjusted(mean: np.ndarray, std: np.ndarray, risk: float) -> np.ndarray:
    """The ranking score E[s] - risk * std[s] (risk = 0: the paper's expected score, Eq. 22)."""
    return np.asarray(mean, dtype=np.float64) - risk * np.asarray(std, dtype=np.float64)


class VarCrossEncoderReranker(pt.Transformer):
    """Re-scores a candidate frame with a VarCrossEncoder: adds ``score_mean``, ``score_std``, ``score`` and ``rank``.

    Input: a result frame with ``qid, query, docno`` and the document text (``text_field``, as
    ``dataset.text_loader()`` or ``pt.text.get_text(dataset, "text")`` adds it).
    Output: the input rows, each query's best first (ties keep the input order), with ``score_mean`` = E[s]
    (Eq. 22), ``score_std`` = sqrt(W^T Sigma W) (Eq. 23), ``score`` = score_mean - risk * score_std and ``rank``
    (from 0) by ``score``. Scores are logits (no sigmoid). A row whose ``query`` or document text is missing
    (None / NaN) or not a str is a ValueError naming the column, the row and its qid / docno: it is never scored as
    an empty text.

    Args:
        model: a :class:`~st_extensions.cross_encoder.VarCrossEncoder`, or the path of a saved one (loaded with
            :func:`st_extensions.load_model`, or with :func:`st_extensions.cross_encoder.load_cross_encoder` when
            ``backend`` / ``precision`` ask for a runtime).
        batch_size: pairs per forward pass.
        risk: lambda of the risk-adjusted score E[s] - lambda * std[s]; 0 ranks by the expected score.
        text_field: the column holding the document text.
        verbose: show a progress bar over the batches.
        backend: where the backbone of a model given by path runs: ``"torch"`` (the default), ``"onnx"`` (ONNX
            Runtime) or ``"openvino"``; the first use exports it into the model folder.
        precision: ``"fp32"`` (the default) or ``"int8"`` (onnx / openvino only).
        backend_options: further arguments of ``load_cross_encoder`` (``num_threads``; ``calibration_pairs``, which
            OpenVINO int8 needs the first time).

    Raises:
        ValueError: ``backend``, ``precision`` or ``backend_options`` given with an already loaded model (load it
            with ``load_cross_encoder`` instead), or an unknown backend / precision.
    """

    def __init__(
        self,
        model: Any,
        batch_size: int = 32,
        risk: float = 0.0,
        text_field: str = "text",
        verbose: bool = True,
        backend: str | None = None,
        precision: str | None = None,
        backend_options: Mapping[str, Any] | None = None,
    ) -> None:
        from st_extensions.cross_encoder import VarCrossEncoder, find_var_head

        if isinstance(model, (str, os.PathLike)):
            if backend in (None, "torch") and precision in (None, "fp32") and not backend_options:
                from st_extensions import load_model

                model = load_model(os.fspath(model))
            else:
                from st_extensions.cross_encoder import load_cross_encoder

                model = load_cross_encoder(
                    os.fspath(model), backend or "torch", precision or "fp32", **dict(backend_options or {})
                )
        else:
            options = {"backend": backend, "precision": precision, "backend_options": backend_options}
            given = [name for name, value in options.items() if value is not None]
            if given:
                raise ValueError(
                    f"{', '.join(given)} apply to a model given by path; this model is already loaded: pass its path, "
                    "or load it with st_extensions.cross_encoder.load_cross_encoder(path, backend=..., precision=...)"
                )
        find_var_head(model)
        if not isinstance(model, VarCrossEncoder):
            raise ValueError(
                f"VarCrossEncoderReranker needs a VarCrossEncoder (predict with return_std), got "
                f"{type(model).__name__}: load the model with st_extensions.load_model(path)"
            )
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if isinstance(risk, bool) or not isinstance(risk, numbers.Real) or not math.isfinite(risk):
            raise ValueError(f"risk must be a finite number (lambda of E[s] - lambda * std[s]), got {risk!r}")
        self.model = model
        self.batch_size = int(batch_size)
        self.risk = float(risk)
        self.text_field = str(text_field)
        self.verbose = bool(verbose)

    def __repr__(self) -> str:
        backbone = self.model[0] if len(self.model) else None
        backend = getattr(backbone, "backend", "torch")
        runtime = getattr(backbone, "model", None)
        on = "" if backend == "torch" else f", backend={backend!r}, precision={getattr(runtime, 'precision', None)!r}"
        return (
            f"VarCrossEncoderReranker({type(self.model).__name__}, variant={self.model.head.variant!r}, "
            f"batch_size={self.batch_size}, risk={self.risk}{on})"
        )

    def subtransformers(self) -> dict:
        return {}

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        cols = ["query", self.text_field]
        try:
            pt.validate.result_frame(inp, extra_columns=cols)
        except pt.validate.InputValidationError as e:
            missing = sorted({c for m in e.modes for c in m.missing_columns})
            raise pt.validate.InputValidationError(
                f"VarCrossEncoderReranker needs a candidate frame with columns ['qid', 'docno', 'query', "
                f"{self.text_field!r}]; missing {missing}: add the document text with dataset.text_loader() "
                f"(or pt.text.get_text(dataset, {self.text_field!r})) before the re-ranker.",
                e.modes,
            ) from e
        inp = inp.reset_index(drop=True)
        base = inp.drop(columns=[c for c in ("score", "rank", "score_mean", "score_std") if c in inp.columns])
        if not len(inp):
            return base.assign(
                score=pd.Series(dtype=np.float64),
                score_mean=pd.Series(dtype=np.float32),
                score_std=pd.Series(dtype=np.float32),
                rank=pd.Series(dtype=np.int64),
            )
        check_ids(inp, ["qid", "docno"], "VarCrossEncoderReranker")
        # a candidate without text is an error, not an empty document (it would get a score and a rank)
        queries = check_texts(inp, "query", "VarCrossEncoderReranker")
        texts = check_texts(inp, self.text_field, "VarCrossEncoderReranker")
        pairs = list(zip(queries, texts))
        mean = np.empty(len(pairs), np.float32)
        std = np.empty(len(pairs), np.float32)
        starts = range(0, len(pairs), self.batch_size)
        if self.verbose:
            starts = pt.tqdm(starts, desc="VarCrossEncoderReranker", unit="batch")
        for a in starts:
            b = min(len(pairs), a + self.batch_size)
            mean[a:b], std[a:b] = self.model.predict(
                pairs[a:b], batch_size=self.batch_size, return_std=True, show_progress_bar=False
            )
        score = risk_adjusted(mean, std, self.risk)
        codes, uniques = pd.factorize(inp["qid"])
        order = np.lexsort((-score, codes))  # stable: ties keep the input order
        c = codes[order]
        counts = np.bincount(c, minlength=len(uniques))
        rank = np.arange(order.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        return (
            base.iloc[order]
            .reset_index(drop=True)
            .assign(score=score[order], score_mean=mean[order], score_std=std[order], rank=rank)
        )
