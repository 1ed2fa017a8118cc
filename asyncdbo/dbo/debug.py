"""Debug mode of a DBO run (``run_ubatches(..., debug=True)``): checks that cost time per yield.

* every dropped awaitable is an error naming the line that created it (:mod:`asyncdbo.dbo.awaits`);
* the yield discipline (:class:`YieldChecker`, below);
* blocking code between two yields (:class:`BlockingDetector`): a ``time.sleep``, a lock, an
  ``.item()`` that waits for the device, reported with the yield points around it and kept in the
  run's stats and traces;
* two ubatches issuing collectives on one process group (:class:`CommGuard`): an error
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
from types import FrameType
from typing import Any

from .._core import (
    SWITCH,
    DBORun,
    DBOUsageError,
    Instrument,
    UBatch,
    UnsubmittedCommError,
    YieldMismatchError,
    user_frame,
)

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
    ``[t0, t1]`` on the run's clock (for traces)."""

    ub: int
    from_tag: str | None
    to_tag: str | None
    from_where: str
    to_where: str
    wall_s: float
    blocked_s: float
    t0: float
    t1: float

    def describe(self) -> str:
        return (
            f"asyncdbo: ubatch {self.ub} blocked the CPU for {self.blocked_s * 1e3:.1f} ms between yield points "
            f"{self.from_tag!r} ({self.from_where}) and {self.to_tag!r} ({self.to_where}); nothing else could run "
            "meanwhile. Look for a time.sleep, a lock, or a host sync (.item(), .tolist(), .cpu()) in that stretch."
        )


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

    def run_started(self, run: DBORun) -> None:
        self.found = []
        self._open = {}
        self._host = run.ext.backend.install_stream is None  # no device stream: compute is the CPU
        self._clock = run.clock

    def resuming(self, ub: UBatch) -> None:
        cpu, runq = self._times.read()
        self._open[ub.id] = (_wall(), cpu, runq, self._clock.now(), ub.tag, _where(ub))

    def stepped(self, ub: UBatch, request: object) -> None:
        opened = self._open.pop(ub.id, None)
        if opened is None:
            return
        w0, cpu0, runq0, t0, from_tag, from_where = opened
        wall = _wall() - w0
        cpu, runq = self._times.read()
        blocked = wall - (runq - runq0) - ((cpu - cpu0) if self._host else 0.0)
        if blocked > self.threshold_s:
            step = BlockingStep(ub.id, from_tag, ub.tag if request is not None else "exit", from_where,
                                _where(ub) if request is not None else "exit", wall, blocked, t0, self._clock.now())
            self.found.append(step)
            ub.run.ext.blocking.append(step)  # now: a tracer reads them when the run finishes
            log.warning("%s", step.describe())

    def run_finished(self, run: DBORun, exc: BaseException | None) -> None:
        self._times.close()


class CommGuard(Instrument):
    """Debug mode's checks of the collectives a run's ubatches issue, through one torch dispatch
    mode active while the run lasts (it sees every ``c10d`` op before it is issued):

    * **two ubatches on one process group** fail the run before the second one's collective is
      issued. Collectives on one group must be issued in the same order on every rank; under DBO
      the order of different ubatches' collectives is timing (a ubatch parked on comm is
      skipped), so every ubatch slot needs its own clone of the group
      (:func:`asyncdbo.ubatch_groups`). Gloo aborts the whole process, from C++, when two ranks
      pair different ubatches' collectives, so this checks before each collective is issued.
    * **an async collective the scheduler does not know about**: one issued with
      ``async_op=True`` (or an ``isend``/``irecv``) whose work does not reach
      :func:`~asyncdbo.dbo.dbo_submit` before its ubatch next yields, parks or returns fails the
      run there, naming the line that issued it. The scheduler waits only for works it was
      handed: the output of any other is read before it arrived (before this check, such a layer
      on 2 gloo ranks differed from serial in 9 of 10 DBO rank-steps, silently). An op that
      takes such an output as an argument before then fails at once (a ``.tolist()`` is no op
      the mode sees: an error raised after it gets a note naming the collective instead)."""

    def __init__(self) -> None:
        self._mode: Any = None
        self._pending: dict[int, PendingComm] = {}

    def run_started(self, run: DBORun) -> None:
        try:
            from torch.utils._python_dispatch import TorchDispatchMode as _Mode
        except ImportError:  # no torch, no collectives to check (the kernel and primitives run without it)
            return

        from .._core import get_ubatch

        mode_base: Any = _Mode  # torch's class is untyped

        users: dict[str, int] = {}
        n = len(run.ubatches)
        pending = self._pending = run.ext.unsubmitted = {}

        class _Guard(mode_base):  # type: ignore[misc]
            def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
                kwargs = kwargs or {}
                if func.namespace == "c10d":
                    ub = get_ubatch()
                    if ub is not None and ub.run is run:
                        _check_group(func, args, ub, users, n)
                        out = func(*args, **kwargs)
                        _note_async(func, args, kwargs, out, ub, pending)
                        return out
                elif pending:
                    ub = get_ubatch()
                    if ub is not None and ub.run is run:
                        _check_reads(func, args, kwargs, ub, pending)
                return func(*args, **kwargs)

        self._mode = _Guard()
        self._mode.__enter__()

    def stepped(self, ub: UBatch, request: object) -> None:
        if self._pending:
            left = [p for p in self._pending.values() if p.ub == ub.id]
            if left:
                self._pending.clear()  # reported: the run ends here
                raise UnsubmittedCommError(_unsubmitted_message(ub, left, request))

    def run_finished(self, run: DBORun, exc: BaseException | None) -> None:
        left = list(self._pending.values())
        self._pending.clear()  # releases the works
        if exc is not None and left and isinstance(exc, Exception):
            for p in left:
                exc.add_note(
                    f"asyncdbo: when this was raised, ubatch {p.ub} had issued {p.op} with async_op=True at "
                    f"{p.site} and not handed its work to dbo_submit: its output was not ready to read"
                )
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None


SharedGroupGuard = CommGuard
"""The name :class:`CommGuard` had while it only checked shared groups."""


@dataclass(eq=False)
class PendingComm:
    """An async collective issued in a debug-mode run and not yet handed to dbo_submit: its work
    (kept, so that dbo_submit finds it by ``id``), the issuing ubatch, the op, where the user's
    code issued it, and the storages it writes."""

    work: Any
    ub: int
    op: str
    site: str
    writes: frozenset[int]


_TORCH_DIR: str | None = None
# c10d ops without an async_op argument: the point-to-point ones. dist.isend/irecv (and
# batch_isend_irecv) hand their work back; dist.send/recv wait for it at once.
_P2P_OPS = frozenset({"send", "recv_", "recv_any_source_"})
_SYNC_P2P = frozenset({"send", "recv"})
_ASYNC_ARG: dict[Any, int | None] = {}
# ops that read no tensor data of their arguments (views and factories that take only the metadata)
_NO_READ = frozenset({"empty_like", "new_empty", "new_empty_strided", "zeros_like", "ones_like", "full_like",
                      "rand_like", "randn_like", "randint_like", "detach", "lift_fresh", "alias"})


def _async_index(func: Any) -> int | None:
    """Position of ``async_op`` in ``func``'s schema (None: it has none)."""
    try:
        return _ASYNC_ARG[func]
    except KeyError:
        names = [a.name for a in func._schema.arguments]
        idx = _ASYNC_ARG[func] = names.index("async_op") if "async_op" in names else None
        return idx


def _is_async(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    import sys

    idx = _async_index(func)
    if idx is not None:
        value = args[idx] if idx < len(args) else kwargs.get("async_op", True)
        return bool(value)
    if func._schema.name.split("::")[-1] not in _P2P_OPS:
        return False  # a barrier without a work (monitored_barrier_): it returns when done
    # The outermost torch.distributed function on the stack says: dist.send/recv wait for the work
    # (they call isend/irecv), dist.isend/irecv and batch_isend_irecv hand it back.
    outermost = None
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.endswith("distributed_c10d.py"):
            outermost = frame.f_code.co_name
        elif outermost is not None and "distributed" not in name:
            break  # left torch.distributed (its c10d_logger wrappers sit between its functions)
        frame = frame.f_back
    return outermost not in _SYNC_P2P


def _issuing_site() -> str:
    """``file:line in func`` of the innermost frame outside torch and this module: the user's
    line that issued the collective."""
    import sys

    global _TORCH_DIR
    if _TORCH_DIR is None:
        import os

        import torch

        _TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_TORCH_DIR) and name != __file__:
            return f"{name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "an unknown line"


def _storages(value: Any) -> frozenset[int]:
    import torch

    from torch.utils._pytree import tree_leaves

    return frozenset(
        ptr for t in tree_leaves(value) if isinstance(t, torch.Tensor) and (ptr := t.untyped_storage().data_ptr())
    )


def _note_async(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, ub: UBatch,
                pending: dict[int, PendingComm]) -> None:
    """Remember the work of an async collective until dbo_submit takes it."""
    import torch

    if not _is_async(func, args, kwargs):
        return
    boxed = out if isinstance(out, torch.ScriptObject) else next(
        (o for o in (out if isinstance(out, (tuple, list)) else ()) if isinstance(o, torch.ScriptObject)), None)
    if boxed is None:
        return
    # The same Python object dist hands back (pybind keeps one wrapper per C++ work while it lives).
    work = torch._C._distributed_c10d.Work.unbox(boxed)
    short = func._schema.name.split("::")[-1]
    writes = frozenset() if short == "send" else _storages(args[0] if args else ())
    pending[id(work)] = PendingComm(work, ub.id, f"c10d.{short}", _issuing_site(), writes)


def _check_reads(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ub: UBatch,
                 pending: dict[int, PendingComm]) -> None:
    """Fail an op that reads (or writes) the output of a collective nobody waits for yet."""
    if func.is_view or func._schema.name.split("::")[-1] in _NO_READ:
        return
    touched = _storages((args, kwargs))
    if not touched:
        return
    for p in pending.values():
        if p.writes & touched:
            raise UnsubmittedCommError(
                f"ubatch {ub.id} used the output of {p.op} (issued with async_op=True at {p.site}) in {func} before "
                "handing its work to dbo_submit: nothing waited for it, so the data is not there yet. Pass the work "
                "to asyncdbo.dbo_submit(work, ...) right after issuing it, and await the handle (or a "
                "comm->compute switch) before reading the output."
            )


def _unsubmitted_message(ub: UBatch, left: list[PendingComm], request: object) -> str:
    if request is SWITCH:
        how = f"yielded at {ub.tag!r}"
    elif request is None:
        how = "returned"
    else:
        how = f"parked on {getattr(request, 'name', request)!r}"
    issued = "; ".join(f"{p.op} at {p.site}" for p in left)
    return (
        f"ubatch {ub.id} {how} with {len(left)} async collective(s) not handed to dbo_submit: {issued}. The scheduler "
        "waits only for the works it knows, so this ubatch would read their output before it arrived (wrong numbers, "
        "or garbage split sizes). Pass each work to asyncdbo.dbo_submit(work, ...) right after issuing it, "
        "and await the handle (or a comm->compute switch) before reading the output."
    )


def _check_group(func: Any, args: tuple[Any, ...], ub: UBatch, users: dict[str, int], n: int) -> None:
    import torch

    for a in args:
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a):
            name = torch._C._distributed_c10d.ProcessGroup.unbox(a).group_name
            first = users.setdefault(name, ub.id)
            if first != ub.id:
                frame = user_frame(ub)
                where = f" ({frame.filename}:{frame.lineno} in {frame.name})" if frame is not None else ""
                raise DBOUsageError(  # a RuntimeError, as it was before it had a name
                    f"ubatches {first} and {ub.id} both issue collectives on process group {name!r} in one run"
                    f"{where}: their order across ranks is timing, and gloo aborts the process when ranks pair "
                    f"different ubatches' collectives. Call asyncdbo.ubatch_groups({n}, group) once on every rank "
                    "before the run, and issue each ubatch's collectives on asyncdbo.ubatch_group(group)."
                )


_dispatch_mode_ready = False


def prepare_dispatch_mode() -> float:
    """Pay, once per process, what the first torch op under a dispatch mode costs; return the
    seconds it took (0 after the first call).

    torch wraps every ``TorchDispatchMode.__torch_dispatch__`` in a ``torch._dynamo.disable``
    that is resolved on its first call by importing torch._dynamo: about 2.3 s of CPU time on a
    2-core machine, once per process. :class:`CommGuard` is such a mode, so without this
    the first debug run's first ubatch step paid it, and a Tracer counted it as that step's
    compute. :func:`debug_instruments` calls this before the run starts, outside every step.
    Without torch there is no dispatch mode to prepare (the guard checks nothing then): 0."""
    global _dispatch_mode_ready
    if _dispatch_mode_ready:
        return 0.0
    try:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:  # no torch: CommGuard is inert, and so is this (the kernel and primitives run without it)
        _dispatch_mode_ready = True
        return 0.0

    t0 = time.perf_counter()

    mode_base: Any = TorchDispatchMode  # torch's class is untyped

    class _Once(mode_base):  # type: ignore[misc]
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    with _Once():
        torch.empty(0)
    _dispatch_mode_ready = True
    took = time.perf_counter() - t0
    log.info("asyncdbo debug mode: %.2f s of one-time set-up (torch's dispatch-mode machinery), "
             "paid before the run, outside its steps", took)
    return took


def debug_instruments(mode: DebugMode) -> list[Instrument]:
    """The instruments debug mode adds to a run (the first call in a process also pays the
    one-time set-up of :func:`prepare_dispatch_mode`, before the run starts)."""
    prepare_dispatch_mode()
    from .stream_guard import StreamContextGuard

    insts: list[Instrument] = [CommGuard(), YieldChecker(), StreamContextGuard()]
    if mode.blocking_s is not None:
        insts.append(BlockingDetector(mode.blocking_s))
    return insts
