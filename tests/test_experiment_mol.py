"""``pyterrier-prob mol``: options, bad settings, and tiny end-to-end runs on small BEIR folders."""

import json
import stat

import numpy as np
import pandas as pd
import pytest
from helpers import cli_help

from pyterrier_prob.cli import main
from st_extensions.modules.mol import MixtureOfLogits


def test_mol_help(capsys):
    out = cli_help(
        capsys, "mol", "--alpha --scale --head-lr --pq --px --component-dim --component-source --k --mi-ablation"
    )
    assert "pyterrier-prob mol" in out


def test_mol_defaults():
    from pyterrier_prob.cli import build_parser
    from pyterrier_prob.experiments.mol import config_from_args

    cfg = config_from_args(build_parser("mol").parse_args([]))
    cfg.check()
    assert (cfg.dataset, cfg.steps, cfg.batch_size, cfg.max_seq_length) == ("irds:beir/nfcorpus", 1000, 64, 128)
    assert (cfg.alpha, cfg.scale, cfg.head_lr, cfg.pq, cfg.px, cfg.k) == (0.001, 20.0, None, 4, 4, 100)
    assert cfg.component_source == "heads" and cfg.recipe == "frozen"
    assert not cfg.mi_ablation and cfg.output == "outputs/mol"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--alpha", "-1"], "--alpha must be finite and >= 0"),
        (["--scale", "0"], "--scale must be > 0"),
        (["--head-lr", "0"], "--head-lr must be finite and > 0"),
        (["--head-lr", "inf"], "--head-lr must be finite and > 0"),
        (["--pq", "0"], "--pq and --px must be >= 1"),
        (["--k", "5"], "--k must be >= 10"),
        (
            ["--pq", "20", "--px", "20", "--max-seq-length", "32", "--component-source", "tokens", "--recipe", "full"],
            "do not fit",
        ),
        (["--component-source", "tokens"], "use --component-source heads or --recipe full"),
        (["--steps", "-1"], "--steps must be >= 0"),
    ],
)
def test_mol_rejects_bad_settings(argv, message, capsys):
    assert main(["mol", *argv]) == 2
    assert message in capsys.readouterr().err


def test_mol_rejects_unknown_component_source():
    with pytest.raises(SystemExit) as e:
        main(["mol", "--component-source", "columns"])
    assert e.value.code == 2


def test_gate_statistics_uniform_and_peaked():
    """A uniform gate has H(pi|q,x) = H(p) = log P and MI = 0; a gate that picks one pair per (q, x), spread over
    all pairs, has H(pi|q,x) = 0 and MI = H(p) (Eq. 3: L_MI = -MI)."""
    import torch

    from pyterrier_prob.experiments.mol import gate_statistics

    class Gate:
        num_query_components, num_doc_components, gate_features = 2, 2, False

        def __init__(self, peaked: bool) -> None:
            self.peaked = peaked

        def gate(self, q, x, qf=None, xf=None):  # peaked: document j puts all weight on pair j % 4
            if not self.peaked:
                return torch.full((len(q), 1, 4), 0.25)
            return torch.nn.functional.one_hot(x[:, 0, 0, 0].long() % 4, 4).float()[:, None]

    q = np.zeros((4, 2, 3), np.float32)
    x = np.zeros((8, 2, 3), np.float32)
    x[:, 0, 0] = np.arange(8)
    qi, docids = np.repeat(np.arange(4), 2), np.arange(8)
    u = gate_statistics(Gate(False), q, x, qi, docids)
    assert u["pairs"] == 8 and u["P"] == 4
    assert u["H_pi_given_qx"] == pytest.approx(np.log(4), abs=1e-4) and u["MI"] == 0.0
    p = gate_statistics(Gate(True), q, x, qi, docids, chunk=3)
    assert p["H_pi_given_qx"] == pytest.approx(0, abs=1e-4)
    assert p["MI"] == pytest.approx(np.log(4), abs=1e-4) and p["mean_max_pi"] == pytest.approx(1)
    assert np.allclose(p["usage_mean_pi"], 0.25)


def _assert_0644(folder):
    files = [p for p in folder.iterdir() if p.is_file()]
    assert files
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p


@pytest.mark.slow
def test_mol_tiny_run(tmp_path, small_beir, small_beir_no_train_no_dev):
    """Train the bi-encoder and MoL for 2 steps on a small BEIR folder; then evaluate the saved MoL model without
    fine-tuning (--steps 0) on a folder with a test split only (every test query reported, no calibration half)."""
    folder, info = small_beir
    out = tmp_path / "mol"
    argv = ["mol", "--dataset", str(folder), "--steps", "2", "--batch-size", "4", "--max-seq-length", "32"]
    claims = tmp_path / "claims.json"
    assert main([*argv, "--output", str(out), "--quiet", "--claims-json", str(claims)]) == 0

    results = pd.read_csv(out / "results.csv")
    assert list(results["name"]) == ["base model (no fine-tuning)", "bi-encoder", "MoL"]
    rows = json.loads(claims.read_text())["rows"]  # mol_vs_dot, paired t-tests as pt.Experiment's
    assert [(r["claim"], r["recipe"], r["system"], r["baseline"]) for r in rows] == [
        ("mol_vs_dot", "frozen", "MoL (heads)", "bi-encoder")
    ] * 2
    r = results.set_index("name")
    for row in rows:
        assert row["value"] == pytest.approx(r.loc["MoL", row["metric"]])
        assert row["baseline_value"] == pytest.approx(r.loc["bi-encoder", row["metric"]])
        p = r.loc["MoL", f"{row['metric']} p-value"]
        assert row["p"] == pytest.approx(p) if row["p"] is not None else np.isnan(p)
    assert list(results["fine-tuned"]) == [False, True, True]
    assert results[["nDCG@10", "R@100"]].apply(lambda c: c.between(0, 1)).all().all()
    assert {"nDCG@10 p-value", "R@100 p-value"} <= set(results.columns)
    assert results.loc[results["name"] == "bi-encoder", "nDCG@10 p-value"].isna().all()  # the baseline
    mol_p = results.loc[results["name"] == "MoL", "nDCG@10 p-value"].iloc[0]
    assert np.isnan(mol_p) or 0 <= mol_p <= 1

    gate = pd.read_csv(out / "gate.csv")
    assert list(gate["pairs_of"]) == ["top-100", "relevant"] and set(gate["system"]) == {"MoL"}
    n_test = info["queries"]["test"]
    assert gate["pairs"].iloc[0] == n_test * min(100, info["docs"])
    assert gate["pairs"].iloc[1] == info["qrels"]["test"]
    assert (gate["log_P"] == round(np.log(16), 4)).all()
    assert (gate["H_pi_given_qx"] <= gate["H_p"] + 1e-4).all() and (gate["H_p"] <= gate["log_P"] + 1e-4).all()
    assert (gate["MI"] >= 0).all()

    summary = json.loads((out / "summary.json").read_text())
    assert summary["systems"] == ["base model (no fine-tuning)", "bi-encoder", "MoL"]
    assert "against 'bi-encoder'" in summary["significance"]
    assert summary["measures"] == ["nDCG@10", "R@100"]
    assert summary["data"]["n_test_queries"] == n_test
    assert summary["per_system"]["MoL"]["alpha"] == 0.001
    # the frozen recipe: only the MoL modules train, so no encoder rate is reported
    assert summary["per_system"]["MoL"]["learning_rate"] == {"mol_head": MixtureOfLogits.learning_rate}
    assert summary["per_system"]["bi-encoder"]["train_loss"]["steps_logged"] == 2
    assert {"train_bi-encoder", "train_mol", "index_mol", "gate_mol"} <= set(summary["timings_s"])
    training = pd.read_csv(out / "training.csv")
    assert list(training["system"]) == ["bi-encoder", "MoL"]
    md = (out / "results.md").read_text()
    assert "| MoL | MoL (Eq. 1-2) | yes |" in md and "H_pi_given_qx" in md
    _assert_0644(out)
    assert (out / "models" / "mol" / "modules.json").exists()

    # --steps 0 with the saved MoL model, on a collection with a test split only
    folder2, info2 = small_beir_no_train_no_dev
    out2 = tmp_path / "mol-steps0"
    argv2 = ["mol", "--dataset", str(folder2), "--steps", "0", "--model", str(out / "models" / "mol")]
    assert main([*argv2, "--max-seq-length", "32", "--output", str(out2), "--quiet"]) == 0
    results2 = pd.read_csv(out2 / "results.csv")
    assert list(results2["name"]) == ["base model (no fine-tuning)", "MoL (no fine-tuning)"]
    assert not results2["fine-tuned"].any()
    assert results2[["nDCG@10", "R@100"]].apply(lambda c: c.between(0, 1)).all().all()
    summary2 = json.loads((out2 / "summary.json").read_text())
    assert summary2["given_model_is_mol"] is True
    assert summary2["data"]["train"] is None
    assert summary2["data"]["n_test_queries"] == info2["queries"]["test"]  # no calibration half set aside
    assert "against 'base model (no fine-tuning)'" in summary2["significance"]
    assert not (out2 / "models").exists()
    _assert_0644(out2)


@pytest.mark.slow
def test_reuse_retrains_mol_for_another_head_init(tmp_path, small_beir):
    """``--reuse --head-init orthogonal`` after an identity-initialised run trains MoL again (the init is part of
    what makes the model) and keeps the bi-encoder, whose settings did not change."""
    folder, _ = small_beir
    out = tmp_path / "mol"
    argv = ["mol", "--dataset", str(folder), "--steps", "1", "--batch-size", "4", "--max-seq-length", "32"]
    argv += ["--output", str(out), "--quiet"]
    assert main(argv) == 0
    assert main([*argv, "--reuse", "--head-init", "orthogonal"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert "train_mol" in summary["timings_s"] and "load_bi-encoder" in summary["timings_s"]
    saved = json.loads((out / "models" / "mol" / "train_settings.json").read_text())["settings"]
    assert saved["mol"]["head_init"] == "orthogonal"


@pytest.mark.slow
def test_nothing_to_train_holds_back_no_test_query_for_dev(tmp_path, small_beir_no_train_no_dev):
    """Without a train split nothing trains, so no learning curve needs dev queries: under --recipe partial with
    --dev-every every test query is reported (no seeded half held back)."""
    folder, info = small_beir_no_train_no_dev
    out = tmp_path / "mol-nothing"
    argv = ["mol", "--dataset", str(folder), "--steps", "2", "--recipe", "partial", "--train-layers", "1"]
    assert main([*argv, "--dev-every", "1", "--max-seq-length", "32", "--output", str(out), "--quiet"]) == 0
    d = json.loads((out / "summary.json").read_text())["data"]
    assert d["train"] is None and d["n_test_queries"] == info["queries"]["test"] and d["n_calibration_queries"] == 0


@pytest.mark.slow
def test_identity_heads_with_another_component_dim_fail_before_training(tmp_path, small_beir, capsys):
    """``--component-dim 64`` with the default ``--head-init identity`` (embedding dimension 384) is refused once the
    base model is loaded, before the bi-encoder trains or anything is indexed, naming both options and the way out."""
    folder, _ = small_beir
    out = tmp_path / "mol"
    argv = ["mol", "--dataset", str(folder), "--steps", "2", "--batch-size", "4", "--max-seq-length", "32"]
    assert main([*argv, "--component-dim", "64", "--output", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--head-init identity" in err and "--component-dim 64" in err and "(384)" in err
    assert "use --head-init orthogonal" in err
    assert not (out / "models").exists() and not (out / "indexes").exists()
