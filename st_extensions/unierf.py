"""UniERF models (Jiang et al., KDD'25, ``../shared/papers/unierf.md``, Sec. 4): several retrieval branches on one
encoder (:class:`~st_extensions.modules.MultiBranchQueryEncoder`, Sec. 4.1), their input texts (:func:`branch_text`),
their embeddings and their differentiated training rows (:func:`build_unierf_dataset`, Sec. 4.3); the loss is
:class:`~st_extensions.losses.UniERFLoss`, more in ``docs/unierf.md``.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformer

from st_extensions.checks import positive_int, probability
from st_extensions.defaults import base_modules, find_module
from st_extensions.modules.branches import MultiBranchQueryEncoder, check_branch_names

#: Separator between the parts of a branch's input text (BERT-like tokenizers read ``[SEP]`` as a text pair's).
SEP = " [SEP] "
#: Column of the positive document in UniERF training rows.
POSITIVE_COLUMN = "positive_doc"
#: Column of the shared (random or same-category random) negative.
RANDOM_NEGATIVE_COLUMN = "negative_random"


def anchor_column(branch: str) -> str:
    """The training column holding ``branch``'s input text: ``anchor_<branch>``."""
    return f"anchor_{branch}"


def negative_column(branch: str) -> str:
    """The training column holding ``branch``'s hard negative: ``negative_<branch>``."""
    return f"negative_{branch}"


def find_branches(model: torch.nn.Module) -> MultiBranchQueryEncoder:
    """The model's :class:`MultiBranchQueryEncoder`; a clear error when it has none (or several)."""
    return find_module(model, MultiBranchQueryEncoder, "UniERF needs", "build_unierf_model")


def build_unierf_model(
    base_model: str | SentenceTransformer | None = None,
    branches: Sequence[str] = ("semantic", "trigger"),
    init_std: float = 0.01,
    seed: int = 0,
    device: str | None = None,
) -> SentenceTransformer:
    """A SentenceTransformer whose query path ends in a :class:`MultiBranchQueryEncoder` (UniERF Sec. 4.1).

    ``base_model`` (name, path or model, deep-copied; default the packaged all-MiniLM-L6-v2) is the shared encoder of
    every branch and the document tower (Sec. 4.2); each branch head starts as the identity plus ``init_std`` noise
    (seeded by ``seed``). ``encode_query(texts, branch=b)`` gives branch b's normalised embeddings."""
    names = check_branch_names(branches)
    modules, dim, device = base_modules(base_model, device, MultiBranchQueryEncoder)
    head = MultiBranchQueryEncoder(dim, names, init_std=init_std, seed=seed, residual=True)
    return SentenceTransformer(modules=[*modules, head], device=device)


def branch_text(parts: Sequence[str | None], sep: str = SEP) -> str:
    """A branch's input text: its non-empty parts joined by ``sep``; training and inference both use it."""
    if isinstance(parts, str):
        raise ValueError("branch_text takes a sequence of parts, e.g. [query, trigger_text], not a single string")
    kept = [str(p).strip() for p in parts if p is not None and not (isinstance(p, float) and np.isnan(p))]
    return sep.join(p for p in kept if p)


def encode_branches(
    model: SentenceTransformer,
    branch_texts: Mapping[str, Sequence[str]],
    batch_size: int = 32,
    show_progress_bar: bool | None = None,
) -> dict[str, np.ndarray]:
    """Each branch's query embeddings ``H^b`` (Eq. 5) of its own input texts (:func:`branch_text`; any subset of the
    branches): branch -> ``(len(texts), dim)`` float32 unit rows. ValueError: unknown branch / no encoder."""
    head = find_branches(model)
    positive_int("batch_size", batch_size)
    for branch in branch_texts:
        head.branch_index(branch)
    out: dict[str, np.ndarray] = {}
    for branch, texts in branch_texts.items():
        if isinstance(texts, str):
            raise ValueError(f"branch_texts[{branch!r}] must be a sequence of texts, got a single string")
        texts = [str(t) for t in texts]
        kwargs = {"batch_size": batch_size, "branch": branch, "show_progress_bar": show_progress_bar}
        emb = model.encode_query(texts, convert_to_numpy=True, **kwargs) if texts else np.zeros((0, head.in_features))
        out[branch] = np.asarray(emb, dtype=np.float32)
    return out


# ---- Training data (Sec. 4.3) --------------------------------------------------------------------


def unierf_columns(
    branches: Sequence[str], random_negative: bool = True, hard_negatives: Sequence[str] | bool = True
) -> list[str]:
    """The column layout of UniERF rows as :class:`~st_extensions.losses.UniERFLoss` reads it: ``anchor_<b>`` per
    branch, ``positive_doc``, ``negative_random`` if ``random_negative``, ``negative_<b>`` for b in ``hard_negatives``
    (True: all)."""
    names = check_branch_names(branches)
    hard = hard_negative_branches(names, hard_negatives)
    return [
        *(anchor_column(b) for b in names),
        POSITIVE_COLUMN,
        *([RANDOM_NEGATIVE_COLUMN] if random_negative else []),
        *(negative_column(b) for b in names if b in hard),
    ]


def hard_negative_branches(branches: Sequence[str], hard_negatives: Sequence[str] | bool = True) -> list[str]:
    """The branches with a hard negative ``negative_<b>``: all (True), none (False) or those named, in the order of
    ``branches``. ValueError: a name not among ``branches``."""
    if isinstance(hard_negatives, bool):
        return list(branches) if hard_negatives else []
    unknown = [b for b in hard_negatives if b not in branches]
    if unknown:
        raise ValueError(f"hard_negatives names unknown branches {unknown}: the branches are {list(branches)}")
    return [b for b in branches if b in hard_negatives]


def parse_unierf_columns(columns: Sequence[str], branches: Sequence[str]) -> tuple[list[str], list[str | None]]:
    """Read a UniERF column layout (``anchor_<b>``..., one ``positive*``, then ``negative*`` columns).

    Returns ``(anchor branches in column order, negative tags)``: ``negative_<b>`` is branch b's hard negative (tag b),
    any other ``negative*`` is shared (``None``). ValueError: unknown column or branch, repeated anchor, wrong order."""
    columns = list(columns)
    i = next((i for i, c in enumerate(columns) if not c.startswith("anchor_")), len(columns))
    anchors = [c.removeprefix("anchor_") for c in columns[:i]]
    for k, (col, name) in enumerate(zip(columns, anchors)):
        if name not in branches:
            raise ValueError(f"column {col!r} names an unknown branch {name!r}: the branches are {list(branches)}")
        if name in anchors[:k]:
            raise ValueError(f"column {col!r} appears twice")
    if not anchors:
        raise ValueError(
            f"UniERF rows start with one anchor_<branch> column per branch, got columns {columns}: "
            f"expected e.g. {unierf_columns(branches)}"
        )
    if i >= len(columns) or not columns[i].startswith("positive"):
        raise ValueError(
            f"after the anchor columns UniERF rows need one positive column (e.g. {POSITIVE_COLUMN!r}), got {columns}"
        )
    negatives: list[str | None] = []
    for col in columns[i + 1 :]:
        if not col.startswith("negative"):
            raise ValueError(
                f"column {col!r} is neither anchor_<branch>, positive nor negative*: drop it before training "
                f"(UniERF layout: {unierf_columns(branches)})"
            )
        tag = col.removeprefix("negative_") if col.startswith("negative_") else None
        negatives.append(tag if tag in branches else None)
    return anchors, negatives


class _NegativeDraws:
    """The seeded negative draws of :func:`build_unierf_dataset` (Sec. 4.3.2-4.3.3), in row order."""

    def __init__(
        self, pool: list[str], categories: Mapping[str, str] | None, same_category_share: float, seed: int
    ) -> None:
        self.rng, self.pool, self.share = random.Random(seed), pool, same_category_share
        self.categories = categories or {}
        self.by_category: dict[str, list[str]] = {}
        for doc in pool:
            if doc in self.categories:
                self.by_category.setdefault(self.categories[doc], []).append(doc)

    def random(self, i: int, positive: str, excluded: Collection[str]) -> str:
        """Uniform over the corpus; for a share of the rows over the positive's category (if it has other docs)."""
        category = self.categories.get(positive)
        same = category is not None and self.rng.random() < self.share
        pool = (self.by_category.get(category, []) if same else []) or self.pool
        for _ in range(64):
            doc = pool[self.rng.randrange(len(pool))]
            if doc not in excluded:
                return doc
        rest = [d for d in pool if d not in excluded]
        if not rest:
            raise ValueError(f"example {i} has no document left to draw a negative from")
        return self.rng.choice(rest)

    def hard(self, i: int, positive: str, candidates: Collection[str], excluded: Collection[str]) -> str:
        """Uniform among the eligible ``candidates``; a random negative when none is."""
        eligible = [d for d in candidates if d not in excluded]
        return self.rng.choice(eligible) if eligible else self.random(i, positive, excluded)


def build_unierf_dataset(
    anchors: Mapping[str, Sequence[str]],
    positives: Sequence[str],
    doc_texts: Mapping[str, str],
    hard_negatives: Mapping[str, Sequence[Sequence[str]]] | None = None,
    exclude: Sequence[Collection[str]] | None = None,
    categories: Mapping[str, str] | None = None,
    same_category_share: float = 0.5,
    random_negative: bool = True,
    seed: int = 0,
) -> Dataset:
    """UniERF training rows with the differentiated negatives of Sec. 4.3 (a :class:`datasets.Dataset` of
    :func:`unierf_columns`), one per (query, positive) example with every branch's anchor text (``anchors``: branch -> N
    texts), batch negatives implicit (Eq. 21), and:

    * ``negative_random`` (if ``random_negative``), shared: uniform over ``doc_texts``' keys (Eq. 22); with
      ``categories`` a share ``same_category_share`` draws from the positive's category (Sec. 4.3.2);
    * ``negative_<b>`` per branch in ``hard_negatives`` (branch -> per example candidate ids, Eq. 23-25): a seeded
      uniform draw among them, a random negative where none is eligible.

    A negative is never the row's positive nor in ``exclude[i]``. Pass ``columns=dataset.column_names`` to the loss.
    """
    if not isinstance(anchors, Mapping) or not anchors:
        raise ValueError("anchors must be a non-empty mapping branch -> texts")
    branches = check_branch_names(list(anchors))
    positives = list(positives)
    n = len(positives)
    for b, texts in anchors.items():
        if isinstance(texts, str) or len(texts) != n:
            raise ValueError(f"anchors[{b!r}] must hold one text per example ({n}), got {len(texts)}")
    hard_negatives = dict(hard_negatives or {})
    ordered_hard = hard_negative_branches(branches, list(hard_negatives))
    for b, cands in hard_negatives.items():
        if len(cands) != n:
            raise ValueError(f"hard_negatives[{b!r}] must hold one candidate list per example ({n}), got {len(cands)}")
    if exclude is not None and len(exclude) != n:
        raise ValueError(f"exclude must hold one collection per example ({n}), got {len(exclude)}")
    probability("same_category_share", same_category_share)
    missing = [p for p in positives if p not in doc_texts]
    if missing:
        raise ValueError(f"{len(missing)} positive(s) are not in doc_texts (e.g. {missing[:3]})")
    if not doc_texts:
        raise ValueError("doc_texts is empty")
    draws = _NegativeDraws(list(doc_texts), categories, same_category_share, seed)
    columns = unierf_columns(branches, random_negative=random_negative, hard_negatives=ordered_hard)
    rows: dict[str, list[str]] = {c: [] for c in columns}
    for i, positive in enumerate(positives):
        excluded = {positive, *(exclude[i] if exclude is not None else ())}
        for b in branches:
            rows[anchor_column(b)].append(str(anchors[b][i]))
        rows[POSITIVE_COLUMN].append(doc_texts[positive])
        if random_negative:
            rows[RANDOM_NEGATIVE_COLUMN].append(doc_texts[draws.random(i, positive, excluded)])
        for b in ordered_hard:
            candidates = [d for d in hard_negatives[b][i] if d in doc_texts]
            rows[negative_column(b)].append(doc_texts[draws.hard(i, positive, candidates, excluded)])
    return Dataset.from_dict(rows)
