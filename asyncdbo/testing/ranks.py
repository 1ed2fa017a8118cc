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
* a rank whose process dies or stays stopped (SIGSTOP) for ``timeout_s``, or a call that runs
  past its own ``timeout_s``, gives :class:`RankError` naming the rank(s), the root cause first
  (:mod:`asyncdbo.testing.rank_error`);
* the process group itself is created with the same timeout, so a collective whose peer is gone
  fails inside the worker instead of blocking forever;
* workers exit on their own when the parent process dies (pipe EOF or a changed parent pid),
  and are named ``asyncdbo-rank<r>`` for ``ps`` and ``pgrep``.

Nothing listens beyond loopback: the ranks meet through a ``file://`` store in a private (0700)
directory, so there is no TCP rendezvous server (torch's ``TCPStore`` listens on every interface,
whatever host it is given: measured on torch 2.13) and no port to choose, race for or lose to a
squatter; gloo's own listeners bind 127.0.0.1 (``GLOO_SOCKET_IFNAME=lo``) on ports the kernel
assigns as they bind.

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
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from types import TracebackType
from typing import Any

from .process import exit_with_parent, set_process_name
from .rank_error import RankError, exception_line

__all__ = ["RankError", "RankPool", "free_port", "rank_world", "run_ranks"]

#: Seconds ``close()`` waits for a worker to leave on its own before terminating it.
_CLOSE_GRACE_S = 5.0
#: After the first rank fails, seconds to wait for the other ranks' answers, so that the error can
#: name every rank that failed (peers often fail a moment later in the same collective).
_FAILURE_GRACE_S = 1.0
#: How often a waiting pool looks whether a rank's process is stopped.
_STATE_POLL_S = 0.5


def free_port() -> int:
    """Deprecated: return a TCP port on 127.0.0.1 that was free a moment ago.

    Bind-then-release is a race (another process can take the port before the real listener binds
    it), so nothing in asyncdbo uses it any more: :class:`RankPool` needs no port; one process
    joins with ``init_process_group(store=torch.distributed.HashStore(), rank=0, world_size=1)``;
    ``torchrun --standalone`` lets its store bind port 0 itself."""
    warnings.warn(
        "asyncdbo.testing.free_port() is racy (the port can be taken before it is used) and deprecated: "
        "RankPool needs no port, one process can use torch.distributed.HashStore(), torchrun has --standalone",
        DeprecationWarning,
        stacklevel=2,
    )
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_world() -> tuple[int, int]:
    """Return ``(rank, world_size)`` of the default process group (inside a pool worker)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("rank_world() called outside an initialised torch.distributed group")
    return dist.get_rank(), dist.get_world_size()


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def _error_reply() -> tuple[str, tuple[str, str]]:
    exc = sys.exc_info()[1]
    assert exc is not None
    return ("err", (traceback.format_exc(), exception_line(exc)))


def _worker_main(
    rank: int,
    world_size: int,
    store_path: str,
    backend: str,
    timeout_s: float,
    start_s: float,
    env: dict[str, str],
    torch_threads: int,
    conn: Connection,
    parent_pid: int,
) -> None:
    os.environ.update(env)
    # A thread watches the parent pid (the pipe EOF misses a worker busy in a call); no
    # PR_SET_PDEATHSIG: it would fire when the parent *thread* that made the pool exits.
    exit_with_parent(parent_pid, watch=True)
    set_process_name(f"asyncdbo-rank{rank}")  # ps / pgrep show which rank a process is
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(torch_threads)
        # Meeting the peers is bounded by the start-up time (a loaded machine can take longer than
        # a collective's bound to import torch on the slowest rank), the collectives by timeout_s.
        dist.init_process_group(
            backend,
            init_method=f"file://{store_path}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=max(timeout_s, start_s)),
        )
        if start_s > timeout_s:
            from torch.distributed import distributed_c10d as c10d

            c10d._set_pg_timeout(timedelta(seconds=timeout_s))
    except BaseException:
        conn.send(_error_reply())
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
            reply = pickle.dumps(_error_reply())
        conn.send_bytes(reply)
    # Leave without tearing the group down: destroy_process_group() and the interpreter's own
    # teardown can wait seconds on peers that are leaving at the same moment.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


def _check_timeout(name: str, value: float) -> float:
    value = float(value)
    if not value > 0:  # also nan
        raise ValueError(f"{name} ({value}) must be a positive number of seconds (math.inf: no limit)")
    return value


class RankPool:
    """``world_size`` worker processes joined into one torch.distributed group on 127.0.0.1.

    Workers use the ``spawn`` start method (safe with torch threads), meet through a ``file://``
    store in a private temporary directory (no TCP rendezvous), run gloo over loopback
    (``GLOO_SOCKET_IFNAME=lo``), and stay alive between :meth:`run` calls.  ``timeout_s`` bounds
    every collective inside the group and every call (unless ``run`` is given its own, or
    ``math.inf`` for none); ``start_timeout_s`` bounds start-up (default: ``timeout_s``).  ``env``
    is added to each worker's environment before torch is imported.
    """

    def __init__(
        self,
        world_size: int,
        *,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        start_timeout_s: float | None = None,
        env: dict[str, str] | None = None,
        torch_threads: int = 1,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size ({world_size}) must be at least 1")
        self.world_size = world_size
        self.backend = backend
        self.timeout_s = _check_timeout("timeout_s", timeout_s)
        if self.timeout_s == float("inf"):
            raise ValueError("timeout_s (inf) bounds every collective of the group: give a finite number of seconds")
        start_s = self.timeout_s if start_timeout_s is None else _check_timeout("start_timeout_s", start_timeout_s)
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._closed = False
        self._broken: str | None = None
        # mkdtemp makes the directory 0700: only this user can read or plant the store file.
        self._store_dir = tempfile.mkdtemp(prefix="asyncdbo-ranks-")

        worker_env = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(torch_threads)}
        worker_env.update(env or {})
        try:
            self._start(worker_env, torch_threads, start_s)
        except BaseException:
            self.close()
            raise

    def _start(self, worker_env: dict[str, str], torch_threads: int, start_s: float) -> None:
        # Workers start with SIGUSR1 blocked (a spawned process inherits this thread's mask): one
        # that arrives before a worker installs the stack-dump handler (``asyncdbo demo``'s ranks
        # do) is held until then instead of ending the worker with the signal's default action.
        blocked = hasattr(signal, "pthread_sigmask") and hasattr(signal, "SIGUSR1")
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1}) if blocked else None
        try:
            # no deadline to meet the peers in: an hour, as timedelta cannot hold inf
            self._spawn(worker_env, torch_threads, start_s if start_s != float("inf") else 3600.0)
        finally:
            if old_mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        self._collect("start-up", start_s)

    def _spawn(self, worker_env: dict[str, str], torch_threads: int, start_s: float) -> None:
        ctx = mp.get_context("spawn")
        store_path = os.path.join(self._store_dir, "store")
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, self.world_size, store_path, self.backend, self.timeout_s, start_s, worker_env,
                      torch_threads, child_conn, os.getpid()),
                name=f"asyncdbo-rank{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)

    # -- public API -----------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list[Any]:
        """Call ``fn(rank, world_size, *args)`` on every rank at once; return results by rank.

        Raises :class:`RankError` if any rank raises, dies, or has not answered after
        ``timeout_s`` (default: the pool's; ``math.inf``: no limit, for calls whose collectives
        and watchdogs bound them); the pool is then closed.  ``fn`` and ``args`` are pickled once
        here, so a pickling error is raised before any rank starts and leaves the pool usable.
        """
        if self._closed:
            reason = f" after a failure ({self._broken})" if self._broken else ""
            raise RuntimeError(f"RankPool is closed{reason}; create a new RankPool")
        limit = self.timeout_s if timeout_s is None else _check_timeout("timeout_s", timeout_s)
        payload = pickle.dumps((fn, args))
        for conn in self._conns:
            conn.send_bytes(payload)
        return self._collect(getattr(fn, "__name__", repr(fn)), limit)

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
        shutil.rmtree(self._store_dir, ignore_errors=True)

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
        """Wait for one answer per rank; on any failure close the pool and raise RankError.

        A rank whose process stays stopped (SIGSTOP, a debugger) for the pool's ``timeout_s``
        fails the call by itself: its peers would fail at their collective timeout too, but one of
        them may instead be blocked for good on a lock the stopped process holds (the ``file://``
        store's ``flock``)."""
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        errors: dict[int, str] = {}
        died: list[int] = []
        order: list[int] = []  # failing ranks in the order their failure arrived
        deadline = time.monotonic() + timeout_s  # inf: no deadline
        failed_at: float | None = None
        stopped_since: dict[int, float] = {}
        pending = set(range(self.world_size))

        def fail(rank: int, kind: str, value: Any) -> None:
            pending.discard(rank)
            order.append(rank)
            if kind == "err":
                failures[rank], errors[rank] = value
            else:
                died.append(rank)
                failures[rank] = errors[rank] = value

        while pending:
            now = time.monotonic()
            limit = deadline if failed_at is None else min(deadline, failed_at + _FAILURE_GRACE_S)
            if now >= limit:
                break
            waitables: list[Any] = []
            for rank in pending:
                waitables += [self._conns[rank], self._procs[rank].sentinel]
            ready = wait(waitables, timeout=min(limit - now, _STATE_POLL_S))
            for rank in sorted(pending):
                conn, proc = self._conns[rank], self._procs[rank]
                if conn in ready:
                    try:
                        kind, value = conn.recv()
                    except (EOFError, OSError):
                        # The pipe closed without an answer: the process is dying or dead.
                        proc.join(_FAILURE_GRACE_S)
                        fail(rank, "died", f"process died (exit code {proc.exitcode}) during {what}")
                        continue
                    if kind == "err":
                        fail(rank, kind, value)
                    else:
                        pending.discard(rank)
                        results[rank] = value
                elif proc.sentinel in ready and not conn.poll():
                    proc.join(_FAILURE_GRACE_S)
                    fail(rank, "died", f"process died (exit code {proc.exitcode}) during {what}")
                elif _is_stopped(proc.pid):
                    since = stopped_since.setdefault(rank, time.monotonic())
                    if time.monotonic() - since >= self.timeout_s:
                        fail(rank, "stopped", f"process stopped (SIGSTOP or a debugger) for {self.timeout_s:g} s "
                                              f"during {what}")
                else:
                    stopped_since.pop(rank, None)
            if failures and failed_at is None:
                failed_at = time.monotonic()
        if not failures and not pending:
            return [results[r] for r in range(self.world_size)]
        silent = tuple(sorted(pending))
        if not failures:
            for rank in pending:
                failures[rank] = errors[rank] = f"no answer within {timeout_s:g} s during {what}"
            summary = f"rank(s) {sorted(failures)} timed out during {what}"
            silent = ()
        else:
            summary = f"rank(s) {sorted(failures)} failed during {what}"
            if pending:
                summary += f"; rank(s) {sorted(pending)} had not answered"
                for rank in pending:
                    errors[rank] = f"no answer {_FAILURE_GRACE_S:g} s after rank {order[0]} failed (stopped or stuck)"
        self._broken = summary
        self._shutdown(0.0)  # surviving ranks may be stuck in a collective: do not wait for them
        raise RankError(summary, failures, errors=errors, died=tuple(died), silent=silent, order=tuple(order))


def _is_stopped(pid: int | None) -> bool:
    """Whether the process is stopped by a signal or a tracer (Linux ``/proc``; False elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


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
