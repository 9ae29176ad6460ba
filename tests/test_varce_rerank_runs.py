"""``benchmarks/varce_rerank.py``: the runs' commands and how their summaries combine (``p_vs_j1``, the row chosen on
dev, the goal and the tables), on made-up summaries whose figures are known."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
from scipy.stats import ttest_rel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import varce_rerank  # noqa: E402

from pyterrier_prob.cli import build_parser  # noqa: E402

HOME, OOD = "irds:beir/nfcorpus", "irds:beir/scifact"
QIDS = [f"q{i}" for i in range(6)]
FUSED = "Teacher (bi-encoder + BM25, alpha 0.8)"
MASS = {"layer": 4, "query_to_document": 0.5, "document_to_query": 0.2}
MASS |= {"uniform_query_to_document": 0.9, "uniform_document_to_query": 0.1}
SHARE = {"w_bm25": 0.1, "w_dense": 0.3, "r2": 0.8, "bm25_share": 0.25}
AURC = {"aurc": {"score (top 10)": 0.5}, "e_aurc": {"score (top 10)": 0.1}, "random": 0.6, "optimal": 0.4}


def _summary(systems: dict[str, tuple[int | None, list[float], float | None]]) -> dict:
    """``systems``: name -> (joint layers, per-query nDCG@10 in domain, best dev point); zero-shot values are those
    minus 0.1. Each row carries its p against BM25 and its interval, as a run's summary does."""
    per_query = {
        c: {name: dict(zip(QIDS, np.asarray(v) - shift)) for name, (_, v, _) in systems.items()}
        for c, shift in ((HOME, 0.0), (OOD, 0.1))
    }
    rows = []
    for c in (HOME, OOD):
        bm25 = list(per_query[c].get("BM25", {}).values())
        for d in (100, 20):
            for name, (j, _, _) in systems.items():
                mine = list(per_query[c][name].values())
                test = ttest_rel(mine, bm25) if bm25 and name != "BM25" else None
                rows.append({
                    "collection": c, "depth": d, "system": name, "joint_layers": j, "nDCG@10": float(np.mean(mine)),
                    "p_vs_bm25": None if test is None else float(test.pvalue), "p_vs_bi_encoder": None,
                    "p_vs_CE": None, "ci95_vs_bm25": None if test is None else list(test.confidence_interval(0.95)),
                })  # fmt: skip
    curves = {
        name: {"points": [{"step": 0, "dev": 0.3}, {"step": 300, "dev": dev}], "best": {"step": 300, "dev": dev}}
        for name, (j, _, dev) in systems.items()
        if j is not None
    }
    return {
        "rows": rows,
        "per_query": per_query,
        "dev_curves": curves,
        "evaluated": {c: {"depth": 100, "zero_shot": c == OOD, "queries": 6} for c in (HOME, OOD)},
        "cross_attention_mass": {n: {"step_0": [MASS], "kept": [MASS]} for n, (j, _, _) in systems.items() if j},
        "aurc": {HOME: {"CE": AURC}},
        "lexical_share": {
            c: {n: SHARE for n in systems if n != "BM25" and n != "Teacher (bi-encoder)"} for c in (HOME,)
        },
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
    j3 = parser.parse_args(varce_rerank.command("out", "j3-pseudo")[1:])  # VarCE against CE at J = 3 as well
    assert j3.students == ["CE", "VarCE-MEANVAR"] and j3.train_layers == 3 and j3.mc_dropout == 0
    # the default runs: the main run, the {rows} x {J = 1, 2} ablation and J = 3; the joint-score CE only when asked
    assert varce_rerank.DEFAULT_RUNS == ["main", "j1-pseudo", "j2-train", "j1-train", "j3-pseudo"]


def test_combine_p_vs_j1_the_row_chosen_on_dev_and_the_goal(tmp_path):
    out = str(tmp_path / "v")
    bm25 = [0.3, 0.2, 0.4, 0.3, 0.3, 0.2]
    bi = [0.35, 0.3, 0.4, 0.35, 0.4, 0.3]  # mean 0.35
    fused = [0.45, 0.4, 0.5, 0.45, 0.5, 0.4]  # mean 0.45: halfway is 0.40
    ce2 = [0.5, 0.4, 0.6, 0.3, 0.5, 0.2]  # mean 0.4167
    ce1 = [0.4, 0.4, 0.5, 0.3, 0.4, 0.1]
    _write(out, _summary({
        "BM25": (None, bm25, None), "Teacher (bi-encoder)": (None, bi, None), FUSED: (None, fused, None),
        "CE": (2, ce2, 0.31), "VarCE-VAR": (2, [0.5] * 6, 0.30),
        "CE (score as text)": (2, [0.9] * 6, 0.99),  # never the chosen row, however high on dev
    }))  # fmt: skip
    _write(f"{out}-j1-pseudo", _summary({"BM25": (None, bm25, None), FUSED: (None, fused, None), "CE": (1, ce1, 0.5)}))
    _write(f"{out}-j3-pseudo", _summary({"CE": (3, [0.1] * 6, 0.31)}))  # ties main's CE on dev: main comes first
    combined = varce_rerank.combine(out, list(varce_rerank.RUNS))
    rows = {(r["run"], r["system"], r["collection"], r["depth"]): r for r in combined["rows"]}
    assert ("j1-pseudo", "BM25", HOME, 100) not in rows  # the baselines come from the main run only
    assert rows["main", "CE", HOME, 100]["p_vs_j1"] == pytest.approx(ttest_rel(ce2, ce1).pvalue)
    assert rows["j1-pseudo", "CE", HOME, 100]["p_vs_j1"] is None
    assert "p_vs_j1" not in rows["main", "BM25", HOME, 100]
    assert combined["chosen_on_dev"] == {"run": "main", "system": "CE", "dev": 0.31}
    chosen = [k for k, r in rows.items() if r["chosen_on_dev"]]
    assert chosen == [("main", "CE", HOME, 100), ("main", "CE", OOD, 100)]  # at the evaluated depth only
    assert combined["ablation_dev"] == {"main/CE": 0.31, "main/VarCE-VAR": 0.30, "j3-pseudo/CE": 0.31}
    assert set(combined["per_query_runs"]) == set(combined["ablation_curves"]) == {"j1-pseudo", "j3-pseudo"}
    assert list(combined["runs_combined"]) == ["main", "j1-pseudo", "j3-pseudo"]

    g = combined["goal"]
    assert g["chosen"] == "main/CE" and g["collection"] == HOME
    assert g["halfway"] == pytest.approx(0.40) and g["halfway_met"]
    assert g["share_of_gap"] == pytest.approx((np.mean(ce2) - 0.35) / 0.10)
    assert g["p_vs_j1"] == pytest.approx(ttest_rel(ce2, ce1).pvalue) and g["j1"] == pytest.approx(np.mean(ce1))
    assert g["above_j1_met"] == (ttest_rel(ce2, ce1).pvalue < 0.05)
    low = ttest_rel(np.asarray(ce2) - 0.1, np.asarray(bm25) - 0.1).confidence_interval(0.95).low
    assert g["zero_shot"][OOD]["ci95_vs_bm25"][0] == pytest.approx(low)
    assert g["zero_shot"][OOD]["non_inferior"] == (low >= -0.02)

    text = varce_rerank.markdown(combined)
    assert f"**{np.mean(ce2):.4f}**" in text  # the chosen row, bold
    assert f"| CE, J = 1, train + pseudo-queries (j1-pseudo) | {np.mean(ce1):.4f} (" in text
    assert f"{100 * g['share_of_gap']:.0f}% of the way (halfway 0.4000: met)" in text
    assert f"| {HOME} | CE | 0.5000 (0.1000) | 0.6000 | 0.4000 |" in text  # AURC (E-AURC), random, optimal
    assert "| j1-pseudo/CE | 4 | 0.500 → 0.500 | 0.900 | 0.200 → 0.200 | 0.100 |" in text
    assert "| main/CE | 0.3000 (0) → 0.3100 (300) | 300 |" in text
    assert f"| main/{FUSED} | 0.250 (0.80) | — |" in text  # how far each follows BM25; scifact: not measured
    assert "| j1-pseudo/CE | 0.250 (0.80) | — |" in text and f"| j1-pseudo/{FUSED}" not in text  # the main run's


def test_gpu_students_join_the_table_and_the_choice_on_dev(tmp_path):
    """The J = 6 students of ``benchmarks/gpu_students.py`` join as run ``j6-gpu``: labelled with the card and their
    configuration, paired against the J = 1 CE on the same rows, their dev points in the choice."""
    out, gpu = str(tmp_path / "v"), str(tmp_path / "varce_gpu.json")
    bm25, bi, fused = [0.3, 0.2, 0.4, 0.3, 0.3, 0.2], [0.35, 0.3, 0.4, 0.35, 0.4, 0.3], [0.45] * 6
    ce1, ce6, var6 = [0.4, 0.4, 0.5, 0.3, 0.4, 0.1], [0.5, 0.3, 0.6, 0.3, 0.5, 0.3], [0.6, 0.3, 0.7, 0.4, 0.5, 0.4]
    systems = {"BM25": (None, bm25, None), "Teacher (bi-encoder)": (None, bi, None), FUSED: (None, fused, None)}
    _write(out, _summary(systems | {"CE": (2, [0.4] * 6, 0.31)}))
    _write(f"{out}-j1-pseudo", _summary({"CE": (1, ce1, 0.2)}))
    curve = {"card": "TestCard", "points": [{"step": 0, "dev": 0.1}, {"step": 300, "dev": 0.4}]}
    students, rows, per_query = {}, [], {HOME: {}}
    for student, values, dev, p in (("CE", ce6, 0.30, None), ("VarCE-VAR", var6, 0.32, 0.04)):
        system = f"{student} (J = 6, TestCard, batch 16, lr 2e-05)"
        students[system] = curve | {"best": {"step": 300, "dev": dev}}
        per_query[HOME][system] = dict(zip(QIDS, values))
        row = {"collection": HOME, "system": system, "queries": 6, "nDCG@10": float(np.mean(values)), "p_vs_ce_j6": p}
        rows.append(row | {"card": "TestCard", "p_vs_bm25": 0.5, "p_vs_bi_encoder": 0.5, "ci95_vs_bm25": [-0.1, 0.1]})
    with open(gpu, "w", encoding="utf8") as f:
        json.dump({"students": students, "rows": rows, "per_query": per_query}, f)
    combined = varce_rerank.combine(out, list(varce_rerank.RUNS), gpu)
    got = {(r["run"], r["system"]): r for r in combined["rows"] if r["collection"] == HOME and r["depth"] == 100}
    ce, var = (
        got["j6-gpu", "CE (TestCard, batch 16, lr 2e-05)"],
        got["j6-gpu", "VarCE-VAR (TestCard, batch 16, lr 2e-05)"],
    )
    assert ce["joint_layers"] == var["joint_layers"] == 6 and ce["training_queries"] == "train + pseudo-queries"
    assert ce["p_vs_j1"] == pytest.approx(ttest_rel(ce6, ce1).pvalue) and ce["p_vs_CE"] is None
    assert var["p_vs_j1"] == pytest.approx(ttest_rel(var6, ce1).pvalue) and var["p_vs_CE"] == 0.04
    chosen = "VarCE-VAR (TestCard, batch 16, lr 2e-05)"
    assert combined["ablation_dev"][f"j6-gpu/{chosen}"] == 0.32
    assert combined["chosen_on_dev"] == {"run": "j6-gpu", "system": chosen, "dev": 0.32}
    assert var["chosen_on_dev"] and not ce["chosen_on_dev"]
    g = combined["goal"]
    assert g["chosen"] == f"j6-gpu/{chosen}" and g["nDCG@10"] == pytest.approx(np.mean(var6))
    assert g["p_vs_j1"] == pytest.approx(ttest_rel(var6, ce1).pvalue)
    assert combined["per_query_runs"]["j6-gpu"][HOME]["CE (TestCard, batch 16, lr 2e-05)"] == dict(zip(QIDS, ce6))
    text = varce_rerank.markdown(combined)
    assert f"| {chosen}, J = 6, train + pseudo-queries (j6-gpu) | **{np.mean(var6):.4f}** (" in text
    assert "| j6-gpu/CE (TestCard, batch 16, lr 2e-05) | 0.1000 (0) → 0.4000 (300) | 300 |" in text
    # without the file, the table is the CPU runs' alone
    alone = varce_rerank.combine(out, list(varce_rerank.RUNS), str(tmp_path / "none.json"))
    assert all(r["run"] != "j6-gpu" for r in alone["rows"]) and alone["chosen_on_dev"]["run"] == "main"


def test_calibration_and_uncertainty_tables_and_one_section_printed(tmp_path, capsys):
    """The calibration and uncertainty tables read the summary's own entries (a CE has no std[s] columns; std[s]
    rises out of domain with its one-sided p), and ``--table FILE --section NAME`` prints that table alone."""
    result = {
        "evaluated": {HOME: {"depth": 100, "zero_shot": False, "queries": 6}},
        "calibration": {
            "CE": {"platt": [0.5, -4.0], "ece": 0.02, "ranking": {"rce": 0.04}},
            "VarCE-VAR": {
                "platt": [0.7, -4.4],
                "ece": 0.018,
                "ece_without_std": 0.0184,
                "ranking": {"rce": 0.05, "rce_without_std": 0.0486},
            },
        },
        "uncertainty": {
            c: {
                "VarCE-VAR": {
                    "n_queries": 300,
                    "rho_top10_std_vs_nDCG@10": rho,
                    "p_top10_std": 0.01,
                    "risk_chosen": lam,
                    "risk_test": 0.6,
                    "risk_p_vs_lambda0": p,
                }
            }
            for c, rho, lam, p in ((HOME, -0.13, 0.25, 0.052), (OOD, 0.21, 0.0, None))
        },
        "std_shift": {"VarCE-VAR": {OOD: {"mean": 0.383, "in_domain": 0.323, "p": 1.4e-53}}},
    }
    calibration = varce_rerank.calibration_table(result)
    assert "| CE | 0.0200 | — | 0.0400 | — | 0.500, -4.000 |" in calibration
    assert "| VarCE-VAR | 0.0180 | 0.0184 | 0.0500 | 0.0486 | 0.700, -4.400 |" in calibration
    uncertainty = varce_rerank.uncertainty_table(result)
    assert f"| {HOME} | VarCE-VAR | 0.323 | -0.13 (0.01, 300) | 0.25 | 0.6000 (0.052) |" in uncertainty
    assert f"| {OOD} | VarCE-VAR | 0.383 (p 1.4e-53) | 0.21 (0.01, 300) | 0 | 0.6000 (—) |" in uncertainty
    path = tmp_path / "r.json"
    path.write_text(json.dumps(result), encoding="utf8")
    argv = sys.argv
    try:
        sys.argv = ["varce_rerank.py", "--table", str(path), "--section", "calibration"]
        assert varce_rerank.main() == 0
    finally:
        sys.argv = argv
    assert capsys.readouterr().out == "\n".join(calibration) + "\n"


def test_input_score_table_pairs_each_score_as_text_student_with_its_plain_version():
    """Only the main run's rows with ``input_score`` are compared, each with the student of its name before the
    bracket; the difference, its interval and p are the paired t-test's over the queries."""
    plain, text = [0.3, 0.5, 0.2, 0.6, 0.4], [0.4, 0.5, 0.35, 0.6, 0.5]
    system = "CE (BM25 score as text)"
    result = {
        "evaluated": {HOME: {"depth": 100}},
        "rows": [
            {"collection": HOME, "depth": 100, "run": "main", "system": system, "input_score": "as text"},
            {"collection": HOME, "depth": 100, "run": "main", "system": "CE", "input_score": None},
        ],
        "per_query": {HOME: {"CE": dict(zip(QIDS, plain)), system: dict(zip(QIDS, text))}},
    }
    test = ttest_rel(text, plain)
    low, high = test.confidence_interval(0.95)
    lines = varce_rerank.input_score_table(result)
    row = f"| {HOME} | CE | {np.mean(plain):.4f} | {np.mean(text):.4f} | {np.mean(text) - np.mean(plain):+.4f} "
    assert lines[-1] == row + f"[{low:+.4f}, {high:+.4f}] | {test.pvalue:.2g} |"
    assert len([line for line in lines if line.startswith(f"| {HOME}")]) == 1


def test_rows_table_pairs_the_ce_on_both_row_sets_at_each_j(tmp_path):
    """At J = 2 the main run's CE (train + pseudo-queries) against ``j2-train``'s CE (train alone); J = 1 is left out
    while only one of its two runs exists."""
    out = str(tmp_path / "v")
    bm25, both, alone = [0.3] * 6, [0.5, 0.4, 0.6, 0.3, 0.5, 0.2], [0.4, 0.4, 0.5, 0.3, 0.45, 0.2]
    baselines = {"BM25": (None, bm25, None), "Teacher (bi-encoder)": (None, bm25, None), FUSED: (None, both, None)}
    _write(out, _summary(baselines | {"CE": (2, both, 0.31)}))
    _write(f"{out}-j2-train", _summary({"CE": (2, alone, 0.30)}))
    _write(f"{out}-j1-pseudo", _summary({"CE": (1, [0.1] * 6, 0.2)}))
    lines = varce_rerank.rows_table(varce_rerank.combine(out, list(varce_rerank.RUNS)))
    test = ttest_rel(both, alone)
    low, high = test.confidence_interval(0.95)
    row = f"| {HOME} | 2 | {np.mean(alone):.4f} | {np.mean(both):.4f} | {np.mean(both) - np.mean(alone):+.4f} "
    assert row + f"[{low:+.4f}, {high:+.4f}] | {test.pvalue:.2g} |" in lines
    assert [line.split(" | ")[1] for line in lines if line.startswith("| irds")] == ["2", "2"]  # both collections


def _earlier_and_now(tmp_path, j3_bi: list[float]) -> tuple[str, dict, dict]:
    """A main run, its J = 1 CE and a J = 3 run whose bi-encoder scores ``j3_bi``; the JSON combined from the first
    two (as ``main`` writes it, round-tripped through JSON) and the folders of those two then removed."""
    import shutil

    out = str(tmp_path / "v")
    bm25, bi, fused = [0.3, 0.2, 0.4, 0.3, 0.3, 0.2], [0.35, 0.3, 0.4, 0.35, 0.4, 0.3], [0.45, 0.4, 0.5, 0.45, 0.5, 0.4]
    baselines = {"BM25": (None, bm25, None), "Teacher (bi-encoder)": (None, bi, None), FUSED: (None, fused, None)}
    _write(out, _summary(baselines | {"CE": (2, [0.5, 0.4, 0.6, 0.3, 0.5, 0.2], 0.31)}))
    _write(f"{out}-j1-pseudo", _summary(baselines | {"CE": (1, [0.4, 0.4, 0.5, 0.3, 0.4, 0.1], 0.2)}))
    before = json.loads(json.dumps(varce_rerank.combine(out, list(varce_rerank.RUNS))))
    shutil.rmtree(out), shutil.rmtree(f"{out}-j1-pseudo")
    j3 = {"BM25": (None, bm25, None), "Teacher (bi-encoder)": (None, j3_bi, None), FUSED: (None, [0.55] * 6, None)}
    _write(f"{out}-j3-pseudo", _summary(j3 | {"CE": (3, [0.6, 0.5, 0.6, 0.4, 0.5, 0.4], 0.32)}))
    return out, before, j3


def test_runs_of_an_earlier_json_stand_in_for_lost_folders(tmp_path):
    """``--earlier``: the runs a JSON written before combined, their folders gone, combine again to the same rows,
    p-values, choice and goal, and a J = 3 run made since joins them (same teacher: the main run's rows)."""
    bi = [0.35, 0.3, 0.4, 0.35, 0.4, 0.3]
    out, before, _ = _earlier_and_now(tmp_path, bi)
    with pytest.raises(SystemExit, match="no summary of the main run"):
        varce_rerank.combine(out, list(varce_rerank.RUNS))
    again = varce_rerank.combine(out, ["main", "j1-pseudo"], earlier=before)
    assert again["runs_from_earlier"] == ["main", "j1-pseudo"] and again["retrained_teacher"] == {}
    for key in ("rows", "chosen_on_dev", "ablation_dev", "per_query_runs", "ablation_curves", "goal", "teacher"):
        assert again.get(key) == (before[key] | {"teacher_run": "main"} if key == "goal" else before.get(key))
    now = varce_rerank.combine(out, list(varce_rerank.RUNS), earlier=before)
    assert now["runs_from_earlier"] == ["main", "j1-pseudo"] and list(now["runs_combined"])[-1] == "j3-pseudo"
    assert now["chosen_on_dev"] == {"run": "j3-pseudo", "system": "CE", "dev": 0.32}
    assert not [r for r in now["rows"] if r["run"] == "j3-pseudo" and r["joint_layers"] is None]
    assert now["goal"]["teacher_run"] == "main" and now["goal"]["bi_encoder"] == pytest.approx(np.mean(bi))


def test_a_run_with_a_retrained_teacher_keeps_its_teacher_rows_and_the_goal_uses_them(tmp_path):
    """A run whose bi-encoder ranks otherwise than the main run's had its teacher retrained: its teacher rows stay,
    labelled with the run, and the goal of its chosen row is halfway between its own bi-encoder and fused teacher."""
    bi3 = [0.4, 0.3, 0.5, 0.35, 0.4, 0.3]  # mean 0.375; its fused teacher 0.55: halfway 0.4625
    out, before, _ = _earlier_and_now(tmp_path, bi3)
    now = varce_rerank.combine(out, list(varce_rerank.RUNS), earlier=before)
    assert list(now["retrained_teacher"]) == ["j3-pseudo"]
    own = {r["system"] for r in now["rows"] if r["run"] == "j3-pseudo" and r["joint_layers"] is None}
    assert own == {"Teacher (bi-encoder)", FUSED}  # BM25: the main run's row only
    g = now["goal"]
    assert g["chosen"] == "j3-pseudo/CE" and g["teacher_run"] == "j3-pseudo"
    assert g["bi_encoder"] == pytest.approx(np.mean(bi3)) and g["fused_teacher"] == pytest.approx(0.55)
    assert g["halfway"] == pytest.approx(0.4625) and g["halfway_met"]  # 0.5: met against its own teacher
    assert g["share_of_gap"] == pytest.approx((0.5 - np.mean(bi3)) / (0.55 - np.mean(bi3)))
    text = varce_rerank.markdown(now)
    assert f"| Teacher (bi-encoder), retrained for j3-pseudo | {np.mean(bi3):.4f} (" in text
    assert "(the teacher retrained for j3-pseudo)" in text


def test_a_run_whose_bm25_differs_from_the_main_runs_is_refused(tmp_path):
    out, before, j3 = _earlier_and_now(tmp_path, [0.35, 0.3, 0.4, 0.35, 0.4, 0.3])
    _write(f"{out}-j3-pseudo", _summary(j3 | {"BM25": (None, [0.3] * 6, None), "CE": (3, [0.5] * 6, 0.32)}))
    with pytest.raises(ValueError, match="run j3-pseudo: BM25's per-query nDCG@10 at irds:beir/nfcorpus differs"):
        varce_rerank.combine(out, list(varce_rerank.RUNS), earlier=before)


def test_make_teacher_runs_the_main_runs_command_with_teacher_only(tmp_path, monkeypatch):
    """The teacher alone is the main run's own command with ``--teacher-only`` (the same teacher settings), and a
    failing command's exit status stops the grid before any run."""
    import pyterrier_prob.cli

    out, calls = str(tmp_path / "v"), []
    monkeypatch.setattr(pyterrier_prob.cli, "main", lambda args: calls.append(args) or 2)
    assert varce_rerank.make_teacher(out) == 2
    assert calls == [[*varce_rerank.command(out, "main", "CE"), "--teacher-only"]]
    assert "--teacher" in calls[0] and calls[0][calls[0].index("--teacher") + 1] == "partial"
    monkeypatch.setattr(sys, "argv", ["varce_rerank.py", "--output", out, "--runs", "j3-pseudo", "--no-write"])
    calls.clear()
    assert varce_rerank.main() == 2 and len(calls) == 1  # the run itself never started


def test_a_run_without_the_main_run_makes_the_main_runs_teacher_first(tmp_path, monkeypatch):
    """``--runs j3-pseudo`` alone: the main run's teacher is made first when its folder lacks it (a fresh machine),
    then the run's own command; with the teacher there, the command alone."""
    import pyterrier_prob.cli

    out, calls = str(tmp_path / "v"), []
    monkeypatch.setattr(varce_rerank, "make_teacher", lambda output: calls.append(("teacher", output)))
    monkeypatch.setattr(pyterrier_prob.cli, "main", lambda args: calls.append(("run", args)) and 0)
    monkeypatch.setattr(sys, "argv", ["varce_rerank.py", "--output", out, "--runs", "j3-pseudo", "--no-write"])
    assert varce_rerank.main() == 0
    assert calls == [("teacher", out), ("run", varce_rerank.command(out, "j3-pseudo"))]
    os.makedirs(os.path.join(out, varce_rerank.TEACHER))
    with open(os.path.join(out, varce_rerank.TEACHER, "train_settings.json"), "w", encoding="utf8") as f:
        f.write("{}")
    calls.clear()
    assert varce_rerank.main() == 0
    assert calls == [("run", varce_rerank.command(out, "j3-pseudo"))]
    monkeypatch.setattr(
        sys, "argv", ["varce_rerank.py", "--output", str(tmp_path / "w"), "--runs", "main", "--no-write"]
    )
    calls.clear()
    assert varce_rerank.main() == 0  # the main run makes its teacher itself
    assert [c[0] for c in calls] == ["run", "run"] and calls[0][1] == varce_rerank.command(
        str(tmp_path / "w"), "main", "CE"
    )


def test_a_varce_runs_uncertainty_joins_the_tables_and_survives_earlier(tmp_path):
    """A run with a VarCE besides the main run keeps its AURC (without the risk-coverage curves), calibration and
    uncertainty under ``ablation_uncertainty``, labelled ``run/student`` in the tables after the main run's rows of
    each collection; a CE-only run adds nothing there; ``--earlier`` gives them back."""
    import shutil

    out = str(tmp_path / "v")
    bm25, bi = [0.3, 0.2, 0.4, 0.3, 0.3, 0.2], [0.35, 0.3, 0.4, 0.35, 0.4, 0.3]
    fused = [0.45, 0.4, 0.5, 0.45, 0.5, 0.4]
    baselines = {"BM25": (None, bm25, None), "Teacher (bi-encoder)": (None, bi, None), FUSED: (None, fused, None)}
    main = _summary(baselines | {"CE": (2, [0.5, 0.4, 0.6, 0.3, 0.5, 0.2], 0.31)})
    j1 = _summary({"CE": (1, [0.4, 0.4, 0.5, 0.3, 0.4, 0.1], 0.2)})
    j3 = _summary(
        {"CE": (3, [0.6, 0.5, 0.6, 0.4, 0.5, 0.4], 0.3), "VarCE-MEANVAR": (3, [0.55, 0.5, 0.6, 0.4, 0.5, 0.3], 0.32)}
    )
    std = {"aurc": {"std[s] (top 10)": 0.7}, "e_aurc": {"std[s] (top 10)": 0.3}, "random": 0.6, "optimal": 0.4}
    j3["aurc"] = {c: {"VarCE-MEANVAR": std | {"curves": {"std[s] (top 10)": [0.1]}}} for c in (HOME, OOD)}
    u = {"n_queries": 6, "rho_top10_std_vs_nDCG@10": 0.27, "p_top10_std": 4.5e-05, "risk_chosen": 0.25}
    j3["uncertainty"] = {HOME: {"VarCE-MEANVAR": u | {"risk_test": 0.35, "risk_p_vs_lambda0": 0.15}}}
    j3["std_shift"] = {"VarCE-MEANVAR": {OOD: {"mean": 0.383, "in_domain": 0.325, "p": 9e-73}}}
    j3["calibration"] = {"VarCE-MEANVAR": {"platt": [0.755, -4.802], "ece": 0.0159, "ranking": {"rce": 0.0497}}}
    j1["uncertainty"] = {HOME: {}}  # a CE-only run: no VarCE, nothing to add
    for suffix, summary in (("", main), ("-j1-pseudo", j1), ("-j3-pseudo", j3)):
        _write(out + suffix, summary)
    combined = json.loads(json.dumps(varce_rerank.combine(out, list(varce_rerank.RUNS))))
    kept = combined["ablation_uncertainty"]
    assert list(kept) == ["j3-pseudo"] and kept["j3-pseudo"]["aurc"][OOD] == {"VarCE-MEANVAR": std}  # no curves
    text = varce_rerank.markdown(combined)
    home = [line for line in text.splitlines() if line.startswith(f"| {HOME} | ")]
    assert home[:2] == [
        f"| {HOME} | CE | 0.5000 (0.1000) | — | 0.6000 | 0.4000 |",  # AURC: the main run's row first
        f"| {HOME} | j3-pseudo/VarCE-MEANVAR | — | 0.7000 (0.3000) | 0.6000 | 0.4000 |",
    ]
    assert "| j3-pseudo/VarCE-MEANVAR | 0.0159 | — | 0.0497 | — | 0.755, -4.802 |" in text
    assert f"| {HOME} | j3-pseudo/VarCE-MEANVAR | 0.325 | 0.27 (4.5e-05, 6) | 0.25 | 0.3500 (0.15) |" in text
    for suffix in ("", "-j1-pseudo", "-j3-pseudo"):
        shutil.rmtree(out + suffix)
    again = varce_rerank.combine(out, list(varce_rerank.RUNS), earlier=combined)
    assert again["ablation_uncertainty"] == kept and varce_rerank.markdown(again) == text


def test_joint_table_pairs_each_student_with_itself_at_the_next_smaller_j(tmp_path):
    """On the main run's rows only (not the train-only CEs, the joint-score CE or a score-as-text student): the CE
    at J = 1 → 2 → 3 and the VarCE-MEANVAR at 2 → 3, each difference and p the paired t-test's over the queries."""
    out = str(tmp_path / "v")
    bm25, fused = [0.3, 0.2, 0.4, 0.3, 0.3, 0.2], [0.45, 0.4, 0.5, 0.45, 0.5, 0.4]
    ce1, ce2, ce3 = [0.4, 0.4, 0.5, 0.3, 0.4, 0.1], [0.5, 0.4, 0.6, 0.3, 0.5, 0.2], [0.6, 0.5, 0.6, 0.4, 0.5, 0.4]
    mv2, mv3 = [0.45, 0.4, 0.55, 0.3, 0.5, 0.2], [0.5, 0.45, 0.6, 0.35, 0.45, 0.3]
    baselines = {"BM25": (None, bm25, None), "Teacher (bi-encoder)": (None, bm25, None), FUSED: (None, fused, None)}
    main = baselines | {
        "CE": (2, ce2, 0.31),
        "VarCE-MEANVAR": (2, mv2, 0.3),
        "CE (score as text)": (2, [0.9, 0.8, 0.9, 0.7, 0.8, 0.9], 0.3),
    }
    _write(out, _summary(main))
    _write(f"{out}-j1-pseudo", _summary({"CE": (1, ce1, 0.2)}))
    _write(f"{out}-j3-pseudo", _summary({"CE": (3, ce3, 0.3), "VarCE-MEANVAR": (3, mv3, 0.3)}))
    _write(f"{out}-j2-train", _summary({"CE": (2, [0.0, 0.1, 0.0, 0.2, 0.1, 0.0], 0.2)}))
    _write(f"{out}-j2-joint", _summary({"CE": (2, [0.1, 0.2, 0.1, 0.0, 0.1, 0.3], 0.2)}))
    combined = varce_rerank.combine(out, list(varce_rerank.RUNS))
    combined["rows"] = [
        r | {"input_score": "as text"} if "score as text" in r["system"] else r for r in combined["rows"]
    ]
    lines = [line for line in varce_rerank.joint_table(combined) if line.startswith(f"| {HOME}")]

    def row(system: str, j: str, x: list[float], y: list[float]) -> str:
        test = ttest_rel(y, x)
        low, high = test.confidence_interval(0.95)
        diff = f"{np.mean(y) - np.mean(x):+.4f} [{low:+.4f}, {high:+.4f}]"
        return f"| {HOME} | {system} | {j} | {np.mean(x):.4f} | {np.mean(y):.4f} | {diff} | {test.pvalue:.2g} |"

    assert lines == [
        row("CE", "1 → 2", ce1, ce2),
        row("CE", "2 → 3", ce2, ce3),
        row("VarCE-MEANVAR", "2 → 3", mv2, mv3),
    ]
