"""Shared test configuration.

* Tests mirror the package: ``tests/<package>/`` specifies ``asyncdbo/<package>/``; ``tests/helpers/``
  holds the functions rank workers run (module level, pickled by reference: the workers get this
  process's ``sys.path``, which includes that folder).
* Async tests where the event loop matters (the kernel, the DBO layer, the backends, the stack
  dumps and tracer) run on both loops asyncdbo supports, asyncio's default loop and uvloop; the
  rest run on uvloop, the loop ``asyncdbo.run`` picks by default.
* Every temporary file of the session, the test process's and its subprocesses' (rank pools'
  store files, torchrun agents' log folders), goes into one folder under pytest's own base
  folder (:func:`session_tmpdir`), which pytest prunes after a few runs: a process a test kills
  with SIGKILL cannot clean up after itself, and its leftovers would otherwise stay in /tmp.
* Multi-process tests share one pool of real gloo ranks per world size for the whole session
  (:func:`rank_pools`); a test that breaks its pool (a failed rank closes it) gets a fresh one
  for the next test instead of failing the others.
* A test that must hold on both kernel loops (the C fast path and the Python reference) takes the
  :func:`kernel_loop` fixture (``pytestmark = pytest.mark.usefixtures("kernel_loop")`` for a whole
  file): it runs once per loop through the kernel's one seam, ``asyncdbo._core.fastpath.kernel_loop``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from asyncdbo._core import fastpath
from asyncdbo.testing import RankPool

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "helpers"))

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
    uvloop = None

#: test folders whose async tests run on both event loops
BOTH_LOOPS = {"core", "dbo", "backends", "observe", "testing"}


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    folder = Path(str(item.path)).resolve().relative_to(HERE).parts[0]
    factories: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {}
    if uvloop is None or folder in BOTH_LOOPS:
        factories["asyncio"] = asyncio.new_event_loop
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories


@pytest.fixture(params=fastpath.LOOPS)
def kernel_loop(request: pytest.FixtureRequest) -> Iterator[str]:
    """The test once on each kernel loop this process has: ``"c"`` (``asyncdbo/_core/_spin.c``, what
    an install with a C compiler runs) and ``"python"`` (the reference alone)."""
    with fastpath.kernel_loop(request.param):
        yield str(request.param)


@pytest.fixture(scope="session", autouse=True)
def session_tmpdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """TMPDIR for this process and every process a test starts, for the whole session."""
    folder = tmp_path_factory.mktemp("tmp")
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = None  # gettempdir() caches its answer: read TMPDIR again
    try:
        yield folder
    finally:
        if before is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before
        tempfile.tempdir = None


#: Start-up bound of the tests' rank pools (spawn, import torch, join the group), generous for a
#: loaded machine: 30 s ran out in a full run beside a CPU hog at load average ~15.
START_TIMEOUT_S = 180.0

class RankPools:
    """One live :class:`RankPool` per world size, started on first use and reused by every test
    of the session; a pool closed by a failure is replaced on the next request."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int, *, timeout_s: float = 60.0) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or pool._closed:
            # start-up imports torch in every rank: on a loaded 2-core machine that took over 30 s
            pool = self._pools[world_size] = RankPool(world_size, timeout_s=timeout_s, start_timeout_s=START_TIMEOUT_S)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread for the test, as the pools' ranks run: a test of many small ops in this
    process ran several times slower on two threads beside a busy 2-core machine's load."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def rank_pools() -> Iterator[RankPools]:
    pools = RankPools()
    try:
        yield pools
    finally:
        pools.close()


@pytest.fixture
def pool(rank_pools: RankPools) -> RankPool:
    """The session's shared pool of 2 gloo ranks."""
    return rank_pools.get(2)


@pytest.fixture
def pool4(rank_pools: RankPools) -> RankPool:
    """The session's shared pool of 4 gloo ranks."""
    return rank_pools.get(4)
