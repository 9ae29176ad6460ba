"""Cross-encoder inference on CPU runtimes: torch fp32 vs ONNX Runtime and OpenVINO, fp32 and int8.

Each ``--model NAME=PATH`` (a saved plain cross-encoder or VarCrossEncoder, e.g. ``CE=...`` and ``VarCE-VAR=...``)
is loaded with :func:`st_extensions.cross_encoder.load_cross_encoder` on every (backend, precision) of ``--configs``
(default: torch fp32, onnx fp32, onnx int8, openvino fp32, openvino int8); one that cannot be had here (a missing
extra, an export that fails) is a row with ``skipped`` saying why. The first load on a backend exports the backbone
into the model folder (not timed).

The pairs are BM25's top ``--depth`` (PISA) for ``--queries`` seeded test queries of ``--dataset`` (default all), the
same pairs for every model and configuration. What is measured:

* effectiveness: every configuration scores all the pairs once (this is also its warm-up); the re-ranked run's
  nDCG@10 (ir_measures, judged test queries; per query in the JSON) and its relative change against torch fp32 of the
  same model on the same queries, with the paired t-test's p and the 95% interval of the per-query difference, and how
  closely the scores follow torch fp32's (Spearman, largest difference; for a VarCrossEncoder the expected score
  E[s] ranks, Eq. 22, and std[s], Eq. 23, is compared as well);
* speed: the first ``--max-pairs`` pairs (default all) are scored ``--repeats`` times, every configuration of every
  model once per round, in rotating order (interleaved, so that a slow phase of the machine hits all of them alike);
  pairs/s is the median over rounds, and the speedup the median over rounds of torch fp32's time / the
  configuration's time in the same round.

Scoring is what the re-ranker runs: ``predict`` with logits for a plain cross-encoder, ``predict(return_std=True)``
for a VarCrossEncoder, batches of ``--batch-size``. All runtimes get ``--threads`` intra-op threads (torch too). The
OpenVINO int8 export is calibrated (once; it is kept in the model folder) on ``--calibration-pairs`` BM25 pairs of
seeded training queries (another split than the one measured).

    python benchmarks/ce_inference.py --model CE=PATH --model VarCE-VAR=PATH [--dataset irds:beir/nfcorpus]
        [--queries N] [--depth 20] [--repeats 5] [--max-pairs N] [--threads T] [--out benchmarks/results/...]
    python benchmarks/ce_inference.py --table benchmarks/results/ce_inference.json   # its table, no measurement
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import re
import shlex
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _machine import describe, write_result  # noqa: E402

CONFIGS = ("torch:fp32", "onnx:fp32", "onnx:int8", "openvino:fp32", "openvino:int8")
BASELINE = ("torch", "fp32")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")


def parse_models(specs: list[str]) -> dict[str, str]:
    models: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--model takes NAME=PATH, got {spec!r}")
        if name in models:
            raise ValueError(f"--model name {name!r} given twice")
        if not os.path.isdir(path):
            raise ValueError(f"--model {name}: {path!r} is not a folder")
        models[name] = os.path.abspath(path)
    return models


def parse_configs(text: str) -> list[tuple[str, str]]:
    configs = []
    for item in text.split(","):
        backend, sep, precision = item.strip().partition(":")
        if not sep:
            raise ValueError(f"--configs takes backend:precision items, got {item!r}")
        configs.append((backend, precision))
    if BASELINE not in configs:
        configs.insert(0, BASELINE)  # every ratio is against torch fp32 measured in the same run
    return configs


def bm25_candidates(coll: Any, topics: Any, depth: int, index_dir: str) -> Any:
    """BM25's top ``depth`` (PISA, built once under ``index_dir``; its log beside it) with ``query`` and ``text``."""
    from pyterrier_pisa import PisaIndex

    from pyterrier_prob.console import native_output_to

    index = PisaIndex(index_dir, text_field="text", threads=2)
    log = f"{index_dir.rstrip(os.sep)}.log"
    os.makedirs(os.path.dirname(os.path.abspath(index_dir)), exist_ok=True)
    with native_output_to(log, fds=(1, 2)):  # PISA prints its progress natively
        if not index.built():
            index.index(coll.corpus_iter())
        run = index.bm25(num_results=depth)(topics[["qid", "query"]])
    texts = coll.doc_texts(set(run["docno"]))
    run = run[run["docno"].isin(texts)].reset_index(drop=True)
    return run.assign(text=[texts[d] for d in run["docno"]])


def load_pairs(a: argparse.Namespace) -> dict[str, Any]:
    """The measured test pairs, their qrels, and the calibration pairs of another split."""
    from pyterrier_prob.collections import load_collection

    coll = load_collection(a.dataset)
    index_dir = a.index or os.path.join(os.path.expanduser("~/.cache/pyterrier-prob/ce_inference"), _slug(coll.name))
    qrels = coll.qrels(a.split)
    topics = coll.topics(a.split)
    topics = topics[topics["qid"].isin(set(qrels["qid"]))].reset_index(drop=True)
    topics["query"] = [" ".join(str(q).split()) for q in topics["query"]]
    if a.queries is not None and a.queries < len(topics):
        picked = sorted(random.Random(a.seed).sample(range(len(topics)), a.queries))
        topics = topics.iloc[picked].reset_index(drop=True)
    cand = bm25_candidates(coll, topics, a.depth, index_dir)
    calibration: list[tuple[str, str]] = []
    calibration_source = None
    others = [s for s in ("train", "dev", "validation") if s in coll.splits and s != a.split]
    if a.calibration_pairs > 0 and others:
        calibration_source = others[0]
        cal_topics = coll.topics(calibration_source)
        cal_topics["query"] = [" ".join(str(q).split()) for q in cal_topics["query"]]
        n_queries = min(len(cal_topics), math.ceil(a.calibration_pairs / a.depth))
        rows = sorted(random.Random(a.seed + 1).sample(range(len(cal_topics)), n_queries))
        cal = bm25_candidates(coll, cal_topics.iloc[rows].reset_index(drop=True), a.depth, index_dir)
        calibration = list(zip(cal["query"], cal["text"]))[: a.calibration_pairs]
    return {
        "collection": coll.name,
        "candidates": cand,
        "qrels": qrels[qrels["qid"].isin(set(topics["qid"]))],
        "queries": len(topics),
        "calibration": calibration,
        "calibration_split": calibration_source,
        "index": index_dir,
    }


def score(model: Any, pairs: list[tuple[str, str]], batch_size: int) -> tuple[np.ndarray, np.ndarray | None]:
    """What the re-ranker runs: (E[s], std[s]) for a VarCrossEncoder, (logits, None) for a plain one."""
    import torch

    from st_extensions.cross_encoder import VarCrossEncoder

    if isinstance(model, VarCrossEncoder):
        mean, std = model.predict(pairs, batch_size=batch_size, return_std=True, show_progress_bar=False)
        return np.asarray(mean, np.float64), np.asarray(std, np.float64)
    logits = model.predict(pairs, batch_size=batch_size, activation_fn=torch.nn.Identity(), show_progress_bar=False)
    return np.asarray(logits, np.float64), None


def ndcg10(cand: Any, scores: np.ndarray, qrels: Any) -> float:
    """The run's nDCG@10 (ir_measures' aggregate over the judged queries)."""
    import ir_measures
    from ir_measures import nDCG

    run = cand[["qid", "docno"]].rename(columns={"qid": "query_id", "docno": "doc_id"}).assign(score=scores)
    qrels = qrels.rename(columns={"qid": "query_id", "docno": "doc_id", "label": "relevance"})
    return float(ir_measures.calc_aggregate([nDCG @ 10], qrels, run)[nDCG @ 10])


def ndcg10_per_query(cand: Any, scores: np.ndarray, qrels: Any) -> dict[str, float]:
    """The run's nDCG@10 per judged query (ir_measures), for the paired test against torch fp32."""
    import ir_measures
    from ir_measures import nDCG

    run = cand[["qid", "docno"]].rename(columns={"qid": "query_id", "docno": "doc_id"}).assign(score=scores)
    qrels = qrels.rename(columns={"qid": "query_id", "docno": "doc_id", "label": "relevance"})
    return {m.query_id: float(m.value) for m in ir_measures.iter_calc([nDCG @ 10], qrels, run)}


def export_record(path: str, backend: str, precision: str) -> dict | None:
    """What ``export_info.json`` says of the export a configuration ran (calibration, exporter)."""
    from st_extensions.cross_encoder.backends import FILES, INFO_FILE

    rel = FILES.get((backend, precision))
    if rel is None:
        return None
    folder, name = os.path.split(os.path.join(path, rel))
    try:
        with open(os.path.join(folder, INFO_FILE), encoding="utf8") as f:
            record = json.load(f).get(name)
    except (OSError, json.JSONDecodeError):
        return None
    return {k: v for k, v in (record or {}).items() if k not in ("weights_stat",)} or None


def _spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    from scipy.stats import spearmanr

    if len(a) < 2 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return None
    return float(spearmanr(a, b)[0])


BACKEND_NAMES = {"torch": "torch", "onnx": "ONNX Runtime", "openvino": "OpenVINO"}


def _precision_label(row: dict, settings: dict) -> str:
    if row["precision"] != "int8":
        return row["precision"]
    if row["backend"] == "onnx":
        return "int8 (dynamic, int8 weights)"
    given, split = settings.get("calibration_pairs_given"), settings.get("calibration_split")
    return f"int8 (NNCF, calibrated on {given} {split} pairs)"


def table(result: dict) -> list[str]:
    """The docs' table of a results file: per model (a column when there are several) and configuration, pairs/s,
    the speedup over torch fp32 (median, min–max over rounds), nDCG@10, its relative change and the paired t-test's p
    against torch fp32 (— where the file has no per-query values)."""
    from pyterrier_prob.experiments.report import MISSING, cell

    several = len({r["model"] for r in result["rows"]}) > 1
    head = [
        "backend",
        "precision",
        "pairs/s",
        "× torch fp32 (min–max over rounds)",
        "nDCG@10",
        "change",
        "p vs torch fp32",
    ]
    head = ["model", *head] if several else head
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in result["rows"]:
        cells = [BACKEND_NAMES.get(row["backend"], row["backend"]), _precision_label(row, result["settings"])]
        if row.get("skipped"):
            cells += [MISSING] * 5
        else:
            speed, span = row["speedup_vs_torch_fp32"], row.get("speedup_min_max")
            speed_cell = cell(speed, ".2f") + (f" ({span[0]:.2f}–{span[1]:.2f})" if span else "")
            change = row["ndcg10_rel_change"]
            cells += [cell(row["pairs_per_s"], ".1f"), speed_cell, cell(row["ndcg10"], ".4f"), cell(change, "+.2%")]
            cells.append(cell(row.get("ndcg10_p_vs_torch_fp32"), ".2g"))
        lines.append("| " + " | ".join([row["model"], *cells] if several else cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="NAME=PATH of a saved CE / VarCE (repeatable; required)")
    ap.add_argument("--table", metavar="JSON", help="print the table of a results file (no measurement) and stop")
    ap.add_argument("--dataset", default="irds:beir/nfcorpus", help="collection (pyterrier_prob.collections spec)")
    ap.add_argument("--split", default="test", help="the split whose queries are measured")
    ap.add_argument("--queries", type=int, default=None, help="seeded sample of this many queries (default all)")
    ap.add_argument("--depth", type=int, default=20, help="BM25 candidates per query")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--max-pairs", type=int, default=None, help="time the first N pairs only (default all)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None, help="intra-op threads of every runtime (default: torch's)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="backend:precision items (torch:fp32 always runs)")
    ap.add_argument("--calibration-pairs", type=int, default=300, help="OpenVINO int8 calibration pairs (train)")
    ap.add_argument("--index", default=None, help="PISA index folder (default ~/.cache/pyterrier-prob/ce_inference)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/ce_inference.json")
    a = ap.parse_args(argv)
    if a.table:
        from pyterrier_prob.experiments.report import print_json_table

        print_json_table(a.table, table)
        return {}
    if not a.model:
        ap.error("--model NAME=PATH is required (or --table JSON to print a results file)")
    command = shlex.join(sys.orig_argv if argv is None else ["python", __file__, *argv])
    for name in ("depth", "repeats", "batch_size"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("queries", "max_pairs", "threads"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        models = parse_models(a.model)
        configs = parse_configs(a.configs)
    except ValueError as e:
        ap.error(str(e))

    import pandas as pd
    import torch
    from transformers.utils import logging as hf_logging

    from pyterrier_prob.evaluation import paired_ci, paired_p
    from pyterrier_prob.experiments.report import cell
    from st_extensions.cross_encoder import load_cross_encoder

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # "Loading weights" of every load
    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)
    threads = a.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    machine = describe()
    print(json.dumps(machine), flush=True)

    data = load_pairs(a)
    cand = data["candidates"]
    pairs = list(zip(cand["query"], cand["text"]))
    timed = pairs[: a.max_pairs] if a.max_pairs else pairs
    print(
        f"{data['queries']} {data['collection']}/{a.split} queries, {len(pairs)} BM25 pairs (depth {a.depth}); timing "
        f"{len(timed)} pairs x {a.repeats} rounds; {threads} threads",
        flush=True,
    )
    bm25_ndcg = ndcg10(cand, cand["score"].to_numpy(np.float64), data["qrels"])

    loaded: dict[tuple[str, str, str], Any] = {}
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    full: dict[tuple[str, str, str], tuple[np.ndarray, np.ndarray | None]] = {}
    for name, path in models.items():
        for backend, precision in configs:
            key = (name, backend, precision)
            row = {
                "model": name,
                "path": path,
                "backend": backend,
                "precision": precision,
                "pairs_per_s": None,
                "speedup_vs_torch_fp32": None,
                "ndcg10_rel_change": None,
                "ndcg10": None,
                "pairs": len(timed),
                "threads": threads,
            }
            rows[key] = row
            t0 = time.perf_counter()
            try:
                model = load_cross_encoder(
                    path, backend, precision, num_threads=threads, calibration_pairs=data["calibration"] or None
                )
            except Exception as e:  # noqa: BLE001 - a configuration that cannot run here is a row saying why
                row["skipped"] = f"{type(e).__name__}: {e}"
                print(f"  {name} {backend} {precision}: skipped ({row['skipped']})", flush=True)
                continue
            row["load_s"] = time.perf_counter() - t0
            row["export"] = export_record(path, backend, precision)
            row["model_class"] = type(model).__name__
            loaded[key] = model
            t0 = time.perf_counter()
            full[key] = score(model, pairs, a.batch_size)  # effectiveness, and the warm-up
            row["scored_pairs"] = len(pairs)
            row["score_all_s"] = time.perf_counter() - t0
            row["ndcg10"] = ndcg10(cand, full[key][0], data["qrels"])
            row["ndcg10_per_query"] = ndcg10_per_query(cand, full[key][0], data["qrels"])
            print(
                f"  {name} {backend} {precision}: nDCG@10 {row['ndcg10']:.4f} ({row['score_all_s']:.1f} s)", flush=True
            )

    for key, row in rows.items():
        base = (key[0], *BASELINE)
        if key not in full or base not in full:
            continue
        ref_mean, ref_std = full[base]
        mean, std = full[key]
        ref_ndcg = rows[base]["ndcg10"]
        row["ndcg10_rel_change"] = (row["ndcg10"] - ref_ndcg) / ref_ndcg if ref_ndcg else None
        ours, ref = pd.Series(row["ndcg10_per_query"]), pd.Series(rows[base]["ndcg10_per_query"])
        row["ndcg10_p_vs_torch_fp32"] = None if key == base else paired_p(ours, ref)  # paired t-test over the queries
        row["ndcg10_ci95_vs_torch_fp32"] = None if key == base else paired_ci(ours, ref)
        row["score_spearman_vs_torch_fp32"] = _spearman(ref_mean, mean)
        row["score_max_abs_diff_vs_torch_fp32"] = float(np.abs(ref_mean - mean).max()) if len(mean) else None
        if std is not None and ref_std is not None:
            row["std_spearman_vs_torch_fp32"] = _spearman(ref_std, std)
            row["std_max_abs_diff_vs_torch_fp32"] = float(np.abs(ref_std - std).max()) if len(std) else None

    order = list(loaded)
    times: dict[tuple[str, str, str], list[float]] = {k: [] for k in order}
    for r in range(a.repeats):
        for key in order[r % len(order) :] + order[: r % len(order)]:
            t0 = time.perf_counter()
            score(loaded[key], timed, a.batch_size)
            times[key].append(time.perf_counter() - t0)
        print(f"  round {r + 1}/{a.repeats} done", flush=True)
    for key in order:
        row = rows[key]
        row["seconds"] = times[key]
        row["seconds_median"] = statistics.median(times[key])
        row["pairs_per_s"] = len(timed) / row["seconds_median"] if row["seconds_median"] > 0 else None
        base = (key[0], *BASELINE)
        if base in times:
            ratios = [b / t for b, t in zip(times[base], times[key]) if t > 0]
            row["speedup_vs_torch_fp32"] = statistics.median(ratios) if ratios else None
            row["speedup_min_max"] = [min(ratios), max(ratios)] if ratios else None

    result = {
        "machine": machine,
        "settings": {
            **vars(a),
            "threads": threads,
            "collection": data["collection"],
            "queries_measured": data["queries"],
            "pairs_total": len(pairs),
            "pairs_timed": len(timed),
            "bm25_ndcg10": bm25_ndcg,
            "calibration_split": data["calibration_split"],
            "calibration_pairs_given": len(data["calibration"]),
            "pisa_index": data["index"],
            "libraries": _versions(),
        },
        "command": command,
        "rows": list(rows.values()),
    }
    write_result(a.out, result)
    print(
        f"\nCross-encoder inference ({data['collection']}/{a.split}: {data['queries']} queries, BM25 top {a.depth}, "
        f"BM25 nDCG@10 {bm25_ndcg:.4f}; {len(timed)} timed pairs, batch {a.batch_size}, {threads} threads, "
        f"{a.repeats} interleaved rounds)"
    )
    for row in rows.values():
        label = f"  {row['model']:14s} {row['backend']:9s} {row['precision']:5s}"
        if row.get("skipped"):
            print(f"{label} skipped: {row['skipped'][:160]}")
            continue
        speed = row["speedup_vs_torch_fp32"]
        change = row["ndcg10_rel_change"]
        print(
            f"{label} {row['pairs_per_s']:8.1f} pairs/s  x{speed:.2f} vs torch fp32  nDCG@10 {row['ndcg10']:.4f} "
            f"({change:+.2%}, p {cell(row.get('ndcg10_p_vs_torch_fp32'), '.2g')})"
            if speed is not None and change is not None
            else f"{label} {row['pairs_per_s']:8.1f} pairs/s  nDCG@10 {row['ndcg10']:.4f}"
        )
    print(f"wrote {a.out}")
    return result


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "sentence-transformers", "transformers", "onnxruntime", "onnx", "openvino", "nncf"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


if __name__ == "__main__":
    main()
