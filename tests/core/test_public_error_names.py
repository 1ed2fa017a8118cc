"""Errors print the names users import: ``asyncdbo.DeadlockError``, not a private module path."""

from __future__ import annotations


def test_errors_print_their_public_names() -> None:
    """A traceback's last line names the class by the path users import, not a private module."""
    import traceback

    import asyncdbo
    from asyncdbo.dist import StepAborted
    from asyncdbo.sim import SimCheckError
    from asyncdbo.testing import RankError

    for cls, public in ((asyncdbo.DeadlockError, "asyncdbo.DeadlockError"),
                        (asyncdbo.WatchdogTimeout, "asyncdbo.WatchdogTimeout"),
                        (asyncdbo.YieldMismatchError, "asyncdbo.YieldMismatchError"),
                        (asyncdbo.AsyncDBOError, "asyncdbo.AsyncDBOError"),
                        (asyncdbo.NoOverlapWarning, "asyncdbo.NoOverlapWarning"),
                        (StepAborted, "asyncdbo.dist.StepAborted"),
                        (SimCheckError, "asyncdbo.sim.SimCheckError"),
                        (RankError, "asyncdbo.testing.RankError")):
        assert f"{cls.__module__}.{cls.__qualname__}" == public
        if cls in (asyncdbo.DeadlockError, asyncdbo.YieldMismatchError):
            line = traceback.format_exception_only(cls("boom"))[-1]
            assert line == f"{public}: boom\n"
