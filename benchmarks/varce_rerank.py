"""Cross-encoders that read query and document together, distilled from a bi-encoder + BM25 teacher, as BM25
re-rankers: nfcorpus/test (in domain), scifact/test and Cranfield (zero-shot), BM25's top 100, every query, paired
tests. Writes ``benchmarks/results/varce_rerank.json`` and the plots beside it.

The runs, each ``pyterrier-prob varce --teacher ...`` with :data:`RECIPE` (resumable: rerun the same command and every
trained model, pool, cache and score is reused; a killed run continues from its last checkpoint):

- ``main`` (``--output``): the teacher fine-tuned until its dev curve stops rising (``--teacher partial``), then
  students whose top 2 layers read ``[q; d]`` with full attention from the start, trained on nfcorpus/train's queries
  and pseudo-queries cut from the nfcorpus corpus (titles and spans); CE, VarCE-MEANVAR, VarCE-VAR, and the CE and
  VarCE-VAR that read BM25's score as text (``--input-score``);
- the ablation (``<output>-j1-pseudo``, ``-j2-train``, ``-j1-train``): the CE alone at 1 and 2 joint layers, on the same
  rows as ``main`` or on nfcorpus/train's queries alone, same steps and seed, with the main run's teacher;
- ``<output>-j3-pseudo``: the CE and the VarCE-MEANVAR (the VarCE that dev preferred at J = 2, and the paper's best
  variant) at 3 joint layers on the main run's rows;
- ``j6-gpu`` (``--gpu``, ``benchmarks/results/varce_gpu.json``): the CE and VarCE-VAR at 6 joint layers (a plain
  sentence-transformers CrossEncoder) on the main run's rows, trained on a lent GPU by ``benchmarks/gpu_students.py``,
  each row labelled with the card;
- ``<output>-j2-joint`` (only with ``--runs``: not among the default runs, to save their CPU hours; the score paths
  are compared in ``benchmarks/results/varce_score_paths_probe.json``): the main run's CE with its score read from the
  joint layers alone (``--score-from joint``: no frozen bi-encoder path), which starts far below the bi-encoder it is
  built from.

The ablation's runs skip the MC-dropout passes (``--mc-dropout 0``): they are there for nDCG@10.

The students learn the teacher's ranking in their own units (``--teacher-units student``: Margin-MSE at their start
is the lexical part alone) and their learning curves re-rank BM25's top 100 of 150 dev queries, where the fused
teacher is visibly above its bi-encoder (``benchmarks/distill_targets.py``; BM25's top 30 of 100 queries could not see
the gap).

Every student but the last scores through both paths (``--score-from kernels``): a frozen copy of its top layers reads
each text apart, as the teacher's bi-encoder, and the joint layers' term, the kernel pooling of each joint layer's
query-document token similarities (CEDR-KNRM), starts at weight 0. (The joint layers' pooled cosine as that term,
``--score-from both``, learnt the training rows but not dev: ``docs/varce.md``.)

Which plain student at J >= 2 is the chosen row is decided by the dev points alone (the best of its learning curve
over every J >= 2 run), a rule fixed before any test figure is read. ``p_vs_j1`` compares a row with the J = 1 CE
trained on the same rows.

    python benchmarks/varce_rerank.py --output outputs/varce_rerank            # every run, then the JSON
    python benchmarks/varce_rerank.py --output outputs/varce_rerank --runs main  # the main run alone

A run whose output folder is gone (a fresh machine) need not be made again: ``--earlier
benchmarks/results/varce_rerank.json`` reads its rows, per-query values and curves from the JSON written before
(``runs_from_earlier`` names them). A run made without the main run (``--runs j3-pseudo``) makes the main run's
teacher first when the folder lacks it (:func:`make_teacher`). A run made since with a retrained teacher (its first
run's teacher was lost) keeps that teacher's rows, labelled with the run, and the goal of a row it holds is measured
against them (``retrained_teacher``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyterrier_prob.experiments.report import MISSING, cell  # noqa: E402

RECIPE = [
    "--dataset", "irds:beir/nfcorpus", "--recipe", "partial",
    "--steps", "3000", "--batch-size", "16", "--lr", "1e-4", "--max-seq-length", "128",
    "--pool-depth", "100", "--depth", "100", "--patience", "3",
    "--dev-queries", "150", "--dev-depth", "100", "--dev-every", "300", "--teacher-units", "student",
    "--score-from", "kernels",
    "--teacher-steps", "6000", "--teacher-dev-every", "200",
    "--ood", "irds:beir/scifact", "irds:cranfield", "--ood-queries", "0", "--ood-depth", "100",
    "--risks", "0", "0.25", "0.5", "1", "2", "--inference-batch-size", "64", "--mc-dropout", "8", "--resume", "--reuse",
]  # fmt: skip
PSEUDO = ["--pseudo-queries", "title", "span"]
ALL = ["CE", "VarCE-MEANVAR", "VarCE-VAR"]
#: run -> (joint layers, training rows, its options); ``main`` trains the teacher the others use.
RUNS = {
    "main": (2, "train + pseudo-queries", ["--train-layers", "2", *PSEUDO, "--input-score", "--students", *ALL]),
    "j1-pseudo": (1, "train + pseudo-queries", ["--train-layers", "1", *PSEUDO, "--students", "CE"]),
    "j2-train": (2, "train", ["--train-layers", "2", "--students", "CE"]),
    "j1-train": (1, "train", ["--train-layers", "1", "--students", "CE"]),
    "j3-pseudo": (3, "train + pseudo-queries", ["--train-layers", "3", *PSEUDO, "--students", "CE", "VarCE-MEANVAR"]),
    "j2-joint": (
        2,
        "train + pseudo-queries",
        ["--train-layers", "2", *PSEUDO, "--students", "CE", "--score-from", "joint"],
    ),
}
TEACHER = "models/distill-teacher"
#: The ablation's runs compare nDCG@10: no MC-dropout passes (its selective prediction keeps the other confidences).
ABLATION_ONLY = ["--mc-dropout", "0"]
#: The order the runs are made in: the main run's CE first (with the teacher it needs), then the J = 1 CE it is
#: compared with, then the main run's other students, then the rest of the ablation (each run reuses what is made).
ORDER = [("main", "CE"), ("j1-pseudo", None), ("main", None)]
ORDER += [(run, None) for run in ("j2-train", "j1-train", "j3-pseudo", "j2-joint")]
#: The runs made unless ``--runs`` names others (``j2-joint`` is made only when asked for).
DEFAULT_RUNS = [run for run in RUNS if run != "j2-joint"]
#: The J = 6 students trained on a lent GPU on the main run's rows (``benchmarks/gpu_students.py``), as the run
#: ``j6-gpu``: their rows join the table labelled with the card, their dev curves join the choice made on dev.
GPU_RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "varce_gpu.json")
GPU_RUN = "j6-gpu"
#: How the ``j6-gpu`` rows were made (the middle step on the GPU machine: ``benchmarks/gpu_students.py``'s docstring).
GPU_COMMANDS = [
    "python benchmarks/gpu_students.py prepare --output OUTPUT --bundle outputs/gpu-bundle",
    "python benchmarks/gpu_students.py device --bundle outputs/gpu-bundle --out $OUT --students STUDENT --steps 3000 "
    "--eval-every 300 --lr 2e-5 --batch-size 16 --patience 3 --budget-s 330",
    "python benchmarks/gpu_students.py device --bundle outputs/gpu-bundle --out $OUT --students STUDENT --steps 750 "
    "--eval-every 75 --lr 4e-5 --batch-size 64 --patience 3 --budget-s 190",
    "python benchmarks/gpu_students.py collect --bundle outputs/gpu-bundle --scores RETURNED_16 RETURNED_64 "
    "--output OUTPUT",
]


def training_queries(run: str) -> str:
    """The training rows of ``run`` (the GPU students: the main run's)."""
    return RUNS["main" if run == GPU_RUN else run][1]


def j1_run(training: str, made: Any = RUNS) -> str | None:
    """The J = 1 run trained on ``training`` among the runs of ``made`` (the runs whose summaries are there)."""
    return next((r for r, v in RUNS.items() if v[:2] == (1, training) and r in made), None)


def gpu_rows(path: str, main: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """The rows of ``benchmarks/gpu_students.py collect``'s JSON in this table's layout (run :data:`GPU_RUN`, the
    system named as there without its ``J = 6``: the card and the configuration; ``p_vs_CE`` against the J = 6 CE of
    the same configuration), their per-query nDCG@10 and dev curves."""
    with open(path, encoding="utf8") as f:
        gpu = json.load(f)

    def name(system: str) -> str:
        return system.replace("J = 6, ", "")

    rows, per_query = [], {}
    curves = {name(system): curve for system, curve in gpu["students"].items()}
    for r in gpu["rows"]:
        system = name(r["system"])
        row = {"collection": r["collection"], "depth": main["evaluated"][r["collection"]]["depth"], "system": system}
        row |= {"queries": r["queries"], "nDCG@10": r["nDCG@10"], "p_vs_bm25": r["p_vs_bm25"]}
        row |= {"p_vs_bi_encoder": r["p_vs_bi_encoder"], "p_vs_CE": r.get("p_vs_ce_j6")}
        row |= {"ci95_vs_bm25": r["ci95_vs_bm25"], "joint_layers": 6, "cross_attention_mass": None}
        row |= {"joint_share": None, "input_score": None, "card": r["card"], "run": GPU_RUN}
        row |= {k: r.get(k) for k in ("batch_size", "lr", "steps_run")}
        row["training_queries"] = training_queries(GPU_RUN)
        rows.append(row)
        per_query.setdefault(r["collection"], {})[system] = gpu["per_query"][r["collection"]][r["system"]]
    return rows, per_query, curves


def run_folder(output: str, run: str) -> str:
    return output if run == "main" else f"{output}-{run}"


def command(output: str, run: str, only: str | None = None) -> list[str]:
    """The run's ``pyterrier-prob`` arguments; ``only``: that plain student alone (no score-as-text ones)."""
    teacher = "partial" if run == "main" else os.path.join(output, TEACHER)
    options = RUNS[run][2]
    if only is not None:
        options = [*options[: options.index("--input-score")], "--students", only]  # the main run's plain options
    if run != "main":
        options = [*options, *ABLATION_ONLY]
    return ["varce", *RECIPE, *options, "--teacher", teacher, "--output", run_folder(output, run)]


#: The keys :func:`combine` and :func:`main` add to the main run's summary (:func:`earlier_summaries` drops them).
COMBINED_KEYS = {
    "benchmark", "command", "experiment_commands", "machine", "rows", "chosen_on_dev", "ablation_dev",
    "per_query_runs", "ablation_curves", "ablation_attention", "ablation_lexical_share", "runs_combined", "goal",
    "runs_from_earlier", "retrained_teacher", "ablation_uncertainty",
}  # fmt: skip
#: What :func:`combine` keeps of a run with a VarCE besides the main run (``ablation_uncertainty``): its selective
#: prediction (AURC without the curves), calibration and uncertainty tables.
UNCERTAINTY_KEYS = ("aurc", "calibration", "uncertainty", "std_shift")
#: The keys :func:`combine` adds to each row (:func:`earlier_summaries` drops them).
ROW_KEYS = {"run", "training_queries", "p_vs_j1", "chosen_on_dev"}
BI_ENCODER = "Teacher (bi-encoder)"


def earlier_summaries(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The summary of each run a ``varce_rerank.json`` written before combined (``runs_combined``), as far as
    :func:`combine` reads it: the run's rows, per-query nDCG@10, dev curves, attention and lexical shares, and a VarCE
    run's uncertainty tables; the main run's whole summary. For runs whose output folder is gone (``--earlier``)."""

    def rows(run: str) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k not in ROW_KEYS} for r in result["rows"] if r.get("run") == run]

    out = {"main": {k: v for k, v in result.items() if k not in COMBINED_KEYS} | {"rows": rows("main")}}
    for run in result["runs_combined"]:
        if run == "main" or run not in RUNS:
            continue
        out[run] = {
            "rows": rows(run),
            "per_query": result["per_query_runs"][run],
            "dev_curves": result["ablation_curves"].get(run, {}),
            "cross_attention_mass": result.get("ablation_attention", {}).get(run, {}),
            "lexical_share": result.get("ablation_lexical_share", {}).get(run, {}),
            **result.get("ablation_uncertainty", {}).get(run, {}),
            "students": result["runs_combined"][run],
            "evaluated": result["evaluated"],
            "teacher": result.get("retrained_teacher", {}).get(run, result.get("teacher")),
        }
    return out


def retrained_teacher(run: str, summary: dict[str, Any], main: dict[str, Any]) -> bool:
    """Whether ``run`` re-ranked with another teacher than the main run's (a teacher retrained by the same command
    after the first was lost): its bi-encoder's per-query nDCG@10 differs from the main run's somewhere. Its BM25 must
    be the main run's (the same first stage)."""
    import numpy as np
    import pandas as pd

    differs = False
    for collection, systems in summary.get("per_query", {}).items():
        for system in ("BM25", BI_ENCODER):
            if system not in systems or system not in main["per_query"].get(collection, {}):
                continue
            a, b = pd.Series(systems[system]), pd.Series(main["per_query"][collection][system])
            same = a.index.equals(b.index) and np.allclose(a.to_numpy(float), b[a.index].to_numpy(float), atol=1e-9)
            if system == "BM25" and not same:
                raise ValueError(f"run {run}: BM25's per-query nDCG@10 at {collection} differs from the main run's")
            differs |= system == BI_ENCODER and not same
    return differs


def make_teacher(output: str) -> int:
    """The main run's teacher alone, trained (or reused) into ``output`` as the main run makes it (``pyterrier-prob
    varce ... --teacher-only``): for runs made without the main run whose folder is gone. Returns the exit status."""
    from pyterrier_prob.cli import main as cli

    args = [*command(output, "main", "CE"), "--teacher-only"]
    print("pyterrier-prob " + shlex.join(args), flush=True)
    return cli(args)


def uncertainty_of(summary: dict[str, Any]) -> dict[str, Any]:
    """A run's :data:`UNCERTAINTY_KEYS`, its AURC without the risk-coverage curves (the plot is the main run's)."""
    out = {k: summary[k] for k in UNCERTAINTY_KEYS if summary.get(k)}
    if "aurc" in out:
        out["aurc"] = {c: {s: {k: v for k, v in t.items() if k != "curves"} for s, t in systems.items()}
                       for c, systems in out["aurc"].items()}  # fmt: skip
    return out


def _by_run(result: dict[str, Any], key: str) -> dict[str, dict[str, Any]]:
    """``key`` of the main run and of each run in ``ablation_uncertainty``, by the run's name."""
    runs = {"main": result.get(key, {})}
    return runs | {run: u.get(key, {}) for run, u in result.get("ablation_uncertainty", {}).items()}


def _name(run: str, system: str) -> str:
    """A re-ranker's name in the uncertainty tables: the main run's bare, another run's ``run/system``."""
    return system if run == "main" else f"{run}/{system}"


def combine(
    output: str, runs: list[str], gpu: str | None = None, earlier: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The main run's summary, its rows and the ablation's CE rows marked with their run, ``p_vs_j1`` and the row
    chosen on dev; ``gpu``: the J = 6 students' JSON (:func:`gpu_rows`), when one was made; ``earlier``: a
    ``varce_rerank.json`` written before, whose runs stand in for those with no summary in ``output``
    (:func:`earlier_summaries`; ``runs_from_earlier`` names them). A run with its own, retrained teacher keeps that
    teacher's rows (labelled with the run; ``retrained_teacher``), and the goal of a row it holds is measured
    against them."""
    import pandas as pd

    from pyterrier_prob.evaluation import paired_p

    summaries, from_earlier = {}, []
    before = earlier_summaries(earlier) if earlier is not None else {}
    for run in runs:
        path = os.path.join(run_folder(output, run), "summary.json")
        if os.path.isfile(path):
            with open(path, encoding="utf8") as f:
                summaries[run] = json.load(f)
        elif run in before:
            summaries[run] = before[run]
            from_earlier.append(run)
    if "main" not in summaries:
        raise SystemExit(f"no summary of the main run in {output}: run it first")
    main = summaries["main"]
    retrained = {
        run: s.get("teacher") for run, s in summaries.items() if run != "main" and retrained_teacher(run, s, main)
    }

    def j1_per_query(training: str, collection: str) -> pd.Series | None:
        """The per-query nDCG@10 of the J = 1 CE trained on ``training`` at ``collection`` (None: not made there)."""
        j1 = j1_run(training, summaries)
        if j1 is None or collection not in summaries[j1]["per_query"]:
            return None
        return pd.Series(summaries[j1]["per_query"][collection]["CE"])

    rows = []
    for run, s in summaries.items():
        layers, training, _ = RUNS[run]
        for row in s["rows"]:
            own = run in retrained and row["system"].startswith("Teacher")
            if run != "main" and row["joint_layers"] is None and not own:
                continue  # BM25 and the teacher: the main run's rows (unless the run's teacher was retrained)
            row = {**row, "run": run, "training_queries": training if row["joint_layers"] is not None else None}
            other = j1_per_query(training, row["collection"]) if row["joint_layers"] is not None else None
            if other is not None:
                mine = pd.Series(s["per_query"][row["collection"]][row["system"]])
                is_j1 = (run, row["system"]) == (j1_run(training, summaries), "CE")
                row["p_vs_j1"] = None if is_j1 else paired_p(mine, other)
            rows.append(row)
    extra = gpu_rows(gpu, main) if gpu is not None and os.path.isfile(gpu) else ([], {}, {})
    for row in extra[0]:
        other = j1_per_query(training_queries(GPU_RUN), row["collection"])
        if other is not None:
            row["p_vs_j1"] = paired_p(pd.Series(extra[1][row["collection"]][row["system"]]), other)
        rows.append(row)
    dev = {  # every plain student at J >= 2: its best dev point (the learning curve), read before test
        (run, system): curve["best"]["dev"]
        for run, s in summaries.items()
        if RUNS[run][0] >= 2
        for system, curve in s["dev_curves"].items()
        if curve.get("best") and "score as text" not in system
    } | {(GPU_RUN, system): curve["best"]["dev"] for system, curve in extra[2].items()}
    order = [*RUNS, GPU_RUN]
    chosen = max(dev, key=lambda k: (dev[k], -order.index(k[0]))) if dev else None
    for row in rows:  # the chosen student's rows at each collection's evaluated depth
        depth = summaries.get(row["run"], main)["evaluated"][row["collection"]]["depth"]
        row["chosen_on_dev"] = (row["run"], row["system"]) == chosen and row["depth"] == depth
    main = {**main, "rows": rows, "chosen_on_dev": {"run": chosen[0], "system": chosen[1], "dev": dev[chosen]}}
    main["ablation_dev"] = {f"{run}/{system}": v for (run, system), v in dev.items()}
    others = {run: s for run, s in summaries.items() if run != "main"}
    main["per_query_runs"] = {run: s["per_query"] for run, s in others.items()}
    main["ablation_curves"] = {run: s.get("dev_curves", {}) for run, s in others.items()}
    if extra[0]:
        main["per_query_runs"][GPU_RUN], main["ablation_curves"][GPU_RUN] = extra[1], extra[2]
    main["ablation_attention"] = {run: s.get("cross_attention_mass", {}) for run, s in others.items()}
    main["ablation_lexical_share"] = {run: s.get("lexical_share", {}) for run, s in others.items()}
    main["ablation_uncertainty"] = {
        run: uncertainty_of(s) for run, s in others.items() if any(s.get("uncertainty", {}).values())
    }
    main["runs_combined"] = {run: s.get("students") for run, s in summaries.items()}  # the runs and students so far
    main["runs_from_earlier"] = from_earlier
    main["retrained_teacher"] = retrained
    main["goal"] = goal(main)
    return main


def _p(value: float | None) -> str:
    return cell(value, ".2g")


def _label(row: dict[str, Any]) -> str:
    if row.get("run") in (None, "main"):
        return row["system"]
    if row["joint_layers"] is None:  # a run's own (retrained) teacher
        return f"{row['system']}, retrained for {row['run']}"
    return f"{row['system']}, J = {row['joint_layers']}, {row['training_queries']} ({row['run']})"


def _evaluated_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows at each collection's evaluated depth (not the extra depths)."""
    return [r for r in result["rows"] if r["depth"] == result["evaluated"][r["collection"]]["depth"]]


def goal(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's goal, checked on the figures: the row chosen on dev against the J = 1 CE on the same rows
    (significantly above), against halfway from the bi-encoder alone to the fused teacher (in domain), and against BM25
    on each zero-shot collection (the paired difference's 95% interval above -0.02)."""
    evaluated = result["evaluated"]
    home = next(label for label, e in evaluated.items() if not e["zero_shot"])
    rows = _evaluated_rows(result)
    chosen = [r for r in rows if r["chosen_on_dev"]]
    if not chosen:
        return {"chosen": None}
    run, system = chosen[0]["run"], chosen[0]["system"]
    at = {r["collection"]: r for r in chosen}
    teacher_run = run if run in result.get("retrained_teacher", {}) else "main"  # the teacher its rows came from
    here = {r["system"]: r["nDCG@10"] for r in rows if r["collection"] == home and r["run"] == teacher_run}
    bi = here[BI_ENCODER]
    fused_name = next(n for n in here if n.startswith("Teacher (bi-encoder + BM25"))
    halfway = bi + (here[fused_name] - bi) / 2
    training = training_queries(run)
    j1_name = j1_run(training)
    j1 = next((r for r in rows if r["collection"] == home and (r["run"], r["system"]) == (j1_name, "CE")), None)
    out: dict[str, Any] = {"chosen": f"{run}/{system}", "collection": home, "nDCG@10": at[home]["nDCG@10"]}
    out["teacher_run"] = teacher_run
    out["bi_encoder"], out["fused_teacher"], out["halfway"] = bi, here[fused_name], halfway
    out["share_of_gap"] = (at[home]["nDCG@10"] - bi) / (here[fused_name] - bi)
    out["halfway_met"] = at[home]["nDCG@10"] >= halfway
    out["j1"] = None if j1 is None else j1["nDCG@10"]
    p = at[home].get("p_vs_j1")
    out["p_vs_j1"] = p
    out["above_j1_met"] = j1 is not None and p is not None and p < 0.05 and at[home]["nDCG@10"] > j1["nDCG@10"]
    out["zero_shot"] = {
        label: {"nDCG@10": r["nDCG@10"], "ci95_vs_bm25": r["ci95_vs_bm25"]}
        | {"non_inferior": r["ci95_vs_bm25"] is not None and r["ci95_vs_bm25"][0] >= -0.02}
        for label, r in at.items()
        if label != home
    }
    return out


def ndcg_table(result: dict[str, Any]) -> list[str]:
    """nDCG@10 per system and collection at its evaluated depth (p vs BM25 / the bi-encoder alone / the J = 1 CE on
    the same rows / the CE of the same run); the row chosen on dev in bold."""
    evaluated = result["evaluated"]
    labels = list(evaluated)
    rows = _evaluated_rows(result)
    names = list(dict.fromkeys(_label(r) for r in rows))
    by_cell = {(_label(r), r["collection"]): r for r in rows}
    head = [f"{c} ({evaluated[c]['queries']} q.{', zero-shot' if evaluated[c]['zero_shot'] else ''})" for c in labels]
    out = ["nDCG@10 on BM25's top 100 (p vs BM25 / vs the bi-encoder alone / vs the J = 1 CE on the same rows / vs "
           "the CE of the same run; paired t-tests; **bold**: the row chosen on dev):", "",
           "| system | " + " | ".join(head) + " |", "|---|" + "---|" * len(labels)]  # fmt: skip
    for name in names:
        cells = []
        for c in labels:
            r = by_cell.get((name, c))
            if r is None:
                cells.append(MISSING)
                continue
            ps = " / ".join(_p(r.get(k)) for k in ("p_vs_bm25", "p_vs_bi_encoder", "p_vs_j1", "p_vs_CE"))
            value = f"**{r['nDCG@10']:.4f}**" if r["chosen_on_dev"] else f"{r['nDCG@10']:.4f}"
            cells.append(f"{value} ({ps})")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def goal_lines(result: dict[str, Any]) -> list[str]:
    """The goal checked on the figures (:func:`goal`), as sentences."""
    g = goal(result)
    if g["chosen"] is None:
        return ["No row chosen on dev: no plain student at J >= 2 has a dev curve."]
    out = [f"Chosen on dev: {g['chosen']} ({result['chosen_on_dev']['dev']:.4f} on dev).", ""]
    retrained = "" if g.get("teacher_run", "main") == "main" else f" (the teacher retrained for {g['teacher_run']})"
    out.append(
        f"- {g['collection']}: {g['nDCG@10']:.4f} against the bi-encoder alone {g['bi_encoder']:.4f} and the "
        f"fused teacher {g['fused_teacher']:.4f}{retrained}: {100 * g['share_of_gap']:.0f}% of the way (halfway "
        f"{g['halfway']:.4f}: {'met' if g['halfway_met'] else 'missed'})."
    )
    if g["j1"] is not None:
        verdict = "met" if g["above_j1_met"] else "missed"
        out.append(f"- Against the J = 1 CE on the same rows, {g['j1']:.4f}: p = {_p(g['p_vs_j1'])} ({verdict}).")
    for label, z in g["zero_shot"].items():
        ci = z["ci95_vs_bm25"]
        span = MISSING if ci is None else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]"
        verdict = "non-inferior" if z["non_inferior"] else "not shown non-inferior"
        out.append(f"- {label}: {z['nDCG@10']:.4f}; 95% interval of (it − BM25) {span} ({verdict} at −0.02).")
    return out


def aurc_table(result: dict[str, Any]) -> list[str]:
    """AURC (E-AURC) of each confidence per collection and re-ranker, with random and optimal (Geifman et al.)."""
    runs = _by_run(result, "aurc")
    aurc: dict[str, dict[str, Any]] = {}  # collection -> re-ranker -> its AURC, the main run's first
    for run, by in runs.items():
        for label, systems in by.items():
            aurc.setdefault(label, {}).update({_name(run, s): t for s, t in systems.items()})
    confidences = list(dict.fromkeys(k for s in aurc.values() for t in s.values() for k in t["aurc"]))
    out = ["AURC (E-AURC) of query-level selective prediction; risk 1 − nDCG@10; lower is better; random: the mean "
           "risk:", "", "| collection | re-ranker | " + " | ".join(confidences) + " | random | optimal |",
           "|---|---|" + "---|" * (len(confidences) + 2)]  # fmt: skip
    for label, systems in aurc.items():
        for s, t in systems.items():
            vals = [f"{t['aurc'][c]:.4f} ({t['e_aurc'][c]:.4f})" if c in t["aurc"] else MISSING for c in confidences]
            out.append(f"| {label} | {s} | " + " | ".join(vals) + f" | {t['random']:.4f} | {t['optimal']:.4f} |")
    return out


def calibration_table(result: dict[str, Any]) -> list[str]:
    """ECE of the Platt map fitted on dev (for a VarCE also without std[s]) and the ranking calibration error."""
    out = ["Calibration on the in-domain test pairs (ECE over 15 equal-mass bins of the Platt map fitted on dev; "
           "RCE: the same for P(the higher-scored of two judged documents of a query is the more relevant) = "
           "sigmoid(a Δs), a fitted on dev; without std[s]: a VarCE's variance not integrated out):", "",
           "| re-ranker | ECE | ECE without std[s] | RCE | RCE without std[s] | Platt a, b |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    for s, c in ((_name(run, s), c) for run, by in _by_run(result, "calibration").items() for s, c in by.items()):
        ranking = c.get("ranking", {})
        cells = [cell(c.get("ece"), ".4f"), cell(c.get("ece_without_std"), ".4f"), cell(ranking.get("rce"), ".4f")]
        cells += [cell(ranking.get("rce_without_std"), ".4f"), f"{c['platt'][0]:.3f}, {c['platt'][1]:.3f}"]
        out.append(f"| {s} | " + " | ".join(cells) + " |")
    return out


def uncertainty_table(result: dict[str, Any]) -> list[str]:
    """Per collection and VarCE: the mean std[s] over the top 10 (one-sided p that it is higher than in domain),
    Spearman's rho of a query's std[s] with its nDCG@10, and the risk-aware lambda chosen on dev with its test
    nDCG@10 (p against lambda = 0)."""
    shifts = _by_run(result, "std_shift")
    out = ["VarCE's uncertainty per collection (std[s] over each query's top 10; rho > 0: uncertain queries score "
           "higher; E[s] − λ·std[s] with λ chosen on dev):", "", "| collection | re-ranker | mean std[s] (p higher "
           "than in domain) | ρ(std[s], nDCG@10) (p, queries) | λ chosen on dev | test nDCG@10 at λ (p vs λ = 0) |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    rows: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}  # collection -> (run, VarCE, its figures)
    for run, by in _by_run(result, "uncertainty").items():
        for label, systems in by.items():
            rows.setdefault(label, []).extend((run, s, u) for s, u in systems.items())
    for label, found in rows.items():
        for run, s, u in found:
            shift = shifts.get(run, {}).get(s, {})
            moved = shift.get(label)
            if moved is not None:
                mean = f"{moved['mean']:.3f} (p {_p(moved['p'])})"
            else:
                mean = next((f"{v['in_domain']:.3f}" for v in shift.values()), MISSING)
            rho = f"{cell(u.get('rho_top10_std_vs_nDCG@10'), '.2f')} ({_p(u.get('p_top10_std'))}, {u['n_queries']})"
            risk = f"{cell(u.get('risk_test'), '.4f')} ({_p(u.get('risk_p_vs_lambda0'))})"
            out.append(f"| {label} | {_name(run, s)} | {mean} | {rho} | {cell(u.get('risk_chosen'), 'g')} | {risk} |")
    return out


def _paired(x: Any, y: Any) -> str:
    """``+diff [low, high] | p`` of the paired per-query series ``x - y`` (mean difference over the queries both
    hold, its 95% interval and the paired t-test), as the comparison tables print it."""
    from pyterrier_prob.evaluation import paired_ci, paired_p

    ci = paired_ci(x, y)
    span = MISSING if ci is None else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]"
    a, b = x.align(y, join="inner")
    return f"{float((a - b).mean()):+.4f} {span} | {_p(paired_p(x, y))}"


def input_score_table(result: dict[str, Any]) -> list[str]:
    """Each main-run student that reads BM25's score as text (``input_score`` not null) against its plain version:
    the paired difference of nDCG@10 per collection, its 95% interval and paired t-test (Askari et al., ECIR 2023)."""
    import pandas as pd

    out = ["Reading BM25's score as text against the same student without it (paired over the queries):", ""]
    out += [
        "| collection | student | plain | score as text | difference (95% interval) | p |",
        "|---|---|---|---|---|---|",
    ]
    texts = {r["system"] for r in _evaluated_rows(result) if r.get("input_score") and r.get("run") == "main"}
    for label, systems in result.get("per_query", {}).items():
        for system in [s for s in systems if s in texts]:
            plain = system[: system.index(" (")]
            if plain not in systems:
                continue
            a, b = pd.Series(systems[system]), pd.Series(systems[plain])
            out.append(f"| {label} | {plain} | {b.mean():.4f} | {a.mean():.4f} | {_paired(a, b)} |")
    return out


def _run_per_query(result: dict[str, Any], run: str, collection: str, system: str) -> Any:
    """The per-query nDCG@10 of ``system`` of ``run`` at ``collection`` as a Series (None: not there)."""
    import pandas as pd

    source = result.get("per_query", {}) if run == "main" else result.get("per_query_runs", {}).get(run, {})
    values = source.get(collection, {}).get(system)
    return None if values is None else pd.Series(values)


def rows_table(result: dict[str, Any]) -> list[str]:
    """The ablation's attribution of the training rows: at each J, the CE trained on nfcorpus/train's queries and
    pseudo-queries against the CE trained on the train queries alone (same steps and seed), paired over the queries."""
    runs = {(r["joint_layers"], r["training_queries"]): r["run"] for r in _evaluated_rows(result)
            if r["system"] == "CE" and r.get("run") in RUNS and r.get("joint_layers")}  # fmt: skip
    out = ["The training rows at each J: the CE on nfcorpus/train's queries and pseudo-queries against the CE on the "
           "train queries alone (paired over the queries):", "",
           "| collection | J | train only | train + pseudo-queries | difference (95% interval) | p |",
           "|---|---|---|---|---|---|"]  # fmt: skip
    for label in result["evaluated"]:
        for j in sorted({j for j, _ in runs}):
            if (j, "train") not in runs or (j, "train + pseudo-queries") not in runs:
                continue
            alone = _run_per_query(result, runs[j, "train"], label, "CE")
            both = _run_per_query(result, runs[j, "train + pseudo-queries"], label, "CE")
            if alone is None or both is None:
                continue
            out.append(f"| {label} | {j} | {alone.mean():.4f} | {both.mean():.4f} | {_paired(both, alone)} |")
    return out


def joint_table(result: dict[str, Any]) -> list[str]:
    """Each plain student at each J on the main run's rows (nfcorpus/train's queries and the pseudo-queries, the
    kernel score; same steps and seed) against the same student at the next smaller J made, paired over the queries."""
    made = {(r["system"], r["joint_layers"]): r["run"] for r in _evaluated_rows(result)
            if r.get("run") in RUNS and RUNS[r["run"]][1] == "train + pseudo-queries" and r.get("joint_layers")
            and "--score-from" not in RUNS[r["run"]][2] and not r.get("input_score")}  # fmt: skip
    out = ["Each joint layer on the main run's rows: a student at J against the same student at the next smaller J "
           "(paired over the queries):", "",
           "| collection | student | J | nDCG@10 at the smaller J | at J | difference (95% interval) | p |",
           "|---|---|---|---|---|---|---|"]  # fmt: skip
    for label in result["evaluated"]:
        for system in dict.fromkeys(s for s, _ in made):
            layers = sorted(j for s, j in made if s == system)
            for low, high in zip(layers, layers[1:]):
                a = _run_per_query(result, made[system, low], label, system)
                b = _run_per_query(result, made[system, high], label, system)
                if a is not None and b is not None:
                    cells = f"{low} → {high} | {a.mean():.4f} | {b.mean():.4f} | {_paired(b, a)}"
                    out.append(f"| {label} | {system} | {cells} |")
    return out


def attention_table(result: dict[str, Any]) -> list[str]:
    """The attention mass between the texts per joint layer at step 0 and at the kept step, beside uniform's."""
    out = ["Attention between the texts per joint layer, step 0 → kept (uniform: what uniform attention gives):", ""]
    out += ["| run / student | layer | query→document | uniform | document→query | uniform |"]
    out.append("|---|---|---|---|---|---|")
    masses = {("main", s): m for s, m in result.get("cross_attention_mass", {}).items()}
    for run, summary in result.get("ablation_attention", {}).items():
        masses |= {(run, s): m for s, m in summary.items()}
    for (run, s), m in masses.items():
        for first, kept in zip(m["step_0"], m["kept"]):
            out.append(
                f"| {run}/{s} | {first['layer']} | {first['query_to_document']:.3f} → {kept['query_to_document']:.3f} "
                f"| {kept['uniform_query_to_document']:.3f} | {first['document_to_query']:.3f} → "
                f"{kept['document_to_query']:.3f} | {kept['uniform_document_to_query']:.3f} |"
            )
    return out


def lexical_table(result: dict[str, Any]) -> list[str]:
    """BM25's share of each ranker's least-squares weights on BM25's and the bi-encoder's per-query z-scores."""
    shares = {("main", n): {c: v[n] for c, v in result.get("lexical_share", {}).items() if n in v}
              for n in dict.fromkeys(n for v in result.get("lexical_share", {}).values() for n in v)}  # fmt: skip
    for run, summary in result.get("ablation_lexical_share", {}).items():
        names = dict.fromkeys(n for v in summary.values() for n in v if not n.startswith("Teacher"))
        shares |= {(run, n): {c: v[n] for c, v in summary.items() if n in v} for n in names}
    labels = list(result["evaluated"])
    out = ["What each ranker follows: BM25's share of the least-squares weights of its per-query z-scores on"
           " BM25's and the teacher bi-encoder's (R^2):", ""]  # fmt: skip
    out += ["| run / ranker | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for (run, n), by in shares.items():
        got = [by.get(c) for c in labels]
        cells = [MISSING if v is None else f"{cell(v['bm25_share'], '.3f')} ({cell(v['r2'], '.2f')})" for v in got]
        out.append(f"| {run}/{n} | " + " | ".join(cells) + " |")
    return out


def curves_table(result: dict[str, Any]) -> list[str]:
    """Every student's dev curve (nDCG@10 by step) and the step kept."""
    out = ["Dev curves (nDCG@10 by step; the best point is kept):", ""]
    out += ["| run / student | dev nDCG@10 (step) | kept step |", "|---|---|---|"]
    curves = {("main", s): c for s, c in result.get("dev_curves", {}).items()}
    for run, summary in result.get("ablation_curves", {}).items():
        curves |= {(run, s): c for s, c in summary.items()}
    for (run, s), c in curves.items():
        points = " → ".join(f"{p['dev']:.4f} ({p['step']})" for p in c["points"])
        out.append(f"| {run}/{s} | {points} | {(c.get('best') or {}).get('step', MISSING)} |")
    return out


#: The tables of ``varce_rerank.json`` by name (``--table FILE --section NAME`` prints one; ``--markdown`` all).
SECTIONS = {
    "ndcg": ndcg_table,
    "goal": goal_lines,
    "aurc": aurc_table,
    "calibration": calibration_table,
    "uncertainty": uncertainty_table,
    "input_score": input_score_table,
    "rows": rows_table,
    "joint": joint_table,
    "attention": attention_table,
    "lexical": lexical_table,
    "curves": curves_table,
}


def markdown(result: dict[str, Any]) -> str:
    """Every table of :data:`SECTIONS` from ``varce_rerank.json``, in that order."""
    return "\n\n".join("\n".join(section(result)) for section in SECTIONS.values()) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", default="outputs/varce_rerank", help="the main run's output folder")
    ap.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, choices=list(RUNS), help="the runs to make")
    ap.add_argument("--out", default="benchmarks/results/varce_rerank.json")
    ap.add_argument("--no-write", action="store_true", help="make the runs only")
    ap.add_argument("--markdown", action="store_true", help="print the tables of --out (written before) and stop")
    ap.add_argument("--write-only", action="store_true", help="make no run: combine the summaries there are")
    ap.add_argument("--gpu", default=GPU_RESULT, help="the J = 6 students' JSON (benchmarks/gpu_students.py)")
    ap.add_argument("--table", default=None, help="print one table of this JSON (written before) and stop")
    ap.add_argument("--section", default="ndcg", choices=list(SECTIONS), help="the table --table prints")
    ap.add_argument(
        "--earlier",
        default=None,
        help="a varce_rerank.json written before: its runs stand in for those whose output folder is gone",
    )
    a = ap.parse_args()
    if a.markdown or a.table:
        with open(a.table or a.out, encoding="utf8") as f:
            result = json.load(f)
        print("\n".join(SECTIONS[a.section](result)) + "\n" if a.table else markdown(result), end="")
        return 0

    from benchmarks._machine import describe, write_result
    from pyterrier_prob.cli import main as cli

    needs_teacher = any(run != "main" for run in a.runs) and "main" not in a.runs and not a.write_only
    if needs_teacher and not os.path.isfile(os.path.join(a.output, TEACHER, "train_settings.json")):
        print(f"the main run's teacher, into {a.output} (the runs asked for read it)", flush=True)
        if code := make_teacher(a.output):
            return code
    for run, only in ORDER:
        if run not in a.runs or a.write_only:
            continue
        args = command(a.output, run, only)
        print("pyterrier-prob " + shlex.join(args), flush=True)
        if code := cli(args):
            return code
    if a.no_write:
        return 0
    earlier = None
    if a.earlier:
        with open(a.earlier, encoding="utf8") as f:
            earlier = json.load(f)
    summary = combine(a.output, list(RUNS), a.gpu, earlier)
    result = {
        "benchmark": "Cross-encoders reading query and document together, distilled from a bi-encoder + BM25 "
        "teacher, as BM25 re-rankers (nDCG@10)",
        "command": f"python benchmarks/varce_rerank.py --output {a.output}"
        + " --write-only" * a.write_only
        + (f" --earlier {a.earlier}" if a.earlier else "")
        + (f" --out {a.out}" if a.out != ap.get_default("out") else ""),
        "experiment_commands": {
            r: "pyterrier-prob " + shlex.join(command(a.output, r)) for r in summary["runs_combined"]
        }
        | ({GPU_RUN: GPU_COMMANDS} if GPU_RUN in summary.get("per_query_runs", {}) else {}),
        "machine": describe(),
        **summary,
    }
    write_result(a.out, result, indent=1)
    print(f"wrote {a.out}")
    # the plots beside the JSON: varce_<plot> for the default --out, <its stem>_<plot> for another (an interim one)
    stem = "varce" if a.out == ap.get_default("out") else os.path.splitext(os.path.basename(a.out))[0]
    for name in ("reliability.png", "risk_coverage.png"):
        plot = os.path.join(a.output, name)
        if os.path.isfile(plot):
            shutil.copyfile(plot, os.path.join(os.path.dirname(os.path.abspath(a.out)), f"{stem}_{name}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
