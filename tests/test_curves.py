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
    return -float((model.w[0].detach() - 3.0) ** 2)


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
    with pytest.raises(ValueError, match="every must be a positive int"):
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


# ---- the harness's dev curves (--dev-every, --patience) and DevRetrieval


def test_dev_retrieval_ranks_the_pool_exactly():
    import pandas as pd

    from pyterrier_prob.curves import DevRetrieval

    topics = pd.DataFrame({"qid": ["1", "2"], "query": ["a", "b"]})
    qrels = pd.DataFrame({"qid": ["1", "2"], "docno": ["d1", "d2"], "label": [1, 1]})
    pool = {"d1": "x", "d2": "y", "d3": "z"}

    def score(model, t, texts):  # query 1 ranks d1 first; query 2 ranks d2 last
        assert list(t["qid"]) == ["1", "2"] and texts == ["x", "y", "z"]
        return [[3.0, 2.0, 1.0], [3.0, 1.0, 2.0]]

    assert DevRetrieval(topics, qrels, pool, "nDCG@10", score)(None) == pytest.approx((1.0 + 0.5) / 2)
    assert DevRetrieval(topics, qrels, pool, "R@100", score)(None) == 1.0


class _Scripted:
    """A dev measure that returns scripted values (the real one is computed too) and keeps each point's weights."""

    def __init__(self, real, values):
        self.real, self.values, self.weights, self.measure = real, list(values), [], "nDCG@10"

    def __call__(self, model):
        assert 0.0 <= self.real(model) <= 1.0
        self.weights.append(model[-1].linear.weight.detach().clone())
        return self.values[len(self.weights) - 1]


def test_harness_training_stops_on_patience_and_keeps_the_best_steps_weights(small_beir, tmp_path):
    from functools import partial

    from pyterrier_prob.experiments.harness import CommonConfig, Harness, TrainingPairs
    from st_extensions import default_model_path, load_model
    from st_extensions.frozen import build_adapter_model
    from st_extensions.losses import MaskedMultipleNegativesRankingLoss

    cfg = CommonConfig(dataset=str(small_beir[0]), output=str(tmp_path / "o"), quiet=True, steps=10, batch_size=4)
    cfg.dev_every, cfg.patience, cfg.lr = 1, 1, 1e-2
    h = Harness("t", cfg)
    data = h.load_data()
    pairs = TrainingPairs(data, 0)
    dev = _Scripted(h.dev_evaluator(data, "nDCG@10"), [0.1, 0.5, 0.2, 0.9])
    build = partial(build_adapter_model, load_model(str(default_model_path()), device="cpu"))
    model, _ = h.train(
        "sys", build, lambda m: MaskedMultipleNegativesRankingLoss(m, judged=pairs.judged), pairs, dev=dev
    )
    assert len(dev.weights) == 3  # steps 0, 1 (best), 2 (worse: patience 1 stops the run)
    assert not torch.equal(dev.weights[1], dev.weights[2])
    assert torch.equal(model[-1].linear.weight, dev.weights[1])  # the best step's weights are kept ...
    saved = load_model(h.path("models", "sys"), device="cpu")
    assert torch.equal(saved[-1].linear.weight, dev.weights[1])  # ... and saved
    curve = h.finish("t", "", {}, {}, data)["dev_curves"]["sys"]
    assert curve["best_step"] == 1 and curve["best_dev"] == 0.5 and curve["stopped_by"] == "patience"
    assert curve["measure"] == "nDCG@10" and curve["evaluations"] == 3

    # a retrain of the same name that is killed rewrites the curve (step 0 only); reusing the saved model puts the
    # curve that led to its weights back
    path = tmp_path / "o" / "curves" / "sys.json"
    trained = json.loads(path.read_text())
    assert [p["step"] for p in trained["points"]] == [0, 1, 2]
    path.write_text(json.dumps({"points": trained["points"][:1], "best": trained["points"][0]}))
    cfg.reuse = True
    again = Harness("t", cfg)
    again.train("sys", build, lambda m: MaskedMultipleNegativesRankingLoss(m, judged=pairs.judged), pairs, dev=dev)
    assert "sys" not in again._fresh and json.loads(path.read_text()) == trained  # reused, its curve restored


def test_resume_continues_only_checkpoints_of_the_same_settings(tmp_path):
    """``--resume`` trusts a run folder without ``settings.json`` (as before), continues one made with the same
    settings, and trains afresh (checkpoints dropped by ``fine_tune(resume=False)``) after the settings changed, e.g.
    a head's learning rate that the recipe does not hold."""
    from pyterrier_prob.experiments.harness import CommonConfig, Harness

    h = Harness("t", CommonConfig(output=str(tmp_path / "o"), quiet=True))
    wanted = {"variant": "MEANVAR", "mean_branch_rate": "head rate / width"}
    assert h._resumable("m", wanted)  # no settings.json yet: trusted
    saved = tmp_path / "o" / "runs" / "m" / "settings.json"
    assert json.loads(saved.read_text()) == wanted
    assert h._resumable("m", dict(wanted))
    assert not h._resumable("m", {"variant": "MEANVAR"})  # the head's rate changed: afresh
    assert json.loads(saved.read_text()) == {"variant": "MEANVAR"}
    assert h._resumable("m", {"variant": "MEANVAR"})


def test_dev_options_are_checked():
    from pyterrier_prob.experiments.harness import CommonConfig

    for flag in ("dev_every", "patience"):
        with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} must be a positive int"):
            CommonConfig(**{flag: 0}).check()


def test_kept_untrained_names_curves_whose_best_point_is_the_start():
    from pyterrier_prob.experiments.report import kept_untrained

    curves = {
        "a": {"best_step": 0, "evaluations": 3},  # curve_summaries' entry: never beat the start
        "b": {"best_step": 20, "evaluations": 3},
        "c": {"best_step": 0, "evaluations": 1},  # only the start evaluated: nothing to beat
        "d": {"points": [{"step": 0}, {"step": 5}], "best": {"step": 0}},  # a saved curve
        "e": {"points": [{"step": 0}, {"step": 5}], "best": {"step": 5}},
    }
    assert kept_untrained(curves) == ["a", "d"]
