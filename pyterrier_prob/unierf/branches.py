"""Multi-branch (UniERF) retrieval for PyTerrier: branch inputs, branch encoders, merged retrieval, training data.

UniERF (Jiang et al., KDD'25, ``shared/papers/unierf.md``) serves several embedding-based retrieval branches
from one jointly trained query tower and merges their candidate sets (Sec. 4; Alg. 1 lines 27-30:
``Z = {TopK(h^sem), TopK(h^per), TopK(h^sim)}``). The model side -- the branch heads, their loss and the
training-row layout -- is :mod:`st_extensions.unierf`; this module adapts the e-commerce branches to text
retrieval with PyTerrier frames:

* a branch's input text is built from query-frame columns (:data:`DEFAULT_BRANCH_INPUTS`): ``semantic`` reads
  ``query``; ``trigger`` reads ``query`` and ``trigger_text`` (the text of a document the user is looking at;
  :class:`TriggerText` adds the top document of a first-stage retriever, e.g. BM25); ``context`` reads ``query``
  and ``context_text`` (other query fields or history, when the topics carry them);
* :class:`UniERFEncoder` adds one query vector column per branch, ``query_vec_<branch>``; its documents are the
  shared encoder's plain document embeddings, so one :class:`~pyterrier_prob.DenseIndex` serves every branch;
* :class:`MultiBranchRetriever` searches every branch against that index and merges the candidate sets into a
  fixed total budget B with per-branch quotas (:func:`branch_quotas`, :func:`merge_branch_lists`), naming in
  the ``branch`` column every branch that found each document;
* :func:`unierf_training_data` mines the differentiated negatives of Sec. 4.3 and returns the training rows of
  :func:`st_extensions.build_unierf_dataset`.
"""

from __future__ import annotations

import copy
import math
import numbers
import os
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import pyterrier as pt
from datasets import Dataset

from pyterrier_prob.index.dense import as_dense_index
from pyterrier_prob.index.exact import QUERY_BATCH, docnos_of, threshold_search
from pyterrier_prob.validation import check_ids, check_rows_match_query, first_rows, row_namer, stack_arrays
from st_extensions.modules.branches import check_branch_names
from st_extensions.unierf import SEP, branch_text, build_unierf_dataset, encode_branches, find_branches

__all__ = [
    "DEFAULT_BRANCH_INPUTS",
    "MultiBranchRetriever",
    "TriggerText",
    "UniERFEncoder",
    "UniERFQueryEncoder",
    "branch_quotas",
    "merge_branch_lists",
    "query_vec_column",
    "unierf_training_data",
]

#: Query-frame columns a branch's input text is built from (joined by ``[SEP]``, :func:`st_extensions.branch_text`).
DEFAULT_BRANCH_INPUTS: dict[str, tuple[str, ...]] = {
    "semantic": ("query",),
    "trigger": ("query", "trigger_text"),
    "context": ("query", "context_text"),
}


def query_vec_column(branch: str) -> str:
    """The frame column holding ``branch``'s query vectors: ``query_vec_<branch>``."""
    return f"query_vec_{branch}"


def _branch_inputs(branches: Sequence[str], inputs: Mapping[str, Sequence[str]] | None) -> dict[str, tuple[str, ...]]:
    """branch -> input columns, from ``inputs`` or :data:`DEFAULT_BRANCH_INPUTS`; a clear error for the rest."""
    inputs = dict(inputs or {})
    unknown = [b for b in inputs if b not in branches]
    if unknown:
        raise ValueError(f"inputs given for unknown branches {unknown}: the branches are {list(branches)}")
    out: dict[str, tuple[str, ...]] = {}
    for b in branches:
        cols = inputs.get(b, DEFAULT_BRANCH_INPUTS.get(b))
        if cols is None:
            raise ValueError(
                f"no input columns for branch {b!r}: pass inputs={{{b!r}: ['query', ...]}} (defaults exist for "
                f"{sorted(DEFAULT_BRANCH_INPUTS)})"
            )
        if isinstance(cols, str) or not cols or not all(isinstance(c, str) for c in cols):
            raise ValueError(f"inputs[{b!r}] must be a non-empty list of column names, got {cols!r}")
        out[b] = tuple(cols)
    return out


def _frame_branch_texts(frame: pd.DataFrame, inputs: Mapping[str, Sequence[str]], sep: str) -> dict[str, list[str]]:
    """branch -> one input text per row of ``frame`` (:func:`st_extensions.branch_text` of the input columns)."""
    return {
        b: [branch_text(parts, sep) for parts in zip(*(frame[c].tolist() for c in cols))] for b, cols in inputs.items()
    }


def _pos_int(name: str, value: Any, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")
    return int(value)


# --------------------------------------------------------------------------------------------------------
# branch inputs and encoders
# --------------------------------------------------------------------------------------------------------


class TriggerText(pt.Transformer):
    """``(qid, query)`` -> adds ``trigger_docno`` and ``trigger_text``: the document a first stage ranks at ``rank``.

    UniERF's similar-item branch reads the items the user saw on the previous page (trigger items, Sec. 4.1.3);
    in benchmarks without such logs, the stand-in is the top document of a first-stage retriever such as BM25.
    Queries for which the retriever finds nothing get ``trigger_docno`` None and an empty ``trigger_text`` (the
    trigger branch then reads the query alone).

    Args:
        retriever: a first-stage retriever, ``(qid, query)`` -> ``(qid, docno, score, rank)`` (e.g. PISA BM25).
        texts: the document texts: a mapping docno -> text, or a transformer adding ``text_field`` to a result
            frame (e.g. ``pt.text.get_text(dataset, "text")``).
        text_field: the column ``texts`` adds (when a transformer).
        rank: which rank (from 0) to take.
        column: the name of the text column added.
    """

    def __init__(
        self,
        retriever: pt.Transformer,
        texts: Mapping[str, str] | pt.Transformer,
        text_field: str = "text",
        rank: int = 0,
        column: str = "trigger_text",
    ) -> None:
        if not isinstance(retriever, pt.Transformer):
            raise TypeError(f"retriever must be a pt.Transformer, got {type(retriever).__name__}")
        if not isinstance(texts, (Mapping, pt.Transformer)):
            raise TypeError(f"texts must be a mapping docno -> text or a pt.Transformer, got {type(texts).__name__}")
        if isinstance(rank, bool) or not isinstance(rank, numbers.Integral) or rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {rank!r}")
        self.retriever = retriever
        self.texts = texts
        self.text_field = text_field
        self.rank = int(rank)
        self.column = column

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        with pt.validate.any(inp) as v:
            v.query_frame(extra_columns=["query"])
        if not len(inp):
            return inp.assign(trigger_docno=pd.Series(dtype=object), **{self.column: pd.Series(dtype=object)})
        queries = inp[["qid", "query"]].drop_duplicates("qid").reset_index(drop=True)
        res = (self.retriever % (self.rank + 1)).compile()(queries)
        if len(res):
            res = res.sort_values(["qid", "score"], ascending=[True, False], kind="stable")
            res = res.groupby("qid", sort=False).nth(self.rank).reset_index(drop=True)
        if not len(res):
            docnos: dict[str, Any] = {}
            texts: dict[str, str] = {}
        elif isinstance(self.texts, Mapping):
            docnos = dict(zip(res["qid"], res["docno"]))
            texts = {q: self.texts.get(d, "") for q, d in docnos.items()}
        else:
            loaded = self.texts(res[["qid", "docno"]])
            if self.text_field not in loaded.columns:
                raise ValueError(f"the texts transformer did not add the column {self.text_field!r}")
            docnos = dict(zip(loaded["qid"], loaded["docno"]))
            texts = dict(zip(loaded["qid"], loaded[self.text_field].fillna("").astype(str)))
        qids = inp["qid"].tolist()
        return inp.assign(
            trigger_docno=pd.Series([docnos.get(q) for q in qids], index=inp.index, dtype=object),
            **{self.column: pd.Series([texts.get(q, "") for q in qids], index=inp.index, dtype=object)},
        )

    def __repr__(self) -> str:
        return f"TriggerText({self.retriever!r}, rank={self.rank})"


class UniERFEncoder:
    """Encodes queries into one vector per UniERF branch, and documents once for all branches (a factory).

    * :meth:`query_encoder`: a query frame with the branches' input columns (:data:`DEFAULT_BRANCH_INPUTS`, or
      ``inputs``) -> adds ``query_vec_<branch>`` (float32, L2-normalised) per branch;
    * :meth:`doc_encoder`: ``(docno, text)`` -> adds ``doc_vec``, the shared encoder's document embedding
      (``encode_document``, normalised): one :class:`~pyterrier_prob.DenseIndex` for every branch.

    Example::

        model = st_extensions.build_unierf_model(branches=("semantic", "trigger"))  # or load_model(path)
        encoder = UniERFEncoder(model)
        index = (encoder.doc_encoder() >> DenseIndex("docs.flex").indexer()).index(dataset.get_corpus_iter())
        pipeline = (
            TriggerText(bm25, texts) >> encoder.query_encoder()
            >> MultiBranchRetriever(index, encoder.branches, num_results=100)
        )

    Args:
        model: a SentenceTransformer with a MultiBranchQueryEncoder, or a path to one
            (:func:`st_extensions.load_model`).
        inputs: branch -> query-frame columns its input text is built from (defaults: :data:`DEFAULT_BRANCH_INPUTS`).
        branches: the branches to encode (default: all of the model's).
        sep: separator between the input parts (``[SEP]``).
        batch_size: encoding batch size.
        text_field: the document column to encode.
        verbose: progress bars while encoding.
    """

    def __init__(
        self,
        model: Any,
        inputs: Mapping[str, Sequence[str]] | None = None,
        branches: Sequence[str] | None = None,
        sep: str = SEP,
        batch_size: int = 32,
        text_field: str = "text",
        verbose: bool = False,
    ) -> None:
        if isinstance(model, (str, os.PathLike)):
            from st_extensions import load_model

            model = load_model(str(model))
        head = find_branches(model)
        self.model = model
        names = list(head.branches) if branches is None else check_branch_names(branches)
        for b in names:
            head.branch_index(b)
        self.branches = names
        self.inputs = _branch_inputs(names, inputs)
        self.sep = sep
        self.batch_size = _pos_int("batch_size", batch_size)
        self.text_field = text_field
        self.verbose = bool(verbose)

    @property
    def input_columns(self) -> list[str]:
        """Every query-frame column some branch reads."""
        return list(dict.fromkeys(c for cols in self.inputs.values() for c in cols))

    @property
    def vector_columns(self) -> list[str]:
        """The columns :meth:`query_encoder` adds: ``query_vec_<branch>`` per branch."""
        return [query_vec_column(b) for b in self.branches]

    def branch_texts(self, frame: pd.DataFrame) -> dict[str, list[str]]:
        """branch -> one input text per row of ``frame``."""
        return _frame_branch_texts(frame, self.inputs, self.sep)

    def encode(self, frame: pd.DataFrame, batch_size: int | None = None) -> dict[str, np.ndarray]:
        """branch -> ``(len(frame), dim)`` float32 unit vectors; identical input texts are encoded once."""
        out: dict[str, np.ndarray] = {}
        texts = self.branch_texts(frame)
        uniq: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for b, t in texts.items():
            u, inv = np.unique(np.asarray(t, dtype=object).astype(str), return_inverse=True)
            uniq[b] = (u, inv.reshape(-1))
        emb = encode_branches(
            self.model,
            {b: u.tolist() for b, (u, _) in uniq.items()},
            batch_size=batch_size or self.batch_size,
            show_progress_bar=self.verbose,
        )
        for b, (_, inv) in uniq.items():
            out[b] = emb[b][inv]
        return out

    def query_encoder(self, batch_size: int | None = None) -> UniERFQueryEncoder:
        """Transformer adding ``query_vec_<branch>`` per branch to a query frame."""
        return UniERFQueryEncoder(self, batch_size=batch_size)

    def doc_encoder(self, batch_size: int | None = None, verbose: bool | None = None) -> pt.Transformer:
        """Transformer adding ``doc_vec`` (the shared document tower, normalised) to a document frame
        (``verbose``: progress bars; default the encoder's)."""
        from pyterrier_prob.pebr.encoders import ProbBiEncoder

        bi = ProbBiEncoder(self.model, batch_size=self.batch_size, text_field=self.text_field, verbose=self.verbose)
        return bi.doc_encoder(batch_size=batch_size, verbose=verbose)

    def __repr__(self) -> str:
        name = getattr(getattr(self.model, "model_card_data", None), "base_model", None) or type(self.model).__name__
        return f"UniERFEncoder({name!r}, branches={self.branches})"


class UniERFQueryEncoder(pt.Transformer):
    """A query frame with the branches' input columns -> adds ``query_vec_<branch>`` per branch; made by
    :meth:`UniERFEncoder.query_encoder`."""

    def __init__(self, encoder: UniERFEncoder, batch_size: int | None = None) -> None:
        self.encoder = encoder
        self.batch_size = _pos_int("batch_size", batch_size, allow_none=True) or encoder.batch_size

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        cols = self.encoder.input_columns
        try:
            with pt.validate.any(inp) as v:
                v.query_frame(extra_columns=cols)
                v.columns(includes=["qid", *cols])
        except pt.validate.InputValidationError as e:
            missing = [c for c in ["qid", *cols] if c not in inp.columns]
            hint = (
                " (add trigger_text with TriggerText(bm25, texts) >> encoder.query_encoder())"
                if "trigger_text" in missing
                else ""
            )
            raise pt.validate.InputValidationError(
                f"{self!r} needs a query frame with columns {['qid', *cols]}; missing {missing}{hint}", e.modes
            ) from e
        if not len(inp):
            return inp.assign(**{c: pd.Series(dtype=object) for c in self.encoder.vector_columns})
        vecs = self.encoder.encode(inp, batch_size=self.batch_size)
        return inp.assign(**{query_vec_column(b): list(v) for b, v in vecs.items()})

    def __repr__(self) -> str:
        return f"{self.encoder!r}.query_encoder()"

    def subtransformers(self) -> dict:
        return {}


# --------------------------------------------------------------------------------------------------------
# merging the branches
# --------------------------------------------------------------------------------------------------------


def branch_quotas(budget: int, weights: Sequence[float]) -> np.ndarray:
    """Split a total ``budget`` into per-branch quotas proportional to ``weights`` (largest remainder).

    Each branch gets ``floor(B w_b / sum w)``; the slots left over go one each to the branches with the largest
    remainders (ties: the earlier branch). The quotas sum to B exactly; equal weights give equal shares (up to
    one slot, the earlier branches first).

    Returns:
        ``(n_branches,)`` int64.
    """
    budget = int(_pos_int("budget", budget))
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not w.size or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"weights must be finite and > 0, one per branch, got {list(np.atleast_1d(w))}")
    exact = budget * w / w.sum()
    quotas = np.floor(exact).astype(np.int64)
    left = budget - int(quotas.sum())
    order = sorted(range(w.size), key=lambda i: (-(exact[i] - quotas[i]), i))
    for i in order[:left]:
        quotas[i] += 1
    return quotas


def merge_branch_lists(
    lists: Sequence[tuple[np.ndarray, np.ndarray]], budget: int, quotas: Sequence[int]
) -> list[tuple[int, float, list[int], int]]:
    """Merge per-branch ranked lists into one deduplicated set of at most ``budget`` documents.

    The branches walk down their lists in rounds, one document per branch per round; round r starts with branch
    ``r mod n`` (then n - 1 more in cyclic order), so no branch is always first to a shared document. A
    document not selected yet is *claimed* by the branch that meets it first and counts against that branch's
    quota; a document already selected counts against no quota (dedup frees the slot), and the branch that met it
    is added to its finders and keeps walking. A branch stops when it has claimed its quota. When every branch has
    stopped and fewer than ``budget`` documents are selected (some branch ran out of candidates), the branches with
    candidates left keep walking, quotas lifted, until ``budget`` documents are selected or all lists are spent.
    Last, each branch also walks over the run of already-selected documents right after where it stopped (they
    cost no slot), so that e.g. two branches with the same list both find every document.
    So exactly ``min(budget, |union of the lists|)`` documents come out, each branch claims ``min(quota, what
    it can)`` of them before any redistribution, and each document's score is the best score any branch that
    found it gave it.

    Args:
        lists: per branch, ``(docids, scores)`` sorted by score, descending (at least ``budget`` long for an exact
            merge: no branch walks further than ``budget`` documents).
        budget: the total B.
        quotas: per branch, its quota (:func:`branch_quotas`).

    Returns:
        ``[(docid, score, finders, claimer)]`` in selection order; ``finders`` are branch positions, ascending.
    """
    n = len(lists)
    if len(quotas) != n:
        raise ValueError(f"need one quota per branch ({n}), got {len(quotas)}")
    docs = [np.asarray(d).tolist() for d, _ in lists]
    scores = [np.asarray(s, dtype=np.float64).tolist() for _, s in lists]
    selected: dict[int, list] = {}  # docid -> [score, finders set, claimer]
    claimed = [0] * n
    pos = [0] * n

    def step(b: int) -> None:
        d, s = docs[b][pos[b]], scores[b][pos[b]]
        pos[b] += 1
        entry = selected.get(d)
        if entry is None:
            selected[d] = [s, {b}, b]
            claimed[b] += 1
        else:
            entry[1].add(b)
            if s > entry[0]:
                entry[0] = s

    rounds = 0
    for lifted in (False, True):
        while len(selected) < budget:
            walking = [b for b in range(n) if pos[b] < len(docs[b]) and (lifted or claimed[b] < quotas[b])]
            if not walking:
                break
            start = rounds % n
            rounds += 1
            for b in sorted(walking, key=lambda b: (b - start) % n):
                if len(selected) >= budget:
                    break
                if pos[b] < len(docs[b]) and (lifted or claimed[b] < quotas[b]):
                    step(b)
    for b in range(n):  # the documents right after a branch's walk that are already selected cost it nothing
        while pos[b] < len(docs[b]) and docs[b][pos[b]] in selected:
            step(b)
    return [(d, e[0], sorted(e[1]), e[2]) for d, e in selected.items()]


class MultiBranchRetriever(pt.Transformer):
    """Searches every UniERF branch against one shared index and merges the candidate sets into a budget of B.

    UniERF retrieves ``TopK(h^b)`` for every branch b and takes the union (Alg. 1 lines 27-30); here the union is
    deduplicated and cut to a fixed total budget B = ``num_results`` with per-branch quotas, as a multi-channel
    retrieval system allocates its candidate slots:

    * quotas: B is split by ``weights`` (default equal) with the largest-remainder rule (:func:`branch_quotas`);
    * each branch's exact top-B (cosine, :func:`~pyterrier_prob.threshold_search`) is read from its
      ``query_vec_<branch>`` column, and the lists are merged by :func:`merge_branch_lists`: a document found by
      several branches is kept once with its best score, and the slot it frees is filled from the branches' next
      candidates, so every query gets exactly ``min(B, |union|)`` documents;
    * ``branch`` names every branch that found the document on its walk down its list (:func:`merge_branch_lists`),
      e.g. ``"semantic|trigger"``, in the retriever's branch order; ``score`` is the best cosine among them;
      ``rank`` (from 0) orders the merged set by score (ties: lower docid first).

    ``retriever % B`` returns this retriever with budget ``min(B, num_results)`` -- the quotas are recomputed on
    the smaller budget, which is not the same as cutting the merged list of the larger one; ``%`` on a pipeline
    ending in this retriever folds the same way under ``pipeline.compile()`` (:meth:`fuse_rank_cutoff`).

    Output: ``qid, docno, docid, score, rank, branch`` plus the input's query columns (the ``query_vec_<branch>``
    columns dropped with ``drop_query_vec=True``).

    Args:
        index: a :class:`~pyterrier_prob.DenseIndex` (or pyterrier-dr FlexIndex) of the shared document embeddings.
        branches: the branch names to search, in order (their ``query_vec_<branch>`` columns must be present).
        num_results: the total budget B.
        weights: per-branch quota weights (a mapping branch -> weight, or one weight per branch); default equal.
        batch_size: queries per search block.
        drop_query_vec: drop the ``query_vec_<branch>`` columns from the output.
        verbose: progress bars in the search.
    """

    def __init__(
        self,
        index: Any,
        branches: Sequence[str],
        num_results: int = 1000,
        weights: Mapping[str, float] | Sequence[float] | None = None,
        batch_size: int = QUERY_BATCH,
        drop_query_vec: bool = False,
        verbose: bool = False,
    ) -> None:
        self.index = as_dense_index(index)
        self.branches = check_branch_names(branches)
        self.num_results = int(_pos_int("num_results", num_results))
        if weights is None:
            w = [1.0] * len(self.branches)
        elif isinstance(weights, Mapping):
            unknown = [b for b in weights if b not in self.branches]
            if unknown:
                raise ValueError(f"weights for unknown branches {unknown}: the branches are {self.branches}")
            w = [float(weights.get(b, 1.0)) for b in self.branches]
        else:
            w = [float(x) for x in weights]
            if len(w) != len(self.branches):
                raise ValueError(f"need one weight per branch ({len(self.branches)}), got {len(w)}")
        if not all(math.isfinite(x) and x > 0 for x in w):
            raise ValueError(f"weights must be finite and > 0, got {w}")
        self.weights = w
        self.batch_size = int(_pos_int("batch_size", batch_size))
        self.drop_query_vec = bool(drop_query_vec)
        self.verbose = bool(verbose)

    @property
    def quotas(self) -> dict[str, int]:
        """branch -> its quota of the budget :attr:`num_results`."""
        return dict(zip(self.branches, branch_quotas(self.num_results, self.weights).tolist()))

    @property
    def vector_columns(self) -> list[str]:
        return [query_vec_column(b) for b in self.branches]

    def __repr__(self) -> str:
        weights = "" if len(set(self.weights)) == 1 else f", weights={self.weights}"
        return (
            f"MultiBranchRetriever({self.index!r}, branches={self.branches}, num_results={self.num_results}{weights})"
        )

    def fuse_rank_cutoff(self, k: int) -> MultiBranchRetriever:
        """``retriever % k``: the same retriever with budget ``min(k, num_results)`` (quotas recomputed)."""
        k = int(_pos_int("k", k))
        out = copy.copy(self)
        out.num_results = min(k, self.num_results)
        return out

    def __mod__(self, k: int) -> MultiBranchRetriever:
        # Cutting the merged list of a larger budget is not the merge at a smaller budget: fold the cutoff here.
        return self.fuse_rank_cutoff(k)

    def subtransformers(self) -> dict:
        return {}

    def _one_row_per_query(self, inp: pd.DataFrame) -> pd.DataFrame:
        """Each qid once (its first row): a repeated qid must repeat every branch vector exactly (a ValueError
        naming the qid, the rows and the column otherwise), so no (qid, docno) is returned twice."""
        if not len(inp):
            return inp
        check_ids(inp, ["qid"], "MultiBranchRetriever")
        codes, first = first_rows(inp["qid"])
        if len(first) == len(inp):
            return inp
        owner = "MultiBranchRetriever"
        for col in self.vector_columns:
            reference = stack_arrays(inp[col].to_numpy()[first], col, lambda i: row_namer(inp)(int(first[i])), owner)
            check_rows_match_query(inp, codes, first, col, reference, owner)
        return inp.iloc[first].reset_index(drop=True)

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        cols = self.vector_columns
        try:
            pt.validate.query_frame(inp, extra_columns=cols)
        except pt.validate.InputValidationError as e:
            missing = [c for c in ["qid", *cols] if c not in inp.columns]
            extra = " (MultiBranchRetriever is a first-stage retriever: drop docno)" if "docno" in inp.columns else ""
            raise pt.validate.InputValidationError(
                f"MultiBranchRetriever needs a query frame with columns {['qid', *cols]}; missing {missing}{extra}: "
                "add the branch vectors with UniERFEncoder(model).query_encoder()",
                e.modes,
            ) from e
        inp = self._one_row_per_query(inp.reset_index(drop=True))
        base = inp.drop(columns=cols) if self.drop_query_vec else inp
        if not len(inp):
            return base.assign(
                docno=pd.Series(dtype=object),
                docid=pd.Series(dtype=np.int64),
                score=pd.Series(dtype=np.float32),
                rank=pd.Series(dtype=np.int64),
                branch=pd.Series(dtype=object),
            )
        budget = self.num_results
        quotas = branch_quotas(budget, self.weights)
        hits = [
            threshold_search(
                self.index,
                inp[query_vec_column(b)].tolist(),
                -np.inf,
                num_results=budget,
                batch_size=self.batch_size,
                verbose=self.verbose,
            )
            for b in self.branches
        ]
        rows_q, rows_d, rows_s, rows_b = [], [], [], []
        for qi in range(len(inp)):
            lists = [
                (h.docids[h.offsets[qi] : h.offsets[qi + 1]], h.scores[h.offsets[qi] : h.offsets[qi + 1]]) for h in hits
            ]
            merged = merge_branch_lists(lists, budget, quotas)
            merged.sort(key=lambda m: (-m[1], m[0]))
            for d, s, finders, _ in merged:
                rows_q.append(qi)
                rows_d.append(d)
                rows_s.append(s)
                rows_b.append("|".join(self.branches[f] for f in finders))
        counts = np.bincount(np.asarray(rows_q, dtype=np.int64), minlength=len(inp))
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        docids = np.asarray(rows_d, dtype=np.int64)
        out = base.iloc[np.asarray(rows_q, dtype=np.int64)].reset_index(drop=True)
        return out.assign(
            docno=docnos_of(self.index, docids),
            docid=docids,
            score=np.asarray(rows_s, dtype=np.float32),
            rank=np.arange(docids.size, dtype=np.int64) - np.repeat(starts, counts),
            branch=np.asarray(rows_b, dtype=object),
        )


# --------------------------------------------------------------------------------------------------------
# training data (Sec. 4.3)
# --------------------------------------------------------------------------------------------------------


def _lexical_query(text: str) -> str:
    """A bag-of-words query for a lexical retriever: punctuation (and ``[SEP]``) becomes spaces."""
    return " ".join(re.sub(r"[^\w]+", " ", text.replace("[SEP]", " ")).split())


def _top_depth(
    retriever: pt.Transformer, queries: pd.DataFrame, depth: int
) -> dict[str, tuple[list[str], list[float]]]:
    """qid -> (docnos, scores) of the retriever's top ``depth``, best first."""
    queries = queries[queries["query"].str.len() > 0]
    if not len(queries):
        return {}
    res = (retriever % depth).compile()(queries.reset_index(drop=True))
    out: dict[str, tuple[list[str], list[float]]] = {}
    if not len(res):
        return out
    res = res.sort_values(["qid", "score"], ascending=[True, False], kind="stable")
    for qid, group in res.groupby("qid", sort=False):
        out[str(qid)] = (group["docno"].astype(str).tolist()[:depth], group["score"].astype(float).tolist()[:depth])
    return out


def _tail(docnos: Sequence[str], share: float) -> list[str]:
    """The last ``ceil(share * len)`` of a ranked list."""
    k = math.ceil(share * len(docnos))
    return list(docnos[len(docnos) - k :]) if k else []


def unierf_training_data(
    topics: pd.DataFrame,
    qrels: pd.DataFrame,
    doc_texts: Mapping[str, str],
    branches: Sequence[str] = ("semantic", "trigger"),
    *,
    inputs: Mapping[str, Sequence[str]] | None = None,
    retriever: pt.Transformer | None = None,
    index: Any = None,
    hard_negatives: bool | Sequence[str] = True,
    depth: int = 100,
    tail: float = 0.3,
    categories: Mapping[str, str] | None = None,
    same_category_share: float = 0.5,
    random_negative: bool = True,
    min_relevance: int = 1,
    max_examples: int | None = None,
    sep: str = SEP,
    seed: int = 0,
) -> Dataset:
    """UniERF training rows with differentiated negatives per branch (Sec. 4.3), mined with PyTerrier.

    One row per judged-relevant (query, document) pair: every branch's input text of the query (built from the
    topic columns as :class:`UniERFEncoder` builds it), the document as positive (Eq. 20), and the negatives of
    :func:`st_extensions.build_unierf_dataset`. Hard negatives (``negative_<branch>``), thresholds "based on the
    last 30% of the total score" (Sec. 5.3.2, ``tail=0.3``):

    * ``trigger`` (similar-item branch, Eq. 25): among the query's top-``depth`` documents of ``retriever``, the
      ``tail`` share *least similar to the trigger document* (cosine of their vectors in ``index``) -- documents
      the query matches but the trigger does not point to; needs ``trigger_docno`` in ``topics`` (from
      :class:`TriggerText`) and ``index``;
    * every other branch (semantic, Eq. 24; context, ...): the ``tail`` share of lowest ``retriever`` scores among
      the top ``depth`` for the branch's own input text (as a bag of words) -- for ``semantic`` the low-BM25 tail
      of the query.

    Relevant documents of the query (any positive label) are never negatives; a row without a candidate gets a
    random negative instead.

    Args:
        topics: ``qid`` plus every branch's input columns (``query``, ``trigger_text``, ...); ``trigger_docno`` for
            the trigger branch's hard negatives.
        qrels: ``qid, docno, label``.
        doc_texts: docno -> text for the whole corpus (random negatives are drawn from it).
        branches: the branch names, in the model's order.
        inputs: branch -> input columns (default :data:`DEFAULT_BRANCH_INPUTS`).
        retriever: a lexical first stage (e.g. PISA BM25), ``(qid, query)`` -> results.
        index: a :class:`~pyterrier_prob.DenseIndex` (e.g. of the base encoder) for the trigger dissimilarity.
        hard_negatives: which branches get a hard-negative column (``True``: all, ``False``: none).
        depth: candidates per query for the hard negatives.
        tail: share of the candidates, from the bottom, that are hard negatives.
        categories, same_category_share: same-category random negatives (docno -> category).
        random_negative: add the shared ``negative_random`` column.
        min_relevance: smallest label of a positive.
        max_examples: keep a seeded random sample of at most this many rows.
        sep: separator of the branches' input parts.
        seed: seeds the sampling.

    Returns:
        A :class:`datasets.Dataset` with the columns of :func:`st_extensions.unierf_columns`; train with
        ``UniERFLoss(model, columns=dataset.column_names)``.
    """
    names = check_branch_names(branches)
    branch_inputs = _branch_inputs(names, inputs)
    if hard_negatives is True:
        hard = names
    elif hard_negatives is False or not list(hard_negatives):
        hard = []
    else:
        hard = check_branch_names(hard_negatives)
    unknown = [b for b in hard if b not in names]
    if unknown:
        raise ValueError(f"hard_negatives names unknown branches {unknown}: the branches are {names}")
    depth = int(_pos_int("depth", depth))
    if not (0.0 < tail <= 1.0):
        raise ValueError(f"tail must be in (0, 1], got {tail}")
    needed = list(dict.fromkeys(c for cols in branch_inputs.values() for c in cols))
    if "trigger" in hard:
        needed.append("trigger_docno")
    missing = [c for c in ["qid", *needed] if c not in topics.columns]
    if missing:
        hint = " (add them with TriggerText(bm25, texts))" if {"trigger_text", "trigger_docno"} & set(missing) else ""
        raise ValueError(f"topics lack the columns {missing}{hint}")
    missing = [c for c in ("qid", "docno", "label") if c not in qrels.columns]
    if missing:
        raise ValueError(f"qrels lack the columns {missing}")
    if hard and retriever is None:
        raise ValueError(f"hard negatives for {hard} need a retriever (e.g. BM25) for the candidates")
    if "trigger" in hard and index is None:
        raise ValueError("the trigger branch's hard negatives need index= (a DenseIndex) to measure dissimilarity")

    topics = topics.assign(qid=topics["qid"].astype(str)).drop_duplicates("qid").reset_index(drop=True)
    qrels = qrels.assign(qid=qrels["qid"].astype(str), docno=qrels["docno"].astype(str))
    relevant: dict[str, set[str]] = {}
    for qid, docno in zip(qrels.loc[qrels["label"] > 0, "qid"], qrels.loc[qrels["label"] > 0, "docno"]):
        relevant.setdefault(qid, set()).add(docno)
    known = set(topics["qid"])
    pos = qrels[(qrels["label"] >= min_relevance) & qrels["qid"].isin(known) & qrels["docno"].isin(doc_texts)]
    examples = list(zip(pos["qid"], pos["docno"]))
    if not examples:
        raise ValueError(f"no judged-relevant (query, document) pairs with label >= {min_relevance} for these topics")
    random.Random(seed).shuffle(examples)
    if max_examples is not None:
        examples = examples[: _pos_int("max_examples", max_examples)]
    used = sorted({q for q, _ in examples})
    topics = topics.set_index("qid").loc[used].reset_index()
    texts = _frame_branch_texts(topics, branch_inputs, sep)
    row_of = {q: i for i, q in enumerate(topics["qid"])}

    candidates: dict[str, dict[str, list[str]]] = {}
    for b in hard:
        if b == "trigger":
            queries = pd.DataFrame({"qid": topics["qid"], "query": [_lexical_query(str(q)) for q in topics["query"]]})
            top = _top_depth(retriever, queries, depth)
            dense = as_dense_index(index)
            vecs, lookup = dense.vectors(), dense.docnos()
            cands: dict[str, list[str]] = {}
            for qid, trig in zip(topics["qid"], topics["trigger_docno"]):
                docnos = [d for d in top.get(qid, ([], []))[0] if d not in relevant.get(qid, ()) and d != trig]
                if trig is None or (isinstance(trig, float) and np.isnan(trig)) or not docnos:
                    cands[qid] = []
                    continue
                ids = np.asarray(lookup.inv[np.asarray([str(trig), *docnos], dtype=str)], dtype=np.int64)
                if ids[0] < 0:
                    raise ValueError(f"trigger document {trig!r} of query {qid!r} is not in {dense!r}")
                keep = ids[1:] >= 0
                d_ids = ids[1:][keep]
                d_nos = [d for d, k in zip(docnos, keep) if k]
                v = np.asarray(vecs[d_ids], dtype=np.float64)
                t = np.asarray(vecs[ids[0]], dtype=np.float64)
                sims = (v @ t) / np.maximum(np.linalg.norm(v, axis=1) * np.linalg.norm(t), 1e-12)
                order = np.argsort(-sims, kind="stable")  # most similar first: the tail is the least similar
                cands[qid] = _tail([d_nos[i] for i in order], tail)
            candidates[b] = cands
        else:
            queries = pd.DataFrame({"qid": topics["qid"], "query": [_lexical_query(t) for t in texts[b]]})
            top = _top_depth(retriever, queries, depth)
            candidates[b] = {
                qid: _tail([d for d in top.get(qid, ([], []))[0] if d not in relevant.get(qid, ())], tail)
                for qid in topics["qid"]
            }

    return build_unierf_dataset(
        anchors={b: [texts[b][row_of[q]] for q, _ in examples] for b in names},
        positives=[d for _, d in examples],
        doc_texts=doc_texts,
        hard_negatives={b: [candidates[b].get(q, []) for q, _ in examples] for b in hard},
        exclude=[relevant.get(q, set()) for q, _ in examples],
        categories=categories,
        same_category_share=same_category_share,
        random_negative=random_negative,
        seed=seed,
    )
