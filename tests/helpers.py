"""Small pieces shared by several test files: the toy query/document texts, a tiny trainer setup, the CLI help."""

from __future__ import annotations

from typing import Any

import pytest

from pyterrier_prob.cli import main

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
