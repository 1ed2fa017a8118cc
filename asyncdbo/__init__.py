"""asyncdbo: Dual Batch Overlap for MoE inference on asyncio coroutines.

Write a microbatch forward as ``async def``, mark yield points with the ``dbo_*`` primitives, and
``await run_ubatches(forward, [(ub0_inputs,), (ub1_inputs,)])``: the ubatches take turns on one OS
thread while streams (or gloo async work on a CPU) keep device work ordered.
"""

from ._core import (
    AsyncDBOError,
    DeadlockError,
    Instrument,
    NoOverlapWarning,
    Signal,
    WatchdogTimeout,
    YieldMismatchError,
)
from .loop import DBOOptions, run, run_ubatches
from .primitives import (
    RecvHookHandle,
    dbo_current_ubatch_id,
    dbo_enabled,
    dbo_get_previous_event,
    dbo_maybe_run_recv_hook,
    dbo_num_ubatches,
    dbo_record_event,
    dbo_register_recv_hook,
    dbo_submit,
    dbo_switch_to_comm,
    dbo_switch_to_comm_sync,
    dbo_switch_to_compute,
    dbo_switch_to_compute_sync,
    dbo_wait_event,
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
)
from .streams import LinkSpec, StreamBackend, get_backend, link_spec

__version__ = "0.1.0"

__all__ = [
    "AsyncDBOError",
    "DBOOptions",
    "DeadlockError",
    "Instrument",
    "LinkSpec",
    "NoOverlapWarning",
    "RecvHookHandle",
    "Signal",
    "StreamBackend",
    "WatchdogTimeout",
    "YieldMismatchError",
    "dbo_current_ubatch_id",
    "dbo_enabled",
    "dbo_get_previous_event",
    "dbo_maybe_run_recv_hook",
    "dbo_num_ubatches",
    "dbo_record_event",
    "dbo_register_recv_hook",
    "dbo_submit",
    "dbo_switch_to_comm",
    "dbo_switch_to_comm_sync",
    "dbo_switch_to_compute",
    "dbo_switch_to_compute_sync",
    "dbo_wait_event",
    "dbo_yield",
    "dbo_yield_and_switch_from_comm_to_compute",
    "dbo_yield_and_switch_from_compute_to_comm",
    "get_backend",
    "link_spec",
    "run",
    "run_ubatches",
]
