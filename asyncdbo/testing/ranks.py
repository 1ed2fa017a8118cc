"""Start a torch.distributed process group on this machine and run functions on every rank.

Multi-rank code (DP agreement, all-to-all dispatch) can only be tested with real processes: gloo
needs one process per rank.  Starting a process and joining a group costs seconds on a small
machine, so :class:`RankPool` keeps its workers alive between calls; a test module starts one pool
(a module-scoped fixture) and runs many functions on it::

    def _sum_ranks(rank: int, world_size: int) -> int:   # module level: it is pickled by name
        t = torch.tensor([rank])
        torch.distributed.all_reduce(t)
        return int(t)

    with RankPool(2) as pool:
        assert pool.run(_sum_ranks) == [1, 1]

Failure is always bounded in time, never a hang:

* a rank that raises gives :class:`RankError` naming the rank and carrying its traceback text;
* a rank whose process dies, or a call that runs past ``timeout_s``, gives :class:`RankError`
  naming the rank(s) that did not answer;
* the process group itself is created with the same timeout, so a collective whose peer is gone
  fails inside the worker instead of blocking forever;
* workers exit on their own when the parent process dies (pipe EOF or a changed parent pid).

After any failure the pool is closed and unusable: ranks may be stuck half-way through a
collective, and a group in that state cannot be trusted for the next call.

Functions are sent by reference (pickle), so they must live at module level in a module the
workers can import.  The ``spawn`` start method gives workers the parent's ``sys.path``, so
functions defined in pytest test modules work (pytest's default ``prepend`` import mode puts the
test directory on ``sys.path``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from types import TracebackType
from typing import Any

__all__ = ["RankError", "RankPool", "free_port", "rank_world", "run_ranks"]

#: Seconds ``close()`` waits for a worker to leave on its own before terminating it.
_CLOSE_GRACE_S = 5.0
#: After the first rank fails, seconds to wait for the other ranks' answers, so that the error can
#: name every rank that failed (peers often fail a moment later in the same collective).
_FAILURE_GRACE_S = 1.0
#: Start-up tries (a new port each time) when the group's port was taken meanwhile.
_START_ATTEMPTS = 2
#: How often a worker checks that its parent is still alive.
_PARENT_POLL_S = 0.5


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, then release)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_world() -> tuple[int, int]:
    """Return ``(rank, world_size)`` of the default process group (inside a pool worker)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("rank_world() called outside an initialised torch.distributed group")
    return dist.get_rank(), dist.get_world_size()


class RankError(RuntimeError):
    """One or more ranks failed: raised, died, or did not answer in time.

    ``ranks`` lists the failing ranks in order; ``details`` maps each to its remote traceback text
    (or a one-line reason for a death or a timeout).
    """

    def __init__(self, summary: str, details: dict[int, str]) -> None:
        self.ranks: tuple[int, ...] = tuple(sorted(details))
        self.details: dict[int, str] = dict(details)
        parts = [summary]
        for rank in self.ranks:
            parts.append(f"--- rank {rank} ---\n{self.details[rank].rstrip()}")
        super().__init__("\n".join(parts))


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def _watch_parent(parent_pid: int) -> None:
    """Exit the worker when its parent is gone (the pipe EOF misses a worker busy in a call)."""
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def _worker_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    timeout_s: float,
    env: dict[str, str],
    torch_threads: int,
    conn: Connection,
    parent_pid: int,
) -> None:
    os.environ.update(env)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(torch_threads)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            os._exit(1)  # the parent is gone; skip the group teardown, peers may be gone too
        if not payload:
            break
        try:
            fn, args = pickle.loads(payload)
            result = fn(rank, world_size, *args)
            reply = pickle.dumps(("ok", result))
        except BaseException:
            reply = pickle.dumps(("err", traceback.format_exc()))
        conn.send_bytes(reply)
    # Leave without tearing the group down: destroy_process_group() and the interpreter's own
    # teardown can wait seconds on peers that are leaving at the same moment.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


class RankPool:
    """``world_size`` worker processes joined into one torch.distributed group on 127.0.0.1.

    Workers use the ``spawn`` start method (safe with torch threads), join the group through
    ``tcp://127.0.0.1:<free port>`` with ``GLOO_SOCKET_IFNAME=lo``, and stay alive between
    :meth:`run` calls.  ``timeout_s`` bounds start-up, every call (unless ``run`` is given its own)
    and every collective inside the group.  ``env`` is added to each worker's environment before
    torch is imported.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
        torch_threads: int = 1,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size ({world_size}) must be at least 1")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) must be positive")
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._closed = False
        self._broken: str | None = None

        worker_env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(torch_threads)}
        worker_env.update(env or {})
        for attempt in range(_START_ATTEMPTS):
            try:
                self._start(worker_env, torch_threads)
                return
            except RankError as e:
                # free_port() is racy: another process may take the port before rank 0 binds it.
                if attempt + 1 == _START_ATTEMPTS or "address already in use" not in str(e).lower():
                    raise
            except BaseException:
                self.close()
                raise
            self._procs, self._conns, self._closed, self._broken = [], [], False, None

    def _start(self, worker_env: dict[str, str], torch_threads: int) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, port, self.backend, self.timeout_s, worker_env,
                      torch_threads, child_conn, os.getpid()),
                name=f"asyncdbo-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        self._collect("start-up", self.timeout_s)

    # -- public API -----------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Call ``fn(rank, world_size, *args)`` on every rank at once; return results by rank.

        Raises :class:`RankError` if any rank raises, dies, or has not answered after
        ``timeout_s`` (default: the pool's); the pool is then closed.  ``fn`` and ``args`` are
        pickled once here, so a pickling error is raised before any rank starts and leaves the
        pool usable.
        """
        if self._closed:
            reason = f" after a failure ({self._broken})" if self._broken else ""
            raise RuntimeError(f"RankPool is closed{reason}; create a new RankPool")
        payload = pickle.dumps((fn, args))
        for conn in self._conns:
            conn.send_bytes(payload)
        return self._collect(getattr(fn, "__name__", repr(fn)),
                             self.timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        """End every worker: ask politely, then terminate, then kill.  Idempotent."""
        self._shutdown(_CLOSE_GRACE_S)

    def _shutdown(self, grace_s: float) -> None:
        self._closed = True
        for conn in self._conns:
            try:
                conn.send_bytes(b"")
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self._procs:
            proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        for conn in self._conns:
            conn.close()
        self._conns = []

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers, by rank (for tests and debugging)."""
        return [int(p.pid) for p in self._procs]

    def __enter__(self) -> RankPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    def _collect(self, what: str, timeout_s: float) -> list[Any]:
        """Wait for one answer per rank; on any failure close the pool and raise RankError."""
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        failed_at: float | None = None
        pending = set(range(self.world_size))
        while pending:
            now = time.monotonic()
            limit = deadline if failed_at is None else min(deadline, failed_at + _FAILURE_GRACE_S)
            if now >= limit:
                break
            waitables: list[Any] = []
            for rank in pending:
                waitables += [self._conns[rank], self._procs[rank].sentinel]
            ready = wait(waitables, timeout=limit - now)
            for rank in sorted(pending):
                conn, proc = self._conns[rank], self._procs[rank]
                if conn in ready:
                    try:
                        kind, value = conn.recv()
                    except (EOFError, OSError):
                        # The pipe closed without an answer: the process is dying or dead.
                        proc.join(_FAILURE_GRACE_S)
                        kind, value = "err", f"process died (exit code {proc.exitcode}) during {what}"
                    pending.discard(rank)
                    if kind == "err":
                        failures[rank] = value
                    else:
                        results[rank] = value
                elif proc.sentinel in ready and not conn.poll():
                    proc.join(_FAILURE_GRACE_S)
                    pending.discard(rank)
                    failures[rank] = f"process died (exit code {proc.exitcode}) during {what}"
            if failures and failed_at is None:
                failed_at = time.monotonic()
        if not failures and not pending:
            return [results[r] for r in range(self.world_size)]
        if not failures:
            for rank in pending:
                failures[rank] = f"no answer within {timeout_s:g} s during {what}"
            summary = f"rank(s) {sorted(failures)} timed out during {what}"
        else:
            summary = f"rank(s) {sorted(failures)} failed during {what}"
            if pending:
                summary += f"; rank(s) {sorted(pending)} had not answered"
        self._broken = summary
        self._shutdown(0.0)  # surviving ranks may be stuck in a collective: do not wait for them
        raise RankError(summary, failures)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """One-shot helper: start a :class:`RankPool`, run ``fn`` once, close the pool."""
    with RankPool(world_size, backend=backend, timeout_s=timeout_s, env=env) as pool:
        return pool.run(fn, *args)
