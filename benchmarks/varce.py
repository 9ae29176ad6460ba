"""VarCrossEncoder (issue #5, ``shared/papers/var-cross-encoder.md``) against a plain CrossEncoder, end to end.

Three re-rankers are fine-tuned from the packaged all-MiniLM-L6-v2 on the same nfcorpus/train data with the same
budget (steps, batch size, learning rate, warm-up, seed, max_seq_length):

* ``CE``: sentence-transformers' ``CrossEncoder`` (num_labels=1) with ``BinaryCrossEntropyLoss``;
* ``VarCE-MEANVAR`` and ``VarCE-VAR``: ``build_var_cross_encoder(variant=...)`` with ``VariationalBCELoss``
  (beta=1e-7, one Monte Carlo sample; Eq. 10, 17-21).

Training data: nfcorpus/train queries (a seeded sample, each used once), each with one judged-relevant document
(label 1) and ``--negatives`` documents drawn from its BM25 top-30 minus its judged documents (label 0); the
paper's 1:4 positive:negative ratio is scaled to 1:3 to fill batches of 16 with whole groups.

Then, for each collection, BM25 (PISA) candidates are re-ranked by each model and compared in ``pt.Experiment``
(nDCG@10, RR@10 = MRR@10, paired t-test against CE): nfcorpus/test in-domain; scifact/test, cranfield and
vaswani out-of-domain. Also reported:

* the robustness table (paper Table 4): the six one-word query perturbations of ``pyterrier_prob.varce.noise`` on a
  seeded subset of nfcorpus/test queries; BM25 retrieves with the perturbed query too, so the table measures the
  whole pipeline; nDCG@10 and its drop against the clean queries (same queries, same depth);
* the hard-query table (paper Table 8): the bottom 50 % of queries under CE's nDCG@10 (the paper's choice) and,
  for reference, under BM25's; %no = share of queries with no relevant document in the top 10;
* is the uncertainty informative? per collection, Spearman's rho between each query's mean score_std over its
  top 10 and its nDCG@10 (with the same for the mean score, a plain score-based predictor, for reference), and
  nDCG@10 / RR@10 when ranking by the risk-adjusted E[s] - risk * std[s] for risk in {0, 0.5, 1, 2};
* inference time of each VarCrossEncoder relative to the CrossEncoder, interleaved in this run on the same pairs
  (``predict``; VarCE with ``return_std=True``), median of per-repeat ratios (target <= 1.05).

Every re-ranker scores each distinct (query, document) pair once (a per-model cache), so the clean robustness
run and the risk sweep reuse the main run's scores.

    python benchmarks/varce.py [--steps 150 --nfcorpus-depth 100 --queries-per-collection 60 --depth 20]
    python benchmarks/varce.py --quick   # minutes: a smoke test of the whole pipeline
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _machine import describe  # noqa: E402

COLLECTIONS = {  # name: (collection with the documents, split with the test topics and qrels)
    "nfcorpus": ("irds:beir/nfcorpus", "irds:beir/nfcorpus/test"),
    "scifact": ("irds:beir/scifact", "irds:beir/scifact/test"),
    "cranfield": ("irds:cranfield", "irds:cranfield"),
    "vaswani": ("irds:vaswani", "irds:vaswani"),
}
TRAIN = "beir/nfcorpus/train"
MODELS = ("CE", "VarCE-MEANVAR", "VarCE-VAR")
VAR_MODELS = ("VarCE-MEANVAR", "VarCE-VAR")
BASELINE = "CE"
RISKS = (0.0, 0.5, 1.0, 2.0)
NOISE_ORDER = ("RD", "RS", "SE", "SR", "WEI", "WES")

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def measures() -> list:
    from ir_measures import RR, nDCG

    return [nDCG @ 10, RR @ 10]


def norm(text: str) -> str:
    return " ".join(str(text).split())


@contextlib.contextmanager
def native_output_to(path: str) -> Iterator[None]:
    """Send file descriptors 1 and 2 to ``path`` for the duration: PISA's C++ progress lines (index
    building, and the index compression on the first query) would flood the log otherwise
    (``pyterrier_prob.experiments.pebr._stderr_to`` does the same for descriptor 2 only)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(path, "ab") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, dup in zip((1, 2), saved):
            os.dup2(dup, fd)
            os.close(dup)


# --------------------------------------------------------------------------------------------------------------
# data and BM25
# --------------------------------------------------------------------------------------------------------------


class Collection:
    """Documents, BM25 index, evaluated topics and qrels of one collection."""

    def __init__(self, name: str, workdir: str, n_queries: int | None, seed: int) -> None:
        from pyterrier_pisa import PisaIndex

        from pyterrier_prob.experiments.pebr import corpus_iter, load_qrels, load_topics

        docs_id, test_id = COLLECTIONS[name]
        self.name = name
        self.docs = {d["docno"]: d["text"] for d in corpus_iter(docs_id)}
        qrels = load_qrels(test_id)
        qrels["label"] = qrels["label"].clip(lower=0)  # cranfield's -1 ("no interest") is non-relevant
        self.qrels = qrels
        topics = load_topics(test_id)
        topics["query"] = topics["query"].map(norm)
        relevant = set(qrels.loc[qrels["label"] >= 1, "qid"].astype(str))
        topics = topics[topics["qid"].astype(str).isin(relevant)]
        self.n_all = len(topics)
        if n_queries is not None and n_queries < len(topics):
            topics = topics.sample(n=n_queries, random_state=seed)
        self.topics = topics.sort_values("qid").reset_index(drop=True)
        self.log_path = os.path.join(workdir, "indexes", f"{name}.pisa.log")
        path = os.path.join(workdir, "indexes", f"{name}.pisa")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.index = PisaIndex(path, text_field="text", threads=2)
        if not self.index.built():
            self.index = PisaIndex(path, text_field="text", threads=2, overwrite=True)
            with native_output_to(self.log_path):
                self.index.index({"docno": d, "text": t} for d, t in self.docs.items())

    def bm25(self, topics: pd.DataFrame, depth: int) -> pd.DataFrame:
        """BM25 top ``depth`` for ``topics`` (qid, query) with the query and document text attached."""
        with native_output_to(self.log_path):
            res = self.index.bm25(num_results=depth)(topics[["qid", "query"]])
        res = res[["qid", "docno", "score", "rank"]].merge(topics[["qid", "query"]], on="qid")
        res["text"] = res["docno"].map(self.docs).fillna("")
        return res.sort_values(["qid", "rank"]).reset_index(drop=True)


def training_data(nf: Collection, n_groups: int, negatives: int, seed: int) -> tuple[Any, dict]:
    """(query, document, label) rows: per sampled nfcorpus/train query one positive and ``negatives`` BM25
    negatives (its BM25 top-30 minus its judged documents; random unjudged documents if that runs short)."""
    import ir_datasets
    from datasets import Dataset

    ds = ir_datasets.load(TRAIN)
    queries = {q.query_id: norm(q.text) for q in ds.queries_iter()}
    judged: dict[str, set[str]] = defaultdict(set)
    relevant: dict[str, set[str]] = defaultdict(set)
    for r in ds.qrels_iter():
        judged[r.query_id].add(r.doc_id)
        if r.relevance >= 1 and r.doc_id in nf.docs:
            relevant[r.query_id].add(r.doc_id)
    qids = sorted(q for q in relevant if q in queries and queries[q])
    rng = random.Random(seed)
    rng.shuffle(qids)
    picked = [qids[i % len(qids)] for i in range(n_groups)]
    uniq = list(dict.fromkeys(picked))
    bm = nf.bm25(pd.DataFrame({"qid": uniq, "query": [queries[q] for q in uniq]}), 30)
    pools = bm.groupby("qid")["docno"].apply(list).to_dict()
    all_docs = sorted(nf.docs)
    rows: dict[str, list] = {"query": [], "document": [], "label": []}
    n_random = 0
    for q in picked:
        pos = rng.choice(sorted(relevant[q]))
        pool = [d for d in pools.get(q, []) if d not in judged[q]]
        negs = rng.sample(pool, min(negatives, len(pool)))
        while len(negs) < negatives:
            d = rng.choice(all_docs)
            if d not in judged[q] and d not in negs:
                negs.append(d)
                n_random += 1
        for d, y in [(pos, 1.0)] + [(d, 0.0) for d in negs]:
            rows["query"].append(queries[q])
            rows["document"].append(nf.docs[d])
            rows["label"].append(y)
    info = {
        "train_split": TRAIN,
        "queries": len(uniq),
        "groups": n_groups,
        "pairs": len(rows["label"]),
        "positives_per_group": 1,
        "negatives_per_group": negatives,
        "negatives": "BM25 top-30 of the query minus its judged documents",
        "random_negatives_filled_in": n_random,
    }
    return Dataset.from_dict(rows), info


# --------------------------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------------------------


def build(name: str, max_seq_length: int, seed: int) -> Any:
    from sentence_transformers import CrossEncoder

    from st_extensions import default_model_path
    from st_extensions.cross_encoder import build_var_cross_encoder

    torch.manual_seed(seed)
    if name == "CE":
        return CrossEncoder(default_model_path(), num_labels=1, max_length=max_seq_length, device="cpu")
    return build_var_cross_encoder(None, variant=name.split("-")[1], max_seq_length=max_seq_length, device="cpu")


def train(name: str, model: Any, data: Any, a: argparse.Namespace) -> dict:
    from sentence_transformers.cross_encoder import CrossEncoderTrainer, CrossEncoderTrainingArguments
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

    from st_extensions.losses import VariationalBCELoss

    loss = BinaryCrossEntropyLoss(model) if name == "CE" else VariationalBCELoss(model, beta=a.beta, num_samples=1)
    with tempfile.TemporaryDirectory() as tmp:
        args = CrossEncoderTrainingArguments(
            output_dir=os.path.join(tmp, "run"),
            max_steps=a.steps,
            per_device_train_batch_size=a.batch_size,
            learning_rate=a.lr,
            warmup_steps=0.1,  # a float below 1 is a ratio of the steps (transformers >= 5)
            seed=a.seed,
            report_to="none",
            save_strategy="no",
            logging_steps=max(1, a.steps // 10),
            use_cpu=True,
            dataloader_drop_last=True,
            disable_tqdm=True,
        )
        trainer = CrossEncoderTrainer(model=model, args=args, train_dataset=data, loss=loss)
        t0 = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - t0
    losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
    model.eval()
    return {"seconds": round(seconds, 1), "s_per_step": round(seconds / a.steps, 3), "logged_loss": losses}


def load_or_train(name: str, data: Any, a: argparse.Namespace) -> tuple[Any, dict | None]:
    from sentence_transformers import CrossEncoder

    from st_extensions import load_model

    path = os.path.join(a.workdir, "models", name)
    info_path = os.path.join(path, "train_info.json")
    settings = {k: getattr(a, k) for k in ("steps", "batch_size", "negatives", "lr", "beta", "max_seq_length", "seed")}
    if a.reuse and os.path.isfile(os.path.join(path, "modules.json")):
        info = None
        if os.path.isfile(info_path):
            with open(info_path) as f:
                info = json.load(f)
            if info.get("settings") != settings:
                raise SystemExit(f"{path} was trained with {info.get('settings')}, not {settings}: drop --reuse")
        log(f"reusing {name} from {path} (trained by an earlier run of this script)")
        model = CrossEncoder(path, device="cpu") if name == "CE" else load_model(path, device="cpu")
        return model, (info or {}) | {"reused": True}
    model = build(name, a.max_seq_length, a.seed)
    log(f"training {name}: {a.steps} steps of {a.batch_size} pairs, lr {a.lr}, max_seq_length {a.max_seq_length}")
    info = train(name, model, data, a) | {"settings": settings}
    log(f"  {name}: {info['seconds']} s ({info['s_per_step']} s/step), loss {info['logged_loss']}")
    model.save(path)
    with open(info_path, "w") as f:
        json.dump(info, f, indent=2)
    scores = os.path.join(a.workdir, "scores", f"{name}.tsv")
    if os.path.exists(scores):  # scores of an earlier model of this name
        os.remove(scores)
    return model, info | {"reused": False}


class Scorer:
    """Scores (query, document) pairs with one model, each distinct pair once; keeps the time it spent.

    CE: ``CrossEncoder.predict`` logits (no sigmoid), std NaN. VarCE: ``VarCrossEncoderReranker`` (risk 0),
    whose ``score_mean`` = E[s] (Eq. 22) and ``score_std`` = sqrt(W^T Sigma W) (Eq. 23) are kept.
    """

    def __init__(self, name: str, model: Any, batch_size: int, cache_path: str) -> None:
        from pyterrier_prob.varce.rerank import VarCrossEncoderReranker

        self.name, self.model, self.batch_size = name, model, batch_size
        self.var = name != "CE"
        self.reranker = VarCrossEncoderReranker(model, batch_size=batch_size, verbose=False) if self.var else None
        self.cache: dict[tuple[str, str], tuple[float, float]] = {}
        self.seconds = 0.0
        self.pairs = 0
        # Scores are appended to cache_path as they come (a killed run resumes with --reuse); the file is
        # removed whenever the model is trained again. Queries are whitespace-normalised: no tab, no newline.
        self.cache_path = cache_path
        os.makedirs(os.path.dirname(cache_path), exist_ok=True)
        if os.path.isfile(cache_path):
            with open(cache_path, encoding="utf8") as f:
                for line in f:
                    q, d, m, s = line.rstrip("\n").split("\t")
                    self.cache[(q, d)] = (float(m), float(s))
        self.loaded = len(self.cache)

    def score(self, cand: pd.DataFrame, chunk: int = 1024) -> tuple[np.ndarray, np.ndarray]:
        keys = list(zip(cand["query"], cand["docno"]))
        todo = cand[[k not in self.cache for k in keys]].drop_duplicates(["query", "docno"])
        for start in range(0, len(todo), chunk):
            part = todo.iloc[start : start + chunk]
            t0 = time.perf_counter()
            if self.var:
                out = self.reranker(part[["qid", "query", "docno", "text"]])
                new = zip(out["query"], out["docno"], out["score_mean"], out["score_std"])
            else:
                pairs = list(zip(part["query"], part["text"]))
                mean = self.model.predict(
                    pairs, batch_size=self.batch_size, activation_fn=torch.nn.Identity(), show_progress_bar=False
                )
                new = zip(part["query"], part["docno"], mean, [math.nan] * len(part))
            lines = []
            for q, d, m, s in new:
                self.cache[(q, d)] = (float(m), float(s))
                lines.append(f"{q}\t{d}\t{float(m)!r}\t{float(s)!r}\n")
            dt = time.perf_counter() - t0
            with open(self.cache_path, "a", encoding="utf8") as f:
                f.writelines(lines)
            self.seconds += dt
            self.pairs += len(part)
            if len(todo) > chunk:
                log(
                    f"    {self.name}: {min(start + chunk, len(todo))}/{len(todo)} pairs ({len(part) / dt:.1f} pairs/s)"
                )
        vals = np.array([self.cache[k] for k in keys], dtype=np.float64).reshape(-1, 2)
        return vals[:, 0], vals[:, 1]


def ranked(cand: pd.DataFrame, mean: np.ndarray, std: np.ndarray, risk: float = 0.0) -> pd.DataFrame:
    """The candidates re-ranked by mean - risk * std (ties: BM25 order); keeps score_mean and score_std."""
    from pyterrier_prob.varce.rerank import risk_adjusted

    score = mean if risk == 0 else risk_adjusted(mean, std, risk)
    run = pd.DataFrame(
        {
            "qid": cand["qid"].to_numpy(),
            "docno": cand["docno"].to_numpy(),
            "score": score,
            "score_mean": mean,
            "score_std": std,
            "bm25_rank": cand["rank"].to_numpy(),
        }
    )
    run = run.sort_values(["qid", "score", "bm25_rank"], ascending=[True, False, True], kind="stable")
    run["rank"] = run.groupby("qid").cumcount()
    return run.reset_index(drop=True)


def bm25_run(cand: pd.DataFrame) -> pd.DataFrame:
    return cand[["qid", "docno", "score", "rank"]].copy()


# --------------------------------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------------------------------


def experiment(runs: dict[str, pd.DataFrame], topics: pd.DataFrame, qrels: pd.DataFrame, baseline: str) -> pd.DataFrame:
    import pyterrier as pt

    names = list(runs)
    return pt.Experiment(
        [r[["qid", "docno", "score", "rank"]] for r in runs.values()],
        topics[["qid", "query"]],
        qrels,
        eval_metrics=measures(),
        names=names,
        baseline=names.index(baseline),
    )


def exp_rows(exp: pd.DataFrame) -> list[dict]:
    out = []
    for _, r in exp.iterrows():
        row = {"name": r["name"]}
        for m in ("nDCG@10", "RR@10"):
            row[m] = float(r[m])
            for suffix in (" +", " -", " p-value"):
                if f"{m}{suffix}" in exp.columns and pd.notna(r[f"{m}{suffix}"]):
                    row[f"{m}{suffix}"] = float(r[f"{m}{suffix}"])
        out.append(row)
    return out


def fmt_p(p: float | None) -> str:
    if p is None or not np.isfinite(p):
        return "   -   "
    return f"{p:7.3f}" + ("*" if p < 0.05 else " ")


def per_query_ndcg(run: pd.DataFrame, coll: Collection, topics: pd.DataFrame | None = None) -> pd.Series:
    from pyterrier_prob.varce.hard_queries import per_query

    return per_query(run, coll.qrels, measures()[0], topics=coll.topics if topics is None else topics)


def uncertainty_stats(run: pd.DataFrame, ndcg: pd.Series) -> dict:
    """Spearman of per-query mean top-10 score_std (and score_mean) with nDCG@10; spread of score_std."""
    from scipy.stats import spearmanr

    top = run[run["rank"] < 10]
    u = top.groupby("qid")["score_std"].mean().reindex(ndcg.index)
    m = top.groupby("qid")["score_mean"].mean().reindex(ndcg.index)
    ok = u.notna()
    rho, p = spearmanr(u[ok], ndcg[ok]) if u[ok].nunique() > 1 else (math.nan, math.nan)
    rho_m, p_m = spearmanr(m[ok], ndcg[ok]) if m[ok].nunique() > 1 else (math.nan, math.nan)
    within = run.groupby("qid")["score_std"].agg(lambda s: s.std(ddof=0) / s.mean() if s.mean() > 0 else math.nan)
    rho_sm, _ = spearmanr(run["score_std"], run["score_mean"])
    return {
        "n_queries": int(ok.sum()),
        "spearman_top10_std_vs_ndcg10": {"rho": float(rho), "p": float(p)},
        "spearman_top10_mean_score_vs_ndcg10": {"rho": float(rho_m), "p": float(p_m)},
        "score_std_quantiles_5_50_95": [float(x) for x in np.quantile(run["score_std"], [0.05, 0.5, 0.95])],
        "score_std_within_query_cv_median": float(np.nanmedian(within)),
        "spearman_pairs_std_vs_mean": float(rho_sm),
    }


def inference_time(models: dict[str, Any], pairs: list[tuple[str, str]], repeats: int, batch_size: int) -> dict:
    """Interleaved predict() timings on the same pairs (rotating order); median of per-repeat ratios to CE."""

    def run(name: str, subset: list) -> None:
        if name == "CE":
            models[name].predict(subset, batch_size=batch_size, activation_fn=torch.nn.Identity())
        else:
            models[name].predict(subset, batch_size=batch_size, return_std=True)

    names = list(models)
    for n in names:  # warm-up
        run(n, pairs[:batch_size])
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            run(n, pairs)
            times[n].append(time.perf_counter() - t0)
    ratios = {n: [t / c for t, c in zip(times[n], times[BASELINE])] for n in names}
    return {
        "pairs": len(pairs),
        "repeats": repeats,
        "batch_size": batch_size,
        "seconds_median": {n: statistics.median(t) for n, t in times.items()},
        "pairs_per_s_median": {n: len(pairs) / statistics.median(t) for n, t in times.items()},
        "ratio_vs_CE_median_of_repeats": {n: statistics.median(v) for n, v in ratios.items()},
        "ratio_vs_CE_min_max": {n: [min(v), max(v)] for n, v in ratios.items()},
        "ratio_vs_CE_total_time": {n: sum(times[n]) / sum(times[BASELINE]) for n in names},
        "target": "VarCrossEncoder / CrossEncoder <= 1.05",
    }


# --------------------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150, help="training steps (same for all three models)")
    ap.add_argument("--batch-size", type=int, default=16, help="pairs per training step")
    ap.add_argument("--negatives", type=int, default=3, help="BM25 negatives per positive")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--beta", type=float, default=1e-7, help="VariationalBCELoss beta")
    ap.add_argument("--max-seq-length", type=int, default=128, help="tokens of query + document, train and test")
    ap.add_argument("--nfcorpus-queries", type=int, default=None, help="cap on nfcorpus/test queries (all: 323)")
    ap.add_argument("--nfcorpus-depth", type=int, default=100, help="BM25 depth re-ranked on nfcorpus/test")
    ap.add_argument("--queries-per-collection", type=int, default=60, help="seeded cap per OOD collection")
    ap.add_argument("--depth", type=int, default=20, help="BM25 depth re-ranked on the OOD collections")
    ap.add_argument("--robust-queries", type=int, default=40, help="nfcorpus/test queries in the robustness table")
    ap.add_argument("--robust-depth", type=int, default=20, help="BM25 depth re-ranked in the robustness table")
    ap.add_argument("--timing-pairs", type=int, default=128)
    ap.add_argument("--timing-repeats", type=int, default=5)
    ap.add_argument("--inference-batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="models and indexes (default outputs/varce[-quick])")
    ap.add_argument("--reuse", action="store_true", help="reuse models saved in --workdir by an earlier run")
    ap.add_argument("--out", default=None, help="result JSON (default benchmarks/results/varce.json)")
    ap.add_argument("--quick", action="store_true", help="tiny smoke-test sizes (result to /tmp)")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.max_seq_length = min(a.steps, 8), min(a.max_seq_length, 128)
        a.nfcorpus_queries, a.nfcorpus_depth = 12, 10
        a.queries_per_collection, a.depth = 8, 10
        a.robust_queries, a.robust_depth = 6, 10
        a.timing_pairs, a.timing_repeats = 32, 2
    a.workdir = a.workdir or ("outputs/varce-quick" if a.quick else "outputs/varce")
    a.out = a.out or ("/tmp/varce-quick.json" if a.quick else "benchmarks/results/varce.json")
    if a.batch_size % (1 + a.negatives):
        ap.error(f"--batch-size ({a.batch_size}) must be a multiple of 1 + --negatives ({1 + a.negatives})")
    if a.robust_depth > a.nfcorpus_depth:
        ap.error("--robust-depth must not exceed --nfcorpus-depth (the clean run reuses the nfcorpus candidates)")
    return a


def main() -> None:
    from pyterrier_prob.varce.hard_queries import hard_query_table
    from pyterrier_prob.varce.noise import all_noise

    a = parse_args()
    torch.manual_seed(a.seed)
    machine = describe()
    log(f"machine: {json.dumps(machine)}")
    log(f"settings: {json.dumps({k: v for k, v in vars(a).items()})}")
    timings: dict[str, float] = {}

    # ---- collections and BM25 ------------------------------------------------------------------------------------
    t = time.perf_counter()
    caps = {"nfcorpus": a.nfcorpus_queries} | {n: a.queries_per_collection for n in COLLECTIONS if n != "nfcorpus"}
    colls = {}
    for name in COLLECTIONS:
        colls[name] = Collection(name, a.workdir, caps[name], a.seed)
        log(f"{name}: {len(colls[name].docs)} docs, {len(colls[name].topics)}/{colls[name].n_all} evaluated queries")
    timings["load_and_index"] = time.perf_counter() - t

    # ---- training ------------------------------------------------------------------------------------------------
    t = time.perf_counter()
    n_groups = a.steps * a.batch_size // (1 + a.negatives)
    data, data_info = training_data(colls["nfcorpus"], n_groups, a.negatives, a.seed)
    log(f"training data: {json.dumps(data_info)}")
    models, train_info = {}, {}
    for name in MODELS:
        models[name], train_info[name] = load_or_train(name, data, a)
    timings["training"] = time.perf_counter() - t
    scorers = {
        n: Scorer(n, m, a.inference_batch_size, os.path.join(a.workdir, "scores", f"{n}.tsv"))
        for n, m in models.items()
    }
    for sc in scorers.values():
        if sc.loaded:
            log(f"{sc.name}: {sc.loaded} pair scores from an earlier run of this model ({sc.cache_path})")

    # ---- effectiveness -------------------------------------------------------------------------------------------
    depth = {n: (a.nfcorpus_depth if n == "nfcorpus" else a.depth) for n in COLLECTIONS}
    cands, runs, effectiveness, exps = {}, {}, {}, {}
    for name, coll in colls.items():
        t = time.perf_counter()
        cand = coll.bm25(coll.topics, depth[name])
        cands[name] = cand
        log(f"{name}: re-ranking BM25 top-{depth[name]} of {len(coll.topics)} queries ({len(cand)} pairs per model)")
        runs[name] = {"BM25": bm25_run(cand)}
        for m, sc in scorers.items():
            runs[name][m] = ranked(cand, *sc.score(cand))
        exps[name] = experiment(runs[name], coll.topics, coll.qrels, BASELINE)
        effectiveness[name] = {
            "queries": len(coll.topics),
            "queries_available": coll.n_all,
            "depth": depth[name],
            "rows": exp_rows(exps[name]),
        }
        timings[f"rerank_{name}"] = time.perf_counter() - t
        print(exps[name].to_string(index=False), flush=True)

    # ---- robustness ----------------------------------------------------------------------------------------------
    t = time.perf_counter()
    nf = colls["nfcorpus"]
    sub = nf.topics.sample(n=min(a.robust_queries, len(nf.topics)), random_state=a.seed).sort_values("qid")
    sub = sub.reset_index(drop=True)
    clean = cands["nfcorpus"]
    clean = clean[clean["qid"].isin(sub["qid"]) & (clean["rank"] < a.robust_depth)].reset_index(drop=True)
    robust: dict[str, dict] = {}

    def robust_runs(cand: pd.DataFrame) -> dict[str, pd.DataFrame]:
        out = {"BM25": bm25_run(cand)}
        for m, sc in scorers.items():
            out[m] = ranked(cand, *sc.score(cand))
        return out

    def robust_entry(rr: dict[str, pd.DataFrame], topics: pd.DataFrame) -> dict:
        exp = experiment(rr, topics, nf.qrels, BASELINE)
        return {"rows": exp_rows(exp)}

    robust["clean"] = robust_entry(robust_runs(clean), sub) | {"changed_queries": 0}
    log(f"robustness: {len(sub)} nfcorpus/test queries, BM25 top-{a.robust_depth} of the (perturbed) query")
    for abbr, noise in sorted(all_noise(a.seed).items(), key=lambda kv: NOISE_ORDER.index(kv[0])):
        noisy = noise(sub[["qid", "query"]])
        changed = int((noisy["query"] != noisy["query_0"]).sum())
        cand = nf.bm25(noisy[["qid", "query"]], a.robust_depth)
        robust[abbr] = robust_entry(robust_runs(cand), sub) | {
            "changed_queries": changed,
            "examples": [[q0, q] for q0, q in zip(noisy["query_0"], noisy["query"]) if q0 != q][:3],
        }
        log(f"  {abbr}: {changed}/{len(sub)} queries changed, e.g. {robust[abbr]['examples'][:1]}")
    timings["robustness"] = time.perf_counter() - t

    # ---- hard queries --------------------------------------------------------------------------------------------
    hard = {}
    for name, coll in colls.items():
        hard[name] = {}
        for base in (BASELINE, "BM25"):
            tab = hard_query_table(runs[name], coll.qrels, base, measures(), 0.5, k=10, topics=coll.topics)
            hard[name][base] = tab.to_dict(orient="records")

    # ---- is the uncertainty informative? -------------------------------------------------------------------------
    uncertainty: dict[str, dict] = {}
    risk: dict[str, dict] = {}
    for name, coll in colls.items():
        uncertainty[name], risk[name] = {}, {}
        for m in VAR_MODELS:
            run = runs[name][m]
            uncertainty[name][m] = uncertainty_stats(run, per_query_ndcg(run, coll))
            mean, std = scorers[m].score(cands[name])
            rr = {f"risk={r:g}": ranked(cands[name], mean, std, r) for r in RISKS}
            top0 = rr["risk=0"][rr["risk=0"]["rank"] < 10].groupby("qid")["docno"].apply(list)
            changed = {}
            for k, v in rr.items():
                topk = v[v["rank"] < 10].groupby("qid")["docno"].apply(list)
                changed[k] = float((topk != top0.reindex(topk.index)).mean())
            exp = experiment(rr, coll.topics, coll.qrels, "risk=0")
            risk[name][m] = {"rows": exp_rows(exp), "share_of_queries_with_changed_top10": changed}

    # ---- inference time ------------------------------------------------------------------------------------------
    t = time.perf_counter()
    rng = np.random.default_rng(a.seed)
    pool = cands["nfcorpus"]
    idx = rng.choice(len(pool), size=min(a.timing_pairs, len(pool)), replace=False)
    timing_pairs = list(zip(pool["query"].iloc[idx], pool["text"].iloc[idx]))
    speed = inference_time(models, timing_pairs, a.timing_repeats, a.inference_batch_size)
    speed["rerank_throughput_pairs_per_s (not interleaved)"] = {
        n: (sc.pairs / sc.seconds if sc.seconds else None) for n, sc in scorers.items()
    }
    timings["inference_time"] = time.perf_counter() - t
    timings["total"] = time.perf_counter() - T0

    result = {
        "machine": machine,
        "settings": {k: v for k, v in vars(a).items()},
        "protocol": {
            "backbone": "packaged all-MiniLM-L6-v2 (st_extensions.default_model_path())",
            "models": {
                "CE": "sentence_transformers.CrossEncoder(num_labels=1) + BinaryCrossEntropyLoss",
                "VarCE-MEANVAR": f"build_var_cross_encoder(variant='MEANVAR') + VariationalBCELoss(beta={a.beta})",
                "VarCE-VAR": f"build_var_cross_encoder(variant='VAR') + VariationalBCELoss(beta={a.beta})",
            },
            "training": "CrossEncoderTrainer, AdamW, linear schedule with 10% warm-up, same data order and seed",
            "training_data": data_info,
            "first_stage": "BM25 (pyterrier-pisa, default settings) on title + text",
            "significance": "pt.Experiment paired t-test against CE (p < 0.05 marked *); no multiple-test correction",
            "measures": "nDCG@10, RR@10 (= MRR@10)",
            "cranfield_qrels": "label -1 ('no interest') counted as 0",
            "robustness": f"{len(sub)} seeded nfcorpus/test queries, BM25 top-{a.robust_depth} on the perturbed "
            "query, all three models; 'clean' = same queries and depth without perturbation",
            "hard_queries": "bottom 50% of the evaluated queries by nDCG@10 under CE (the paper) and under BM25",
        },
        "training": train_info,
        "effectiveness": effectiveness,
        "robustness": robust,
        "hard_queries": hard,
        "uncertainty": uncertainty,
        "risk": risk,
        "inference_time": speed,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=2, default=float)
    print_report(result)
    log(f"wrote {a.out}")


def print_report(r: dict) -> None:
    s = r["settings"]
    print()
    print(json.dumps(r["machine"]))
    print(
        f"training: {s['steps']} steps x {s['batch_size']} pairs (1 positive : {s['negatives']} BM25 negatives), "
        f"lr {s['lr']}, max_seq_length {s['max_seq_length']}, seed {s['seed']}, beta {s['beta']}"
    )
    for n, info in r["training"].items():
        if info.get("seconds") is not None:
            print(
                f"  {n:14s} {info['seconds']:8.1f} s  ({info['s_per_step']} s/step)  loss first/last logged "
                f"{info['logged_loss'][0]:.3f} / {info['logged_loss'][-1]:.3f}"
                + ("  (trained by an earlier run of this script)" if info.get("reused") else "")
            )
        if info.get("note"):
            print(f"  {'':14s} note: {info['note']}")

    print("\nEffectiveness (BM25 candidates re-ranked; p: paired t-test vs CE, * p < 0.05)")
    print(
        f"{'collection':10s} {'queries':>9s} {'depth':>5s} {'system':14s} {'nDCG@10':>8s} {'p':>8s} "
        f"{'RR@10':>7s} {'p':>8s}"
    )
    for c, e in r["effectiveness"].items():
        for row in e["rows"]:
            print(
                f"{c:10s} {e['queries']:>4d}/{e['queries_available']:<4d} {e['depth']:5d} {row['name']:14s} "
                f"{row['nDCG@10']:8.4f} {fmt_p(row.get('nDCG@10 p-value'))} {row['RR@10']:7.4f} "
                f"{fmt_p(row.get('RR@10 p-value'))}"
            )

    rob = r["robustness"]
    names = [row["name"] for row in rob["clean"]["rows"]]
    cols = ["clean", *[k for k in NOISE_ORDER if k in rob]]
    print(f"\nRobustness (nDCG@10; nfcorpus/test subset, {r['protocol']['robustness']})")
    print(f"{'system':14s} " + " ".join(f"{c:>8s}" for c in cols))
    print(f"{'changed q':14s} " + " ".join(f"{rob[c]['changed_queries']:8d}" for c in cols))
    for i, n in enumerate(names):
        vals = [rob[c]["rows"][i]["nDCG@10"] for c in cols]
        print(f"{n:14s} " + " ".join(f"{v:8.4f}" for v in vals))
    print("drop vs clean (clean - perturbed; p of the perturbed run vs CE under the same perturbation)")
    for i, n in enumerate(names):
        c0 = rob["clean"]["rows"][i]["nDCG@10"]
        cells = []
        for c in cols[1:]:
            row = rob[c]["rows"][i]
            p = row.get("nDCG@10 p-value")
            cells.append(f"{c0 - row['nDCG@10']:+8.4f}" + (f"(p{p:.2f})" if p is not None and np.isfinite(p) else ""))
        print(f"{n:14s} " + " ".join(f"{x:>15s}" for x in cells))

    print("\nHard queries: bottom 50% by nDCG@10 under the baseline named; %no = % of queries, no relevant in top 10")
    for base in (BASELINE, "BM25"):
        print(f"  hard = bottom half under {base}")
        print(
            f"  {'collection':10s} {'n_hard':>6s} {'system':14s} {'nDCG@10':>8s} {'hard':>7s} {'RR@10':>7s} "
            f"{'hard':>7s} {'%no':>6s} {'%no hard':>8s}"
        )
        for c, h in r["hard_queries"].items():
            for row in h[base]:
                print(
                    f"  {c:10s} {row['n_hard']:6d} {row['name']:14s} {row['nDCG@10']:8.4f} "
                    f"{row['nDCG@10 hard']:7.4f} {row['RR@10']:7.4f} {row['RR@10 hard']:7.4f} {row['%no']:6.1f} "
                    f"{row['%no hard']:8.1f}"
                )

    print("\nUncertainty: Spearman rho(per-query mean score_std over its top 10, its nDCG@10); for reference the")
    print("same with the mean score_mean; score_std spread (5/50/95%), median within-query CV of score_std")
    print(
        f"{'collection':10s} {'model':14s} {'n':>4s} {'rho(std)':>9s} {'p':>8s} {'rho(mean)':>9s} {'p':>8s} "
        f"{'std 5/50/95%':>26s} {'cv in q':>8s} {'rho(std,mean) pairs':>19s}"
    )
    for c, u in r["uncertainty"].items():
        for m, x in u.items():
            sd = x["spearman_top10_std_vs_ndcg10"]
            sm = x["spearman_top10_mean_score_vs_ndcg10"]
            q = x["score_std_quantiles_5_50_95"]
            print(
                f"{c:10s} {m:14s} {x['n_queries']:4d} {sd['rho']:9.3f} {fmt_p(sd['p'])} {sm['rho']:9.3f} "
                f"{fmt_p(sm['p'])} {q[0]:8.4f}/{q[1]:8.4f}/{q[2]:8.4f} {x['score_std_within_query_cv_median']:8.2e} "
                f"{x['spearman_pairs_std_vs_mean']:19.3f}"
            )

    print(
        "\nRisk-adjusted ranking E[s] - risk * std[s] (p: paired t-test vs risk=0; changed = share of queries "
        "whose top 10 changed)"
    )
    print(f"{'collection':10s} {'model':14s} " + " ".join(f"{f'risk={x:g}':>24s}" for x in RISKS))
    for c, rk in r["risk"].items():
        for m, x in rk.items():
            cells = []
            for row in x["rows"]:
                p = row.get("nDCG@10 p-value")
                ch = x["share_of_queries_with_changed_top10"][row["name"]]
                cells.append(f"{row['nDCG@10']:.4f}{fmt_p(p) if p is not None else ' ' * 8} ch{ch:4.2f}")
            print(f"{c:10s} {m:14s} " + " ".join(f"{x:>24s}" for x in cells))

    sp = r["inference_time"]
    print(
        f"\nInference time (predict, {sp['pairs']} nfcorpus/test pairs, batch {sp['batch_size']}, "
        f"{sp['repeats']} interleaved repeats; target VarCE / CE <= 1.05)"
    )
    for n in sp["seconds_median"]:
        print(
            f"  {n:14s} {sp['seconds_median'][n]:8.2f} s  {sp['pairs_per_s_median'][n]:7.1f} pairs/s  ratio vs CE "
            f"{sp['ratio_vs_CE_median_of_repeats'][n]:.3f} (min {sp['ratio_vs_CE_min_max'][n][0]:.3f}, max "
            f"{sp['ratio_vs_CE_min_max'][n][1]:.3f}; total-time {sp['ratio_vs_CE_total_time'][n]:.3f})"
        )
    thr = sp["rerank_throughput_pairs_per_s (not interleaved)"]
    print(
        "  re-ranking throughput over the whole run (not interleaved): "
        + ", ".join(f"{n} {v:.1f} pairs/s" for n, v in thr.items() if v)
    )
    print("\ntimings (s): " + json.dumps(r["timings_s"]))


if __name__ == "__main__":
    main()
