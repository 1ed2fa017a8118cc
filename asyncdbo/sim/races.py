"""Happens-before race checking for simulated streams (the idea of PyTorch's CUDA sanitizer).

Every stream has a vector clock: ``clock[s][r]`` is the highest op sequence number of stream ``r``
known to be complete before stream ``s``'s next op. An op on ``s`` bumps ``clock[s][s]``; recording
an event copies ``clock[s]``; waiting on it takes the elementwise max. An earlier access ``a`` is
ordered before the current op on ``s`` iff ``a.stream == s`` or ``a.seq <= clock[s][a.stream]``.

Per tensor *storage* (so views alias their base) the checker keeps the last write and the reads
since it. A read unordered with the last write is an early read (read-after-write); a write
unordered with a read or write since is a write-after-read/-write (a buffer reused too soon).
Comm ops count their outputs as written by the stream they are issued on (c10d schemas do not mark
them written). A fresh output (no alias in the schema) starts a new history, because the CPU
allocator reuses addresses. Tensors created outside the run have no history and are never racy.

Each access carries its :class:`Site` (ubatch, yield tag, stream, file:line, op), so a report names
both places.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from types import FrameType

from .._core.errors import AsyncDBOError

__all__ = ["DeadWait", "LostOverlap", "Race", "RaceChecker", "SimCheckError", "Site", "user_place"]

# Frames of asyncdbo's machinery (kernel, DBO layer, backends, sim, the EP all-to-all), torch and
# the standard library: a finding names the first frame outside them, the user's.
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIP: tuple[str, ...] = tuple(
    os.path.join(_PKG, d) for d in ("_core", "dbo", "backends", "sim", "dist")
) + (os.path.dirname(os.path.abspath(str(__import__("torch").__file__))), os.path.dirname(str(os.__file__)))


def user_place() -> str:
    """``file:line in function`` of the innermost frame outside asyncdbo's machinery and torch."""
    f: FrameType | None = sys._getframe(1)
    while f is not None:
        fn = f.f_code.co_filename
        if not fn.startswith(_SKIP) and not fn.startswith("<"):
            return f"{os.path.relpath(fn) if not fn.startswith('..') else fn}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return "?"


@dataclass(frozen=True)
class Site:
    """Where an access or sync happened."""

    ubatch: int | None
    tag: str | None
    stream: str
    place: str
    op: str

    def __str__(self) -> str:
        who = "outside ubatches" if self.ubatch is None else f"ubatch {self.ubatch}"
        return f"{who} at yield point {self.tag!r}, stream {self.stream}, {self.place}: {self.op}"


@dataclass(frozen=True)
class Race:
    """Two unordered accesses to one storage across streams."""

    kind: str  # "read-after-write" | "write-after-read" | "write-after-write"
    now: Site
    before: Site

    def __str__(self) -> str:
        verb = {"read-after-write": "reads", "write-after-read": "writes", "write-after-write": "writes"}[self.kind]
        prev = {"read-after-write": "written", "write-after-read": "read", "write-after-write": "written"}[self.kind]
        return (
            f"{self.kind} race: {self.now}\n    {verb} a buffer {prev} with no event ordering it by: {self.before}"
        )


@dataclass(frozen=True)
class LostOverlap:
    """A wait on an event whose record covered another ubatch's later work: correct, but serial."""

    waiter: Site
    recorder: Site
    foreign_ubatch: int
    lost_s: float

    def __str__(self) -> str:
        return (
            f"lost overlap ({self.lost_s * 1e6:.1f} us): {self.waiter}\n    waits on an event recorded by: "
            f"{self.recorder}\n    which also covers work ubatch {self.foreign_ubatch} queued after it; the "
            "event was recorded after a yield, so the ubatches serialize (record before yielding)"
        )


@dataclass(frozen=True)
class DeadWait:
    """A wait on an event that was never recorded (on a device it hangs or silently does nothing)."""

    waiter: Site
    recorded_later_by: Site | None = None

    def __str__(self) -> str:
        if self.recorded_later_by is None:
            return f"dead wait: {self.waiter}\n    waits on an event that no one recorded before the run ended"
        return (
            f"wait before record: {self.waiter}\n    waits on an event first recorded later by: "
            f"{self.recorded_later_by} (CUDA ignores such a wait: early read; NPU stalls)"
        )


class SimCheckError(AsyncDBOError):
    """The sim found races or dead waits. ``findings`` holds each one."""

    def __init__(self, findings: list[object]) -> None:
        self.findings = findings
        lines = [f"asyncdbo sim: {len(findings)} ordering problem(s):"]
        lines += [f"  {i + 1}. {f}" for i, f in enumerate(findings)]
        super().__init__("\n".join(lines))


@dataclass
class _Access:
    stream: int
    seq: int
    site: Site


@dataclass
class _History:
    write: _Access | None = None
    reads: list[_Access] = field(default_factory=list)


class RaceChecker:
    """Vector clocks over streams and access histories over storages (see the module docstring)."""

    def __init__(self) -> None:
        self.clocks: dict[int, dict[int, int]] = {}
        self.seq: dict[int, int] = {}
        self.history: dict[int, _History] = {}
        self.races: list[Race] = []
        self._seen: set[tuple[str, str, str]] = set()

    def _clock(self, sid: int) -> dict[int, int]:
        c = self.clocks.get(sid)
        if c is None:
            c = self.clocks[sid] = {}
            self.seq[sid] = 0
        return c

    def record(self, sid: int) -> dict[int, int]:
        """The clock an event recorded on ``sid`` now carries."""
        c = dict(self._clock(sid))
        c[sid] = self.seq[sid]
        return c

    def wait(self, sid: int, clock: dict[int, int]) -> None:
        c = self._clock(sid)
        for k, v in clock.items():
            if v > c.get(k, 0):
                c[k] = v

    def sync_all_to(self, sid: int) -> None:
        """A host synchronization with ``sid`` (``.item()``): later work on any stream follows it."""
        snap = self.record(sid)
        for other in list(self.clocks):
            self.wait(other, snap)

    def _ordered(self, a: _Access, sid: int) -> bool:
        return a.stream == sid or a.seq <= self.clocks[sid].get(a.stream, 0)

    def fresh(self, key: int) -> None:
        """``key`` was just allocated: forget the history of whatever used that address before."""
        self.history.pop(key, None)

    def access(self, sid: int, reads: set[int], writes: set[int], site: Site) -> None:
        """One op on stream ``sid`` reading and writing these storages."""
        self._clock(sid)
        self.seq[sid] += 1
        acc = _Access(sid, self.seq[sid], site)
        for key in reads - writes:
            h = self.history.setdefault(key, _History())
            if h.write is not None and not self._ordered(h.write, sid):
                self._report("read-after-write", site, h.write.site)
            h.reads.append(acc)
        for key in writes:
            h = self.history.setdefault(key, _History())
            for r in h.reads:
                if not self._ordered(r, sid):
                    self._report("write-after-read", site, r.site)
                    break
            else:
                if h.write is not None and not self._ordered(h.write, sid):
                    self._report("write-after-write", site, h.write.site)
            h.write = acc
            h.reads = [acc] if key in reads else []

    def _report(self, kind: str, now: Site, before: Site) -> None:
        key = (kind, now.place + now.op, before.place + before.op)
        if key in self._seen:  # one report per pair of places, not one per layer
            return
        self._seen.add(key)
        self.races.append(Race(kind, now, before))
