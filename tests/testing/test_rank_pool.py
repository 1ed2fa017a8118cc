"""RankPool: results by rank, errors name the rank, failures end in bounded time, close ends all,
and nothing it starts listens beyond loopback or needs a port that a squatter could take.

The tests of a healthy pool's properties take the session's shared pool (``pool``, tests/conftest.py,
a plain ``RankPool(2)``); the tests of start-up, failure and close start their own."""

from __future__ import annotations

import os
import pickle
import socket
import stat
import time
from collections.abc import Iterable

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


def test_free_port_is_deprecated_because_its_port_can_be_taken_before_use() -> None:
    with pytest.warns(DeprecationWarning, match=r"free_port\(\) is racy .* RankPool needs no port"):
        port = free_port()
    assert 0 < port < 65536


def _address(hex_addr: str) -> str:
    """An address of /proc/net/tcp{,6}: hex, in 32-bit words of host (little-endian) byte order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, words)


def listening_sockets(pids: Iterable[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state that these processes hold."""
    owner: dict[str, int] = {}
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile
                continue
            if target.startswith("socket:["):
                owner[target[len("socket:["):-1]] = pid
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                fields = row.split()
                local, state, inode = fields[1], fields[3], fields[9]
                if state == "0A" and inode in owner:  # 0A: TCP_LISTEN
                    addr, port = local.split(":")
                    found.append((owner[inode], _address(addr), int(port, 16)))
    return found


@pytest.mark.timeout(120)
def test_nothing_the_ranks_listen_on_is_reachable_beyond_loopback(pool: RankPool) -> None:
    assert pool.run(_all_reduce_rank) == [3, 3]  # the group is up and has talked
    sockets = listening_sockets(pool.pids)
    assert sockets, "gloo listens for its peers: the check found no listener at all"
    assert {addr for _, addr, _ in sockets} <= {"127.0.0.1", "::1"}, sockets


@pytest.mark.timeout(120)
def test_the_rendezvous_store_is_a_private_file_not_a_port(pool: RankPool) -> None:
    mode = os.stat(pool._store_dir).st_mode
    assert stat.S_IMODE(mode) == 0o700
    assert os.listdir(pool._store_dir) == ["store"]


@pytest.mark.timeout(120)
def test_a_squatter_on_every_port_handed_out_cannot_deny_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    # The old pool asked free_port() for a port and bound it seconds later, twice at most: a
    # squatter that always won that race denied service. Now it is handed every such port.
    import asyncdbo.testing as testing
    import asyncdbo.testing.ranks as ranks

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    monkeypatch.setattr(testing, "free_port", lambda: taken)
    monkeypatch.setattr(ranks, "free_port", lambda: taken)
    try:
        with RankPool(2, timeout_s=30.0, start_timeout_s=180.0) as pool:
            assert pool.run(_all_reduce_rank) == [3, 3]
            assert taken not in {port for _, _, port in listening_sockets(pool.pids)}
    finally:
        squatter.close()


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
    with RankPool(3, timeout_s=30.0, start_timeout_s=180.0) as pool:
        assert pool.run(_all_reduce_rank) == [6, 6, 6]
        pids = pool.pids
        assert all(_alive(pid) for pid in pids)
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(RuntimeError, match=r"^RankPool is closed; create a new RankPool$"):
        pool.run(_pid)


@pytest.mark.timeout(120)
def test_rank_exception_names_the_rank_and_carries_its_traceback() -> None:
    pool = RankPool(2, timeout_s=30.0, start_timeout_s=180.0)
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
    pool = RankPool(2, timeout_s=30.0, start_timeout_s=180.0)
    pids = pool.pids
    # the dead rank's path, not the 30 s timeout's: that one would report rank 0 "timed out"
    with pytest.raises(
        RankError, match=r"rank\(s\) \[1\] failed during .*; rank\(s\) \[0\] had not answered"
    ) as info:
        pool.run(_exit_on_rank1_others_wait)
    assert info.value.details == {1: "process died (exit code 3) during _exit_on_rank1_others_wait"}
    assert not any(_alive(pid) for pid in pids)  # the busy rank 0 was ended too


@pytest.mark.timeout(120)
def test_call_past_its_timeout_names_the_silent_rank() -> None:
    pool = RankPool(2, timeout_s=30.0, start_timeout_s=180.0)
    pool.run(_pid)  # warm up: the first call imports this module in the workers (slow under load)
    # the call's own 3 s, not the pool's 30 s nor the 60 s sleep: the details name the bound that ended it
    with pytest.raises(RankError, match=r"rank\(s\) \[0\] timed out during _sleep_on_rank0") as info:
        pool.run(_sleep_on_rank0, 60.0, timeout_s=3.0)
    assert info.value.details == {0: "no answer within 3 s during _sleep_on_rank0"}


@pytest.mark.timeout(120)
def test_workers_exit_when_the_parent_dies() -> None:
    import subprocess
    import sys

    script = (
        "import os, sys\n"
        "from asyncdbo.testing import RankPool\n"
        "pool = RankPool(2, timeout_s=30.0, start_timeout_s=180.0)\n"
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
