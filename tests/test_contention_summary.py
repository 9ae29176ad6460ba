"""``benchmarks/contention.py``'s summary of its rounds: medians, per-round ratios, the ratio of the medians and the
one-sided t-test against half the speed alone, checked against values worked out by hand."""

import math

from helpers import load_benchmark


def _contention():
    return load_benchmark("contention")


def _round(alone, busy, job):
    return {
        "alone": alone,
        "beside_busy": busy,
        "beside_job": job,
        "ratio_beside_busy": busy / alone,
        "ratio_beside_job": job / alone,
    }


def test_summary_of_three_rounds():
    rounds = [_round(20.0, 10.0, 8.0), _round(25.0, 12.0, 12.5), _round(10.0, 6.0, 6.0)]
    s = _contention().summarise(rounds)
    assert s["rounds"] == 3 and s["per_round"] == rounds
    assert (s["alone"], s["beside_busy"], s["beside_job"]) == (20.0, 10.0, 8.0)
    # per-round ratios beside the job: 0.4, 0.5, 0.6 -> median 0.5, min 0.4, max 0.6
    assert (s["ratio_beside_job"], s["ratio_beside_job_min"], s["ratio_beside_job_max"]) == (0.5, 0.4, 0.6)
    assert s["ratio_of_medians_beside_job"] == 0.4  # median 8.0 over median 20.0
    # mean 0.5 = the null: t = 0, one-sided p = 0.5
    assert math.isclose(s["ratio_beside_job_p_below_half"], 0.5)
    # beside busy: ratios 0.5, 0.48, 0.6 (mean 0.5267, sd 0.0643): t = 0.718 on 2 df, P(T < t) = 0.726
    assert math.isclose(s["ratio_beside_busy_p_below_half"], 0.726, abs_tol=1e-3)


def test_one_round_has_no_test_and_the_table_says_so():
    c = _contention()
    s = c.summarise([_round(20.0, 10.0, 9.0)])
    assert "ratio_beside_job_p_below_half" not in s and s["ratio_beside_job"] == 0.45
    s["cpu_share_beside_job"] = 0.5
    row = c.markdown({"unierf_frozen": {"after": s}}).splitlines()[-1]
    assert "**0.450** (0.450-0.450) | nan | 0.450 | 0.500 |" in row


def test_the_recorded_command_is_the_one_that_measures():
    m = _contention()
    argv = ["--resume", "--note", "rounds of an earlier session", "--report-only", "--rounds", "3"]
    assert m._measuring(argv) == ["--resume", "--rounds", "3"]
    assert m.policies()["before"][0][-2:] == ["--sched-slice-ms", "0"]  # the old default had no batch scheduling
    assert m.policies()["after"] == ([], {})  # the defaults
