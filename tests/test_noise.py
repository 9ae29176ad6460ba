"""Query noise (VarCrossEncoder Sec. 4.5.2) and hard-query analysis (Sec. 5)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pandas as pd
import pyterrier as pt
import pytest

from pyterrier_prob.varce import noise as noise_module
from pyterrier_prob.varce.hard_queries import hard_queries, hard_query_table, no_relevant_in_top, percent_no
from pyterrier_prob.varce.noise import (
    ABBREVIATIONS,
    NOISE_TYPES,
    EmbeddingNeighbours,
    QueryNoise,
    WordNet,
    all_noise,
    find_wordnet,
    spelling_dictionary,
    wordnet_available,
)

TOPICS = pd.DataFrame(
    {
        "qid": ["1", "2", "3", "4", "5", "6"],
        "query": [
            "What causes fever in children?",
            "vitamin d deficiency symptoms",
            "cancer treatment options",
            "how does hypertension affect the kidneys",
            "effects of caffeine on sleep",
            "diabetes",
        ],
    }
)


NO_WORDNET = "no WordNet database on this machine (apt-get install wordnet-base, or set $WORDNET_DIR)"


def _has_system_wordnet() -> bool:
    return wordnet_available()


@pytest.fixture
def no_wordnet(monkeypatch):
    """A machine without WordNet, whatever this one has: the default search path is empty."""
    monkeypatch.setattr(noise_module, "_wordnet_search_path", lambda: [])


@pytest.fixture(scope="module")
def neighbours(base_model):
    return EmbeddingNeighbours(base_model, top_k=10)


@pytest.fixture(scope="module")
def tiny_wordnet(tmp_path_factory):
    """A hand-made WordNet in the Princeton database format (byte offsets and all)."""
    root = tmp_path_factory.mktemp("wordnet")
    header = "  1 This software and database is being provided to you, the LICENSEE, ...\n"
    synsets = {
        "noun": [
            ("n", ["fever", "febrility", "pyrexia"]),
            ("n", ["child", "kid", "youngster"]),
            ("n", ["cancer", "malignant_neoplastic_disease"]),
            ("n", ["treatment", "intervention"]),
        ],
        "verb": [("v", ["cause", "do", "make"]), ("v", ["affect", "impact", "touch"])],
        "adj": [],
        "adv": [],
    }
    for pos, entries in synsets.items():
        data, lemmas = header, {}
        for ss_type, words in entries:
            offset = len(data.encode())
            body = " ".join(f"{w} 0" for w in words)
            data += f"{offset:08d} 03 {ss_type} {len(words):02x} {body} 000 | a gloss\n"
            for w in words:
                lemmas.setdefault(w, []).append(offset)
        (root / f"data.{pos}").write_text(data)
        index = header + "".join(
            f"{w} {pos[0]} {len(o)} 0 {len(o)} 0 " + " ".join(f"{x:08d}" for x in o) + "\n"
            for w, o in sorted(lemmas.items())
        )
        (root / f"index.{pos}").write_text(index)
    (root / "noun.exc").write_text("children child\n")
    return root


# ---- one word per query, deterministic ---------------------------------------------------------------------


def _check_one_word(kind: str, before: str, after: str) -> bool:
    """True when ``after`` is ``before`` with exactly one word-level edit of ``kind``; False when unchanged."""
    a, b = before.split(), after.split()
    if a == b:
        return False
    if kind in ("spelling", "wordemb_substitute", "synonym"):
        assert len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1, (before, after)
    elif kind == "wordemb_insert":
        assert len(b) == len(a) + 1 and any(b[:i] + b[i + 1 :] == a for i in range(1, len(b))), (before, after)
    elif kind == "random_delete":
        assert len(b) == len(a) - 1 and any(a[:i] + a[i + 1 :] == b for i in range(len(a))), (before, after)
    elif kind == "random_swap":
        diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        assert len(a) == len(b) and Counter(a) == Counter(b) and len(diff) == 2, (before, after)
        i, j = diff
        assert a[i] == b[j] and a[j] == b[i]
    return True


def _noise(kind, seed, neighbours, wordnet_dir):
    return QueryNoise(kind, seed, embedding_model=neighbours, wordnet_dir=wordnet_dir)


@pytest.mark.parametrize("kind", NOISE_TYPES)
def test_each_noise_changes_one_word_deterministically(kind, neighbours, tiny_wordnet):
    noise = _noise(kind, 7, neighbours, tiny_wordnet)
    out = noise(TOPICS)
    assert list(out["qid"]) == list(TOPICS["qid"]) and list(out["query_0"]) == list(TOPICS["query"])
    changed = [_check_one_word(kind, q0, q) for q0, q in zip(out["query_0"], out["query"])]
    assert sum(changed) >= (3 if kind == "synonym" else 4), list(out["query"])  # most queries can be perturbed
    if kind in ("random_swap", "random_delete"):
        assert out.loc[out["qid"] == "6", "query"].item() == "diabetes"  # one word: nothing to swap or delete
    again = _noise(kind, 7, neighbours, tiny_wordnet)(TOPICS)
    pd.testing.assert_frame_equal(out, again)
    # per query, independent of the frame's order and of the other queries
    reversed_out = noise(TOPICS.iloc[::-1]).set_index("qid").loc[out["qid"]]
    assert list(reversed_out["query"]) == list(out["query"])
    assert noise.perturb(TOPICS["query"][0], "1") == out["query"][0]
    # another seed gives other perturbations somewhere
    others = [_noise(kind, s, neighbours, tiny_wordnet)(TOPICS)["query"].tolist() for s in (8, 9, 10)]
    assert any(o != list(out["query"]) for o in others)


def test_abbreviations_and_errors(neighbours, tiny_wordnet):
    assert QueryNoise("rd").kind == "random_delete" and QueryNoise("SP").kind == "spelling"
    assert set(ABBREVIATIONS.values()) == set(NOISE_TYPES)
    with pytest.raises(ValueError, match="noise type"):
        QueryNoise("typo")
    with pytest.raises(ValueError, match="seed"):
        QueryNoise("RD", seed=-1)
    with pytest.raises(FileNotFoundError, match="wordnet-base"):
        QueryNoise("SR", wordnet_dir=tiny_wordnet / "missing")
    noise = QueryNoise("RS", 0)
    assert repr(noise) == "QueryNoise('random_swap', seed=0)"
    empty = noise(TOPICS.iloc[:0])
    assert len(empty) == 0 and {"qid", "query", "query_0"} <= set(empty.columns)
    with pytest.raises(pt.validate.InputValidationError, match="query frame"):
        noise(TOPICS.assign(docno="d1"))
    with pytest.raises(pt.validate.InputValidationError):
        noise(TOPICS.drop(columns="query"))
    # a second noise keeps the chain of originals: query_0 -> query_1
    twice = QueryNoise("RD", 1)(noise(TOPICS))
    assert list(twice["query_1"]) == list(TOPICS["query"])


def test_punctuation_and_case_are_kept(neighbours, tiny_wordnet):
    noise = _noise("SR", 0, neighbours, tiny_wordnet)
    out = noise.perturb("Fever?", "x")
    assert out in ("Febrility?", "Pyrexia?")


# ---- resources -----------------------------------------------------------------------------------------------


def test_spelling_dictionary(tmp_path):
    table = spelling_dictionary()  # NLPaug's dictionary
    assert "hierachically" in table["hierarchically"] and len(table) > 1000
    path = tmp_path / "spelling.txt"
    path.write_text("fever fevr feaver\nchildren childern\n")
    noise = QueryNoise("SE", 3, spelling_path=path)
    assert noise.perturb("fever in children", "q") in {"fevr in children", "feaver in children", "fever in childern"}
    # no word with a misspelling: fall back to a typo (two adjacent inner letters swapped) -- or leave it
    typo = noise.perturb("kidneys", "q")
    assert typo != "kidneys" and sorted(typo) == sorted("kidneys") and typo[0] == "k" and typo[-1] == "s"
    assert QueryNoise("SE", 3, spelling_path=path, spelling_fallback=False).perturb("kidneys", "q") == "kidneys"


def test_embedding_neighbours(neighbours):
    assert "queen" in neighbours.neighbours("king") and "king" not in neighbours.neighbours("king")
    assert len(neighbours.neighbours("fever", 3)) == 3
    assert neighbours.neighbours("hypertension") == [] and "hypertension" not in neighbours  # not one token
    with pytest.raises(ValueError, match="top_k"):
        EmbeddingNeighbours(object(), top_k=0)
    with pytest.raises(ValueError, match="Hugging Face encoder"):
        EmbeddingNeighbours(object())


def test_tiny_wordnet_reader(tiny_wordnet):
    wn = WordNet(tiny_wordnet)
    assert wn.synonyms("fever") == ["febrility", "pyrexia"]
    assert wn.synonyms("children") == ["kid", "youngster"]  # exception list: children -> child
    assert wn.synonyms("causes") == ["do", "make"]  # suffix rule: causes -> cause
    assert wn.synonyms("cancer") == [] and wn.synonyms("cancer", multiword=True) == ["malignant neoplastic disease"]
    assert wn.synonyms("xylophone") == []


def test_without_wordnet_every_other_noise_works(no_wordnet, neighbours):
    assert not wordnet_available()
    with pytest.raises(FileNotFoundError, match="WordNet is missing") as e:
        find_wordnet()
    assert "apt-get install wordnet-base" in str(e.value)
    with pytest.raises(FileNotFoundError, match=r"QueryNoise\('SR'\): the synonym perturbation \(SR\)") as e:
        QueryNoise("SR", 0)
    assert "apt-get install wordnet-base" in str(e.value) and "(RD, RS, SE, WEI, WES) work without it" in str(e.value)
    for kind in ("RD", "RS", "SE", "WEI", "WES"):
        out = QueryNoise(kind, 7, embedding_model=neighbours)(TOPICS)
        changed = [_check_one_word(ABBREVIATIONS[kind], a, b) for a, b in zip(out["query_0"], out["query"])]
        assert sum(changed) >= 4, (kind, list(out["query"]))
    with pytest.raises(FileNotFoundError, match="apt-get install wordnet-base"):
        all_noise(0, embedding_model=neighbours)  # missing="raise" by default
    with pytest.warns(UserWarning, match=r"all_noise: SR left out: .*apt-get install wordnet-base"):
        five = all_noise(0, missing="warn", embedding_model=neighbours)
    assert list(five) == ["RD", "RS", "SE", "WEI", "WES"]
    assert list(all_noise(0, missing="skip", embedding_model=neighbours)) == list(five)
    with pytest.raises(ValueError, match="missing must be"):
        all_noise(0, missing="ignore")


def test_wordnet_search_path_reads_the_environment(monkeypatch, tiny_wordnet, neighbours):
    monkeypatch.setenv("WORDNET_DIR", str(tiny_wordnet))
    assert find_wordnet() == tiny_wordnet and wordnet_available()
    assert QueryNoise("SR", 0).perturb("fever", "q") in ("febrility", "pyrexia")
    assert list(all_noise(0, embedding_model=neighbours)) == ["RD", "RS", "SE", "SR", "WEI", "WES"]
    monkeypatch.setenv("WORDNET_DIR", str(tiny_wordnet / "missing"))
    assert wordnet_available() == any(wordnet_available(d) for d in noise_module.WORDNET_DIRS)  # on to the next


@pytest.mark.skipif(not _has_system_wordnet(), reason=NO_WORDNET)
def test_system_wordnet():
    wn = WordNet()
    assert "pyrexia" in wn.synonyms("fever") and "kid" in wn.synonyms("children")
    out = QueryNoise("SR", 0)(TOPICS)
    assert sum(_check_one_word("synonym", a, b) for a, b in zip(out["query_0"], out["query"])) >= 4


# ---- hard queries (Sec. 5) -------------------------------------------------------------------------------------


def _run(rows):
    return pd.DataFrame(rows, columns=["qid", "docno", "score"])


QRELS = pd.DataFrame(
    {
        "qid": ["q1", "q2", "q3", "q4", "q5", "q5"],
        "docno": ["r1", "r2", "r3", "r4", "r5", "n5"],
        "label": [1, 1, 1, 1, 1, 0],
    }
)


def _baseline():
    rows = [("q1", "r1", 10.0), ("q1", "x", 9.0)]  # nDCG@10 = 1
    rows += [("q2", "x", 10.0), ("q2", "r2", 9.0)]  # relevant at rank 2: nDCG@10 = 1 / log2(3)
    rows += [("q3", "x", 10.0)]  # relevant not retrieved: 0, no relevant in the top 10
    rows += [("q4", f"x{i}", 100.0 - i) for i in range(10)] + [("q4", "r4", 1.0)]  # relevant at rank 11
    # q5: the run has nothing -> 0, counts as no relevant in the top 10
    return _run(rows)


def test_percent_no_and_per_query_flags():
    flags = no_relevant_in_top(_baseline(), QRELS, 10)
    assert flags.to_dict() == {"q1": False, "q2": False, "q3": True, "q4": True, "q5": True}
    assert percent_no(_baseline(), QRELS) == pytest.approx(60.0)
    assert percent_no(_baseline(), QRELS, k=11) == pytest.approx(40.0)  # q4's relevant document at rank 11
    assert percent_no(_baseline(), QRELS, topics=["q1", "q3"]) == pytest.approx(50.0)


def test_hard_queries_bottom_half():
    # per-query nDCG@10: q1 1, q2 0.63, q3 0, q4 0, q5 0 -> bottom floor(0.5 * 5) = 2, ties by qid
    assert hard_queries(_baseline(), QRELS) == ["q3", "q4"]
    assert hard_queries(_baseline(), QRELS, fraction=0.8) == ["q3", "q4", "q5", "q2"]
    assert hard_queries(_baseline(), QRELS, "P@1", fraction=0.2) == ["q2"]
    with pytest.raises(ValueError, match="fraction"):
        hard_queries(_baseline(), QRELS, fraction=0.0)


def test_hard_query_table():
    better = _run([("q3", "r3", 5.0), ("q4", "r4", 5.0), ("q1", "x", 5.0), ("q1", "r1", 4.0)])
    table = hard_query_table({"base": _baseline(), "var": better}, QRELS, "base").set_index("name")
    assert list(table.columns) == ["n_queries", "n_hard", "nDCG@10", "nDCG@10 hard", "%no", "%no hard"]
    assert (table["n_queries"] == 5).all() and (table["n_hard"] == 2).all()
    assert table.loc["base", "nDCG@10 hard"] == 0.0 and table.loc["var", "nDCG@10 hard"] == 1.0
    assert table.loc["base", "nDCG@10"] == pytest.approx((1 + 1 / np.log2(3)) / 5)
    assert table.loc["var", "nDCG@10"] == pytest.approx((1 / np.log2(3) + 2) / 5)
    assert table.loc["base", "%no"] == pytest.approx(60.0) and table.loc["var", "%no"] == pytest.approx(40.0)
    assert table.loc["base", "%no hard"] == 100.0 and table.loc["var", "%no hard"] == 0.0
    same = hard_query_table({"base": _baseline(), "var": better}, QRELS, _baseline(), ["nDCG@10", "P@10"])
    assert "P@10 hard" in same.columns
    with pytest.raises(ValueError, match="baseline"):
        hard_query_table({"var": better}, QRELS, "base")
