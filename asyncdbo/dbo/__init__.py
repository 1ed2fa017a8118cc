"""The DBO layer: vLLM's primitives and their extensions, and the entry points that run ubatches.

Built on the kernel (:mod:`asyncdbo._core`) and a stream backend (:mod:`asyncdbo.backends`):
:func:`run_ubatches` gives every ubatch a lane (its streams, role and pending recv hook) and the
run its state (backend, named events); the primitives read them through ``current_ubatch``.
"""

from .._core import (
    DuplicateEventError,
    MissingAwaitError,
    RecvHookOverwriteError,
    UnsubmittedCommError,
    WrongStreamError,
)
from .events import dbo_record_event, dbo_wait_event
from .hooks import RecvHookHandle, dbo_maybe_run_recv_hook, dbo_register_recv_hook
from .primitives import (
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_get_previous_event,
    dbo_num_ubatches,
    dbo_stream_policy,
    dbo_submit,
)
from .kinds import TABLE as _TABLE
from .prepared import PreparedRun, prepare_run
from .run import DBOOptions, RunStats, run, run_ubatches, run_ubatches_with_stats
from .state import Lane, RunState
from .table import *  # noqa: F403  (the yield and switch primitives: one row each, exported by their rows)

__all__ = [
    "DBOOptions",
    "DuplicateEventError",
    "Lane",
    "MissingAwaitError",
    "PreparedRun",
    "RecvHookHandle",
    "RecvHookOverwriteError",
    "RunState",
    "RunStats",
    "UnsubmittedCommError",
    "WrongStreamError",
    "dbo_current_ubatch_id",
    "dbo_enabled",
    "dbo_get_previous_event",
    "dbo_maybe_run_recv_hook",
    "dbo_num_ubatches",
    "dbo_record_event",
    "dbo_register_recv_hook",
    "dbo_stream_policy",
    "dbo_submit",
    "dbo_wait_event",
    "prepare_run",
    "run",
    "run_ubatches",
    "run_ubatches_with_stats",
]
__all__ += _TABLE  # the yield and switch primitives, by their rows
__all__.sort()
