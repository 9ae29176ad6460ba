"""``pyterrier-prob unierf``: options, settings checks, the frozen document tower, and tiny end-to-end runs."""

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from helpers import assert_same_figures, cli_help, pisa_threads_finish_backwards

import pyterrier_prob.experiments.unierf as unierf_experiment
from pyterrier_prob.cli import main
from st_extensions import build_unierf_model
from st_extensions.losses import UniERFLoss
from st_extensions.losses.unierf import FrozenDocumentTower
from st_extensions.unierf import unierf_columns

BRANCHES = ("semantic", "trigger")


def test_help_lists_the_options(capsys):
    out = cli_help(capsys, "unierf", "--budgets --ablations --doc-tower --alpha --low-alpha --head-lr --dev-quotas")
    assert "pyterrier-prob unierf" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--budgets", "1"], "--budgets must be integers >= 2"),
        (["--budgets", "10", "10"], "--budgets must be distinct"),
        (["--alpha", "1.5"], "--alpha must lie in [-1, 1)"),
        (["--low-alpha", "nan"], "--low-alpha must lie in [-1, 1)"),
        (["--head-lr", "0"], "--head-lr must be finite and > 0"),
        (["--head-lr", "inf"], "--head-lr must be finite and > 0"),
        (["--steps", "-1"], "--steps must be >= 0"),
        (["--test-split", "dev", "--dev-split", "dev"], "must differ from the train and dev splits"),
        (["--dev-quotas", "--doc-tower", "joint"], "--dev-quotas searches the dev queries"),
        (["--doc-tower", "joint"], "which --recipe frozen keeps frozen"),  # frozen: the default recipe
        (["--doc-tower", "joint", "--recipe", "frozen", "--steps", "2"], "use --recipe partial or full"),
        (["--alpha-grid", "0.3", "1.2"], "--alpha-grid must lie in [-1, 1)"),
        (["--alpha-grid", "0.3", "0.3"], "--alpha-grid takes two or more distinct alphas"),
        (["--alpha-grid", "0.3"], "--alpha-grid takes two or more distinct alphas"),
        (["--alpha-grid", "0.3", "0.6"], "--alpha-grid chooses alpha on the dev curves"),  # frozen, no --dev-every
    ],
)
def test_bad_settings_are_refused(argv, message, capsys):
    assert main(["unierf", *argv]) == 2
    assert message in capsys.readouterr().err


def test_joint_doc_tower_needs_a_recipe_that_trains_the_encoder():
    """``--doc-tower joint`` is accepted where the encoder trains (partial, full) or nothing trains (--steps 0)."""
    from pyterrier_prob.cli import build_parser
    from pyterrier_prob.experiments.unierf import config_from_args

    for argv in (["--recipe", "full"], ["--recipe", "partial", "--train-layers", "1"], ["--steps", "0"]):
        config_from_args(build_parser("unierf").parse_args(["--doc-tower", "joint", *argv])).check()


def test_unknown_choices_are_refused():
    for argv in (["--ablations", "some"], ["--doc-tower", "liquid"]):
        with pytest.raises(SystemExit) as e:
            main(["unierf", *argv])
        assert e.value.code == 2


# --------------------------------------------------------------------------------------------------------------
# the frozen document tower
# --------------------------------------------------------------------------------------------------------------

TEXTS = {
    "anchor_semantic": ["vitamin d and bones", "statins and cholesterol", "green tea"],
    "anchor_trigger": ["vitamin d [SEP] a bone study", "statins [SEP] lipid trial", "green tea [SEP] cancer"],
    "positive_doc": ["Vitamin D supplements and bone density.", "Statin use lowers LDL.", "Tea catechins."],
    "negative_random": ["Gardening in spring.", "Weather of the week.", "A note on trains."],
    "negative_semantic": ["Bone broth recipes.", "Cholesterol in eggs.", "Green vegetables."],
    "negative_trigger": ["Coffee and sleep.", "Salt and blood pressure.", "Soy and hormones."],
}


@pytest.fixture
def unierf_model(base_model):
    model = build_unierf_model(base_model, branches=BRANCHES, seed=0, device="cpu")
    model.max_seq_length = 32
    return model


def _batch(model, columns):
    return [model.preprocess(TEXTS[c]) for c in columns]


def test_frozen_tower_documents_get_no_gradient_and_equal_the_frozen_encoder(unierf_model):
    columns = unierf_columns(BRANCHES)
    start = {n: p.detach().clone() for n, p in unierf_model.named_parameters()}
    tower = FrozenDocumentTower(unierf_model, cache=False)  # every batch through the frozen copy
    loss = UniERFLoss(unierf_model, columns=columns, document_tower=tower)
    assert not any(p is q for p in loss.parameters() for q in tower.encoder.parameters())  # the trainer never sees it
    unierf_model.train()
    branch_emb, positives, negatives, _ = loss.embed(_batch(unierf_model, columns))
    for docs in (positives, *negatives):
        assert not docs.requires_grad and docs.grad_fn is None
    assert all(e.requires_grad for e in branch_emb.values())  # the query tower trains
    unierf_model.eval()
    for c, docs in zip(columns[2:], (positives, *negatives)):
        want = unierf_model.encode_document(TEXTS[c], convert_to_tensor=True, normalize_embeddings=True)
        torch.testing.assert_close(docs, want, atol=1e-5, rtol=0)

    # a training step moves the encoder; the documents keep the start model's embeddings
    unierf_model.train()
    value = loss(_batch(unierf_model, columns))
    value.backward()
    assert all(p.grad is None for p in tower.encoder.parameters())
    encoder_grads = [p.grad for n, p in unierf_model.named_parameters() if "heads" not in n]
    assert any(g is not None and g.abs().sum() > 0 for g in encoder_grads)
    with torch.no_grad():
        for p in unierf_model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    _, again, _, _ = loss.embed(_batch(unierf_model, columns))
    torch.testing.assert_close(again, positives)
    assert any(not torch.equal(p, start[n]) for n, p in unierf_model.named_parameters())


def test_frozen_tower_prime_and_cache(unierf_model):
    docs = [t for c in ("positive_doc", "negative_random") for t in TEXTS[c]]
    vecs = unierf_model.encode_document(docs, convert_to_numpy=True, normalize_embeddings=True)
    tower = FrozenDocumentTower(unierf_model)
    assert tower.prime(docs, vecs) == len(docs)
    out = tower.embed_columns(_batch(unierf_model, ["positive_doc", "negative_random"]))
    assert tower.stats["computed"] == 0 and tower.stats["hits"] == len(docs)  # read from the primed vectors
    np.testing.assert_allclose(torch.cat(out).numpy(), vecs, atol=1e-6)
    tower.embed(unierf_model.preprocess(TEXTS["negative_semantic"]))
    assert tower.stats["computed"] == 3
    tower.embed(unierf_model.preprocess(TEXTS["negative_semantic"][::-1]))
    assert tower.stats["computed"] == 3  # cached
    with pytest.raises(ValueError, match="differ from the frozen encoder"):
        FrozenDocumentTower(unierf_model).prime(docs, np.roll(vecs, 1, axis=0))
    with pytest.raises(ValueError, match="one vector per text"):
        tower.prime(docs, vecs[:2])


def test_ignore_columns_skips_them(unierf_model, base_model):
    columns = unierf_columns(BRANCHES)
    hard = ["negative_semantic", "negative_trigger"]
    full = UniERFLoss(unierf_model, columns=columns[:4])
    skip = UniERFLoss(unierf_model, columns=columns, ignore_columns=hard)
    assert skip.layout == full.layout and skip.get_config_dict()["ignore_columns"] == hard
    unierf_model.eval()
    with torch.no_grad():
        a = full.loss_terms(_batch(unierf_model, columns[:4]))
        b = skip.loss_terms(_batch(unierf_model, columns))
    for name in a:
        torch.testing.assert_close(a[name], b[name])
    single = build_unierf_model(base_model, branches=("semantic",), device="cpu")
    UniERFLoss(single, columns=columns, ignore_columns=["anchor_trigger", "negative_trigger"])  # one-branch model
    with pytest.raises(ValueError, match="needs columns"):
        UniERFLoss(unierf_model, ignore_columns=hard)
    with pytest.raises(ValueError, match="not among the columns"):
        UniERFLoss(unierf_model, columns=columns, ignore_columns=["negative_context"])
    with pytest.raises(ValueError, match="batch has 4 input columns"):
        skip.loss_terms(_batch(unierf_model, columns[:4]))


# --------------------------------------------------------------------------------------------------------------
# end to end
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["frozen", "full"])
def test_tiny_run_trains_ablations_on_identical_batches(recipe, tmp_path, small_beir, capfd, monkeypatch):
    folder, info = small_beir
    out = tmp_path / "unierf"
    argv = [
        "unierf",
        "--recipe",
        recipe,
        "--dataset",
        str(folder),
        "--steps",
        "2",
        "--batch-size",
        "4",
        "--max-seq-length",
        "32",
        "--budgets",
        "10",
        "20",
        "--output",
        str(out),
        "--quiet",
    ]
    assert main(argv) == 0
    assert "results written to" in capfd.readouterr().out
    results = pd.read_csv(out / "results.csv")
    trained = ["UniERF (all)", "w/o L_div", "w/o diff. negatives", "w/o L_div / diff-sam"]
    expected = [f"{s}: merged" for s in trained] + [
        f"{s}: {b} branch alone" for s in ("UniERF (all)", "untrained") for b in BRANCHES
    ]
    expected += ["untrained: merged", "BM25"]
    assert sorted(results["name"]) == sorted(expected)
    assert results["name"].iloc[0] == "UniERF (all): merged"  # the t-test baseline
    for b in (10, 20):
        assert results[f"R@{b}"].between(0, 1).all()
        p = results[f"R@{b} p-value"]
        assert np.isnan(p.iloc[0]) and p.iloc[1:].dropna().between(0, 1).all() and p.iloc[1:].notna().any()
    r = results.set_index("name")
    assert (r["R@20"] >= r["R@10"] - 1e-12).all()

    overlap = pd.read_csv(out / "overlap.csv").set_index("system")
    assert sorted(overlap.index) == sorted([*trained, "untrained"])
    for col in ("J@5", "J@10", "both@10", "both@20"):
        assert overlap[col].between(0, 1).all()
    assert overlap["cos(H_sem, H_trig)"].between(-1, 1).all()

    summary = json.loads((out / "summary.json").read_text())
    assert summary["experiment"] == "unierf" and summary["trained"] == trained
    assert summary["identical_batches"] is True and len(set(summary["batch_fingerprints"].values())) == 1
    if recipe == "full":  # the default --doc-tower frozen: a FrozenDocumentTower serves the documents
        assert summary["frozen_tower"]["computed"] == 0 and summary["frozen_tower"]["hits"] > 0
    else:  # the frozen recipe freezes the whole encoder: documents come from the run's encoder cache
        assert summary["frozen_tower"] is None
    assert summary["training_rows"] == 2 * 2 * 4
    assert summary["training"]["w/o diff. negatives"]["columns"] == unierf_columns(BRANCHES)[:4]
    assert summary["data"]["n_test_queries"] == info["queries"]["test"]
    assert all(len(v["loss_first_last_10"]) == 2 for v in summary["training"].values())
    for name in ("results.md", "results.csv", "overlap.csv", "training.csv"):
        assert (out / name).stat().st_size > 0
    assert "UniERF (all): merged" in (out / "results.md").read_text()

    # --reuse: the saved models and index are read back and give the same numbers
    with pisa_threads_finish_backwards():
        assert main([*argv, "--reuse"]) == 0
    again = pd.read_csv(out / "results.csv")
    assert_same_figures(again, results)
    reused = json.loads((out / "summary.json").read_text())
    assert all(v["reused"] for v in reused["training"].values())
    # what the trainings recorded is saved beside the models: the reused ones report it as the first run did
    assert reused["batch_fingerprints"] == summary["batch_fingerprints"] and reused["identical_batches"] is True
    for name, first in summary["training"].items():
        for key in ("branch_cos", "share_above_alpha", "diversity_term"):
            assert reused["training"][name][f"{key}_first_last_10"] == first[f"{key}_first_last_10"]
    assert "the same batches for every system: yes" in (out / "results.md").read_text()
    if recipe == "full":
        shutil.rmtree(out / "models" / "unierf-nodiv")
        (out / "runs" / "unierf-nodiv" / "checkpoint-1").mkdir(parents=True)  # incomplete: trains from step 0
        first = summary["batch_fingerprints"]["w/o L_div"]
        assert main([*argv, "--resume"]) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert not summary["training"]["w/o L_div"]["reused"] and summary["batch_fingerprints"]["w/o L_div"] == first
        # a training that resumes from a complete checkpoint sees only its last batches: they are not compared
        shutil.rmtree(out / "models" / "unierf-nodiv")
        monkeypatch.setattr(unierf_experiment, "complete_checkpoints", lambda folder: [f"{folder}/checkpoint-1"])
        assert main([*argv, "--resume"]) == 0
        summary = json.loads((out / "summary.json").read_text())
        assert not summary["training"]["w/o L_div"]["reused"] and "w/o L_div" not in summary["batch_fingerprints"]
        assert summary["identical_batches"] is None
        assert "the same batches for every system: not checked" in (out / "results.md").read_text()


@pytest.mark.slow
def test_steps_0_on_a_test_only_collection_evaluates_the_start_model(tmp_path, small_beir_no_train_no_dev):
    folder, info = small_beir_no_train_no_dev
    out = tmp_path / "unierf0"
    argv = ["unierf", "--dataset", str(folder), "--max-seq-length", "32", "--budgets", "6", "--output", str(out)]
    assert main([*argv, "--quiet"]) == 0
    results = pd.read_csv(out / "results.csv")
    assert list(results["name"]) == [
        "untrained: merged",
        "untrained: semantic branch alone",
        "untrained: trigger branch alone",
        "BM25",
    ]
    assert results["R@6"].between(0, 1).all()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trained"] == [] and summary["frozen_tower"] is None
    assert summary["data"]["n_test_queries"] == info["queries"]["test"]  # every test query: nothing is calibrated
    assert summary["data"]["train"] is None


@pytest.mark.slow
def test_dev_quotas_choose_the_trigger_share_on_dev_and_report_it(tmp_path, small_beir):
    folder, _ = small_beir
    out, claims = tmp_path / "unierf-q", tmp_path / "claims.json"
    argv = ["unierf", "--dataset", str(folder), "--steps", "2", "--batch-size", "4", "--max-seq-length", "32"]
    argv += ["--budgets", "6", "100", "--ablations", "none", "--dev-quotas", "--output", str(out), "--quiet"]
    assert main([*argv, "--claims-json", str(claims)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["cpu"]["threads"] >= 1 and isinstance(summary["cpu"]["batch_scheduled"], bool)
    results = pd.read_csv(out / "results.csv").set_index("name")
    equal = results.loc["UniERF (all): merged"]
    for b in (6, 100):
        chosen = summary["dev_quotas"][str(b)]
        dev = chosen[f"dev_R@{b}"]
        assert sorted(map(float, dev)) == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
        best = max(dev.values())
        tied = [float(w) for w, v in dev.items() if v == best]
        assert chosen["trigger_share"] == min(tied, key=lambda w: abs(w - 0.5))  # the dev argmax, nearest 0.5
        assert chosen["dev_queries"] == summary["data"]["n_calibration_queries"]
        value = results.loc["UniERF (all): merged, dev quotas", f"R@{b}"]
        assert 0 <= value <= 1 and not np.isnan(results.loc["UniERF (all): merged, dev quotas", f"R@{b} p-value"])
        if chosen["trigger_share"] == 0.5:  # the equal merge: the same lists
            assert value == equal[f"R@{b}"]
    assert "merged with the trigger branch's share of B chosen on" in (out / "results.md").read_text()
    rows = {r["claim"]: r for r in json.loads(claims.read_text())["rows"]}
    plain, quotas = rows["merged_vs_best_branch"], rows["merged_dev_quotas_vs_best_branch"]
    assert quotas["baseline"] == plain["baseline"] and quotas["baseline_value"] == plain["baseline_value"]
    assert quotas["system"] == "UniERF (all): merged, dev quotas"
    assert quotas["value"] == pytest.approx(results.loc["UniERF (all): merged, dev quotas", "R@100"])
    # every claims figure is in the run's own JSON too (the claims file adds the run's recipe, device and command)
    own = {r["claim"]: r for r in summary["claims"]}
    assert own.keys() == rows.keys()
    assert all(rows[c][k] == v for c, r in own.items() for k, v in r.items())


def test_alpha_grid_chooses_on_dev_and_reports_every_alpha(tmp_path, small_beir):
    """--alpha-grid: one UniERF (all) per alpha, the best dev point (the curves on disk) names the chosen one, the
    ablation trains at the chosen alpha and every alpha's model has its test row."""
    folder, _ = small_beir
    out = tmp_path / "unierf-grid"
    argv = ["unierf", "--dataset", str(folder), "--steps", "2", "--batch-size", "4", "--max-seq-length", "32"]
    argv += ["--budgets", "6", "--ablations", "table2", "--alpha-grid", "0.2", "0.6", "--dev-every", "1"]
    assert main([*argv, "--output", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    grid = summary["alpha_grid"]
    best = {a: json.loads((out / "curves" / f"unierf-all-a{a}.json").read_text())["best"] for a in ("0.2", "0.6")}
    assert {a: v["dev_R@100"] for a, v in grid.items()} == {a: b["dev"] for a, b in best.items()}
    chosen = max(best, key=lambda a: (round(best[a]["dev"], 12), -abs(float(a) - 0.6)))
    assert [a for a, v in grid.items() if v["chosen"]] == [chosen] and summary["alpha"] == float(chosen)
    other = next(a for a in grid if a != chosen)
    assert grid[other]["system"] == f"UniERF (all) at alpha {other}"
    names = set(pd.read_csv(out / "results.csv")["name"])
    assert {"UniERF (all): merged", f"UniERF (all) at alpha {other}: merged"} <= names
    info = summary["training"]
    assert info["UniERF (all)"]["alpha"] == float(chosen) and info["w/o diff. negatives"]["alpha"] == float(chosen)
    assert "alpha chosen on dev" in (out / "results.md").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(
    "options", [["--dev-quotas"], ["--recipe", "partial", "--train-layers", "1", "--dev-every", "1"]]
)
def test_nothing_to_train_holds_back_no_test_query_for_dev(options, tmp_path, small_beir_no_train_no_dev):
    """On a collection without a train split nothing trains, so nothing is chosen on dev: every test query is
    reported (no seeded half is held back as dev queries) and --dev-quotas says that it chose nothing."""
    folder, info = small_beir_no_train_no_dev
    out = tmp_path / "unierf-nothing"
    argv = ["unierf", "--dataset", str(folder), "--steps", "2", "--max-seq-length", "32", "--budgets", "6"]
    assert main([*argv, *options, "--output", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trained"] == [] and summary["dev_quotas"] is None
    d = summary["data"]
    assert d["n_test_queries"] == info["queries"]["test"] and d["n_calibration_queries"] == 0
    notes = " ".join(summary["data"]["notes"])
    assert ("no trigger share is chosen on dev" in notes) == ("--dev-quotas" in options)
