"""The J = 6 students (every layer reads query and document together: a plain sentence-transformers ``CrossEncoder``
and a VarCE-VAR, [CLS] head) trained on a lent GPU on the same rows as the CPU students of
``benchmarks/varce_rerank.py``, scored there, their scores brought back and evaluated here.

The GPU machine has sentence-transformers and torch but no PyTerrier, PISA, ir_datasets or faiss, and nothing can be
fetched there, so the work is split in three:

    python benchmarks/gpu_students.py prepare --output outputs/v52 --bundle outputs/gpu-bundle   # here
    python benchmarks/gpu_students.py device --bundle outputs/gpu-bundle --out $OUT     # there (sentence-transformers)
    python benchmarks/gpu_students.py collect --bundle outputs/gpu-bundle --scores RETURNED --output outputs/v52

The device has no ``datasets`` (the trainer's): its wheels and those of ``dill`` and ``multiprocess`` travel in
``.whl`` (``/work/.library/device/README.md``), and the run carries ``outputs/gpu-bundle`` and ``.whl``:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site && PYTHONUNBUFFERED=1 python3 benchmarks/gpu_students.py device \
        --bundle outputs/gpu-bundle --out $OUT

``prepare`` writes the main run's Margin-MSE rows (:class:`~pyterrier_prob.experiments.varce_distill.StudentRows`, the
teacher's ranking in the students' units), BM25's top 100 of the dev queries of the learning curves, of nfcorpus/test
and of the zero-shot collections, their judgements, and the teacher in fp16 (the starting weights): texts once each,
pairs as indices. ``device`` trains each student with the sentence-transformers trainer, re-ranks the dev pairs every
``--eval-every`` steps (nDCG@10, :func:`ndcg_at_10`), keeps the weights of the best dev point in memory, stops after
``--patience`` points without a new best or at ``--budget-s``, and scores the test pairs with the kept weights once:
what comes back is the dev curve and the test scores of the step chosen on dev. ``collect`` evaluates the test
scores with ir_measures against the main run's rows (paired tests) and writes ``benchmarks/results/varce_gpu.json``,
each row labelled with the card; ``benchmarks/varce_rerank.py`` adds its rows to the table (run ``j6-gpu``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import time
from typing import Any

import numpy as np
import pandas as pd

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RESULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "varce_gpu.json")
STUDENTS = ("CE", "VarCE-VAR")
DEV = "dev"


# ------------------------------------------------------------------------------------------------ here: prepare
def prepare(output: str, bundle: str, work: str, steps: int | None = None) -> dict[str, Any]:
    """The bundle of the main run in ``output`` (its teacher and caches linked into ``work``, as the main run may hold
    its own folder's lock); ``steps``: fewer rows (a tiny bundle for a test of the device step)."""
    import shutil

    from benchmarks.varce_rerank import command
    from pyterrier_prob.cli import build_parser
    from pyterrier_prob.experiments import varce
    from pyterrier_prob.experiments.harness import Harness
    from pyterrier_prob.experiments.varce_distill import StudentRows, fusion_stage, load_side, teacher_model
    from pyterrier_prob.experiments.varce_train import dev_evaluator, target_stage

    for part in ("teacher", "indexes", os.path.join("models", "distill-teacher"), "curves"):
        src, dst = os.path.join(output, part), os.path.join(work, part)
        if os.path.isdir(src) and not os.path.exists(dst):
            shutil.copytree(src, dst, copy_function=os.link)
    args = command(work, "main", only="CE")[1:]
    if steps is not None:
        args += ["--steps", str(steps)]
    cfg = varce.config_from_args(build_parser("varce").parse_args(args))
    h = Harness("varce", cfg)
    data = h.load_data(calibrate=True)
    corpus = {d["docno"]: d["text"] for d in data.train_collection.corpus_iter()}
    folder, fingerprint = teacher_model(cfg, h, data, corpus)
    from sentence_transformers import SentenceTransformer

    teacher = SentenceTransformer(folder, device="cpu")
    teacher.max_seq_length = cfg.max_seq_length
    fusion = fusion_stage(cfg, h, data, load_side(h, teacher, fingerprint, data.train_collection, corpus))
    rows = StudentRows(cfg, fusion, corpus)()
    splits = {DEV: (dev_evaluator(cfg, h, data), None)}
    texts: dict[str, int] = {}

    def index(values: Any) -> np.ndarray:
        return np.array([texts.setdefault(t, len(texts)) for t in values], dtype=np.int32)

    os.makedirs(bundle, exist_ok=True)
    docs = [c for c in rows.column_names if c.startswith("document_")]
    idx = np.stack([index(rows["query"]), *(index(rows[c]) for c in docs)], axis=1)
    np.savez_compressed(os.path.join(bundle, "rows.npz"), idx=idx, label=np.asarray(rows["label"], np.float32))
    manifest: dict[str, Any] = {"rows": len(rows), "documents_per_row": len(docs), "splits": {}, "made_by": args}
    manifest |= {"steps": cfg.steps, "batch_size": cfg.batch_size, "max_seq_length": cfg.max_seq_length}
    targets = {tg.label: tg for tg in target_stage(cfg, h, data)}
    for name, target in [(DEV, splits[DEV][0]), *targets.items()]:
        if name == DEV:
            cand, qrels, qids = target.cand, target.qrels, target.qids
        else:
            cand, qrels = target.candidates(h, target.topics, target.depth), target.qrels
            qids = target.topics["qid"].astype(str).tolist()
        pairs = pd.DataFrame({"qid": cand["qid"].astype(str), "docno": cand["docno"].astype(str)})
        pairs["q"], pairs["t"] = index(cand["query"]), index(cand["text"])
        key = re.sub(r"[^A-Za-z0-9]+", "_", name)  # a plain file name: the device brings back no other
        pairs.to_parquet(os.path.join(bundle, f"pairs-{key}.parquet"))
        qrels.astype({"qid": str, "docno": str})[["qid", "docno", "label"]].to_parquet(
            os.path.join(bundle, f"qrels-{key}.parquet")
        )
        manifest["splits"][name] = {"file": key, "pairs": len(pairs), "queries": int(pairs["qid"].nunique())}
        manifest["splits"][name]["qids"] = [str(q) for q in qids]  # the evaluated ones: a query without candidates is 0
    with gzip.open(os.path.join(bundle, "texts.json.gz"), "wt", encoding="utf8") as f:
        json.dump(list(texts), f)
    teacher.half().save(os.path.join(bundle, "teacher"))
    with open(os.path.join(bundle, "manifest.json"), "w", encoding="utf8") as f:
        json.dump(manifest, f, indent=1)
    return manifest


# ------------------------------------------------------------------------------------------------ there: device
def ndcg_at_10(
    pairs: pd.DataFrame, scores: np.ndarray, qrels: pd.DataFrame, qids: list[str] | None = None
) -> pd.Series:
    """nDCG@10 per query of ``pairs`` ranked by ``scores`` (trec_eval's: gain = label, 1 / log2(rank + 1), ties by
    docno descending; queries with no judgement score 0), for every query of ``qids`` (default: those of ``pairs``; one
    without candidates scores 0, as in :func:`pyterrier_prob.varce.distill.ndcg_at_10`, which the CPU students' dev
    curves use): the device's own measure for choosing the step (no ir_measures there; tested against it)."""
    run = pairs.assign(score=scores).sort_values(["qid", "score", "docno"], ascending=[True, False, False])
    gains = {(q, d): g for q, d, g in qrels[["qid", "docno", "label"]].itertuples(index=False) if g > 0}
    ideal = qrels[qrels["label"] > 0].groupby("qid")["label"].apply(lambda g: sorted(g, reverse=True)[:10])
    discount = 1.0 / np.log2(np.arange(2, 12))
    out = {}
    for qid, group in run.groupby("qid", sort=False):
        top = [gains.get((qid, d), 0) for d in group["docno"].head(10)]
        best = ideal.get(qid, [])
        idcg = float(np.dot(best, discount[: len(best)]))
        out[qid] = float(np.dot(top, discount[: len(top)])) / idcg if idcg > 0 else 0.0
    if qids is not None:
        return pd.Series([out.get(str(q), 0.0) for q in qids], index=[str(q) for q in qids], dtype=float)
    return pd.Series(out, dtype=float)


def device(
    bundle: str,
    out: str,
    students: list[str],
    steps: int,
    eval_every: int,
    lr: float,
    batch: int,
    patience: int = 3,
    budget_s: float | None = None,
    head_lr: float | None = None,
) -> None:
    """Train each student on the bundle's rows (sentence-transformers' trainer, Margin-MSE; the VarCE's Gaussian
    likelihood and KL as on the CPU) and write ``out/<student>/``: ``curve.json`` (dev nDCG@10 every ``eval_every``
    steps, wall times, the card) and ``<split>.npy`` (the test pairs' scores at the best dev point).

    The weights train in float32 (the bundle's teacher is saved in float16; bf16 autocast on a GPU). Training stops
    after ``patience`` dev points without a new best (the CPU students' rule) or once ``budget_s`` seconds of training
    have passed; the best dev point's weights are kept in memory and only they score the test pairs, once. The
    parameters a student adds to the teacher's weights train at a rate of their own (:func:`head_rates`); the curve
    records every optimizer group's rate and size (``param_groups``)."""
    import tempfile

    import torch
    from datasets import Dataset
    from sentence_transformers import CrossEncoder
    from sentence_transformers.cross_encoder import CrossEncoderTrainer, CrossEncoderTrainingArguments
    from sentence_transformers.cross_encoder.losses import MarginMSELoss
    from transformers import TrainerCallback

    with open(os.path.join(bundle, "manifest.json"), encoding="utf8") as f:
        manifest = json.load(f)
    with gzip.open(os.path.join(bundle, "texts.json.gz"), "rt", encoding="utf8") as f:
        texts = json.load(f)
    rows = np.load(os.path.join(bundle, "rows.npz"))
    idx, label = rows["idx"], rows["label"]
    n = min(len(idx), steps * batch)
    columns = {"query": [texts[i] for i in idx[:n, 0]]}
    columns |= {f"document_{j}": [texts[i] for i in idx[:n, j + 1]] for j in range(idx.shape[1] - 1)}
    data = Dataset.from_dict(columns | {"label": label[:n].tolist()})
    splits = {
        name: (pd.read_parquet(os.path.join(bundle, f"pairs-{s['file']}.parquet")),
               pd.read_parquet(os.path.join(bundle, f"qrels-{s['file']}.parquet")))
        for name, s in manifest["splits"].items()
    }  # fmt: skip
    dev_qids = manifest["splits"][DEV].get("qids")
    cuda = torch.cuda.is_available()
    card = torch.cuda.get_device_name(0) if cuda else "CPU"
    if cuda:
        torch.set_float32_matmul_precision("high")
    teacher, length = os.path.join(bundle, "teacher"), 2 * int(manifest["max_seq_length"])
    for student in students:
        if student == "CE":
            model = CrossEncoder(teacher, num_labels=1, max_length=length, activation_fn=torch.nn.Identity())
            loss = MarginMSELoss(model)
        else:
            from st_extensions.cross_encoder import build_var_cross_encoder
            from st_extensions.losses import VariationalMarginMSELoss

            model = build_var_cross_encoder(teacher, variant=student.split("-")[1], max_seq_length=length)
            loss = VariationalMarginMSELoss(model)
        model.float()  # float16 weights would not train under Adam; the new head was made in float16 too
        folder = os.path.join(out, student)
        os.makedirs(folder, exist_ok=True)
        curve: dict[str, Any] = {"card": card, "student": student, "points": [], "best": None, "rows": n}
        curve["dev_queries"] = len(dev_qids) if dev_qids is not None else int(splits[DEV][0]["qid"].nunique())
        curve |= {"lr": lr, "batch_size": batch, "eval_every": eval_every, "patience": patience, "budget_s": budget_s}
        mapping = head_rates(model, loss, student, head_lr)
        curve["head_lr"] = sorted(set(mapping.values()))
        best_state: dict[str, Any] = {}

        def predict(name: str, m: Any = model) -> np.ndarray:
            pairs = splits[name][0]
            texts_ = [(texts[q], texts[t]) for q, t in zip(pairs["q"], pairs["t"])]
            return np.asarray(m.predict(texts_, batch_size=256, show_progress_bar=False), dtype=np.float32)

        def save(c: dict = curve, folder: str = folder) -> None:
            with open(os.path.join(folder, "curve.json"), "w", encoding="utf8") as f:
                json.dump(c, f, indent=1)

        def evaluate(
            step: int, c: dict = curve, m: Any = model, student: str = student, best: dict = best_state
        ) -> bool:
            """The dev point at ``step``; True when it is a new best (its weights then kept on the CPU)."""
            start = time.perf_counter()
            m.eval()
            dev = float(ndcg_at_10(splits[DEV][0], predict(DEV, m), splits[DEV][1], dev_qids).mean())
            c["points"].append({"step": step, "dev": dev, "eval_s": time.perf_counter() - start})
            new = c["best"] is None or dev > c["best"]["dev"]
            if new:
                c["best"] = {"step": step, "dev": dev}
                best.clear()
                best.update({k: v.detach().to("cpu", copy=True) for k, v in m.state_dict().items()})
            save(c)
            m.train()
            print(f"{student} step {step}: dev nDCG@10 {dev:.4f}", flush=True)
            return new

        class Every(TrainerCallback):
            def __init__(self, evaluate: Any) -> None:
                self.evaluate, self.since, self.start = evaluate, 0, time.perf_counter()

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if state.global_step % eval_every == 0:
                    self.since = 0 if self.evaluate(state.global_step) else self.since + 1
                    if self.since >= patience:
                        control.should_training_stop = True
                if budget_s is not None and time.perf_counter() - self.start > budget_s:
                    control.should_training_stop = True

        evaluate(0)
        targs = CrossEncoderTrainingArguments(
            output_dir=tempfile.mkdtemp(prefix=f"gpu-{student}-"), per_device_train_batch_size=batch,
            learning_rate=lr, max_steps=min(steps, n // batch), warmup_ratio=0.1, seed=0, save_strategy="no",
            report_to=[], logging_steps=100, bf16=cuda, dataloader_drop_last=True, learning_rate_mapping=mapping,
        )  # fmt: skip
        start = time.perf_counter()
        trainer = CrossEncoderTrainer(
            model=model, args=targs, train_dataset=data, loss=loss, callbacks=[Every(evaluate)]
        )
        trainer.train()
        curve["train_s"] = time.perf_counter() - start
        curve["steps_run"] = int(trainer.state.global_step)
        curve["param_groups"] = [
            {"lr": g.get("initial_lr", g["lr"]), "parameters": sum(p.numel() for p in g["params"])}
            for g in trainer.optimizer.param_groups
            if g["params"]
        ]
        model.load_state_dict(best_state)
        model.eval()
        start = time.perf_counter()
        for name in splits:
            if name != DEV:
                np.save(os.path.join(folder, f"{manifest['splits'][name]['file']}.npy"), predict(name, model))
        curve["test_s"] = time.perf_counter() - start
        save(curve)


def head_rates(model: Any, loss: Any, student: str, head_lr: float | None = None) -> dict[str, float]:
    """``learning_rate_mapping`` of a student: the parameters it adds to the teacher's weights train at a rate of their
    own, as the CPU students' heads do -- the VarCE's head at its declared rate
    (:func:`pyterrier_prob.training.head_learning_rates`, with its branches' scales), the CE's new ``classifier`` at
    that same rate (``VariationalHead.learning_rate``); ``head_lr`` replaces the declared rate for both."""
    from pyterrier_prob.training import head_learning_rates
    from st_extensions.cross_encoder.head import VariationalHead

    mapping = head_learning_rates(model, loss, default=head_lr)
    if student == "CE":
        rate = VariationalHead.learning_rate if head_lr is None else head_lr
        new = [n for n, _ in loss.named_parameters() if re.search(r"(^|\.)classifier\.", n)]
        if not new:
            raise ValueError("the CE has no `classifier` parameters to give the head's learning rate")
        mapping |= {f"^{re.escape(n)}$": float(rate) for n in new}
    return mapping


# ------------------------------------------------------------------------------------------------ here: collect
def label(student: str, curve: dict[str, Any]) -> str:
    """A returned student's row name: the student, J = 6, the card and (when recorded) its batch size, rate and its
    head's own rate (curves from before the head had one record none: it trained at ``lr``)."""
    parts = ["J = 6", curve["card"]]
    if "batch_size" in curve and "lr" in curve:
        parts.append(f"batch {curve['batch_size']}, lr {curve['lr']:g}")
    if curve.get("head_lr"):
        parts.append("head lr " + "/".join(f"{r:g}" for r in curve["head_lr"]))
    return f"{student} ({', '.join(parts)})"


def collect(bundle: str, scores: str | list[str], output: str) -> dict[str, Any]:
    """Each returned student's dev curve (``scores``: one or several device ``--out`` folders, as brought back; a
    student is named by :func:`label`) and its test rows against the main run's per-query nDCG@10
    (``output/summary.json``): paired t-tests against the teacher's bi-encoder and the J = 2 CE (a VarCE also against
    the CE of its folder), the paired difference's 95% interval against BM25, the per-query nDCG@10 (ir_measures)
    under ``per_query``, and the main run's rows' means under ``reference``.

    The dev figures are put on the CPU curves' footing, the mean over every evaluated dev query (one without BM25
    candidates counts 0): a device run that averaged over the queries with candidates alone (``dev_queries`` fewer than
    the manifest's ``qids``) is scaled by their ratio, exact since the others score 0; ``dev_as_run`` keeps its own."""
    from pyterrier_prob.evaluation import paired_ci, paired_p
    from pyterrier_prob.experiments.varce_distill import BI_ENCODER
    from pyterrier_prob.varce import distill

    with open(os.path.join(bundle, "manifest.json"), encoding="utf8") as f:
        manifest = json.load(f)
    with open(os.path.join(output, "summary.json"), encoding="utf8") as f:
        main = json.load(f)
    dev_split = manifest["splits"][DEV]
    if "qids" not in dev_split:
        raise SystemExit(f"{bundle}/manifest.json lists no evaluated dev qids: rerun `prepare` (same rows and pairs)")
    result: dict[str, Any] = {"students": {}, "rows": [], "per_query": {}}
    result["reference"] = {  # the main run's rows these are paired with: their mean nDCG@10 over the same queries
        name: {system: float(np.mean(list(values.values()))) for system, values in systems.items()}
        for name, systems in main["per_query"].items()
    }
    folders = [scores] if isinstance(scores, str) else list(scores)
    found = [
        (d, st) for d in folders for st in sorted(os.listdir(d)) if os.path.isfile(os.path.join(d, st, "curve.json"))
    ]
    for folder, student in found:
        with open(os.path.join(folder, student, "curve.json"), encoding="utf8") as f:
            curve = json.load(f)
        averaged = int(curve.get("dev_queries", dev_split["queries"]))
        scale = averaged / len(dev_split["qids"])
        if scale != 1.0:
            curve["dev_as_run"] = {"points": curve["points"], "best": curve["best"], "queries": averaged}
            curve["points"] = [{**pt, "dev": pt["dev"] * scale} for pt in curve["points"]]
            curve["best"] = {**curve["best"], "dev": curve["best"]["dev"] * scale}
            curve["dev_queries"] = len(dev_split["qids"])
        system = label(student, curve)
        if system in result["students"]:
            raise SystemExit(f"{system} comes back twice ({folder}): one folder per configuration")
        result["students"][system] = curve | {"folder": os.path.join(folder, student)}
        for name, split in manifest["splits"].items():
            file = os.path.join(folder, student, f"{split['file']}.npy")
            if name == DEV or not os.path.isfile(file) or name not in main["per_query"]:
                continue
            pairs = pd.read_parquet(os.path.join(bundle, f"pairs-{split['file']}.parquet"))
            qrels = pd.read_parquet(os.path.join(bundle, f"qrels-{split['file']}.parquet"))
            frame = pairs.assign(s=np.load(file))
            qids = sorted(main["per_query"][name][BI_ENCODER])
            per = distill.ndcg_at_10(frame, qrels, "s", qids=qids)
            ref = {k: pd.Series(v) for k, v in main["per_query"][name].items()}
            row = {"collection": name, "system": system, "joint_layers": 6, "input_score": None, "chosen_on_dev": False}
            row |= {"nDCG@10": float(per.mean()), "queries": len(per), "best_dev_step": curve["best"]["step"]}
            row |= {"dev": curve["best"]["dev"], "card": curve["card"], "student": student}
            row |= {k: curve.get(k) for k in ("batch_size", "lr", "head_lr", "steps_run")}
            row["p_vs_bm25"] = paired_p(per, ref["BM25"])
            row["p_vs_bi_encoder"] = paired_p(per, ref[BI_ENCODER])
            row["p_vs_ce_j2"] = paired_p(per, ref["CE"]) if "CE" in ref else None
            ce = result["per_query"].get(name, {}).get(label("CE", curve))
            row["p_vs_ce_j6"] = None if student == "CE" or ce is None else paired_p(per, pd.Series(ce))
            row["ci95_vs_bm25"] = paired_ci(per, ref["BM25"])
            result["rows"].append(row)
            result["per_query"].setdefault(name, {})[system] = {str(q): float(v) for q, v in per.items()}
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--output", required=True, help="the main run's folder (benchmarks/varce_rerank.py --output)")
    p.add_argument("--bundle", required=True)
    p.add_argument("--work", help="a folder of its own for the harness (default: <bundle>-work)")
    p.add_argument("--steps", type=int, help="fewer rows: a tiny bundle")
    d = sub.add_parser("device")
    d.add_argument("--bundle", required=True)
    d.add_argument("--out", required=True)
    d.add_argument("--students", nargs="+", default=list(STUDENTS), choices=STUDENTS)
    d.add_argument("--steps", type=int, default=3000)
    d.add_argument("--eval-every", type=int, default=300)
    d.add_argument("--lr", type=float, default=2e-5)
    d.add_argument("--batch-size", type=int, default=16)
    d.add_argument("--head-lr", type=float, default=None, help="the added head's rate (default: its declared one)")
    d.add_argument("--patience", type=int, default=3, help="dev points without a new best before stopping")
    d.add_argument("--budget-s", type=float, help="stop training after this many seconds (a lease's limit)")
    c = sub.add_parser("collect")
    c.add_argument("--bundle", required=True)
    c.add_argument("--scores", required=True, nargs="+", help="the device step's --out folders, as brought back")
    c.add_argument("--output", required=True)
    c.add_argument("--out", default=RESULT)
    a = ap.parse_args(argv)
    if a.step == "prepare":
        print(json.dumps(prepare(a.output, a.bundle, a.work or f"{a.bundle}-work", a.steps), indent=1))
    elif a.step == "device":
        device(
            a.bundle, a.out, a.students, a.steps, a.eval_every, a.lr, a.batch_size, a.patience, a.budget_s, a.head_lr
        )
    else:
        from benchmarks._machine import write_result

        result = collect(a.bundle, a.scores, a.output)
        result["command"] = "python benchmarks/gpu_students.py " + " ".join(sys.argv[1:] if argv is None else argv)
        write_result(a.out, result, indent=1)
        print(json.dumps(result["rows"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
