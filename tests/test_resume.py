"""Resumable training: a run cut off after a checkpoint and resumed ends where an uninterrupted run ends, having seen
the same batches; an interrupted checkpoint write is skipped; the recipe round-trips and checks its fields."""

import os

import pytest
import torch
from transformers import TrainerCallback

from pyterrier_prob.training import Recipe, complete_checkpoints, fine_tune
from st_extensions.frozen import build_adapter_model
from st_extensions.losses import MaskedMultipleNegativesRankingLoss


class _Recording(MaskedMultipleNegativesRankingLoss):
    """The baseline loss, recording each training batch's anchor token ids (what the trainer fed it)."""

    def __init__(self, model, judged=None, seen=None):
        super().__init__(model, judged=judged)
        self.seen = seen if seen is not None else []

    def forward(self, sentence_features, labels):
        features = list(sentence_features)
        self.seen.append(tuple(map(tuple, features[0]["input_ids"].tolist())))
        return super().forward(features, labels)


class _Crash(TrainerCallback):
    """Kills the run (an exception, as an interruption) when the trainer reaches ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt(f"interrupted at step {self.step}")


def _train(base_model, rows, judged, recipe, out, resume=False, crash=None):
    torch.manual_seed(0)
    model = build_adapter_model(base_model)
    with torch.no_grad():  # a start that is not the identity, so the adapter's gradient is not trivially shared
        torch.nn.init.normal_(model[-1].linear.weight, std=0.02)
    seen: list = []
    loss = _Recording(model, judged=judged, seen=seen)
    callbacks = [_Crash(crash)] if crash else []
    try:
        losses = fine_tune(
            model, loss, rows, recipe, output_dir=str(out), resume=resume, show_progress=False, callbacks=callbacks
        )
    except KeyboardInterrupt:
        losses = None
    return model, seen, losses


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["frozen", "full"])
def test_interrupted_run_resumes_to_the_same_weights_and_batches(mode, base_model, small_beir, tmp_path):
    """24 training queries in batches of 8: 3 batches an epoch; 10 steps cross three epoch boundaries; the run is cut
    at step 6 after the checkpoint of step 4 (one batch into the second epoch), and a half-written checkpoint of step
    8 is left behind. Tolerance: frozen exact to 1e-6; full (dropout on, the trainer restores the RNG) 1e-5."""
    from pyterrier_prob.collections import load_collection
    from pyterrier_prob.data import judged_pairs, training_pairs

    coll = load_collection(small_beir[0])
    rows = training_pairs(coll, "train")
    judged = judged_pairs(coll, "train")
    recipe = Recipe(mode=mode, steps=10, batch_size=8, learning_rate=1e-4, checkpoint_every=4, checkpoint_limit=2)
    whole, seen_whole, _ = _train(base_model, rows, judged, recipe, tmp_path / "whole")
    assert len(seen_whole) == 10
    epochs = [seen_whole[i : i + 3] for i in (0, 3, 6)]
    for epoch in epochs:  # distinct queries over an epoch; epochs differ in order
        assert len({a for batch in epoch for a in batch}) == 24
    assert epochs[0] != epochs[1]

    out = tmp_path / "cut"
    _, seen_cut, losses = _train(base_model, rows, judged, recipe, out, crash=6)
    assert losses is None and len(seen_cut) == 6
    assert [os.path.basename(p) for p in complete_checkpoints(str(out))] == ["checkpoint-4"]
    (out / "checkpoint-8").mkdir()  # a checkpoint whose write was cut off: no completion marker
    (out / "checkpoint-8" / "model.safetensors").write_bytes(b"partial")
    resumed, seen_resumed, losses = _train(base_model, rows, judged, recipe, out, resume=True)
    assert seen_cut[:4] + seen_resumed == seen_whole  # the same batches, in the same order
    assert len(losses) >= 6
    tol = 1e-6 if mode == "frozen" else 1e-5
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, atol=tol, rtol=0, msg=f"{name} differs after resuming")
    # the limit keeps the newest 2: step 8 (rewritten by the resumed run, complete this time) and the last step
    assert [os.path.basename(p) for p in complete_checkpoints(str(out))] == ["checkpoint-8", "checkpoint-10"]
    assert sorted(k for k in os.listdir(out) if k.startswith("checkpoint-")) == ["checkpoint-10", "checkpoint-8"]
    assert Recipe.load(str(out / "recipe.json")) == recipe


def test_resume_under_another_recipe_is_refused(base_model, small_beir, tmp_path):
    from pyterrier_prob.collections import load_collection
    from pyterrier_prob.data import training_pairs

    rows = training_pairs(load_collection(small_beir[0]), "train")
    recipe = Recipe(mode="frozen", steps=4, batch_size=8, checkpoint_every=2)
    _train(base_model, rows, None, recipe, tmp_path)
    other = Recipe(mode="frozen", steps=4, batch_size=8, checkpoint_every=2, seed=1)
    with pytest.raises(ValueError, match="another recipe.*seed"):
        _train(base_model, rows, None, other, tmp_path, resume=True)


def test_recipe_checks_and_round_trips(tmp_path):
    r = Recipe(mode="partial", train_layers=2, steps=5, module_learning_rates={"LinearAdapter": 0.0})
    r.save(str(tmp_path / "r.json"))
    assert Recipe.load(str(tmp_path / "r.json")) == r
    with pytest.raises(ValueError, match="train_layers"):
        Recipe(mode="partial")
    with pytest.raises(ValueError, match="train_layers"):
        Recipe(mode="full", train_layers=2)
    with pytest.raises(ValueError, match="mode"):
        Recipe(mode="half")
    with pytest.raises(ValueError, match="batch_size"):
        Recipe(batch_size=1)
    with pytest.raises(ValueError, match="unknown Recipe fields"):
        Recipe.from_dict({"mode": "frozen", "epochs": 3})
    with pytest.raises(ValueError, match="output_dir"):
        fine_tune(None, None, None, Recipe(checkpoint_every=10))


def test_sampler_epoch_is_set_through_accelerates_wrappers():
    """A multi-process run resumed mid-epoch: the trainer's data loader holds accelerate's SkipBatchSampler over a
    BatchSamplerShard over our sampler; the callback finds the sampler and sets the epoch the trainer is in, so the
    resumed rank draws the rest of that epoch's batches (not epoch 0's)."""
    from types import SimpleNamespace

    from accelerate.data_loader import BatchSamplerShard, SkipBatchSampler
    from datasets import Dataset

    from pyterrier_prob.training import _SamplerEpoch
    from st_extensions.sampler import QueryBalancedBatchSampler

    rows = Dataset.from_dict({"anchor": [f"q{i}" for i in range(16)], "positive": [f"d{i}" for i in range(16)]})
    sampler = QueryBalancedBatchSampler(rows, batch_size=4, drop_last=True, world_size=2)
    shard = BatchSamplerShard(sampler, num_processes=2, process_index=1)
    sampler.set_epoch(2)
    expected = list(shard)  # rank 1's batches of epoch 2
    assert len(expected) == 2

    class Loader:
        batch_sampler = SkipBatchSampler(shard, skip_batches=1)

        def __len__(self) -> int:
            return 2  # optimizer steps per epoch on each rank

    sampler.set_epoch(0)
    args, state = SimpleNamespace(gradient_accumulation_steps=1), SimpleNamespace(global_step=5)
    _SamplerEpoch().on_epoch_begin(args, state, None, train_dataloader=Loader())
    assert sampler.epoch == 2
    assert list(Loader.batch_sampler) == expected[1:]
