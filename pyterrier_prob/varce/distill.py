"""Distilling a strong ranker into cross-encoders: candidate pools, teacher scores, Margin-MSE rows, scoring. The
teacher is a fine-tuned bi-encoder fused with BM25 by per-query z-scores, ``alpha * z(cos) + (1 - alpha) * z(BM25)``
(alpha chosen on dev, :func:`choose_teacher`); :func:`distillation_rows` train a cross-encoder with ``MarginMSELoss``
(Hofstätter et al., 2020) or a VarCrossEncoder with ``VariationalMarginMSELoss``. Plain frames in and out; docs/varce.md
("Cross-encoders distilled ...") describes the setup."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import ir_measures
import numpy as np
import pandas as pd
import torch
from datasets import Dataset

from pyterrier_prob.atomic import atomic_write, read_checked
from pyterrier_prob.fusion import ALPHAS, ScoresLike, interpolate, zscore_per_query  # ALPHAS: fusion weights on dev
from pyterrier_prob.varce.rerank import score_as_text
from st_extensions.cross_encoder import VarCrossEncoder

__all__ = [
    "ALPHAS",
    "DenseDev",
    "add_cosines",
    "candidate_pool",
    "choose_teacher",
    "dense_run",
    "distillation_rows",
    "encode",
    "lexical_share",
    "ndcg_at_10",
    "score_pairs",
    "teacher_in_student_units",
    "teacher_scores",
]


def encode(model: Any, texts: Sequence[str], path: str | None = None, *, query: bool = False) -> np.ndarray:
    """L2-normalised float32 embeddings of ``texts`` by a bi-encoder, cached in ``path`` (``.npy``) when given."""
    if path is not None and os.path.isfile(path):
        cached = read_checked(path, np.load, "delete it: the embeddings are computed again on the next run")
        if cached.shape[0] == len(texts):
            return cached
    fn = model.encode_query if query else model.encode_document
    emb = np.asarray(fn(list(texts), batch_size=64, normalize_embeddings=True, convert_to_numpy=True), np.float32)
    if path is not None:
        atomic_write(path, lambda f: np.save(f, emb))
    return emb


def dense_run(
    queries: pd.DataFrame, q_emb: np.ndarray, docnos: Sequence[str], d_emb: np.ndarray, k: int
) -> pd.DataFrame:
    """Exact top ``k`` by cosine (faiss ``IndexFlatIP`` over unit vectors): ``qid, docno, dense``, best first."""
    import faiss

    index = faiss.IndexFlatIP(d_emb.shape[1])
    index.add(np.ascontiguousarray(d_emb, dtype=np.float32))
    scores, ids = index.search(np.ascontiguousarray(q_emb, dtype=np.float32), min(k, len(docnos)))
    qid, docno = np.repeat(queries["qid"].to_numpy(), ids.shape[1]), np.asarray(docnos, dtype=object)[ids.reshape(-1)]
    return pd.DataFrame({"qid": qid, "docno": docno, "dense": scores.reshape(-1).astype(np.float64)})


def candidate_pool(bm25: pd.DataFrame, dense: pd.DataFrame, depth: int) -> pd.DataFrame:
    """The union of BM25's and the dense model's top ``depth`` per query: ``qid, docno, bm25`` (0 for a candidate BM25
    does not retrieve: ``bm25`` should reach deeper than ``depth``)."""
    b = bm25.rename(columns={"score": "bm25"})[["qid", "docno", "bm25"]]
    top_b = b[b.groupby("qid").cumcount() < depth]
    top_d = dense[dense.groupby("qid").cumcount() < depth][["qid", "docno"]]
    keys = pd.concat([top_b[["qid", "docno"]], top_d]).drop_duplicates()
    pool = keys.merge(b, on=["qid", "docno"], how="left")
    pool["bm25"] = pool["bm25"].fillna(0.0)
    return pool.sort_values(["qid", "docno"], kind="stable").reset_index(drop=True)


def add_cosines(
    frame: pd.DataFrame, qids: Sequence[str], q_emb: np.ndarray, docnos: Sequence[str], d_emb: np.ndarray
) -> pd.DataFrame:
    """``frame`` with column ``dense``: the cosine of each row's query and document unit embeddings."""
    rows = []
    for name, col, keys in (("query", "qid", qids), ("document", "docno", docnos)):
        rows.append(pd.Index(keys).get_indexer(frame[col]))  # -1: no embedding
        if (rows[-1] < 0).any():
            raise ValueError(f"no {name} embedding for {col} {frame[col].iloc[np.argmax(rows[-1] < 0)]!r}")
    return frame.assign(dense=np.einsum("ij,ij->i", q_emb[rows[0]], d_emb[rows[1]]).astype(np.float64))


def teacher_scores(pool: pd.DataFrame, alpha: float) -> np.ndarray:
    """``alpha * z(dense) + (1 - alpha) * z(bm25)`` with per-query z-scores over each query's candidates."""
    return interpolate(pool["qid"], pool["bm25"], pool["dense"], alpha)


def lexical_share(frame: pd.DataFrame, score: ScoresLike) -> dict[str, float]:
    """How far a re-ranker's ranking follows each half of the teacher: the least-squares weights of ``z_q(score)`` on
    ``z_q(bm25)`` and ``z_q(dense)`` (per-query z-scores, as the teacher fuses them, pooled over ``frame``'s rows),
    ``r2`` (the share of ``z_q(score)``'s variance they explain) and ``bm25_share`` = ``|w_bm25| / (|w_bm25| +
    |w_dense|)``. The fused teacher's share is about ``1 - alpha``; a student that kept only the bi-encoder half is
    near 0 (docs/varce.md)."""
    q = frame["qid"]
    x = np.column_stack([zscore_per_query(q, frame["bm25"]), zscore_per_query(q, frame["dense"])])
    y = zscore_per_query(q, score)
    if not y.any():  # no rows, or constant scores in every query: nothing to explain
        nan = float("nan")
        return {"w_bm25": nan, "w_dense": nan, "r2": nan, "bm25_share": nan}
    w, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ w
    total = np.abs(w).sum()
    return {
        "w_bm25": float(w[0]),
        "w_dense": float(w[1]),
        "r2": float(1.0 - resid @ resid / (y @ y)),  # y has mean 0 within each query
        "bm25_share": float(abs(w[0]) / total) if total > 0 else float("nan"),
    }


def teacher_in_student_units(pool: pd.DataFrame, alpha: float, scale: float) -> np.ndarray:
    """:func:`teacher_scores` in a student's units: ``scale * (dense + (1 - alpha) / alpha * sd_q(dense) *
    z_q(bm25))``: per query the fused score times ``scale * sd_q / alpha`` plus a constant (the same ranking, every
    margin in proportion), whose dense part is ``scale * cos``, the score a student built from the
    teacher's bi-encoder starts with: what is left to learn is the lexical part alone, not a per-query rescaling of
    what the student already ranks by (``sd_q``: the population sd of the query's cosines, as in the z-scores; a query
    of equal cosines keeps them, its BM25 part vanishing with ``sd_q``)."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must lie in (0, 1] for the teacher in a student's units, got {alpha}")
    dense = pool["dense"].to_numpy(np.float64)
    sd = pd.Series(dense).groupby(pool["qid"].to_numpy()).transform("std", ddof=0).to_numpy()
    return scale * (dense + (1.0 - alpha) / alpha * sd * zscore_per_query(pool["qid"], pool["bm25"]))


def ndcg_at_10(
    run: pd.DataFrame, qrels: pd.DataFrame, score: str = "score", qids: Sequence[str] | None = None
) -> pd.Series:
    """Per-query nDCG@10 (ir_measures) of ``run`` ranked by column ``score``, for every query of ``qids`` (default:
    those of ``run``); a query with no candidate or no judged-relevant document scores 0, as in ``pt.Experiment``."""
    q = qrels.astype({"qid": str, "docno": str})
    qrel = [ir_measures.Qrel(a, b, int(c)) for a, b, c in q[["qid", "docno", "label"]].itertuples(index=False)]
    scored = [
        ir_measures.ScoredDoc(str(a), str(b), float(c))
        for a, b, c in run[["qid", "docno", score]].itertuples(index=False)
    ]
    values = {m.query_id: m.value for m in ir_measures.iter_calc([ir_measures.nDCG @ 10], qrel, scored)}
    qids = pd.unique(run["qid"].astype(str)) if qids is None else [str(q) for q in qids]
    return pd.Series([float(values.get(qid, 0.0)) for qid in qids], index=qids, name="nDCG@10")


def choose_teacher(pool: pd.DataFrame, qrels: pd.DataFrame, alphas: Sequence[float] = ALPHAS) -> dict[str, Any]:
    """The fusion weight with the best mean nDCG@10 over ``pool``'s queries (dev; the smallest among ties) and
    every weight's value: ``{"alpha", "dev": {alpha: nDCG@10}}``."""
    dev = {float(a): float(ndcg_at_10(pool.assign(t=teacher_scores(pool, a)), qrels, "t").mean()) for a in alphas}
    return {"alpha": max(dev, key=lambda a: (dev[a], -a)), "dev": dev}


def distillation_rows(
    pool: pd.DataFrame,
    queries: dict[str, str],
    texts: dict[str, str],
    n_rows: int,
    *,
    negatives: int = 3,
    top: int = 10,
    seed: int = 0,
    score_column: str | None = None,
) -> Dataset:
    """Margin-MSE rows ``query, document_0, ..., document_<negatives>, label`` (label: the teacher's scores). Rounds of
    shuffled passes over the pool's queries; ``document_0`` from the query's ``top`` candidates by teacher score, the
    others from the rest of its pool (``pool``: ``qid, docno, teacher``). ``score_column``: each document's text is
    preceded by that column of the pool as text (:func:`~pyterrier_prob.varce.rerank.score_as_text`)."""
    if n_rows < 1 or negatives < 1 or top < 1:
        raise ValueError(f"n_rows, negatives and top must be >= 1, got {n_rows}, {negatives}, {top}")
    rng = np.random.default_rng(seed)
    ranked = pool.sort_values(["qid", "teacher"], ascending=[True, False], kind="stable")
    first = ranked[score_column].to_numpy(np.float64) if score_column else np.zeros(len(ranked))
    ranked = ranked.assign(_first=first)
    groups = {
        q: (g["docno"].to_numpy(), g["teacher"].to_numpy(), g["_first"].to_numpy())
        for q, g in ranked.groupby("qid")
        if len(g) > top
    }
    if not groups:
        most = int(pool.groupby("qid").size().max()) if len(pool) else 0
        raise ValueError(
            f"no query of the pool has more than top={top} candidates (at most {most}), so none has a negative: "
            "build the pool deeper (--pool-depth)"
        )
    if missing := [q for q in groups if q not in queries]:
        raise ValueError(f"no query text for qid {missing[0]!r}")
    qids = sorted(groups)
    cols: dict[str, list[Any]] = {"query": [], **{f"document_{j}": [] for j in range(negatives + 1)}, "label": []}
    while len(cols["query"]) < n_rows:
        for qid in rng.permutation(qids):
            docnos, scores, firsts = groups[qid]
            first = int(rng.integers(0, top))
            rest = rng.choice(np.arange(top, len(docnos)), size=negatives, replace=len(docnos) - top < negatives)
            picked = [first, *rest.tolist()]
            cols["query"].append(queries[qid])
            for j, i in enumerate(picked):
                text = texts[docnos[i]]
                cols[f"document_{j}"].append(score_as_text([text], [firsts[i]])[0] if score_column else text)
            cols["label"].append([float(scores[i]) for i in picked])
            if len(cols["query"]) == n_rows:
                break
    return Dataset.from_dict(cols)


def score_pairs(model: Any, queries: Sequence[str], documents: Sequence[str], batch_size: int = 64) -> tuple:
    """``(E[s], std[s])`` of a VarCrossEncoder per (query, document) pair; ``(logits, None)`` for a CrossEncoder
    (whatever its ``activation_fn``). No progress bar: callers show their own."""
    pairs = list(zip(queries, documents))
    if not pairs:
        return np.zeros(0, np.float32), None
    if isinstance(model, VarCrossEncoder):
        mean, std = model.predict(pairs, batch_size=batch_size, return_std=True, show_progress_bar=False)
        return np.asarray(mean, np.float32), np.asarray(std, np.float32)
    logits = model.predict(pairs, batch_size=batch_size, activation_fn=torch.nn.Identity(), show_progress_bar=False)
    return np.asarray(logits, np.float32), None


class DenseDev:
    """``model -> mean nDCG@10`` of a bi-encoder ranking a whole corpus by exact search for dev ``topics`` (every
    query counted; the ``evaluate`` of a :class:`~pyterrier_prob.curves.DevCurve`)."""

    def __init__(self, topics: pd.DataFrame, qrels: pd.DataFrame, corpus: dict[str, str], k: int = 100) -> None:
        self.topics, self.qrels, self.corpus, self.k = topics, qrels, corpus, k

    def __call__(self, model: Any) -> float:
        docnos = list(self.corpus)
        q = encode(model, self.topics["query"].tolist(), query=True)
        d = encode(model, [self.corpus[x] for x in docnos])
        run = dense_run(self.topics, q, docnos, d, self.k)
        return float(ndcg_at_10(run, self.qrels, "dense", qids=self.topics["qid"].tolist()).mean())
