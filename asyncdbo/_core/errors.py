"""Errors raised by the DBO loop.

User mistakes are ``ValueError``/``TypeError`` with the bad value and the fix in the message;
failures of a run (deadlock, watchdog, a crashed ubatch) are :class:`AsyncDBOError` subclasses so a
serving loop can catch "the DBO step failed" in one ``except``.
"""

from __future__ import annotations

__all__ = [
    "AsyncDBOError",
    "DeadlockError",
    "WatchdogTimeout",
    "NoOverlapWarning",
    "YieldMismatchError",
]


class AsyncDBOError(Exception):
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


class NoOverlapWarning(RuntimeWarning):
    """A run of two or more ubatches finished without a single yield: nothing could overlap."""


# Tracebacks and reprs name the path users import (``asyncdbo.DeadlockError``), not this private
# module: the class's module is what Python prints before the message.
for _cls in (AsyncDBOError, DeadlockError, WatchdogTimeout, YieldMismatchError, NoOverlapWarning):
    _cls.__module__ = "asyncdbo"
del _cls
