"""``pyterrier-prob varce``: options, bad settings, the training rows, and a tiny end-to-end run."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from helpers import assert_same_figures, cli_help, pisa_threads_finish_backwards

from pyterrier_prob.cli import main
from pyterrier_prob.experiments.varce import build_noises
from pyterrier_prob.varce import noise as noise_module
from pyterrier_prob.varce.noise import wordnet_available

SYSTEMS = ["BM25", "CE", "VarCE-MEANVAR", "VarCE-VAR"]


def test_help_lists_the_options(capsys):
    options = "--negatives --beta --depth --max-queries --risks --robust-queries --robust-depth --noise --ood"
    cli_help(capsys, "varce", options)


BAD_SETTINGS = {
    "--negatives 0": "--negatives must be >= 1",
    "--negatives 5 --pool-depth 4": "--pool-depth (4) must be at least --negatives (5)",
    "--beta -1": "--beta must be a finite number >= 0",
    "--depth 0": "--depth must be >= 1",
    "--max-queries 0": "--max-queries must be >= 1",
    "--robust-queries -1": "--robust-queries must be >= 0",
    "--risks nan": "--risks must be finite numbers",
    "--dev-split x --test-split x": "must differ from the train and dev splits",
    "--noise RD --robust-depth 0": "--robust-depth must be >= 1",
    "--steps -1": "--steps must be >= 0",
    "--claims-json claims.json": "--claims-json: varce records no claims rows",  # (was accepted and ignored)
}


@pytest.mark.parametrize("argv, message", BAD_SETTINGS.items())
def test_bad_settings_exit_2_with_a_message(argv, message, capsys):
    assert main(["varce", *argv.split()]) == 2
    assert message in capsys.readouterr().err


# ---- the training rows -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_bm25(small_beir, tmp_path_factory):
    """The small BEIR collection and a PISA BM25 index of it."""
    from pyterrier_pisa import PisaIndex

    from pyterrier_prob.collections import load_collection

    coll = load_collection(small_beir[0])
    index = PisaIndex(str(tmp_path_factory.mktemp("bm25") / "index.pisa"), text_field="text", threads=1)
    index.index(coll.corpus_iter())
    return coll, index


def _check_rows(coll, split, rows, negatives):
    """Labels 1, 0 x negatives per group; the positive is judged relevant; no negative is judged for its query."""
    texts = {}
    for d in coll.corpus_iter():
        texts.setdefault(d["text"], set()).add(d["docno"])
    qid_of = {" ".join(q.split()): qid for qid, q in zip(coll.topics(split)["qid"], coll.topics(split)["query"])}
    qrels = coll.qrels(split)
    judged = qrels.groupby("qid")["docno"].apply(set).to_dict()
    relevant = qrels[qrels["label"] >= 1].groupby("qid")["docno"].apply(set).to_dict()
    frame = rows.to_pandas()
    assert list(frame.columns) == ["query", "document", "label"]
    group = 1 + negatives
    assert len(frame) % group == 0
    assert frame["label"].tolist() == ([1.0] + [0.0] * negatives) * (len(frame) // group)
    for start in range(0, len(frame), group):
        g = frame.iloc[start : start + group]
        assert g["query"].nunique() == 1
        qid = qid_of[g["query"].iloc[0]]
        assert texts[g["document"].iloc[0]] & relevant[qid]
        for doc in g["document"].iloc[1:]:
            assert not texts[doc] & judged[qid], "a judged document was used as a negative"
        assert g["document"].iloc[1:].nunique() == negatives


@pytest.mark.parametrize("negatives", [3, 2])
def test_training_rows_from_bm25(small_bm25, negatives):
    from pyterrier_prob.varce.data import cross_encoder_training_data

    coll, index = small_bm25
    rows, info = cross_encoder_training_data(
        coll, "train", index.bm25(num_results=30), n_groups=10, negatives=negatives
    )
    assert len(rows) == 10 * (1 + negatives)
    _check_rows(coll, "train", rows, negatives)
    assert info["queries"] == 10 and info["groups"] == 10 and info["rows"] == len(rows)
    assert info["negatives_per_group"] == negatives
    again, _ = cross_encoder_training_data(coll, "train", index.bm25(num_results=30), n_groups=10, negatives=negatives)
    assert again.to_dict() == rows.to_dict()  # seeded


def test_training_rows_cycle_through_queries_and_fill_in_random_negatives(small_bm25):
    from pyterrier_prob.varce.data import cross_encoder_training_data, groups_for

    coll, _ = small_bm25
    n = len(coll.topics("train"))

    def nothing(topics):
        return pd.DataFrame({"qid": pd.Series(dtype=str), "docno": pd.Series(dtype=str), "rank": []})

    groups = n + 5  # more groups than queries: every query once, then round again
    rows, info = cross_encoder_training_data(coll, "train", nothing, n_groups=groups, negatives=3, seed=1)
    _check_rows(coll, "train", rows, 3)
    assert info["queries"] == n and info["groups"] == groups
    assert info["random_negatives_filled_in"] == 3 * groups
    assert groups_for(steps=10, batch_size=16, negatives=3) == 40
    assert groups_for(steps=3, batch_size=5, negatives=3) == 4  # rounded up


def test_training_rows_mine_negatives_from_each_first_stage_in_turn(small_bm25):
    from pyterrier_prob.varce.data import cross_encoder_training_data

    coll, _ = small_bm25
    docnos = sorted(d["docno"] for d in coll.corpus_iter())

    def stage(order):  # a first stage ranking the corpus in a fixed order for every query
        return lambda topics: pd.DataFrame(
            [(q, d, r) for q in topics["qid"] for r, d in enumerate(order)], columns=["qid", "docno", "rank"]
        )

    stages = {"forward": stage(docnos), "back": stage(docnos[::-1])}
    rows, info = cross_encoder_training_data(coll, "train", stages, n_groups=6, negatives=4, pool_depth=5)
    _check_rows(coll, "train", rows, 4)
    assert info["negatives_from"] == {"forward": 12, "back": 12}  # 2 + 2 of each group's 4, in turn
    assert info["random_negatives_filled_in"] == 0
    texts = coll.doc_texts(docnos)
    pools = {name: {texts[d] for d in order[:5]} for name, order in (("f", docnos), ("b", docnos[::-1]))}
    for g in range(6):  # negatives 1 and 3 from the first stage's top 5, 2 and 4 from the second's
        group = rows.select(range(g * 5, g * 5 + 5))["document"]
        assert group[1] in pools["f"] and group[3] in pools["f"]
        assert group[2] in pools["b"] and group[4] in pools["b"]
    with pytest.raises(ValueError, match="first_stage must be"):
        cross_encoder_training_data(coll, "train", {}, n_groups=2)


def test_training_rows_take_positives_from_the_first_stages_top_k(small_bm25):
    from pyterrier_prob.varce.data import cross_encoder_training_data

    coll, index = small_bm25
    bm25 = index.bm25(num_results=5)
    rows, info = cross_encoder_training_data(coll, "train", bm25, n_groups=8, negatives=2, positive_depth=5)
    _check_rows(coll, "train", rows, 2)
    topics = coll.topics("train")
    top5 = bm25(topics[["qid", "query"]])
    texts = coll.doc_texts(set(top5["docno"]))
    retrieved = {(q, texts[d]) for q, d in zip(top5["qid"], top5["docno"])}
    by_query = dict(zip(topics["query"].map(lambda t: " ".join(str(t).split())), topics["qid"].astype(str)))
    positives = rows.filter(lambda r: r["label"] == 1.0)
    assert all((by_query[q], d) in retrieved for q, d in zip(positives["query"], positives["document"]))
    assert info["positives_available"] < info["relevant_judged"]
    with pytest.raises(ValueError, match="positive_depth must be an int >= 1"):
        cross_encoder_training_data(coll, "train", bm25, n_groups=2, positive_depth=0)


def test_rerank_rows_at_a_shallower_depth_rerank_only_bm25s_top_k():
    from scipy.stats import ttest_rel

    from pyterrier_prob.varce import per_query
    from pyterrier_prob.varce.analysis import ranked
    from pyterrier_prob.varce.analysis import rerank_rows as _rerank_rows

    qids, docs = ["q1", "q2", "q3"], [f"d{i}" for i in range(6)]
    cand = pd.DataFrame(
        [(q, d, 10.0 - r, r) for q in qids for r, d in enumerate(docs)], columns=["qid", "docno", "score", "rank"]
    )
    topics = pd.DataFrame({"qid": qids, "query": ["a", "b", "c"]})
    qrels = pd.DataFrame({"qid": ["q1", "q2", "q3", "q3"], "docno": ["d5", "d3", "d1", "d4"], "label": [1, 1, 1, 2]})
    mean = cand["docno"].map({d: float(i) for i, d in enumerate(docs)}).to_numpy()  # reverses BM25's order
    runs = {"BM25": cand, "CE": ranked(cand, mean, mean * 0)}
    rows = {(r["depth"], r["system"]): r for d in (6, 3) for r in _rerank_rows("c", d, cand, runs, topics, qrels)}
    top3 = cand[cand["rank"] < 3]
    expected = per_query(ranked(top3, mean[cand["rank"] < 3], mean[cand["rank"] < 3] * 0), qrels, topics=topics)
    assert rows[(3, "CE")]["nDCG@10"] == pytest.approx(expected.mean())
    bm25_3 = per_query(top3, qrels, topics=topics)
    assert rows[(3, "BM25")]["nDCG@10"] == pytest.approx(bm25_3.mean())
    full_ce = per_query(runs["CE"], qrels, topics=topics)
    full_bm25 = per_query(cand, qrels, topics=topics)
    assert rows[(6, "CE")]["p_vs_bm25"] == pytest.approx(ttest_rel(full_ce, full_bm25).pvalue)
    assert rows[(6, "CE")]["nDCG@10"] > rows[(6, "BM25")]["nDCG@10"]  # d5, d3, d4 move up
    assert rows[(6, "BM25")]["p_vs_bm25"] is None and rows[(6, "CE")]["p_vs_CE"] is None


def test_rerank_rows_interpolated_with_bm25():
    """``<re-ranker>+BM25`` rows: alpha 0 is BM25's order, alpha 1 the re-ranker's, in between the per-query z-score
    mix of pyterrier_prob.fusion over the depth's candidates."""
    from pyterrier_prob.fusion import interpolate
    from pyterrier_prob.varce import per_query
    from pyterrier_prob.varce.analysis import ranked
    from pyterrier_prob.varce.analysis import rerank_rows as _rerank_rows

    qids, docs = ["q1", "q2", "q3"], [f"d{i}" for i in range(6)]
    rng = np.random.default_rng(0)
    cand = pd.DataFrame(
        [(q, d, 10.0 - r + rng.uniform(0, 0.5), r) for q in qids for r, d in enumerate(docs)],
        columns=["qid", "docno", "score", "rank"],
    )
    topics = pd.DataFrame({"qid": qids, "query": ["a", "b", "c"]})
    qrels = pd.DataFrame({"qid": ["q1", "q2", "q3", "q3"], "docno": ["d5", "d3", "d1", "d4"], "label": [1, 1, 1, 2]})
    mean = rng.normal(size=len(cand))
    runs = {"BM25": cand, "CE": ranked(cand, mean, mean * 0)}

    def rows(alpha, depth=6):
        out = _rerank_rows("c", depth, cand, runs, topics, qrels, {"CE": alpha})
        return {r["system"]: r for r in out}

    assert rows(0.0)["CE+BM25"]["nDCG@10"] == pytest.approx(rows(0.0)["BM25"]["nDCG@10"])
    assert rows(1.0)["CE+BM25"]["nDCG@10"] == pytest.approx(rows(1.0)["CE"]["nDCG@10"])
    top = cand[cand["rank"] < 4]
    fused = interpolate(top["qid"], top["score"], mean[cand["rank"] < 4], 0.4)
    expected = per_query(top.assign(score=fused), qrels, topics=topics).mean()
    assert rows(0.4, depth=4)["CE+BM25"]["nDCG@10"] == pytest.approx(expected)
    assert "CE+BM25" not in {r["system"] for r in _rerank_rows("c", 6, cand, runs, topics, qrels)}


def test_training_rows_need_relevant_documents(small_bm25):
    from pyterrier_prob.varce.data import cross_encoder_training_data

    coll, index = small_bm25
    with pytest.raises(ValueError, match="no query with a judged-relevant document"):
        cross_encoder_training_data(coll, "train", index.bm25(num_results=30), n_groups=4, min_relevance=5)
    with pytest.raises(ValueError, match="negatives must be an int >= 1"):
        cross_encoder_training_data(coll, "train", index.bm25(num_results=30), n_groups=4, negatives=0)


# ---- end to end --------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_without_wordnet_the_robustness_table_skips_sr_with_a_note(monkeypatch, tmp_path):
    monkeypatch.setattr(noise_module, "_wordnet_search_path", lambda: [])  # a machine without WordNet
    noises, notes = build_noises(["SR", "RS", "RD"], seed=3)
    assert list(noises) == ["RD", "RS"] and noises["RS"].seed == 3  # NOISE_ORDER's order
    assert len(notes) == 1 and notes[0].startswith("robustness: SR (WordNet synonym replacement) skipped")
    assert "apt-get install wordnet-base" in notes[0]
    # with WordNet (a one-synset database in $WORDNET_DIR) SR is built
    (tmp_path / "index.noun").write_text("fever n 1 0 1 0 00000000\n")
    (tmp_path / "data.noun").write_text("00000000 03 n 02 fever 0 pyrexia 0 000 | a gloss\n")
    for pos in ("verb", "adj", "adv"):
        (tmp_path / f"index.{pos}").write_text("")
    monkeypatch.setattr(noise_module, "_wordnet_search_path", lambda: [str(tmp_path)])
    noises, notes = build_noises(["SR", "RD"], seed=3)
    assert list(noises) == ["RD", "SR"] and notes == []
    assert noises["SR"].perturb("fever", "q") == "pyrexia"


def test_tiny_run_end_to_end(small_beir, small_beir_no_train_no_dev, tmp_path):
    """Three re-rankers trained for 2 steps on the small BEIR folder, every table written; --reuse neither trains
    nor scores again; a saved VarCrossEncoder with --steps 0 is evaluated as given, also zero-shot (--ood)."""
    folder, info = small_beir
    out = tmp_path / "varce"
    argv = ["varce", "--dataset", str(folder), "--teacher", "none", "--steps", "2", "--batch-size", "4"]
    argv += ["--max-seq-length", "32"]
    argv += ["--depth", "5", "--robust-queries", "3", "--robust-depth", "3", "--output", str(out), "--quiet"]
    assert main(argv) == 0

    results = pd.read_csv(out / "results.csv")
    assert results["name"].tolist() == SYSTEMS
    assert (results["queries"] == info["queries"]["test"]).all() and (results["depth"] == 5).all()
    assert results[["nDCG@10", "RR@10"]].apply(lambda c: c.between(0, 1)).all().all()
    assert {"nDCG@10 p-value", "RR@10 p-value"} <= set(results.columns)
    assert results.loc[results["name"] == "CE", "nDCG@10 p-value"].isna().all()  # the significance baseline

    unc = pd.read_csv(out / "uncertainty.csv")
    assert unc["name"].tolist() == ["VarCE-MEANVAR", "VarCE-VAR"]
    assert (unc["std_q05"] > 0).all() and (unc["std_q05"] <= unc["std_q95"]).all()
    risk = pd.read_csv(out / "risk.csv")
    assert risk["risk"].tolist() == [0.0, 0.5, 1.0, 2.0] * 2
    assert risk["changed_top10"].between(0, 1).all()
    hard = pd.read_csv(out / "hard_queries.csv")
    assert set(hard["hard_under"]) == {"CE", "BM25"} and set(hard["name"]) == set(SYSTEMS)
    assert hard["%no"].between(0, 100).all()
    robust = pd.read_csv(out / "robustness.csv")
    if wordnet_available():
        assert list(dict.fromkeys(robust["perturbation"])) == ["clean", "RD", "RS", "SE", "SR", "WEI", "WES"]
    else:  # SR is skipped with a note, the other perturbations run
        assert list(dict.fromkeys(robust["perturbation"])) == ["clean", "RD", "RS", "SE", "WEI", "WES"]
        notes = json.loads((out / "summary.json").read_text())["data"]["notes"]
        assert any(n.startswith("robustness: SR (WordNet synonym replacement) skipped") for n in notes), notes
    assert (robust["queries"] == 3).all() and robust["changed_queries"].between(0, 3).all()
    assert robust[["nDCG@10", "RR@10"]].apply(lambda c: c.between(0, 1)).all().all()
    clean = robust[robust["perturbation"] == "clean"]
    assert (clean["nDCG@10 drop"] == 0).all()

    summary = json.loads((out / "summary.json").read_text())
    assert summary["experiment"] == "varce" and summary["systems"] == SYSTEMS
    assert summary["fine_tuned"] is True
    assert summary["training_rows"]["rows"] == 8  # 2 steps x 4 rows: 2 groups of 1 relevant + 3 negatives
    assert set(summary["training_loss_first_last"]) == {"CE", "VarCE-MEANVAR", "VarCE-VAR"}
    assert {"train_CE", "train_VarCE-MEANVAR", "train_VarCE-VAR"} <= set(summary["timings_s"])
    assert all(s["pairs_scored"] > 0 for s in summary["scoring"].values())
    assert summary["data"]["test"].endswith("/test")
    assert (out / "results.md").read_text().startswith("# VarCrossEncoder")
    assert (out / "models" / "VarCE-VAR" / "modules.json").exists()

    with pisa_threads_finish_backwards():  # same models, same scores: nothing trained or scored again
        assert main([*argv, "--reuse"]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert not {"train_CE", "train_VarCE-MEANVAR", "train_VarCE-VAR"} & set(again["timings_s"])
    assert all(s["pairs_scored"] == 0 and s["pairs_from_earlier_runs"] > 0 for s in again["scoring"].values())
    assert_same_figures(pd.read_csv(out / "results.csv"), results)
    assert again["training_rows"] == summary["training_rows"]  # the reused models' rows, as their training saved
    assert "Training rows: 8 from" in (out / "results.md").read_text()

    given = tmp_path / "given"
    argv = ["varce", "--dataset", str(folder), "--teacher", "none", "--steps", "0"]
    argv += ["--model", str(out / "models" / "VarCE-VAR")]
    argv += ["--depth", "5", "--max-queries", "6", "--robust-queries", "0", "--max-seq-length", "32"]
    argv += ["--ood", str(small_beir_no_train_no_dev[0]), "--ood-queries", "4", "--ood-depth", "3"]
    assert main([*argv, "--output", str(given), "--quiet"]) == 0
    summary = json.loads((given / "summary.json").read_text())
    assert summary["systems"] == ["BM25", "VarCE-VAR"] and summary["fine_tuned"] is False
    assert summary["model_kind"] == "var"
    res = pd.read_csv(given / "results.csv")
    assert res["name"].tolist() == ["BM25", "VarCE-VAR"] * 2
    assert res["queries"].tolist() == [6, 6, 4, 4] and res["depth"].tolist() == [5, 5, 3, 3]
    assert res["collection"].nunique() == 2
    assert res.loc[res["name"] == "BM25", "nDCG@10 p-value"].isna().all()  # no CE: tested against BM25
    assert pd.read_csv(given / "uncertainty.csv")["name"].tolist() == ["VarCE-VAR"] * 2
    assert not (given / "robustness.csv").exists()


@pytest.mark.slow
def test_patience_stops_the_curves_and_a_later_run_without_curves_reports_none(small_beir, tmp_path, monkeypatch):
    """``--patience`` stops each re-ranker's training (a dev value that never improves: after one point past the
    best); a later run into the same folder that draws no curve (frozen recipe) does not report the earlier ones."""
    from pyterrier_prob.experiments import varce_train

    monkeypatch.setattr(varce_train.DevRerank, "__call__", lambda self, model: 0.5)  # dev never improves
    folder, _ = small_beir
    out = tmp_path / "varce-patience"
    argv = ["varce", "--dataset", str(folder), "--teacher", "none", "--steps", "4", "--batch-size", "4"]
    argv += ["--max-seq-length", "32"]
    argv += ["--depth", "5", "--robust-queries", "0", "--dev-queries", "4", "--dev-depth", "5", "--output", str(out)]
    partial_run = ["--recipe", "partial", "--train-layers", "1", "--dev-every", "1", "--patience", "1", "--quiet"]
    assert main([*argv, *partial_run]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["dev_curves"]) == {"CE", "VarCE-MEANVAR", "VarCE-VAR"}
    for name, curve in summary["dev_curves"].items():
        assert [p["step"] for p in curve["points"]] == [0, 1], name  # stopped at step 1, not at --steps 4
        saved = json.loads((out / "models" / name / "train_settings.json").read_text())
        assert len(saved["losses"]) == 1 and saved["settings"]["patience"] == 1
    assert "Learning curves" in (out / "results.md").read_text()

    assert main([*argv, "--recipe", "frozen", "--steps", "2", "--quiet"]) == 0  # no curve under frozen
    summary = json.loads((out / "summary.json").read_text())
    assert summary["dev_curves"] == {}
    assert "Learning curves" not in (out / "results.md").read_text()
