"""What the joint layers of a distilled split cross-encoder learn, by the term its score reads them through (the
pooled segments' cosine, ``--score-from both``, or kernel pooling of their token similarities, ``--score-from
kernels``): each run's dev learning curve and its training loss per 100 steps (the progress bar's), side by side on the
same teacher, rows and dev pairs; and for a cosine student's checkpoint, whether its joint term carries the lexical
signal the teacher adds (Spearman's rho with BM25 within a query) and whether any weight on it helps dev (nDCG@10 of
the bi-encoder path plus ``c`` times the joint term).

    python benchmarks/joint_term_probe.py --run cosine outputs/v52-su2 outputs/v52_su2.log \\
        --run kernels outputs/v52 outputs/v52_k1.log,outputs/v52_grid3.log \\
        --scale outputs/v52-su2/runs/distilled-CE/checkpoint-600
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "joint_term_probe.json")
TEACHER = "outputs/v52/models/distill-teacher"
WEIGHTS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)


def train_loss(log: str, student: str = "distilled-CE", every: int = 100) -> list[dict]:
    """Mean of the progress bar's ``loss`` per ``every`` steps of ``student`` in a run's logs (``log``: paths joined by
    commas, in the order they were written; the last value shown at each step wins, as a resumed run's)."""
    text = ""
    for path in log.split(","):
        with open(path, encoding="utf8", errors="replace") as f:
            text += f.read()
    pattern = rf"training {re.escape(student)}:[^\r\n]*?(\d+)/\d+ \[[^\]]*loss=([0-9.]+)\]"
    last = {int(step): float(loss) for step, loss in re.findall(pattern, text)}
    windows: dict[int, list[float]] = {}
    for step, loss in sorted(last.items()):
        windows.setdefault(step // every * every, []).append(loss)
    return [{"steps_from": k, "steps": len(v), "mean_loss": float(np.mean(v))} for k, v in sorted(windows.items())]


def run_record(folder: str, log: str, student: str = "distilled-CE") -> dict:
    """One run's dev curve, its recipe's module rates and command, and its training loss."""
    with open(os.path.join(folder, "curves", f"{student}.json"), encoding="utf8") as f:
        curve = json.load(f)
    out = {"folder": folder, "dev_curve": curve["points"], "best": curve["best"]}
    recipe = os.path.join(folder, "runs", student, "recipe.json")
    if os.path.isfile(recipe):
        with open(recipe, encoding="utf8") as f:
            out["module_learning_rates"] = json.load(f).get("module_learning_rates")
    for name in ("command.txt",):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, encoding="utf8") as f:
                out["command"] = f.read().strip()
    out["train_loss"] = train_loss(log, student)
    return out


def joint_scale(checkpoint: str, alpha: float, seed: int = 0, queries: int = 150, depth: int = 100) -> dict:
    """For a cosine (``--score-from both``) student: on BM25's top ``depth`` of ``queries`` seeded dev queries, the
    within-query Spearman rho of its joint term with BM25 and nDCG@10 of ``bi-encoder path + c * joint term``, beside
    the teacher's bi-encoder and its fusion with BM25 at ``alpha``."""
    import pandas as pd
    from scipy.stats import spearmanr

    from pyterrier_prob.cli import build_parser
    from pyterrier_prob.experiments import varce
    from pyterrier_prob.experiments.harness import Harness
    from pyterrier_prob.experiments.varce_train import dev_target
    from pyterrier_prob.fusion import interpolate
    from pyterrier_prob.varce import distill
    from st_extensions import load_model
    from st_extensions.cross_encoder.split import score_parts

    argv = ["--dataset", "irds:beir/nfcorpus", "--recipe", "partial", "--train-layers", "2", "--seed", str(seed)]
    argv += ["--dev-queries", str(queries), "--teacher", TEACHER, "--output", "outputs/distill-targets", "--quiet"]
    cfg = varce.config_from_args(build_parser("varce").parse_args(argv))
    h = Harness("varce", cfg)
    tg = dev_target(cfg, h, h.load_data(calibrate=True), depth)
    cand = tg.candidates(h, tg.topics, depth).reset_index(drop=True)
    full, bi = score_parts(load_model(checkpoint, device="cpu"), list(zip(cand["query"], cand["text"])), 64)
    cand["bi_path"] = bi.numpy()
    cand["joint"] = full.numpy() - cand["bi_path"]
    teacher = load_model(TEACHER, device="cpu")
    q = teacher.encode(cand["query"].tolist(), normalize_embeddings=True, batch_size=64)
    d = teacher.encode(cand["text"].tolist(), normalize_embeddings=True, batch_size=64)
    cand["dense"] = (q * d).sum(1)

    def ndcg(s: pd.Series) -> float:
        return float(distill.ndcg_at_10(cand.assign(s=np.asarray(s)), tg.qrels, "s", qids=tg.topics["qid"]).mean())

    rho = [spearmanr(g["joint"], g["score"])[0] for _, g in cand.groupby("qid") if g["score"].nunique() > 1]
    return {
        "checkpoint": checkpoint,
        "dev_queries": len(tg.topics),
        "depth": depth,
        "rho_joint_bm25_within_query": float(np.nanmean(rho)),
        "BM25": ndcg(cand["score"]),
        "teacher bi-encoder": ndcg(cand["dense"]),
        "alpha": alpha,
        "fused teacher": ndcg(interpolate(cand["qid"], cand["score"], cand["dense"], alpha)),
        "bi path + c * joint": {str(c): ndcg(cand["bi_path"] + c * cand["joint"]) for c in WEIGHTS},
        "joint term alone": ndcg(cand["joint"]),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", nargs=3, action="append", default=[], metavar=("NAME", "FOLDER", "LOG"))
    ap.add_argument("--scale", help="a cosine student's checkpoint for the joint term's weight sweep")
    ap.add_argument("--alpha", type=float, default=0.8, help="the teacher's fusion weight (its run's)")
    ap.add_argument("--out", default=RESULT)
    a = ap.parse_args(argv)
    from benchmarks._machine import describe, write_result

    result = {"command": "python benchmarks/joint_term_probe.py " + shlex.join(sys.argv[1:] if argv is None else argv)}
    result["runs"] = {name: run_record(folder, log) for name, folder, log in a.run}
    if a.scale:
        result["joint_scale"] = joint_scale(a.scale, a.alpha)
    result["machine"] = describe()
    write_result(a.out, result, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1)[:4000])


if __name__ == "__main__":
    main()
