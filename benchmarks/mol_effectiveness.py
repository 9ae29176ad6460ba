"""Effectiveness of Mixture-of-Logits (MoL) against the dot-product bi-encoder, same backbone and budget (issue #4).

Ding & Zhai, *Retrieval with Learned Similarities* (``shared/papers/mixture-of-logits.txt``). For each dataset
(train split -> test split) three models are fine-tuned from the packaged all-MiniLM-L6-v2 with the same
(query, relevant document) pairs, optimiser steps, batch size, backbone learning rate, seed, batch order and
max_seq_length:

* ``bi-encoder``: the model itself (mean pooling, cosine) with ``MultipleNegativesRankingLoss(scale=20)``;
* ``MoL``: :func:`st_extensions.build_mol_model` on the same weights, trained with ``MoLLoss(alpha=0.001)``
  (sampled softmax over the MoL similarity + alpha * L_MI, Eq. 3-4, scale 20);
* ``MoL (no L_MI)``: the same with ``alpha=0`` (the paper's "abl. L_MI" rows).

MoL configuration (the paper's construction for text, App. A.2): ``component_source="tokens"``, P_q = P_x = 4
aggregation tokens after ``[CLS]`` read by parameterised pooling, d_P = 384 (the encoder's hidden size, identity
projection, as the paper keeps d_P at the LM's dimension for NQ320k), the gate a SiLU MLP over the 16 dot products
without side features. Why tokens rather than ``"heads"``: a tiny-budget probe on nfcorpus test (full corpus,
nDCG@10): the untrained MiniLM scores 0.315; MoL with the default, independently orthogonal-initialised linear
heads starts as a random similarity (0.005 untrained, 0.038 after 30 steps), with aggregation tokens it starts at
0.019 but reaches 0.223 after 30 steps, because its components come from the encoder's own output space. (Linear
heads initialised at the identity, a benchmark-side hack, reached 0.265 after 30 steps, but their 4 + 4 components
start identical, i.e. MoL starts as the bi-encoder.) The new MoL parameters (pooling, gate) train at ``--head-lr``
(1e-3; the encoder, aggregation-token embeddings included, at ``--lr`` 5e-5 like the bi-encoder): the gate's output
layer starts at zero, and at 5e-5 Adam moves each weight by at most ~3e-3 over 100 steps (what 8 steps at 1e-3 do,
which left the gate uniform to three decimals in a smoke run), so the gate would stay uniform and the L_MI ablation
be empty (the paper grid-searched 2e-4 to 8e-4 for its QA models because of the parameterised pooling).
With ``"tokens"`` the aggregation tokens take 8 of the ``max_seq_length`` positions, so MoL sees 8 fewer text tokens.

The untrained MiniLM is a reference row. Documents are indexed with :class:`pyterrier_prob.DenseIndex` (dense
models) or :class:`pyterrier_prob.MoLIndex` (MoL), queries retrieved with ``TopKRetriever(num_results=100)`` or
``MoLRetriever(method="brute_force", num_results=100)`` over the whole collection, and compared in
``pt.Experiment`` with nDCG@10 and R@100 and paired t-tests against the bi-encoder. For the MoL models the gate
pi(q, x) is summarised on test pairs (each test query with its top-100 retrieved documents, and with its judged
relevant documents): its mean entropy H(pi | q, x), the entropy of the average gate H(p) (the load on the
P = P_q x P_x component pairs, which L_MI is meant to spread) and their difference, the mutual information.

    python benchmarks/mol_effectiveness.py [--steps 100 --batch-size 16 --max-seq-length 128
                                            --datasets nfcorpus scifact --component-source tokens]
    python benchmarks/mol_effectiveness.py --quick    # a smoke run: 8 steps, 600 documents, nfcorpus only

Writes ``benchmarks/results/mol_effectiveness.json`` (``--quick``: ``/tmp/mol_effectiveness_quick.json``) and
saves the nfcorpus MoL model (alpha = 0.001) to ``outputs/mol-bench/nfcorpus-mol`` for other benchmarks.
"""

from __future__ import annotations

import argparse
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

sys.path.insert(0, os.path.dirname(__file__))
from _machine import describe  # noqa: E402

DATASETS = {
    "nfcorpus": ("irds:beir/nfcorpus", "train", "test"),
    "scifact": ("irds:beir/scifact", "train", "test"),
}
BASELINE = "bi-encoder"
#: Parameters of the MixtureOfLogits module (pooling, projections or heads, gate): the ones ``--head-lr`` sets.
HEAD_PARAMS = r"(^|\.)(query_pool|doc_pool|query_proj|doc_proj|query_heads|doc_heads|gate_net)\."


# --------------------------------------------------------------------------------------------------------------
# gate statistics
# --------------------------------------------------------------------------------------------------------------


def _entropy(p: np.ndarray) -> np.ndarray:
    return -(p * np.log(np.clip(p, 1e-12, None))).sum(-1)


def gate_statistics(mol, q_comps: np.ndarray, x_comps: np.ndarray, qi: np.ndarray, docids: np.ndarray) -> dict:
    """Summary of pi(q, x) over the (query ``qi[i]``, document ``docids[i]``) pairs (entropies in nats)."""
    gates = []
    with torch.inference_mode():
        for a in range(0, len(qi), 4096):
            q = torch.from_numpy(q_comps[qi[a : a + 4096]])
            uniq, inv = np.unique(docids[a : a + 4096], return_inverse=True)  # sorted reads from the memmap
            x = torch.from_numpy(np.asarray(x_comps[uniq]))[torch.from_numpy(inv.reshape(-1))]
            gates.append(mol.gate(q, x[:, None]).reshape(len(q), -1).float().numpy())
    pi = np.concatenate(gates)
    P = pi.shape[1]
    usage = pi.mean(0)
    h_cond = float(_entropy(pi).mean())
    h_marg = float(_entropy(usage))
    argmax = np.bincount(pi.argmax(1), minlength=P) / len(pi)
    return {
        "pairs": int(len(pi)),
        "P": P,
        "log_P": round(math.log(P), 4),
        "mean_entropy_H_pi_given_qx": round(h_cond, 4),
        "entropy_of_mean_gate_H_p": round(h_marg, 4),
        "mutual_information": round(h_marg - h_cond, 4),
        "effective_components_exp_H_p": round(math.exp(h_marg), 3),
        "mean_effective_components_per_pair_exp_H_pi": round(float(np.exp(_entropy(pi)).mean()), 3),
        "mean_max_pi": round(float(pi.max(1).mean()), 4),
        "usage_mean_pi": np.round(usage.reshape(mol.num_query_components, -1), 4).tolist(),
        "usage_argmax_share": np.round(argmax.reshape(mol.num_query_components, -1), 4).tolist(),
    }


# --------------------------------------------------------------------------------------------------------------
# one dataset
# --------------------------------------------------------------------------------------------------------------


def _loss_summary(losses: list[float]) -> dict:
    tail = losses[-10:]
    return {
        "first": round(losses[0], 4),
        "last": round(losses[-1], 4),
        "mean_first_10": round(float(np.mean(losses[:10])), 4),
        "mean_last_10": round(float(np.mean(tail)), 4),
        "steps_logged": len(losses),
    }


def run_dataset(name: str, a: argparse.Namespace, t0: float) -> dict:
    import pyterrier as pt
    from ir_measures import R, nDCG
    from sentence_transformers.losses import MultipleNegativesRankingLoss

    from pyterrier_prob.data import training_pairs
    from pyterrier_prob.experiments.pebr import corpus_iter, load_qrels, load_topics
    from pyterrier_prob.index.dense import DenseIndex
    from pyterrier_prob.index.mol import MoLIndex
    from pyterrier_prob.mol.retrieval import MoLEncoder, MoLRetriever
    from pyterrier_prob.pebr.cutoff import TopKRetriever
    from pyterrier_prob.pebr.encoders import ProbBiEncoder
    from pyterrier_prob.training import fine_tune
    from st_extensions import build_mol_model, default_model_path, load_model
    from st_extensions.losses import MoLLoss

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {name}: {msg}", flush=True)

    dataset, train_split, test_split = DATASETS[name]
    train_id, test_id = f"{dataset}/{train_split}", f"{dataset}/{test_split}"
    pairs = training_pairs(train_id, max_pairs=a.steps * a.batch_size * 2, seed=a.seed)
    topics, qrels = load_topics(test_id), load_qrels(test_id)
    docs = list(corpus_iter(dataset))
    if a.max_docs is not None:  # --quick only: a cut corpus, numbers meaningless
        docs = docs[: a.max_docs]
    log(f"{len(pairs)} training pairs from {train_id}, {len(topics)} test queries, {len(docs)} documents")
    work = os.path.join(a.output_dir, "indexes", name)

    def base() -> object:
        model = load_model(a.model or default_model_path(), device="cpu")
        model.max_seq_length = a.max_seq_length
        return model

    systems = ["MiniLM (untrained)", BASELINE, "MoL", "MoL (no L_MI)"]
    runs: dict[str, pd.DataFrame] = {}
    info: dict[str, dict] = {}
    mol_model_path = None
    checkpoints = os.path.join(a.output_dir, "checkpoints", name)
    os.makedirs(checkpoints, exist_ok=True)
    for system in systems:
        slug = re.sub(r"[^A-Za-z0-9]+", "_", system).strip("_")
        ckpt_entry, ckpt_run = os.path.join(checkpoints, f"{slug}.json"), os.path.join(checkpoints, f"{slug}.run.tsv")
        if a.resume and os.path.isfile(ckpt_entry) and os.path.isfile(ckpt_run):
            with open(ckpt_entry) as f:
                saved = json.load(f)
            if saved["settings"] == a.settings:
                runs[system] = pd.read_csv(ckpt_run, sep="\t", dtype={"qid": str, "docno": str})
                info[system] = saved["entry"]
                if saved.get("saved_mol_model"):
                    mol_model_path = saved["saved_mol_model"]
                log(f"{system}: reusing the run and figures of an earlier process ({ckpt_entry})")
                continue
            log(f"{system}: the checkpoint in {ckpt_entry} has other settings; running again")
        entry: dict = {}
        if system.startswith("MoL"):
            alpha = a.alpha if system == "MoL" else 0.0
            model = build_mol_model(
                base(),
                num_query_components=a.pq,
                num_doc_components=a.px,
                component_dim=a.dim,
                component_source=a.component_source,
                seed=a.seed,
                device="cpu",
            )
            loss = MoLLoss(model, alpha=alpha, scale=a.scale)
            mapping = {HEAD_PARAMS: a.head_lr} if a.head_lr is not None else None
            entry.update(loss="MoLLoss", alpha=alpha, scale=a.scale)
        else:
            model, mapping = base(), None
            loss = MultipleNegativesRankingLoss(model, scale=a.scale) if system == BASELINE else None
            if loss is not None:
                entry.update(loss="MultipleNegativesRankingLoss", scale=a.scale)
        if loss is not None:
            log(f"training {system}: {a.steps} steps of {a.batch_size}")
            ts = time.perf_counter()
            losses = fine_tune(
                model,
                loss,
                pairs,
                a.steps,
                a.batch_size,
                a.lr,
                a.seed,
                show_progress=a.progress,
                learning_rate_mapping=mapping,
            )
            entry["train_seconds"] = round(time.perf_counter() - ts, 1)
            entry["seconds_per_step"] = round(entry["train_seconds"] / a.steps, 3)
            entry["train_loss"] = _loss_summary(losses)
            log(f"trained {system} in {entry['train_seconds']} s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
            del loss
        ts = time.perf_counter()
        if system.startswith("MoL"):
            encoder = MoLEncoder(model, batch_size=a.encode_batch_size)
            index = MoLIndex(os.path.join(work, f"{system.replace(' ', '_')}.mol"))
            (encoder.doc_encoder() >> index.indexer(mode="overwrite")).index(docs)
            entry["index_seconds"] = round(time.perf_counter() - ts, 1)
            ts = time.perf_counter()
            queries = encoder.query_encoder()(topics)
            run = MoLRetriever(index, encoder.mol, method="brute_force", num_results=a.k)(queries)
            entry["retrieve_seconds"] = round(time.perf_counter() - ts, 1)
            # gate statistics on test pairs
            q_comps = np.stack(queries["query_comp"].to_list()).astype(np.float32)
            qpos = {q: i for i, q in enumerate(queries["qid"])}
            rel = qrels[qrels["label"] > 0]
            rel_ids = index.docids_of(rel["docno"].astype(str).to_numpy())
            keep = rel_ids >= 0
            mol = encoder.mol
            mol.eval()
            entry["gate"] = {
                "top100": gate_statistics(
                    mol, q_comps, index.components(), run["qid"].map(qpos).to_numpy(), run["docid"].to_numpy()
                ),
                "relevant": gate_statistics(
                    mol, q_comps, index.components(), rel["qid"].map(qpos).to_numpy()[keep], rel_ids[keep]
                ),
            }
            g = entry["gate"]["top100"]
            log(
                f"{system} gate on top-100 pairs: H(pi|q,x) {g['mean_entropy_H_pi_given_qx']:.3f}, "
                f"H(p) {g['entropy_of_mean_gate_H_p']:.3f} (log P = {g['log_P']:.3f}), MI {g['mutual_information']:.3f}"
            )
            if name == "nfcorpus" and system == "MoL":
                mol_model_path = os.path.join(a.output_dir, "nfcorpus-mol")
                model.save(mol_model_path)
                log(f"saved the MoL model to {mol_model_path}")
        else:
            encoder = ProbBiEncoder(model, batch_size=a.encode_batch_size)
            index = DenseIndex(os.path.join(work, f"{system.split(' ')[0]}.flex"))
            (encoder.doc_encoder() >> index.indexer(mode="overwrite")).index(docs)
            entry["index_seconds"] = round(time.perf_counter() - ts, 1)
            ts = time.perf_counter()
            run = TopKRetriever(index, num_results=a.k)(encoder.query_encoder()(topics))
            entry["retrieve_seconds"] = round(time.perf_counter() - ts, 1)
        log(
            f"{system}: indexed {len(docs)} documents in {entry['index_seconds']} s, "
            f"retrieved in {entry['retrieve_seconds']} s"
        )
        runs[system] = run[["qid", "docno", "score", "rank"]]
        info[system] = entry
        # per-system checkpoint, so that --resume survives a killed process (shared machine)
        runs[system].to_csv(ckpt_run, sep="\t", index=False)
        saved_model = mol_model_path if system == "MoL" else None
        with open(ckpt_entry, "w") as f:
            json.dump({"settings": a.settings, "entry": entry, "saved_mol_model": saved_model}, f)
        del model, encoder
        gc.collect()

    names = list(runs)
    exp = pt.Experiment(
        list(runs.values()),
        topics,
        qrels,
        eval_metrics=[nDCG @ 10, R @ 100],
        names=names,
        baseline=names.index(BASELINE),
        test="t",
    )
    print(f"\n{name} ({test_id}, {len(topics)} queries, {len(docs)} documents; paired t-test vs {BASELINE})")
    with pd.option_context("display.width", 200, "display.max_columns", 20):
        print(exp.round(4).to_string(index=False))
    print()
    table = json.loads(exp.to_json(orient="records"))
    return {
        "train": train_id,
        "test": test_id,
        "training_pairs": len(pairs),
        "test_queries": len(topics),
        "documents": len(docs),
        "table": table,
        "systems": info,
        "saved_mol_model": mol_model_path,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--datasets", nargs="+", choices=sorted(DATASETS), default=["nfcorpus", "scifact"])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-seq-length", type=int, default=128)
    ap.add_argument("--lr", type=float, default=5e-5, help="learning rate of the encoder (all systems)")
    ap.add_argument(
        "--head-lr",
        type=float,
        default=1e-3,
        help="learning rate of the new MixtureOfLogits parameters (pooling, gate); 0 or less: --lr",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=20.0, help="softmax scale (1 / temperature), all systems")
    ap.add_argument("--alpha", type=float, default=0.001, help="weight of L_MI in the MoL row")
    ap.add_argument("--component-source", choices=["tokens", "heads"], default="tokens")
    ap.add_argument("--pq", type=int, default=4, help="P_q, query components")
    ap.add_argument("--px", type=int, default=4, help="P_x, document components")
    ap.add_argument("--dim", type=int, default=None, help="d_P (default: the encoder's hidden size, 384)")
    ap.add_argument("--k", type=int, default=100, help="results per query")
    ap.add_argument("--encode-batch-size", type=int, default=64)
    ap.add_argument("--model", default=None, help="base model (default: the packaged all-MiniLM-L6-v2)")
    ap.add_argument("--max-docs", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="smoke run: 8 steps, 600 documents, nfcorpus")
    ap.add_argument("--progress", action="store_true", help="training progress bars")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="reuse the runs and figures of systems an earlier process with the same settings finished "
        "(checkpoints under --output-dir)",
    )
    ap.add_argument("--output-dir", default=None, help="models and indexes (default outputs/mol-bench)")
    ap.add_argument("--out", default=None, help="results JSON")
    a = ap.parse_args()
    if a.head_lr is not None and a.head_lr <= 0:
        a.head_lr = None
    if a.quick:
        a.steps, a.max_docs = min(a.steps, 8), a.max_docs or 600
        if "--datasets" not in sys.argv:
            a.datasets = ["nfcorpus"]
    a.output_dir = a.output_dir or ("/tmp/mol-bench-quick" if a.quick else "outputs/mol-bench")
    a.out = a.out or ("/tmp/mol_effectiveness_quick.json" if a.quick else "benchmarks/results/mol_effectiveness.json")

    a.settings = {
        k: v for k, v in vars(a).items() if k not in ("progress", "resume", "out", "datasets", "encode_batch_size")
    }

    t0 = time.perf_counter()
    machine = describe()
    print(json.dumps(machine))
    config = {
        "base_model": a.model or "packaged all-MiniLM-L6-v2 (st_extensions.default_model_path())",
        "steps": a.steps,
        "batch_size": a.batch_size,
        "max_seq_length": a.max_seq_length,
        "learning_rate": a.lr,
        "mol_head_learning_rate": a.head_lr or a.lr,
        "warmup": "10% linear, then linear decay (SentenceTransformerTrainer defaults)",
        "batch_sampler": "NO_DUPLICATES",
        "seed": a.seed,
        "scale": a.scale,
        "alpha": a.alpha,
        "mol": {
            "component_source": a.component_source,
            "P_q": a.pq,
            "P_x": a.px,
            "d_P": a.dim or 384,
            "gate": "MLP over the P dot products (SiLU, hidden max(16, 2P)), no side features",
        },
        "retrieval": {
            "dense": "DenseIndex + TopKRetriever",
            "mol": "MoLIndex + MoLRetriever(method='brute_force')",
            "num_results": a.k,
        },
        "measures": ["nDCG@10", "R@100"],
        "significance": f"paired t-test per measure against {BASELINE!r} (pt.Experiment, no correction)",
        "quick": a.quick,
        "max_docs": a.max_docs,
    }
    print(json.dumps(config))
    results = {name: run_dataset(name, a, t0) for name in a.datasets}
    saved = next((r["saved_mol_model"] for r in results.values() if r["saved_mol_model"]), None)
    out = {
        "machine": machine,
        "config": config,
        "datasets": results,
        "saved_nfcorpus_mol_model": os.path.abspath(saved) if saved else None,
        "total_seconds": round(time.perf_counter() - t0, 1),
    }
    for name, r in results.items():
        print(f"{name}: gate statistics on (test query, top-{a.k}) pairs")
        for system, entry in r["systems"].items():
            if "gate" in entry:
                g = entry["gate"]["top100"]
                print(
                    f"  {system:14s} H(pi|q,x) {g['mean_entropy_H_pi_given_qx']:.3f}  H(p) "
                    f"{g['entropy_of_mean_gate_H_p']:.3f}  MI {g['mutual_information']:.3f}  (log P {g['log_P']:.3f}), "
                    f"effective components {g['effective_components_exp_H_p']:.2f}, mean max pi {g['mean_max_pi']:.3f}"
                )
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {a.out} ({out['total_seconds']} s)")


if __name__ == "__main__":
    main()
