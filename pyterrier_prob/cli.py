"""The ``pyterrier-prob`` command: the pEBR main job (:mod:`pyterrier_prob.experiment`).

By default, on irds:beir/nfcorpus with the packaged all-MiniLM-L6-v2: fine-tune a pEBR model (BetaNCE) and a
MultipleNegativesRankingLoss baseline with the same budget, index both and BM25 (PISA), calibrate the cutoffs
to matched mean depth k on dev, and compare BM25, top-k, score cutoff and CDF cutoff on test in
``pt.Experiment`` -- overall and per head/torso/tail stratum -- with Table 3 and Figure 2.
"""

from __future__ import annotations

import argparse
import sys

from pyterrier_prob.experiment import PebrJobConfig

_DEFAULTS = PebrJobConfig()


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="pyterrier-prob",
        description=(
            "pEBR main job: fine-tune a BetaNCE pEBR model and an MNRL baseline with the same budget, index them "
            "(and BM25 with PISA), calibrate top-k / score-cutoff / CDF-cutoff retrieval to matched mean depth k "
            "on the dev split, and compare them on the test split with pt.Experiment, overall and per stratum."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--dataset", default=_DEFAULTS.dataset, help="PyTerrier/ir_datasets id without the split")
    ap.add_argument("--train-split", default=_DEFAULTS.train_split)
    ap.add_argument("--dev-split", default=_DEFAULTS.dev_split, help="split the cutoffs are calibrated on")
    ap.add_argument("--test-split", default=_DEFAULTS.test_split, help="split the results are reported on")
    ap.add_argument("--model", default=None, help="base model name or path (default: packaged all-MiniLM-L6-v2)")
    ap.add_argument("--family", choices=["beta", "exp", "beta_mle"], default=_DEFAULTS.family, help="pEBR head")
    ap.add_argument("--steps", type=int, default=_DEFAULTS.steps, help="training steps (both models)")
    ap.add_argument("--batch-size", type=int, default=_DEFAULTS.batch_size)
    ap.add_argument("--lr", type=float, default=_DEFAULTS.lr)
    ap.add_argument("--max-seq-length", type=int, default=_DEFAULTS.max_seq_length, help="token budget per text")
    ap.add_argument("--seed", type=int, default=_DEFAULTS.seed)
    ap.add_argument(
        "--ks", type=int, nargs="+", default=list(_DEFAULTS.ks), help="matched mean depths (documents per query)"
    )
    ap.add_argument("--cap", type=int, default=_DEFAULTS.cap, help="most documents a cutoff retriever returns")
    ap.add_argument(
        "--geometry",
        choices=["line", "sphere"],
        default=_DEFAULTS.geometry,
        help="cosine law of the CDF cutoff: 1-D (Sec. 3.2, what the loss trains) or sphere-corrected (App. A)",
    )
    ap.add_argument(
        "--table3-ps", type=float, nargs="+", default=list(_DEFAULTS.table3_ps), help="CDF values of Table 3"
    )
    ap.add_argument("--output", default=_DEFAULTS.output, help="folder for models, indexes, tables and plots")
    ap.add_argument("--reuse", action="store_true", help="reuse models and indexes already in --output")
    ap.add_argument("--quiet", action="store_true", help="no progress output")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    cfg = PebrJobConfig(
        dataset=a.dataset,
        train_split=a.train_split,
        dev_split=a.dev_split,
        test_split=a.test_split,
        model=a.model,
        family=a.family,
        steps=a.steps,
        batch_size=a.batch_size,
        lr=a.lr,
        max_seq_length=a.max_seq_length,
        seed=a.seed,
        ks=tuple(a.ks),
        cap=a.cap,
        geometry=a.geometry,
        table3_ps=tuple(a.table3_ps),
        output=a.output,
        reuse=a.reuse,
        verbose=not a.quiet,
    )
    try:
        cfg.check()
    except ValueError as e:
        print(f"pyterrier-prob: {e}", file=sys.stderr)
        return 2
    from pyterrier_prob.experiment import run_pebr_job

    run_pebr_job(cfg)
    print(f"outputs written to {cfg.output}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
