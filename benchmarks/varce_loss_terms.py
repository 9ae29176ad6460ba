"""Which term of a VarCE student's loss moves which parameters: the gradient norms of
:class:`~st_extensions.losses.VariationalMarginMSELoss`'s Margin-MSE term and its variance NLL term, from one forward
pass per batch, on the head's mean path (mean branch and decoder), its variance branch and the encoder, with their
cosine on each; and the student's effective linear weights of E[s] on the kernel features (decoder @ mean branch)
beside a CE's. The model is in eval mode (no dropout), so the figures are deterministic.

The rows are the main run's own (``python benchmarks/gpu_students.py prepare --output <run> --bundle <bundle>``).

    python benchmarks/varce_loss_terms.py --checkpoint outputs/v52/models/distilled-VarCE-MEANVAR \\
        --bundle outputs/gpu-bundle --ce outputs/v52/models/distilled-CE
    python benchmarks/varce_loss_terms.py --table benchmarks/results/varce_loss_terms.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shlex
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks._machine

RESULT = "benchmarks/results/varce_loss_terms.json"
GROUPS = ("head: mean branch and decoder", "head: variance branch", "encoder")


def group_of(name: str) -> str:
    """The parameter group (of :data:`GROUPS`) that the parameter ``name`` belongs to."""
    if "mean_branch" in name or "decoder" in name:
        return GROUPS[0]
    return GROUPS[1] if "var_branch" in name else GROUPS[2]


def measure(checkpoint: str, bundle: str, batches: int, batch_size: int) -> dict:
    """Per batch of the bundle's first rows: both terms' values and, per parameter group, their gradient norms and
    cosine; and the model's E[s] weights on the kernel features."""
    import torch

    from st_extensions.loading import load_model
    from st_extensions.losses import VariationalMarginMSELoss

    torch.manual_seed(0)
    model = load_model(checkpoint)
    with gzip.open(os.path.join(bundle, "texts.json.gz"), "rt", encoding="utf8") as f:
        texts = json.load(f)
    rows = np.load(os.path.join(bundle, "rows.npz"))
    idx, label = rows["idx"], rows["label"]
    loss = VariationalMarginMSELoss(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    per_batch = []
    for b in range(batches):
        rs = slice(b * batch_size, (b + 1) * batch_size)
        inputs = [[texts[i] for i in idx[rs, j]] for j in range(idx.shape[1])]
        terms = loss.terms(inputs, torch.tensor(label[rs]).float())  # the loss's own terms, unweighted
        terms = {"margin_mse": terms["margin_mse"], "nll": terms["nll"]}
        grads = {}
        for t, term in terms.items():
            gs = torch.autograd.grad(term, [p for _, p in params], retain_graph=True, allow_unused=True)
            grads[t] = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params, gs)}
        found = {"margin_mse": float(terms["margin_mse"]), "nll": float(terms["nll"]), "groups": {}}
        for g in GROUPS:
            names = [n for n, _ in params if group_of(n) == g]
            v = {t: torch.cat([grads[t][n].flatten() for n in names]) for t in grads}
            both = bool(v["margin_mse"].norm() > 0 and v["nll"].norm() > 0)
            cos = float(torch.nn.functional.cosine_similarity(v["margin_mse"], v["nll"], dim=0)) if both else None
            found["groups"][g] = {
                "grad_norm_margin_mse": float(v["margin_mse"].norm()),
                "grad_norm_nll": float(v["nll"].norm()),
                "cosine": cos,
            }
        print(f"batch {b}: Margin-MSE {found['margin_mse']:.4f}, NLL {found['nll']:.4f}", flush=True)
        per_batch.append(found)
    head, dim = model[2], model[0].get_embedding_dimension()  # the bi-encoder path's columns come first
    effective = head.decoder.weight if head.mean_branch is None else head.decoder.weight @ head.mean_branch.weight
    kernels = effective[0].detach()[dim:]
    return {
        "per_batch": per_batch,
        "kernel_features": len(kernels),
        "kernel_weight_max_abs": float(kernels.abs().max()),
        "mean_branch_rate": getattr(head, "mean_branch_rate", None),
    }


def ce_kernel_weight(ce: str) -> float:
    """The largest |weight| of a CE student's linear head on the kernel features."""
    from st_extensions.loading import load_model

    model = load_model(ce)
    dim = model[0].get_embedding_dimension()
    return float(model[2].linear.weight[0].detach()[dim:].abs().max())


def table(result: dict) -> list[str]:
    """Markdown rows: per measured model and parameter group, the mean gradient norms and cosine over the batches."""
    from pyterrier_prob.experiments.report import cell

    lines = [
        "| model | parameters | grad norm, Margin-MSE | grad norm, NLL | NLL / Margin-MSE | cosine"
        " | E[s] max abs kernel weight |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, m in result["models"].items():
        for g in GROUPS:
            vals = [b["groups"][g] for b in m["per_batch"]]
            mse = float(np.mean([v["grad_norm_margin_mse"] for v in vals]))
            nll = float(np.mean([v["grad_norm_nll"] for v in vals]))
            coss = [v["cosine"] for v in vals if v["cosine"] is not None]
            cos = cell(float(np.mean(coss)) if coss else None, "+.3f")
            ratio = cell(nll / mse if mse > 0 else None, ".3g")
            weight = f"{m['kernel_weight_max_abs']:.3f}" if g == GROUPS[0] else ""
            lines.append(f"| {name} | {g} | {mse:.4g} | {nll:.4g} | {ratio} | {cos} | {weight} |")
    if result.get("ce_kernel_weight_max_abs") is not None:
        lines.append(f"| CE ({result['ce']}) | linear head | | | | | {result['ce_kernel_weight_max_abs']:.3f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", nargs="+", help="VarCE students' folders (checkpoints or saved models)")
    ap.add_argument("--bundle", help="gpu_students.py's bundle: the rows and their texts")
    ap.add_argument("--ce", help="a CE student of the same run, for its kernel weights")
    ap.add_argument("--batches", type=int, default=3, help="batches of --batch-size rows, the bundle's first ones")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--out", default=RESULT, help="where the JSON goes")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--table", metavar="JSON", help="print the table of a results file (no measurement)")
    a = ap.parse_args(argv)
    if a.table:
        from pyterrier_prob.experiments.report import print_json_table

        print_json_table(a.table, table)
        return
    if not a.checkpoint or not a.bundle:
        ap.error("--checkpoint and --bundle are needed to measure (or --table JSON to print a results file)")
    from benchmarks._machine import describe, write_result

    result = {
        "benchmark": __doc__.split("\n\n")[0].replace("\n", " "),
        "command": shlex.join(["python", "benchmarks/varce_loss_terms.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": describe(),
        "bundle": a.bundle,
        "batches": a.batches,
        "batch_size": a.batch_size,
        "models": {c: measure(c, a.bundle, a.batches, a.batch_size) for c in a.checkpoint},
        "ce": a.ce,
        "ce_kernel_weight_max_abs": ce_kernel_weight(a.ce) if a.ce else None,
    }
    print("\n".join(table(result)))
    if not a.no_write:
        write_result(a.out, result)
        print(f"written to {a.out}")


if __name__ == "__main__":
    main()
