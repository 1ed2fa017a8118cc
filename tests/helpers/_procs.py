"""What the tests that start real processes read about them in /proc (Linux): a process's
children, a field of its status, whether it catches a signal, and the rank torchrun gave it."""

from __future__ import annotations

import os
import signal

def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (read from every /proc/<pid>/stat)."""
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == pid:
                kids.append(int(entry))
    return kids


def status(pid: int, field: str) -> str | None:
    """The value of ``field`` in /proc/<pid>/status, or None (no such process or field)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def alive(pid: int) -> bool:
    state = status(pid, "State")
    return state is not None and not state.startswith(("Z", "X"))


def catches(pid: int, signum: int) -> bool:
    """Whether ``pid`` has a handler for ``signum`` (its SigCgt mask)."""
    caught = status(pid, "SigCgt")
    return caught is not None and bool(int(caught, 16) & (1 << (signum - 1)))


def catches_sigusr1(pid: int) -> bool:
    """Whether ``pid`` has a SIGUSR1 handler: before it does, the signal's default action would
    end the process."""
    return catches(pid, signal.SIGUSR1)


def signal_masks(pid: int) -> str:
    """The process's state and its blocked, ignored and caught signal masks, for a failure message."""
    fields = [f"{name}: {status(pid, name)}" for name in ("State", "SigBlk", "SigIgn", "SigCgt")]
    return "\n".join(fields)


def torchrun_rank(pid: int) -> int | None:
    """The RANK that torchrun put in the environment of its worker ``pid``, or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    except OSError:
        return None
    return int(env[b"RANK"]) if b"RANK" in env and b"LOCAL_RANK" in env else None
