"""Re-ranking with a VarCrossEncoder (``shared/papers/var-cross-encoder.md``, Sec. 4.4, 4.5.3): each candidate's
Gaussian score, mean E[s] = mu^T W + b (Eq. 22) and variance W^T Sigma W (Eq. 23), ranked by the mean or by the
risk-adjusted E[s] - lambda * std[s]; e.g. ``bm25 % 100 >> dataset.text_loader() >> VarCrossEncoderReranker(model)``.
The backbone can run on ONNX Runtime or OpenVINO (docs/varce.md, "Fast CPU inference")."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt

from pyterrier_prob.dense import validate_columns
from pyterrier_prob.validation import check_ids, check_texts
from st_extensions import load_model
from st_extensions.checks import finite_float, positive_int
from st_extensions.cross_encoder import VarCrossEncoder, find_var_head, load_cross_encoder
from st_extensions.cross_encoder.split import SCORE_SEPARATOR

__all__ = ["VarCrossEncoderReranker", "risk_adjusted", "score_as_text"]


def score_as_text(texts: Sequence[str], scores: Sequence[float] | np.ndarray) -> list[str]:
    """Each document text preceded by the first stage's score as text, ``"<score, 2 decimals> [SEP] <text>"``, so a
    cross-encoder reads ``[CLS] query [SEP] score [SEP] document [SEP]`` (Askari et al., ECIR 2023, "Injecting the BM25
    Score as Text Improves BERT-Based Re-rankers", Sec. 3); a non-finite score is a ValueError."""
    scores = np.asarray(scores, dtype=np.float64)
    if len(scores) != len(texts):
        raise ValueError(f"score_as_text: {len(texts)} texts but {len(scores)} scores")
    if not np.isfinite(scores).all():
        raise ValueError(f"score_as_text: a non-finite score at row {int(np.argmax(~np.isfinite(scores)))}")
    return [f"{s:.2f}{SCORE_SEPARATOR}{t}" for s, t in zip(scores.tolist(), texts)]


def risk_adjusted(mean: np.ndarray, std: np.ndarray, risk: float) -> np.ndarray:
    """The ranking score E[s] - risk * std[s] (risk = 0: the paper's expected score, Eq. 22)."""
    return np.asarray(mean, dtype=np.float64) - risk * np.asarray(std, dtype=np.float64)


class VarCrossEncoderReranker(pt.Transformer):
    """Re-scores a result frame (``qid, query, docno`` and ``text_field``) with a VarCrossEncoder, each query's best
    first: ``score_mean`` = E[s] (Eq. 22), ``score_std`` = sqrt(W^T Sigma W) (Eq. 23), ``score`` = score_mean - risk *
    score_std and ``rank`` (from 0; ties keep the input order); a missing or non-str query / text is a ValueError.
    ``model``: a VarCrossEncoder or its path, loaded by :func:`st_extensions.cross_encoder.load_cross_encoder` with
    ``backend``, ``precision`` and ``backend_options`` (docs/varce.md, "Fast CPU inference"); ``input_score``: the model
    reads the incoming ``score`` column as text before each document (:func:`score_as_text`; for a model trained so).
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
        input_score: bool = False,
    ) -> None:
        if isinstance(model, (str, os.PathLike)):
            if backend in (None, "torch") and precision in (None, "fp32") and not backend_options:
                model = load_model(os.fspath(model))
            else:
                model = load_cross_encoder(
                    os.fspath(model), backend or "torch", precision or "fp32", **dict(backend_options or {})
                )
        else:
            options = (("backend", backend), ("precision", precision), ("backend_options", backend_options))
            if given := [name for name, value in options if value is not None]:
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
        self.model = model
        self.batch_size = positive_int("batch_size", batch_size)
        self.risk = finite_float("risk", risk)  # lambda of E[s] - lambda * std[s]
        self.text_field = str(text_field)
        self.verbose = bool(verbose)
        self.input_score = bool(input_score)  # read the incoming score as text (score_as_text)

    def __repr__(self) -> str:
        backbone = self.model[0] if len(self.model) else None
        backend = getattr(backbone, "backend", "torch")
        runtime = getattr(backbone, "model", None)
        on = "" if backend == "torch" else f", backend={backend!r}, precision={getattr(runtime, 'precision', None)!r}"
        return (
            f"VarCrossEncoderReranker({type(self.model).__name__}, variant={self.model.head.variant!r}, "
            f"batch_size={self.batch_size}, risk={self.risk}{on}" + (", input_score=True)" if self.input_score else ")")
        )

    def subtransformers(self) -> dict:
        return {}

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        how = f"dataset.text_loader() (or pt.text.get_text(dataset, {self.text_field!r}))"
        validate_columns(self, inp, ["query", self.text_field], f"add the document text with {how} before it", True)
        inp = inp.reset_index(drop=True)
        base = inp.drop(columns=["score", "rank", "score_mean", "score_std"], errors="ignore")
        check_ids(inp, ["qid", "docno"], "VarCrossEncoderReranker")
        # a candidate without text is an error, not an empty document (it would get a score and a rank)
        queries = check_texts(inp, "query", "VarCrossEncoderReranker")
        texts = check_texts(inp, self.text_field, "VarCrossEncoderReranker")
        if self.input_score:
            validate_columns(
                self, inp, ["score"], "input_score=True reads the first stage's score: retrieve first", True
            )
            texts = score_as_text(texts, pd.to_numeric(inp["score"], errors="raise").to_numpy(np.float64))
        pairs = list(zip(queries, texts))
        mean, std = np.empty((2, len(pairs)), np.float32)
        starts = range(0, len(pairs), self.batch_size)
        if self.verbose and starts:
            starts = pt.tqdm(starts, desc="VarCrossEncoderReranker", unit="batch")
        for a in starts:
            b = min(len(pairs), a + self.batch_size)
            mean[a:b], std[a:b] = self.model.predict(
                pairs[a:b], batch_size=self.batch_size, return_std=True, show_progress_bar=False
            )
        score = risk_adjusted(mean, std, self.risk)
        order = np.lexsort((-score, pd.factorize(inp["qid"])[0]))  # queries as they come; ties keep the input order
        out = base.iloc[order].assign(score=score[order], score_mean=mean[order], score_std=std[order])
        return out.reset_index(drop=True).assign(rank=out.groupby("qid", sort=False).cumcount().to_numpy(np.int64))
