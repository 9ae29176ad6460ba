"""The GPU students' script (``benchmarks/gpu_students.py``) at a tiny size on the CPU: its own nDCG@10 (the device
has no ir_measures) against ir_measures, and its device step end to end on a hand-made bundle."""

from __future__ import annotations

import gzip
import json
import re

import ir_measures
import numpy as np
import pandas as pd
import pytest
from helpers import load_benchmark


@pytest.fixture(scope="module")
def gpu():
    return load_benchmark("gpu_students")


def test_device_ndcg_is_ir_measures(gpu):
    rng = np.random.default_rng(0)
    pairs = pd.DataFrame({"qid": np.repeat(["a", "b", "c"], 15), "docno": [f"d{i}" for i in range(45)]})
    scores = rng.normal(size=45).round(1)  # ties on purpose
    qrels = pd.DataFrame({"qid": ["a", "a", "b", "b", "a"], "docno": ["d3", "d7", "d20", "d99", "d1"]})
    qrels["label"] = [2, 1, 1, 2, 0]
    ours = gpu.ndcg_at_10(pairs, scores, qrels)
    run = pairs.assign(score=scores).rename(columns={"qid": "query_id", "docno": "doc_id"})
    ref = {
        m.query_id: m.value
        for m in ir_measures.iter_calc(
            [ir_measures.nDCG @ 10], qrels.rename(columns={"qid": "query_id", "docno": "doc_id", "label": "relevance"}),
            run,
        )
    }  # fmt: skip
    for qid in ("a", "b"):
        assert ours[qid] == pytest.approx(ref[qid], abs=1e-12)
    assert ours["c"] == 0.0
    # over given qids, as the CPU students' dev curves: one without candidates scores 0 and counts
    over = gpu.ndcg_at_10(pairs, scores, qrels, qids=["a", "b", "c", "z"])
    assert list(over.index) == ["a", "b", "c", "z"] and over["z"] == 0.0
    assert over.mean() == pytest.approx((ref["a"] + ref["b"]) / 4, abs=1e-12)


def test_device_step_on_a_tiny_bundle(gpu, minilm_path, tmp_path):
    """Two steps of each student on four rows, the dev curve at steps 0, 1, 2 and the test scores of the best dev
    point, all from the bundle's files; the added head trains at a rate of its own."""
    from sentence_transformers import CrossEncoder, SentenceTransformer

    from st_extensions.cross_encoder import build_var_cross_encoder
    from st_extensions.cross_encoder.head import VariationalHead

    bundle = tmp_path / "b"
    bundle.mkdir()
    texts = ["vitamin d bones", "statins heart", "Vitamin D helps bones.", "Statins lower cholesterol.",
             "Pandas eat bamboo.", "Rain falls in spring.", "Bones need calcium.", "Hearts pump blood."]  # fmt: skip
    idx = np.array([[0, 2, 4, 5, 6], [1, 3, 5, 4, 7], [0, 6, 5, 7, 4], [1, 7, 4, 6, 5]], dtype=np.int32)
    label = np.array([[5, 1, 0, 2], [5, 0, 1, 2], [4, 0, 1, 0], [4, 1, 0, 0]], dtype=np.float32)
    np.savez_compressed(bundle / "rows.npz", idx=idx, label=label)
    with gzip.open(bundle / "texts.json.gz", "wt", encoding="utf8") as f:
        json.dump(texts, f)
    pairs = pd.DataFrame({"qid": ["q0"] * 3 + ["q1"] * 3, "docno": ["D2", "D4", "D6", "D3", "D5", "D7"]})
    pairs["q"], pairs["t"] = np.array([0, 0, 0, 1, 1, 1]), np.array([2, 4, 6, 3, 5, 7])
    qrels = pd.DataFrame({"qid": ["q0", "q1"], "docno": ["D2", "D3"], "label": [1, 1]})
    splits = {}
    for name, key in (("dev", "dev"), ("beir/nfcorpus", "beir_nfcorpus")):
        pairs.to_parquet(bundle / f"pairs-{key}.parquet")
        qrels.to_parquet(bundle / f"qrels-{key}.parquet")
        splits[name] = {"file": key, "pairs": len(pairs), "queries": 2}
    manifest = {"rows": 4, "documents_per_row": 4, "splits": splits, "steps": 2, "batch_size": 2, "max_seq_length": 32}
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    SentenceTransformer(minilm_path, device="cpu").half().save(str(bundle / "teacher"))
    ce, var = CrossEncoder(minilm_path, num_labels=1), build_var_cross_encoder(minilm_path, variant="VAR")
    heads = {"CE": sum(p.numel() for p in ce.model.classifier.parameters())}
    heads["VarCE-VAR"] = sum(p.numel() for m in var.modules() if isinstance(m, VariationalHead) for p in m.parameters())
    totals = {"CE": sum(p.numel() for p in ce.parameters()), "VarCE-VAR": sum(p.numel() for p in var.parameters())}
    assert heads["CE"] == 385 and 0 < heads["VarCE-VAR"] < totals["VarCE-VAR"] / 100
    out = tmp_path / "out"
    gpu.device(str(bundle), str(out), ["CE", "VarCE-VAR"], steps=2, eval_every=1, lr=1e-4, batch=2, patience=5)
    for student in ("CE", "VarCE-VAR"):
        curve = json.loads((out / student / "curve.json").read_text())
        assert [p["step"] for p in curve["points"]] == [0, 1, 2] and curve["card"] == "CPU" and curve["rows"] == 4
        assert curve["best"]["dev"] == max(p["dev"] for p in curve["points"])
        scores = np.load(out / student / "beir_nfcorpus.npy")
        assert scores.shape == (6,) and np.isfinite(scores).all()
        # the added head trains at its own rate (the VarCE head's declared 1e-3, its branches scaled), the rest at lr
        groups = curve["param_groups"]
        head = sum(g["parameters"] for g in groups if g["lr"] != 1e-4)
        assert sorted({g["lr"] for g in groups if g["lr"] != 1e-4}) == curve["head_lr"]
        assert head == heads[student] and sum(g["parameters"] for g in groups) == totals[student]
    assert curve["head_lr"] and max(curve["head_lr"]) == 1e-3


def test_head_rates_name_the_added_parameters(gpu, minilm_path):
    """The CE's new ``classifier`` (and nothing else) at the head's rate, or at ``head_lr`` when given."""
    import torch
    from sentence_transformers import CrossEncoder
    from sentence_transformers.cross_encoder.losses import MarginMSELoss

    ce = CrossEncoder(minilm_path, num_labels=1, activation_fn=torch.nn.Identity())
    loss = MarginMSELoss(ce)
    for head_lr, rate in ((None, 1e-3), (5e-4, 5e-4)):
        mapping = gpu.head_rates(ce, loss, "CE", head_lr)
        named = [n for n, _ in loss.named_parameters() if any(re.search(k, n) for k in mapping)]
        assert [n.rsplit(".", 2)[-2:] for n in named] == [["classifier", "weight"], ["classifier", "bias"]]
        assert set(mapping.values()) == {rate}


def test_collect_rows_against_the_main_run(gpu, tmp_path):
    """``collect`` evaluates a returned student's test scores with ir_measures and pairs them with the main run's
    per-query figures: the row's nDCG@10 is the mean of per-query values a loop gives, and its p against the
    bi-encoder is scipy's paired t-test on them."""
    from scipy.stats import ttest_rel

    bundle, scores, output = tmp_path / "b", tmp_path / "s", tmp_path / "o"
    for p in (bundle, scores / "CE", output):
        p.mkdir(parents=True)
    qids = [f"q{i}" for i in range(6)]
    pairs = pd.DataFrame({"qid": np.repeat(qids, 3), "docno": [f"d{i}" for i in range(18)]})
    pairs["q"], pairs["t"] = 0, 0
    qrels = pd.DataFrame({"qid": qids, "docno": [f"d{3 * i + i % 3}" for i in range(6)], "label": 1})
    pairs.to_parquet(bundle / "pairs-x.parquet")
    qrels.to_parquet(bundle / "qrels-x.parquet")
    splits = {"dev": {"file": "dev", "queries": 3, "qids": ["v1", "v2", "v3", "v4"]}, "coll": {"file": "x"}}
    (bundle / "manifest.json").write_text(json.dumps({"splits": splits}))
    s = np.tile([3.0, 2.0, 1.0], 6)  # each query's first document on top: reciprocal gains 1, 1/log2(3), 1/2
    np.save(scores / "CE" / "x.npy", s.astype(np.float32))
    curve = {
        "card": "TestCard",
        "points": [{"step": 0, "dev": 0.25}, {"step": 3, "dev": 0.5}],
        "best": {"step": 3, "dev": 0.5},
    }
    (scores / "CE" / "curve.json").write_text(json.dumps(curve))
    rng = np.random.default_rng(1)
    ref = {name: dict(zip(qids, rng.uniform(size=6))) for name in ("BM25", "Teacher (bi-encoder)", "CE")}
    (output / "summary.json").write_text(json.dumps({"per_query": {"coll": ref}}))
    result = gpu.collect(str(bundle), str(scores), str(output))
    (row,) = result["rows"]
    expected = np.array([[1.0, 1 / np.log2(3), 0.5][i % 3] for i in range(6)])
    assert row["system"] == "CE (J = 6, TestCard)" and row["queries"] == 6 and row["best_dev_step"] == 3
    assert row["nDCG@10"] == pytest.approx(expected.mean(), abs=1e-9)
    assert result["per_query"]["coll"][row["system"]] == pytest.approx(dict(zip(qids, expected)), abs=1e-9)
    assert result["reference"]["coll"] == pytest.approx({k: np.mean(list(v.values())) for k, v in ref.items()})
    # the device averaged its dev points over the 3 dev queries with candidates: on the CPU curves' footing, 4 queries
    assert (
        row["dev"] == pytest.approx(0.5 * 3 / 4)
        and result["students"]["CE (J = 6, TestCard)"]["dev_as_run"]["best"]["dev"] == 0.5
    )
    bi = np.array([ref["Teacher (bi-encoder)"][q] for q in qids])
    assert row["p_vs_bi_encoder"] == pytest.approx(ttest_rel(expected, bi).pvalue, rel=1e-9)
    low, high = row["ci95_vs_bm25"]
    assert low < (expected - np.array([ref["BM25"][q] for q in qids])).mean() < high

    # a second configuration in its own folder: named by its batch and rate, its VarCE paired with its own CE
    second = tmp_path / "s2"
    config = {"card": "TestCard", "batch_size": 64, "lr": 4e-5, "dev_queries": 4}
    for student, order in (("CE", [3.0, 2.0, 1.0]), ("VarCE-VAR", [1.0, 3.0, 2.0])):
        (second / student).mkdir(parents=True)
        np.save(second / student / "x.npy", np.tile(order, 6).astype(np.float32))
        c = config | {"points": [{"step": 0, "dev": 0.2}], "best": {"step": 0, "dev": 0.2}}
        (second / student / "curve.json").write_text(json.dumps(c))
    both = gpu.collect(str(bundle), [str(scores), str(second)], str(output))
    names = [r["system"] for r in both["rows"]]
    assert names == ["CE (J = 6, TestCard)", "CE (J = 6, TestCard, batch 64, lr 4e-05)",
                     "VarCE-VAR (J = 6, TestCard, batch 64, lr 4e-05)"]  # fmt: skip
    var = both["rows"][2]
    mine = np.array([[0.5, 1.0, 1 / np.log2(3)][i % 3] for i in range(6)])  # scores [1, 3, 2]: the relevant one's rank
    assert var["nDCG@10"] == pytest.approx(mine.mean(), abs=1e-9)
    assert var["p_vs_ce_j6"] == pytest.approx(ttest_rel(mine, expected).pvalue, rel=1e-9)
    assert both["rows"][1]["p_vs_ce_j6"] is None and var["dev"] == 0.2 and var["batch_size"] == 64
    with pytest.raises(SystemExit, match="comes back twice"):
        gpu.collect(str(bundle), [str(second), str(second)], str(output))
