"""UniERF models: several retrieval branches on one encoder, their input texts, their embeddings, their data.

UniERF (Jiang et al., KDD'25, ``../shared/papers/unierf.md``) trains the branches of an embedding-based
retrieval system jointly (Sec. 4): one user-query tower with a head per branch (Sec. 4.1), one shared item
tower (Sec. 4.2), differentiated training samples per branch (Sec. 4.3) and the sum of four losses
(Eq. 28-32, :class:`~st_extensions.losses.UniERFLoss`). Adapted to text retrieval:

* a branch is a head of :class:`~st_extensions.modules.MultiBranchQueryEncoder` on the shared encoder's pooled
  embedding of the branch's own input text, built by :func:`branch_text` -- ``semantic``: the query (Sec. 4.1.1);
  ``trigger``: the query and the text of a document the user is looking at (the paper's trigger items,
  Sec. 4.1.3; in benchmarks the top BM25 document); ``context``: the query and other query fields or history
  (the paper's user behaviour, Sec. 4.1.2);
* documents go through the encoder's plain document path (``encode_document``), indexed once for all branches;
* :func:`build_unierf_dataset` lays out the training rows (every branch's input of one query in one row, so the
  diversity loss sees all branches of that query) with the negatives of Sec. 4.3: in-batch (implicit), random
  or same-category random, and per-branch hard negatives.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Collection, Mapping, Sequence

import numpy as np
import torch
from datasets import Dataset
from sentence_transformers import SentenceTransformer

from st_extensions.defaults import default_model_path
from st_extensions.modules.branches import MultiBranchQueryEncoder, check_branch_names

#: Separator between the parts of a branch's input text: BERT-like tokenizers read ``[SEP]`` as their special
#: separator token, so ``query [SEP] document`` is encoded like a text pair.
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
    heads = [m for m in model.modules() if isinstance(m, MultiBranchQueryEncoder)]
    if not heads:
        raise ValueError(
            f"{type(model).__name__} has no MultiBranchQueryEncoder: UniERF needs a model built with "
            "st_extensions.build_unierf_model(...) (or loaded with st_extensions.load_model)"
        )
    if len(heads) > 1:
        raise ValueError(f"model has {len(heads)} MultiBranchQueryEncoders, expected exactly one")
    return heads[0]


def build_unierf_model(
    base_model: str | SentenceTransformer | None = None,
    branches: Sequence[str] = ("semantic", "trigger"),
    init_std: float = 0.01,
    seed: int = 0,
    device: str | None = None,
) -> SentenceTransformer:
    """A SentenceTransformer whose query path ends in a :class:`MultiBranchQueryEncoder` (UniERF Sec. 4.1).

    Args:
        base_model: a model name or path (default: the packaged all-MiniLM-L6-v2) or a SentenceTransformer whose
            modules are deep-copied (the new model shares no weights with it). It is the shared encoder of every
            branch and the document tower (Sec. 4.2).
        branches: the branch names, e.g. ``("semantic", "trigger", "context")`` (alphanumeric, distinct).
        init_std: noise added to each head's identity initialisation (breaks the branches' symmetry).
        seed: seeds that noise.
        device: where to put the model.

    Returns:
        The model: ``encode_document`` embeds documents as ``base_model`` does; ``encode_query(texts,
        branch=b)`` gives branch b's normalised embeddings; :func:`encode_branches` does that per branch.
    """
    names = check_branch_names(branches)
    if base_model is None:
        base_model = default_model_path()
    if isinstance(base_model, str):
        from st_extensions.loading import load_model

        base_model = load_model(base_model, device=device)
    if any(isinstance(m, MultiBranchQueryEncoder) for m in base_model.modules()):
        raise ValueError("base_model already has a MultiBranchQueryEncoder")
    dim = base_model.get_embedding_dimension()
    if dim is None:
        raise ValueError("cannot tell the base model's embedding dimension")
    head = MultiBranchQueryEncoder(int(dim), names, init_std=init_std, seed=seed, residual=True)
    modules = [copy.deepcopy(m) for m in base_model]
    return SentenceTransformer(modules=[*modules, head], device=device or str(base_model.device))


def branch_text(parts: Sequence[str | None], sep: str = SEP) -> str:
    """A branch's input text: its non-empty parts joined by ``sep`` (e.g. ``query [SEP] trigger document``).

    The same function builds the training anchors and the inference inputs, so both see the same texts.
    """
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
    """Each branch's query embeddings ``H^b`` (Eq. 5) of that branch's own input texts.

    Args:
        model: a model with a :class:`MultiBranchQueryEncoder` (see :func:`build_unierf_model`).
        branch_texts: branch name -> the input texts built for that branch (:func:`branch_text`); branches may be
            a subset of the model's and may have different numbers of texts.
        batch_size: encoding batch size.
        show_progress_bar: show a progress bar.

    Returns:
        branch name -> ``(len(texts), dim)`` float32 with unit-norm rows, ordered as the texts.

    Raises:
        ValueError: an unknown branch name, or no MultiBranchQueryEncoder.
    """
    head = find_branches(model)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    for branch in branch_texts:
        head.branch_index(branch)
    out: dict[str, np.ndarray] = {}
    for branch, texts in branch_texts.items():
        if isinstance(texts, str):
            raise ValueError(f"branch_texts[{branch!r}] must be a sequence of texts, got a single string")
        texts = [str(t) for t in texts]
        if not texts:
            out[branch] = np.zeros((0, head.in_features), np.float32)
            continue
        emb = model.encode_query(
            texts, batch_size=batch_size, branch=branch, convert_to_numpy=True, show_progress_bar=show_progress_bar
        )
        out[branch] = np.asarray(emb, dtype=np.float32)
    return out


# --------------------------------------------------------------------------------------------------
# Training data (Sec. 4.3)
# --------------------------------------------------------------------------------------------------


def unierf_columns(
    branches: Sequence[str], random_negative: bool = True, hard_negatives: Sequence[str] | bool = True
) -> list[str]:
    """The column layout of UniERF training rows, in the order :class:`~st_extensions.losses.UniERFLoss` reads.

    ``anchor_<b>`` for every branch b (its input text), ``positive_doc``, then ``negative_random`` (shared by all
    branches) if ``random_negative``, then ``negative_<b>`` (branch b's hard negative) for the branches in
    ``hard_negatives`` (``True``: all, ``False``: none), in branch order.
    """
    names = check_branch_names(branches)
    hard = names if hard_negatives is True else [] if hard_negatives is False else list(hard_negatives)
    unknown = [b for b in hard if b not in names]
    if unknown:
        raise ValueError(f"hard-negative branches {unknown} are not among the branches {names}")
    return [
        *(anchor_column(b) for b in names),
        POSITIVE_COLUMN,
        *([RANDOM_NEGATIVE_COLUMN] if random_negative else []),
        *(negative_column(b) for b in names if b in hard),
    ]


def parse_unierf_columns(columns: Sequence[str], branches: Sequence[str]) -> tuple[list[str], list[str | None]]:
    """Read a UniERF column layout: ``anchor_<b>``..., one ``positive*`` column, then ``negative*`` columns.

    Args:
        columns: the training dataset's column names, in order (``dataset.column_names``).
        branches: the model's branch names.

    Returns:
        ``(anchor branches in column order, negative tags)``: a negative column ``negative_<b>`` with b a branch
        is b's hard negative (tag b), any other ``negative*`` column is shared by all branches (tag ``None``).

    Raises:
        ValueError: a column that fits none of these, an unknown branch, a repeated anchor, or a wrong order.
    """
    columns = list(columns)
    anchors: list[str] = []
    i = 0
    while i < len(columns) and columns[i].startswith("anchor_"):
        name = columns[i][len("anchor_") :]
        if name not in branches:
            raise ValueError(
                f"column {columns[i]!r} names an unknown branch {name!r}: the branches are {list(branches)}"
            )
        if name in anchors:
            raise ValueError(f"column {columns[i]!r} appears twice")
        anchors.append(name)
        i += 1
    if not anchors:
        raise ValueError(
            f"UniERF rows start with one anchor_<branch> column per branch, got columns {columns}: "
            f"expected e.g. {unierf_columns(branches)}"
        )
    if i >= len(columns) or not columns[i].startswith("positive"):
        raise ValueError(
            f"after the anchor columns UniERF rows need one positive column (e.g. {POSITIVE_COLUMN!r}), got {columns}"
        )
    i += 1
    negatives: list[str | None] = []
    for col in columns[i:]:
        if not col.startswith("negative"):
            raise ValueError(
                f"column {col!r} is neither anchor_<branch>, positive nor negative*: drop it before training "
                f"(UniERF layout: {unierf_columns(branches)})"
            )
        tag = col[len("negative_") :] if col.startswith("negative_") else None
        negatives.append(tag if tag in branches else None)
    return anchors, negatives


def _sample_random(rng: random.Random, pool: Sequence[str], excluded: Collection[str], tries: int = 64) -> str | None:
    """A uniform draw from ``pool`` outside ``excluded`` (None if there is none)."""
    for _ in range(tries):
        doc = pool[rng.randrange(len(pool))]
        if doc not in excluded:
            return doc
    rest = [d for d in pool if d not in excluded]
    return rng.choice(rest) if rest else None


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
    """UniERF training rows with the differentiated negatives of Sec. 4.3, for the sentence-transformers trainer.

    One row per (query, positive document) example, carrying every branch's input text of that query (so the
    diversity loss, Eq. 31, compares the branches of one query) and these negatives:

    * batch negatives (Eq. 21): implicit -- the other rows' positives and negatives in the batch;
    * ``negative_random``, shared by all branches: a uniform draw from the corpus (Eq. 22); with ``categories``,
      a share ``same_category_share`` of the rows draw from the positive's category instead (the "more
      challenging random negatives" of Sec. 4.3.2; uniform when that category has no other document);
    * ``negative_<b>`` per branch b in ``hard_negatives``: a seeded uniform draw among the example's candidates
      for b (Sec. 4.3.3, Eq. 23-25 -- e.g. low-BM25-score documents for the semantic branch, documents
      dissimilar to the trigger document for the trigger branch; mined by
      :func:`pyterrier_prob.unierf_training_data`); a row without an eligible candidate gets a random negative.

    Negatives never are the row's positive nor a document of ``exclude[i]`` (e.g. all the query's relevant
    documents).

    Args:
        anchors: branch -> input text per example (:func:`branch_text`), all of the same length N, in branch order.
        positives: the positive document id per example (keys of ``doc_texts``).
        doc_texts: document id -> text for the whole corpus; random negatives are drawn from its keys.
        hard_negatives: branch -> per example, the candidate document ids of that branch's hard negatives.
        exclude: per example, document ids that must not be negatives.
        categories: document id -> category (optional).
        same_category_share: share of rows whose random negative comes from the positive's category.
        random_negative: add the ``negative_random`` column.
        seed: seeds every draw.

    Returns:
        A :class:`datasets.Dataset` with the columns of :func:`unierf_columns` (texts only, nothing to drop):
        ``anchor_<b>``..., ``positive_doc``, ``negative_random``, ``negative_<b>``...; pass
        ``columns=dataset.column_names`` to :class:`~st_extensions.losses.UniERFLoss`.
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
    unknown = [b for b in hard_negatives if b not in branches]
    if unknown:
        raise ValueError(f"hard_negatives for unknown branches {unknown}: the anchors' branches are {branches}")
    for b, cands in hard_negatives.items():
        if len(cands) != n:
            raise ValueError(f"hard_negatives[{b!r}] must hold one candidate list per example ({n}), got {len(cands)}")
    if exclude is not None and len(exclude) != n:
        raise ValueError(f"exclude must hold one collection per example ({n}), got {len(exclude)}")
    if not (0.0 <= same_category_share <= 1.0):
        raise ValueError(f"same_category_share must be in [0, 1], got {same_category_share}")
    missing = [p for p in positives if p not in doc_texts]
    if missing:
        raise ValueError(f"{len(missing)} positive(s) are not in doc_texts (e.g. {missing[:3]})")
    pool = list(doc_texts.keys())
    if not pool:
        raise ValueError("doc_texts is empty")
    by_category: dict[str, list[str]] = {}
    if categories is not None:
        for doc in pool:
            if doc in categories:
                by_category.setdefault(categories[doc], []).append(doc)
    rng = random.Random(seed)
    ordered_hard = [b for b in branches if b in hard_negatives]
    columns = unierf_columns(branches, random_negative=random_negative, hard_negatives=ordered_hard)
    rows: dict[str, list[str]] = {c: [] for c in columns}

    def random_doc(i: int, excluded: set[str]) -> str:
        category = categories.get(positives[i]) if categories is not None else None
        if category is not None and rng.random() < same_category_share:
            doc = _sample_random(rng, by_category.get(category, []) or pool, excluded)
        else:
            doc = _sample_random(rng, pool, excluded)
        if doc is None:
            raise ValueError(f"example {i} has no document left to draw a negative from")
        return doc

    for i, positive in enumerate(positives):
        excluded = {positive, *(exclude[i] if exclude is not None else ())}
        for b in branches:
            rows[anchor_column(b)].append(str(anchors[b][i]))
        rows[POSITIVE_COLUMN].append(doc_texts[positive])
        if random_negative:
            rows[RANDOM_NEGATIVE_COLUMN].append(doc_texts[random_doc(i, excluded)])
        for b in ordered_hard:
            cands = [d for d in hard_negatives[b][i] if d not in excluded and d in doc_texts]
            doc = rng.choice(cands) if cands else random_doc(i, excluded)
            rows[negative_column(b)].append(doc_texts[doc])
    return Dataset.from_dict(rows)
