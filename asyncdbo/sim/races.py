"""Happens-before race checking for simulated streams (the idea of PyTorch's CUDA sanitizer), and
the findings the sim reports.

Every stream has a vector clock: ``clock[s][r]`` is the highest op sequence number of stream ``r``
known to be complete before stream ``s``'s next op. An op on ``s`` bumps ``clock[s][s]``; recording
an event copies ``clock[s]``; waiting on it takes the elementwise max. An earlier access ``a`` is
ordered before the current op on ``s`` iff ``a.stream == s`` or ``a.seq <= clock[s][a.stream]``.

Per tensor *storage* (so views alias their base) the checker keeps the writes and the reads since
them, each with the bytes it touched (a view's span; the rows an indexed op names, such as the
slots a paged KV cache write or gather touches: :func:`asyncdbo.sim.ops.self_region`). A read
unordered with an overlapping write is an early read (read-after-write); a write unordered with an
overlapping read or write is a write-after-read/-write (a buffer reused too soon). Disjoint bytes
of one storage never conflict.
Comm ops count their outputs as written by the stream they run on (c10d schemas do not mark
them written). A fresh output (no alias in the schema) starts a new history, because the CPU
allocator reuses addresses. Tensors created outside the run have no history and are never racy.

Findings name places in the user's code: the first three frames outside asyncdbo's machinery
(kernel, DBO layer, backends, sim, the EP all-to-all), torch and the standard library. A race
names both accesses and the wait that is missing between them; lost overlap names the record or
send that came after a yield, or the recv hook held across one.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field
from types import FrameType

from .._core.errors import AsyncDBOError
from .lost_text import describe
from .ops import Region, covers, overlaps

__all__ = [
    "LOST_KINDS",
    "DeadWait",
    "LostOverlap",
    "Race",
    "RaceChecker",
    "SimCheckError",
    "Site",
    "user_frames",
    "user_place",
]

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIP: tuple[str, ...] = tuple(
    os.path.join(_PKG, d) for d in ("_core", "dbo", "backends", "syncs.py", "sim", "dist", "cli")
) + (os.path.dirname(os.path.abspath(str(__import__("torch").__file__))), os.path.dirname(str(os.__file__)))

_BIN = os.path.join(sys.prefix, "bin") + os.sep

#: How many of the user's frames a finding shows.
FRAMES = 3


def _where(f: FrameType) -> str:
    fn = f.f_code.co_filename
    return f"{os.path.relpath(fn) if not fn.startswith('..') else fn}:{f.f_lineno} in {f.f_code.co_name}"


def _installed(filename: str) -> bool:
    """A frame of an installed package or of a console script (``asyncdbo``'s entry point)."""
    return "site-packages" in filename or "dist-packages" in filename or filename.startswith(_BIN)


def user_frames(limit: int = FRAMES) -> tuple[str, ...]:
    """``file:line in function`` of the innermost ``limit`` frames outside asyncdbo's machinery
    and torch, innermost first. An installed package's frame after the first user frame ends the
    list: beyond it lies the caller's framework (a test runner, an event loop), not their code."""
    out: list[str] = []
    f: FrameType | None = sys._getframe(1)
    while f is not None and len(out) < limit:
        fn = f.f_code.co_filename
        if out and _installed(fn):
            break
        if not fn.startswith(_SKIP) and not fn.startswith("<"):
            out.append(_where(f))
        f = f.f_back
    return tuple(out) or ("?",)


def user_place() -> str:
    """The innermost user frame (see :func:`user_frames`)."""
    return user_frames(1)[0]


@dataclass(frozen=True)
class Site:
    """Where an access, record, wait or send happened: the ubatch and the yield it last passed,
    the stream, the user's frames (innermost first) and the op."""

    ubatch: int | None
    tag: str | None
    stream: str
    frames: tuple[str, ...]
    op: str

    @property
    def place(self) -> str:
        return self.frames[0]

    @property
    def who(self) -> str:
        if self.ubatch is None:
            return "outside ubatches"
        if self.tag is None:
            return f"ubatch {self.ubatch} before its first yield"
        return f"ubatch {self.ubatch} after its yield {self.tag!r}"

    def lines(self, label: str = "") -> list[str]:
        """A block for a multi-line report: ``label``, the op, who and which stream, then the frames."""
        out = [f"    {label}{self.op}: {self.who}, stream {self.stream}"]
        out += [f"        {'at' if i == 0 else '  '} {fr}" for i, fr in enumerate(self.frames)]
        return out

    def __str__(self) -> str:
        return f"{self.who}, stream {self.stream}, {self.place}: {self.op}"


_VERBS = {"read-before-await": ("read", "write"), "read-after-write": ("read", "write"), "write-after-read": ("write", "read"),
          "write-after-write": ("write", "write")}


@dataclass(frozen=True)
class Race:
    """Two unordered accesses to one storage from different streams: ``before`` happened first
    in program order, ``now`` after it with no event ordering ``now``'s stream after it."""

    kind: str  # "read-after-write" | "write-after-read" | "write-after-write"
    now: Site
    before: Site
    cross_wait: Site | None = None  # the racing stream's last wait, when another ubatch recorded its event

    def __str__(self) -> str:
        first, second = _VERBS[self.kind][1], _VERBS[self.kind][0]
        b, n = self.before, self.now
        if self.kind == "read-before-await":
            return "\n".join([
                f"read-before-await: ubatch {n.ubatch} reads what its transfer {b.op} wrote without awaiting the "
                "transfer's handle",
                *b.lines("1. write by "),
                *n.lines("2. read by "),
                f"    missing: ubatch {n.ubatch} never awaited the handle of {b.op} ({b.place}) before {n.op} "
                f"({n.place}): another ubatch's recv hook ordered the device stream, but on the host backend the "
                "data arrives only when its owner awaits it (wrong numbers there): await the handle before the read",
            ])
        note = [] if self.cross_wait is None else [
            f"    note: stream {n.stream} last waited on an event ubatch {self.cross_wait.ubatch} recorded ("
            f"{self.cross_wait.place}): a wait on another ubatch's event does not order this one's own work"]
        return "\n".join([
            f"{self.kind} race: {n.op} on stream {n.stream} {second}s a buffer {b.op} on stream {b.stream} "
            f"{'wrote' if first == 'write' else 'read'}, with no event between them",
            *b.lines(f"1. {first} by "),
            *n.lines(f"2. {second} by "),
            f"    missing: no wait on stream {b.stream} between {b.op} ({b.place}) and {n.op} ({n.place}): record "
            f"an event on {b.stream} after the {first} and make stream {n.stream} wait on it before the {second}",
            *note,
        ])


#: Lost-overlap kinds, each with what the counterfactual run changes to measure its cost.
LOST_KINDS = {
    "record-after-yield": "the event carries the end of this ubatch's own work, as if recorded before the yield",
    "send-after-yield": "the send leaves when its data was ready, as if issued before the yield",
    "skipped-recv-hook": "the held recv hook runs at the yield, as if dbo_maybe_run_recv_hook() had been called",
    "empty-recv-hook": "the ubatch that ran the hook waits for the transfer before its next yield, as a hook that "
                       "receives would",
    "host-sync": "the host does not wait at that op",
    "comm-not-overlapped": "the await moves past the ubatch's next yield (the fixed schedule awaits the transfer once "
                           "the other ubatch ran); where its data is used before that yield, a yield before the await "
                           "(used without an await: the transfer takes no time, the most a yield could hide)",
    "compute-on-comm-stream": "the op runs on the compute stream; comm waits for it only where it reads its output",
    "unneeded-comm-wait": "the ubatch's work that reads nothing the transfer delivered runs as if issued before the "
                          "wait (from the stream's time before it), up to its first op that reads the transfer",
    "comm-wait-blocks-other": "another ubatch's work queued behind the wait that reads nothing the transfer delivered "
                              "runs from the stream's time before the wait (the wait holds the waiting ubatch's work "
                              "only), up to its first op that reads the transfer",
}

#: Kinds that fail the check whatever their counterfactual measured here: a host sync (a GPU pays
#: it at any size) and a recv hook that received nothing (the receive a hook-based comm library
#: launches only from its hook).
ALWAYS_FAIL = frozenset({"host-sync", "empty-recv-hook"})


@dataclass(frozen=True)
class LostOverlap:
    """Correct but serial: the schedule waits for another ubatch's work it does not need, or
    leaves the device idle where another ubatch's work could run.

    ``kind`` (:data:`LOST_KINDS`): ``record-after-yield`` (an event recorded after a yield covers
    work the other ubatch queued meanwhile, and a wait on it waits for that work too: vLLM
    #38451), ``send-after-yield`` (a transfer whose data was ready before a yield, issued after
    it), ``skipped-recv-hook`` (a ubatch yielded while holding another's recv hook),
    ``empty-recv-hook`` (under role streams, a recv hook another ubatch ran received nothing: the
    owner's own wait was the first on the transfer it issued before yielding with the hook out),
    ``host-sync`` (a read to the host of a device result between yields: ``.item()``,
    ``.tolist()``, ``.cpu()``; the CPU stops launching for every ubatch), ``comm-not-overlapped``
    (a transfer issued and awaited with no yield between its data, its send and its use: no other
    ubatch's work can hide it), ``compute-on-comm-stream`` (a compute kernel queued on the comm
    stream, where it holds up the transfers queued behind it).
    ``unneeded-comm-wait`` (whatever the schedule's cause: a compute kernel of a ubatch queued
    behind a stream wait on that ubatch's own transfer, although it reads nothing the transfer
    delivered; issued before the wait, it would have run while the transfer was in flight).
    ``comm-wait-blocks-other`` (whatever the schedule's cause: comm exposed on a stream while another
    ubatch had work it could have run there; a ubatch's stream wait on comm that another
    ubatch's work, reading nothing the transfer delivered, was queued behind before the waiting
    ubatch's own next op).

    ``cost_s``: what it cost, measured by a counterfactual sim run of the same schedule without
    it (:func:`asyncdbo.sim.counterfactual.measure_lost_overlap`; ``asyncdbo check`` and
    :func:`asyncdbo.sim.predict.predict` run it): this run's makespan minus that run's. None
    when no counterfactual was run (a bare :class:`~asyncdbo.sim.SimBackend` run)."""

    kind: str
    site: Site
    other: Site | None
    foreign_ubatch: int | None
    cost_s: float | None = None
    #: the cost model's estimate on a GPU (a host sync: its cost with eager launches), the step
    #: time of that run, and what was modeled (``"h200, eager launches"``); None where not run.
    estimate_s: float | None = None
    estimate_step_s: float | None = None
    estimate_on: str | None = None
    #: ``comm-wait-blocks-other``: the other ubatch's first op the wait held up
    blocked: Site | None = None

    @property
    def lost_s(self) -> float:
        """Deprecated: :attr:`cost_s` (0.0 where no counterfactual was run)."""
        warnings.warn("LostOverlap.lost_s is deprecated and will be removed: use cost_s (the counterfactual run's "
                      "measured cost; None when none was run)", DeprecationWarning, stacklevel=2)
        return self.cost_s or 0.0

    @property
    def key(self) -> tuple[str, str]:
        """What a counterfactual run fixes: the kind at this place (every layer's occurrence)."""
        return self.kind, self.site.place

    def _head(self) -> str:
        if self.cost_s is None:
            cost = "cost not measured: asyncdbo check measures it by a counterfactual run"
        elif self.cost_s > 0:
            cost = f"costs {self.cost_s * 1e6:.1f} us of this run"
        else:
            cost = "no cost measured at this size"
        if self.estimate_s is not None and self.estimate_step_s is not None:
            cost += (f"; the cost model estimates {max(0.0, self.estimate_s) * 1e6:.1f} us on {self.estimate_on} "
                     f"(a step of {self.estimate_step_s * 1e6:.1f} us there)")
        return f"lost overlap ({self.kind}, {cost})"

    def __str__(self) -> str:
        return describe(self, self._head())


@dataclass(frozen=True)
class DeadWait:
    """A wait on an event that was never recorded (on a device it hangs or silently does nothing)."""

    waiter: Site
    recorded_later_by: Site | None = None

    def __str__(self) -> str:
        if self.recorded_later_by is None:
            return "\n".join([
                f"dead wait: stream {self.waiter.stream} waits on an event that no one recorded before the run ended",
                *self.waiter.lines(),
            ])
        return "\n".join([
            f"wait before record: stream {self.waiter.stream} waits on an event first recorded later (CUDA ignores "
            "such a wait: early read; NPU stalls)",
            *self.waiter.lines(),
            *self.recorded_later_by.lines(),
        ])


class SimCheckError(AsyncDBOError):
    """The sim found ordering problems (races, dead waits, and lost overlap when asked to fail on
    it). ``findings`` holds each one."""

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
    """One storage's accesses that a later one may race with, each with the bytes it touched: the
    writes no later write covered, and the reads since the write that covered them."""

    writes: list[tuple[_Access, Region]] = field(default_factory=list)
    reads: list[tuple[_Access, Region]] = field(default_factory=list)


class RaceChecker:
    """Vector clocks over streams (always kept: lost overlap uses them too) and, when asked,
    access histories over storages (see the module docstring)."""

    def __init__(self) -> None:
        #: stream -> the record of the event its last wait was on (set by the backend)
        self.last_wait: dict[int, Site] = {}
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

    def tick(self, sid: int) -> int:
        """One op on ``sid``; returns its sequence number."""
        self._clock(sid)
        self.seq[sid] += 1
        return self.seq[sid]

    def record(self, sid: int) -> dict[int, int]:
        """The clock an event recorded on ``sid`` now carries."""
        c = dict(self._clock(sid))
        c[sid] = self.seq[sid]
        return c

    def knows(self, sid: int, other: int) -> int:
        """The last op of ``other`` that ``sid`` is ordered after (its own last op for itself)."""
        c = self._clock(sid)
        return self.seq[sid] if sid == other else c.get(other, 0)

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

    def access(self, sid: int, reads: set[int], writes: set[int], site: Site,
               regions: dict[int, Region] | None = None) -> None:
        """One op on stream ``sid`` reading and writing these storages; ``regions``: the bytes it
        touches of some of them (:func:`asyncdbo.sim.ops.self_region`; the rest: all of it). Two
        accesses conflict only where their bytes overlap: ubatches writing their own slots of one
        KV cache do not, a read of a slot another stream wrote does."""
        acc = _Access(sid, self.tick(sid), site)
        where = regions or {}
        for key in reads - writes:
            h = self.history.setdefault(key, _History())
            reg = where.get(key)
            for w, wr in reversed(h.writes):
                if overlaps(reg, wr) and not self._ordered(w, sid):
                    self._report("read-after-write", site, w.site, sid)
                    break
            h.reads.append((acc, reg))
        for key in writes:
            h = self.history.setdefault(key, _History())
            reg = where.get(key)
            for r, rr in h.reads:
                if overlaps(reg, rr) and not self._ordered(r, sid):
                    self._report("write-after-read", site, r.site, sid)
                    break
            else:
                for w, wr in reversed(h.writes):
                    if overlaps(reg, wr) and not self._ordered(w, sid):
                        self._report("write-after-write", site, w.site, sid)
                        break
            h.writes = [(w, wr) for w, wr in h.writes if not covers(reg, wr)] + [(acc, reg)]
            h.reads = [(r, rr) for r, rr in h.reads if not covers(reg, rr)] + ([(acc, reg)] if key in reads else [])

    def report(self, kind: str, now: Site, before: Site, sid: int) -> None:
        """Report a finding the backend found itself (``read-before-await``)."""
        self._report(kind, now, before, sid)

    def _report(self, kind: str, now: Site, before: Site, sid: int) -> None:
        key = (kind, now.place + now.op, before.place + before.op)
        if key in self._seen:  # one report per pair of places, not one per layer
            return
        self._seen.add(key)
        waited = self.last_wait.get(sid)
        cross = waited if waited is not None and waited.ubatch not in (None, now.ubatch) else None
        self.races.append(Race(kind, now, before, cross))


SimCheckError.__module__ = "asyncdbo.sim"  # tracebacks print the public path, not this private module
