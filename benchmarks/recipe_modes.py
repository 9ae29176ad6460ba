"""Frozen vs partial vs full fine-tuning of the MNRL baseline and pEBR (BetaNCE) on nfcorpus: seconds per step, dev
nDCG@10 curves until they stop improving, test nDCG@10 and R@100 of the best-dev model, paired t-tests against the
same system's frozen row.

Three steps, so that the training step needs neither PyTerrier nor ir_datasets (it runs on a lent GPU machine too):

    python benchmarks/recipe_modes.py prepare --out .bundle --fp16-model # nfcorpus train/dev/test + corpus as JSON
    python benchmarks/recipe_modes.py run --bundle .bundle --system pebr --mode partial --train-layers 2 \\
        --steps 600 --eval-every 100 --batch-size 32 --out runs/pebr-partial2.json
    python benchmarks/recipe_modes.py table runs/*.json --out benchmarks/results/recipe_modes.json

``run`` trains through :func:`pyterrier_prob.training.fine_tune` under a :class:`~pyterrier_prob.training.Recipe`
(the same trainer, losses, sampler and rates as ``pyterrier-prob pebr``), evaluates dev nDCG@10 (exact search over the
whole corpus) every ``--eval-every`` steps on the model being trained (frozen and partial: through their cached
stand-ins, which give the model's own embeddings), stops after ``--patience`` evaluations without improvement, puts
the best-dev weights back and evaluates test once (per-query values kept for the paired tests). ``--time-only``
measures seconds per step over a few steps and evaluates nothing (full fine-tuning on the CPU). ``table`` merges the
rows, adds ``p_vs_frozen`` (scipy's paired t-test on the same test queries) and prints the Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from pyterrier_prob.experiments.report import MISSING, cell  # noqa: E402

SYSTEMS = ("mnrl", "pebr")
MEASURES = ("nDCG@10", "R@100")


# ---------------------------------------------------------------------------------------------------- prepare
def prepare(out: str, dataset: str = "irds:beir/nfcorpus") -> str:
    """Write ``<out>/bundle.json``: the training pairs as (qid, docno) in :func:`~pyterrier_prob.data.training_pairs`'
    order with the train query texts (every judged-relevant train pair: also the judged pairs the losses mask),
    dev/test topics and qrels, and the corpus; the collection itself stays uncommitted (``out`` is ignored by git)."""
    from pyterrier_prob.collections import load_collection
    from pyterrier_prob.data import training_pairs

    coll = load_collection(dataset)
    corpus = {d["docno"]: d["text"] for d in coll.corpus_iter()}
    by_text = {text: docno for docno, text in corpus.items()}
    train = training_pairs(coll, "train", seed=0)
    bundle: dict[str, Any] = {
        "dataset": dataset,
        "train": {
            "queries": dict(zip(train["qid"], train["anchor"])),
            "pairs": [[q, by_text[d]] for q, d in zip(train["qid"], train["positive"])],
        },
        "corpus": corpus,
    }
    for split in ("dev", "test"):
        topics = coll.topics(split)
        qrels = coll.qrels(split)
        bundle[split] = {
            "topics": dict(zip(topics["qid"], topics["query"])),
            "qrels": [[q, d, int(lab)] for q, d, lab in qrels[["qid", "docno", "label"]].itertuples(index=False)],
        }
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "bundle.json")
    with open(path, "w", encoding="utf8") as f:
        json.dump(bundle, f)
    return path


def _training_rows(bundle: dict[str, Any]) -> tuple[Any, Any]:
    """The bundle's training rows (anchor, positive, label) and judged pairs."""
    from datasets import Dataset

    from st_extensions.judged import JudgedPairs, pair_labels

    queries, corpus = bundle["train"]["queries"], bundle["corpus"]
    anchors = [queries[q] for q, _ in bundle["train"]["pairs"]]
    positives = [corpus[d] for _, d in bundle["train"]["pairs"]]
    rows = Dataset.from_dict({"anchor": anchors, "positive": positives, "label": pair_labels(anchors, positives)})
    return rows, JudgedPairs(zip(anchors, positives))


# ---------------------------------------------------------------------------------------------------- evaluation
class _Split:
    """A query set with its qrels, evaluated by exact search over the corpus (ir_measures for the measures)."""

    def __init__(self, bundle: dict[str, Any], split: str) -> None:
        import ir_measures

        self.qids = list(bundle[split]["topics"])
        self.queries = [bundle[split]["topics"][q] for q in self.qids]
        self.qrels = [ir_measures.Qrel(q, d, lab) for q, d, lab in bundle[split]["qrels"]]

    def evaluate(self, model: Any, docnos: list[str], doc_texts: list[str], batch_size: int = 128) -> dict:
        """Per-query nDCG@10 and R@100 of ``model`` (cosine, top 100 by exact search)."""
        import ir_measures
        import torch
        import torch.nn.functional as F

        was = model.training
        model.eval()
        try:
            with torch.inference_mode():
                q = model.encode_query(self.queries, batch_size=batch_size, convert_to_tensor=True)
                d = model.encode_document(doc_texts, batch_size=batch_size, convert_to_tensor=True)
                scores = F.normalize(q.float(), dim=-1) @ F.normalize(d.float(), dim=-1).T
                top = scores.topk(100, dim=1)
        finally:
            model.train(was)
        run = [
            ir_measures.ScoredDoc(qid, docnos[j], float(s))
            for qid, idx, sc in zip(self.qids, top.indices.tolist(), top.values.tolist())
            for j, s in zip(idx, sc)
        ]
        per_query: dict[str, dict[str, float]] = {m: {} for m in MEASURES}
        for m in ir_measures.iter_calc([ir_measures.parse_measure(x) for x in MEASURES], self.qrels, run):
            per_query[str(m.measure)][m.query_id] = float(m.value)
        # queries without a relevant document score 0 (as pt.Experiment with its default)
        return {k: {qid: v.get(qid, 0.0) for qid in self.qids} for k, v in per_query.items()}


def _mean(values: dict[str, float]) -> float:
    return float(statistics.fmean(values.values()))


# ---------------------------------------------------------------------------------------------------- run
def _build(system: str, mode: str, model_path: str) -> tuple[Any, Any]:
    from st_extensions import build_pebr_model, load_model
    from st_extensions.frozen import build_adapter_model

    base = load_model(model_path, device="cpu")
    base.float()
    if system == "mnrl":
        return (build_adapter_model(base) if mode == "frozen" else base), None
    return build_pebr_model(base, family="beta", device="cpu", projection=mode == "frozen"), None


def _loss(system: str, model: Any, judged: Any) -> Any:
    from st_extensions.losses import BetaNCELoss, MaskedMultipleNegativesRankingLoss

    return (MaskedMultipleNegativesRankingLoss if system == "mnrl" else BetaNCELoss)(model, judged=judged)


def run(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import TrainerCallback

    from pyterrier_prob.training import Recipe, fine_tune

    with open(os.path.join(a.bundle, "bundle.json"), encoding="utf8") as f:
        bundle = json.load(f)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(a.seed)
    model, _ = _build(a.system, a.mode, a.model)
    model.to(device)
    model.max_seq_length = a.max_seq_length
    train, judged = _training_rows(bundle)
    loss = _loss(a.system, model, judged)
    docnos = list(bundle["corpus"])
    doc_texts = [bundle["corpus"][d] for d in docnos]
    dev, test = _Split(bundle, "dev"), _Split(bundle, "test")
    eval_texts = [*dev.queries, *test.queries, *doc_texts]
    recipe = Recipe(
        mode=a.mode,
        steps=a.steps,
        batch_size=a.batch_size,
        learning_rate=a.lr,
        seed=a.seed,
        train_layers=a.train_layers if a.mode == "partial" else None,
    )
    cache = None
    if a.mode == "frozen":  # every text encoded once, training and evaluation texts alike
        from st_extensions.frozen import cached_model

        texts = [*train["anchor"], *train["positive"], *([] if a.time_only else eval_texts)]
        cache = cached_model(model, texts, show_progress_bar=not a.quiet)[0]

    t0 = time.perf_counter()
    step_s: list[float] = []
    curve: list[list[float]] = []
    best: dict[str, Any] = {"score": -1.0, "step": 0, "state": None}

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            step_s.append(time.perf_counter() - self.t0)
            if a.time_only and state.global_step >= a.steps:
                control.should_training_stop = True

    class DevCurve(TrainerCallback):
        def _evaluate(self, stand_in: Any, step: int, control: Any) -> None:
            t0 = time.perf_counter()
            score = _mean(dev.evaluate(stand_in, docnos, doc_texts)["nDCG@10"])
            curve.append([step, round(score, 5)])
            print(f"step {step}: dev nDCG@10 {score:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
            if score > best["score"]:
                best.update(
                    score=score, step=step, state={k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
                )
            elif len(curve) - 1 - [s for s, _ in curve].index(best["step"]) >= a.patience:
                control.should_training_stop = True

        def on_train_begin(self, args, state, control, model=None, **kw):
            if not curve:
                self._evaluate(model, 0, control)

        def on_step_end(self, args, state, control, model=None, **kw):
            over = a.max_minutes and time.perf_counter() - t0 > 60 * a.max_minutes
            if state.global_step % a.eval_every == 0 or over:
                self._evaluate(model, state.global_step, control)
                _dump(a.out, {"system": a.system, "mode": a.mode, "dev_curve": curve, "partial": True})
            if over:  # the time budget is spent: stop here, then test the best-dev weights
                control.should_training_stop = True

    callbacks = [Timer()] if a.time_only else [Timer(), DevCurve()]
    fine_tune(
        model,
        loss,
        train,
        recipe,
        output_dir=a.workdir,
        show_progress=not a.quiet,
        desc=f"{a.system} {a.mode}",
        callbacks=callbacks,
        encoder_cache=cache,
        state_cache=os.path.join(a.workdir, f"states-top{a.train_layers}") if a.mode == "partial" else None,
    )
    wall = time.perf_counter() - t0
    steady = step_s[min(5, len(step_s) - 1) :] or step_s  # the first steps warm up
    row: dict[str, Any] = {
        "system": a.system,
        "mode": a.mode,
        "train_layers": a.train_layers if a.mode == "partial" else None,
        "s_per_step": round(statistics.median(steady), 4),
        "steps_run": len(step_s),
        "batch_size": a.batch_size,
        "learning_rate": a.lr,
        "max_seq_length": a.max_seq_length,
        "device": _device_name(device),
        "train_wall_s": round(wall, 1),
        "stopped_by": "time budget" if a.max_minutes and wall > 60 * a.max_minutes else "patience or steps",
        "dev_curve": curve,
        "test": None,
        "time_only": bool(a.time_only),
    }
    if not a.time_only:
        model.load_state_dict(best["state"])
        per_query = test.evaluate(_stand_in(model, a, cache), docnos, doc_texts)
        row.update(
            best_step=best["step"],
            test={m: round(_mean(per_query[m]), 4) for m in MEASURES},
            per_query=per_query,
        )
        if a.save_model:  # the best-dev weights, as an ordinary sentence-transformers model (no cache needed)
            model.save(a.save_model)
            row["model"] = a.save_model
    _dump(a.out, row)
    print(json.dumps({k: v for k, v in row.items() if k != "per_query"}), flush=True)
    return row


def _dump(path: str, row: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf8") as f:
        json.dump(row, f, indent=1)
    os.replace(path + ".tmp", path)


def _stand_in(model: Any, a: argparse.Namespace, cache: Any) -> Any:
    """What encodes for evaluation: the model itself, or under frozen / partial its stand-in on the run's caches
    (the same embeddings, each text through the frozen part once)."""
    if a.mode == "frozen":
        from st_extensions.frozen import cached_model

        return cached_model(model, cache=cache)
    if a.mode == "partial":
        from st_extensions.partial import partial_model

        return partial_model(model, a.train_layers, cache_dir=os.path.join(a.workdir, f"states-top{a.train_layers}"))
    return model


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (torch {torch.__version__})"


# ---------------------------------------------------------------------------------------------------- table
def table(paths: list[str], out: str) -> dict[str, Any]:
    """Merge run rows; ``p_vs_frozen``: paired t-test (scipy.stats.ttest_rel) against the same system's frozen row
    on the same test queries (rows of one device together)."""
    from scipy.stats import ttest_rel

    rows = []
    for p in paths:
        with open(p, encoding="utf8") as f:
            rows.append(json.load(f))
    # s/step from the quiet timing pass (--time-only, every mode side by side in one run) where there is one
    key = lambda r: (r["device"], r["system"], r["mode"], r["train_layers"])  # noqa: E731
    timed = {key(r): r for r in rows if r.get("time_only")}
    trained = {key(r) for r in rows if not r.get("time_only")}
    for r in rows:
        if not r.get("time_only") and key(r) in timed:
            r["s_per_step_while_training"] = r["s_per_step"]
            r["s_per_step"] = timed[key(r)]["s_per_step"]
    rows = [r for r in rows if not r.get("time_only") or key(r) not in trained]
    frozen = {(r["system"], r["device"]): r for r in rows if r["mode"] == "frozen" and r.get("per_query")}
    out_rows = []
    order = {"frozen": 0, "partial": 1, "full": 2}
    for r in sorted(rows, key=lambda r: (r["device"], r["system"], order[r["mode"]], r["train_layers"] or 0)):
        ref = frozen.get((r["system"], r["device"]))
        if ref is None:  # no frozen row on this device (the GPU ran full only): the same system's frozen row elsewhere
            ref = next((v for (system, _), v in frozen.items() if system == r["system"]), None)
        p = None
        if r.get("per_query") and ref is not None and r is not ref:
            p = {}
            for m in MEASURES:
                qids = sorted(ref["per_query"][m])
                p[m] = float(
                    ttest_rel([r["per_query"][m][q] for q in qids], [ref["per_query"][m][q] for q in qids]).pvalue
                )
        row = {k: v for k, v in r.items() if k != "per_query"}
        row["p_vs_frozen"] = p
        if p is not None:
            row["frozen_reference"] = ref["device"]
        out_rows.append(row)
    result = {
        "benchmark": "recipe_modes",
        "command": "python benchmarks/recipe_modes.py table <run rows> --out benchmarks/results/recipe_modes.json",
        "rows": out_rows,
    }
    with open(out, "w", encoding="utf8") as f:
        json.dump(result, f, indent=1)
    print(markdown(out_rows))
    return result


def markdown(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table (s/step also as a ratio to the same system's full row on the same device)."""
    head = [
        "device",
        "system",
        "mode",
        "s/step",
        "× full",
        "best step",
        "dev nDCG@10",
        "test nDCG@10",
        "test R@100",
        "p vs frozen (nDCG@10 / R@100)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    full = {(r["device"], r["system"]): r["s_per_step"] for r in rows if r["mode"] == "full"}

    def fmt(v: Any, spec: str = ".4f") -> str:
        return cell(v, spec)

    for r in rows:
        mode = r["mode"] + (f" (top {r['train_layers']})" if r["mode"] == "partial" else "")
        ref = full.get((r["device"], r["system"]))
        dev = max((s for _, s in r["dev_curve"]), default=None)
        t = r["test"] or {}
        p = r["p_vs_frozen"] or {}
        cells = [
            r["device"].split(" (")[0],
            r["system"],
            mode,
            fmt(r["s_per_step"], ".3f"),
            fmt(r["s_per_step"] / ref if ref else None, ".2f"),
            str(r.get("best_step", MISSING)),
            fmt(dev),
            fmt(t.get("nDCG@10")),
            fmt(t.get("R@100")),
            f"{fmt(p.get('nDCG@10'), '.2g')} / {fmt(p.get('R@100'), '.2g')}" if p else MISSING,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", default=".bundle")
    p.add_argument("--dataset", default="irds:beir/nfcorpus")
    p.add_argument(
        "--fp16-model",
        action="store_true",
        help="also write <out>/minilm-fp16: the packaged model in fp16 safetensors (45 MB, small enough to carry to a "
        "GPU machine; run loads it as fp32)",
    )
    r = sub.add_parser("run")
    r.add_argument("--bundle", default=".bundle")
    r.add_argument("--model", default=None, help="base model folder (default: the packaged all-MiniLM-L6-v2)")
    r.add_argument("--system", choices=SYSTEMS, required=True)
    r.add_argument("--mode", choices=("frozen", "partial", "full"), required=True)
    r.add_argument("--train-layers", type=int, default=None)
    r.add_argument("--steps", type=int, default=1000)
    r.add_argument("--batch-size", type=int, default=32)
    r.add_argument("--lr", type=float, default=5e-5)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--max-seq-length", type=int, default=128)
    r.add_argument("--eval-every", type=int, default=100)
    r.add_argument("--patience", type=int, default=3, help="evaluations without a better dev score before stopping")
    r.add_argument("--max-minutes", type=float, default=0, help="stop training after this long (then test the best)")
    r.add_argument("--time-only", action="store_true", help="time --steps steps; no evaluation")
    r.add_argument("--device", default=None)
    r.add_argument("--workdir", default="outputs/recipe_modes")
    r.add_argument("--quiet", action="store_true")
    r.add_argument("--out", required=True)
    r.add_argument(
        "--save-model", default=None, help="save the best-dev model to this folder (e.g. a distillation teacher)"
    )
    t = sub.add_parser("table")
    t.add_argument("rows", nargs="+")
    t.add_argument("--out", default="benchmarks/results/recipe_modes.json")
    a = ap.parse_args(argv)
    if a.cmd == "prepare":
        print(prepare(a.out, a.dataset))
        if a.fp16_model:
            from st_extensions import default_model_path, load_model

            load_model(default_model_path(), device="cpu").half().save(os.path.join(a.out, "minilm-fp16"))
    elif a.cmd == "run":
        if a.model is None:
            from st_extensions import default_model_path

            a.model = default_model_path()
        run(a)
    else:
        table(a.rows, a.out)


if __name__ == "__main__":
    main()
