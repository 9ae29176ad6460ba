"""Which term of a VarCE student's loss moves which parameters: the gradient norms of
:class:`~st_extensions.losses.VariationalMarginMSELoss`'s Margin-MSE term and its variance NLL term, from one forward
pass per batch, on the head's mean path (mean branch and decoder), its variance branch and the encoder, with their
cosine on each; and the student's effective linear weights of E[s] on the kernel features (decoder @ mean branch)
beside a CE's. The model is in eval mode (no dropout), so the figures are deterministic.

The rows are the main run's own (``python benchmarks/gpu_students.py prepare --output <run> --bundle <bundle>``).

    python benchmarks/varce_loss_terms.py --checkpoint outputs/v52/runs/distilled-VarCE-MEANVAR/checkpoint-600 \\
        --bundle outputs/gpu-bundle --ce outputs/v52/models/distilled-CE
"""

from __future__ import annotations

import argparse
import gzip
import json
import os

import numpy as np
import torch


def main() -> None:
    from st_extensions.loading import load_model
    from st_extensions.losses import VariationalMarginMSELoss

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a VarCE student's folder (a checkpoint or a saved model)")
    ap.add_argument("--bundle", required=True, help="gpu_students.py's bundle: the rows and their texts")
    ap.add_argument("--ce", help="a CE student of the same run, for its kernel weights")
    ap.add_argument("--batches", type=int, default=3, help="batches of --batch-size rows, the bundle's first ones")
    ap.add_argument("--batch-size", type=int, default=16)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = load_model(a.checkpoint)
    with gzip.open(os.path.join(a.bundle, "texts.json.gz"), "rt", encoding="utf8") as f:
        texts = json.load(f)
    rows = np.load(os.path.join(a.bundle, "rows.npz"))
    idx, label = rows["idx"], rows["label"]
    loss = VariationalMarginMSELoss(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = {
        "head: mean branch and decoder": lambda n: "mean_branch" in n or "decoder" in n,
        "head: variance branch": lambda n: "var_branch" in n,
    }
    groups["encoder"] = lambda n: not any(f(n) for f in list(groups.values())[:2])
    found: dict[str, list[tuple[float, float, float]]] = {g: [] for g in groups}
    for b in range(a.batches):
        rs = slice(b * a.batch_size, (b + 1) * a.batch_size)
        inputs = [[texts[i] for i in idx[rs, j]] for j in range(idx.shape[1])]
        labels = torch.tensor(label[rs]).float()
        terms = loss.terms(inputs, labels)  # the loss's own terms, unweighted
        terms = {"mse": terms["margin_mse"], "nll": terms["nll"]}
        grads = {}
        for t, term in terms.items():
            gs = torch.autograd.grad(term, [p for _, p in params], retain_graph=True, allow_unused=True)
            grads[t] = {n: torch.zeros_like(p) if g is None else g for (n, p), g in zip(params, gs)}
        print(f"batch {b}: Margin-MSE {float(terms['mse']):.4f}, NLL {float(terms['nll']):.4f}", flush=True)
        for g, picks in groups.items():
            names = [n for n, _ in params if picks(n)]
            v = {t: torch.cat([grads[t][n].flatten() for n in names]) for t in grads}
            both = bool(v["mse"].norm() > 0 and v["nll"].norm() > 0)
            cos = float(torch.nn.functional.cosine_similarity(v["mse"], v["nll"], dim=0)) if both else float("nan")
            found[g].append((float(v["mse"].norm()), float(v["nll"].norm()), cos))
    print("\n| parameters | grad norm, Margin-MSE | grad norm, NLL | cosine |\n|---|---|---|---|")
    for g, vals in found.items():
        m = np.array(vals)
        print(f"| {g} | {m[:, 0].mean():.4g} | {m[:, 1].mean():.4g} | {np.nanmean(m[:, 2]):+.3f} |")
    head, dim = model[2], model[0].get_word_embedding_dimension()  # the bi-encoder path's columns come first
    width = head.decoder.weight.shape[1]
    effective = head.decoder.weight if head.mean_branch is None else head.decoder.weight @ head.mean_branch.weight
    kernels = effective[0].detach()[dim:]
    top = float(kernels.abs().max())
    print(f"\nE[s]'s weights on the {len(kernels)} kernel features (of {width}): max |w| {top:.3f}")
    if a.ce:
        ce = load_model(a.ce)[2].linear.weight[0].detach()[dim:]
        print(f"the CE's: max |w| {float(ce.abs().max()):.3f}")


if __name__ == "__main__":
    main()
