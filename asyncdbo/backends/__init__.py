"""Stream backends: where a ubatch's compute and comm go, and how events order them.

* ``host``: CPU without an accelerator. Compute runs inline; comm is torch.distributed async work
  (gloo) whose completion parks the waiting ubatch; an optional modeled link releases completions
  after ``latency + bytes / bandwidth``.
* ``accelerator``: CUDA, NPU (with torch_npu), XPU through ``torch.Stream``/``torch.Event``/
  ``torch.accelerator``; comm completion is a stream event, never a CPU wait.
* ``sim`` (in :mod:`asyncdbo.sim`): a simulated device with virtual streams and a race checker.

Backends are chosen by name and imported lazily (:func:`get_backend`).
"""

from __future__ import annotations

from .base import (
    COMPLETED,
    ROLES,
    CommHandle,
    CommRecord,
    CommStamps,
    DoneWork,
    Role,
    RunStreams,
    StreamBackend,
    StreamPolicy,
    UBatchStreams,
)
from .links import LINKS, LinkSpec, link_spec
from .registry import backend_names, get_backend, register_backend

__all__ = [
    "COMPLETED",
    "LINKS",
    "ROLES",
    "CommHandle",
    "CommRecord",
    "CommStamps",
    "DoneWork",
    "LinkSpec",
    "Role",
    "RunStreams",
    "StreamBackend",
    "StreamPolicy",
    "UBatchStreams",
    "backend_names",
    "get_backend",
    "link_spec",
    "register_backend",
]
