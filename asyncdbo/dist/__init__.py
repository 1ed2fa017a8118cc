"""torch.distributed for DBO: per-ubatch process groups, step recovery and the expert-parallel
all-to-all.

:func:`ubatch_groups` makes one clone of a group per ubatch slot (collectives of different
ubatches then never need a global order); :mod:`asyncdbo.dist.recovery` lets the ranks run the
next step after one failed or was cancelled (:class:`StepSync`, :class:`StepAborted`);
:func:`destroy_process_groups` leaves torch.distributed so that no gloo thread outlives the
interpreter; :func:`dispatch_options` lets the MoE dispatch send its counts and rows as one
message where the link model says it pays (:mod:`asyncdbo.dist.fused`); :mod:`asyncdbo.dist.ep` issues the MoE dispatch and combine through the run's stream
backend (imported on first use: it imports torch).
"""

from typing import TYPE_CHECKING, Any

from .groups import (
    clone_group,
    current_clones,
    destroy_process_groups,
    forget_group,
    on_destroy,
    renew_ubatch_groups,
    ubatch_group,
    ubatch_groups,
)
from .fused import DispatchChoice, DispatchOptions, choose_dispatch, current_dispatch_options, dispatch_options
from .recovery import StepAborted, StepSync, roll_call, step_sync

if TYPE_CHECKING:
    from .ep import DispatchPlan, EPComm, ep_comm, forget_ep_comm, plan_dispatch

_EP = ("DispatchPlan", "EPComm", "ep_comm", "forget_ep_comm", "plan_dispatch")


def __getattr__(name: str) -> Any:
    if name in _EP:
        from . import ep

        return getattr(ep, name)
    raise AttributeError(f"module 'asyncdbo.dist' has no attribute {name!r}")


__all__ = [
    "DispatchChoice",
    "DispatchOptions",
    "DispatchPlan",
    "EPComm",
    "StepAborted",
    "StepSync",
    "choose_dispatch",
    "clone_group",
    "current_clones",
    "current_dispatch_options",
    "destroy_process_groups",
    "dispatch_options",
    "ep_comm",
    "forget_ep_comm",
    "forget_group",
    "on_destroy",
    "plan_dispatch",
    "renew_ubatch_groups",
    "roll_call",
    "step_sync",
    "ubatch_group",
    "ubatch_groups",
]
