"""Multi-branch (UniERF, Jiang et al., KDD'25, ``shared/papers/unierf.md``) retrieval for PyTerrier: branch inputs
(:class:`TriggerText`), one ``query_vec_<branch>`` per branch (:class:`UniERFEncoder`), the merge of the branches'
candidates under quotas (:class:`MultiBranchRetriever`, Sec. 4, Alg. 1 lines 27-30) and the negatives of Sec. 4.3
(:func:`unierf_training_data`). Model side: :mod:`st_extensions.unierf`; usage: ``docs/unierf.md``."""

from __future__ import annotations

import math
import os
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyterrier as pt

from pyterrier_prob.dense import Capped, ProbBiEncoder, validate_columns
from pyterrier_prob.index.dense import as_dense_index
from pyterrier_prob.index.exact import QUERY_BATCH, docnos_of, threshold_search
from pyterrier_prob.validation import (
    check_ids,
    check_rows_match_query,
    empty_results,
    finite_float,
    first_rows,
    non_negative_int,
    positive_int,
    require_columns,
    row_namer,
    stack_arrays,
    unique_texts,
)
from st_extensions import load_model
from st_extensions.modules.branches import check_branch_names
from st_extensions.unierf import (
    SEP,
    branch_text,
    build_unierf_dataset,
    encode_branches,
    find_branches,
    hard_negative_branches,
)

if TYPE_CHECKING:
    from datasets import Dataset

__all__ = [
    "DEFAULT_BRANCH_INPUTS",
    "MultiBranchRetriever",
    "TriggerText",
    "UniERFDataConfig",
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
    if unknown := [b for b in inputs if b not in branches]:
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
    """branch -> one input text per row of ``frame``."""
    return {
        b: [branch_text(parts, sep) for parts in zip(*(frame[c].tolist() for c in cols))] for b, cols in inputs.items()
    }


def _quota_weights(weights: Any, branches: Sequence[str] | None = None) -> np.ndarray:
    """Per-branch quota weights as float64, each finite and > 0; with ``branches``, ``weights`` may be None (all 1)
    or a mapping branch -> weight (missing ones 1)."""
    if branches is not None:
        if weights is None or isinstance(weights, Mapping):
            if unknown := [b for b in weights or {} if b not in branches]:
                raise ValueError(f"weights for unknown branches {unknown}: the branches are {branches}")
            weights = [(weights or {}).get(b, 1.0) for b in branches]
        elif len(weights := list(weights)) != len(branches):
            raise ValueError(f"need one weight per branch ({len(branches)}), got {len(weights)}")
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not w.size or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"weights must be finite and > 0, one per branch, got {list(np.atleast_1d(w))}")
    return w


class TriggerText(pt.Transformer):
    """``(qid, query)`` -> adds ``trigger_docno`` and ``column`` (``trigger_text``): the document ``retriever`` ranks at
    ``rank`` (from 0), the stand-in for UniERF's trigger items (Sec. 4.1.3; no result: None and ""). ``texts``: a
    mapping docno -> text, or a transformer adding ``text_field`` (e.g. ``pt.text.get_text(dataset, "text")``)."""

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
        self.retriever, self.texts, self.text_field = retriever, texts, text_field
        self.rank = non_negative_int("rank", rank)
        self.column = column

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        pt.validate.query_frame(inp, extra_columns=["query"])
        if not len(inp):
            return inp.assign(trigger_docno=pd.Series(dtype=object), **{self.column: pd.Series(dtype=object)})
        top = _top_depth(self.retriever, inp[["qid", "query"]].drop_duplicates("qid"), self.rank + 1)
        docnos = {q: d[self.rank] for q, d in top.items() if len(d) > self.rank}
        if isinstance(self.texts, Mapping) or not docnos:
            texts = {q: self.texts.get(d, "") for q, d in docnos.items()}
        else:
            loaded = self.texts(pd.DataFrame({"qid": list(docnos), "docno": list(docnos.values())}))
            if self.text_field not in loaded.columns:
                raise ValueError(f"the texts transformer did not add the column {self.text_field!r}")
            texts = dict(zip(loaded["qid"].astype(str), loaded[self.text_field].fillna("").astype(str)))
        qids = inp["qid"].astype(str).tolist()
        return inp.assign(
            trigger_docno=pd.Series([docnos.get(q) for q in qids], index=inp.index, dtype=object),
            **{self.column: pd.Series([texts.get(q, "") for q in qids], index=inp.index, dtype=object)},
        )

    def __repr__(self) -> str:
        return f"TriggerText({self.retriever!r}, rank={self.rank})"


class UniERFEncoder:
    """Encodes queries into one vector per UniERF branch, and documents once for all branches: :meth:`query_encoder`
    adds ``query_vec_<branch>`` per branch from its ``inputs`` columns (default :data:`DEFAULT_BRANCH_INPUTS`, joined by
    ``sep``), :meth:`doc_encoder` the shared tower's ``doc_vec``. ``model``: a SentenceTransformer with a
    MultiBranchQueryEncoder, or its path (``docs/unierf.md``)."""

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
        self.model = load_model(str(model)) if isinstance(model, (str, os.PathLike)) else model
        head = find_branches(self.model)
        self.branches = list(head.branches) if branches is None else check_branch_names(branches)
        for b in self.branches:
            head.branch_index(b)
        self.inputs, self.sep, self.text_field = _branch_inputs(self.branches, inputs), sep, text_field
        self.batch_size = positive_int("batch_size", batch_size)
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
        uniq = {b: unique_texts(t) for b, t in self.branch_texts(frame).items()}
        kw = {"batch_size": batch_size or self.batch_size, "show_progress_bar": self.verbose}
        emb = encode_branches(self.model, {b: u for b, (u, _) in uniq.items()}, **kw)
        return {b: emb[b][inv] for b, (_, inv) in uniq.items()}

    def query_encoder(self, batch_size: int | None = None) -> UniERFQueryEncoder:
        """Transformer adding ``query_vec_<branch>`` per branch to a query frame."""
        return UniERFQueryEncoder(self, batch_size=batch_size)

    def doc_encoder(self, batch_size: int | None = None, verbose: bool | None = None) -> pt.Transformer:
        """Transformer adding ``doc_vec`` (the shared document tower, normalised) to a document frame."""
        bi = ProbBiEncoder(self.model, batch_size=self.batch_size, text_field=self.text_field, verbose=self.verbose)
        return bi.doc_encoder(batch_size=batch_size, verbose=verbose)

    def __repr__(self) -> str:
        name = getattr(getattr(self.model, "model_card_data", None), "base_model", None) or type(self.model).__name__
        return f"UniERFEncoder({name!r}, branches={self.branches})"


class UniERFQueryEncoder(pt.Transformer):
    """Adds ``query_vec_<branch>`` per branch to a query frame; made by :meth:`UniERFEncoder.query_encoder`."""

    def __init__(self, encoder: UniERFEncoder, batch_size: int | None = None) -> None:
        self.encoder = encoder
        self.batch_size = positive_int("batch_size", batch_size, allow_none=True) or encoder.batch_size

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        cols = self.encoder.input_columns
        try:
            with pt.validate.any(inp) as v:
                v.query_frame(extra_columns=cols)
                v.columns(includes=["qid", *cols])
        except pt.validate.InputValidationError as e:
            missing = [c for c in ["qid", *cols] if c not in inp.columns]
            trigger = "trigger_text" in missing
            hint = " (add trigger_text with TriggerText(bm25, texts) >> encoder.query_encoder())" if trigger else ""
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


def branch_quotas(budget: int, weights: Sequence[float]) -> np.ndarray:
    """Split ``budget`` into per-branch quotas proportional to ``weights`` by largest remainder (ties: the earlier
    branch); ``(n_branches,)`` int64 summing to ``budget``."""
    budget = positive_int("budget", budget)
    w = _quota_weights(weights)
    exact = budget * w / w.sum()
    quotas = np.floor(exact).astype(np.int64)
    order = sorted(range(w.size), key=lambda i: (-(exact[i] - quotas[i]), i))
    quotas[order[: budget - int(quotas.sum())]] += 1
    return quotas


def merge_branch_lists(
    lists: Sequence[tuple[np.ndarray, np.ndarray]], budget: int, quotas: Sequence[int]
) -> list[tuple[int, float, list[int], int]]:
    """Merge per-branch ranked ``(docids, scores)`` lists (descending, at least ``budget`` long for an exact merge) into
    one deduplicated set of ``min(budget, |union|)`` documents under per-branch ``quotas`` (the walk in rounds:
    ``docs/unierf.md``, The merge). Returns ``[(docid, best score, finders ascending, claimer)]`` in selection order."""
    n = len(lists)
    if len(quotas) != n:
        raise ValueError(f"need one quota per branch ({n}), got {len(quotas)}")
    walk = _BranchWalk(lists, quotas)
    rounds = 0
    for lifted in (False, True):
        while len(walk.selected) < budget:
            walking = [b for b in range(n) if walk.can_step(b, lifted)]
            if not walking:
                break
            start = rounds % n
            rounds += 1
            for b in sorted(walking, key=lambda b: (b - start) % n):
                if len(walk.selected) >= budget:
                    break
                if walk.can_step(b, lifted):
                    walk.step(b)
    for b in range(n):  # the documents right after a branch's walk that are already selected cost it nothing
        while walk.can_step(b, True) and walk.docs[b][walk.pos[b]] in walk.selected:
            walk.step(b)
    return [(d, e[0], sorted(e[1]), e[2]) for d, e in walk.selected.items()]


class _BranchWalk:
    """The walk of :func:`merge_branch_lists`: each branch's position and claims, and the selected documents."""

    def __init__(self, lists: Sequence[tuple[np.ndarray, np.ndarray]], quotas: Sequence[int]) -> None:
        self.docs = [np.asarray(d).tolist() for d, _ in lists]
        self.scores = [np.asarray(s, dtype=np.float64).tolist() for _, s in lists]
        self.quotas = list(quotas)
        self.selected: dict[int, list] = {}  # docid -> [best score, finders set, claimer]
        self.claimed = [0] * len(lists)
        self.pos = [0] * len(lists)

    def can_step(self, b: int, lifted: bool) -> bool:
        """Branch ``b`` has candidates left and, unless quotas are lifted, quota left."""
        return self.pos[b] < len(self.docs[b]) and (lifted or self.claimed[b] < self.quotas[b])

    def step(self, b: int) -> None:
        """Branch ``b`` meets its next document: claims it if new, else joins its finders."""
        d, s = self.docs[b][self.pos[b]], self.scores[b][self.pos[b]]
        self.pos[b] += 1
        entry = self.selected.get(d)
        if entry is None:
            self.selected[d] = [s, {b}, b]
            self.claimed[b] += 1
        else:
            entry[1].add(b)
            entry[0] = max(entry[0], s)


class MultiBranchRetriever(Capped):
    """Searches every UniERF branch against one shared index and merges the branches' top-B (Alg. 1 lines 27-30) with
    :func:`merge_branch_lists` into B = ``num_results`` documents, quotas by ``weights`` (a mapping or one per branch).
    Output: ``qid, docno, docid, score`` (best cosine), ``rank`` (ties: lower docid), ``branch`` (the finders, e.g.
    ``"semantic|trigger"``) and the query columns (no vectors if ``drop_query_vec``; ``docs/unierf.md``)."""

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
        self.num_results = positive_int("num_results", num_results)
        self.weights = _quota_weights(weights, self.branches).tolist()
        self.batch_size = positive_int("batch_size", batch_size)
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

    def __mod__(self, k: int) -> MultiBranchRetriever:
        """The merge at budget ``min(k, num_results)`` (quotas recomputed), not a cut of the larger merge."""
        return self.fuse_rank_cutoff(k)

    def _one_row_per_query(self, inp: pd.DataFrame) -> pd.DataFrame:
        """Each qid once (its first row); a repeated qid must repeat every branch vector exactly."""
        if not len(inp):
            return inp
        owner = "MultiBranchRetriever"
        check_ids(inp, ["qid"], owner)
        codes, first = first_rows(inp["qid"])
        if len(first) == len(inp):
            return inp
        for col in self.vector_columns:
            reference = stack_arrays(inp[col].to_numpy()[first], col, lambda i: row_namer(inp)(int(first[i])), owner)
            check_rows_match_query(inp, codes, first, col, reference, owner)
        return inp.iloc[first].reset_index(drop=True)

    def transform(self, inp: pd.DataFrame) -> pd.DataFrame:
        cols = self.vector_columns
        drop = "it is a first-stage retriever: drop docno; " if "docno" in inp.columns else ""
        hint = f"{drop}add the branch vectors with UniERFEncoder(model).query_encoder()"
        validate_columns(self, inp, cols, hint, rerank=False)
        inp = self._one_row_per_query(inp.reset_index(drop=True))
        base = inp.drop(columns=cols) if self.drop_query_vec else inp
        if not len(inp):
            return empty_results(base, branch=object)
        budget, quotas = self.num_results, branch_quotas(self.num_results, self.weights)
        search = {"num_results": budget, "batch_size": self.batch_size, "verbose": self.verbose}
        hits = [threshold_search(self.index, inp[c].tolist(), -np.inf, **search) for c in cols]
        rows: list[tuple[int, int, float, int, str]] = []
        for qi in range(len(inp)):
            spans = [slice(h.offsets[qi], h.offsets[qi + 1]) for h in hits]
            lists = [(h.docids[span], h.scores[span]) for h, span in zip(hits, spans)]
            merged = sorted(merge_branch_lists(lists, budget, quotas), key=lambda m: (-m[1], m[0]))
            rows += [
                (qi, d, s, r, "|".join(self.branches[f] for f in found)) for r, (d, s, found, _) in enumerate(merged)
            ]
        res = pd.DataFrame(rows, columns=["query", "docid", "score", "rank", "branch"])
        res = res.astype({"query": np.int64, "docid": np.int64, "score": np.float32, "rank": np.int64})
        out = base.iloc[res.pop("query").to_numpy()].reset_index(drop=True)
        return out.assign(docno=docnos_of(self.index, res["docid"].to_numpy()), **{c: res[c].to_numpy() for c in res})


# --- training data (Sec. 4.3) -----------------------------------------------------------------------------------


def _lexical_query(text: str) -> str:
    """A bag-of-words query for a lexical retriever: punctuation (and ``[SEP]``) becomes spaces."""
    return " ".join(re.sub(r"[^\w]+", " ", text.replace("[SEP]", " ")).split())


def _top_depth(retriever: pt.Transformer, queries: pd.DataFrame, depth: int) -> dict[str, list[str]]:
    """qid -> the docnos of the retriever's top ``depth``, best first."""
    queries = queries[queries["query"].str.len() > 0]
    if not len(queries):
        return {}
    res = (retriever % depth).compile()(queries.reset_index(drop=True))
    if not len(res):
        return {}
    res = res.sort_values(["qid", "score"], ascending=[True, False], kind="stable")
    return {str(qid): g["docno"].astype(str).tolist()[:depth] for qid, g in res.groupby("qid", sort=False)}


def _tail(docnos: Sequence[str], share: float) -> list[str]:
    """The last ``ceil(share * len)`` of a ranked list."""
    return list(docnos[len(docnos) - math.ceil(share * len(docnos)) :])


@dataclass
class UniERFDataConfig:
    """Options of :func:`unierf_training_data` (Sec. 4.3): ``inputs`` (branch -> columns), ``retriever`` (lexical first
    stage for hard negatives), ``index`` (a DenseIndex for the trigger dissimilarity), ``hard_negatives`` (branches, or
    True / False), ``depth`` candidates of which the bottom ``tail`` share are hard negatives (Sec. 5.3.2: "the last
    30%"), ``categories`` / ``same_category_share`` (same-category random negatives), ``random_negative``,
    ``min_relevance`` (of a positive), ``max_examples`` (seeded sample), ``sep``, ``seed``."""

    inputs: Mapping[str, Sequence[str]] | None = None
    retriever: pt.Transformer | None = None
    index: Any = None
    hard_negatives: bool | Sequence[str] = True
    depth: int = 100
    tail: float = 0.3
    categories: Mapping[str, str] | None = None
    same_category_share: float = 0.5
    random_negative: bool = True
    min_relevance: int = 1
    max_examples: int | None = None
    sep: str = SEP
    seed: int = 0

    def __post_init__(self) -> None:
        self.depth = positive_int("depth", self.depth)
        self.tail = finite_float("tail", self.tail, low=0.0, high=1.0, low_open=True)
        self.max_examples = positive_int("max_examples", self.max_examples, allow_none=True)

    def hard_branches(self, names: list[str]) -> list[str]:
        """The branches that get hard negatives, checked against ``names`` and the retriever / index they need."""
        hard = hard_negative_branches(names, self.hard_negatives)
        if hard and self.retriever is None:
            raise ValueError(f"hard negatives for {hard} need a retriever (e.g. BM25) for the candidates")
        if "trigger" in hard and self.index is None:
            raise ValueError("the trigger branch's hard negatives need index= (a DenseIndex) to measure dissimilarity")
        return hard


def _training_examples(
    topics: pd.DataFrame, qrels: pd.DataFrame, doc_texts: Mapping[str, str], cfg: UniERFDataConfig
) -> tuple[pd.DataFrame, list[tuple[str, str]], dict[str, set[str]]]:
    """``(topics of the examples, (qid, docno) examples shuffled and sampled, qid -> relevant docnos)``."""
    topics = topics.assign(qid=topics["qid"].astype(str)).drop_duplicates("qid").reset_index(drop=True)
    qrels = qrels.assign(qid=qrels["qid"].astype(str), docno=qrels["docno"].astype(str))
    relevant: dict[str, set[str]] = qrels[qrels["label"] > 0].groupby("qid")["docno"].agg(set).to_dict()
    keep = (qrels["label"] >= cfg.min_relevance) & qrels["qid"].isin(set(topics["qid"]))
    pos = qrels[keep & qrels["docno"].isin(doc_texts)]
    examples = list(zip(pos["qid"], pos["docno"]))
    if not examples:
        raise ValueError(f"no judged-relevant (query, document) pairs of label >= {cfg.min_relevance} for these topics")
    random.Random(cfg.seed).shuffle(examples)
    examples = examples[: cfg.max_examples]
    used = sorted({q for q, _ in examples})
    return topics.set_index("qid").loc[used].reset_index(), examples, relevant


def _lexical_candidates(
    qids: Sequence[str], texts: Sequence[str], relevant: dict[str, set[str]], cfg: UniERFDataConfig
) -> dict[str, list[str]]:
    """qid -> the retriever's top-``depth`` for ``texts`` as bags of words, without the query's relevant documents."""
    queries = pd.DataFrame({"qid": qids, "query": [_lexical_query(str(t)) for t in texts]})
    top = _top_depth(cfg.retriever, queries, cfg.depth)
    return {q: [d for d in top.get(q, []) if d not in relevant.get(q, ())] for q in qids}


def _trigger_candidates(topics: pd.DataFrame, top: dict[str, list[str]], cfg: UniERFDataConfig) -> dict[str, list[str]]:
    """Trigger hard negatives (Eq. 25): the ``tail`` share of the lexical candidates ``top`` least similar to the
    trigger document."""
    dense = as_dense_index(cfg.index)
    vecs, lookup = dense.vectors(), dense.docnos()
    cands: dict[str, list[str]] = {}
    for qid, trig in zip(topics["qid"], topics["trigger_docno"]):
        docnos = [d for d in top[qid] if d != trig]
        if pd.isna(trig) or not docnos:
            cands[qid] = []
            continue
        ids = np.asarray(lookup.inv[np.asarray([str(trig), *docnos], dtype=str)], dtype=np.int64)
        if ids[0] < 0:
            raise ValueError(f"trigger document {trig!r} of query {qid!r} is not in {dense!r}")
        keep = ids[1:] >= 0
        v = np.asarray(vecs[ids[1:][keep]], dtype=np.float64)
        t = np.asarray(vecs[ids[0]], dtype=np.float64)
        sims = (v @ t) / np.maximum(np.linalg.norm(v, axis=1) * np.linalg.norm(t), 1e-12)
        order = np.argsort(-sims, kind="stable")  # most similar first: the tail is the least similar
        d_nos = [d for d, k in zip(docnos, keep) if k]
        cands[qid] = _tail([d_nos[i] for i in order], cfg.tail)
    return cands


def unierf_training_data(
    topics: pd.DataFrame,
    qrels: pd.DataFrame,
    doc_texts: Mapping[str, str],
    branches: Sequence[str] = ("semantic", "trigger"),
    config: UniERFDataConfig | None = None,
    **options: Any,
) -> Dataset:
    """UniERF training rows with differentiated negatives per branch (Sec. 4.3), mined with PyTerrier: per
    judged-relevant (query, document) pair every branch's input text, the document as positive (Eq. 20) and the
    negatives of :func:`st_extensions.build_unierf_dataset`, hard ones the bottom ``tail`` of the ``retriever``'s
    top-``depth``: least similar to the trigger document for ``trigger`` (Eq. 25), lowest scored otherwise (Eq. 24;
    ``docs/unierf.md``). Options: a :class:`UniERFDataConfig` or its fields as keywords; a :class:`datasets.Dataset` for
    ``UniERFLoss``."""
    if config is not None and options:
        raise TypeError(f"pass either config or keyword options, not both (got {sorted(options)})")
    cfg = config if config is not None else UniERFDataConfig(**options)
    names = check_branch_names(branches)
    branch_inputs = _branch_inputs(names, cfg.inputs)
    hard = cfg.hard_branches(names)
    needed = ["qid", *dict.fromkeys(c for cols in branch_inputs.values() for c in cols)]
    needed += ["trigger_docno"] if "trigger" in hard else []
    trigger_missing = {"trigger_text", "trigger_docno"} & (set(needed) - set(topics.columns))
    require_columns(topics, needed, "topics", " (add them with TriggerText(bm25, texts))" if trigger_missing else "")
    require_columns(qrels, ["qid", "docno", "label"], "qrels")
    topics, examples, relevant = _training_examples(topics, qrels, doc_texts, cfg)
    texts = _frame_branch_texts(topics, branch_inputs, cfg.sep)
    candidates: dict[str, dict[str, list[str]]] = {}
    qids = topics["qid"].tolist()
    for b in hard:  # the trigger branch's candidates are the query's, the others' those of their own text
        top = _lexical_candidates(qids, topics["query"] if b == "trigger" else texts[b], relevant, cfg)
        tails = {q: _tail(d, cfg.tail) for q, d in top.items()}
        candidates[b] = _trigger_candidates(topics, top, cfg) if b == "trigger" else tails
    row_of = {q: i for i, q in enumerate(topics["qid"])}
    return build_unierf_dataset(
        anchors={b: [texts[b][row_of[q]] for q, _ in examples] for b in names},
        positives=[d for _, d in examples],
        doc_texts=doc_texts,
        hard_negatives={b: [candidates[b].get(q, []) for q, _ in examples] for b in hard},
        exclude=[relevant.get(q, set()) for q, _ in examples],
        categories=cfg.categories,
        same_category_share=cfg.same_category_share,
        random_negative=cfg.random_negative,
        seed=cfg.seed,
    )
