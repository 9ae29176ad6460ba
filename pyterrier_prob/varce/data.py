"""Training rows for a (Var)CrossEncoder re-ranker from any collection's train split (VarCrossEncoder Sec. 4.3): one
judged-relevant document against hard negatives from first stages (the paper's 1 : 4), the same rows for the CE's
``BinaryCrossEntropyLoss`` and :class:`~st_extensions.losses.VariationalBCELoss` (Eq. 10). How the rows are drawn:
docs/varce.md ("The experiment")."""

from __future__ import annotations

import itertools
import math
import random
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import pandas as pd
from datasets import Dataset

from pyterrier_prob.collections import Collection

__all__ = ["cross_encoder_training_data", "evaluated_queries", "groups_for", "normalise_query"]


def normalise_query(text: str) -> str:
    """A query with its whitespace collapsed (one line, single spaces): the form re-rankers and caches see."""
    return " ".join(str(text).split())


def evaluated_queries(
    topics: pd.DataFrame, qrels: pd.DataFrame, cap: int | None, seed: int
) -> tuple[pd.DataFrame, pd.DataFrame, int]:
    """``(topics, qrels, number of queries with a relevant document)``: the queries with a judged-relevant document
    (whitespace-normalised, at most ``cap``, seeded, sorted by qid) and their qrels, negative labels counted as 0."""
    qrels = qrels.assign(qid=qrels["qid"].astype(str), label=qrels["label"].clip(lower=0))
    relevant = set(qrels.loc[qrels["label"] >= 1, "qid"])
    t = topics.assign(qid=topics["qid"].astype(str), query=topics["query"].map(normalise_query))
    t = t[t["qid"].isin(relevant) & (t["query"] != "")]
    available = len(t)
    if cap is not None and cap < len(t):
        t = t.sample(n=cap, random_state=seed)
    t = t.sort_values("qid").reset_index(drop=True)[["qid", "query"]]
    return t, qrels[qrels["qid"].isin(set(t["qid"]))].reset_index(drop=True), available


def cross_encoder_training_data(
    collection: Collection,
    split: str,
    first_stage: Callable[[pd.DataFrame], pd.DataFrame] | Mapping[str, Callable[[pd.DataFrame], pd.DataFrame]],
    n_groups: int,
    negatives: int = 3,
    pool_depth: int = 30,
    seed: int = 0,
    min_relevance: int = 1,
    positive_depth: int | None = None,
) -> tuple[Dataset, dict[str, Any]]:
    """``(dataset, info)``: ``query, document, label`` rows, per group one judged-relevant document (1.0, first) and
    ``negatives`` (0.0) from the query's first-stage top ``pool_depth`` minus its judged documents. ``first_stage``:
    topics -> a ranked frame (``qid, docno, rank``), or ``{name: first_stage}`` giving a group's negatives in turn;
    ``positive_depth`` keeps only positives some first stage ranks that high; random unjudged documents fill short pools
    (queries shuffled by ``seed``; docs/varce.md, "The experiment")."""
    sizes = [("n_groups", n_groups), ("negatives", negatives), ("pool_depth", pool_depth)]
    for name, value in sizes + ([("positive_depth", positive_depth)] if positive_depth is not None else []):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    stages = dict(first_stage) if isinstance(first_stage, Mapping) else {"first_stage": first_stage}
    if not stages or not all(callable(f) for f in stages.values()):
        raise ValueError("first_stage must be a callable or a non-empty mapping of names to callables")
    queries, judged, relevant, texts = _judgements(collection, split, min_relevance)
    qids = list(relevant)
    frame = pd.DataFrame({"qid": qids, "query": [queries[q] for q in qids]})
    pools = {name: _ranked_lists(stage(frame)) for name, stage in stages.items()}
    n_relevant = sum(len(relevant[q]) for q in qids)
    if positive_depth is not None:  # only the relevant documents a first stage ranks in its top positive_depth
        seen = {q: {d for p in pools.values() for d in p.get(q, [])[:positive_depth]} for q in qids}
        relevant = {q: [d for d in relevant[q] if d in seen[q]] for q in qids}
        qids = [q for q in qids if relevant[q]]
    if not qids:
        raise ValueError(f"no query of {collection.name}/{split} has a judged-relevant document in a first stage's top "
                         f"{positive_depth}")  # fmt: skip
    rng = random.Random(seed)
    rng.shuffle(qids)
    picked = [qids[i % len(qids)] for i in range(n_groups)]
    positives = {q: itertools.cycle(rng.sample(relevant[q], len(relevant[q]))) for q in dict.fromkeys(picked)}
    from_stage, corpus, n_random = [0] * len(stages), [], 0
    groups: list[tuple[str, str, list[str]]] = []
    for q in picked:
        negs = _draw_negatives(rng, [pools[n].get(q, [])[:pool_depth] for n in pools], judged[q], negatives, from_stage)
        if len(negs) < negatives:  # random unjudged documents fill in
            corpus = corpus or sorted(d["docno"] for d in collection.corpus_iter())
            n_random += _fill_in(rng, corpus, judged[q], negs, negatives, f"{collection.name} query {q!r}")
        groups.append((q, next(positives[q]), negs))  # the query's relevant documents in turn
    texts.update(collection.doc_texts({d for _, _, negs in groups for d in negs} - set(texts)))
    rows = [
        (queries[q], texts.get(d, ""), y) for q, pos, negs in groups for d, y in [(pos, 1.0)] + [(n, 0.0) for n in negs]
    ]
    info = {
        "source": f"{collection.name}/{split}",
        "queries": len(positives),
        "queries_available": len(qids),
        "groups": n_groups,
        "rows": len(rows),
        "positives_per_group": 1,
        "negatives_per_group": negatives,
        "negatives": f"first-stage top {pool_depth} of the query minus its judged documents",
        "negatives_from": dict(zip(stages, from_stage)),
        "positives": "every judged-relevant document"
        if positive_depth is None
        else f"judged-relevant documents in a first stage's top {positive_depth}",
        "positives_available": sum(len(relevant[q]) for q in qids),
        "relevant_judged": n_relevant,
        "random_negatives_filled_in": n_random,
    }
    return Dataset.from_dict(dict(zip(("query", "document", "label"), map(list, zip(*rows))))), info


def _judgements(collection: Collection, split: str, min_relevance: int) -> tuple[dict, dict, dict, dict]:
    """``(queries, judged, relevant, texts)`` of a split; ``relevant`` keeps only documents in the corpus (sorted)."""
    topics = collection.topics(split)
    queries = {str(q): normalise_query(t) for q, t in zip(topics["qid"], topics["query"])}
    judged: dict[str, set[str]] = defaultdict(set)
    relevant: dict[str, set[str]] = defaultdict(set)
    for q, d, label in collection.qrels(split)[["qid", "docno", "label"]].itertuples(index=False):
        judged[str(q)].add(str(d))
        if label >= min_relevance:
            relevant[str(q)].add(str(d))
    candidates = sorted(q for q in relevant if queries.get(q))
    texts = collection.doc_texts({d for q in candidates for d in relevant[q]})
    kept = {q: docs for q in candidates if (docs := sorted(d for d in relevant[q] if d in texts))}
    if not kept:
        raise ValueError(
            f"{collection.name}/{split} has no query with a judged-relevant document (label >= {min_relevance}) "
            "in the corpus: nothing to train a re-ranker on"
        )
    return queries, judged, kept, texts


def _ranked_lists(ranked: pd.DataFrame) -> dict[str, list[str]]:
    """A first stage's ranking as ``{qid: docnos, best first}``."""
    ranked = ranked.assign(qid=ranked["qid"].astype(str), docno=ranked["docno"].astype(str))
    if "rank" in ranked.columns:
        ranked = ranked.sort_values(["qid", "rank"], kind="stable")
    return {q: list(g["docno"]) for q, g in ranked.groupby("qid", sort=False)}


def _fill_in(rng: random.Random, corpus: list[str], judged: set[str], negs: list[str], k: int, what: str) -> int:
    """Add random unjudged documents of ``corpus`` to ``negs`` until it has ``k``; returns how many were added."""
    missing = k - len(negs)
    if len(corpus) - len(judged | set(negs)) < missing:
        raise ValueError(f"too few unjudged documents for {k} negatives of {what}")
    while len(negs) < k:
        d = rng.choice(corpus)
        if d not in judged and d not in negs:
            negs.append(d)
    return missing


def _draw_negatives(
    rng: random.Random, pools: list[list[str]], judged: set[str], k: int, counts: list[int]
) -> list[str]:
    """Up to ``k`` distinct unjudged documents, the i-th from pool i mod S (a spent pool passes its turn on);
    ``counts[s]`` counts those taken from pool s."""
    left = [rng.sample(p, len(p)) for p in ([d for d in pool if d not in judged] for pool in pools)]
    negs: list[str] = []
    turn = 0
    while len(negs) < k and any(left):
        s = turn % len(left)
        turn += 1
        while left[s] and left[s][-1] in negs:
            left[s].pop()
        if left[s]:
            negs.append(left[s].pop())
            counts[s] += 1
    return negs


def groups_for(steps: int, batch_size: int, negatives: int) -> int:
    """Groups of ``1 + negatives`` rows that fill ``steps`` batches of ``batch_size`` rows (rounded up)."""
    return max(1, math.ceil(steps * batch_size / (1 + negatives)))
