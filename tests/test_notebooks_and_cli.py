"""The notebooks execute, and the command line works end to end on a tiny budget."""

import json
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

from pyterrier_prob.cli import main

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


def test_notebooks_exist():
    assert NOTEBOOKS


def test_cli_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for option in ("--dataset", "--model", "--steps", "--ks", "--cap", "--geometry", "--output", "--reuse"):
        assert option in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ks", "100", "--cap", "50"], "cap (50) must be at least the largest k (100)"),
        (["--ks", "0"], "ks must be positive integers"),
        (["--steps", "0"], "need steps >= 1"),
        (["--table3-ps", "1.0"], "table3_ps must lie strictly inside (0, 1)"),
        (["--test-split", "dev"], "must differ from the train and dev splits"),
        (["--lr", "-1"], "lr must be > 0"),
    ],
)
def test_cli_rejects_bad_settings(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_unknown_geometry(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--geometry", "torus"])
    assert e.value.code == 2


@pytest.mark.slow
def test_main_job_tiny_budget(tmp_path):
    """The whole job on nfcorpus with 2 training steps; a second run with --reuse neither trains nor encodes."""
    import pandas as pd

    out = tmp_path / "job"
    argv = ["--steps", "2", "--batch-size", "4", "--max-seq-length", "32", "--ks", "5", "20"]
    argv += ["--table3-ps", "0.999", "0.9", "--output", str(out), "--quiet"]
    assert main(argv) == 0
    results = pd.read_csv(out / "results.csv")
    assert sorted(set(results["k"])) == [5, 20]
    assert list(results[results["k"] == 5]["name"]) == [
        "BM25",
        "baseline top-k",
        "baseline score cutoff",
        "pEBR top-k",
        "pEBR score cutoff",
        "pEBR CDF cutoff",
    ]
    topk = results[results["name"].str.endswith("top-k")]
    assert (topk["test_mean_k"] == topk["k"]).all()  # nfcorpus has far more than 20 documents per query
    assert results[["SetR", "SetP"]].apply(lambda c: c.between(0, 1)).all().all()
    assert results[results["name"] == "pEBR top-k"]["SetR p-value"].isna().all()  # the significance baseline
    cal = pd.read_csv(out / "calibration.csv")
    assert len(cal) == 6
    assert ((cal["dev_mean_k"] - cal["k"]).abs() <= 0.01 * cal["k"]).all()
    assert cal["achieved_within_1pct"].all()
    strata = pd.read_csv(out / "strata.csv")
    assert set(strata["stratum"]) == {"all", "head", "torso", "tail"}
    table3 = pd.read_csv(out / "table3.csv", index_col="stratum")
    assert list(table3.index) == ["head", "torso", "tail", "all"]
    assert (table3.iloc[:, 0] >= table3.iloc[:, 1]).all()  # larger p keeps more
    summary = json.loads((out / "summary.json").read_text())
    assert summary["strata_basis"] == "terciles of the number of relevant documents per query"
    assert {"train_pebr", "train_baseline", "index_pebr", "index_baseline"} <= set(summary["timings_s"])
    for name in ("figure2.png", "table3.png", "results.md"):
        assert (out / name).stat().st_size > 0
    assert (out / "models" / "pebr" / "modules.json").exists()

    assert main([*argv, "--reuse"]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert not {"train_pebr", "train_baseline", "index_pebr", "index_baseline"} & set(again["timings_s"])
    pd.testing.assert_frame_equal(pd.read_csv(out / "results.csv"), results)
