"""The chaos test of ``--resume`` with 2 seeded SIGKILLs (``benchmarks/chaos.py`` runs 20): ``pyterrier-prob pebr
--recipe partial`` killed at random moments over its stages and resumed ends with the uninterrupted run's
``results.md`` tables and model weights (1e-6), and no temporary or partial file left behind."""

import pytest
from helpers import load_benchmark


@pytest.mark.slow
def test_two_kills_resume_to_the_uninterrupted_results(tmp_path):
    chaos = load_benchmark("chaos")
    result = chaos.chaos(tmp_path, kills=2, seed=0, log=lambda *a: None)
    failed = [r for r in result["kills"] if not r["passed"]]
    assert not failed, failed
    assert result["passed"] == 2 and all(r["kills"] for r in result["kills"])  # each run was killed at least once
