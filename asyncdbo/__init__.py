"""asyncdbo: Dual Batch Overlap for MoE inference on asyncio coroutines.

Write a microbatch forward as ``async def``, mark yield points with the ``dbo_*`` primitives, and
``await run_ubatches(forward, [(ub0_inputs,), (ub1_inputs,)])``: the ubatches take turns on one OS
thread while streams (or gloo async work on a CPU) keep device work ordered.
"""

import importlib
from typing import TYPE_CHECKING, Any

from ._core import (
    AsyncDBOError,
    DeadlockError,
    Instrument,
    NoOverlapWarning,
    Signal,
    WatchdogTimeout,
    YieldMismatchError,
)
from .debug import dump_stacks, install_stack_dump_signal
from .groups import ubatch_group, ubatch_groups
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

# Names from the torch-heavy parts (MoE layer, model runner, planning, tracing, launcher) load on
# first use, so `import asyncdbo` stays light for code that only needs the DBO loop.
_LAZY = {
    "MoEConfig": "asyncdbo.moe",
    "MoELayer": "asyncdbo.moe",
    "moe_from_hf": "asyncdbo.hf",
    "AttentionMetadata": "asyncdbo.plan",
    "PlanReason": "asyncdbo.plan",
    "PlanStats": "asyncdbo.plan",
    "StepPlan": "asyncdbo.plan",
    "StepRecord": "asyncdbo.plan",
    "UBatchSlice": "asyncdbo.plan",
    "plan_step": "asyncdbo.plan",
    "DBORunner": "asyncdbo.runner",
    "RunnerConfig": "asyncdbo.runner",
    "RunNumbers": "asyncdbo.trace",
    "Tracer": "asyncdbo.trace",
    "RankPool": "asyncdbo.launch",
    "run_ranks": "asyncdbo.launch",
}

if TYPE_CHECKING:
    from .hf import moe_from_hf
    from .launch import RankPool, run_ranks
    from .moe import MoEConfig, MoELayer
    from .plan import (
        AttentionMetadata,
        PlanReason,
        PlanStats,
        StepPlan,
        StepRecord,
        UBatchSlice,
        plan_step,
    )
    from .runner import DBORunner, RunnerConfig
    from .trace import RunNumbers, Tracer


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncdbo' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "AsyncDBOError",
    "AttentionMetadata",
    "DBOOptions",
    "DBORunner",
    "DeadlockError",
    "Instrument",
    "LinkSpec",
    "MoEConfig",
    "MoELayer",
    "NoOverlapWarning",
    "PlanReason",
    "PlanStats",
    "RankPool",
    "RecvHookHandle",
    "RunNumbers",
    "RunnerConfig",
    "Signal",
    "StepPlan",
    "StepRecord",
    "StreamBackend",
    "Tracer",
    "UBatchSlice",
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
    "get_backend",
    "install_stack_dump_signal",
    "link_spec",
    "moe_from_hf",
    "plan_step",
    "run",
    "run_ranks",
    "run_ubatches",
    "ubatch_group",
    "ubatch_groups",
]
