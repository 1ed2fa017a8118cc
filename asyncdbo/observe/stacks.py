"""Where is each ubatch stuck? ``dump_stacks()`` and a signal that prints it.

A thread-based DBO hang shows N threads blocked in ``Event.wait``; here every ubatch is a suspended
coroutine, so its whole await chain (file:line down to the yield it is parked at), its last yield
tag and what it waits on can be printed. :func:`dump_stacks` uses the same printer as the deadlock
error and the watchdog (:func:`asyncdbo._core.format_run`), so all three read alike.

Live runs come from the scheduler's weak registry (:data:`asyncdbo._core.LIVE_RUNS`):
every run is listed while it is being driven, in any task, with no instrument needed.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from typing import IO, Any

from .._core import LIVE_RUNS, DBORun, format_run, get_ubatch

__all__ = ["dump_stacks", "install_stack_dump_signal", "live_runs"]


def live_runs() -> list[DBORun]:
    """Runs in progress in this process, by name."""
    return sorted((r for r in list(LIVE_RUNS) if r._live), key=lambda r: r.name)


def dump_stacks(file: IO[str] | None = None) -> str:
    """Every live ubatch's await chain (file:line), last yield tag and what it is parked on.

    Returns the text, and also writes it to ``file`` when one is given (the library prints nothing
    on its own)."""
    runs = live_runs()
    if not runs:
        text = "asyncdbo: no live DBO run\n"
    else:
        parts = []
        me = get_ubatch()
        for run in runs:
            title = f"asyncdbo run {run.name!r}: {len(run.ubatches)} ubatches on {getattr(getattr(run.ext, 'backend', None), 'name', '?')}"
            if me is not None and me.run is run:
                title += f"; ubatch {me.id} is running (it called dump_stacks)"
            parts.append(format_run(run.ubatches, title))
        text = "\n\n".join(parts) + "\n"
    if file is not None:
        file.write(text)
        file.flush()
    return text


def install_stack_dump_signal(signum: int | None = None, file: IO[str] | None = None) -> Callable[[], None]:
    """On ``signum`` (default SIGUSR1) write :func:`dump_stacks` to ``file`` (default stderr).

    ``kill -USR1 <pid>`` then shows where each ubatch of a stuck server is. Python runs signal
    handlers in the main thread between bytecodes, so a main thread blocked inside C code prints
    when that call returns; pair it with ``faulthandler.register`` for thread-level stacks. Returns
    a function that restores the previous handler."""
    if signum is None:
        if not hasattr(signal, "SIGUSR1"):
            raise ValueError("this platform has no SIGUSR1; pass another signal number as signum")
        signum = signal.SIGUSR1
    out = file

    def handler(sig: int, frame: Any) -> None:
        dump_stacks(out if out is not None else sys.stderr)

    previous = signal.signal(signum, handler)

    def uninstall() -> None:
        signal.signal(signum, previous)

    return uninstall
