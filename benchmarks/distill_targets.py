"""What a distilled student can learn from the fused teacher of ``pyterrier-prob varce --teacher``, measured before any
student trains: (1) how much of Margin-MSE at a student's start (``scale * cos`` of the teacher's bi-encoder) is the
lexical part it should learn, and how much a per-query rescaling of what it already ranks by, under each
``--teacher-units``; (2) how far the fused teacher is above its bi-encoder alone on dev, at each dev depth and query
count: a dev measure that cannot see that gap cannot choose a student's step.

(1) samples Margin-MSE rows as ``distillation_rows`` does (a document from the query's top 10 by teacher score, one from
the rest of its pool) from the run's cached training pools; (2) re-ranks BM25's top ``depth`` of the dev queries
(``--dev-queries`` seeded, as the run's learning curves) with the bi-encoder, BM25 and the fusion, paired t-tests.

    python benchmarks/distill_targets.py --output outputs/v52 --teacher outputs/v52/models/distill-teacher
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

import numpy as np
import pandas as pd

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pyterrier_prob.atomic import atomic_write  # noqa: E402
from pyterrier_prob.evaluation import paired_ci, paired_p  # noqa: E402
from pyterrier_prob.varce import distill  # noqa: E402

RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "distill_targets.json")


def start_losses(pool: pd.DataFrame, alpha: float, scale: float, rows: int, seed: int = 0) -> dict[str, float]:
    """Mean Margin-MSE of the student at its start (``scale * cos``) over ``rows`` sampled (positive, negative) pairs
    per query, against the teacher in z units, in the student's units, and against the z teacher's dense part alone
    (``alpha * z(cos)``: the loss a student would pay with no lexical part to learn at all)."""
    rng = np.random.default_rng(seed)
    student = scale * pool["dense"].to_numpy()
    targets = {
        "z": distill.teacher_scores(pool, alpha),
        "student": distill.teacher_in_student_units(pool, alpha, scale),
        "z, dense part alone": alpha * distill.teacher_scores(pool, 1.0),
    }
    losses: dict[str, list[float]] = {k: [] for k in targets}
    for _, g in pool.groupby("qid"):
        i = g.index.to_numpy()
        if len(i) <= 10:
            continue
        order = i[np.argsort(-targets["z"][i], kind="stable")]
        pos, neg = order[rng.integers(0, 10, rows)], order[rng.integers(10, len(order), rows)]
        for k, t in targets.items():
            losses[k].append(float(np.mean(((student[pos] - student[neg]) - (t[pos] - t[neg])) ** 2)))
    return {k: float(np.mean(v)) for k, v in losses.items()} | {"queries": len(losses["z"])}


def dev_headroom(teacher: str, alpha: float, settings: list[tuple[int, int]], seed: int) -> list[dict]:
    """The bi-encoder, BM25 and the fusion at ``alpha`` re-ranking BM25's top ``depth`` of ``queries`` dev queries."""
    import torch

    from pyterrier_prob.cli import build_parser
    from pyterrier_prob.experiments import varce
    from pyterrier_prob.experiments.harness import Harness
    from pyterrier_prob.experiments.varce_train import dev_target
    from pyterrier_prob.fusion import interpolate
    from st_extensions import load_model

    bi = load_model(teacher, device="cpu")
    out = []
    for queries, depth in settings:
        argv = ["--dataset", "irds:beir/nfcorpus", "--recipe", "partial", "--train-layers", "2", "--seed", str(seed)]
        argv += ["--dev-queries", str(queries), "--teacher", teacher, "--output", "outputs/distill-targets", "--quiet"]
        cfg = varce.config_from_args(build_parser("varce").parse_args(argv))
        h = Harness("varce", cfg)
        tg = dev_target(cfg, h, h.load_data(calibrate=True), depth)
        cand = tg.candidates(h, tg.topics, depth)
        with torch.no_grad():
            q = bi.encode(cand["query"].tolist(), normalize_embeddings=True, batch_size=64)
            d = bi.encode(cand["text"].tolist(), normalize_embeddings=True, batch_size=64)
        cand["dense"] = (q * d).sum(1)
        systems = {"BM25": cand["score"], "bi-encoder": cand["dense"]}
        systems["fused teacher"] = interpolate(cand["qid"], cand["score"], cand["dense"], alpha)
        per = {n: distill.ndcg_at_10(cand.assign(s=np.asarray(s)), tg.qrels, "s", qids=tg.topics["qid"]) for n, s in
               systems.items()}  # fmt: skip
        row = {"dev_queries": len(tg.topics), "depth": depth, **{n: float(v.mean()) for n, v in per.items()}}
        row["fused_minus_bi"] = row["fused teacher"] - row["bi-encoder"]
        row["p_fused_vs_bi"] = paired_p(per["fused teacher"], per["bi-encoder"])
        row["ci95_fused_minus_bi"] = paired_ci(per["fused teacher"], per["bi-encoder"])
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--output", required=True, help="a varce --teacher run's folder (its cached teacher pools)")
    ap.add_argument("--teacher", required=True, help="the teacher bi-encoder's folder")
    ap.add_argument("--scale", type=float, default=10.0, help="the students' cosine scale (--score-scale)")
    ap.add_argument("--rows", type=int, default=20, help="sampled pairs per query")
    ap.add_argument("--dev", nargs="*", default=["100:30", "150:100", "100000:100"], help="QUERIES:DEPTH settings")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=RESULT)
    a = ap.parse_args(argv)
    pools = sorted(glob.glob(os.path.join(a.output, "teacher", "*", "*pool-a*.parquet")))
    if not pools:
        raise SystemExit(f"no cached teacher pool under {a.output}/teacher: run pyterrier-prob varce --teacher first")
    result: dict = {"command": "python benchmarks/distill_targets.py " + " ".join(argv or sys.argv[1:]), "pools": {}}
    alpha = None
    for path in pools:
        alpha = float(re.search(r"pool-a([0-9.]+)-", os.path.basename(path)).group(1))
        result["pools"][os.path.basename(path)] = {"alpha": alpha}
        result["pools"][os.path.basename(path)] |= start_losses(pd.read_parquet(path), alpha, a.scale, a.rows, a.seed)
        print(os.path.basename(path), json.dumps(result["pools"][os.path.basename(path)]), flush=True)
    settings = [tuple(int(x) for x in s.split(":")) for s in a.dev]
    result["dev_headroom"] = dev_headroom(a.teacher, alpha, settings, a.seed)
    atomic_write(a.out, json.dumps(result, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
