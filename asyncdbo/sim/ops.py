"""Reading a dispatched torch op for the race checker: its tensors, whether it is a view, and the
storage key an access is tracked under."""

from __future__ import annotations

import re
from typing import Any

import torch

__all__ = ["FACTORY", "Region", "covers", "is_view", "overlaps", "self_region", "span", "storage_key", "tensor_items", "union"]

FACTORY = re.compile(r"(new_.*|.*_like)")
"""Schema names of ops whose tensor arguments are only templates (nothing is read from them)."""


def tensor_items(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in tensor_items(v)]
    return []


def is_view(func: Any) -> bool:
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def storage_key(t: torch.Tensor) -> int | None:
    """What an access is tracked under: the storage's data pointer, or for a meta tensor (no
    data) the address of its storage object; views share their base's key."""
    if t.numel() == 0:
        return None
    if t.device.type == "meta":
        return int(t.untyped_storage()._cdata)
    return t.untyped_storage().data_ptr()


# ------------------------------------------------------------------------ regions of a storage
Region = tuple[tuple[int, int], ...] | None
"""The bytes of a storage an access touches: sorted, disjoint ``[start, end)`` intervals, or None
for the whole storage (what comm ops and an op the checker cannot read claim)."""

_aten = torch.ops.aten
#: Ops that touch rows of their ``self`` along ``dim`` named by an index tensor: (position of dim,
#: position of the index), and whether ``self`` is written (the in-place forms) or read.
_ROW_OPS: dict[Any, tuple[int, int]] = {
    _aten.index_copy_.default: (1, 2),
    _aten.index_select.default: (1, 2),
    _aten.index_fill_.int_Scalar: (1, 2),
    _aten.index_fill_.int_Tensor: (1, 2),
}
#: Ops whose ``indices`` list (argument 1) picks rows of ``self`` along dim 0 when it holds one
#: integer tensor first and nothing else (``t[idx]``, ``t[idx] = v``).
_INDEX_OPS = {_aten.index.Tensor, _aten._unsafe_index.Tensor, _aten.index_put_.default, _aten.index_put.default,
              _aten._index_put_impl_.default}


def span(t: torch.Tensor) -> Region:
    """The byte interval from ``t``'s first to its last element in its storage (a strided view
    is claimed whole between them: over-claiming can only report a conflict, never hide one)."""
    if t.numel() == 0:
        return ()
    size = t.element_size()
    start = int(t.storage_offset()) * size
    extent = 1 + sum((int(n) - 1) * int(s) for n, s in zip(t.shape, t.stride()))
    return ((start, start + extent * size),)


def _rows(t: torch.Tensor, dim: int, index: Any) -> Region:
    """The bytes of rows ``index`` of ``t`` along ``dim`` (a real integer tensor), each row the
    span of ``t`` with that dim fixed; adjacent rows merge."""
    if not isinstance(index, torch.Tensor) or index.device.type == "meta" or index.dtype in (torch.bool, torch.uint8):
        return span(t)
    if index.is_floating_point() or index.is_complex() or t.dim() == 0:
        return span(t)
    dim = dim % t.dim()
    n = int(t.shape[dim])
    size = t.element_size()
    step = int(t.stride(dim)) * size
    base = int(t.storage_offset()) * size
    rest = 1 + sum((int(m) - 1) * int(s) for i, (m, s) in enumerate(zip(t.shape, t.stride())) if i != dim)
    width = rest * size
    # Read the index values with the sim's own modes off: this is the checker looking, not the run.
    # Vectorized: a dispatch index of a 16k-token prefill has ~10^5 entries, too many for a loop.
    with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
        flat = index.detach().reshape(-1).to("cpu", torch.int64)
        if flat.numel() == 0:
            return ()
        if step < 0:
            return span(t)
        if n:  # which of the n rows are named, without sorting the (often expanded) index
            named = torch.zeros(n, dtype=torch.bool)
            named[torch.remainder(flat, n)] = True
            values = torch.nonzero(named).reshape(-1)
        else:
            values = torch.zeros(1, dtype=torch.int64)
        lo = base + values * step
        # rows merge with the one before when they touch: a new interval starts where the gap opens
        starts = torch.ones_like(values, dtype=torch.bool)
        starts[1:] = (values[1:] - values[:-1]) * step > width
        first = torch.nonzero(starts).reshape(-1)
        last = torch.cat([first[1:] - 1, torch.tensor([values.numel() - 1])])
        out = list(zip(lo[first].tolist(), (lo[last] + width).tolist()))
    return tuple(out)


def self_region(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Region:
    """The bytes of ``self`` (argument 0) an indexed op touches, or its whole span for any other
    op: a KV-cache write through ``index_copy_`` and a gather through ``index_select`` or
    ``t[idx]`` claim only the slots they name."""
    t = args[0] if args else kwargs.get("self")
    if not isinstance(t, torch.Tensor):
        return None
    rows = _ROW_OPS.get(func)
    if rows is not None:
        dim_i, idx_i = rows
        dim = args[dim_i] if len(args) > dim_i else kwargs.get("dim", 0)
        return _rows(t, int(dim), args[idx_i] if len(args) > idx_i else kwargs.get("index"))
    if func in _INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices")
        if isinstance(indices, (list, tuple)) and len(indices) == 1:
            return _rows(t, 0, indices[0])
    return span(t)


def overlaps(a: Region, b: Region) -> bool:
    """Whether two regions of one storage share a byte."""
    if a is None:
        return b is None or bool(b)
    if b is None:
        return bool(a)
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][1] <= b[j][0]:
            i += 1
        elif b[j][1] <= a[i][0]:
            j += 1
        else:
            return True
    return False


def covers(a: Region, b: Region) -> bool:
    """Whether region ``a`` holds every byte of ``b``."""
    if a is None:
        return True
    if b is None:
        return False
    i = 0
    for lo, hi in b:
        while i < len(a) and a[i][1] <= lo:
            i += 1
        if i == len(a) or a[i][0] > lo or a[i][1] < hi:
            return False
    return True


def union(a: Region, b: Region) -> Region:
    """The bytes of ``a`` and of ``b``."""
    if a is None or b is None:
        return None
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(a + b):
        if out and out[-1][1] >= lo:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)
