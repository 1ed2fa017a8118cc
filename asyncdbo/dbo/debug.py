"""Debug mode of a DBO run (``run_ubatches(..., debug=True)``): checks that cost time per yield.

* every dropped awaitable is an error naming the line that created it (:mod:`asyncdbo.dbo.awaits`);
* the yield discipline (:class:`YieldChecker`, below);
* blocking code between two yields (:class:`BlockingDetector`): a ``time.sleep``, a lock, an
  ``.item()`` that waits for the device, reported with the yield points around it and kept in the
  run's stats and traces;
* two ubatches issuing collectives on one process group (:class:`CommGuard`, in
  :mod:`asyncdbo.dbo.comm_guard`): an error
  before the second collective is issued (gloo would abort the process on the mismatch, from C++,
  where Python cannot catch it);
* an async collective whose work a ubatch does not hand to ``dbo_submit`` before it next yields,
  parks or returns (:class:`CommGuard`): an error naming the line that issued it;
* a stream context held across a yield (:class:`asyncdbo.dbo.stream_guard.StreamContextGuard`):
  an error naming the line where the ubatch suspended with another stream current.

Yield discipline: every ubatch of a step should pass the same yield points in the same order.

Mismatched yields are the usual cause of lost overlap and of hangs in DBO code: if ubatch 0 yields
at ``dispatch`` while ubatch 1 yields at ``combine``, the ping-pong pairs the wrong stages (one
ubatch's comm no longer runs under the other's compute) and a wait on the other ubatch's event may
never be satisfied. :class:`YieldChecker` (turned on by ``run_ubatches(..., debug=True)``) compares
the sequences of yield tags as the run goes and raises :class:`~asyncdbo.YieldMismatchError` at the
first divergence, naming the ubatch, the position and both tags.

Rules:

* Only handovers count (``dbo_yield`` and the ``dbo_yield_and_switch_*`` primitives). Parking on a
  comm completion or an event is not a yield: whether a ubatch parks depends on timing.
* Position ``k`` of every ubatch must carry the tag the first ubatch to reach position ``k`` had.
* At the end every ubatch must have made the same number of yields, except a ubatch that made
  none at all: it did no staged work (an empty or padding ubatch that returned early), and the
  others are compared among themselves. A ubatch that stopped part-way through is a mismatch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from .._core import (
    SWITCH,
    DBORun,
    Instrument,
    UBatch,
    YieldMismatchError,
    user_frame,
)
from .comm_guard import CommGuard, PendingComm, SharedGroupGuard, prepare_dispatch_mode

__all__ = [
    "BlockingDetector",
    "BlockingStep",
    "CommGuard",
    "DebugMode",
    "PendingComm",
    "SharedGroupGuard",
    "YieldChecker",
    "debug_instruments",
    "prepare_dispatch_mode",
]

log = logging.getLogger("asyncdbo")


@dataclass(frozen=True)
class DebugMode:
    """What debug mode checks. ``blocking_s``: a step (the code between two yield points) that
    blocks the CPU longer than this is reported (None: not checked)."""

    blocking_s: float | None


@dataclass(frozen=True)
class BlockingStep:
    """A step that blocked the CPU: ubatch, the yield points before and after it with where the
    user's code stood at each, its wall time and how long the CPU was blocked in it, and its span
    ``[t0, t1]`` on the run's clock (for traces). ``cpu_s``: CPU time the thread used in it;
    ``runq_s``: time it waited for a free core; ``host``: on the host backend (where the CPU is
    the compute stream, so a host sync waits for nothing)."""

    ub: int
    from_tag: str | None
    to_tag: str | None
    from_where: str
    to_where: str
    wall_s: float
    blocked_s: float
    t0: float
    t1: float
    cpu_s: float = 0.0
    runq_s: float = 0.0
    host: bool = True
    #: On a device backend, the host syncs :class:`~asyncdbo.syncs.HostSyncs` saw in the step (one
    #: line each: op, user line, why it syncs); None where it did not watch (the host backend).
    syncs: tuple[str, ...] | None = None

    def describe(self) -> str:
        where = (f"between yield points {self.from_tag!r} ({self.from_where}) and {self.to_tag!r} "
                 f"({self.to_where}); no other ubatch could run meanwhile")
        if self.host:
            return (
                f"asyncdbo: ubatch {self.ub} was off the CPU for {self.blocked_s * 1e3:.1f} ms {where}. Measured: "
                f"{self.wall_s * 1e3:.1f} ms wall = {self.cpu_s * 1e3:.1f} ms computing on this thread + "
                f"{self.runq_s * 1e3:.1f} ms waiting for a free core + {self.blocked_s * 1e3:.1f} ms neither. "
                "On the CPU backend a host sync (.item(), .tolist()) waits for nothing, so it is not one: look for a "
                "time.sleep, a lock or a blocking wait (work.wait()); on a loaded machine, torch's intra-op threads "
                "that this thread waits for count here too (torch.set_num_threads(1) rules them out)."
            )
        measured = (f"asyncdbo: ubatch {self.ub} blocked the CPU for {self.blocked_s * 1e3:.1f} ms {where}. Measured: "
                    f"{self.wall_s * 1e3:.1f} ms wall, less {self.runq_s * 1e3:.1f} ms waiting for a free core. ")
        if self.syncs is None:
            return measured + ("On a device backend the CPU only launches work, so look for a host sync (.item(), "
                               ".tolist(), .cpu(); asyncdbo.syncs.HostSyncs names each one and its line), a time.sleep "
                               "or a lock in that stretch.")
        if not self.syncs:
            return measured + ("asyncdbo.syncs.HostSyncs watched the stretch and saw no host sync in it, so the CPU "
                               "was held by something else: a time.sleep, a lock, a blocking wait (work.wait()), or "
                               "launching that much work.")
        n = len(self.syncs)
        return measured + (f"In that stretch asyncdbo.syncs.HostSyncs saw {n} host sync{'s' if n != 1 else ''}, each "
                           "a wait for the device: " + "; ".join(self.syncs) + ". Keep the value on the device, or "
                           "move the read out of the stretch (before a yield point, or after the step).")


class YieldChecker(Instrument):
    """Raises :class:`YieldMismatchError` at the first divergence of the ubatches' yield tags.

    The message names both sides by the user's file:line (the innermost frame outside asyncdbo of
    each ubatch's await chain when it yielded), so the reader goes straight to the two
    ``await dbo_*`` lines that differ rather than to this module.
    """

    def __init__(self) -> None:
        self._tags: dict[int, list[str | None]] = {}
        self._where: dict[int, list[str]] = {}
        self._first: list[tuple[int, str | None, str]] = []  # position -> (ubatch, tag, where) that set it

    def run_started(self, run: DBORun) -> None:
        self._tags = {ub.id: [] for ub in run.ubatches}
        self._where = {ub.id: [] for ub in run.ubatches}
        self._first = []

    def stepped(self, ub: UBatch, request: object) -> None:
        if request is not SWITCH:
            return
        seq = self._tags[ub.id]
        pos = len(seq)
        where = _at(ub)
        seq.append(ub.tag)
        self._where[ub.id].append(where)
        if pos == len(self._first):
            self._first.append((ub.id, ub.tag, where))
            return
        ref_ub, ref_tag, ref_where = self._first[pos]
        if ub.tag != ref_tag:
            raise YieldMismatchError(
                f"yield mismatch in run {ub.run.name!r}: ubatch {ub.id} yield #{pos} is {ub.tag!r}{where} but "
                f"ubatch {ref_ub} yield #{pos} was {ref_tag!r}{ref_where}. Sequences so far: {self._sequences()}. "
                "Every ubatch should pass the same yield points in the same order; check the branches "
                "that skip or add a yield for one ubatch."
            )

    def run_finished(self, run: DBORun, exc: BaseException | None) -> None:
        if exc is not None:
            return
        counts = {i: len(seq) for i, seq in self._tags.items() if seq}
        if len(set(counts.values())) <= 1:
            return
        longest = max(counts, key=lambda i: (counts[i], -i))
        short = min(counts, key=lambda i: (counts[i], i))
        nxt = self._tags[longest][counts[short]]
        nxt_where = self._where[longest][counts[short]]
        last = self._where[short][-1]
        raise YieldMismatchError(
            f"yield mismatch in run {run.name!r}: ubatch {short} finished after {counts[short]} yields (the last "
            f"one{last}) but ubatch {longest} made {counts[longest]} (its yield #{counts[short]} was {nxt!r}{nxt_where}). "
            f"Sequences: {self._sequences()}. A ubatch that stops yielding early leaves the others "
            "without a partner to overlap with."
        )

    def _sequences(self) -> str:
        return "; ".join(f"ubatch {i}: {seq}" for i, seq in self._tags.items())


def _at(ub: UBatch) -> str:
    """`` at file:line in func`` of the user's code where ``ub`` is suspended ('' if unknown)."""
    frame = user_frame(ub)
    return f" at {frame.filename}:{frame.lineno} in {frame.name}" if frame is not None else ""


def _where(ub: UBatch) -> str:
    frame = user_frame(ub)
    return "start" if frame is None else f"{frame.filename}:{frame.lineno} in {frame.name}"


#: The blocking detector's wall clock (a module attribute, so a test can put its own clock here).
_wall = time.perf_counter


class _ThreadTimes:
    """This thread's CPU time and the time it waited for a CPU while runnable, in seconds, from
    ``/proc/thread-self/schedstat`` (Linux); elsewhere ``time.thread_time`` and no wait time."""

    def __init__(self) -> None:
        import os

        self._os = os
        try:
            self._fd: int | None = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> tuple[float, float]:
        if self._fd is None:
            return time.thread_time(), 0.0
        cpu_ns, runq_ns, _ = self._os.pread(self._fd, 128, 0).split()
        return int(cpu_ns) * 1e-9, int(runq_ns) * 1e-9

    def close(self) -> None:
        if self._fd is not None:
            self._os.close(self._fd)
            self._fd = None


class BlockingDetector(Instrument):
    """Reports steps that block the CPU for more than ``threshold_s``.

    A step is blocked for its wall time less the time its thread waited for a CPU while runnable
    (a loaded machine preempts it: that is not the step's doing), and, on the host backend, less
    the CPU time it used: there the CPU *is* the compute stream, so time on the CPU is compute and
    only time off it (a sleep, a lock, a wait) is blocking. On a device backend the CPU only
    launches work, so a long step is a blocked one whether it sleeps or spins (a device sync
    spin-waits). Findings are reports (a log warning, ``RunStats.blocking``, spans marked in traces
    and timelines), never errors."""

    def __init__(self, threshold_s: float) -> None:
        self.threshold_s = threshold_s
        self.found: list[BlockingStep] = []
        self._open: dict[int, tuple[float, float, float, float, str | None, str]] = {}
        self._host = True
        self._times = _ThreadTimes()
        self._watch: Any = None  # the step's HostSyncs (device backends), entered at resuming
        self._device_only = False

    def run_started(self, run: DBORun) -> None:
        self.found = []
        self._open = {}
        backend = run.ext.backend
        self._host = backend.install_stream is None  # no device stream: compute is the CPU
        # On a real accelerator only its tensors sync; a stand-in's CPU tensors play the device's.
        self._device_only = not getattr(backend, "stand_in", False)
        self._clock = run.clock

    def resuming(self, ub: UBatch) -> None:
        if not self._host:  # what the step syncs on, said in the warning (torch is there: a device backend)
            from ..syncs import HostSyncs

            self._watch = HostSyncs(device_only=self._device_only).__enter__()
        cpu, runq = self._times.read()
        self._open[ub.id] = (_wall(), cpu, runq, self._clock.now(), ub.tag, _where(ub))

    def _close_watch(self) -> tuple[str, ...] | None:
        watch, self._watch = self._watch, None
        if watch is None:
            return None
        watch.__exit__(None, None, None)
        return tuple(str(r) for r in watch.records)

    def stepped(self, ub: UBatch, request: object) -> None:
        syncs = self._close_watch()
        opened = self._open.pop(ub.id, None)
        if opened is None:
            return
        w0, cpu0, runq0, t0, from_tag, from_where = opened
        wall = _wall() - w0
        cpu, runq = self._times.read()
        blocked = wall - (runq - runq0) - ((cpu - cpu0) if self._host else 0.0)
        if blocked > self.threshold_s:
            step = BlockingStep(ub.id, from_tag, ub.tag if request is not None else "exit", from_where,
                                _where(ub) if request is not None else "exit", wall, blocked, t0, self._clock.now(),
                                cpu - cpu0, runq - runq0, self._host, syncs)
            self.found.append(step)
            ub.run.ext.blocking.append(step)  # now: a tracer reads them when the run finishes
            log.warning("%s", step.describe())

    def run_finished(self, run: DBORun, exc: BaseException | None) -> None:
        self._close_watch()  # a step that raised never reached stepped: its watch is still on top
        self._times.close()


def debug_instruments(mode: DebugMode) -> list[Instrument]:
    """The instruments debug mode adds to a run (the first call in a process also pays the
    one-time set-up of :func:`prepare_dispatch_mode`, before the run starts)."""
    prepare_dispatch_mode()
    from .stream_guard import StreamContextGuard

    insts: list[Instrument] = [CommGuard(), YieldChecker(), StreamContextGuard()]
    if mode.blocking_s is not None:
        # First: its per-step sync watch sits above CommGuard's run-long dispatch mode, so at the
        # end of a run that failed mid-step it must leave the mode stack before CommGuard does.
        insts.insert(0, BlockingDetector(mode.blocking_s))
    return insts
