"""The kernel: a round-robin driver of ubatch coroutines, its traps, its per-ubatch record, its
clock, its instrument hooks, its errors and its stack printer.

Nothing here imports torch or knows about streams, events, comm or models; everything else in
asyncdbo is built on this package's names (curio's rule: new features go outside the kernel).
"""

from .clock import Clock, MonotonicClock, VirtualClock
from .errors import (
    AsyncDBOError,
    AsyncDBOException,
    DBOUsageError,
    DeadlockError,
    DuplicateEventError,
    MissingAwaitError,
    RecvHookOverwriteError,
    UnsubmittedCommError,
    WrongStreamError,
    NoOverlapWarning,
    WatchdogTimeout,
    YieldMismatchError,
)
from .extensions import load_extension
from .instrument import Fanout, Instrument
from .kernel import LIVE_RUNS, LOOP_POLL_S, DBORun
from .stacks import Frame, await_chain, format_run, format_ubatch, from_the_ubatch, user_frame
from .traps import SWITCH, Signal, switch, trap
from .ubatch import UBatch, UBatchState, current_ubatch, get_ubatch

__all__ = [
    "LIVE_RUNS",
    "LOOP_POLL_S",
    "SWITCH",
    "AsyncDBOError",
    "AsyncDBOException",
    "Clock",
    "DBORun",
    "DBOUsageError",
    "DeadlockError",
    "DuplicateEventError",
    "Fanout",
    "Frame",
    "Instrument",
    "MissingAwaitError",
    "MonotonicClock",
    "NoOverlapWarning",
    "RecvHookOverwriteError",
    "Signal",
    "UBatch",
    "UBatchState",
    "UnsubmittedCommError",
    "VirtualClock",
    "WatchdogTimeout",
    "WrongStreamError",
    "YieldMismatchError",
    "await_chain",
    "current_ubatch",
    "format_run",
    "format_ubatch",
    "from_the_ubatch",
    "get_ubatch",
    "load_extension",
    "switch",
    "trap",
    "user_frame",
]
