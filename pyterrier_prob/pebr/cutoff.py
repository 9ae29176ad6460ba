"""Variable-depth dense retrieval: pEBR's CDF cutoff and the DSSM-score / DSSM-topk baselines.

pEBR (``shared/papers/pebr.md``) compares three ways of cutting off the items a two-tower model retrieves
(Sec. 4.1.2); Appendix A writes the classic ones as ``S_{t,K}(q) = Top_K({d : cos(q, d) >= t})``:

* **DSSM-topk** (:class:`TopKRetriever`): a fixed number K of items per query (t = -inf);
* **DSSM-score** (:class:`ScoreCutoffRetriever`): a fixed cosine threshold t, with K as the cap that
  "is mainly to save inference cost" (Appendix A);
* **pEBR** (:class:`CDFCutoffRetriever`): a per-query threshold ``t_q = F_q^{-1}(1 - p)`` read off the CDF
  of the query's learned relevant-item law (default p = 0.5, Sec. 4.1.2), so that a share p of that law lies
  above it -- broad (head) queries get low thresholds and many items, narrow (tail) queries few (Sec. 4.2).
  The law is the 1-D one of Sec. 3.2 (``dim=None``) or Appendix A's sphere-corrected one (``dim=n``), from
  :mod:`st_extensions.distributions`, with the per-query parameters read from the input frame
  (``query_temp``, or ``query_alpha``/``query_beta``), as :class:`~pyterrier_prob.ProbBiEncoder` writes them.

All three are one algorithm with per-query thresholds t_q (-inf for top-k) and cap K (``num_results``):
keep every document with ``cos(q, d) >= t_q``, then the K highest among them. Because the kept set of a
cosine threshold is always a head of the cosine ranking, this equals the top-K ranking truncated at t_q.
By default the search is exact and exhaustive (:func:`~pyterrier_prob.index.exact.threshold_search`, blocked BLAS
scans). Given ``searcher=`` (a :class:`~pyterrier_prob.index.search.Searcher`, e.g.
``index.searcher("ivf_flat", nprobe=64)``), the first stage runs on that backend instead -- an IVF range search, HNSW,
a faiss GPU index or shards -- with the same per-query thresholds and cap; re-ranking always scores the candidates
exactly. Scores are cosines: query vectors are L2-normalised here, and index vectors are normalised at indexing
(:class:`~pyterrier_prob.DenseIndex`) or, for a FlexIndex holding unnormalised vectors, divided by their norms on the
fly.

Every retriever works as a first stage (input: a query frame with ``query_vec``) and as a re-ranker of a
candidate frame (input with ``docno``: only each query's candidates are scored, their vectors looked up by
docno), supports ``retriever % k`` (:meth:`fuse_rank_cutoff`) and returns ``qid, docno, score, rank`` (rank
from 0, as :func:`pyterrier.model.add_ranks` assigns it) plus the input columns; first-stage output also
has ``docid`` (the row in the index), as pyterrier-dr's retrievers do.

Repeated qids: a query frame that lists a qid on several rows with the same ``query_vec`` (and distribution
parameters) is retrieved once per qid -- the first row's columns are kept, so no (qid, docno) appears twice and each
qid has one rank 0; rows of one qid with different values (in a query frame or a candidate frame) raise a ValueError
naming the qid, the two rows and the column. Missing qids / docnos and vectors that are missing, textual (after a CSV
round trip) or non-finite raise a ValueError naming the column and the row.

Relation to pyterrier-dr: ``FlexIndex.np_retriever(num_results=K)`` / ``faiss_flat_retriever`` on the same
index return the same top-K as :class:`TopKRetriever` (up to float rounding and ties; they score by inner
product, which is the cosine on a normalised :class:`~pyterrier_prob.DenseIndex`). :class:`TopKRetriever`
exists so that the three cutoffs share one implementation, one output schema and one cost profile.
"""

from __future__ import annotations

import copy
import math
import numbers
import warnings
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt

from pyterrier_prob.index.dense import as_dense_index
from pyterrier_prob.index.exact import (
    DOC_BATCH,
    QUERY_BATCH,
    CutoffHits,
    check_num_results,
    count_above,
    doc_scale,
    docnos_of,
    f32_ceil,
    threshold_search,
    unit_rows,
)
from pyterrier_prob.index.search import Searcher
from pyterrier_prob.pebr.encoders import PARAM_COLUMNS
from pyterrier_prob.validation import (
    EmptyRetrievalWarning,
    check_ids,
    check_rows_match_query,
    check_same_per_query,
    first_rows,
    float_column,
    row_namer,
    stack_arrays,
    user_stacklevel,
)
from st_extensions.distributions import BetaCosine, ExpCosine

_RERANK_ROWS = 65536  # candidate rows scored at once in re-ranking mode
EMPTY_WARN_MIN_QUERIES = 5
"""A CDF cutoff warns when more than half of the queries of a first-stage call, and at least this many, get nothing."""

__all__ = [
    "CDFCutoffRetriever",
    "CutoffHits",
    "EmptyRetrievalWarning",
    "ScoreCutoffRetriever",
    "TopKRetriever",
    "count_above",
    "threshold_search",
]

# --------------------------------------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------------------------------------


class _CutoffRetriever(pt.Transformer):
    """Shared machinery: input validation, first-stage and re-ranking modes, output frames, ``%``."""

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
        if searcher is not None:
            if not isinstance(searcher, Searcher):
                raise TypeError(
                    f"searcher must be a pyterrier_prob.index.Searcher (e.g. index.searcher('ivf_flat')), got "
                    f"{type(searcher).__name__}"
                )
            if searcher.n_docs != len(self.index) or searcher.dim != self.index.dim:
                raise ValueError(
                    f"searcher covers {searcher.n_docs} x {searcher.dim} vectors but {self.index!r} holds "
                    f"{len(self.index)} x {self.index.dim}: build it from this index (index.searcher(...))"
                )
        self.searcher = searcher
        self.num_results = check_num_results(num_results, allow_none=not self._needs_cap)
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.batch_size = int(batch_size)
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
        raise NotImplementedError

    # ---- shared --------------------------------------------------------------------------------------------
    def __repr__(self) -> str:
        extra = "" if self.searcher is None else f", searcher={self.searcher.backend}[{self.searcher.setting()}]"
        return f"{type(self).__name__}({self.index!r}, {self._params()}num_results={self.num_results}{extra})"

    def fuse_rank_cutoff(self, k: int) -> _CutoffRetriever:
        """``retriever % k``: the same retriever with ``num_results = min(k, num_results)``."""
        k = check_num_results(k, allow_none=False)
        out = copy.copy(self)
        out.num_results = k if self.num_results is None else min(k, self.num_results)
        return out

    def subtransformers(self) -> dict:
        return {}

    def _validate(self, inp: pd.DataFrame) -> bool:
        """Validate the input columns; True for re-ranking mode (input has docno), False for first stage."""
        cols = self._columns()
        try:
            with pt.validate.any(inp) as v:
                v.query_frame(extra_columns=cols, mode="retrieve")
                v.result_frame(extra_columns=cols, mode="rerank")
        except pt.validate.InputValidationError as e:
            missing = sorted({c for m in e.modes for c in m.missing_columns if c != "docno"})
            raise pt.validate.InputValidationError(
                f"{type(self).__name__} needs columns {['qid', *cols]} (plus docno to re-rank); missing "
                f"{missing}: {self._hint()}.",
                e.modes,
            ) from e
        return v.mode == "rerank"

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        rerank = self._validate(inp)
        inp = inp.reset_index(drop=True)
        check_ids(inp, ["qid", "docno"] if rerank else ["qid"], type(self).__name__)
        if rerank:
            out = self._rerank(inp)
        else:
            out = self._retrieve(inp)
        if self.drop_query_vec and "query_vec" in out.columns:
            out = out.drop(columns="query_vec")
        return out

    def _retrieve(self, inp: pd.DataFrame) -> pd.DataFrame:
        if not len(inp):
            return inp.assign(
                docno=pd.Series(dtype=object),
                docid=pd.Series(dtype=np.int64),
                score=pd.Series(dtype=np.float32),
                rank=pd.Series(dtype=np.int64),
            )
        inp = self._one_row_per_query(inp)
        Q = self._query_vectors(inp)
        t = self._thresholds(inp)
        if self.searcher is None:
            hits = threshold_search(
                self.index,
                Q,
                t,
                self.num_results,
                batch_size=self.batch_size,
                doc_batch_size=DOC_BATCH,
                verbose=self.verbose,
            )
        else:
            hits = self.searcher.search(Q, t, self.num_results)
        counts = hits.counts
        self._check_counts(counts)
        total = int(hits.offsets[-1])
        out = inp.iloc[np.repeat(np.arange(len(inp)), counts)].reset_index(drop=True)
        return out.assign(
            docno=docnos_of(self.index, hits.docids),
            docid=hits.docids,
            score=hits.scores,
            rank=np.arange(total, dtype=np.int64) - np.repeat(hits.offsets[:-1], counts),
        )

    def _check_counts(self, counts: np.ndarray) -> None:
        """A look at the per-query result counts of one first-stage call (nothing here; see CDFCutoffRetriever)."""

    # ---- the query side of the input frame -------------------------------------------------------------------
    def _param_columns(self) -> list[str]:
        """Columns besides ``query_vec`` that the thresholds are computed from."""
        return [c for c in self._columns() if c != "query_vec"]

    def _raw_query_vectors(self, inp: pd.DataFrame, rows: np.ndarray | None = None) -> np.ndarray:
        """``query_vec`` of ``rows`` (all by default) stacked as float32, with errors naming the row and qid."""
        values = inp["query_vec"].to_numpy()
        name = row_namer(inp)
        if rows is not None:
            values = values[rows]
            name = (lambda n, r: lambda i: n(int(r[i])))(name, rows)
        return stack_arrays(values, "query_vec", name, type(self).__name__, ndim=1)

    def _query_vectors(self, inp: pd.DataFrame) -> np.ndarray:
        """The unit query vectors of a frame with one row per query."""
        return unit_rows(self._raw_query_vectors(inp), self.index.dim, row_namer(inp))

    def _check_query_rows(self, inp: pd.DataFrame, codes: np.ndarray, first: np.ndarray, raw: np.ndarray) -> None:
        """Every row of a qid carries its first row's ``query_vec`` (``raw``, one per query) and parameters."""
        owner = type(self).__name__
        params = {col: float_column(inp, col, owner) for col in self._param_columns()}  # missing / non-numeric
        check_rows_match_query(inp, codes, first, "query_vec", raw, owner)
        rest = np.flatnonzero(first[codes] != np.arange(len(codes)))
        for col, vals in params.items():
            check_same_per_query(inp, codes, first, col, vals[rest], vals[first], owner, rows=rest)

    def _one_row_per_query(self, inp: pd.DataFrame) -> pd.DataFrame:
        """A query frame with each qid once (its first row); repeated qids must repeat their query exactly."""
        codes, first = first_rows(inp["qid"])
        if len(first) == len(inp):
            return inp
        self._check_query_rows(inp, codes, first, self._raw_query_vectors(inp, first))
        return inp.iloc[first].reset_index(drop=True)

    def _rerank(self, inp: pd.DataFrame) -> pd.DataFrame:
        base = inp.drop(columns=[c for c in ("score", "rank") if c in inp.columns])
        if not len(inp):
            return base.assign(score=pd.Series(dtype=np.float32), rank=pd.Series(dtype=np.int64))
        codes, first = first_rows(inp["qid"])
        n_q = len(first)
        raw = self._raw_query_vectors(inp, first)
        self._check_query_rows(inp, codes, first, raw)
        Q = unit_rows(raw, self.index.dim, lambda i: row_namer(inp)(int(first[i])))
        t32 = f32_ceil(self._thresholds(inp.iloc[first].reset_index(drop=True)))

        docids = np.asarray(self.index.docnos().inv[inp["docno"].to_numpy(dtype=str)], dtype=np.int64)
        if (docids < 0).any():
            bad = inp["docno"].to_numpy()[docids < 0]
            raise ValueError(
                f"{int((docids < 0).sum())} candidate docno(s) are not in {self.index!r} (e.g. {list(bad[:3])}): "
                "re-ranking needs the candidates' vectors in the index"
            )
        vecs, scale = self.index.vectors(), doc_scale(self.index)
        scores = np.empty(len(inp), np.float32)
        for r0 in range(0, len(inp), _RERANK_ROWS):
            r1 = min(len(inp), r0 + _RERANK_ROWS)
            d = docids[r0:r1]
            s = np.einsum("ij,ij->i", Q[codes[r0:r1]], np.asarray(vecs[d]))
            scores[r0:r1] = s if scale is None else s * scale[d]
        if not np.isfinite(scores).all():  # the query vectors are finite: a candidate's stored vector is not
            d = int(docids[np.flatnonzero(~np.isfinite(scores))[0]])
            raise ValueError(
                f"{str(self.index.index_path / 'vecs.f4')!r} is corrupt: the vector of row {d} (docno "
                f"{str(self.index.docnos().fwd[d])!r}) has non-finite values (nan or inf); rebuild the index"
            )

        keep = np.flatnonzero(scores >= t32[codes])
        order = np.lexsort((-scores[keep], codes[keep]))  # stable: ties keep the input order
        sel = keep[order]
        c = codes[sel]
        ends = np.cumsum(np.bincount(c, minlength=n_q))
        rank = np.arange(sel.size, dtype=np.int64) - (ends - np.bincount(c, minlength=n_q))[c]
        if self.num_results is not None:
            m = rank < self.num_results
            sel, rank = sel[m], rank[m]
        return base.iloc[sel].reset_index(drop=True).assign(score=scores[sel], rank=rank)


class CDFCutoffRetriever(_CutoffRetriever):
    """pEBR's probabilistic cutoff (Sec. 4.1.2 "pEBR", Appendix A): keep ``cos(q, d) >= t_q = F_q^{-1}(1 - p)``.

    F_q is the query's learned law of the cosine of its relevant items, built from the per-query parameters
    in the input frame (written by :meth:`ProbBiEncoder.query_encoder`):

    * ``family="beta"`` (BetaNCE, the paper's default): ``query_temp``; Beta law alpha = 1 / tau_q, beta = 1
      (Eq. 3);
    * ``family="exp"`` (ExpNCE, Sec. 3.2.1): ``query_temp``; truncated exponential law with temperature tau_q;
    * ``family="beta_mle"`` (Sec. 3.1): ``query_alpha``, ``query_beta`` (the relevant-item Beta law).

    A share p of the relevant-item law lies above t_q (default p = 0.5, Sec. 4.1.2); larger p, lower
    thresholds, deeper lists. Each query gets its own depth, capped at ``num_results`` (the highest-scoring
    kept documents; ``None``: no cap). A level that fits the model is best chosen on dev queries, with
    :func:`pyterrier_prob.evaluation.calibrate_mean_k` (a mean depth) or
    :class:`~pyterrier_prob.pebr.rlt.RecallTargetCutoff` (a recall target). When more than half of the queries of a
    first-stage call (at least five) retrieve nothing, an :class:`~pyterrier_prob.validation.EmptyRetrievalWarning`
    (a ``UserWarning``) says so.

    Args:
        index: a :class:`~pyterrier_prob.DenseIndex` or :class:`pyterrier_dr.FlexIndex`.
        p: share of the relevant-item law to keep, strictly inside (0, 1).
        family: ``"beta"``, ``"exp"`` or ``"beta_mle"`` -- the family of the encoder's head.
        dim: ``None`` for the 1-D law of Sec. 3.2; the embedding dimension n for Appendix A's sphere-corrected
            law (Eq. 4).
        num_results: cap per query.
        batch_size: queries per search block.
        drop_query_vec: drop ``query_vec`` from the output.
        verbose: progress bar over query blocks.
        searcher: run the first stage on this backend (``index.searcher("ivf_flat", nprobe=64)``, HNSW, GPU,
            shards; :mod:`pyterrier_prob.index.search`) instead of the exact scan; same thresholds and cap.

    Example::

        pipeline = encoder.query_encoder() >> CDFCutoffRetriever(index, p=0.5, family=encoder.family)
        rerank = bm25 % 1000 >> encoder.query_encoder() >> CDFCutoffRetriever(index, p=0.9)
    """

    def __init__(
        self,
        index: Any,
        p: float = 0.5,
        family: str = "beta",
        dim: int | None = None,
        num_results: int | None = 1000,
        batch_size: int = QUERY_BATCH,
        drop_query_vec: bool = False,
        verbose: bool = False,
        searcher: Searcher | None = None,
    ) -> None:
        super().__init__(index, num_results, batch_size, drop_query_vec, verbose, searcher)
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not (0.0 < float(p) < 1.0):
            raise ValueError(f"p must be a number strictly inside (0, 1) (the share of the law kept), got {p!r}")
        if family not in PARAM_COLUMNS:
            raise ValueError(f"family must be one of {tuple(PARAM_COLUMNS)}, got {family!r}")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, numbers.Integral) or dim < 2):
            raise ValueError(f"dim must be None or the embedding dimension (an int >= 2), got {dim!r}")
        self.p = float(p)
        self.family = family
        self.dim = None if dim is None else int(dim)
        if self.index.index_path.exists():
            self._check_dim()

    def _check_dim(self) -> None:
        """The sphere-corrected law's ``dim`` is the index's vector dimension."""
        if self.dim is not None and self.dim != self.index.dim:
            raise ValueError(
                f"dim={self.dim} (the sphere-corrected law's embedding dimension, Appendix A) differs from the "
                f"{self.index.dim}-dim vectors of {self.index!r}: pass dim={self.index.dim} (or None for the 1-D law)"
            )

    def _columns(self) -> list[str]:
        params = PARAM_COLUMNS[self.family][:2] if self.family == "beta_mle" else PARAM_COLUMNS[self.family]
        return ["query_vec", *params]

    def _hint(self) -> str:
        return (
            f"the {self.family!r} cutoff reads each query's distribution parameters from the frame; encode the "
            f"queries with ProbBiEncoder(model).query_encoder() where model has a {self.family!r} "
            "QueryDistributionHead (st_extensions.build_pebr_model(..., family=...))"
        )

    def _params(self) -> str:
        return f"p={self.p}, family={self.family!r}, dim={self.dim}, "

    def distribution(self, queries: pd.DataFrame) -> ExpCosine | BetaCosine:
        """The per-query relevant-item laws of the rows of ``queries``."""
        self._check_dim()
        cols = self._columns()[1:]
        values = [float_column(queries, c, type(self).__name__) for c in cols]
        try:
            if self.family == "exp":
                return ExpCosine(values[0], dim=self.dim)
            if self.family == "beta":
                return BetaCosine.from_temperature(values[0], dim=self.dim)
            return BetaCosine(values[0], values[1], dim=self.dim)
        except ValueError as e:
            raise ValueError(f"bad distribution parameters in columns {cols}: {e}") from e

    def _thresholds(self, queries: pd.DataFrame) -> np.ndarray:
        return np.asarray(self.distribution(queries).cutoff(self.p), dtype=np.float64).reshape(-1)

    def _check_counts(self, counts: np.ndarray) -> None:
        """Warn (:class:`~pyterrier_prob.validation.EmptyRetrievalWarning`) when more than half of the queries of a
        first-stage call (at least :data:`EMPTY_WARN_MIN_QUERIES`) retrieve nothing: the level p is uncalibrated."""
        n = len(counts)
        empty = int(np.count_nonzero(np.asarray(counts) == 0))
        if n >= EMPTY_WARN_MIN_QUERIES and 2 * empty > n:
            warnings.warn(
                f"CDFCutoffRetriever: {empty} of {n} queries retrieved no document at level p={self.p:g} (the "
                f"{self.family!r} law puts their thresholds t_q above every document's cosine). An "
                "uncalibrated p rarely fits a model: pick it on dev queries with "
                "pyterrier_prob.evaluation.calibrate_mean_k (the level at which the mean depth is k) or cut a deeper "
                "ranking with RecallTargetCutoff (pyterrier_prob.pebr.rlt; the level that meets a recall target)",
                EmptyRetrievalWarning,
                stacklevel=user_stacklevel(),
            )


class ScoreCutoffRetriever(_CutoffRetriever):
    """DSSM-score (Sec. 4.1.2): keep ``cos(q, d) >= threshold``, one threshold for all queries, capped at K.

    Appendix A's ``S_{t,K}`` with a fixed t: "the cosine threshold does not account for the variability of item
    distributions across different queries, while the top-K threshold is mainly to save inference cost".

    Args:
        index: a :class:`~pyterrier_prob.DenseIndex` or :class:`pyterrier_dr.FlexIndex`.
        searcher: as for :class:`CDFCutoffRetriever`.
        threshold: the cosine threshold (finite).
        num_results: the cap K (``None``: no cap).
    """

    def __init__(
        self,
        index: Any,
        threshold: float,
        num_results: int | None = 1000,
        batch_size: int = QUERY_BATCH,
        drop_query_vec: bool = False,
        verbose: bool = False,
        searcher: Searcher | None = None,
    ) -> None:
        super().__init__(index, num_results, batch_size, drop_query_vec, verbose, searcher)
        if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not math.isfinite(threshold):
            raise ValueError(f"threshold must be a finite number (a cosine), got {threshold!r}")
        self.threshold = float(threshold)

    def _params(self) -> str:
        return f"threshold={self.threshold}, "

    def _thresholds(self, queries: pd.DataFrame) -> np.ndarray:
        return np.full(len(queries), self.threshold)


class TopKRetriever(_CutoffRetriever):
    """DSSM-topk (Sec. 4.1.2): the ``num_results`` documents of highest cosine for every query.

    Same ranking as pyterrier-dr's ``FlexIndex.np_retriever(num_results=K)`` on a normalised index; this
    class shares the cutoff retrievers' implementation and output schema (``searcher=`` as for
    :class:`CDFCutoffRetriever`).
    """

    _needs_cap = True

    def __init__(
        self,
        index: Any,
        num_results: int = 1000,
        batch_size: int = QUERY_BATCH,
        drop_query_vec: bool = False,
        verbose: bool = False,
        searcher: Searcher | None = None,
    ) -> None:
        super().__init__(index, num_results, batch_size, drop_query_vec, verbose, searcher)

    def _params(self) -> str:
        return ""

    def _thresholds(self, queries: pd.DataFrame) -> np.ndarray:
        return np.full(len(queries), -np.inf)
