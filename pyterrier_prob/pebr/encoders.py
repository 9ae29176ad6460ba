"""Query and document encoders for pEBR models (and plain SentenceTransformers) as PyTerrier transformers.

pEBR (``shared/papers/pebr.md``, Sec. 3.1-3.2) gives every query a law of the cosine similarity of its
relevant items; :class:`ProbBiEncoder` writes that law's parameters next to the query vector, so that a
retriever reads them from the frame (Sec. 4.1.2's pEBR cutoff, Appendix A) without calling the model:

* ``exp`` (ExpNCE, Sec. 3.2.1) and ``beta`` (BetaNCE, Sec. 3.2.2, alpha = 1 / tau_q, beta = 1 by Eq. 3):
  ``query_temp`` (tau_q);
* ``beta_mle`` (Sec. 3.1): ``query_alpha``, ``query_beta`` (the relevant-item law) and
  ``query_alpha_neg``, ``query_beta_neg`` (the law of the other items).

A SentenceTransformer without a :class:`~st_extensions.QueryDistributionHead` is accepted too (only
``query_vec``; ``family`` is ``None``), so the DSSM-topk / DSSM-score baselines use the same encoder class.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt
import torch
from pyterrier_dr import BiEncoder
from sentence_transformers import SentenceTransformer

from pyterrier_prob.validation import check_ids, check_texts, unique_texts
from st_extensions import encode_queries as _encode_queries_with_params
from st_extensions.modules import QueryDistributionHead

__all__ = ["PARAM_COLUMNS", "ProbBiEncoder", "ProbDocEncoder", "ProbQueryEncoder"]

#: Frame columns holding each family's per-query distribution parameters, in the head's output order.
PARAM_COLUMNS: dict[str, tuple[str, ...]] = {
    "exp": ("query_temp",),
    "beta": ("query_temp",),
    "beta_mle": ("query_alpha", "query_beta", "query_alpha_neg", "query_beta_neg"),
}


class ProbBiEncoder(BiEncoder):
    """A pyterrier-dr bi-encoder over a SentenceTransformer, adding pEBR's per-query distribution parameters.

    A transformer factory, like :class:`pyterrier_dr.BiEncoder`:

    * :meth:`query_encoder`: ``(qid, query)`` -> adds ``query_vec`` (float32) and the parameter columns of
      :data:`PARAM_COLUMNS` for the model's head family (none for a model without a head);
    * :meth:`doc_encoder`: ``(docno, text)`` -> adds ``doc_vec`` (float32, L2-normalised);
    * :meth:`text_scorer` (inherited): scores ``query``/``text`` pairs by inner product.

    Example::

        model = st_extensions.build_pebr_model(family="beta")   # or st_extensions.load_model(path)
        encoder = ProbBiEncoder(model)
        index = DenseIndex("docs.flex")
        (encoder.doc_encoder() >> index.indexer()).index(docs)
        pipeline = encoder.query_encoder() >> CDFCutoffRetriever(index, p=0.5, family=encoder.family)

    Args:
        model: a SentenceTransformer (with or without a QueryDistributionHead) or a path to one (loaded
            with :func:`st_extensions.load_model`).
        batch_size: encoding batch size.
        text_field: the document column to encode.
        verbose: show tqdm progress bars while encoding.
        devices: encode documents over several processes, one per device (``["cuda:0", "cuda:1"]``, or
            ``["cpu", "cpu"]``): sentence-transformers' multi-process encoding (``encode(..., device=[...])``), for
            corpora too large for one process. Queries are encoded in this process.
    """

    def __init__(
        self,
        model: SentenceTransformer | str | os.PathLike,
        batch_size: int = 32,
        text_field: str = "text",
        verbose: bool = False,
        devices: Sequence[str] | None = None,
    ) -> None:
        super().__init__(batch_size=batch_size, text_field=text_field, verbose=verbose)
        if devices is not None:
            if isinstance(devices, str) or not len(devices) or not all(isinstance(d, str) for d in devices):
                raise ValueError(
                    f"devices must be a non-empty list of device names, e.g. ['cpu', 'cpu'], got {devices!r}"
                )
            devices = list(devices)
        self.devices = devices
        if isinstance(model, (str, os.PathLike)):
            from st_extensions import load_model

            model = load_model(str(model))
        if not isinstance(model, SentenceTransformer):
            raise TypeError(f"model must be a SentenceTransformer or a path to one, got {type(model).__name__}")
        heads = [m for m in model.modules() if isinstance(m, QueryDistributionHead)]
        if len(heads) > 1:
            raise ValueError(f"model has {len(heads)} QueryDistributionHeads, expected at most one")
        self.model = model
        self._head = heads[0] if heads else None

    @property
    def family(self) -> str | None:
        """The head's family (``"exp"``, ``"beta"``, ``"beta_mle"``), or ``None`` for a model without a head."""
        return None if self._head is None else self._head.family

    @property
    def dim(self) -> int:
        """Embedding dimension."""
        dim = self.model.get_embedding_dimension()
        if dim is None:
            raise ValueError("cannot tell the model's embedding dimension")
        return int(dim)

    @property
    def param_columns(self) -> tuple[str, ...]:
        """The distribution-parameter columns :meth:`query_encoder` adds (empty without a head)."""
        return () if self.family is None else PARAM_COLUMNS[self.family]

    # ---- encoding ------------------------------------------------------------------------------------------
    def encode_queries_with_params(
        self, texts: list[str], batch_size: int | None = None, show_progress_bar: bool | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """``(embeddings (Q, dim) float32, params (Q, k) float64 or None)`` for query texts."""
        batch_size = batch_size or self.batch_size
        texts = _text_list(texts, "query texts")
        if self._head is not None:
            return _encode_queries_with_params(
                self.model, texts, batch_size=batch_size, show_progress_bar=show_progress_bar
            )
        if not texts:
            return np.zeros((0, self.dim), np.float32), None
        emb = self.model.encode_query(
            texts, batch_size=batch_size, convert_to_numpy=True, show_progress_bar=show_progress_bar
        )
        return np.asarray(emb, dtype=np.float32), None

    def encode_queries(self, texts: list[str], batch_size: int | None = None) -> np.ndarray:
        """Query embeddings, ``(Q, dim)`` float32 (pyterrier-dr's BiEncoder API)."""
        return self.encode_queries_with_params(texts, batch_size)[0]

    def encode_queries_torch(self, texts: list[str], batch_size: int | None = None) -> torch.Tensor:
        return torch.from_numpy(self.encode_queries(texts, batch_size))

    def encode_docs(
        self, texts: list[str], batch_size: int | None = None, show_progress_bar: bool | None = None
    ) -> np.ndarray:
        """Document embeddings, ``(N, dim)`` float32, L2-normalised (the document path skips the head)."""
        texts = _text_list(texts, "document texts")
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        emb = self.model.encode_document(
            texts,
            batch_size=batch_size or self.batch_size,
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=show_progress_bar,
            **({"device": self.devices} if self.devices and len(texts) > 1 else {}),
        )
        return np.asarray(emb, dtype=np.float32)

    # ---- transformers --------------------------------------------------------------------------------------
    def query_encoder(self, verbose: bool | None = None, batch_size: int | None = None) -> ProbQueryEncoder:
        """Transformer adding ``query_vec`` and the distribution-parameter columns to a query frame."""
        return ProbQueryEncoder(self, verbose=verbose, batch_size=batch_size)

    def doc_encoder(self, verbose: bool | None = None, batch_size: int | None = None) -> ProbDocEncoder:
        """Transformer adding ``doc_vec`` to a document frame."""
        return ProbDocEncoder(self, verbose=verbose, batch_size=batch_size)

    def __repr__(self) -> str:
        name = getattr(getattr(self.model, "model_card_data", None), "base_model", None) or type(self.model).__name__
        return f"ProbBiEncoder({name!r}, family={self.family!r})"


class ProbQueryEncoder(pt.Transformer):
    """``(qid, query)`` -> adds ``query_vec`` and the per-query distribution parameters; made by
    :meth:`ProbBiEncoder.query_encoder`. Identical query texts are encoded once."""

    def __init__(self, bi_encoder: ProbBiEncoder, verbose: bool | None = None, batch_size: int | None = None) -> None:
        self.bi_encoder = bi_encoder
        self.verbose = bi_encoder.verbose if verbose is None else verbose
        self.batch_size = bi_encoder.batch_size if batch_size is None else batch_size

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        with pt.validate.any(inp) as v:
            v.query_frame(extra_columns=["query"])
            v.columns(includes=["query"])
        cols = self.bi_encoder.param_columns
        if not len(inp):
            return inp.assign(query_vec=pd.Series(dtype=object), **{c: pd.Series(dtype=np.float64) for c in cols})
        check_ids(inp, ["qid"], "ProbQueryEncoder")
        texts, inv = unique_texts(check_texts(inp, "query", "ProbQueryEncoder"))
        emb, params = self.bi_encoder.encode_queries_with_params(
            texts, batch_size=self.batch_size, show_progress_bar=self.verbose
        )
        rows = list(emb)  # rows of one text share one array object (the retrievers compare them by identity first)
        extra = {c: params[inv, j] for j, c in enumerate(cols)} if params is not None else {}
        return inp.assign(query_vec=[rows[i] for i in inv], **extra)

    def __repr__(self) -> str:
        return f"{self.bi_encoder!r}.query_encoder()"

    def subtransformers(self) -> dict:
        return {}


class ProbDocEncoder(pt.Transformer):
    """``(docno, text)`` -> adds ``doc_vec`` (L2-normalised float32); made by :meth:`ProbBiEncoder.doc_encoder`."""

    def __init__(self, bi_encoder: ProbBiEncoder, verbose: bool | None = None, batch_size: int | None = None) -> None:
        self.bi_encoder = bi_encoder
        self.verbose = bi_encoder.verbose if verbose is None else verbose
        self.batch_size = bi_encoder.batch_size if batch_size is None else batch_size
        self.text_field = bi_encoder.text_field

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        with pt.validate.any(inp) as v:
            v.document_frame(extra_columns=[self.text_field])
            v.columns(includes=[self.text_field])
        if not len(inp):
            return inp.assign(doc_vec=pd.Series(dtype=object))
        texts = check_texts(inp, self.text_field, "ProbDocEncoder")
        show = bool(self.verbose) and len(texts) > self.batch_size
        vecs = self.bi_encoder.encode_docs(texts, batch_size=self.batch_size, show_progress_bar=show)
        return inp.assign(doc_vec=list(vecs))

    def fuse_rank_cutoff(self, k: int) -> pt.Transformer:
        return pt.RankCutoff(k) >> self

    def __repr__(self) -> str:
        return f"{self.bi_encoder!r}.doc_encoder()"

    def subtransformers(self) -> dict:
        return {}


def _text_list(texts: Any, what: str) -> list[str]:
    """``texts`` as a list of str; a ValueError naming the position of a None / NaN / non-str entry."""
    if isinstance(texts, str):
        raise TypeError(f"expected a list of {what}, got a single str {texts[:40]!r}")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ValueError(f"{what}[{i}] is {t!r} ({type(t).__name__}), not a str: every text must be a str")
    return texts
