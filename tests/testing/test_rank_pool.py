"""RankPool: results by rank, errors name the rank, failures end in bounded time, close ends all."""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from asyncdbo.testing import RankError, RankPool, free_port, rank_world, run_ranks

pytestmark = pytest.mark.slow


# Functions run on the ranks live at module level: they are pickled by reference.


def _identity(rank: int, world_size: int, tag: str) -> tuple[int, int, str]:
    return rank, world_size, tag


def _all_reduce_rank(rank: int, world_size: int) -> int:
    t = torch.tensor([rank + 1], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t)


def _env_and_threads(rank: int, world_size: int) -> tuple[str | None, int, tuple[int, int], str]:
    return os.environ.get("GLOO_SOCKET_IFNAME"), torch.get_num_threads(), rank_world(), dist.get_backend()


def _raise_on_rank1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("rank one is unhappy")
    return rank


def _exit_on_rank1_others_wait(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    time.sleep(60)  # stands for a collective whose peer is gone: the parent must not wait


def _sleep_on_rank0(rank: int, world_size: int, seconds: float) -> int:
    if rank == 0:
        time.sleep(seconds)
    return rank


def _pid(rank: int, world_size: int) -> int:
    return os.getpid()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(pid, 0); it has ended but its parent has not reaped it yet.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    with RankPool(2, timeout_s=30.0) as p:
        yield p


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


@pytest.mark.timeout(120)
def test_results_come_back_in_rank_order(pool: RankPool) -> None:
    assert pool.run(_identity, "x") == [(0, 2, "x"), (1, 2, "x")]


@pytest.mark.timeout(120)
def test_ranks_share_one_group_and_the_pool_is_reusable(pool: RankPool) -> None:
    assert pool.run(_all_reduce_rank) == [3, 3]
    assert pool.run(_all_reduce_rank) == [3, 3]


@pytest.mark.timeout(120)
def test_workers_get_loopback_gloo_and_one_thread(pool: RankPool) -> None:
    assert pool.run(_env_and_threads) == [("lo", 1, (0, 2), "gloo"), ("lo", 1, (1, 2), "gloo")]


@pytest.mark.timeout(120)
def test_unpicklable_function_fails_before_any_rank_starts(pool: RankPool) -> None:
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        pool.run(lambda rank, world_size: rank)
    assert pool.run(_identity, "still usable") == [(0, 2, "still usable"), (1, 2, "still usable")]


@pytest.mark.timeout(120)
def test_run_ranks_is_one_shot_and_ends_its_processes() -> None:
    pids = run_ranks(_pid, 2)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.timeout(120)
def test_close_ends_every_process_and_the_pool_refuses_later_calls() -> None:
    with RankPool(3, timeout_s=30.0) as pool:
        assert pool.run(_all_reduce_rank) == [6, 6, 6]
        pids = pool.pids
        assert all(_alive(pid) for pid in pids)
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match=r"^RankPool is closed; create a new RankPool$"):
        pool.run(_pid)


@pytest.mark.timeout(120)
def test_rank_exception_names_the_rank_and_carries_its_traceback() -> None:
    pool = RankPool(2, timeout_s=30.0)
    with pytest.raises(RankError, match=r"rank\(s\) \[1\] failed during _raise_on_rank1") as info:
        pool.run(_raise_on_rank1)
    assert info.value.ranks == (1,)
    assert "ValueError: rank one is unhappy" in str(info.value)
    assert "_raise_on_rank1" in info.value.details[1]  # the remote traceback text
    with pytest.raises(RuntimeError, match=r"RankPool is closed after a failure .*create a new"):
        pool.run(_identity, "x")
    pool.close()  # idempotent
    pool.close()


@pytest.mark.timeout(120)
def test_dead_rank_fails_fast_even_while_its_peer_is_busy() -> None:
    pool = RankPool(2, timeout_s=30.0)
    pids = pool.pids
    start = time.monotonic()
    with pytest.raises(
        RankError, match=r"rank\(s\) \[1\] failed during .*; rank\(s\) \[0\] had not answered"
    ) as info:
        pool.run(_exit_on_rank1_others_wait)
    assert time.monotonic() - start < 15.0  # not the 30 s collective timeout
    assert info.value.details == {1: "process died (exit code 3) during _exit_on_rank1_others_wait"}
    assert not any(_alive(pid) for pid in pids)  # the busy rank 0 was ended too


@pytest.mark.timeout(120)
def test_call_past_its_timeout_names_the_silent_rank() -> None:
    pool = RankPool(2, timeout_s=30.0)
    pool.run(_pid)  # warm up: the first call imports this module in the workers (slow under load)
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank\(s\) \[0\] timed out during _sleep_on_rank0") as info:
        pool.run(_sleep_on_rank0, 60.0, timeout_s=3.0)
    assert time.monotonic() - start < 15.0
    assert info.value.details == {0: "no answer within 3 s during _sleep_on_rank0"}


@pytest.mark.timeout(120)
def test_workers_exit_when_the_parent_dies() -> None:
    import subprocess
    import sys

    script = (
        "import os, sys\n"
        "from asyncdbo.testing import RankPool\n"
        "pool = RankPool(2, timeout_s=30.0)\n"
        "print(*pool.pids, flush=True)\n"
        "os._exit(0)\n"  # no close(): the workers are orphaned
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=50)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2, out.stderr
    deadline = time.monotonic() + 10.0
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.timeout(120)
def test_start_up_retries_once_when_its_port_was_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    import asyncdbo.testing as launch

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1], free_port()])
    monkeypatch.setattr(launch, "free_port", lambda: next(ports))
    try:
        with RankPool(2, timeout_s=30.0) as pool:
            assert pool.run(_all_reduce_rank) == [3, 3]
    finally:
        taken.close()
