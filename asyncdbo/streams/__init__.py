"""Stream backends: where a ubatch's compute and comm go, and how events order them.

* ``host``: CPU without an accelerator. Compute runs inline; comm is torch.distributed async work
  (gloo) whose completion parks the waiting ubatch; an optional modeled link releases completions
  after ``latency + bytes / bandwidth``.
* ``accelerator``: CUDA, NPU (with torch_npu), XPU through ``torch.Stream``/``torch.Event``/
  ``torch.accelerator``; comm completion is a stream event, never a CPU wait.

Backends are chosen by name and imported lazily (:func:`get_backend`).
"""

from __future__ import annotations

from .base import ROLES, StreamBackend, StreamPolicy, get_backend
from .links import LINKS, LinkSpec, link_spec

__all__ = ["LINKS", "ROLES", "LinkSpec", "StreamBackend", "StreamPolicy", "get_backend", "link_spec"]
