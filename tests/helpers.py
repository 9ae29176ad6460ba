"""Small pieces shared by several test files: the toy query/document texts, a tiny trainer setup, the CLI help, a
benchmark script loaded as a module (:func:`load_benchmark`), and what a rerun that reuses a run is checked with
(:func:`assert_same_figures`, :func:`pisa_threads_finish_backwards`)."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import pathlib
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pandas as pd
import pytest

from pyterrier_prob.cli import main

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (the folder is no package; its scripts import their siblings, such as
    ``_machine``, so it is on ``sys.path`` while the module loads)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


QUERIES = ["vitamin d and bone health", "statins side effects", "breast cancer diet", "gut bacteria"]
DOCS = [
    "Vitamin D supplementation improves bone mineral density in older adults.",
    "Muscle pain is a frequently reported adverse effect of statin therapy.",
    "Dietary fat intake and the risk of breast cancer in a cohort study.",
    "The human microbiome and its role in metabolic disease.",
]


def tiny_training_args(args_class: type, tmp_path: Any, **settings: Any) -> Any:
    """``args_class`` (a sentence-transformers or cross-encoder ``TrainingArguments``) for a few CPU steps writing
    under ``tmp_path / "run"``: 3 steps of 4 rows at lr 1e-3, every step logged, nothing saved or reported;
    ``settings`` override or add fields."""
    base = dict(max_steps=3, per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1)
    fixed = dict(output_dir=str(tmp_path / "run"), report_to="none", save_strategy="no", use_cpu=True)
    return args_class(**(base | fixed | settings))


#: the options every experiment command takes (``harness.CommonConfig``)
COMMON_OPTIONS = "--dataset --test-dataset --model --steps --batch-size --max-seq-length --output --reuse --quiet"


def cli_help(capsys: Any, command: str, options: str) -> str:
    """The ``pyterrier-prob <command> --help`` text, checking that it exits 0 and lists :data:`COMMON_OPTIONS` and
    each of the (space-separated) ``options``."""
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in f"{COMMON_OPTIONS} {options}".split():
        assert option in out, option
    return out


def figure_differences(again: Any, first: Any, where: str = "") -> list[str]:
    """Every place where ``again`` differs from ``first`` (nested dicts, lists, DataFrames and scalars), compared
    exactly: a float equals only the same float (NaN equals NaN), so a figure that differs in its last bit is named,
    e.g. ``rows[3].ece: 0.24319867560439992 != 0.2431986756044038``."""
    if isinstance(first, pd.DataFrame) and isinstance(again, pd.DataFrame):
        if list(again.columns) != list(first.columns) or len(again) != len(first):
            shape = f"{list(again.columns)} x {len(again)} rows != {list(first.columns)} x {len(first)}"
            return [f"{where or 'frame'}: columns {shape}"]
        return figure_differences(again.to_dict("list"), first.to_dict("list"), where)
    if isinstance(first, dict) and isinstance(again, dict):
        if list(again) != list(first):
            return [f"{where or 'top'}: keys {list(again)} != {list(first)}"]
        return [d for k in first for d in figure_differences(again[k], first[k], f"{where}.{k}" if where else str(k))]
    if isinstance(first, list | tuple) and isinstance(again, list | tuple):
        if len(again) != len(first):
            return [f"{where}: {len(again)} items != {len(first)}"]
        return [d for i, (a, b) in enumerate(zip(again, first)) for d in figure_differences(a, b, f"{where}[{i}]")]
    both_nan = isinstance(first, float) and isinstance(again, float) and math.isnan(first) and math.isnan(again)
    if both_nan or (type(again) is type(first) and again == first):
        return []
    return [f"{where}: {again!r} != {first!r}"]


def assert_same_figures(again: Any, first: Any) -> None:
    """A reused run reports the very same figures as the run it reuses: :func:`figure_differences` is empty."""
    diff = figure_differences(again, first)
    assert not diff, f"{len(diff)} figure(s) differ from the first run: " + "; ".join(diff[:5])


@contextlib.contextmanager
def pisa_threads_finish_backwards() -> Iterator[None]:
    """PISA's batch retrieval as its threads might finish it on another machine: each query's rows as before, the
    queries in reverse order. A rerun under it must report what the first run did (the harness puts BM25's rows in
    the queries' order); without that, figures summed over rows in their order change in their last bits."""
    from pyterrier_pisa import PisaRetrieve

    plain = PisaRetrieve.transform

    def backwards(self: Any, queries: pd.DataFrame) -> pd.DataFrame:
        out = plain(self, queries)
        order = list(dict.fromkeys(out["qid"]))[::-1]
        return pd.concat([out[out["qid"] == q] for q in order] or [out]).reset_index(drop=True)

    PisaRetrieve.transform = backwards
    try:
        yield
    finally:
        PisaRetrieve.transform = plain
