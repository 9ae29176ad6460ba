"""``benchmarks/varce_rerank.py``: the runs' commands and how their summaries combine (``p_vs_j1``, the row chosen on
dev), on made-up summaries whose figures are known."""

from __future__ import annotations

import json
import os
import sys

import pytest
from scipy.stats import ttest_rel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import varce_rerank  # noqa: E402

from pyterrier_prob.cli import build_parser  # noqa: E402

COLL = "irds:beir/nfcorpus"
QIDS = [f"q{i}" for i in range(6)]


def _summary(systems: dict[str, tuple[int | None, list[float], float | None]]) -> dict:
    """``systems``: name -> (joint layers, per-query nDCG@10, best dev point)."""
    rows = [
        {"collection": COLL, "depth": d, "system": name, "joint_layers": j, "nDCG@10": sum(v) / len(v)}
        for d in (100, 20)
        for name, (j, v, _) in systems.items()
    ]
    return {
        "rows": rows,
        "per_query": {COLL: {name: dict(zip(QIDS, v)) for name, (_, v, _) in systems.items()}},
        "dev_curves": {name: {"best": {"dev": dev}} for name, (j, _, dev) in systems.items() if j is not None},
        "evaluated": {COLL: {"depth": 100}},
    }


def _write(folder, summary) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "summary.json"), "w", encoding="utf8") as f:
        json.dump(summary, f)


def test_ablation_runs_skip_mc_dropout_and_the_main_run_keeps_it():
    parser = build_parser("varce")
    main = parser.parse_args(varce_rerank.command("out", "main")[1:])
    j1 = parser.parse_args(varce_rerank.command("out", "j1-pseudo")[1:])
    assert main.mc_dropout == 8 and j1.mc_dropout == 0
    assert j1.output == "out-j1-pseudo" and j1.teacher == os.path.join("out", varce_rerank.TEACHER)
    only = parser.parse_args(varce_rerank.command("out", "main", only="CE")[1:])
    assert only.students == ["CE"] and not only.input_score and only.mc_dropout == 8


def test_combine_p_vs_j1_and_the_row_chosen_on_dev(tmp_path):
    out = str(tmp_path / "v")
    ce2 = [0.5, 0.4, 0.6, 0.3, 0.7, 0.2]
    ce1 = [0.4, 0.4, 0.5, 0.3, 0.5, 0.1]
    text = [0.9] * 6
    _write(out, _summary({
        "BM25": (None, [0.3] * 6, None),
        "CE": (2, ce2, 0.31),
        "VarCE-VAR": (2, [0.5] * 6, 0.30),
        "CE (score as text)": (2, text, 0.99),  # never the chosen row, however high on dev
    }))  # fmt: skip
    _write(f"{out}-j1-pseudo", _summary({"BM25": (None, [0.3] * 6, None), "CE": (1, ce1, 0.5)}))
    _write(f"{out}-j3-pseudo", _summary({"CE": (3, [0.1] * 6, 0.31)}))  # ties main's CE on dev: main comes first
    combined = varce_rerank.combine(out, list(varce_rerank.RUNS))
    rows = {(r["run"], r["system"], r["depth"]): r for r in combined["rows"]}
    assert ("j1-pseudo", "BM25", 100) not in rows  # the baselines come from the main run only
    assert rows["main", "CE", 100]["p_vs_j1"] == pytest.approx(ttest_rel(ce2, ce1).pvalue)
    assert rows["j1-pseudo", "CE", 100]["p_vs_j1"] is None
    assert "p_vs_j1" not in rows["main", "BM25", 100]
    assert combined["chosen_on_dev"] == {"run": "main", "system": "CE", "dev": 0.31}
    chosen = [k for k, r in rows.items() if r["chosen_on_dev"]]
    assert chosen == [("main", "CE", 100)]  # at the evaluated depth only
    assert combined["ablation_dev"] == {"main/CE": 0.31, "main/VarCE-VAR": 0.30, "j3-pseudo/CE": 0.31}
    assert set(combined["per_query_runs"]) == {"j1-pseudo", "j3-pseudo"}
