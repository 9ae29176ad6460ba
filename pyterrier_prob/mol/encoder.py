"""Mixture-of-Logits encoding for PyTerrier: query and document component embeddings f_pq(q), g_px(x) (Eq. 2 of
``shared/papers/mixture-of-logits.txt``) as frame columns, via :func:`st_extensions.mol.encode_components`."""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np
import pyterrier as pt

from pyterrier_prob.dense import TextEncoderStage
from pyterrier_prob.mol.scoring import MoLReranker
from pyterrier_prob.validation import positive_int, text_list
from st_extensions import load_model


def _st_mol() -> Any:
    """:mod:`st_extensions.mol`, looked up when used (so that a test can substitute the model side)."""
    return importlib.import_module("st_extensions.mol")


class MoLEncoder:
    """Encodes queries and documents into MoL component embeddings (a transformer factory).

    :meth:`query_encoder` adds ``query_comp`` (``(P_q, d)`` float32 per row), :meth:`doc_encoder` ``doc_comp``
    (``(P_x, d)``), L2-normalised (Eq. 2), plus ``query_feat`` / ``doc_feat`` for a gate with side features (App.
    A.3); :attr:`mol` is what :class:`MoLRetriever` and :class:`MoLReranker` score with. Example::

        encoder = MoLEncoder(model)
        index = (encoder.doc_encoder() >> MoLIndex("docs.mol").indexer()).index(dataset.get_corpus_iter())
        pipeline = encoder.query_encoder() >> MoLRetriever(index, encoder.mol, method="exact", num_results=100)
    """

    def __init__(self, model: Any, batch_size: int = 32, text_field: str = "text", verbose: bool = False) -> None:
        self.model = load_model(str(model)) if isinstance(model, (str, os.PathLike)) else model
        self.batch_size = positive_int("batch_size", batch_size)
        self.text_field = text_field
        self.verbose = bool(verbose)

    @property
    def mol(self) -> Any:
        """The model's MixtureOfLogits module (:func:`st_extensions.mol.find_mol`)."""
        return _st_mol().find_mol(self.model)

    @cached_property
    def gate_features(self) -> bool:
        """Whether the MoL gate also reads query/document features (App. A.3): the encoders then add them."""
        return bool(getattr(self.mol, "gate_features", False))

    def encode_with_features(
        self, texts: Sequence[str], task: str, batch_size: int | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """``(components (n, P, d), gate features (n, F) or None)`` of ``texts`` for ``task`` (query/document)."""
        texts, bs = text_list(texts, "texts"), batch_size or self.batch_size
        kw = {"return_features": True} if self.gate_features else {}
        out = _st_mol().encode_components(self.model, texts, task=task, batch_size=bs, **kw)
        arr, feats = out if self.gate_features else (out, None)
        return np.asarray(arr, dtype=np.float32), None if feats is None else np.asarray(feats, dtype=np.float32)

    def encode_queries(self, texts: Sequence[str], batch_size: int | None = None) -> np.ndarray:
        """Query component embeddings ``f_pq(q)``, float32 ``(Q, P_q, d)``."""
        return self.encode_with_features(texts, "query", batch_size)[0]

    def encode_docs(self, texts: Sequence[str], batch_size: int | None = None) -> np.ndarray:
        """Document component embeddings ``g_px(x)``, float32 ``(N, P_x, d)``."""
        return self.encode_with_features(texts, "document", batch_size)[0]

    def query_encoder(self, batch_size: int | None = None) -> MoLQueryEncoder:
        """Transformer adding ``query_comp`` to a query frame."""
        return MoLQueryEncoder(self, batch_size=batch_size)

    def doc_encoder(self, batch_size: int | None = None) -> MoLDocEncoder:
        """Transformer adding ``doc_comp`` to a document (or candidate) frame."""
        return MoLDocEncoder(self, batch_size=batch_size)

    def text_scorer(self, num_results: int | None = None, batch_size: int | None = None) -> pt.Transformer:
        """Re-ranks candidates with text by MoL: ``bm25 % 100 >> pt.text.get_text(...) >> encoder.text_scorer()``."""
        return (
            self.query_encoder(batch_size)
            >> self.doc_encoder(batch_size)
            >> MoLReranker(None, self.mol, num_results=num_results, drop_doc_comp=True)
        )

    def __repr__(self) -> str:
        name = getattr(getattr(self.model, "model_card_data", None), "base_model", None) or type(self.model).__name__
        return f"MoLEncoder({name!r})"


class _MoLStage(TextEncoderStage):
    """Adds ``<side>_comp`` (and ``<side>_feat`` for a gate with side features); ``side``: ``query`` or ``doc``."""

    @property
    def side(self) -> str:
        return "query" if self.frame == "query_frame" else "doc"

    def _columns(self) -> dict[str, Any]:
        feat = {f"{self.side}_feat": object} if self.encoder.gate_features else {}
        return {f"{self.side}_comp": object, **feat}

    def _encode(self, texts: list[str]) -> dict[str, Any]:
        task = "query" if self.side == "query" else "document"
        comps, feats = self.encoder.encode_with_features(texts, task, batch_size=self.batch_size)
        return {f"{self.side}_comp": list(comps), **({} if feats is None else {f"{self.side}_feat": list(feats)})}


class MoLQueryEncoder(_MoLStage):
    """``(qid, query)`` -> adds ``query_comp`` (``(P_q, d)`` per row); made by :meth:`MoLEncoder.query_encoder`."""


class MoLDocEncoder(_MoLStage):
    """``(docno, text)`` -> adds ``doc_comp`` (``(P_x, d)`` per row), also to candidates; by :meth:`doc_encoder`."""

    frame, made_by = "document_frame", "doc_encoder"
