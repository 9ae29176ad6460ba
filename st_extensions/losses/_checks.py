"""Input checks shared by the losses: a clear error for an empty batch, before anything reaches the model."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from torch import Tensor


def feature_rows(features: Mapping[str, Any]) -> int | None:
    """Rows of a column's features, ``input_ids``' (else the first tensor's/list's) length; 0 for ``{}``; else None."""
    if not features:
        return 0
    for v in [features[k] for k in ("input_ids", "attention_mask") if k in features] + list(features.values()):
        if isinstance(v, Tensor) and v.dim() >= 1:
            return int(v.shape[0])
        if isinstance(v, Sequence) and not isinstance(v, (str, bytes)):
            return len(v)
    return None


def check_not_empty(loss: str, sentence_features: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """``sentence_features`` as a list, or a ``ValueError`` naming ``loss`` if the batch (or a column) has 0 rows."""
    features = list(sentence_features)
    rows = [feature_rows(f) for f in features]
    empty = [i for i, r in enumerate(rows) if r == 0]
    if empty and len(empty) == len(rows):  # every column known to be empty
        raise ValueError(
            f"{loss} got an empty batch (0 rows in each of its {len(rows)} columns): nothing to compute a loss on; "
            "check that the training dataset is not empty and that batches are not filtered down to nothing"
        )
    if empty:
        full = next(((i, r) for i, r in enumerate(rows) if r), None)
        other = f" while column {full[0]} has {full[1]}" if full else ""
        raise ValueError(
            f"{loss} got an empty batch in column(s) {empty} (0 rows){other}: every column needs one text per row"
        )
    return features
