"""Plain dense retrieval that every paper's PyTerrier side uses: :class:`ProbBiEncoder` (with pEBR's
``QueryDistributionHead``, Sec. 3.1-3.2, it also writes :data:`PARAM_COLUMNS`), :class:`DenseRetriever` (``S_{t,K}``,
pEBR Appendix A, exact or on a ``searcher=``) and :class:`TopKRetriever` (DSSM-topk); the cutoffs are in
:mod:`pyterrier_prob.pebr.cutoff`. See ``docs/pebr.md``."""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt
import torch
from pyterrier_dr import BiEncoder
from sentence_transformers import SentenceTransformer

from pyterrier_prob.index import Searcher, as_dense_index, check_searcher, docnos_of, threshold_search
from pyterrier_prob.index.exact import QUERY_BATCH, candidate_scores, f32_ceil, top_per_query, unit_rows
from pyterrier_prob.validation import (
    check_ids,
    check_rows_match_query,
    check_same_per_query,
    check_texts,
    empty_results,
    first_rows,
    float_column,
    positive_int,
    row_namer,
    stack_arrays,
    text_list,
    unique_texts,
)
from st_extensions import encode_queries as _encode_queries_with_params
from st_extensions import load_model
from st_extensions.modules import QueryDistributionHead

__all__ = ["PARAM_COLUMNS", "DenseRetriever", "ProbBiEncoder", "ProbDocEncoder", "ProbQueryEncoder", "TopKRetriever"]

#: Frame columns holding each family's per-query distribution parameters, in the head's output order.
PARAM_COLUMNS: dict[str, tuple[str, ...]] = {
    "exp": ("query_temp",),
    "beta": ("query_temp",),
    "beta_mle": ("query_alpha", "query_beta", "query_alpha_neg", "query_beta_neg"),
}


def validate_columns(owner: pt.Transformer, inp: pd.DataFrame, cols: list[str], hint: str, rerank: bool | None) -> bool:
    """pt.validate with a message naming what is missing and how to get it; True for a candidate frame (``rerank``:
    True / False to require one / a query frame, None for either)."""
    try:
        with pt.validate.any(inp) as v:
            if rerank is not True:
                v.query_frame(extra_columns=cols, mode="retrieve")
            if rerank is not False:
                v.result_frame(extra_columns=cols, mode="rerank")
    except pt.validate.InputValidationError as e:
        missing = sorted({c for m in e.modes for c in m.missing_columns if rerank is not None or c != "docno"})
        need = ["qid", *cols] if rerank is not True else ["qid", "docno", *cols]
        extra = " (plus docno to re-rank)" if rerank is None else ""
        raise pt.validate.InputValidationError(
            f"{type(owner).__name__} needs columns {need}{extra}; missing {missing}: {hint}.", e.modes
        ) from e
    return v.mode == "rerank"


class ProbBiEncoder(BiEncoder):
    """A pyterrier-dr bi-encoder over a SentenceTransformer (or a path to one), adding pEBR's per-query law.

    :meth:`query_encoder` adds ``query_vec`` and the :data:`PARAM_COLUMNS` of the head's family (none without a
    head), :meth:`doc_encoder` adds ``doc_vec`` (L2-normalised); usage: :class:`~pyterrier_prob.index.DenseIndex`,
    :class:`~pyterrier_prob.pebr.CDFCutoffRetriever`. ``devices``: encode documents over one process per device
    (``["cuda:0", "cuda:1"]``, sentence-transformers' multi-process encoding); queries are encoded in this process.
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
        texts = text_list(texts, "query texts")
        kw = {"batch_size": batch_size or self.batch_size, "show_progress_bar": show_progress_bar}
        if self._head is not None:
            return _encode_queries_with_params(self.model, texts, **kw)
        if not texts:
            return np.zeros((0, self.dim), np.float32), None
        return np.asarray(self.model.encode_query(texts, convert_to_numpy=True, **kw), dtype=np.float32), None

    def encode_queries(self, texts: list[str], batch_size: int | None = None) -> np.ndarray:
        """Query embeddings, ``(Q, dim)`` float32 (pyterrier-dr's BiEncoder API)."""
        return self.encode_queries_with_params(texts, batch_size)[0]

    def encode_queries_torch(self, texts: list[str], batch_size: int | None = None) -> torch.Tensor:
        return torch.from_numpy(self.encode_queries(texts, batch_size))

    def encode_docs(
        self, texts: list[str], batch_size: int | None = None, show_progress_bar: bool | None = None
    ) -> np.ndarray:
        """Document embeddings, ``(N, dim)`` float32, L2-normalised (the document path skips the head)."""
        texts = text_list(texts, "document texts")
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        kw = {"device": self.devices} if self.devices and len(texts) > 1 else {}
        kw.update(batch_size=batch_size or self.batch_size, show_progress_bar=show_progress_bar)
        return np.asarray(
            self.model.encode_document(texts, convert_to_numpy=True, normalize_embeddings=True, **kw), dtype=np.float32
        )

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


class TextEncoderStage(pt.Transformer):
    """A transformer made by an ``encoder`` (``verbose`` / ``batch_size``: the encoder's by default) adding the
    columns :meth:`_encode` gives to a query (``frame="query_frame"``, texts in ``query``) or document frame (texts in
    the encoder's ``text_field``); identical texts are encoded once and their rows share one array object (the
    retrievers compare them by identity first)."""

    frame = "query_frame"  # the pt.validate check of the input frame
    made_by = "query_encoder"  # the encoder's method making it, for repr

    def __init__(self, encoder: Any, verbose: bool | None = None, batch_size: int | None = None) -> None:
        self.encoder = encoder
        self.verbose = encoder.verbose if verbose is None else bool(verbose)
        self.batch_size = positive_int("batch_size", batch_size, allow_none=True) or encoder.batch_size

    def _columns(self) -> dict[str, Any]:
        """The added columns and their dtypes (of an empty frame)."""
        raise NotImplementedError

    def _encode(self, texts: list[str]) -> dict[str, Any]:
        """Each added column's values for ``texts``: a list of arrays or a 1-D array."""
        raise NotImplementedError

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        field = "query" if self.frame == "query_frame" else self.encoder.text_field
        with pt.validate.any(inp) as v:
            getattr(v, self.frame)(extra_columns=[field])
            v.columns(includes=[field])
        if not len(inp):
            return inp.assign(**{c: pd.Series(dtype=d) for c, d in self._columns().items()})
        if self.frame == "query_frame":
            check_ids(inp, ["qid"], type(self).__name__)
        texts, inv = unique_texts(check_texts(inp, field, type(self).__name__))
        cols = self._encode(texts)
        return inp.assign(**{c: v[inv] if isinstance(v, np.ndarray) else [v[i] for i in inv] for c, v in cols.items()})

    def __repr__(self) -> str:
        return f"{self.encoder!r}.{self.made_by}()"

    def subtransformers(self) -> dict:
        return {}

    def fuse_rank_cutoff(self, k: int) -> pt.Transformer | None:
        """``stage % k`` of a document stage: the cutoff first, so fewer documents are encoded (none for queries)."""
        return pt.RankCutoff(k) >> self if self.frame == "document_frame" else None


class ProbQueryEncoder(TextEncoderStage):
    """``(qid, query)`` -> adds ``query_vec`` and the per-query distribution parameters; made by
    :meth:`ProbBiEncoder.query_encoder`."""

    def _columns(self) -> dict[str, Any]:
        return {"query_vec": object, **{c: np.float64 for c in self.encoder.param_columns}}

    def _encode(self, texts: list[str]) -> dict[str, Any]:
        emb, params = self.encoder.encode_queries_with_params(texts, self.batch_size, show_progress_bar=self.verbose)
        extra = {c: params[:, j] for j, c in enumerate(self.encoder.param_columns)} if params is not None else {}
        return {"query_vec": list(emb), **extra}


class ProbDocEncoder(TextEncoderStage):
    """``(docno, text)`` -> adds ``doc_vec`` (L2-normalised float32); made by :meth:`ProbBiEncoder.doc_encoder`."""

    frame, made_by = "document_frame", "doc_encoder"

    def _columns(self) -> dict[str, Any]:
        return {"doc_vec": object}

    def _encode(self, texts: list[str]) -> dict[str, Any]:
        show = self.verbose and len(texts) > self.batch_size
        return {"doc_vec": list(self.encoder.encode_docs(texts, self.batch_size, show_progress_bar=show))}


class Capped(pt.Transformer):
    """A transformer keeping at most ``num_results`` per query (``None``: all) of no subtransformers."""

    num_results: int | None

    def fuse_rank_cutoff(self, k: int) -> Any:
        """``transformer % k``: the same transformer with ``num_results = min(k, num_results)``."""
        k = positive_int("k", k)
        out = copy.copy(self)
        out.num_results = k if self.num_results is None else min(k, self.num_results)
        return out

    def subtransformers(self) -> dict:
        return {}


class DenseRetriever(Capped):
    """``S_{t,K}(q) = Top_K({d : cos(q, d) >= t_q})`` over a DenseIndex / FlexIndex (pEBR Appendix A); a subclass
    gives the per-query thresholds (:meth:`_thresholds`, ``-inf``: top-K), ``num_results`` is the cap K.

    A first stage (``query_vec`` in) or a re-ranker (``docno`` in: each query's candidates scored exactly); output
    ``qid, docno, score, rank`` (from 0) plus the input columns, and ``docid`` in the first stage. A repeated qid must
    repeat its query exactly (else ValueError naming qid, rows and column). ``searcher=`` (e.g.
    ``index.searcher("ivf_flat", nprobe=64)``) runs the first stage on an approximate backend instead of the exact
    scan; ``batch_size``: queries per block of the exact scan.
    """

    _needs_cap = False

    def __init__(
        self,
        index: Any,
        num_results: int | None = 1000,
        batch_size: int = QUERY_BATCH,
        drop_query_vec: bool = False,
        verbose: bool = False,
        searcher: Searcher | None = None,
    ) -> None:
        self.index = as_dense_index(index)
        self.searcher = check_searcher(searcher, len(self.index), self.index.dim, repr(self.index))
        self.num_results = positive_int("num_results", num_results, allow_none=not self._needs_cap)
        self.batch_size = positive_int("batch_size", batch_size)
        self.drop_query_vec = bool(drop_query_vec)
        self.verbose = bool(verbose)

    # ---- to implement ----------------------------------------------------------------------------------------
    def _columns(self) -> list[str]:
        """Input columns needed besides qid (and docno when re-ranking)."""
        return ["query_vec"]

    def _thresholds(self, queries: pd.DataFrame) -> np.ndarray:
        """One cosine threshold per row of ``queries`` (float64)."""
        raise NotImplementedError

    def _hint(self) -> str:
        return "add query vectors with an encoder, e.g. ProbBiEncoder(model).query_encoder() >> retriever"

    def _params(self) -> str:
        """The subclass' parameters for ``repr``, each followed by ``", "``."""
        return ""

    # ---- shared --------------------------------------------------------------------------------------------
    def __repr__(self) -> str:
        extra = "" if self.searcher is None else f", searcher={self.searcher.backend}[{self.searcher.setting()}]"
        return f"{type(self).__name__}({self.index!r}, {self._params()}num_results={self.num_results}{extra})"

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        rerank = validate_columns(self, inp, self._columns(), self._hint(), rerank=None)
        inp = inp.reset_index(drop=True)
        check_ids(inp, ["qid", "docno"] if rerank else ["qid"], type(self).__name__)
        out = self._rerank(inp) if rerank else self._retrieve(inp)
        return out.drop(columns="query_vec") if self.drop_query_vec and "query_vec" in out.columns else out

    def _retrieve(self, inp: pd.DataFrame) -> pd.DataFrame:
        if not len(inp):
            return empty_results(inp)
        _, first, Q = self._queries(inp)
        inp = inp.iloc[first].reset_index(drop=True)
        t = self._thresholds(inp)
        if self.searcher is None:
            hits = threshold_search(
                self.index, Q, t, self.num_results, batch_size=self.batch_size, verbose=self.verbose
            )
        else:
            hits = self.searcher.search(Q, t, self.num_results)
        counts = hits.counts
        self._check_counts(counts)
        out = inp.iloc[np.repeat(np.arange(len(inp)), counts)].reset_index(drop=True)
        rank = np.arange(int(hits.offsets[-1]), dtype=np.int64) - np.repeat(hits.offsets[:-1], counts)
        return out.assign(docno=docnos_of(self.index, hits.docids), docid=hits.docids, score=hits.scores, rank=rank)

    def _check_counts(self, counts: np.ndarray) -> None:
        """A look at the per-query result counts of one first-stage call (nothing here; see CDFCutoffRetriever)."""

    # ---- the query side of the input frame -------------------------------------------------------------------
    def _queries(self, inp: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(codes, first, Q)``: each row's query number, each query's first row and the unit query vectors; every
        row of a qid must carry its first row's ``query_vec`` and threshold parameters (errors name row and qid)."""
        codes, first = first_rows(inp["qid"])
        name, owner = row_namer(inp, rows=first), type(self).__name__  # name(i): the i-th query's first row
        raw = stack_arrays(inp["query_vec"].to_numpy()[first], "query_vec", name, owner, ndim=1)
        if len(first) < len(inp):
            params = {col: float_column(inp, col, owner) for col in self._columns() if col != "query_vec"}
            check_rows_match_query(inp, codes, first, "query_vec", raw, owner)
            rest = np.flatnonzero(first[codes] != np.arange(len(codes)))
            for col, vals in params.items():
                check_same_per_query(inp, codes, first, col, vals[rest], vals[first], owner, rows=rest)
        return codes, first, unit_rows(raw, self.index.dim, name)

    def _rerank(self, inp: pd.DataFrame) -> pd.DataFrame:
        base = inp.drop(columns=[c for c in ("score", "rank") if c in inp.columns])
        if not len(inp):
            return base.assign(score=pd.Series(dtype=np.float32), rank=pd.Series(dtype=np.int64))
        codes, first, Q = self._queries(inp)
        t32 = f32_ceil(self._thresholds(inp.iloc[first].reset_index(drop=True)))

        docids = self.index.candidate_docids(inp["docno"], "re-ranking needs the candidates' vectors in the index")
        scores = candidate_scores(self.index, Q, codes, docids)  # exact, as the search layer scores them
        keep = np.flatnonzero(scores >= t32[codes])
        order, rank = top_per_query(codes[keep], keep, scores[keep], self.num_results)  # ties keep the input order
        sel = keep[order]
        return base.iloc[sel].reset_index(drop=True).assign(score=scores[sel], rank=rank)


class TopKRetriever(DenseRetriever):
    """The ``num_results`` documents of highest cosine per query (pEBR's DSSM-topk, Sec. 4.1.2): the ranking of
    pyterrier-dr's ``np_retriever`` with the cutoff retrievers' output schema and ``searcher=``."""

    _needs_cap = True  # num_results must be an int

    def _thresholds(self, queries: pd.DataFrame) -> np.ndarray:
        return np.full(len(queries), -np.inf)
