"""Training rows for a (Var)CrossEncoder re-ranker from any collection's train split (VarCrossEncoder Sec. 4.3).

The paper fine-tunes its re-rankers on (query, document, label) triples, one judged-relevant document
against hard negatives from a first stage (1 positive : 4 negatives on MS MARCO, Sec. 4.3). Both the
CrossEncoder's ``BinaryCrossEntropyLoss`` and :class:`~st_extensions.losses.VariationalBCELoss` (Eq. 10, 17-21)
train on such rows, so every re-ranker of an experiment can be given the very same data.
:func:`cross_encoder_training_data` builds them from a :class:`~pyterrier_prob.collections.Collection` split and a
first stage (BM25 in :mod:`pyterrier_prob.experiments.varce`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from typing import Any

import pandas as pd
from datasets import Dataset

from pyterrier_prob.collections import Collection

__all__ = ["cross_encoder_training_data", "groups_for", "normalise_query"]


def normalise_query(text: str) -> str:
    """A query with its whitespace collapsed (one line, single spaces): the form re-rankers and caches see."""
    return " ".join(str(text).split())


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
    """``(query, document, label)`` rows: per group one judged-relevant document and ``negatives`` hard negatives.

    Queries of ``split`` with at least one judged-relevant document (label >= ``min_relevance``) in the corpus
    are shuffled (``seed``) and taken in turn, ``n_groups`` times (each query once while ``n_groups`` does not
    exceed their number, then round again). A group is the query with one of its relevant documents (label 1.0)
    and ``negatives`` documents (label 0.0) drawn from the query's ``first_stage`` top ``pool_depth`` minus **every
    document judged for it** (relevant or not); when that pool runs short, random unjudged documents of the corpus
    fill in (counted in the returned info). Several first stages (a mapping name -> first stage, e.g. BM25 and the
    untrained dense model) share the negatives of a group in turn: the i-th negative comes from stage i mod S's pool
    (a document already drawn is skipped; a stage whose pool is spent hands its turn to the next).

    With ``positive_depth`` the positives are only the relevant documents some first stage ranks in its top
    ``positive_depth`` (the candidates a re-ranker of that depth sees; queries with none are left out): otherwise
    most positives of a collection judged by citation (nfcorpus) are documents no first stage retrieves, set against
    negatives taken from the top of the first stages, and a re-ranker learns to prefer documents unlike the query.

    The relevant documents of a query are cycled across the rounds: shuffled once per query (``seed``), its r-th
    group takes the (r mod n)-th of its n relevant documents, so every relevant document of a query is trained on
    before any repeats (as the queries themselves are: each once per round).

    Args:
        collection: the collection (its documents and the split's topics and qrels).
        split: the split to train on (e.g. ``"train"``).
        first_stage: topics (``qid, query``) -> a ranked result frame (``qid, docno, rank``), e.g. a PISA
            index's ``bm25(num_results=pool_depth)``; only its top ``pool_depth`` per query are used. A mapping
            ``{name: first_stage}`` mines the negatives from several first stages in turn.
        n_groups: number of (query, positive, negatives) groups; each gives ``1 + negatives`` rows.
        negatives: negatives per positive (the paper's 1:4 ratio is ``negatives=4``).
        pool_depth: depth of the first-stage ranking the negatives come from.
        seed: seed of the query order, the order each query's positives cycle in, and the negatives.
        min_relevance: smallest label counted as relevant.
        positive_depth: keep only positives within a first stage's top ``positive_depth`` (None: every relevant
            document); the first stages must return that many documents per query.

    Returns:
        ``(dataset, info)``: a :class:`datasets.Dataset` with columns ``query``, ``document``, ``label`` (float;
        the rows of a group are consecutive, positive first) and a dict describing what was built.

    Raises:
        ValueError: bad sizes, or a split with no relevant (query, document) pair in the corpus.
    """
    sizes = [("n_groups", n_groups, 1), ("negatives", negatives, 1), ("pool_depth", pool_depth, 1)]
    if positive_depth is not None:
        sizes.append(("positive_depth", positive_depth, 1))
    for name, value, low in sizes:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    topics = collection.topics(split)
    queries = {str(q): normalise_query(t) for q, t in zip(topics["qid"], topics["query"])}
    qrels = collection.qrels(split)
    judged: dict[str, set[str]] = {}
    relevant: dict[str, set[str]] = {}
    for q, d, label in qrels[["qid", "docno", "label"]].itertuples(index=False):
        q, d = str(q), str(d)
        judged.setdefault(q, set()).add(d)
        if label >= min_relevance:
            relevant.setdefault(q, set()).add(d)
    candidates = sorted(q for q in relevant if queries.get(q))
    # the relevant documents that exist in the corpus (a qrel may name a document the corpus lacks)
    texts = collection.doc_texts({d for q in candidates for d in relevant[q]})
    relevant = {q: sorted(d for d in relevant[q] if d in texts) for q in candidates}
    qids = [q for q in candidates if relevant[q]]
    if not qids:
        raise ValueError(
            f"{collection.name}/{split} has no query with a judged-relevant document (label >= {min_relevance}) "
            "in the corpus: nothing to train a re-ranker on"
        )
    stages = dict(first_stage) if isinstance(first_stage, Mapping) else {"first_stage": first_stage}
    if not stages or not all(callable(f) for f in stages.values()):
        raise ValueError("first_stage must be a callable or a non-empty mapping of names to callables")
    frame = pd.DataFrame({"qid": qids, "query": [queries[q] for q in qids]})
    pools: dict[str, dict[str, list[str]]] = {}
    ranked_docs: dict[str, set[str]] = {}
    for name, stage in stages.items():
        ranked = stage(frame)
        ranked = ranked.assign(qid=ranked["qid"].astype(str), docno=ranked["docno"].astype(str))
        if "rank" in ranked.columns:
            ranked = ranked.sort_values(["qid", "rank"], kind="stable")
        pools[name] = {}
        for q, g in ranked.groupby("qid", sort=False):
            docs = list(g["docno"])
            pools[name][q] = docs[:pool_depth]
            if positive_depth is not None:
                ranked_docs.setdefault(q, set()).update(docs[:positive_depth])
    n_relevant = sum(len(relevant[q]) for q in qids)
    if positive_depth is not None:
        relevant = {q: [d for d in relevant[q] if d in ranked_docs.get(q, ())] for q in qids}
        qids = [q for q in qids if relevant[q]]
        if not qids:
            raise ValueError(
                f"no query of {collection.name}/{split} has a judged-relevant document in a first stage's top "
                f"{positive_depth}"
            )
    rng = random.Random(seed)
    rng.shuffle(qids)
    picked = [qids[i % len(qids)] for i in range(n_groups)]
    unique = list(dict.fromkeys(picked))

    positives = {q: rng.sample(relevant[q], len(relevant[q])) for q in unique}  # each query's cycle, shuffled once
    rounds = dict.fromkeys(unique, 0)
    all_docnos: list[str] | None = None
    n_random = 0
    from_stage = [0] * len(stages)
    groups: list[tuple[str, str, list[str]]] = []
    for q in picked:
        pos = positives[q][rounds[q] % len(positives[q])]
        rounds[q] += 1
        negs = _draw_negatives(rng, [pools[n].get(q, []) for n in stages], judged[q], negatives, from_stage)
        if len(negs) < negatives:
            if all_docnos is None:
                all_docnos = sorted(d["docno"] for d in collection.corpus_iter())
            free = len(all_docnos) - len(judged[q] | set(negs))
            if free < negatives - len(negs):
                raise ValueError(
                    f"{collection.name} has too few unjudged documents for {negatives} negatives of query {q!r}"
                )
            while len(negs) < negatives:
                d = rng.choice(all_docnos)
                if d not in judged[q] and d not in negs:
                    negs.append(d)
                    n_random += 1
        groups.append((q, pos, negs))
    texts.update(collection.doc_texts({d for _, _, negs in groups for d in negs} - set(texts)))
    rows: dict[str, list[Any]] = {"query": [], "document": [], "label": []}
    for q, pos, negs in groups:
        for d, y in [(pos, 1.0)] + [(d, 0.0) for d in negs]:
            rows["query"].append(queries[q])
            rows["document"].append(texts.get(d, ""))
            rows["label"].append(y)
    info = {
        "source": f"{collection.name}/{split}",
        "queries": len(unique),
        "queries_available": len(qids),
        "groups": n_groups,
        "rows": len(rows["label"]),
        "positives_per_group": 1,
        "negatives_per_group": negatives,
        "negatives": f"first-stage top {pool_depth} of the query minus its judged documents",
        "negatives_from": dict(zip(stages, from_stage)),
        "positives": (
            "every judged-relevant document"
            if positive_depth is None
            else f"judged-relevant documents in a first stage's top {positive_depth}"
        ),
        "positives_available": sum(len(relevant[q]) for q in qids),
        "relevant_judged": n_relevant,
        "random_negatives_filled_in": n_random,
    }
    return Dataset.from_dict(rows), info


def _draw_negatives(
    rng: random.Random, pools: list[list[str]], judged: set[str], k: int, counts: list[int]
) -> list[str]:
    """Up to ``k`` distinct unjudged documents, the i-th from pool i mod S (each pool sampled without replacement;
    a spent pool passes its turn on); ``counts[s]`` counts those taken from pool s."""
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
