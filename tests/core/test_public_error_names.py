"""Errors print the names users import: ``asyncdbo.DeadlockError``, not a private module path."""

from __future__ import annotations

import pytest


def test_errors_print_their_public_names() -> None:
    """A traceback's last line names the class by the path users import, not a private module."""
    import asyncdbo
    import asyncdbo.dbo
    from asyncdbo.testing import RankError

    errors = [(asyncdbo.DeadlockError, "asyncdbo.DeadlockError"),
              (asyncdbo.WatchdogTimeout, "asyncdbo.WatchdogTimeout"),
              (asyncdbo.YieldMismatchError, "asyncdbo.YieldMismatchError"),
              (asyncdbo.AsyncDBOError, "asyncdbo.AsyncDBOError"),
              (asyncdbo.AsyncDBOException, "asyncdbo.AsyncDBOException"),
              (asyncdbo.NoOverlapWarning, "asyncdbo.NoOverlapWarning"),
              (asyncdbo.DBOUsageError, "asyncdbo.DBOUsageError"),
              (asyncdbo.dbo.MissingAwaitError, "asyncdbo.dbo.MissingAwaitError"),
              (asyncdbo.dbo.WrongStreamError, "asyncdbo.dbo.WrongStreamError"),
              (asyncdbo.dbo.DuplicateEventError, "asyncdbo.dbo.DuplicateEventError"),
              (asyncdbo.dbo.RecvHookOverwriteError, "asyncdbo.dbo.RecvHookOverwriteError"),
              (asyncdbo.dbo.UnsubmittedCommError, "asyncdbo.dbo.UnsubmittedCommError"),
              (RankError, "asyncdbo.testing.RankError")]
    check(errors)
    pytest.importorskip("torch", reason="asyncdbo.dist and asyncdbo.sim need torch (CI runs tests/core without it too)")
    from asyncdbo.dist import StepAborted
    from asyncdbo.sim import SimCheckError

    check([(StepAborted, "asyncdbo.dist.StepAborted"), (SimCheckError, "asyncdbo.sim.SimCheckError")])


def check(errors: list[tuple[type, str]]) -> None:
    import traceback

    import asyncdbo

    for cls, public in errors:
        assert f"{cls.__module__}.{cls.__qualname__}" == public
        if cls in (asyncdbo.DeadlockError, asyncdbo.YieldMismatchError):
            line = traceback.format_exception_only(cls("boom"))[-1]
            assert line == f"{public}: boom\n"


def test_user_mistakes_inside_a_run_are_named_runtime_errors() -> None:
    """A mistake only the running ubatches reveal has a name of its own and stays a RuntimeError
    (what it was before it had a name), so ``except RuntimeError`` written earlier still catches it;
    it is not an AsyncDBOError, which means "the step failed" for a reason other than the code. Both
    derive from the one root, AsyncDBOException (issue 52)."""
    import asyncdbo
    from asyncdbo import dbo

    for cls in (dbo.MissingAwaitError, dbo.WrongStreamError, dbo.DuplicateEventError, dbo.RecvHookOverwriteError,
                dbo.UnsubmittedCommError):
        assert cls.__mro__[1:] == (asyncdbo.DBOUsageError, asyncdbo.AsyncDBOException, RuntimeError, Exception,
                                   BaseException, object)
        assert not issubclass(cls, asyncdbo.AsyncDBOError)
        assert cls.__doc__
