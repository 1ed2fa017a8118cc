"""Worker processes that follow their parent: when the launcher dies, its workers end too.

A worker whose launcher is gone (a killed ``torchrun`` agent, a crashed test run) otherwise runs to
the end of its job with its ports open, and may hold the machine's memory and cores for hours.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

__all__ = ["exit_with_parent", "set_process_name"]

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15
#: How often the fallback watcher thread looks at the parent pid.
_PARENT_POLL_S = 0.5


def exit_with_parent(parent_pid: int | None = None, *, watch: bool = False) -> str:
    """End this process when its parent (``parent_pid``, default: the current parent) dies.

    On Linux the kernel does it: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, set through ctypes, kills
    this process as soon as the parent's thread that started it exits; then the parent pid is
    checked once, in case the parent died before the call. Elsewhere (or with ``watch=True``) a
    daemon thread checks the parent pid every 0.5 s and leaves with ``os._exit(1)``. Returns which
    mechanism is in place (``"prctl"`` or ``"watch"``); exits at once if the parent is already
    gone."""
    parent = os.getppid() if parent_pid is None else parent_pid
    how = "watch"
    if sys.platform.startswith("linux") and not watch:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0:
            how = "prctl"
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)
    if how == "watch":
        threading.Thread(target=_watch, args=(parent,), name="asyncdbo-parent-watch", daemon=True).start()
    return how


def set_process_name(name: str) -> bool:
    """Name this process for ``ps``, ``top`` and ``pgrep`` (Linux: ``/proc/<pid>/comm``, at most 15
    bytes), so ``kill -USR1 $(pgrep -x asyncdbo-rank1)`` finds a rank. Returns whether it worked."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return bool(libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0) == 0)


def _watch(parent_pid: int) -> None:
    while True:
        time.sleep(_PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)
