"""Mutation helpers for the sim's mutant tests: recompile a library function from its source with
edits, keeping its file name and line numbers (so a finding points at the mutated line), and the
small helpers mutated code may call."""

from __future__ import annotations

import inspect
from typing import Any

from asyncdbo.dbo import dbo_num_ubatches, dbo_switch_to_comm_sync
from asyncdbo.lowlevel import get_ubatch

__all__ = ["EXTRA", "SHARED", "mutated"]

SHARED: dict[Any, Any] = {}  # the buffer a mutant reuses across ubatches


def _dead_wait() -> None:
    """A wait on an event that nobody records (a device hangs, or CUDA does not wait at all)."""
    lane = get_ubatch().ext
    be = lane.ub.run.ext.backend
    be.wait(lane.stream, be.new_event())


def _record_comm_now() -> Any:
    """Record this ubatch's comm done-event now (before its dispatch is issued): a stale event."""
    lane = get_ubatch().ext
    lane.ub.run.ext.backend.record(lane.events["comm"], lane.stream)
    return lane.events["comm"]


async def _wait_stale(event: Any) -> None:
    lane = get_ubatch().ext
    lane.role = "compute"
    lane.set_stream(lane.streams["compute"])
    lane.ub.run.ext.backend.wait(lane.stream, event)


EXTRA = {"_dead_wait": _dead_wait, "_record_comm_now": _record_comm_now, "_wait_stale": _wait_stale,
         "dbo_switch_to_comm_sync": dbo_switch_to_comm_sync, "dbo_num_ubatches": dbo_num_ubatches, "SHARED": SHARED}


def mutated(fn: Any, *edits: tuple[str, str]) -> Any:
    """``fn`` recompiled from its source with each ``(old, new)`` edit applied (``old`` must occur
    exactly once), keeping its file name and line numbers."""
    lines, first = inspect.getsourcelines(fn)
    src = "".join(lines)
    for old, new in edits:
        assert src.count(old) == 1, f"mutant edit {old!r} matches {src.count(old)} times in {fn.__qualname__}"
        src = src.replace(old, new)
    method = src[:1].isspace()  # a method: compile it inside a class to keep its indentation
    code = "\n" * (first - 2) + "class _Owner:\n" + src if method else "\n" * (first - 1) + src
    namespace = {**fn.__globals__, **EXTRA}
    exec(compile(code, inspect.getsourcefile(fn), "exec"), namespace)  # noqa: S102
    return namespace["_Owner"].__dict__[fn.__name__] if method else namespace[fn.__name__]
