"""How the sim sees a run's torch ops: a ``TorchDispatchMode`` entered for the run, which executes
each op and hands it to the backend.

Ops run for real on the CPU, so a model's numbers are the real numbers. Tensors on torch's
``meta`` device are shapes without data: an op that reads one runs on the meta device (CPU
tensors among its inputs are viewed as meta for the call, and an in-place op leaves its CPU
target unchanged). That is how :mod:`asyncdbo.sim.predict` runs DeepSeek-V3's width in seconds:
activations and weights are meta, while the tensors that steer the schedule (routing, counts,
split sizes, indices) stay on the CPU and are computed for real. The cost model prices an op
from its shapes either way, and the race checker tracks meta storages like real ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .._core import get_ubatch

if TYPE_CHECKING:
    from .accounting import OpAccounting

__all__ = ["SimMode"]


def _as_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.device.type != "meta" and x.dim() > 0:
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
    return x


def _mixed_meta(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` on meta copies of its CPU inputs; mutated CPU arguments are returned as the
    op would return them (unchanged: only their shape matters here)."""
    out = func(*tree_map(_as_meta, args), **tree_map(_as_meta, kwargs))
    schema = func._schema
    if not schema.is_mutable:
        return out
    aliased = {}
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            aliased[frozenset(a.alias_info.before_set)] = args[i] if i < len(args) else kwargs.get(a.name)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    for j, r in enumerate(schema.returns):
        if r.alias_info is not None:
            real = aliased.get(frozenset(r.alias_info.before_set))
            if real is not None:
                outs[j] = real
    return type(out)(outs) if isinstance(out, (tuple, list)) else outs[0]


class SimMode(TorchDispatchMode):
    """Executes each op, then reports it to the backend if a ubatch of its run issued it."""

    def __init__(self, backend: OpAccounting) -> None:  # a SimBackend: what of it takes the ops
        super().__init__()
        self.backend = backend

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func.namespace != "c10d" and any(t.device.type == "meta" for t in flat) and any(
                t.device.type != "meta" and t.dim() > 0 for t in flat):
            out = _mixed_meta(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        ub = get_ubatch()
        be = self.backend
        if ub is not None and ub.run is be._run:
            be._on_op(ub, func, args, kwargs, out)
        return out
