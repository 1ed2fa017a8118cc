"""Debug mode's stream check (``run_ubatches(..., debug=True)``): a ubatch must hand over on the
stream the run made current for it.

The kernel installs a ubatch's stream on resume only when it differs from the one it installed
last (:attr:`asyncdbo._core.DBORun.installed`), the per-switch cost it avoids. Code that makes
another stream current and yields before putting it back (a ``with torch.cuda.stream(s):`` block
that spans an ``await dbo_*``, or a bare ``set_stream``) therefore leaves that stream current for
the next ubatch, whose kernels then run on ``s``: out of order with its own stream's work, racing
with it, and nothing on a real GPU says so. :class:`StreamContextGuard` compares the current
stream with the installed one each time a ubatch suspends and raises
:class:`~asyncdbo.DBOUsageError` naming the line where it did. Under the fake device the same
mistake is also reported where the next ubatch's first kernel lands
(:mod:`asyncdbo.testing.fake_device`). Why it is not repaired silently: docs/troubleshooting.md.
"""

from __future__ import annotations

import sys

from .._core import DBOUsageError, Instrument, UBatch, user_frame

__all__ = ["StreamContextGuard"]


class StreamContextGuard(Instrument):
    """Raises :class:`DBOUsageError` when a ubatch yields or parks with a current stream other
    than the one its run installed. Only for runs whose installed objects are torch streams (an
    accelerator backend, or the fake device's streams); a host run installs nothing."""

    def stepped(self, ub: UBatch, request: object) -> None:
        run = ub.run
        installed = run.installed
        torch = sys.modules.get("torch")
        if installed is None or torch is None or not isinstance(installed, torch.Stream):
            return
        current = torch.accelerator.current_stream()
        if current == installed:
            return
        frame = user_frame(ub)
        where = f"{frame.filename}:{frame.lineno} in {frame.name}" if frame is not None else "its start"
        raise DBOUsageError(
            f"stream context held across a yield: ubatch {ub.id} of run {run.name!r} suspended at {where} "
            f"({ub.tag!r}) with {current} current, not {installed}, the stream the run made current for it. "
            "A `with torch.cuda.stream(...)` block (or a set_stream) left open across an `await dbo_*` leaves its "
            "stream current for the next ubatch, whose kernels then run there, out of order with its own stream. "
            "Leave the block before the yield, or change streams with the dbo_switch_* primitives "
            "(docs/troubleshooting.md)."
        )
