"""DevCurve: points every few steps and at the end, the curve on disk, the best point's weights put back, and a
resumed run that keeps the points before it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pyterrier_prob.curves import DevCurve


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2))
        self.frozen = torch.nn.Parameter(torch.ones(1), requires_grad=False)


def _dev(model: _Model) -> float:
    """A dev measure that peaks at w[0] = 3."""
    return -float((model.w[0] - 3.0) ** 2)


def _train(curve: DevCurve, model: _Model, steps: int, start: int = 0) -> None:
    state = SimpleNamespace(global_step=start, max_steps=steps)
    curve.on_train_begin(None, state, None, model=model)
    for step in range(start + 1, steps + 1):
        curve.on_step_begin(None, state, None)
        with torch.no_grad():
            model.w += 1.0  # w[0] = step
        state.global_step = step
        curve.on_step_end(None, state, None, model=model)
    curve.on_train_end(None, state, None, model=model)


def test_points_file_and_best_weights_put_back(tmp_path):
    model = _Model()
    curve = DevCurve(2, _dev, path=tmp_path / "curve.json")
    _train(curve, model, 7)
    assert [p["step"] for p in curve.points] == [0, 2, 4, 6, 7]  # every 2 steps, the start and the last step
    assert [p["dev"] for p in curve.points] == [-9.0, -1.0, -1.0, -9.0, -16.0]
    assert curve.best_point()["step"] == 2  # the earliest of the tied best
    assert model.w.tolist() == [2.0, 2.0]  # the weights of step 2, not of step 7
    saved = json.loads((tmp_path / "curve.json").read_text())
    assert saved["points"] == curve.points and saved["best"]["step"] == 2
    assert (tmp_path / "curve.best.safetensors").is_file()


def test_keep_best_off_leaves_the_last_step():
    model = _Model()
    _train(DevCurve(3, _dev, keep_best=False, evaluate_at_start=False), model, 5)
    assert model.w.tolist() == [5.0, 5.0]


def test_a_resumed_run_keeps_the_points_before_it_and_the_best_weights(tmp_path):
    path = tmp_path / "curve.json"
    model = _Model()
    first = DevCurve(2, _dev, path=path)
    _train(first, model, 4)  # points 0, 2, 4; best at 2 (tied with 4, the earlier kept)
    with torch.no_grad():
        model.w.fill_(4.0)  # the checkpoint of step 4 the run resumes from
    second = DevCurve(2, _dev, path=path)
    _train(second, model, 8, start=4)
    assert [p["step"] for p in second.points] == [0, 2, 4, 6, 8]
    assert second.best_point()["step"] == 2
    assert model.w.tolist() == [2.0, 2.0]  # the best weights came from disk


def test_a_fresh_run_starts_a_new_curve(tmp_path):
    path = tmp_path / "curve.json"
    _train(DevCurve(2, _dev, path=path), _Model(), 4)
    again = DevCurve(3, _dev, path=path)
    _train(again, _Model(), 3)
    assert [p["step"] for p in again.points] == [0, 3]


def test_bad_every():
    with pytest.raises(ValueError, match="every must be an int >= 1"):
        DevCurve(0, _dev)


def test_patience_stops_after_evaluations_without_a_better_point():
    model = _Model()
    curve = DevCurve(1, _dev, patience=2)
    state = SimpleNamespace(global_step=0, max_steps=10)
    control = SimpleNamespace(should_training_stop=False)
    curve.on_train_begin(None, state, control, model=model)
    stopped_at = None
    for step in range(1, 11):
        with torch.no_grad():
            model.w += 1.0
        state.global_step = step
        curve.on_step_end(None, state, control, model=model)
        if control.should_training_stop:
            stopped_at = step
            break
    # dev peaks at step 3 (w[0] = 3); steps 4 and 5 are worse: the second of them stops the run
    assert stopped_at == 5 and curve.best_point()["step"] == 3
    with pytest.raises(ValueError, match="patience"):
        DevCurve(1, _dev, patience=0)
