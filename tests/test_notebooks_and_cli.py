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
    assert "--dataset" in capsys.readouterr().out


def test_cli_rejects_p_out_of_range(capsys):
    assert main(["--p", "1.5"]) == 2
    assert "--p must be in (0, 1)" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_demo_tiny_budget(tmp_path):
    out = tmp_path / "demo"
    assert main(["--steps", "2", "--batch-size", "4", "--max-seq-length", "32", "--output", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["dev"] == "irds:beir/nfcorpus/dev"
    lo, mid, hi = summary["cutoff_quantiles_10_50_90_at_p=0.5"]
    assert -1 <= lo <= mid <= hi <= 1
    assert (out / "model" / "modules.json").exists()
