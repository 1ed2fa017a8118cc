"""What a rank's failed step says, for tests where every rank runs the same failing program.

Each rank fails the step with its own error, unless a faster peer posted the same failure first:
then this rank's next poll or its run's start raises :class:`StepAborted`, whose reason is the
peer's error line (see ``asyncdbo/dist/recovery.py``). Which rank posts first is timing (a loaded
machine decides it), so a test of the error's text reads it through :func:`error_line`.
"""

from __future__ import annotations

from asyncdbo.dist.recovery import StepAborted


def error_line(exc: BaseException) -> str:
    """The first line of the step's error: this rank's own, or the peer's that ``exc`` names."""
    return error_kind_and_line(exc)[1]


def error_kind_and_line(exc: BaseException) -> tuple[str, str]:
    """The step error's type name and first line: this rank's own, or the peer's that ``exc``
    names (a RuntimeError or one of asyncdbo's named kinds of it)."""
    if isinstance(exc, StepAborted):
        kind, sep, line = exc.reason.partition(": ")
        assert sep and kind in ("RuntimeError", "DBOUsageError", "UnsubmittedCommError"), f"the peer failed differently: {exc.reason!r}"
        return kind, line
    return type(exc).__name__, str(exc).split("\n")[0]
