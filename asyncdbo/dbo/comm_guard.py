"""Debug mode's checks of the collectives a run's ubatches issue (:class:`CommGuard`): two
ubatches issuing collectives on one process group, and an async collective whose work is not
handed to ``dbo_submit`` before its ubatch next yields, parks or returns. One torch dispatch mode
sees every ``c10d`` op before it is issued; :func:`prepare_dispatch_mode` pays that mode's
one-time set-up before a run. Part of debug mode (:mod:`asyncdbo.dbo.debug`).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

from .._core import SWITCH, DBORun, DBOUsageError, Instrument, UBatch, UnsubmittedCommError, user_frame

__all__ = ["CommGuard", "PendingComm", "SharedGroupGuard", "prepare_dispatch_mode"]

log = logging.getLogger("asyncdbo")


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
