"""fine_tune under torchrun: two CPU processes over gloo (batches of 4 each, candidates gathered across them) train the
same model as one process on batches of 8 — the same global batches, losses and weights."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from pyterrier_prob.data import judged_pairs, training_pairs
    from pyterrier_prob.training import Recipe, fine_tune
    from st_extensions import build_pebr_model

    folder, out, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model = build_pebr_model(sys.argv[4], family="beta", projection=True)
    model.max_seq_length = 32
    with torch.no_grad():  # a head that is not constant, so every anchor has its own temperature
        torch.nn.init.normal_(model[-1].linear.weight, std=0.02)
    from st_extensions.losses import BetaNCELoss

    loss = BetaNCELoss(model, judged=judged_pairs(folder, "train"))
    recipe = Recipe(mode="frozen", steps=6, batch_size=batch, gather_across_devices=True, head_learning_rate=1e-2)
    losses = fine_tune(model, loss, training_pairs(folder, "train"), recipe, show_progress=False)
    if int(os.environ.get("RANK", "0")) == 0:
        state = {k: v.tolist() for k, v in model.state_dict().items() if not k.startswith("0.")}
        json.dump({"losses": losses, "state": state}, open(out, "w"))
    """
)


@pytest.mark.slow
def test_torchrun_two_cpu_processes_train_as_one_process_on_the_whole_batch(tmp_path, small_beir, minilm_path):
    folder, _ = small_beir
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    subprocess.run([sys.executable, str(script), str(folder), str(one), "8", minilm_path], check=True, env=env)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533"]
    subprocess.run([*torchrun, str(script), str(folder), str(two), "4", minilm_path], check=True, env=env)
    a, b = json.loads(one.read_text()), json.loads(two.read_text())
    # the trainer logs the mean over ranks of each rank's loss: the loss of the global batch
    assert a["losses"] == pytest.approx(b["losses"], abs=1e-5) and len(a["losses"]) == 6
    assert set(a["state"]) == set(b["state"]) and a["state"]
    for k in a["state"]:  # the adapter and the head, trained at 1e-2 so that 6 steps move them
        torch.testing.assert_close(torch.tensor(a["state"][k]), torch.tensor(b["state"][k]), atol=1e-5, rtol=1e-4)
