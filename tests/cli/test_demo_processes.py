"""``asyncdbo demo`` as an operator meets it: a rank killed or stopped mid-run is the one the error
line names, ``--timeout`` bounds a wait and not the run, SIGUSR1 prints a rank's stacks without
ending it, and a killed ``torchrun`` agent takes its workers along.

Each test starts the demo as a subprocess (ranks on 127.0.0.1, in their own session), finds its
rank processes in /proc, and ends every process it started.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from _procs import alive, catches_sigusr1, children, status, torchrun_rank

pytestmark = pytest.mark.slow

TINY = ["--hidden", "64", "--layers", "1", "--experts", "4", "--tokens", "512", "--warmup", "0"]
def _ranks_running_demo(parent: int, name_of: Callable[[int], int | None], world: int, timeout_s: float = 200.0) -> dict[int, int]:
    """{rank: pid} of ``parent``'s rank processes once each has installed its SIGUSR1 handler
    (which demo_rank does first: from then on the rank is in the demo)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ranks = {}
        for pid in children(parent):
            rank = name_of(pid)
            if rank is not None and catches_sigusr1(pid):
                ranks[rank] = pid
        if len(ranks) == world:
            return ranks
        time.sleep(0.1)
    raise AssertionError(f"the demo's {world} ranks did not start within {timeout_s} s")


def _pool_rank(pid: int) -> int | None:
    name = status(pid, "Name")  # RankPool names its workers asyncdbo-rank<r>
    return int(name[len("asyncdbo-rank"):]) if name and name.startswith("asyncdbo-rank") else None


@contextmanager
def _started(cmd: list[str]) -> Iterator[subprocess.Popen[str]]:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the demo and whatever it started, stopped or not
        except ProcessLookupError:
            pass
        proc.communicate()


def _demo(*flags: str) -> list[str]:
    return [sys.executable, "-m", "asyncdbo", "demo", *TINY, *flags]


@pytest.mark.timeout(330)
def test_a_killed_rank_is_named_first_with_how_it_died() -> None:
    with _started(_demo("--steps", "500", "--link", "ib400")) as proc:
        ranks = _ranks_running_demo(proc.pid, _pool_rank, 2)
        time.sleep(0.5)  # mid-step
        os.kill(ranks[1], signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert err.splitlines()[-1] == (
        "asyncdbo demo: error: rank 1: process died (exit code -9) during demo_rank (then rank(s) [0] failed too)"
    ), err


@pytest.mark.timeout(330)
def test_a_stopped_rank_is_named_first_after_the_timeout_of_one_wait() -> None:
    with _started(_demo("--steps", "500", "--link", "ib400", "--timeout", "4")) as proc:
        ranks = _ranks_running_demo(proc.pid, _pool_rank, 2)
        os.kill(ranks[1], signal.SIGSTOP)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert err.splitlines()[-1] == (
        "asyncdbo demo: error: rank 1: process stopped (SIGSTOP or a debugger) for 4 s during demo_rank "
        "(then rank(s) [0] failed too)"
    ), err


@pytest.mark.timeout(330)
def test_timeout_bounds_each_wait_not_the_run_and_sigusr1_prints_stacks_without_stopping_a_rank() -> None:
    start = time.monotonic()
    with _started(_demo("--steps", "25", "--link", "ib400", "--timeout", "3")) as proc:
        ranks = _ranks_running_demo(proc.pid, _pool_rank, 2)
        os.kill(ranks[1], signal.SIGUSR1)
        out, err = proc.communicate(timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, err
    assert elapsed > 3, "the run must outlast --timeout for this test to mean anything"
    assert "DBO steps: microbatched, every step on every rank" in out
    # The dump of rank 1: its live run's ubatches, or (between two runs) that none is live.
    assert re.search(r"^asyncdbo run '\w+': [12] ubatches on ", err, re.MULTILINE) or "asyncdbo: no live DBO run" in err, err


@pytest.mark.timeout(330)
def test_torchrun_workers_exit_when_their_agent_is_killed() -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "asyncdbo", "demo", "--launcher", "env", *TINY, "--steps", "1000", "--link", "ib400"]
    with _started(cmd) as proc:
        ranks = _ranks_running_demo(proc.pid, torchrun_rank, 2)
        os.kill(proc.pid, signal.SIGKILL)  # the agent
        deadline = time.monotonic() + 20
        while any(alive(pid) for pid in ranks.values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in ranks.values() if alive(pid)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} outlived their torchrun agent"
