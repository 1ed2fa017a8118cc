"""asyncdbo: Dual Batch Overlap for MoE inference on asyncio coroutines.

Write a microbatch forward as ``async def``, mark yield points with the ``dbo_*`` primitives, and
``await run_ubatches(forward, [(ub0_inputs,), (ub1_inputs,)])``: the ubatches take turns on one OS
thread while streams (or gloo async work on a CPU) keep device work ordered.

The top level holds the entry points, vLLM's primitives and asyncdbo's extensions, the options
and the errors. Everything else lives in its subpackage (imports point down this list):

=================  ================================================================================
``_core``          the kernel: round-robin driver, traps, per-ubatch record, clock, errors
``backends``       stream backends (host, accelerator) and their typed per-ubatch state
``syncs``          the host-sync detector: the torch ops that would make the host wait
``dbo``            the primitives, named events, recv hooks, ``run``/``run_ubatches``
``dist``           per-ubatch process groups, the expert-parallel all-to-all
``plan``           when and where to cut a batch into ubatches, across DP ranks
``moe``            the async MoE layer and Hugging Face weight import
``serving``        the runner (plan, run, merge), batches, the paged KV cache
``models``         the reference model(s)
``observe``        tracer, numbers, Chrome export, PNG timelines, stack dumps
``sim``            the simulated device: virtual streams, cost model, race checker, predictions
``testing``        yield assertions, pools of real ranks, a virtual clock
``cli``            ``asyncdbo demo | trace | check``
=================  ================================================================================

``import asyncdbo`` imports no torch: the packages that need it load on first use.
"""

from typing import Any

from . import _compat
from ._core import (
    AsyncDBOError,
    AsyncDBOException,
    DBOUsageError,
    DeadlockError,
    NoOverlapWarning,
    WatchdogTimeout,
    YieldMismatchError,
)
from .dbo import (
    DBOOptions,
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
    prepare_run,
    run,
    run_ubatches,
    run_ubatches_with_stats,
)
from .backends.registry import register_backend as _register_backend
from .dist.groups import ubatch_group, ubatch_groups
from .observe.stacks import dump_stacks

__version__ = "0.2.0"

_compat.install()
# The simulated device lives above the backends, so the top level (which sees every room) names it
# for get_backend("sim"); it is imported only when chosen.
_register_backend("sim", "asyncdbo.sim.backend:SimBackend")


def __getattr__(name: str) -> Any:
    if name in _compat.MOVED_NAMES:
        value = _compat.moved_name(name)
        return value
    raise AttributeError(f"module 'asyncdbo' has no attribute {name!r}")


__all__ = [
    "AsyncDBOError",
    "AsyncDBOException",
    "DBOOptions",
    "DBOUsageError",
    "DeadlockError",
    "NoOverlapWarning",
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
    "dump_stacks",
    "prepare_run",
    "run",
    "run_ubatches",
    "run_ubatches_with_stats",
    "ubatch_group",
    "ubatch_groups",
]
