"""``pyterrier-prob depth``: a tiny end-to-end run on a small folder with a saved VarCE, every rule fitted on dev and
replayed on test, the figures recomputed from the rows, and a rerun with --reuse reporting the same figures."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from helpers import assert_same_figures, pisa_threads_finish_backwards

from st_extensions.cross_encoder.split import build_split_cross_encoder


@pytest.fixture(scope="module")
def reranker(minilm_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("reranker") / "varce"
    build_split_cross_encoder(minilm_path, joint_layers=1, variant="VAR").save_pretrained(str(path))
    return str(path)


def test_depth_run_end_to_end(small_beir, reranker, tmp_path):
    from pyterrier_prob.cli import main

    folder, _ = small_beir
    out = tmp_path / "depth"
    argv = ["depth", "--dataset", str(folder), "--reranker", reranker, "--depth", "10", "--fixed", "2", "5", "10"]
    argv += ["--mean-depths", "3", "5", "--targets", "0.8", "--prefix", "2", "--max-seq-length", "32"]
    argv += ["--timing-pairs", "16", "--output", str(out), "--quiet"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    rows = pd.DataFrame(summary["rows"])
    names = {f"{r}@{lv:g}" if r != "fixed" else f"fixed-{lv:g}" for r, lv in zip(rows["rule"], rows["level"])}
    assert names == {"fixed-2", "fixed-5", "fixed-10", "zscore@3", "zscore@5", "score-distribution@3",
                     "score-distribution@5", "learned@3", "learned@5", "first-pass@3", "first-pass@5",
                     "conformal-recall@0.8", "conformal-fixed@0.8"}  # fmt: skip
    fixed = rows[rows["rule"] == "fixed"].set_index("mean_pairs")  # below k where BM25 returns fewer documents
    assert fixed["level"].tolist() == [2.0, 5.0, 10.0] and (fixed.index <= fixed["level"]).all()
    assert fixed.index.is_monotonic_increasing and fixed["ci95_vs_fixed100"].iloc[-1] is None  # fixed-10 itself
    # a rule's "fixed-k at the same pairs" interpolates the fixed-k values at its mean number of pairs
    xs = fixed.index.tolist()
    for r in rows[rows["rule"] != "fixed"].to_dict("records"):
        m = min(max(r["mean_pairs"], xs[0]), xs[-1])
        lo, hi = max(x for x in xs if x <= m), min(x for x in xs if x >= m)
        w = 0.0 if hi == lo else (m - lo) / (hi - lo)
        want = w * fixed.loc[hi, "nDCG@10"] + (1 - w) * fixed.loc[lo, "nDCG@10"]
        assert r["fixed_k_nDCG@10_at_same_pairs"] == pytest.approx(want, abs=1e-12)
        assert r["mean_pairs"] <= 10 and 0 <= r["kept_recall"] <= 1
    conformal = rows[rows["rule"] == "conformal-recall"].iloc[0]
    assert conformal["promised_recall"] == 0.8 and conformal["fixed_k_for_same_promise"] >= 1
    fixed_promise = rows[rows["rule"] == "conformal-fixed"].iloc[0]  # the same k for every query with k documents
    assert fixed_promise["mean_pairs"] <= conformal["fixed_k_for_same_promise"]
    assert summary["chosen_on_dev"] is None or not summary["chosen_on_dev"].startswith(("fixed", "conformal-fixed"))
    assert summary["chosen_on_dev"] is None or rows["chosen_on_dev"].sum() == 1
    oracle = summary["oracle"][str(folder)]
    assert oracle["nDCG@10"] == pytest.approx(oracle["fixed100_nDCG@10"]) and oracle["mean_depth"] <= 10
    # Meng et al.'s EET: beta 0 is the mean gain over the first stage's order, clipped per query at 0 (so at least
    # the gain of the means); every value a weighted harmonic mean of two numbers in [0, 1]
    for r in [*rows.to_dict("records"), oracle]:
        assert r["EET"]["alpha"] == -0.001 and all(0 <= r["EET"][f"beta={b}"] <= 1 for b in (0, 1, 2))
        assert r["EET"]["beta=0"] >= r["nDCG@10"] - oracle["first_stage_nDCG@10"] - 1e-12
    assert {"z_top1", "gap_1_2", "spread", "std_prefix"} <= set(oracle["depth_rho"])  # the VarCE's std[s] too
    assert (out / "depth_curves.png").stat().st_size > 0
    assert "oracle depth" in (out / "results.md").read_text()

    with pisa_threads_finish_backwards():  # everything reused: the same figures
        assert main([*argv, "--reuse"]) == 0
    again = json.loads((out / "summary.json").read_text())
    strip = lambda rs: [{k: v for k, v in r.items() if k != "s_per_query"} for r in rs]  # noqa: E731 (a timing)
    assert_same_figures(strip(again["rows"]), strip(summary["rows"]))
    assert_same_figures(again["oracle"], summary["oracle"])


def test_depth_options_are_checked(reranker, tmp_path):
    from pyterrier_prob.cli import build_parser
    from pyterrier_prob.experiments import depth

    def config(*argv):
        cfg = depth.config_from_args(build_parser("depth").parse_args(["--output", str(tmp_path), *argv]))
        cfg.check()
        return cfg

    with pytest.raises(ValueError, match="--reranker must be a saved"):
        config()
    with pytest.raises(ValueError, match="--fixed must be ks"):
        config("--reranker", reranker, "--fixed", "5", "10")
    with pytest.raises(ValueError, match="--targets must be recalls"):
        config("--reranker", reranker, "--targets", "1.2")
    assert config("--reranker", reranker).depth == 100


def test_oracle_depth_rho_is_spearman_of_each_list_feature():
    """Which list features predict the oracle depth: per query, the top score's z-value (and the others) against the
    oracle depth, Spearman's rho by scipy; the VarCE's mean std[s] over the prefix; None for a constant feature."""
    from scipy.stats import spearmanr

    from pyterrier_prob.experiments.depth import oracle_depth_rho

    rng = np.random.default_rng(0)
    rows = []
    for q in range(8):
        scores = np.sort(rng.normal(size=12))[::-1] * (1 + q)
        rows += [
            {"qid": f"q{q}", "docno": f"d{r}", "rank": r, "score": s, "rr_std": 0.1 * q + 0.01 * r}
            for r, s in enumerate(scores)
        ]
    run = pd.DataFrame(rows)
    oracle = pd.Series(rng.integers(0, 12, 8), index=[f"q{q}" for q in range(8)])
    cfg = SimpleNamespace(depth=12, prefix=3)
    rho = oracle_depth_rho(cfg, run, oracle)
    z = [((g["score"].iloc[0] - g["score"].mean()) / g["score"].std(ddof=0)) for _, g in run.groupby("qid")]
    assert rho["z_top1"] == pytest.approx(spearmanr(z, oracle).statistic)
    std = [g[g["rank"] < 3]["rr_std"].mean() for _, g in run.groupby("qid")]
    assert rho["std_prefix"] == pytest.approx(spearmanr(std, oracle).statistic)
    assert rho["length"] is None  # every list has 12 documents
