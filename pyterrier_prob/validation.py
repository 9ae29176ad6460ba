"""Input checks shared by the indexers, encoders, retrievers and re-rankers: the one place to import checks from.

A bad input ends in one clear error naming the column and the row (qid / docno): missing ids and texts, vectors stored
as text, misshapen or non-finite vectors, one qid with different query vectors. Fast paths are vectorised; the per-row
diagnosis runs only after a failure. Argument checks are re-exported from :mod:`st_extensions.checks`."""

from __future__ import annotations

import contextlib
import operator
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd
from pandas.api.types import infer_dtype

from st_extensions.checks import (  # noqa: F401 -- re-exported: pyterrier_prob imports every check from here
    choice,
    finite_float,
    is_int,
    non_negative_int,
    positive_float,
    positive_int,
    probability,
)

_KEY_COLUMNS = ("qid", "docno")


def require_columns(frame: Any, columns: Iterable[str], what: str, hint: str = "") -> None:
    """``frame`` is a DataFrame with ``columns``; else a TypeError / ValueError naming ``what`` and the missing ones."""
    if not isinstance(frame, pd.DataFrame):
        raise TypeError(f"{what} must be a pandas DataFrame, got {type(frame).__name__}")
    if missing := [c for c in columns if c not in frame.columns]:
        raise ValueError(f"{what} lacks column(s) {missing}; it has {list(frame.columns)}{hint}")


def row_namer(
    frame: pd.DataFrame, keys: tuple[str, ...] = _KEY_COLUMNS, rows: Sequence[int] | None = None
) -> Callable[[int], str]:
    """``i -> "row i (qid='q1', docno='d3')"`` for positional rows of ``frame`` (the key columns it has); with
    ``rows``, ``i`` names the frame's row ``rows[i]``."""
    cols = [c for c in keys if c in frame.columns]

    def name(i: int) -> str:
        i = int(i if rows is None else rows[i])
        keys_ = ", ".join(f"{c}={frame[c].iat[i]!r}" for c in cols)
        return f"row {i} ({keys_})" if keys_ else f"row {i}"

    return name


def is_missing(v: Any) -> bool:
    """Whether a cell holds no value: None, ``pd.NA``, ``pd.NaT`` or a float NaN."""
    return v is None or v is pd.NA or v is pd.NaT or (isinstance(v, float | np.floating) and bool(np.isnan(v)))


def check_ids(frame: pd.DataFrame, columns: Iterable[str], owner: str) -> None:
    """No missing (None / NaN) value in the id columns (``qid``, ``docno``) of ``frame``."""
    for col in columns:
        if col in frame.columns and (bad := frame[col].isna().to_numpy()).any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"{owner}: {col!r} is missing ({frame[col].iat[i]!r}) in {row_namer(frame)(i)}"
                f"{f' and {int(bad.sum()) - 1} more rows' if bad.sum() > 1 else ''}: every row needs a {col}"
            )


def check_texts(frame: pd.DataFrame, column: str, owner: str) -> list[str]:
    """The ``column`` of ``frame`` as a list of str; a ValueError naming the row of a None / NaN / non-str value."""
    s = frame[column]
    if not len(s) or (infer_dtype(s, skipna=False) == "string" and not s.isna().any()):
        return s.tolist()
    ok = np.fromiter((isinstance(v, str) for v in s.tolist()), dtype=bool, count=len(s))
    i = int(np.flatnonzero(~ok)[0])
    v = s.iat[i]
    what = f"missing ({v!r})" if is_missing(v) else f"a {type(v).__name__} ({v!r}), not a str"
    more = int((~ok).sum()) - 1
    raise ValueError(
        f"{owner}: {column!r} of {row_namer(frame)(i)} is {what}{f' (and {more} more rows)' if more else ''}: "
        f"every row needs a text in {column!r}; fill or drop such rows first"
    )


def unique_texts(texts: list[str]) -> tuple[list[str], np.ndarray]:
    """``(distinct texts, sorted; each row's position among them)``: what encoders encode once per text."""
    uniq, inv = np.unique(np.asarray(texts, dtype=object), return_inverse=True)
    return uniq.tolist(), inv.reshape(-1)


def stack_arrays(
    values: Sequence[Any],
    column: str,
    name: Callable[[int], str],
    owner: str,
    ndim: int = 1,
    shape: tuple[int, ...] | None = None,
    kind: str = "shapes",
) -> np.ndarray:
    """Stack one array per row into float32 ``(n, *shape)``; a ValueError naming ``column`` and the row (``name(i)``) of
    a missing, textual, non-numeric, misshapen or non-finite value. ``ndim``: of each row's array; ``shape``: known from
    earlier rows (else the first row's); ``kind``: what differs when shapes do, for the message."""
    n = len(values)
    if not n:
        return np.zeros((0, *(shape or (0,) * ndim)), np.float32)
    if isinstance(values, pd.Series) or (isinstance(values, np.ndarray) and values.dtype == object):
        values = list(values)
    arr = None
    with contextlib.suppress(TypeError, ValueError):
        arr = np.asarray(values, dtype=np.float32)
    if arr is None or arr.ndim != ndim + 1 or (shape is not None and arr.shape[1:] != tuple(shape)):
        for i, v in enumerate(list(values)):  # the first row that is not a numeric array of the right shape
            if is_missing(v):
                raise ValueError(f"{owner}: {column!r} of {name(i)} is missing ({v!r}): every row needs one")
            if isinstance(v, str | bytes):
                text = v if len(v) <= 40 else v[:37] + "..."
                raise ValueError(
                    f"{owner}: {column!r} of {name(i)} is a {type(v).__name__} ({text!r}), not an array: vectors "
                    "stored as text (e.g. after a CSV round trip) must be parsed back into numeric arrays first"
                )
            try:
                a = np.asarray(v, dtype=np.float32)
            except (TypeError, ValueError) as e:
                raise ValueError(
                    f"{owner}: {column!r} of {name(i)} is not a numeric array ({type(v).__name__}): {e}"
                ) from e
            if a.ndim != ndim:
                raise ValueError(f"{owner}: {column!r} of {name(i)} must be a {ndim}-D array, got shape {a.shape}")
            if shape is None:
                shape = a.shape
            elif a.shape != tuple(shape):
                raise ValueError(
                    f"{owner}: inconsistent {kind}: {column!r} of {name(i)} has shape {a.shape}, earlier rows "
                    f"{tuple(shape)}; were all rows encoded by the same model?"
                )
        raise ValueError(f"{owner}: {column!r} must hold one {ndim}-D numeric array per row")  # pragma: no cover
    if 0 in arr.shape[1:]:
        raise ValueError(f"{owner}: {column!r} of {name(0)} is empty (shape {arr.shape[1:]})")
    finite = np.isfinite(arr.reshape(n, -1)).all(axis=1)
    if not finite.all():
        bad = np.flatnonzero(~finite)
        more = f" (and {bad.size - 1} more rows)" if bad.size > 1 else ""
        raise ValueError(f"{owner}: {column!r} of {name(int(bad[0]))} has non-finite values (nan or inf){more}")
    return arr


def float_column(frame: pd.DataFrame, column: str, owner: str) -> np.ndarray:
    """``frame[column]`` as float64; a ValueError naming the row of a missing or non-numeric value."""
    s = frame[column]
    out = None
    with contextlib.suppress(TypeError, ValueError):
        out = s.to_numpy(dtype=np.float64)
    if out is None or np.isnan(out).any():
        for i, v in enumerate(s.tolist()):
            if is_missing(v):
                raise ValueError(f"{owner}: {column!r} of {row_namer(frame)(i)} is missing ({v!r})")
            try:
                float(v)
            except (TypeError, ValueError):
                raise ValueError(
                    f"{owner}: {column!r} of {row_namer(frame)(i)} is not a number: {type(v).__name__} {v!r}"
                ) from None
    return out


def first_rows(qids: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, first)``: each row's query number (in order of first appearance) and each query's first row."""
    codes, uniques = pd.factorize(qids)
    first = np.zeros(len(uniques), np.int64)
    first[codes[::-1]] = np.arange(len(codes) - 1, -1, -1)
    return codes, first


def check_same_per_query(
    frame: pd.DataFrame,
    codes: np.ndarray,
    first: np.ndarray,
    column: str,
    values: np.ndarray,
    reference: np.ndarray,
    owner: str,
    rows: np.ndarray | None = None,
) -> None:
    """Every row of a qid carries its query's value of ``column``; a ValueError naming the qid, rows and column.
    ``values`` are those of ``rows`` (default all), ``reference`` each query's first-row value (nan equals nan)."""
    rows = np.arange(len(codes)) if rows is None else rows
    if not rows.size:
        return
    a = values.reshape(rows.size, -1)
    b = reference[codes[rows]].reshape(rows.size, -1)
    same = (a == b).all(axis=1)
    if not same.all():
        same |= ((a == b) | (np.isnan(a) & np.isnan(b))).all(axis=1)
    if same.all():
        return
    r = int(rows[np.flatnonzero(~same)[0]])
    r0 = int(first[codes[r]])
    raise ValueError(
        f"{owner}: qid {frame['qid'].iat[r]!r} has conflicting {column!r} values in rows {r0} and {r}: all rows of a "
        "query must carry the same query representation (were rows of different queries given one qid?)"
    )


_CHECK_ROWS = 8192  # rows stacked at once by check_rows_match_query


def check_rows_match_query(
    frame: pd.DataFrame,
    codes: np.ndarray,
    first: np.ndarray,
    column: str,
    reference: np.ndarray,
    owner: str,
    ndim: int = 1,
) -> None:
    """Every row of a qid carries the same array in ``column`` as its first row (``reference``, one per query); rows
    holding the very same object are skipped, the rest compared in chunks (bounded memory)."""
    rest = np.flatnonzero(first[codes] != np.arange(len(codes)))
    if not rest.size:
        return
    values = frame[column].to_numpy()
    same_object = np.frompyfunc(operator.is_, 2, 1)(values[rest], values[first[codes[rest]]]).astype(bool)
    rest = rest[~same_object]
    shape, kind = reference.shape[1:], f"{column} shapes within a query"
    for a in range(0, rest.size, _CHECK_ROWS):
        rows = rest[a : a + _CHECK_ROWS]
        vals = stack_arrays(values[rows], column, row_namer(frame, rows=rows), owner, ndim, shape, kind)
        check_same_per_query(frame, codes, first, column, vals, reference, owner, rows=rows)


# --- results ----------------------------------------------------------------------------------------------------


def empty_results(frame: pd.DataFrame, **columns: Any) -> pd.DataFrame:
    """``frame`` (no rows) with a first stage's result columns ``docno, docid, score, rank``, typed, plus ``columns``
    (name -> dtype): what a retriever returns for an empty query frame."""
    typed = {"docno": object, "docid": np.int64, "score": np.float32, "rank": np.int64, **columns}
    return frame.assign(**{c: pd.Series(dtype=d) for c, d in typed.items()})


class EmptyRetrievalWarning(UserWarning):
    """A first-stage retrieval that returned no document for most of its queries (e.g. an uncalibrated CDF level);
    :func:`~pyterrier_prob.evaluation.calibrate_mean_k` silences it while it searches."""


def user_stacklevel(packages: Sequence[str] = ("pyterrier_prob", "pyterrier")) -> int:
    """The ``stacklevel`` pointing a warning at the first frame outside ``packages`` (the user's code)."""
    dirs = tuple(
        os.path.dirname(os.path.abspath(m.__file__)) + os.sep
        for name in packages
        if (m := sys.modules.get(name)) is not None and getattr(m, "__file__", None)
    )
    frame = sys._getframe(1)  # the function that calls warnings.warn: stacklevel 1
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(dirs):
        frame = frame.f_back
        level += 1
    return level


def text_list(texts: Any, what: str) -> list[str]:
    """``texts`` as a list of str; a ValueError naming the position of a None / NaN / non-str entry."""
    if isinstance(texts, str):
        raise TypeError(f"expected a list of {what}, got a single str {texts[:40]!r}")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ValueError(f"{what}[{i}] is {t!r} ({type(t).__name__}), not a str: every text must be a str")
    return texts
