"""A rerun that reuses a run reports the very same figures: BM25's rows come in one order whatever order PISA's threads
finish in, sums over queries do not follow the string hash, and the check the end-to-end tests use catches a figure
that differs in its last bit."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from helpers import assert_same_figures, figure_differences, pisa_threads_finish_backwards

from pyterrier_prob.experiments.bm25 import OrderedBM25, in_query_order


def test_in_query_order_puts_queries_as_they_came_and_each_query_by_rank():
    queries = pd.DataFrame({"qid": ["q2", "q10", "q1"], "query": ["b", "c", "a"]})
    run = pd.DataFrame(
        {
            "qid": ["q1", "q1", "zz", "q10", "q2", "q2", "q10"],
            "docno": ["a1", "a0", "z0", "c0", "b1", "b0", "c1"],
            "rank": [1, 0, 0, 0, 1, 0, 1],
        }
    )
    out = in_query_order(run, queries)
    assert out["qid"].tolist() == ["q2", "q2", "q10", "q10", "q1", "q1", "zz"]  # an unknown qid last
    assert out["docno"].tolist() == ["b0", "b1", "c0", "c1", "a0", "a1", "z0"]
    assert out.index.tolist() == list(range(7))
    assert in_query_order(run.iloc[:0], queries).empty


@pytest.fixture(scope="module")
def pisa_index(tmp_path_factory):
    """A PISA index of 60 short documents over a small vocabulary (every query matches many of them)."""
    from pyterrier_pisa import PisaIndex

    rng = np.random.default_rng(0)
    words = [f"w{i}" for i in range(25)]
    docs = [{"docno": f"d{i}", "text": " ".join(rng.choice(words, size=12))} for i in range(60)]
    index = PisaIndex(str(tmp_path_factory.mktemp("pisa") / "index.pisa"), text_field="text", threads=1)
    index.index(docs)
    return index, words


def test_bm25_rows_are_the_same_frame_whatever_order_the_threads_finish(pisa_index, tmp_path):
    """Under a backwards thread schedule PISA's own frame changes order; the harness's BM25 gives the same frame as
    one thread, row for row (the reason a reused varce --teacher run once reported another ECE in its last digits)."""
    from pyterrier_pisa import PisaIndex

    index, words = pisa_index
    queries = [f"{words[i % 25]} {words[(i * 7 + 3) % 25]}" for i in range(40)]
    topics = pd.DataFrame({"qid": [f"q{i}" for i in range(40)], "query": queries})
    one = PisaIndex(index.path, text_field="text", threads=1).bm25(num_results=10)
    two = PisaIndex(index.path, text_field="text", threads=2).bm25(num_results=10)
    want = one(topics)
    answered = list(dict.fromkeys(want["qid"]))
    assert len(answered) > 30 and answered == [q for q in topics["qid"] if q in answered]  # one thread: input order
    log = str(tmp_path / "pisa.log")
    with pisa_threads_finish_backwards():
        planted = two(topics)
        got = OrderedBM25(two, log)(topics)
    assert list(dict.fromkeys(planted["qid"])) != answered  # the plant does put PISA's frame in another order
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    pd.testing.assert_frame_equal(OrderedBM25(two, log)(topics), want, check_exact=True)


def test_the_rerun_check_names_a_figure_that_differs_in_its_last_bit():
    """The planted change: the reused run's ECE one ulp off, as the issue saw it, fails the check that every reuse
    test runs, naming the figure; equal figures (NaN included) pass."""
    first = {"rows": [{"system": "CE", "nDCG@10": 0.43, "ece": 0.2431986756044038, "p": float("nan")}], "n": 11}
    same = json.loads(json.dumps(first, allow_nan=True))
    assert figure_differences(same, first) == []
    assert_same_figures(same, first)
    planted = json.loads(json.dumps(first, allow_nan=True))
    planted["rows"][0]["ece"] = math.nextafter(first["rows"][0]["ece"], 1.0)
    assert figure_differences(planted, first) == ["rows[0].ece: 0.24319867560440384 != 0.2431986756044038"]
    with pytest.raises(AssertionError, match=r"rows\[0\]\.ece"):
        assert_same_figures(planted, first)
    frame = pd.DataFrame(first["rows"])
    moved = frame.assign(ece=planted["rows"][0]["ece"])
    assert figure_differences(moved, frame) == ["ece[0]: 0.24319867560440384 != 0.2431986756044038"]
    assert figure_differences({**first, "n": 11.0}, first) == ["n: 11.0 != 11"]  # a count turned float is a change


JACCARD = """
import json, sys
import numpy as np
from pyterrier_prob.unierf.analysis import mean_jaccard
rng = np.random.default_rng(0)
a = {f"q{i}": (np.array([f"d{j}" for j in rng.choice(40, 5 + i % 7, replace=False)]), None) for i in range(60)}
b = {f"q{i}": (np.array([f"d{j}" for j in rng.choice(40, 3 + i % 11, replace=False)]), None) for i in range(60)}
print(json.dumps([repr(mean_jaccard(a, b, 10)), list(set(a))[:5]]))
"""


def test_mean_jaccard_is_the_same_under_every_string_hash():
    """The mean over queries once iterated a set of qids, whose order (and so the sum's last bits) followed the
    process's string hash."""
    outs = []
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", JACCARD], env=env, capture_output=True, text=True, check=True)
        outs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert len({tuple(o[1]) for o in outs}) > 1  # the hash seeds do order the set differently
    assert len({o[0] for o in outs}) == 1, outs
