"""Errors raised by the DBO loop, and the root of every asyncdbo exception.

:class:`AsyncDBOException` is the one root: every exception class asyncdbo defines derives from
it (tests/layout/test_error_root.py checks each), and each keeps the builtin base it had before it
had that root (a usage error is a ``RuntimeError``, a non-finite logit an ``ArithmeticError``), so
``except RuntimeError`` keeps working. Under it, :class:`AsyncDBOError` means "the run failed"
for a reason other than the code, :class:`DBOUsageError` "the code used a primitive wrongly".
Warnings derive from the builtin warning categories only.

User mistakes are ``ValueError``/``TypeError`` with the bad value and the fix in the message where
they can be checked at the call. A mistake that only shows while the ubatches run (a primitive not
awaited, a switch from the wrong stream, a named event recorded twice, a recv hook that would be
lost; in debug mode, two ubatches issuing collectives on one process group, or an async collective
not handed to ``dbo_submit``) is a :class:`DBOUsageError` (its kinds are public in ``asyncdbo.dbo``): a ``RuntimeError``, which is what
these were before they had names, so existing ``except RuntimeError`` keeps working. Failures of a run (deadlock, watchdog, a
crashed ubatch) are :class:`AsyncDBOError` subclasses so a serving loop can catch "the DBO step
failed" in one ``except``; ``except AsyncDBOException`` catches anything asyncdbo raised of its own.
"""

from __future__ import annotations

__all__ = [
    "AsyncDBOError",
    "AsyncDBOException",
    "DBOUsageError",
    "DeadlockError",
    "DuplicateEventError",
    "MissingAwaitError",
    "RecvHookOverwriteError",
    "UnsubmittedCommError",
    "WrongStreamError",
    "WatchdogTimeout",
    "NoOverlapWarning",
    "YieldMismatchError",
]


class AsyncDBOException(Exception):
    """The root of every exception asyncdbo defines: failures of a DBO run (:class:`AsyncDBOError`),
    usage errors (:class:`DBOUsageError`, also a ``RuntimeError``), and the errors of the layers
    above (a step aborted for a peer's failure, a host sync, a rank's error...)."""


class AsyncDBOError(AsyncDBOException):
    """Base class for failures of a DBO run."""


class DeadlockError(AsyncDBOError):
    """Every live ubatch waits on something no ubatch can ever produce.

    The message carries each ubatch's await chain (file:line) and what it is parked on.
    """


class WatchdogTimeout(AsyncDBOError):
    """A DBO run made no progress for longer than its watchdog allows.

    Raised instead of hanging when ubatches wait on outside events (a collective whose peer died,
    a future nobody completes). The message carries every ubatch's await chain.
    """


class YieldMismatchError(AsyncDBOError):
    """The ubatches of one run passed different sequences of yield tags (checked in debug mode)."""


class DBOUsageError(AsyncDBOException, RuntimeError):
    """A ubatch used a DBO primitive the wrong way; the message names the ubatch, the place and the fix."""


class MissingAwaitError(DBOUsageError):
    """A primitive whose skipping is a data hazard (a stream switch, an event wait) was called
    without ``await`` (or any primitive, in debug mode)."""


class WrongStreamError(DBOUsageError):
    """A switch primitive was called from the stream it switches to (``dbo_switch_to_comm`` while
    already on comm): the order of switches in the layer is wrong."""


class DuplicateEventError(DBOUsageError):
    """``dbo_record_event`` was called twice with one key in one run."""


class RecvHookOverwriteError(DBOUsageError):
    """A ubatch registered a recv hook on a ubatch that still holds an unrun hook of its own."""


class UnsubmittedCommError(DBOUsageError):
    """In debug mode, a ubatch yielded, parked or returned while an async collective it issued was
    not handed to ``dbo_submit``, or read that collective's output before it was."""


class NoOverlapWarning(RuntimeWarning):
    """A run of two or more ubatches finished without a single yield: nothing could overlap."""


# Tracebacks and reprs name the path users import (``asyncdbo.DeadlockError``), not this private
# module: the class's module is what Python prints before the message.
for _cls in (AsyncDBOException, AsyncDBOError, DeadlockError, WatchdogTimeout, YieldMismatchError, NoOverlapWarning, DBOUsageError):
    _cls.__module__ = "asyncdbo"
# The kinds of DBOUsageError are public in the DBO layer, where the primitives that raise them live
# (the top level stays small: tests/layout/test_old_paths.py).
for _cls in (MissingAwaitError, WrongStreamError, DuplicateEventError, RecvHookOverwriteError, UnsubmittedCommError):
    _cls.__module__ = "asyncdbo.dbo"
del _cls
