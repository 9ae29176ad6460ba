"""UniERF on nfcorpus: recall of the merged branch candidates at a total budget B, and branch overlap (issue #6).

Jiang et al., *UniERF* (KDD'25, ``shared/papers/unierf.md``), Table 2 ablation, adapted to text retrieval with two
branches: ``semantic`` reads the query; ``trigger`` reads the query and the text of the top BM25 document
(:class:`pyterrier_prob.TriggerText`, the stand-in for the paper's trigger items, for training and test queries
alike). Every system starts from the packaged all-MiniLM-L6-v2 and is trained on the same nfcorpus/train rows
(:func:`pyterrier_prob.unierf_training_data`: one row per judged-relevant pair, a seeded sample of
2 x steps x batch) in the very same batches (the ``NO_DUPLICATES`` rule, drawn once), with the same steps, learning
rates, seed and max_seq_length, by the terms of :class:`st_extensions.losses.UniERFLoss`:

* ``UniERF (all)`` -- (a): both branches trained jointly, all four terms of Eq. 32 (positive, triplet, InfoNCE,
  diversity with the paper's alpha = 0.6) and the differentiated negatives of Sec. 4.3 (in-batch, a shared random
  negative, and a hard negative per branch: the BM25 tail for ``semantic``, the documents least similar to the
  trigger document for ``trigger``);
* ``w/o L_div`` -- (a1): the same without the diversity loss;
* ``w/o diff. negatives`` -- (a2): the same rows without the per-branch hard negatives (in-batch and the shared
  random negative only), diversity loss kept;
* ``w/o L_div / diff-sam`` -- (a3): both removed, the paper's Table 2 ablation row;
* ``UniERF (all, low alpha)``: (a) with the diversity loss truncated at ``--low-alpha`` (0.3) instead of 0.6 --
  a probe: the two branches' embeddings of a query start at a cosine of about 0.58, below 0.6, where the truncated
  loss is flat (its value is log 2 and its gradient zero), so at the paper's alpha it may never act;
* ``independent`` -- (c): "branches trained independently" = two single-branch models (a semantic-only and a
  trigger-only :func:`st_extensions.build_unierf_model`), each trained alone on its own columns of the same rows
  (its hard negative, the random negative, in-batch) in the same batches (so (c) spends the training steps twice),
  their candidate sets merged with the same quota rule as the joint models.

Document tower (``--doc-tower``). ``frozen`` (default): the documents keep the untrained encoder's embeddings (one
:class:`~pyterrier_prob.DenseIndex` for every system; in training the positives and negatives are read from it),
while the query tower -- the encoder and the branch heads -- is fine-tuned: the query and trigger texts go through
a fine-tuned copy of MiniLM, the documents through the original. UniERF's item tower is shared by the branches
(Sec. 4.2); freezing it keeps the default run within ~15 minutes on two cores (a step with the documents in the
backward pass costs ~4x more, and every trained model must then index the corpus again). ``joint``: the encoder is
fine-tuned on queries and documents alike and every trained model gets its own index (the brief's design; ~4x the
time). The branch heads (identity-initialised linear maps, new parameters) train at ``--head-lr`` (1e-3), the
encoder at ``--lr`` (5e-5): at 5e-5 the heads would move by ~1e-3 per weight over 60 steps. The training loop is
local (AdamW, 10% warm-up then linear decay, clipping at 1.0: the sentence-transformers trainer's defaults) so
that every system sees identical batches and the frozen document tower needs no second model.

On nfcorpus/test, per system: the merged candidates of the two branches at total budget B in {100, 300} (equal
quotas B/2, dedup, refill: :func:`pyterrier_prob.unierf.branches.merge_branch_lists`; checked equal to
:class:`~pyterrier_prob.MultiBranchRetriever`'s sets whenever both branches search one index), recall R@B
(ir_measures, over the B merged documents), paired t-tests against ``UniERF (all)`` (pt.Experiment); (b) each
branch of (a) alone given the whole budget B; the two single models of (c) alone; BM25 (PISA) and the untrained
model (identity heads on MiniLM) as references. Overlap: per query the Jaccard index of the two branches' top-B/2
lists (each branch's quota), averaged over queries; the share of the merged set found by both branches; and the
mean cosine of a query's two branch vectors (what the diversity loss acts on).

    python benchmarks/unierf.py [--steps 60 --batch-size 16 --max-seq-length 128 --budgets 100 300]
    python benchmarks/unierf.py --quick     # smoke run: 6 steps, 600 documents, numbers meaningless

Writes ``benchmarks/results/unierf.json`` (``--quick``: ``/tmp/unierf_quick.json``); indexes go to
``outputs/unierf-bench``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import re
import sys
import time

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _machine import describe  # noqa: E402

from st_extensions.losses.unierf import TERMS  # noqa: E402

DATASET = "irds:beir/nfcorpus"
BRANCHES = ("semantic", "trigger")
BASELINE = "UniERF (all)"
#: joint system -> (per-branch hard-negative columns kept, diversity loss used)
JOINT = {
    "UniERF (all)": (True, True),
    "w/o L_div": (True, False),
    "w/o diff. negatives": (False, True),
    "w/o L_div / diff-sam": (False, False),
    "UniERF (all, low alpha)": (True, True),
}
SYSTEM_KEYS = {
    "all": "UniERF (all)",
    "nodiv": "w/o L_div",
    "nodiff": "w/o diff. negatives",
    "neither": "w/o L_div / diff-sam",
    "lowalpha": "UniERF (all, low alpha)",
}
HEAD_PARAMS = r"(^|\.)heads\."


def no_duplicate_batches(train, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """``steps`` batches of row indices in which no text value repeats (the rule of sentence-transformers'
    ``BatchSamplers.NO_DUPLICATES``: a query with several relevant documents never meets itself as an in-batch
    negative), from seeded shuffles of the rows; computed once on the full rows and reused by every system."""
    rng = np.random.default_rng(seed)
    values = [set(r.values()) for r in train.to_list()]
    pool: list[int] = []
    batches: list[list[int]] = []
    while len(batches) < steps:
        if len(pool) < 4 * batch_size:
            pool += rng.permutation(len(values)).tolist()
        batch, seen, rest = [], set(), []
        for i in pool:
            if len(batch) < batch_size and not (values[i] & seen) and i not in batch:
                batch.append(i)
                seen |= values[i]
            else:
                rest.append(i)
        if len(batch) < batch_size:
            raise ValueError("not enough distinct training rows for one batch")
        batches.append(batch)
        pool = rest
    return batches


def train_model(
    model, loss, train, batches: list[list[int]], a: argparse.Namespace, doc_vecs=None
) -> tuple[list[float], dict[str, list[float]]]:
    """AdamW (no weight decay) with 10% linear warm-up then linear decay and gradient clipping at 1.0 (the
    sentence-transformers trainer's defaults), the encoder at ``--lr`` and the branch heads at ``--head-lr``; one
    step per batch of ``batches``. Every term is :class:`~st_extensions.losses.UniERFLoss`'s own
    (``terms_from_embeddings``). ``doc_vecs`` (text -> vector): the document tower is frozen and the positives and
    negatives are read from the untrained index; ``None``: they go through the model, which is fine-tuned with them.

    Returns the loss of every step and, with two branches, per step: the diversity term (logged whether it is used
    or not), the batch's mean cosine of a row's two branch embeddings and the share of rows above alpha (the rows
    the truncated diversity loss acts on; its value is log 2 when there are none).
    """
    from transformers import get_linear_schedule_with_warmup

    anchors, tags = loss.layout
    k = len(anchors)
    columns = train.column_names
    rows = train.to_list()
    head = [p for n, p in model.named_parameters() if re.search(HEAD_PARAMS, n)]
    encoder = [p for n, p in model.named_parameters() if not re.search(HEAD_PARAMS, n)]
    opt = torch.optim.AdamW([{"params": encoder, "lr": a.lr}, {"params": head, "lr": a.head_lr}], weight_decay=0.0)
    sched = get_linear_schedule_with_warmup(opt, math.ceil(0.1 * len(batches)), len(batches))

    def embed(texts: list[str]) -> torch.Tensor:
        return model(model.preprocess(texts))["sentence_embedding"]

    torch.manual_seed(a.seed)
    model.train()
    losses: list[float] = []
    stats: dict[str, list[float]] = {"diversity_term": [], "branch_cos": [], "share_above_alpha": []}
    for step, batch in enumerate(batches):
        texts = {c: [rows[i][c] for i in batch] for c in columns}
        branch_emb = {b: loss.head.embed(embed(texts[c]), b) for b, c in zip(anchors, columns[:k])}
        if doc_vecs is None:
            docs = [F.normalize(embed(texts[c]), dim=-1) for c in columns[k:]]
        else:
            docs = [torch.from_numpy(np.stack([doc_vecs[t] for t in texts[c]])) for c in columns[k:]]
        terms = loss.terms_from_embeddings(branch_emb, docs[0], docs[1:], tags)
        value = torch.stack([terms[n] for n in TERMS if loss.use[n]]).sum()
        value.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(value.detach()))
        if len(branch_emb) == 2:
            h1, h2 = branch_emb.values()
            cos = (h1 * h2).sum(-1).detach()
            stats["diversity_term"].append(float(terms["diversity"].detach()))
            stats["branch_cos"].append(float(cos.mean()))
            stats["share_above_alpha"].append(float((cos > loss.diversity_threshold).float().mean()))
        if a.progress:
            print(f"  step {step + 1}/{len(batches)}: loss {losses[-1]:.4f}", flush=True)
    model.eval()
    return losses, stats


def _loss_summary(losses: list[float]) -> dict:
    k = min(10, len(losses))
    return {
        "first": round(losses[0], 4),
        "last": round(losses[-1], 4),
        f"mean_first_{k}": round(float(np.mean(losses[:k])), 4),
        f"mean_last_{k}": round(float(np.mean(losses[-k:])), 4),
        "steps_logged": len(losses),
    }


# --------------------------------------------------------------------------------------------------------------
# candidate lists, merging, overlap
# --------------------------------------------------------------------------------------------------------------


def branch_lists(frame: pd.DataFrame, index, column: str, k: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """qid -> (docnos, scores) of the top-``k`` cosine search with the vectors in ``column``, best first."""
    from pyterrier_prob.pebr.cutoff import TopKRetriever

    queries = frame[["qid", column]].rename(columns={column: "query_vec"})
    res = TopKRetriever(index, num_results=k)(queries).sort_values(["qid", "rank"], kind="stable")
    out = {}
    for qid, g in res.groupby("qid", sort=False):
        out[str(qid)] = (g["docno"].astype(str).to_numpy(), g["score"].to_numpy(np.float64))
    return out


def as_run(lists: dict[str, tuple[np.ndarray, np.ndarray]], k: int) -> pd.DataFrame:
    rows = [(q, d, float(s), r) for q, (ds, ss) in lists.items() for r, (d, s) in enumerate(zip(ds[:k], ss[:k]))]
    return pd.DataFrame(rows, columns=["qid", "docno", "score", "rank"])


def merge_run(per_branch: list[dict], budget: int) -> tuple[pd.DataFrame, float]:
    """Merge the branches' lists (each cut to ``budget``) with equal quotas: the run, and the mean share of the
    merged set that more than one branch found."""
    from pyterrier_prob.unierf.branches import branch_quotas, merge_branch_lists

    quotas = branch_quotas(budget, [1.0] * len(per_branch))
    rows, shared = [], []
    for qid in per_branch[0]:
        lists = [(b[qid][0][:budget], b[qid][1][:budget]) for b in per_branch]
        merged = sorted(merge_branch_lists(lists, budget, quotas), key=lambda m: (-m[1], m[0]))
        rows += [(qid, d, s, r) for r, (d, s, _, _) in enumerate(merged)]
        shared.append(np.mean([len(m[2]) > 1 for m in merged]))
    return pd.DataFrame(rows, columns=["qid", "docno", "score", "rank"]), float(np.mean(shared))


def mean_jaccard(sem: dict, trig: dict, k: int) -> float:
    vals = []
    for qid, (d1, _) in sem.items():
        a, b = set(d1[:k].tolist()), set(trig[qid][0][:k].tolist())
        vals.append(len(a & b) / len(a | b))
    return float(np.mean(vals))


# --------------------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_native(path: str):
    """PISA's C++ logging off the console: file descriptor 2 (progress) and 1 (spdlog lines) to ``path``."""
    from pyterrier_prob.experiments.pebr import _stderr_to

    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with _stderr_to(path), open(path, "ab") as log:
            os.dup2(log.fileno(), 1)
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-seq-length", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-5, help="learning rate of the encoder (all systems)")
    ap.add_argument("--head-lr", type=float, default=1e-3, help="learning rate of the branch heads (all systems)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--alpha", type=float, default=0.6, help="truncation alpha of the diversity loss (the paper's Sec. 5.3.2: 0.6)"
    )
    ap.add_argument(
        "--low-alpha", type=float, default=0.3, help="alpha of the 'UniERF (all, low alpha)' system (lowalpha)"
    )
    ap.add_argument("--budgets", type=int, nargs="+", default=[100, 300], help="total budgets B")
    ap.add_argument(
        "--doc-tower",
        choices=["frozen", "joint"],
        default="frozen",
        help="frozen: documents keep the untrained encoder's vectors (one index for all systems); joint: the "
        "encoder is fine-tuned on documents too and every trained model indexes the corpus again (~6x the time)",
    )
    ap.add_argument(
        "--systems",
        nargs="+",
        choices=[*SYSTEM_KEYS, "independent"],
        default=[*SYSTEM_KEYS, "independent"],
        help="trained systems (all: (a); nodiv: (a1); nodiff: (a2); neither: (a3); lowalpha: (a) with alpha "
        "--low-alpha; independent: (c))",
    )
    ap.add_argument("--encode-batch-size", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--max-docs", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="smoke run: 6 steps, 600 documents")
    ap.add_argument("--progress", action="store_true", help="print the loss of every training step")
    ap.add_argument("--work-dir", default=None, help="indexes (default outputs/unierf-bench)")
    ap.add_argument("--out", default=None, help="results JSON")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.max_docs = min(a.steps, 6), a.max_docs or 600
    a.work_dir = a.work_dir or ("/tmp/unierf-bench-quick" if a.quick else "outputs/unierf-bench")
    a.out = a.out or ("/tmp/unierf_quick.json" if a.quick else "benchmarks/results/unierf.json")
    torch.set_num_threads(a.threads)

    import pyterrier as pt
    from ir_measures import R
    from pyterrier_pisa import PisaIndex

    from pyterrier_prob.experiments.pebr import corpus_iter, load_qrels, load_topics
    from pyterrier_prob.index.dense import DenseIndex
    from pyterrier_prob.unierf.branches import MultiBranchRetriever, TriggerText, UniERFEncoder, unierf_training_data
    from st_extensions import build_unierf_model, default_model_path, load_model
    from st_extensions.losses import UniERFLoss

    t0 = time.perf_counter()
    timings: dict[str, float] = {}

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    machine = describe()
    print(json.dumps(machine))
    os.makedirs(a.work_dir, exist_ok=True)
    pisa_log = os.path.join(a.work_dir, "pisa.log")

    # ---- data, BM25, trigger documents -----------------------------------------------------------------------
    ts = time.perf_counter()
    docs = list(corpus_iter(DATASET))
    if a.max_docs is not None:  # --quick only: a cut corpus, numbers meaningless
        docs = docs[: a.max_docs]
    doc_texts = {d["docno"]: d["text"] for d in docs}
    train_topics, train_qrels = load_topics(f"{DATASET}/train"), load_qrels(f"{DATASET}/train")
    topics, qrels = load_topics(f"{DATASET}/test"), load_qrels(f"{DATASET}/test")
    kmax = max(a.budgets)
    with _quiet_native(pisa_log):
        bm25_index = PisaIndex(os.path.join(a.work_dir, "bm25.pisa"), text_field="text", threads=2, overwrite=True)
        bm25_index.index(iter(docs))
        bm25 = bm25_index.bm25(num_results=kmax)
        trigger = TriggerText(bm25, doc_texts)
        train_topics = trigger(train_topics)
        topics = trigger(topics)
        bm25_runs = {B: (bm25 % B)(topics[["qid", "query"]]) for B in a.budgets}
    timings["bm25_index_and_triggers"] = round(time.perf_counter() - ts, 1)
    log(
        f"{len(docs)} documents, {len(train_topics)} train / {len(topics)} test queries; BM25 indexed and trigger "
        f"documents found in {timings['bm25_index_and_triggers']} s (PISA log: {pisa_log})"
    )

    def base():
        model = load_model(default_model_path(), device="cpu")
        model.max_seq_length = a.max_seq_length
        return model

    def index_model(model, name: str):
        ts = time.perf_counter()
        index = DenseIndex(os.path.join(a.work_dir, f"{name}.flex"))
        encoder = UniERFEncoder(model, batch_size=a.encode_batch_size)
        (encoder.doc_encoder() >> index.indexer(mode="overwrite")).index(iter(docs))
        timings[f"index {name}"] = round(time.perf_counter() - ts, 1)
        log(f"indexed {len(docs)} documents with {name} in {timings[f'index {name}']} s")
        return index

    # ---- the untrained model: its index (trigger hard negatives, frozen document tower) and reference rows ------
    untrained = build_unierf_model(base(), branches=BRANCHES, seed=a.seed, device="cpu")
    untrained.max_seq_length = a.max_seq_length
    base_index = index_model(untrained, "untrained")
    doc_vecs = None
    if a.doc_tower == "frozen":
        vecs = np.asarray(base_index.vectors(), dtype=np.float32)
        doc_vecs = {doc_texts[str(d)]: vecs[i] for i, d in enumerate(base_index.docno_array())}

    ts = time.perf_counter()
    with _quiet_native(pisa_log):
        train_full = unierf_training_data(
            train_topics,
            train_qrels,
            doc_texts,
            BRANCHES,
            retriever=bm25,
            index=base_index,
            hard_negatives=True,
            max_examples=a.steps * a.batch_size * 2,
            seed=a.seed,
        )
    batches = no_duplicate_batches(train_full, a.batch_size, a.steps, a.seed)
    timings["training_data"] = round(time.perf_counter() - ts, 1)
    log(f"{len(train_full)} training rows {train_full.column_names} mined in {timings['training_data']} s")

    # ---- per system: each branch's top-kmax list ----------------------------------------------------------------
    lists: dict[str, dict[str, dict]] = {}  # system -> branch -> qid -> (docnos, scores)
    cosines: dict[str, float | None] = {}
    info: dict[str, dict] = {}

    def system_lists(name: str, frames: dict, indexes: dict) -> None:
        """``frames[b]``: test queries with ``query_vec_<b>``; ``indexes[b]``: the index branch b searches."""
        ts = time.perf_counter()
        lists[name] = {b: branch_lists(frames[b], indexes[b], f"query_vec_{b}", kmax) for b in BRANCHES}
        sem, trig = (np.stack(frames[b][f"query_vec_{b}"].to_list()) for b in BRANCHES)
        same_space = indexes["semantic"] is indexes["trigger"]
        cosines[name] = float(np.mean(np.sum(sem * trig, axis=1))) if same_space else None
        if same_space:  # the library's merged retriever gives the very sets merged here
            q = frames["semantic"].assign(query_vec_trigger=frames["trigger"]["query_vec_trigger"].to_list())
            for B in a.budgets:
                lib = MultiBranchRetriever(indexes["semantic"], BRANCHES, num_results=B)(q)
                mine, _ = merge_run([lists[name][b] for b in BRANCHES], B)
                assert set(zip(lib["qid"].astype(str), lib["docno"])) == set(zip(mine["qid"], mine["docno"])), name
        timings[f"retrieve {name}"] = round(time.perf_counter() - ts, 1)

    def encode_topics(model):
        return UniERFEncoder(model, batch_size=a.encode_batch_size).query_encoder()(topics)

    q = encode_topics(untrained)
    system_lists("untrained", {b: q for b in BRANCHES}, {b: base_index for b in BRANCHES})
    del untrained
    gc.collect()

    def train_one(name: str, branches, columns: list[str], diversity: bool):
        train = train_full.select_columns(columns)
        model = build_unierf_model(base(), branches=branches, seed=a.seed, device="cpu")
        model.max_seq_length = a.max_seq_length
        alpha = a.low_alpha if name == SYSTEM_KEYS["lowalpha"] else a.alpha
        loss = UniERFLoss(model, columns=train.column_names, use_diversity=diversity, diversity_threshold=alpha)
        log(f"training {name}: {a.steps} steps of {a.batch_size}, columns {columns}, diversity loss {diversity}")
        ts = time.perf_counter()
        losses, stats = train_model(model, loss, train, batches, a, doc_vecs)
        secs = round(time.perf_counter() - ts, 1)
        timings[f"train {name}"] = secs
        info[name] = {
            "columns": columns,
            "use_diversity": diversity if len(branches) > 1 else None,
            "diversity_threshold_alpha": alpha if len(branches) > 1 else None,
            "train_seconds": secs,
            "seconds_per_step": round(secs / a.steps, 2),
            "train_loss": _loss_summary(losses),
            **{f"train_{k}": _loss_summary(v) for k, v in stats.items() if v},
        }
        msg = ""
        if stats["branch_cos"]:
            c, sh = stats["branch_cos"], stats["share_above_alpha"]
            msg = (
                f"; training rows' cos(H_sem, H_trig) {np.mean(c[:10]):.3f} -> {np.mean(c[-10:]):.3f} (first/last 10 "
                f"steps), share above alpha {alpha} {np.mean(sh[:10]):.3f} -> {np.mean(sh[-10:]):.3f}"
            )
        log(
            f"trained {name} in {secs} s, loss {np.mean(losses[:10]):.3f} -> {np.mean(losses[-10:]):.3f} (means of "
            f"the first/last 10 steps){msg}"
        )
        index = base_index if a.doc_tower == "frozen" else index_model(model, name.replace(" ", "_").replace("/", ""))
        return model, index

    anchor_cols = [f"anchor_{b}" for b in BRANCHES]
    for key in [k for k in SYSTEM_KEYS if k in a.systems]:
        name = SYSTEM_KEYS[key]
        hard, diversity = JOINT[name]
        columns = [*anchor_cols, "positive_doc", "negative_random", *([f"negative_{b}" for b in BRANCHES] * hard)]
        model, index = train_one(name, BRANCHES, columns, diversity)
        q = encode_topics(model)
        system_lists(name, {b: q for b in BRANCHES}, {b: index for b in BRANCHES})
        del model
        gc.collect()

    if "independent" in a.systems:
        frames, indexes = {}, {}
        for b in BRANCHES:
            columns = [f"anchor_{b}", "positive_doc", "negative_random", f"negative_{b}"]
            model, indexes[b] = train_one(f"independent {b}", (b,), columns, False)
            frames[b] = encode_topics(model)
            del model
            gc.collect()
        system_lists("independent", frames, indexes)

    # ---- recall at B --------------------------------------------------------------------------------------------
    trained = [s for s in lists if s != "untrained"]
    order = ([BASELINE] if BASELINE in trained else []) + [s for s in trained if s != BASELINE]
    recall_tables, overlap = {}, {}
    shares: dict[str, dict[int, float]] = {s: {} for s in lists}
    for B in a.budgets:
        runs: dict[str, pd.DataFrame] = {}
        for s in order:
            runs[f"{s}: merged"], shares[s][B] = merge_run([lists[s][b] for b in BRANCHES], B)
            if s in (BASELINE, "independent"):
                for b in BRANCHES:
                    runs[f"{s}: {b} branch alone"] = as_run(lists[s][b], B)
        runs["untrained: merged"], shares["untrained"][B] = merge_run([lists["untrained"][b] for b in BRANCHES], B)
        for b in BRANCHES:
            runs[f"untrained: {b} branch alone"] = as_run(lists["untrained"][b], B)
        runs["BM25"] = bm25_runs[B][["qid", "docno", "score", "rank"]]
        names = list(runs)
        exp = pt.Experiment(
            list(runs.values()),
            topics[["qid", "query"]],
            qrels,
            eval_metrics=[R @ B],
            names=names,
            baseline=0,
            test="t",
        )
        print(
            f"\nrecall of the candidates at total budget B = {B} (nfcorpus/test, {len(topics)} queries; "
            f"paired t-test vs {names[0]!r})"
        )
        with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_colwidth", 60):
            print(exp.round(4).to_string(index=False))
        recall_tables[str(B)] = json.loads(exp.to_json(orient="records"))

    # ---- overlap ------------------------------------------------------------------------------------------------
    print(
        "\nbranch overlap on nfcorpus/test (means over queries): J@k = Jaccard of the branches' top-k, k = B/2; "
        "both@B = share of the merged B found by both branches"
    )
    header = "".join(f"{f'J@{B // 2}':>9s}{f'both@{B}':>10s}" for B in a.budgets)
    print(f"{'system':24s}{header}{'cos(H_sem, H_trig)':>20s}")
    for s in lists:
        o = {
            f"jaccard_top{B // 2}": round(mean_jaccard(lists[s]["semantic"], lists[s]["trigger"], B // 2), 4)
            for B in a.budgets
        }
        o.update({f"found_by_both_share_B{B}": round(shares[s][B], 4) for B in a.budgets})
        o["mean_cos_branch_query_vectors"] = None if cosines[s] is None else round(cosines[s], 4)
        overlap[s] = o
        row = "".join(f"{o[f'jaccard_top{B // 2}']:9.3f}{o[f'found_by_both_share_B{B}']:10.3f}" for B in a.budgets)
        cos = f"{'-':>20s}" if cosines[s] is None else f"{cosines[s]:20.3f}"
        print(f"{s:24s}{row}{cos}")

    config = {
        "dataset": DATASET,
        "train": f"{DATASET}/train",
        "test": f"{DATASET}/test",
        "base_model": "packaged all-MiniLM-L6-v2 (st_extensions.default_model_path())",
        "branches": {"semantic": "query", "trigger": "query [SEP] text of the top BM25 document"},
        "doc_tower": a.doc_tower,
        "steps": a.steps,
        "batch_size": a.batch_size,
        "max_seq_length": a.max_seq_length,
        "learning_rate": a.lr,
        "head_learning_rate": a.head_lr,
        "optimiser": "AdamW, no weight decay, 10% linear warm-up then linear decay, gradient norm clipped at 1.0",
        "batches": "NO_DUPLICATES rule, computed once on the full rows: the same batches for every system",
        "seed": a.seed,
        "loss": "UniERFLoss defaults (beta 0.5, gamma 0.1, tau 0.05, diversity scale 32, Delta 0.8) with alpha "
        f"{a.alpha} ('UniERF (all, low alpha)': {a.low_alpha})",
        "training_rows": len(train_full),
        "training_columns": train_full.column_names,
        "hard_negatives": "semantic: 30% tail of the BM25 top 100; trigger: the 30% of the BM25 top 100 least "
        "similar to the trigger document (untrained MiniLM vectors); relevant documents excluded",
        "budgets": a.budgets,
        "merge": "equal quotas B/2, dedup, refill (merge_branch_lists; the sets equal MultiBranchRetriever's)",
        "independent": "two single-branch models (semantic-only, trigger-only), each trained alone with the same "
        "steps and batches on its own columns of the same rows; merged with the same quota rule",
        "measures": [f"R@{B}" for B in a.budgets],
        "significance": f"paired t-test against {BASELINE!r} (pt.Experiment, no correction)",
        "threads": a.threads,
        "quick": a.quick,
        "max_docs": a.max_docs,
        "documents": len(docs),
        "test_queries": len(topics),
    }
    out = {
        "machine": machine,
        "config": config,
        "systems": info,
        "recall": recall_tables,
        "overlap": overlap,
        "timings_seconds": timings,
        "total_seconds": round(time.perf_counter() - t0, 1),
    }
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    log(f"wrote {a.out}")


if __name__ == "__main__":
    main()
