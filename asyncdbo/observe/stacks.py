"""Where is each ubatch stuck? ``dump_stacks()`` and a signal that prints it.

A thread-based DBO hang shows N threads blocked in ``Event.wait``; here every ubatch is a suspended
coroutine, so its whole await chain (file:line down to the yield it is parked at), its last yield
tag and what it waits on can be printed. :func:`dump_stacks` uses the same printer as the deadlock
error and the watchdog (:func:`asyncdbo._core.format_run`), so all three read alike.

Live runs come from the scheduler's weak registry (:data:`asyncdbo._core.LIVE_RUNS`):
every run is listed while it is being driven, in any task, with no instrument needed. Every dump
opens with who printed it (rank when torch.distributed is initialised or ``RANK`` is set, pid) and
how (``dump_stacks()`` or the signal handler).

The signal handler is safe at any moment it can run: before any run, between runs, inside a
ubatch, while another dump is being written (the second one is skipped), with ``sys.stderr``
closed or gone (it writes to file descriptor 2), and at exit (the handler turns into "ignore" in
an ``atexit`` hook, because interpreter teardown resets a Python-level handler to the default
action, which for SIGUSR1 ends the process). A launcher covers the start of a child process by
starting it with the signal blocked (:class:`asyncdbo.testing.RankPool` does): a signal that
arrives before the child installs the handler is held, and printed once
:func:`install_stack_dump_signal` unblocks it.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
from collections.abc import Callable
from typing import IO, Any

from .._core import LIVE_RUNS, DBORun, format_run, get_ubatch

__all__ = ["dump_stacks", "install_stack_dump_signal", "live_runs"]

_BY_CALL = "dump_stacks()"
_BY_SIGNAL = "the signal handler"


def live_runs() -> list[DBORun]:
    """Runs in progress in this process, by name."""
    return sorted((r for r in list(LIVE_RUNS) if r._live), key=lambda r: r.name)


def _who() -> str:
    """``rank R of W, pid P`` (the rank when torch.distributed has one, else ``RANK``), or ``pid P``.
    Never imports torch: a signal can arrive before torch is loaded."""
    rank = None
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank = f"{dist.get_rank()} of {dist.get_world_size()}"
    except Exception:  # noqa: BLE001 - a half-initialised group: fall back to the environment
        rank = None
    if rank is None and os.environ.get("RANK"):
        rank = os.environ["RANK"]
        if os.environ.get("WORLD_SIZE"):
            rank += f" of {os.environ['WORLD_SIZE']}"
    pid = f"pid {os.getpid()}"
    return f"rank {rank}, {pid}" if rank is not None else pid


def _format(by: str) -> str:
    head = f"asyncdbo stacks of {_who()}, printed by {by}\n"
    runs = live_runs()
    if not runs:
        return head + "asyncdbo: no live DBO run\n"
    me = get_ubatch()
    parts = []
    for run in runs:
        title = f"asyncdbo run {run.name!r}: {len(run.ubatches)} ubatches on {getattr(getattr(run.ext, 'backend', None), 'name', '?')}"
        if me is not None and me.run is run:
            why = "it called dump_stacks" if by == _BY_CALL else "the signal handler interrupted it"
            title += f"; ubatch {me.id} is running ({why})"
        parts.append(format_run(run.ubatches, title))
    return head + "\n\n".join(parts) + "\n"


def dump_stacks(file: IO[str] | None = None) -> str:
    """Every live ubatch's await chain (file:line), last yield tag and what it is parked on, after a
    line naming this process (rank, pid).

    Returns the text, and also writes it to ``file`` when one is given (the library prints nothing
    on its own)."""
    text = _format(_BY_CALL)
    if file is not None:
        file.write(text)
        file.flush()
    return text


def _write(file: IO[str] | None, text: str) -> None:
    """Write ``text`` to ``file`` (None: the current ``sys.stderr``), or to fd 2 if that fails."""
    out = file if file is not None else sys.stderr
    try:
        if out is None:
            raise OSError("no stderr")
        out.write(text)
        out.flush()
    except Exception:  # noqa: BLE001 - closed, detached or gone at exit: the raw descriptor is left
        try:
            os.write(2, text.encode("utf-8", "replace"))
        except OSError:
            pass


class _Handler:
    """The installed signal handler: prints the dump, never raises, never nests."""

    def __init__(self, signum: int, file: IO[str] | None) -> None:
        self.signum, self.file, self.busy = signum, file, False

    def __call__(self, sig: int, frame: Any) -> None:
        if self.busy:  # a second signal while the first dump is being written: that one is enough
            return
        self.busy = True
        try:
            try:
                text = _format(f"{_BY_SIGNAL} ({signal.Signals(sig).name})")
            except Exception as exc:  # noqa: BLE001 - a dump must never take the process down
                text = f"asyncdbo stacks of {_who()}: the signal handler could not format them ({type(exc).__name__}: {exc})\n"
            _write(self.file, text)
        finally:
            self.busy = False

    def ignore_at_exit(self) -> None:
        """atexit: from here on the signal is ignored (see the module docstring)."""
        signum = self.signum
        try:
            current = signal.getsignal(signum)
            if current is self:
                signal.signal(signum, signal.SIG_IGN)
        except (ValueError, OSError):  # not the main thread, or the interpreter is going away
            pass


def _default_signum(signum: int | None) -> int:
    if signum is not None:
        return signum
    if not hasattr(signal, "SIGUSR1"):
        raise ValueError("this platform has no SIGUSR1; pass another signal number as signum")
    return int(signal.SIGUSR1)


def install_stack_dump_signal(signum: int | None = None, file: IO[str] | None = None) -> Callable[[], None]:
    """On ``signum`` (default SIGUSR1) write :func:`dump_stacks` to ``file`` (default stderr).

    ``kill -USR1 <pid>`` then shows where each ubatch of a stuck server is. Python runs signal
    handlers in the main thread between bytecodes, so a main thread blocked inside C code prints
    when that call returns; pair it with ``faulthandler.register`` for thread-level stacks. The
    signal is unblocked in this thread if the process started with it blocked (a signal held
    meanwhile is printed now). Returns a function that restores the previous handler."""
    signum = _default_signum(signum)
    handler = _Handler(signum, file)
    previous = signal.signal(signum, handler)
    atexit.register(handler.ignore_at_exit)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})

    def uninstall() -> None:
        atexit.unregister(handler.ignore_at_exit)
        signal.signal(signum, previous)

    return uninstall
