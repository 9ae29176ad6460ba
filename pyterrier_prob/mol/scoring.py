"""Mixture-of-Logits scoring for PyTerrier: phi(q, x) = sum_p pi_p(q, x) <f_pq(q), g_px(x)> (Eqs. 1-2 of
``shared/papers/mixture-of-logits.txt``) of (query, candidate) pairs read from the frame or a
:class:`~pyterrier_prob.MoLIndex`, scored by the model's gate (:mod:`st_extensions.mol`), and :class:`MoLReranker`."""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from pyterrier_prob.dense import Capped, validate_columns
from pyterrier_prob.index.exact import top_per_query
from pyterrier_prob.index.mol import MoLIndex, as_mol_index
from pyterrier_prob.validation import (
    check_ids,
    check_rows_match_query,
    first_rows,
    is_int,
    positive_int,
    row_namer,
    stack_arrays,
)
from st_extensions.mol import inference

SCORE_BUDGET = 1 << 23  # float32 elements of one MoL scoring chunk (components + gate inputs), ~32 MiB

#: ``docs(rows)`` -> the components ``(n, P_x, d)`` and gate features ``(n, F)`` (or None) of pairs ``rows``.
DocSource = Callable[[Any], "tuple[np.ndarray, np.ndarray | None]"]


@dataclass(frozen=True)
class Shapes:
    """P_q, P_x and d of a MoL, and whether (and with what dimension) its gate reads side features (App. A.3)."""

    pq: int
    px: int
    dim: int
    gate_features: bool = False
    feature_dim: int | None = None


def mol_shapes(mol: Any) -> Shapes:
    """The :class:`Shapes` of a MixtureOfLogits-like object, with a clear error when it is not one."""
    if missing := [m for m in ("score_candidates", "score_all") if not callable(getattr(mol, m, None))]:
        raise TypeError(
            f"mol must be a MixtureOfLogits-like module (st_extensions.mol.find_mol(model)) with score_candidates "
            f"and score_all; {type(mol).__name__} lacks {missing}"
        )
    vals = []
    for attr in ("num_query_components", "num_doc_components", "component_dim"):
        v = getattr(mol, attr, None)
        if not is_int(v) or v < 1:
            raise TypeError(f"mol.{attr} must be a positive int, got {v!r} ({type(mol).__name__})")
        vals.append(int(v))
    gate_features = bool(getattr(mol, "gate_features", False))
    fdim = getattr(mol, "embedding_dim", None) if gate_features else None
    return Shapes(*vals, gate_features, int(fdim) if is_int(fdim) and fdim >= 1 else None)


def device_dtype(mol: Any) -> tuple[torch.device, torch.dtype]:
    for getter in ("parameters", "buffers"):
        try:
            t = next(getattr(mol, getter)())
        except (AttributeError, StopIteration, TypeError):
            continue
        return t.device, (t.dtype if t.is_floating_point() else torch.float32)
    return torch.device("cpu"), torch.float32


def tensor(a: np.ndarray | None, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """``a`` as a tensor of ``dtype`` on ``device`` (None stays None)."""
    return None if a is None else torch.from_numpy(np.require(a, np.float32, ["C", "W"])).to(device=device, dtype=dtype)


def frame_side(
    inp: pd.DataFrame, rows: np.ndarray, shapes: Shapes, side: str, owner: str
) -> tuple[np.ndarray, np.ndarray | None]:
    """``<side>_comp`` (and ``<side>_feat``) of ``rows`` (``side``: ``"query"`` or ``"doc"``) as float32 ``(n, P, d)``
    (and ``(n, F)``), with errors naming the row of a missing, misshapen or non-finite value."""
    name = row_namer(inp, rows=rows)
    column, count = f"{side}_comp", shapes.pq if side == "query" else shapes.px
    comps = stack_arrays(inp[column].to_numpy()[rows], column, name, owner, ndim=2, kind="component shapes")
    if comps.shape[1] != count:
        raise ValueError(
            f"{column} of {name(0)} has {comps.shape[1]} component embeddings, the MoL expects {count} per {side} "
            f"(P_{'q' if side == 'query' else 'x'}); were they encoded by the same model?"
        )
    if comps.shape[2] != shapes.dim:
        raise ValueError(
            f"dimension mismatch: {column} of {name(0)} has {comps.shape[2]}-dim components, the MoL (and index) "
            f"use {shapes.dim}-dim ones; were they encoded by the same model?"
        )
    if not shapes.gate_features:
        return comps, None
    column = f"{side}_feat"
    feats = stack_arrays(inp[column].to_numpy()[rows], column, name, owner, ndim=1, kind=f"{column} dimensions")
    if shapes.feature_dim is not None and feats.shape[1] != shapes.feature_dim:
        raise ValueError(
            f"dimension mismatch: {column} has {feats.shape[1]} dims, the MoL gate reads {shapes.feature_dim}"
        )
    return comps, feats


def query_rows(
    inp: pd.DataFrame, shapes: Shapes, owner: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """``(codes, first, Q, Qf)``: each row's query number, each query's first row, and the queries' components and
    gate features; a qid on several rows must carry the same ``query_comp`` (``query_feat``) on each."""
    codes, first = first_rows(inp["qid"])
    Q, Qf = frame_side(inp, first, shapes, "query", owner)
    check_rows_match_query(inp, codes, first, "query_comp", Q, owner, ndim=2)
    if Qf is not None:
        check_rows_match_query(inp, codes, first, "query_feat", Qf, owner)
    return codes, first, Q, Qf


def check_index_matches(index: MoLIndex, shapes: Shapes) -> None:
    if index.num_components != shapes.px or index.dim != shapes.dim:
        raise ValueError(
            f"{index!r} holds {index.num_components} components of dim {index.dim} per document, but the MoL "
            f"expects P_x = {shapes.px} of dim {shapes.dim}: was the index built with this model's doc_encoder()?"
        )
    if shapes.gate_features:
        if index.feature_dim is None:
            raise ValueError(
                f"the MoL gate reads document features (gate_features=True) but {index!r} holds none: index "
                "with MoLEncoder(model).doc_encoder(), which adds doc_feat for such models"
            )
        if shapes.feature_dim is not None and index.feature_dim != shapes.feature_dim:
            raise ValueError(
                f"{index!r} holds {index.feature_dim}-dim document features, the MoL gate reads {shapes.feature_dim}"
            )


def gather_rows(arr: np.ndarray, docids: np.ndarray) -> np.ndarray:
    """``arr[docids]`` read in sorted order (memmap-friendly)."""
    uniq, inv = np.unique(docids, return_inverse=True)
    return np.asarray(arr[uniq])[inv.reshape(-1)]


class IndexDocs:
    """A :data:`DocSource` reading pair i's document ``docids[i]`` from a :class:`~pyterrier_prob.MoLIndex`."""

    def __init__(self, index: MoLIndex, docids: np.ndarray) -> None:
        self.index, self.docids = index, docids
        self.comps, self.feats = index.components(), index.features()

    def __call__(self, rows: Any) -> tuple[np.ndarray, np.ndarray | None]:
        docids = self.docids[rows]
        out = (gather_rows(self.comps, docids), None if self.feats is None else gather_rows(self.feats, docids))
        if not all(arr is None or np.isfinite(arr).all() for arr in out):
            self.index.check_finite()  # a corrupt index file: names it, the row and its docno
            raise ValueError(f"non-finite components of candidates in {self.index!r}: rebuild the index")
        return out


def _candidate_scorer(mol: Any) -> Callable[..., torch.Tensor]:
    """``mol.score_candidates``, or ``mol.mixture(..., check_finite=False)`` where it exists: the inputs were checked
    here and at indexing (the scores are checked afterwards either way)."""
    mixture = getattr(mol, "mixture", None)
    with contextlib.suppress(TypeError, ValueError):  # a signature inspect cannot read: score_candidates
        if callable(mixture) and "check_finite" in inspect.signature(mixture).parameters:
            return lambda q, x, **kw: mixture(q, x, check_finite=False, **kw)[0]
    return mol.score_candidates


def _segments(qi: np.ndarray, cap: int) -> Iterator[tuple[int, int, np.ndarray, int]]:
    """Chunks of query-grouped pairs ``qi``: ``(a, b, starts, width)``, pairs a..b as rows starting at ``starts``
    (a query's run split every ``cap`` pairs), packed while rows x the longest row fits ``cap``."""
    m = qi.size
    runs = np.flatnonzero(np.r_[True, qi[1:] != qi[:-1]])
    start = np.concatenate([np.arange(r0, r1, cap) for r0, r1 in zip(runs, np.r_[runs[1:], m])])
    length = np.minimum(np.r_[start[1:], m], start + cap) - start
    i = 0
    while i < start.size:
        j, width = i + 1, int(length[i])
        while j < start.size and (j - i + 1) * max(width, int(length[j])) <= cap:
            width = max(width, int(length[j]))
            j += 1
        yield int(start[i]), int(start[j - 1] + length[j - 1]), start[i:j], width
        i = j


def _padded(t: torch.Tensor, shape: tuple[int, ...], row: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """The rows of ``t`` placed at ``(row, pos)`` of a zero tensor of ``shape`` (a plain reshape when full)."""
    if t.shape[0] == shape[0] * shape[1]:
        return t.reshape(shape)
    out = t.new_zeros(shape)
    out[row, pos] = t
    return out


def score_pairs(mol: Any, shapes: Shapes, Q: np.ndarray, Qf: np.ndarray | None, qi: np.ndarray, docs: DocSource):
    """phi (Eq. 1) of the pairs (query ``qi[i]``, document i), via ``mol.score_candidates``: each query's candidates
    are one zero-padded row of a batch (split over rows when too many), so query components are not repeated per
    candidate; chunks hold at most ``SCORE_BUDGET`` elements."""
    order = np.argsort(qi, kind="stable") if qi.size > 1 and bool((qi[1:] < qi[:-1]).any()) else None
    grouped = qi if order is None else qi[order]
    scores = np.empty(qi.size, np.float32)
    device, dtype = device_dtype(mol)
    Qt, Qft = tensor(Q, device, dtype), tensor(Qf, device, dtype)
    score = _candidate_scorer(mol)
    cap = max(1, SCORE_BUDGET // (shapes.px * shapes.dim + 4 * shapes.pq * shapes.px + (shapes.feature_dim or 0)))
    for a, b, starts, width in _segments(grouped, cap):
        lens = np.diff(np.r_[starts, b])
        row = torch.from_numpy(np.repeat(np.arange(starts.size), lens)).to(device)
        pos = torch.from_numpy(np.arange(a, b) - np.repeat(starts, lens)).to(device)
        comps, feats = docs(slice(a, b) if order is None else order[a:b])
        x = _padded(tensor(comps, device, dtype), (starts.size, width, shapes.px, shapes.dim), row, pos)
        qrows = torch.from_numpy(grouped[starts]).to(device)
        kwargs, xf = {}, tensor(feats, device, dtype)
        if Qft is not None or feats is not None:
            kwargs = {"q_features": Qft[qrows], "x_features": _padded(xf, (starts.size, width, xf.shape[-1]), row, pos)}
        s = score(Qt[qrows], x, **kwargs)
        if tuple(s.shape) != (starts.size, width):
            raise ValueError(f"mol.score_candidates returned shape {tuple(s.shape)}, expected ({starts.size}, {width})")
        scores[a:b] = s[row, pos].float().cpu().numpy()
    if not np.isfinite(scores).all():
        raise ValueError("the MoL produced non-finite scores (nan or inf)")
    if order is not None:  # back to the input order
        scores[order] = scores.copy()
    return scores


class MoLReranker(Capped):
    """Re-scores candidates (``qid, docno, query_comp``) with MoL's phi (Eq. 1) and re-ranks them.

    Document components come from ``index`` (a :class:`~pyterrier_prob.MoLIndex` or its path, by ``docno``:
    ``bm25 % 100 >> encoder.query_encoder() >> MoLReranker(index, encoder.mol)``) or, with ``index=None``, from the
    frame's ``doc_comp`` (:meth:`MoLEncoder.doc_encoder`); a gate with side features also needs ``query_feat`` (and
    ``doc_feat``). Output: the input rows re-scored, each query's best first (ties keep the input order), at most
    ``num_results`` per query (``reranker % k`` sets it).
    """

    def __init__(
        self,
        index: MoLIndex | str | os.PathLike | None,
        mol: Any,
        num_results: int | None = None,
        drop_query_comp: bool = False,
        drop_doc_comp: bool = False,
    ) -> None:
        self.shapes = mol_shapes(mol)
        self.index = None if index is None else as_mol_index(index)
        if self.index is not None:
            check_index_matches(self.index, self.shapes)
        self.mol = mol
        self.num_results = positive_int("num_results", num_results, allow_none=True)
        self.drop_query_comp = bool(drop_query_comp)
        self.drop_doc_comp = bool(drop_doc_comp)

    def _columns(self) -> list[str]:
        sides = ["query"] if self.index is not None else ["query", "doc"]
        return [f"{s}_{kind}" for kind in ("comp", "feat")[: 1 + self.shapes.gate_features] for s in sides]

    def _docs(self, inp: pd.DataFrame) -> DocSource:
        if self.index is None:  # stacked arrays, one row per pair
            comps, feats = frame_side(inp, np.arange(len(inp)), self.shapes, "doc", type(self).__name__)
            return lambda rows: (comps[rows], None if feats is None else feats[rows])
        hint = "re-ranking from an index needs the candidates' components in it (or use MoLReranker(None, mol) after "
        docids = self.index.candidate_docids(inp["docno"], hint + "MoLEncoder(model).doc_encoder())")
        return IndexDocs(self.index, docids)

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        hint = "encode the queries with MoLEncoder(model).query_encoder()"
        if self.index is None:
            hint += " and the documents with MoLEncoder(model).doc_encoder() (or pass a MoLIndex)"
        validate_columns(self, inp, self._columns(), hint, rerank=True)
        inp = inp.reset_index(drop=True)
        out = inp.drop(columns=["score", "rank"], errors="ignore")
        if len(inp):
            check_ids(inp, ["qid", "docno"], type(self).__name__)
            codes, _, Q, Qf = query_rows(inp, self.shapes, type(self).__name__)
            with inference(self.mol):
                scores = score_pairs(self.mol, self.shapes, Q, Qf, codes.astype(np.int64), self._docs(inp))
            # ties keep the input order (the row number breaks them)
            order, rank = top_per_query(codes, np.arange(len(codes)), scores, self.num_results)
            out = out.iloc[order].reset_index(drop=True).assign(score=scores[order], rank=rank)
        else:
            out = out.assign(score=pd.Series(dtype=np.float32), rank=pd.Series(dtype=np.int64))
        drop = [c for c, d in (("query_comp", self.drop_query_comp), ("doc_comp", self.drop_doc_comp)) if d]
        return out.drop(columns=drop, errors="ignore")

    def __repr__(self) -> str:
        return f"MoLReranker({self.index!r}, {type(self.mol).__name__}, num_results={self.num_results})"
