"""Shared machines and faults: threads follow the CPUs a process may use; an output folder is locked while a run
writes it (a second run refused, naming the holder's pid; a killed run's lock taken over)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from pyterrier_prob import cli
from pyterrier_prob.cli import build_parser, main
from pyterrier_prob.experiments.harness import LOCK_FILE, CommonConfig, Harness, config_from_args, lock_output
from pyterrier_prob.training import StepRate
from st_extensions import threads
from st_extensions.atomic import locked


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """Four CPUs in the affinity mask, no OMP_NUM_THREADS, and a cgroup folder of our own."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(threads, "CGROUP_ROOT", tmp_path)
    return tmp_path


@pytest.fixture
def torch_state(monkeypatch):
    """torch's and faiss's thread counts and the tokenizers' variables restored after the test."""
    for name in ("RAYON_NUM_THREADS", "TOKENIZERS_PARALLELISM"):
        monkeypatch.delenv(name, raising=False)  # put back as it was after the test
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_configured", threads._configured)
    yield
    threads.configure_threads(before)  # torch's and faiss's counts back (the variables and _configured: monkeypatch)


def test_available_cpus_follow_affinity_quota_and_env(machine, monkeypatch):
    assert threads.available_cpus() == 4  # no cgroup files: the affinity
    (machine / "cpu.max").write_text("max 100000\n")
    assert threads.available_cpus() == 4
    (machine / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: 2 threads
    assert threads.available_cpus() == 2
    (machine / "cpu.max").unlink()
    (machine / "cpu").mkdir()
    (machine / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (machine / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # cgroup v1, no quota
    assert threads.available_cpus() == 4
    (machine / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    assert threads.available_cpus() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's word wins
    assert threads.available_cpus() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "0")  # not a count: ignored
    assert threads.available_cpus() == 1


def test_configure_threads_sets_torch_faiss_and_tokenizers(machine, torch_state):
    assert threads.configure_threads(1) == 1 and torch.get_num_threads() == 1
    assert os.environ["RAYON_NUM_THREADS"] == "1" and os.environ["TOKENIZERS_PARALLELISM"] == "false"
    assert threads.thread_count() == 1
    faiss = pytest.importorskip("faiss")
    assert faiss.omp_get_max_threads() == 1
    assert threads.configure_threads() == 4 and torch.get_num_threads() == 4 and threads.thread_count() == 4
    with pytest.raises(ValueError, match="threads must be a positive int, got 0"):
        threads.configure_threads(0)


def test_torch_threads_narrows_and_restores(torch_state, monkeypatch):
    torch.set_num_threads(2)
    with threads.torch_threads() as n:
        assert n == torch.get_num_threads() == threads.SMALL_MODEL_THREADS
    assert torch.get_num_threads() == 2
    with threads.torch_threads(8) as n:  # never raised
        assert n == 2
    monkeypatch.setenv("ST_SMALL_MODEL_THREADS", "0")  # the policy's off switch
    with threads.torch_threads() as n:
        assert n == 2


def test_threads_option_parsed_and_checked(capsys):
    a = build_parser("pebr").parse_args(["--threads", "3"])
    cfg = config_from_args(CommonConfig, a)
    assert cfg.threads == 3
    cfg.check()
    assert build_parser("pebr").parse_args([]).threads is None  # default: the CPUs the process may use
    with pytest.raises(ValueError, match=r"--threads must be a positive int.*, got 0"):
        CommonConfig(threads=0).check()
    assert main(["pebr", "--threads", "0"]) == 2
    assert re.search(r"--threads must be a positive int.*, got 0", capsys.readouterr().err)
    with pytest.raises(SystemExit):
        build_parser("pebr").parse_args(["--threads", "two"])


BATCH_PROBE = """
import os, threading, sys
from st_extensions.threads import batch_scheduling
os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))  # not what the parent left (a run in the test process)
def sched(tid):
    text = open(f"/proc/self/task/{tid}/sched").read()
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.splitlines()) if v}
before = sched(threading.get_native_id())
ok = batch_scheduling(float(sys.argv[1]))
later = []
t = threading.Thread(target=lambda: later.append(sched(threading.get_native_id())))
t.start(); t.join()
now = sched(threading.get_native_id())
last = later[0]
print(ok, before.get("policy"), now.get("policy"), now.get("se.slice"), last.get("policy"), last.get("se.slice"))
"""


def test_batch_scheduling_sets_policy_and_slice_for_every_thread():
    if not os.path.exists("/proc/self/sched"):
        pytest.skip("no /proc/<pid>/sched to read the scheduling back")

    def probe(ms: str) -> list[str]:
        return subprocess.check_output([sys.executable, "-c", BATCH_PROBE, ms], text=True).split()

    ok, before, policy, slice_ns, later_policy, later_slice = probe("37.5")
    if ok != "True" or slice_ns == "None":
        pytest.skip("this kernel does not take per-task slices (Linux >= 6.12)")
    assert (before, policy, later_policy) == ("0", "3", "3")  # SCHED_OTHER -> SCHED_BATCH, inherited
    assert slice_ns == later_slice == "37500000"
    assert probe("0")[:3] == ["False", "0", "0"]  # 0: left as it is
    with pytest.raises(ValueError, match="slice_ms must be a finite number"):
        threads.batch_scheduling(float("nan"))
    with pytest.raises(ValueError, match="--sched-slice-ms must be a finite number >= 0, got -1"):
        CommonConfig(sched_slice_ms=-1).check()
    assert build_parser("pebr").parse_args([]).sched_slice_ms == threads.BATCH_SLICE_MS


HARNESS_PROBE = """
import os, sys
from pyterrier_prob.experiments.harness import CommonConfig, Harness
os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
h = Harness("t", CommonConfig(output=sys.argv[1], quiet=True))  # a notebook's run: its process is left as it is
print(os.sched_getscheduler(0), h.batch_scheduled)
"""


def test_batch_scheduling_is_the_commands_not_a_notebooks(tmp_path, monkeypatch):
    out = subprocess.check_output([sys.executable, "-c", HARNESS_PROBE, str(tmp_path / "nb")], text=True).split()
    assert out == [str(os.SCHED_OTHER), "False"]
    calls = []
    monkeypatch.setattr(threads, "batch_scheduling", lambda ms: calls.append(ms))
    monkeypatch.setattr("pyterrier_prob.experiments.pebr.run", lambda cfg: calls.append(cfg.output))
    assert main(["pebr", "--sched-slice-ms", "25", "--output", str(tmp_path / "cmd")]) == 0
    assert calls == [25.0, str(tmp_path / "cmd")]  # the command sets it, before the run


WAIT_PROBE = """
import contextlib, io, os, sys
from pyterrier_prob import cli
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    cli.main(["pebr", "--help"])  # the parser imports the experiment, and with it torch
print(os.environ.get("OMP_WAIT_POLICY"), "torch" in sys.modules)
"""


def test_command_lets_openmp_threads_sleep_unless_told_otherwise():
    clean = {k: v for k, v in os.environ.items() if k not in cli.OMP_WAIT_VARIABLES}

    def probe(**env: str) -> list[str]:
        return subprocess.check_output([sys.executable, "-c", WAIT_PROBE], text=True, env={**clean, **env}).split()

    assert probe() == ["PASSIVE", "True"]  # set before torch (and its OpenMP library) loaded
    assert probe(OMP_WAIT_POLICY="active") == ["active", "True"]  # the user's choice is kept
    assert probe(GOMP_SPINCOUNT="300000") == ["None", "True"]
    environ: dict[str, str] = {}
    assert "torch" in sys.modules and not cli.passive_waiting(environ) and environ == {}  # too late: left alone


def test_step_rate_leaves_out_the_first_step(monkeypatch):
    clock = iter([10.0, 10.5, 11.0, 11.5])
    monkeypatch.setattr("pyterrier_prob.training.time.perf_counter", lambda: next(clock))
    rate = StepRate()
    assert rate.steps_per_second is None
    for _ in range(4):
        rate.on_step_end(None, None, None)
    assert rate.steps_per_second == pytest.approx(2.0)


def test_locked_non_blocking_refuses_a_second_holder(tmp_path):
    path = str(tmp_path / "l")
    with locked(path, blocking=False) as fd:
        assert isinstance(fd, int)
        with pytest.raises(BlockingIOError), locked(path, blocking=False):
            pass
    with locked(path, blocking=False):  # released
        pass


_HOLDER = "import sys, time; from pyterrier_prob.experiments.harness import lock_output; lock_output(sys.argv[1]); "
_HOLDER += "print('locked', flush=True); time.sleep(600)"


def test_output_folder_lock_refuses_a_second_run_and_takes_over_a_killed_ones(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    child = subprocess.Popen([sys.executable, "-c", _HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=rf"--output .*out' is in use by pyterrier-prob pid {child.pid} since "):
            Harness("t", CommonConfig(output=str(out), quiet=True))
        with pytest.raises(ValueError, match="wait for it to finish or choose another --output"):
            lock_output(str(out))
    finally:
        child.send_signal(signal.SIGKILL)  # a killed run: its flock dies with it, its note stays
        child.wait()
    assert f"pid {child.pid} " in (out / LOCK_FILE).read_text()
    h = Harness("t", CommonConfig(output=str(out), quiet=True))  # the stale lock is taken over
    assert (out / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} since ")
    assert oct(os.stat(out / LOCK_FILE).st_mode & 0o777) == oct(0o644)
    again = Harness("t", CommonConfig(output=str(out), quiet=True))  # this process's earlier run: taken over too
    assert h._lock is not again._lock
    again._lock.close()
