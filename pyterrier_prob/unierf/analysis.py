"""The UniERF experiment's instruments (:mod:`pyterrier_prob.experiments.unierf`): a loss recording per step what the
report shows (batch fingerprints, branch cosines), and analyses of branch candidate lists: each branch's top-k, their
merge into a budget B (as :class:`~pyterrier_prob.MultiBranchRetriever`) and the branches' overlap."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from pyterrier_prob.dense import TopKRetriever
from pyterrier_prob.unierf.branches import branch_quotas, merge_branch_lists, query_vec_column
from st_extensions.losses import UniERFLoss
from st_extensions.losses.unierf import FrozenDocumentTower

__all__ = [
    "RECORDED",
    "BranchLists",
    "LossFactory",
    "RecordedUniERFLoss",
    "alone_run",
    "branch_lists",
    "mean_jaccard",
    "merged_run",
]

RECORDED = ("branch_cos", "share_above_alpha", "diversity_term")
"""What :class:`RecordedUniERFLoss` records per step (``stats``)."""


BranchLists = dict[str, tuple[np.ndarray, np.ndarray]]


def branch_lists(frame: pd.DataFrame, index: Any, branch: str, k: int) -> BranchLists:
    """qid -> (docnos, scores) of branch ``branch``'s top-``k`` cosine search, best first."""
    col = query_vec_column(branch)
    queries = frame[["qid", col]].rename(columns={col: "query_vec"})
    res = TopKRetriever(index, num_results=k)(queries).sort_values(["qid", "rank"], kind="stable")
    return {
        str(q): (g["docno"].astype(str).to_numpy(), g["score"].to_numpy(np.float64))
        for q, g in res.groupby("qid", sort=False)
    }


def alone_run(lists: BranchLists, budget: int) -> pd.DataFrame:
    """One branch's top-``budget`` as a run (the branch given the whole budget)."""
    rows = [
        (q, d, float(s), r) for q, (ds, ss) in lists.items() for r, (d, s) in enumerate(zip(ds[:budget], ss[:budget]))
    ]
    return pd.DataFrame(rows, columns=["qid", "docno", "score", "rank"])


def merged_run(
    per_branch: Sequence[BranchLists], budget: int, weights: Sequence[float] | None = None
) -> tuple[pd.DataFrame, float]:
    """The branches' lists merged into ``budget`` documents, quotas by ``weights`` (default: equal), as
    :class:`~pyterrier_prob.MultiBranchRetriever` does; and the mean share of the merged set several branches found."""
    quotas = branch_quotas(budget, [1.0] * len(per_branch) if weights is None else weights)
    empty = (np.empty(0, dtype=object), np.empty(0))
    qids = list(dict.fromkeys(q for b in per_branch for q in b))
    rows, shared = [], []
    for qid in qids:
        lists = [(b.get(qid, empty)[0][:budget], b.get(qid, empty)[1][:budget]) for b in per_branch]
        merged = sorted(merge_branch_lists(lists, budget, quotas), key=lambda m: (-m[1], str(m[0])))
        rows += [(qid, d, s, r) for r, (d, s, _, _) in enumerate(merged)]
        shared.append(np.mean([len(m[2]) > 1 for m in merged]) if merged else 0.0)
    run = pd.DataFrame(rows, columns=["qid", "docno", "score", "rank"])
    return run, float(np.mean(shared)) if shared else float("nan")


def mean_jaccard(a: BranchLists, b: BranchLists, k: int) -> float:
    """Mean over queries of the Jaccard index of the two branches' top-``k`` sets (summed over the queries in ``a``'s
    order, then ``b``'s others: a set's order would follow the string hash, which changes from one process to the next,
    and so would the mean's last bits)."""
    vals = []
    for qid in dict.fromkeys([*a, *b]):
        x = set(a[qid][0][:k].tolist()) if qid in a else set()
        y = set(b[qid][0][:k].tolist()) if qid in b else set()
        if x | y:
            vals.append(len(x & y) / len(x | y))
    return float(np.mean(vals)) if vals else float("nan")


class RecordedUniERFLoss(UniERFLoss):
    """``UniERFLoss`` that also records per step a fingerprint of the batch (``digest`` of its anchor and positive token
    ids) and in ``stats`` the mean cosine of a row's two branch embeddings, the share of rows above alpha (those Eq. 31
    acts on) and the diversity term. ``resumed``: continued from a checkpoint (only its last batches are seen)."""

    def __init__(self, model: Any, columns: Sequence[str], resumed: bool = False, **kwargs: Any) -> None:
        super().__init__(model, columns=list(columns), **kwargs)
        self.marks = [list(columns).index(c) for c in ("anchor_semantic", "positive_doc")]
        self.digest, self.resumed = hashlib.sha1(), resumed
        self.stats: dict[str, list[float]] = {k: [] for k in RECORDED}

    def record(self) -> dict[str, Any]:
        """What is saved beside the trained model: ``stats`` and the batches' fingerprint (None when resumed)."""
        return {"batch_fingerprint": None if self.resumed else self.digest.hexdigest()[:16], "stats": self.stats}

    def forward(self, sentence_features, labels=None):
        features = list(sentence_features)
        for i in self.marks:
            for key in FrozenDocumentTower.row_keys(features[i]):
                self.digest.update(key + b"|")
        return super().forward(features, labels)

    def terms_from_embeddings(self, branch_emb, positives, negatives, tags, labels=None):
        terms = super().terms_from_embeddings(branch_emb, positives, negatives, tags, labels=labels)
        if len(branch_emb) == 2:
            h1, h2 = (e.detach() for e in branch_emb.values())
            cos = (h1 * h2).sum(-1)
            self.stats["branch_cos"].append(float(cos.mean()))
            self.stats["share_above_alpha"].append(float((cos > self.config.diversity_threshold).float().mean()))
            self.stats["diversity_term"].append(float(terms["diversity"].detach()))
        return terms


class LossFactory:
    """Makes a system's :class:`RecordedUniERFLoss` for :meth:`Harness.train` and keeps it (``loss`` stays None
    when the model was reused rather than trained)."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs, self.loss = kwargs, None

    def __call__(self, model: Any) -> RecordedUniERFLoss:
        self.loss = RecordedUniERFLoss(model, **self.kwargs)
        return self.loss
