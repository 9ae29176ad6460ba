"""The in-batch losses under DDP (``gather_across_devices=True``): two gloo processes on CPU, each with half of a fixed
global batch, against one process computing the loss on the whole batch.

DDP's objective is the mean over the ranks of each rank's loss, and it averages the gradients over the ranks. So for
every loss we check (a) mean_r loss_r == the single-process loss, (b) the gradients, all-reduced and averaged over the
ranks as DDP does, == the single-process gradients, for every parameter (encoder included). The batch carries a
``label`` column and JudgedPairs in which judged pairs cross the ranks both ways (and every row's own pair is judged,
as in real qrels, so a diagonal left at the local index would mask a positive), and a hard-negative column. One
process group of one, and no process group at all, must give exactly the loss without gathering.

Tolerances (float32): losses within 1e-5 (absolute, plus 1e-5 relative); gradients within atol 1e-5 + rtol 1e-4
(``torch.allclose``) -- the two computations differ only in summation order and padding lengths.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 2
B = 3  # rows per rank; the global batch is rank 0's rows, then rank 1's
QUERIES = ["vitamin d bones", "statin muscle pain", "breast cancer diet", "gut bacteria", "coffee heart", "sleep teens"]
TRIGGERS = ["vitamin d", "statins", "fat intake", "microbiome", "caffeine", "sleep"]
DOCS = [
    "Vitamin D improves bone density.",
    "Statins often cause muscle pain.",
    "Dietary fat and breast cancer risk.",
    "Gut microbes shape metabolism.",
    "Coffee and heart disease.",
    "Teenagers sleep too little.",
]
NEGS = ["Red meat and colon cancer.", "Exercise and mood.", "Salt and blood pressure.", "Sugar.", "Tea.", "Noise."]
NEGS2 = ["Smoking and lungs.", "Walking daily.", "Fish oil.", "Alcohol and liver.", "Green tea.", "Screen time."]
# every row's own pair (as in real qrels) plus pairs across the ranks (0 -> 4, 2 -> 3: rank 0 anchor, rank 1
# candidate; 4 -> 1: rank 1 anchor, rank 0 candidate) and one within a rank (1 -> 2)
CROSSING = [(QUERIES[0], DOCS[4]), (QUERIES[2], DOCS[3]), (QUERIES[4], DOCS[1]), (QUERIES[1], DOCS[2])]
JUDGED = [*zip(QUERIES, DOCS), *CROSSING]
LOSSES = ["mnrl", "exp", "beta", "beta_mle", "mol", "unierf", "unierf_frozen"]
LOSS_ATOL, LOSS_RTOL = 1e-5, 1e-5
GRAD_ATOL, GRAD_RTOL = 1e-5, 1e-4
SPAWN_TIMEOUT_S = 300


def _perturb(module: torch.nn.Module, std: float, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)


def _case(name: str, base):
    """``(model, make_loss(gather, judged), columns)`` for one loss; heads perturbed away from their neutral start."""
    from st_extensions import build_mol_model, build_pebr_model, build_unierf_model, find_mol, losses
    from st_extensions.frozen import build_adapter_model
    from st_extensions.losses import MaskedMultipleNegativesRankingLoss, MoLLoss, UniERFLoss
    from st_extensions.losses.unierf import FrozenDocumentTower

    torch.manual_seed(0)
    pairs = [QUERIES, DOCS, NEGS]
    if name == "mnrl":
        model = build_adapter_model(base)
        _perturb(model[-1], 0.02)
        return model, lambda g, j: MaskedMultipleNegativesRankingLoss(model, 5.0, j, gather_across_devices=g), pairs
    if name in ("exp", "beta", "beta_mle"):
        model = build_pebr_model(base, family=name)
        _perturb(model[-1], 0.05)
        cls = {"exp": losses.ExpNCELoss, "beta": losses.BetaNCELoss, "beta_mle": losses.BetaMLELoss}[name]
        return model, lambda g, j: cls(model, judged=j, gather_across_devices=g), pairs
    if name == "mol":
        model = build_mol_model(base, 2, 3, component_dim=8, component_source="heads", gate_features=True)
        _perturb(find_mol(model).gate_net, 1.0)
        return model, lambda g, j: MoLLoss(model, alpha=0.5, scale=15.0, judged=j, gather_across_devices=g), pairs
    model = build_unierf_model(base, branches=["semantic", "trigger"], init_std=0.05, seed=1, device="cpu")
    tower = FrozenDocumentTower(model, cache=False) if name == "unierf_frozen" else None
    columns = ["anchor_semantic", "anchor_trigger", "positive_doc", "negative_semantic", "negative_trigger"]

    def make(g, j):
        return UniERFLoss(model, columns=columns, document_tower=tower, judged=j, gather_across_devices=g)

    return model, make, [QUERIES, TRIGGERS, DOCS, NEGS, NEGS2]


def _params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in _params(model)])


def _run(model, loss_fn, columns, rows: slice, backward: bool = True):
    """Loss and flat gradient of ``loss_fn`` on ``rows`` of the batch."""
    from st_extensions.judged import pair_labels

    model.zero_grad(set_to_none=True)
    features = [model.preprocess(list(c[rows])) for c in columns]
    labels = torch.tensor(pair_labels(QUERIES[rows], DOCS[rows]))
    loss = loss_fn(features, labels)
    if not backward:
        return loss.detach(), None
    loss.backward()
    return loss.detach(), _grads(model)


def _worker(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    from st_extensions import default_model_path, load_model
    from st_extensions.judged import JudgedPairs

    base = load_model(default_model_path(), device="cpu")
    base.max_seq_length = 16
    judged = JudgedPairs(JUDGED)
    everything = slice(0, WORLD * B)
    timeout = timedelta(seconds=SPAWN_TIMEOUT_S)
    dist.init_process_group("gloo", init_method=f"file://{folder}/pg2", rank=rank, world_size=world, timeout=timeout)
    results, kept = {}, {}
    for name in LOSSES:
        model, make, columns = _case(name, base)
        model.eval()  # no dropout: the two computations must see the same network
        vector = torch.nn.utils.parameters_to_vector(_params(model)).detach()
        dist.broadcast(vector, 0)  # DDP starts every rank from rank 0's parameters
        torch.nn.utils.vector_to_parameters(vector, _params(model))
        loss, grads = _run(model, make(True, judged), columns, slice(rank * B, rank * B + B))
        losses = [torch.zeros_like(loss) for _ in range(world)]
        dist.all_gather(losses, loss)
        dist.all_reduce(grads)  # DDP: the gradients averaged over the ranks
        grads /= world
        if rank == 0:
            ref, ref_grads = _run(model, make(False, judged), columns, everything)
            encoder_grad = sum(float(p.grad.abs().sum()) for p in model[0].parameters() if p.grad is not None)
            diff = (grads - ref_grads).abs()
            local, _ = _run(model, make(False, judged), columns, slice(0, B), backward=False)
            unmasked, _ = _run(model, make(False, None), columns, everything, backward=False)
            results[name] = {
                "losses": [float(x) for x in losses],
                "ref": float(ref),
                "local": float(local),
                "unmasked": float(unmasked),
                # fp32 sums in another order: the absolute error scales with the gradient's magnitude
                "grad_close": bool(
                    torch.allclose(
                        grads, ref_grads, rtol=GRAD_RTOL, atol=max(GRAD_ATOL, 1e-6 * float(ref_grads.abs().max()))
                    )
                ),
                "grad_max_diff": float(diff.max()),
                "grad_max_ref": float(ref_grads.abs().max()),
                "encoder_grad": encoder_grad,
                "config": make(True, judged).get_config_dict(),
            }
            kept[name] = (model, make, columns, float(ref), ref_grads)
        del model
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return
    # one process: gathering is a no-op, exactly -- in a process group of one, and with no process group at all
    dist.init_process_group("gloo", init_method=f"file://{folder}/pg1", rank=0, world_size=1, timeout=timeout)
    try:
        for name, (model, make, columns, ref, ref_grads) in kept.items():
            loss, grads = _run(model, make(True, judged), columns, everything)
            results[name]["world1_equal"] = float(loss) == ref and torch.equal(grads, ref_grads)
    finally:
        dist.destroy_process_group()
    for name, (model, make, columns, ref, ref_grads) in kept.items():
        loss, grads = _run(model, make(True, judged), columns, everything)
        results[name]["no_group_equal"] = float(loss) == ref and torch.equal(grads, ref_grads)
    torch.save(results, Path(folder) / "results.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ddp")
    with pytest.MonkeyPatch.context() as mp_env:
        if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
            mp_env.setenv("GLOO_SOCKET_IFNAME", "lo")  # gloo on the loopback device (the children inherit it)
        context = mp.spawn(_worker, args=(WORLD, str(folder)), nprocs=WORLD, join=False)
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"the {WORLD} gloo processes did not finish within {SPAWN_TIMEOUT_S} s")
    return torch.load(folder / "results.pt")


@pytest.mark.parametrize("name", LOSSES)
def test_mean_over_ranks_is_the_single_process_loss(results, name):
    r = results[name]
    mean = sum(r["losses"]) / WORLD
    assert mean == pytest.approx(r["ref"], abs=LOSS_ATOL, rel=LOSS_RTOL), r
    # not vacuous: the ranks' losses differ, gathering changes a rank's loss, the cross-rank judged pairs matter
    assert abs(r["losses"][0] - r["losses"][1]) > 1e-4
    assert abs(r["local"] - r["losses"][0]) > 1e-4
    assert abs(r["unmasked"] - r["ref"]) > 1e-4
    assert r["config"]["gather_across_devices"] is True


@pytest.mark.parametrize("name", LOSSES)
def test_ddp_averaged_gradients_are_the_single_process_gradients(results, name):
    r = results[name]
    assert r["grad_close"], f"max |diff| {r['grad_max_diff']:.3g} (max |grad| {r['grad_max_ref']:.3g})"
    assert r["grad_max_ref"] > 1e-3
    assert r["encoder_grad"] > 0  # the comparison covers the encoder (all of it, through the gathered candidates)


@pytest.mark.parametrize("name", LOSSES)
def test_one_process_gathers_nothing(results, name):
    assert results[name]["world1_equal"]
    assert results[name]["no_group_equal"]
