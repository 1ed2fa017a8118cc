"""Checks of the CLI's inputs that must fail before any rank starts: timeouts, output directories,
and the memory a run would need.

A size flag that does not fit used to end in an allocation failure inside the ranks or in the
OOM killer after a minute (``demo --tokens 5000000``, ``check --tokens 100000000``). The estimates
here add up the largest tensors of one step (attention scores, the KV cache, logits, MoE rows,
weights) plus a fixed per-process base, and the run is refused when they exceed the memory the
machine has available (``MemAvailable``), with the largest size that would fit; ``check`` also
holds them to the process's own limits (``ulimit -v``, ``ulimit -d``: :func:`usable_bytes`). They
are meant to be right to within a small factor, and to err high (measured against peak RSS:
``benchmarks/results/memory_estimate_cpu-2c_2026-12-01.md``), not to be a budget.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = [
    "MAX_TIMEOUT_S",
    "ProcessLimit",
    "available_bytes",
    "check_output_dir",
    "check_timeout",
    "human_bytes",
    "largest_fitting",
    "memory_bound",
    "process_limits",
    "usable_bytes",
]

#: The longest ``--timeout`` accepted: a day. Larger values overflow the waits they bound (a
#: ``select`` timeout in milliseconds must fit a C int: 24.8 days).
MAX_TIMEOUT_S = 86400.0
#: Resident memory of one rank process with torch, asyncdbo's models and a gloo group, and nothing
#: else: 222 MiB measured (peak RSS), rounded up.
PROCESS_BASE_BYTES = 256 * 2**20


def check_timeout(flag: str, value: float) -> float:
    """A positive, finite number of seconds of at most a day, or ValueError naming ``flag``."""
    if math.isnan(value) or value <= 0:
        raise ValueError(f"{flag} {value:g} is not a positive number of seconds; use e.g. {flag} 120")
    if value > MAX_TIMEOUT_S:
        raise ValueError(
            f"{flag} {value:g} is longer than a day ({MAX_TIMEOUT_S:g} s), the longest wait asyncdbo can bound; "
            f"use at most {flag} {MAX_TIMEOUT_S:g}"
        )
    return value


def check_output_dir(flag: str, path: str) -> str:
    """Make sure ``path`` is a directory this process can write (creating it if missing), or
    raise ValueError naming ``flag``: before a run, not after it."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a file; give a directory (it is created if missing)")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):  # the real test: permissions, read-only mounts, quotas
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {path!r} is not a writable directory ({exc.strerror or exc}); give one you can write") from None
    return path


def available_bytes() -> int | None:
    """Memory the kernel says new allocations can have (``MemAvailable``); None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


@dataclass(frozen=True)
class ProcessLimit:
    """A soft limit on this process's memory (``resource.getrlimit``) and how much of what it
    counts is not resident now: ``name`` (``"RLIMIT_AS"``), ``flag`` (the shell's ``ulimit -v``),
    ``what`` (``"address-space"``), ``limit`` and ``unresident`` in bytes."""

    name: str
    flag: str
    what: str
    limit: int
    unresident: int

    @property
    def left(self) -> int:
        """What the limit leaves for resident memory: the limit less what it counts that is not."""
        return max(0, self.limit - self.unresident)

    def describe(self) -> str:
        """The limit as a message names it: ``RLIMIT_AS, ulimit -v: 1.2 GiB, of which ... is mapped
        but not resident``."""
        mapped = f", of which {human_bytes(self.unresident)} is mapped but not resident" if self.unresident else ""
        return f"{self.name}, {self.flag}: {human_bytes(self.limit)}{mapped}"


#: The limits a run is held to: RLIMIT_AS counts the address space (VmSize), RLIMIT_DATA the
#: private writable mappings (VmData: Linux >= 4.7).
_LIMITS = (("RLIMIT_AS", "ulimit -v", "address-space", "VmSize"), ("RLIMIT_DATA", "ulimit -d", "data", "VmData"))


def _proc_status() -> dict[str, int]:
    """``/proc/self/status``'s sizes in bytes (``VmSize``, ``VmRSS``...); empty where there is none."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(":")
                parts = value.split()
                if len(parts) == 2 and parts[1] == "kB":
                    out[key] = int(parts[0]) * 1024
    except (OSError, ValueError):
        return {}
    return out


def process_limits() -> list[ProcessLimit]:
    """This process's soft RLIMIT_AS and RLIMIT_DATA, those that are set (``RLIM_INFINITY``: none).

    The estimates here are of the resident set, but a limit counts mappings whether resident or
    not: with torch imported the address space is about 400 MiB larger than the resident set
    (VmSize 644 MiB, VmRSS 228 MiB), the data segment about as large (VmData 226 MiB). Each limit
    carries that difference now (``unresident``), which the run keeps: ``check --workload`` of a
    65,536-token rank (peak RSS 687-715 MiB) ran under ``ulimit -v`` 1120 MiB and failed to
    allocate under 1060 MiB, and ran under ``ulimit -d`` 720 MiB."""
    try:
        import resource
    except ImportError:  # not on Windows
        return []
    status = _proc_status()
    out = []
    for name, flag, what, counted in _LIMITS:
        soft, _ = resource.getrlimit(getattr(resource, name))
        if soft == resource.RLIM_INFINITY or soft < 0:
            continue
        unresident = max(0, status[counted] - status["VmRSS"]) if counted in status and "VmRSS" in status else 0
        out.append(ProcessLimit(name, flag, what, soft, unresident))
    return out


def memory_bound(available: int | None, limits: Sequence[ProcessLimit]) -> tuple[int, str] | None:
    """The most bytes a run's resident set may reach here, and what bounds it (the end of a
    message: ``"is available"``, or which limit leaves it): the smaller of the memory the machine
    has ``available`` (None: unknown) and what each of this process's ``limits`` leaves for
    resident memory (the limit less what it counts that is not resident). None where neither is
    known."""
    bounds = [] if available is None else [(available, "is available")]
    for lim in limits:
        bounds.append((lim.left, f"is left under this process's {lim.what} limit ({lim.describe()})"))
    return min(bounds, key=lambda bound: bound[0]) if bounds else None


def usable_bytes() -> tuple[int, str] | None:
    """:func:`memory_bound` of this machine's available memory and this process's limits."""
    return memory_bound(available_bytes(), process_limits())


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def largest_fitting(estimate: Callable[[int], float], lo: int, hi: int, available: int) -> int | None:
    """The largest ``n`` in ``[lo, hi]`` with ``estimate(n) <= available`` (estimate grows with
    ``n``), or None if not even ``lo`` fits."""
    if estimate(lo) > available:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if estimate(mid) <= available:
            lo = mid
        else:
            hi = mid - 1
    return lo
