"""The notebooks execute, and the command line works end to end on a tiny budget."""

import json
import pathlib
import re

import nbformat
import pytest
from helpers import assert_same_figures, pisa_threads_finish_backwards
from nbclient import NotebookClient

from pyterrier_prob.cli import PAPERS, main

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
#: one notebook per paper (train briefly -> PyTerrier pipeline -> pt.Experiment -> plots), and the laws' one
PAPER_NOTEBOOKS = ("pebr", "mol", "varce", "unierf")


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch):
    """Each notebook runs top to bottom without an error, on the small configuration it reads from NOTEBOOK_SMALL
    (fewer steps and queries; the stored outputs are from the configuration a reader runs)."""
    monkeypatch.setenv("NOTEBOOK_SMALL", "1")  # the kernel inherits the environment
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in _code_cells(nb) for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert all(c.execution_count is not None for c in _code_cells(nb))


def test_each_paper_has_a_notebook():
    names = {p.stem for p in NOTEBOOKS}
    assert set(PAPER_NOTEBOOKS) <= names, f"missing notebooks: {set(PAPER_NOTEBOOKS) - names}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_lets_openmp_threads_sleep_before_torch_loads(path):
    """A kernel beside another job on the same cores crawls while its idle OpenMP threads spin (docs/cluster.md): each
    notebook's first code cell, which imports neither torch nor the models, calls ``passive_waiting()``."""
    first = _code_cells(nbformat.read(path, as_version=4))[0]
    assert "\npassive_waiting()" in first.source, f"{path.name}: its first cell does not call passive_waiting()"
    assert not re.search(r"^\s*(import|from) (torch|st_extensions|sentence_transformers)\b", first.source, re.M)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_stored_with_its_outputs(path):
    """What a reader sees without running anything (GitHub renders stored outputs): every code cell executed in
    order, at least one figure, no error, and a clean console (no library logs or progress bars on stderr)."""
    nb = nbformat.read(path, as_version=4)
    cells = _code_cells(nb)
    counts = [c.execution_count for c in cells]
    assert None not in counts, f"{path.name}: cells stored without running them"
    assert counts == sorted(counts), f"{path.name}: cells stored out of order: {counts}"
    outputs = [o for c in cells for o in c.get("outputs", [])]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name}: no figure stored"
    assert not [o for o in outputs if o.output_type == "error"], path.name
    stderr = [o.text for o in outputs if o.output_type == "stream" and o.name == "stderr"]
    assert not stderr, f"{path.name}: stored stderr output {stderr[:2]}"


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("--dataset", "--model", "--steps", "--ks", "--cap", "--geometry", "--output", "--reuse"):
        assert option in out


def test_cli_help_lists_the_commands(capsys):
    """``pyterrier-prob --help`` lists the four commands, one line each (then the default command's options)."""
    with pytest.raises(SystemExit):
        main(["--help"])
    lines = capsys.readouterr().out.splitlines()
    for paper in ("pebr", "mol", "varce", "unierf"):
        assert any(line.split()[:1] == [paper] and len(line.split()) > 1 for line in lines), paper


@pytest.mark.parametrize("paper", list(PAPERS))
def test_every_option_has_help_and_its_default_once(paper):
    from pyterrier_prob.cli import build_parser

    ap = build_parser(paper)
    for action in ap._actions:
        assert action.help, f"{paper}: {action.option_strings} has no help"
    text = ap.format_help()
    for block in text.split("\n  -"):  # one option's help per block
        assert block.count("(default:") <= 1, block


def test_results_json_copies_the_summary_with_the_command_and_the_report_states_the_recipe(tmp_path, capsys):
    from pyterrier_prob.experiments.harness import CommonConfig, Harness

    command = "pyterrier-prob pebr --steps 10"
    cfg = CommonConfig(output=str(tmp_path / "o"), results_json=f"{tmp_path / 'results'}/", command=command)
    h = Harness("pebr", cfg)
    h.recipes["pebr"] = cfg.training_recipe(10).to_dict()
    h.finish("title", "text", {}, {"x": 1})
    printed = capsys.readouterr().out  # the console shows the report (as results.md), not the JSON copy
    assert "# title" in printed and "Wall time:" in printed and '"command"' not in printed
    copy = json.loads((tmp_path / "results" / "pebr.json").read_text())
    assert copy["command"] == command and copy["x"] == 1 and copy["config"]["command"] == command
    assert f"Recipe of pebr: {cfg.training_recipe(10).describe()}" in (tmp_path / "o" / "results.md").read_text()


def test_recipe_options_are_checked_by_the_recipe_under_their_flags():
    from pyterrier_prob.experiments.harness import CommonConfig

    with pytest.raises(ValueError, match="--train-layers"):
        CommonConfig(recipe="partial").check()
    with pytest.raises(ValueError, match="--recipe must be one of"):
        CommonConfig(recipe="half").check()
    assert CommonConfig(recipe="partial", train_layers=2, steps=50).training_recipe().checkpoint_every == 5


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ks", "100", "--cap", "50"], "cap (50) must be at least the largest k (100)"),
        (["--ks", "0"], "ks must be positive integers"),
        (["--steps", "-1"], "--steps must be >= 0"),
        (["--table3-ps", "1.0"], "table3_ps must lie strictly inside (0, 1)"),
        (["--test-split", "dev", "--dev-split", "dev"], "must differ from the train and dev splits"),
        (["--lr", "-1"], "--lr must be a finite number > 0"),
        (["--lr", "inf"], "--lr must be a finite number > 0"),
    ],
)
def test_cli_rejects_bad_settings(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_unknown_geometry(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--geometry", "torus"])
    assert e.value.code == 2


@pytest.mark.parametrize("paper", list(PAPERS))
def test_each_subcommand_has_its_own_help(paper, capsys):
    with pytest.raises(SystemExit) as e:
        main([paper, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert f"pyterrier-prob {paper}" in out
    for option in ("--dataset", "--test-dataset", "--model", "--steps", "--output", "--reuse", "--quiet"):
        assert option in out


def test_unknown_collection_is_a_clear_error(capsys, tmp_path):
    assert main(["--dataset", str(tmp_path / "nothing-here"), "--output", str(tmp_path / "o"), "--quiet"]) == 2
    assert "unknown ir_datasets id" in capsys.readouterr().err


def test_unwritable_output_is_a_usage_error(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert main(["--output", str(blocker / "out"), "--quiet"]) == 2
    assert "--output" in capsys.readouterr().err


@pytest.mark.slow
def test_max_seq_length_beyond_the_model_is_a_usage_error(capsys, small_beir_no_train_no_dev, tmp_path):
    folder, _ = small_beir_no_train_no_dev
    assert main(["--dataset", str(folder), "--steps", "0", "--max-seq-length", "4096", "--output", str(tmp_path)]) == 2
    assert "--max-seq-length 4096 exceeds the model's position limit of 512" in capsys.readouterr().err


@pytest.mark.slow
def test_main_job_tiny_budget(tmp_path, small_beir, capfd):
    """The whole job on a small BEIR folder with 2 training steps; a second run with --reuse neither trains nor
    encodes and gives the same table; --quiet prints no progress bar, only where the results are."""
    import pandas as pd

    folder, info = small_beir
    out = tmp_path / "job"
    argv = ["--dataset", str(folder), "--steps", "2", "--batch-size", "4", "--max-seq-length", "32", "--ks", "5", "20"]
    argv += ["--table3-ps", "0.999", "0.9", "--output", str(out), "--quiet"]
    assert main(argv) == 0
    printed = capfd.readouterr()
    for bar in ("training", "encoding", "calibrating", "scoring", "indexing"):  # the stage bars are silenced
        assert bar not in printed.err
    assert "[info]" not in printed.out + printed.err  # PISA's own log goes to a file
    assert printed.out.strip().splitlines()[-1].startswith(f"results written to {out}/results.md")
    assert "| k | system | setting | test mean k | SetR | SetP |" in printed.out  # the table, even when quiet
    results = pd.read_csv(out / "results.csv")
    assert sorted(set(results["k"])) == [5, 20]
    assert list(results[results["k"] == 5]["name"]) == [
        "BM25",
        "untrained top-k",
        "baseline top-k",
        "baseline score cutoff",
        "pEBR top-k",
        "pEBR score cutoff",
        "pEBR CDF cutoff",
    ]
    topk = results[results["name"].str.endswith("top-k")]
    assert (topk["test_mean_k"] == topk["k"]).all()  # the folder has far more than 20 documents
    assert results[["SetR", "SetP"]].apply(lambda c: c.between(0, 1)).all().all()
    assert results[results["name"] == "pEBR top-k"]["SetR p-value"].isna().all()  # the significance baseline
    ptk = results[results["name"] == "pEBR top-k"]  # at its own depth (exactly k) pEBR top-k is its own comparator
    assert (ptk["pebr_topk_SetR_at_same_k"] - ptk["SetR"]).abs().max() < 1e-9
    assert ptk["p_vs_pebr_topk_at_same_k"].isna().all()
    untrained = results[results["name"] == "untrained top-k"]  # another model at the same depth: a real comparison
    assert (untrained["pebr_topk_SetR_at_same_k"] - ptk["SetR"].to_numpy()).abs().max() < 1e-9
    cal = pd.read_csv(out / "calibration.csv")
    assert len(cal) == 6
    assert ((cal["dev_mean_k"] - cal["k"]).abs() <= 0.01 * cal["k"]).all()
    assert cal["achieved_within_1pct"].all()
    strata = pd.read_csv(out / "strata.csv")
    assert set(strata["stratum"]) == {"all", "head", "torso", "tail"}
    table3 = pd.read_csv(out / "table3.csv", index_col="stratum")
    assert list(table3.index) == ["head", "torso", "tail", "all"]
    assert (table3.iloc[:, 0] >= table3.iloc[:, 1]).all()  # larger p keeps more
    # the cutoff study: every rule at matched depth, recall targets with the re-split check (same collection)
    from pyterrier_prob.experiments.pebr_cutoffs import RULES, TARGET_RULES

    matched = pd.read_csv(out / "cutoffs_matched_depth.csv")
    assert set(matched["name"]) == {*RULES, "oracle depth (qrels known)"}
    topk = matched[matched["name"] == "top-k"]  # at depth exactly k, top-k's interpolated recall is its SetR
    assert (topk["topk_SetR_at_same_depth"] - topk["SetR"]).abs().max() < 1e-9
    assert topk["p_vs_topk_at_same_depth"].isna().all()  # equal to itself for every query: no test
    claims = json.loads((out / "summary.json").read_text())["claims"]  # against top-k at the rule's own depth
    assert {r["claim"] for r in claims} == {"cutoff_vs_topk_k5", "cutoff_vs_topk_k20"}
    for r in claims:
        row = matched[
            (matched["k"] == int(r["claim"].removeprefix("cutoff_vs_topk_k"))) & (matched["name"] == r["rule"])
        ]
        assert r["depth"] == pytest.approx(row["test_mean_depth"].item())
        assert r["baseline_value"] == pytest.approx(row["topk_SetR_at_same_depth"].item())
    oracle = matched[matched["name"] == "oracle depth (qrels known)"]  # compared with itself
    assert (oracle["depth_abs_diff_vs_oracle"] == 0).all()
    assert ((oracle["depth_rho_vs_oracle"] - 1.0).abs() < 1e-12).all()
    assert topk["depth_rho_vs_oracle"].isna().all()  # a constant depth has no rank correlation
    depth_gap = (topk["k"].to_numpy() - oracle["test_mean_depth"].to_numpy()).tolist()
    assert all(d >= abs(g) - 1e-9 for d, g in zip(topk["depth_abs_diff_vs_oracle"], depth_gap))  # mean|x| >= |mean x|
    assert matched["depth_rho_vs_num_relevant"].dropna().between(-1, 1).all()
    # the calibration queries' recall picks the claimed rule: none for the oracle, and a deeper level keeps more
    assert oracle["calibration_SetR"].isna().all()
    rules = matched[matched["name"] != "oracle depth (qrels known)"]
    assert rules["calibration_SetR"].between(0, 1).all()
    assert all(g.sort_values("k")["calibration_SetR"].is_monotonic_increasing for _, g in rules.groupby("name"))
    targets = pd.read_csv(out / "cutoffs_recall_targets.csv")
    assert set(targets["rule"]) == set(TARGET_RULES) and (targets["resplits"] == 200).all()
    assert targets["resplit_mean_recall"].between(0, 1).all()
    assert (targets["resplit_recall_5"] <= targets["resplit_recall_95"]).all()
    summary = json.loads((out / "summary.json").read_text())
    pit = summary["cutoff_study"]["pit_per_query"]
    assert set(pit) == set(summary["cutoff_study"]["pit"]) and all(0 <= p["mean"] <= 1 for p in pit.values())
    assert summary["strata_basis"] == "terciles of the number of relevant documents per query"
    assert summary["data"]["n_test_queries"] == info["queries"]["test"]
    assert summary["data"]["calibration"].endswith("/dev") and summary["data"]["train"].endswith("/train")
    assert {"train_pebr", "train_baseline", "index_pebr", "index_baseline"} <= set(summary["timings_s"])
    for name in ("figure2.png", "table3.png", "results.md", "results.csv", "summary.json"):
        assert (out / name).stat().st_size > 0
        assert (out / name).stat().st_mode & 0o777 == 0o644
    assert (out / "models" / "pebr" / "modules.json").exists()

    with pisa_threads_finish_backwards():
        assert main([*argv, "--reuse"]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert not {"train_pebr", "train_baseline", "index_pebr", "index_baseline"} & set(again["timings_s"])
    assert_same_figures(pd.read_csv(out / "results.csv"), results)


@pytest.mark.slow
def test_beta_mle_family_keeps_the_base_geometry_and_adds_the_likelihood_ratio_rule(tmp_path, small_beir):
    """``--family beta_mle`` under the frozen recipe trains only the head (the adapter's rate is 0, chosen on
    nfcorpus/dev): the pEBR model ranks exactly as the untrained one, its settings say so, and the study has the
    Sec. 3.1 likelihood-ratio cutoff."""
    import pandas as pd

    from pyterrier_prob.experiments.pebr import MLE_FROZEN_RATES
    from pyterrier_prob.experiments.pebr_cutoffs import LR_RULE

    folder, _ = small_beir
    out = tmp_path / "mle"
    argv = ["--dataset", str(folder), "--family", "beta_mle", "--steps", "3", "--batch-size", "4"]
    argv += ["--max-seq-length", "32", "--ks", "5", "--cap", "50", "--table3-ps", "0.9", "--output", str(out)]
    assert main([*argv, "--quiet"]) == 0
    saved = json.loads((out / "models" / "pebr" / "train_settings.json").read_text())["settings"]
    assert saved["recipe"]["module_learning_rates"] == MLE_FROZEN_RATES and saved["family"] == "beta_mle"
    ranking = pd.read_csv(out / "ranking.csv").set_index("name")
    for measure in ("nDCG@10", "R@100"):
        assert ranking.loc["pEBR", measure] == pytest.approx(ranking.loc["untrained", measure], abs=1e-6)
    assert LR_RULE in set(pd.read_csv(out / "cutoffs_matched_depth.csv")["name"])


@pytest.mark.slow
def test_steps_0_on_a_test_only_collection(tmp_path, small_beir_no_train_no_dev):
    """No train and no dev split: the base model is evaluated untrained, calibration on a seeded half of test,
    results on the other half, and the report says so."""
    import pandas as pd

    folder, info = small_beir_no_train_no_dev
    out = tmp_path / "zero"
    argv = ["--dataset", str(folder), "--steps", "0", "--max-seq-length", "32", "--ks", "5", "--cap", "50"]
    assert main([*argv, "--table3-ps", "0.9", "--output", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    d = summary["data"]
    assert d["train"] is None and d["n_calibration_queries"] + d["n_test_queries"] == info["queries"]["test"]
    assert d["n_calibration_queries"] == info["queries"]["test"] // 2
    assert "no dev split" in " ".join(d["notes"]) and "seeded half" in d["calibration"]
    assert "no dev split" in (out / "results.md").read_text()
    assert not (out / "models").exists() and summary["training_loss_first_last"] == {}
    results = pd.read_csv(out / "results.csv")
    assert len(results) == 7 and results["SetR"].between(0, 1).all()


@pytest.mark.slow
def test_test_dataset_transfer(tmp_path, small_beir, small_beir_no_train_no_dev):
    """Train on one collection, evaluate on another; calibration comes from the training collection's dev split."""
    import pandas as pd

    train_folder, _ = small_beir
    test_folder, info = small_beir_no_train_no_dev
    out = tmp_path / "transfer"
    argv = ["--dataset", str(train_folder), "--test-dataset", str(test_folder), "--steps", "1", "--batch-size", "4"]
    argv += ["--max-seq-length", "32", "--ks", "5", "--cap", "50", "--table3-ps", "0.9", "--output", str(out)]
    assert main([*argv, "--quiet"]) == 0
    d = json.loads((out / "summary.json").read_text())["data"]
    assert d["train"] == f"{train_folder}/train" and d["calibration"] == f"{train_folder}/dev"
    assert d["test"] == f"{test_folder}/test" and d["n_test_queries"] == info["queries"]["test"]
    assert any("zero-shot transfer" in n for n in d["notes"])
    # calibration and test queries come from different collections: no re-split of a pool
    assert "resplit_mean_recall" not in pd.read_csv(out / "cutoffs_recall_targets.csv").columns
    indexes = sorted(p.name for p in (out / "indexes").iterdir() if p.is_dir())
    # indexed: the test collection, plus the pEBR model on the calibration collection (the cutoff study fits the
    # calibrated law on the calibration queries' own relevant documents)
    on_train = [n for n in indexes if test_folder.name.replace("_", "-") not in n]
    assert on_train == [n for n in indexes if n.startswith("pebr-") and train_folder.name.replace("_", "-") in n]
    assert len(on_train) == 1


@pytest.mark.slow
def test_partial_recipe_end_to_end_and_an_interrupted_run_resumes(tmp_path, small_beir, monkeypatch):
    """``pyterrier-prob pebr --recipe partial --train-layers 2``: cut off right after pEBR's checkpoint of step 4,
    then ``--resume``: the run finishes from that checkpoint (its pEBR model equals an uninterrupted run's, 1e-5),
    the recipe is written beside each model and in the output folder, and the checkpoints are gone once saved."""
    import torch

    from pyterrier_prob import training
    from st_extensions import default_model_path, load_model

    folder, _ = small_beir
    argv = ["--dataset", str(folder), "--recipe", "partial", "--train-layers", "2", "--steps", "6"]
    argv += ["--checkpoint-every", "2", "--batch-size", "4", "--max-seq-length", "32", "--ks", "5"]
    argv += ["--cap", "50", "--table3-ps", "0.9", "--quiet"]
    assert main([*argv, "--output", str(tmp_path / "whole")]) == 0

    original = training._MarkComplete.on_save

    def cut_off(self, args, state, control, **kwargs):
        original(self, args, state, control, **kwargs)
        if state.global_step == 4:
            raise KeyboardInterrupt("cut off after the checkpoint of step 4")

    out = tmp_path / "cut"
    monkeypatch.setattr(training._MarkComplete, "on_save", cut_off)
    with pytest.raises(KeyboardInterrupt):
        main([*argv, "--output", str(out)])
    monkeypatch.setattr(training._MarkComplete, "on_save", original)
    run_dir = out / "runs" / "pebr"
    assert [p.rsplit("/", 1)[1] for p in training.complete_checkpoints(str(run_dir))] == [
        "checkpoint-2",
        "checkpoint-4",
    ]
    assert not (out / "models" / "pebr" / "modules.json").exists()
    assert main([*argv, "--output", str(out), "--resume"]) == 0
    assert not run_dir.exists()  # the saved model replaces the checkpoints
    recipe = training.Recipe.load(str(out / "models" / "pebr" / "recipe.json"))
    assert (recipe.mode, recipe.train_layers, recipe.steps, recipe.checkpoint_every) == ("partial", 2, 6, 2)
    recipes = json.loads((out / "recipes.json").read_text())
    assert set(recipes) >= {"pebr", "baseline"} and recipes["pebr"]["mode"] == "partial"
    losses = json.loads((out / "models" / "pebr" / "train_settings.json").read_text())["losses"]
    assert len(losses) == 6  # the checkpoint's four, then the two steps after it
    whole = load_model(str(tmp_path / "whole" / "models" / "pebr"))
    resumed = load_model(str(out / "models" / "pebr"))
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"{name} differs after resuming")
    lower = whole[0].auto_model.encoder.layer[0].attention.self.query.weight
    start = load_model(default_model_path())[0].auto_model.encoder.layer[0].attention.self.query.weight
    assert torch.equal(lower, start)  # the lower layers stayed as they were


def test_an_unreachable_depth_is_calibrated_to_the_nearest_end():
    """A mean depth below the shallowest setting's takes that setting (not the deepest one), and one beyond the
    deepest setting's takes the deepest: each miss as small as the rule allows."""
    import pandas as pd

    from pyterrier_prob.experiments.pebr import _calibrated

    topics = pd.DataFrame({"qid": ["q1", "q2"]})

    def run(p):  # 8 documents per query at the shallowest p, 47 at the deepest
        return pd.DataFrame({"qid": [q for q in ("q1", "q2") for _ in range(8 + int(40 * p))]})

    c, unreachable = _calibrated(run, 5, 1e-9, 1 - 1e-9, True, topics)
    assert unreachable and (c.value, c.mean_k, c.achieved) == (1e-9, 8.0, False)
    c, unreachable = _calibrated(run, 100, 1e-9, 1 - 1e-9, True, topics)
    assert unreachable and (c.value, c.mean_k) == (1 - 1e-9, 47.0)
    c, unreachable = _calibrated(lambda t: run(1 - t), 5, 0.0, 1.0, False, topics)  # a threshold: deeper when lower
    assert unreachable and (c.value, c.mean_k) == (1.0, 8.0)


@pytest.mark.slow
def test_sphere_geometry_under_the_frozen_recipe(tmp_path, small_beir):
    """``--geometry sphere`` with the default (frozen) recipe: the law's dimension comes from the model (its
    encoding model, cached encoder outputs and the added modules, cannot tell it)."""
    folder, _ = small_beir
    out = tmp_path / "sphere"
    argv = ["--dataset", str(folder), "--geometry", "sphere", "--steps", "1", "--batch-size", "4"]
    argv += ["--max-seq-length", "32", "--ks", "10", "--cap", "50", "--study-cap", "50", "--table3-ps", "0.9"]
    assert main([*argv, "--output", str(out), "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["geometry"] == "sphere" and summary["cutoff_study"]["calibrated_law"]["dim"] == 384


def test_experiment_scores_an_empty_run_as_nothing_retrieved(tmp_path):
    """A variable-depth rule that keeps no document for any query (the cutoff study's level from the calibration
    queries can do that on test) scores 0, with its paired test; pt.Experiment refused it and the run died."""
    import pandas as pd

    from pyterrier_prob.experiments.harness import CommonConfig, Harness

    h = Harness("pebr", CommonConfig(output=str(tmp_path / "o"), quiet=True))
    topics = pd.DataFrame({"qid": ["1", "2"], "query": ["a", "b"]})
    qrels = pd.DataFrame({"qid": ["1", "2", "2"], "docno": ["d1", "d2", "d4"], "label": [1, 1, 1]})
    some = pd.DataFrame({"qid": ["1", "2", "2"], "docno": ["d1", "d3", "d2"], "score": [1.0, 0.9, 0.8]})
    none = some.iloc[:0]
    exp = h.experiment({"some": some, "none": none}, topics, qrels, ["SetR", "SetP"], baseline="some").set_index("name")
    assert exp.loc["some", "SetR"] == 0.75 and exp.loc["some", "SetP"] == 0.75  # (1 + 1/2) / 2 both
    assert exp.loc["none", "SetR"] == 0.0 and exp.loc["none", "SetP"] == 0.0
    assert 0 <= exp.loc["none", "SetR p-value"] <= 1
