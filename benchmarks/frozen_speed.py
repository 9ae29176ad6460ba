"""Frozen-encoder recipe against full fine-tuning, measured side by side in one run (nfcorpus train -> dev).

Both train the same model (all-MiniLM-L6-v2 + LinearAdapter) with the same loss (masked MNRL) on the same
query-balanced batches of 16: full fine-tuning moves the encoder (learning rate ``--encoder-lr``) and the adapter;
the frozen recipe moves only the adapter, on encoder outputs cached once (the caching time is counted), at the same
batch size and, as a second arm, at the recipe's batch of ``--frozen-batch-size``. Dev
nDCG@10 (brute force over the whole corpus) is measured every ``--eval-every`` steps, outside the timed training.
Prints seconds per step of each and their ratio, and the time each takes to first reach the best dev score of full
fine-tuning; writes ``frozen_speed.json``.

    python benchmarks/frozen_speed.py --full-steps 150 --frozen-steps 1000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recipe_search import dev_ndcg, dev_setup  # noqa: E402

from pyterrier_prob.atomic import atomic_write  # noqa: E402
from pyterrier_prob.training import Recipe, fine_tune  # noqa: E402
from st_extensions.defaults import default_model_path  # noqa: E402
from st_extensions.frozen import CachedEmbeddings, build_adapter_model, cached_model, encode_prefix  # noqa: E402
from st_extensions.losses import MaskedMultipleNegativesRankingLoss  # noqa: E402


class DevCurve(TrainerCallback):
    """Dev nDCG@10 every ``every`` steps, with the training seconds spent so far (evaluation time excluded)."""

    def __init__(self, every: int, evaluate, offset_s: float = 0.0) -> None:
        self.every, self.evaluate, self.offset = every, evaluate, offset_s
        self.curve: list[dict] = []
        self.train_s = 0.0
        self.t = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.train_s += time.perf_counter() - self.t
        if state.global_step % self.every == 0 or state.global_step == state.max_steps:
            self.curve.append(
                {"step": state.global_step, "train_s": self.offset + self.train_s, "dev_ndcg10": self.evaluate()}
            )
            print(json.dumps(self.curve[-1]), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default="irds:beir/nfcorpus")
    ap.add_argument("--full-steps", type=int, default=150)
    ap.add_argument("--frozen-steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--frozen-batch-size", type=int, default=64, help="batch of the second frozen arm (the recipe's)")
    ap.add_argument("--encoder-lr", type=float, default=5e-5)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--output", default="outputs/frozen_speed")
    args = ap.parse_args()
    os.makedirs(args.output, exist_ok=True)
    s = dev_setup(args.dataset)
    train, judged = s["train"], s["judged"]

    def evaluator(m):
        return lambda: dev_ndcg(m, False, s["dev"], s["docnos"], s["doc_texts"], s["dev_qrels"])

    out: dict = {"settings": vars(args)}
    # full fine-tuning
    torch.manual_seed(0)
    full = build_adapter_model(default_model_path())
    full.max_seq_length = 128
    cb = DevCurve(args.eval_every, evaluator(full))
    fine_tune(
        full,
        MaskedMultipleNegativesRankingLoss(full, judged=judged),
        train,
        Recipe(mode="full", steps=args.full_steps, batch_size=args.batch_size, learning_rate=args.encoder_lr),
        callbacks=[cb],
        show_progress=False,
    )
    out["full"] = {"curve": cb.curve, "s_per_step": cb.train_s / args.full_steps}
    # frozen: cache every training, dev and corpus text once (timed), then train the adapter only, at the same batch
    # size (per-step cost) and at the recipe's batch size (time to reach full fine-tuning's best dev score)
    texts = list(dict.fromkeys([*train["anchor"], *train["positive"], *s["dev"]["query"], *s["doc_texts"]]))
    base = build_adapter_model(default_model_path())
    base.max_seq_length = 128
    t0 = time.perf_counter()
    cache = CachedEmbeddings(texts, encode_prefix(base, texts, batch_size=64))
    cache_s = time.perf_counter() - t0
    for arm, batch in (("frozen", args.batch_size), ("frozen_recipe_batch", args.frozen_batch_size)):
        torch.manual_seed(0)
        frozen = build_adapter_model(default_model_path())
        frozen.max_seq_length = 128
        cb2 = DevCurve(args.eval_every * 4, evaluator(cached_model(frozen, cache=cache)), offset_s=cache_s)
        fine_tune(
            frozen,
            MaskedMultipleNegativesRankingLoss(frozen, judged=judged),
            train,
            Recipe(mode="frozen", steps=args.frozen_steps, batch_size=batch),
            encoder_cache=cache,
            callbacks=[cb2],
            show_progress=False,
        )
        out[arm] = {
            "batch_size": batch,
            "curve": cb2.curve,
            "cache_s": cache_s,
            "s_per_step": cb2.train_s / args.frozen_steps,
        }
    target = max(p["dev_ndcg10"] for p in cb.curve)
    first = {
        name: next((p["train_s"] for p in curve if p["dev_ndcg10"] >= target), None)
        for name, curve in [("full", cb.curve)] + [(a, out[a]["curve"]) for a in ("frozen", "frozen_recipe_batch")]
    }
    out["target_dev_ndcg10"] = target
    out["seconds_to_target"] = first
    out["s_per_step_ratio_frozen_over_full"] = out["frozen"]["s_per_step"] / out["full"]["s_per_step"]
    for arm in ("frozen", "frozen_recipe_batch"):
        if first[arm] is not None and first["full"]:
            out[f"time_to_target_ratio_{arm}_over_full"] = first[arm] / first["full"]
    atomic_write(os.path.join(args.output, "frozen_speed.json"), json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k not in ("full", "frozen")}, indent=1))
    print(f"s/step full {out['full']['s_per_step']:.3f}, frozen {out['frozen']['s_per_step']:.4f} (same batch)")


if __name__ == "__main__":
    main()
