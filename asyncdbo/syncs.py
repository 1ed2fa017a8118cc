"""Host syncs: which torch ops make the CPU wait for an accelerator, found on any device.

A host sync is an op whose result the CPU needs before it can go on: a value read to the host
(``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``.cpu()``), or an output whose *size*
depends on the data (``nonzero``), which the host must know to allocate it. On an accelerator
each one drains the stream it reads (under DBO's shared role streams, the other ubatch's queued
compute too), so the host cannot run ahead, and a CUDA graph cannot capture it. On a CPU nothing
waits, so such ops go unnoticed there. :class:`HostSyncs` notices them on any device: under it,
every op that *would* sync on an accelerator is recorded with the user's ``file:line``, counted,
and (``forbid=True``) refused before it runs.

What counts, and where torch says so (torch 2.13; torch's own ``torch.cuda.set_sync_debug_mode``
sees only the syncs that go through c10's ``memcpy_and_sync``/``stream_synchronize``, needs a
CUDA device and is process-global):

* host reads: ``_local_scalar_dense`` (``.item()``, ``int``/``float``/``bool``/``__index__``,
  ``__format__``), ``equal``, ``allclose``, ``is_nonzero`` (each returns a Python value computed
  from device data), and ``.tolist()``, ``.cpu()``, ``.numpy()``, ``.to("cpu")`` (a
  device-to-host copy; on CPU tensors these ops never reach torch's dispatcher, so they are
  caught one level up, as Tensor methods);
* data-dependent sizes: ``nonzero`` (so ``torch.where(cond)`` and ``argwhere``),
  ``masked_select``, boolean-mask indexing (``index.Tensor`` with a bool/uint8 index: the mask
  is expanded by ``nonzero``, ``aten/src/ATen/native/TensorAdvancedIndexing.cpp``), a masked
  ``index_put_`` (except a one-element host value, which torch turns into ``masked_fill_``:
  ``canDispatchToMaskedFill`` in the same file), ``unique`` in all its forms, ``bincount`` (its
  CUDA kernel reads ``self.min()`` and ``self.max()`` to the host even with ``minlength``,
  ``aten/src/ATen/native/cuda/SummaryOps.cu``), ``histc`` with ``min == max`` (reads both from
  the data, same file), ``repeat_interleave`` without ``output_size`` (its documentation: passing
  it "will avoid stream synchronization");
* device-to-host copies (``_to_copy``/``copy_`` from an accelerator into host memory), when a
  real accelerator tensor is involved.

Judged by what the op does on an accelerator, not by the CPU kernel that runs it here:
``F.one_hot(t, num_classes)`` with ``num_classes`` given launches one kernel on a device (CUDA
checks the classes with a device assert), while its CPU kernel reads ``t.min()`` to the host: the
ops it runs inside are no sync. Without ``num_classes`` it reads ``t.max()`` on every device: a
sync (``F.one_hot``).

Not counted: ``nonzero_static`` (fixed size), ``repeat_interleave(..., output_size=n)``,
``masked_fill``, ``scatter_add_``, ``sort``, ``topk``, ``cumsum`` (device kernels only), and
anything torch.distributed does (torch's mode does not see it either).

Usage::

    with HostSyncs() as syncs:          # record
        out = await run_ubatches(...)
    assert syncs.count == 0, syncs.report()

    with HostSyncs(forbid=True):        # refuse: HostSyncError names the op and the line
        ...

``device_only=True`` counts only ops on real accelerator tensors (what a device would really
do); by default CPU tensors count as if they lived on one, which is how the CPU test suite checks
the device path. ``on_sync`` is called with each record and the op's arguments after the op ran
(the simulator charges the wait there).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ._core import AsyncDBOException, get_ubatch

__all__ = ["HostSyncError", "HostSyncs", "SyncRecord", "dispatch_sync_reason", "method_sync_reason"]

_aten = torch.ops.aten

_READ = "reads a value to the host"
_SIZE = "output size depends on the data (the host reads a count)"

# aten overload packets that always sync on an accelerator, and why.
_ALWAYS: dict[Any, str] = {
    _aten._local_scalar_dense: _READ,
    _aten.item: _READ,
    _aten.equal: _READ,
    _aten.allclose: _READ,
    _aten.is_nonzero: _READ,
    _aten.nonzero: _SIZE,
    _aten.nonzero_numpy: _SIZE,
    _aten.argwhere: _SIZE,
    _aten.masked_select: _SIZE,
    _aten._unique: _SIZE,
    _aten._unique2: _SIZE,
    _aten.unique_dim: _SIZE,
    _aten.unique_consecutive: _SIZE,
    _aten.unique_dim_consecutive: _SIZE,
    _aten.bincount: "reads min and max of the input to the host",
}
_INDEX = {_aten.index, _aten._unsafe_index}
_INDEX_PUT = {_aten.index_put, _aten.index_put_, _aten._index_put_impl_, _aten._unsafe_index_put}
_COPIES = {_aten._to_copy, _aten.copy_, _aten.copy, _aten._copy_from}

# Tensor methods that copy to the host: invisible to the dispatcher on CPU tensors.
_METHODS: dict[str, str] = {
    "tolist": "copies the tensor to the host",
    "cpu": "copies the tensor to the host",
    "numpy": "copies the tensor to the host",
}

#: Functions whose CPU kernel reads to the host where the accelerator's does not: name -> why it
#: syncs on a device too, or None when it does not (given its arguments).
def _one_hot(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    num_classes = _arg(args, kwargs, 1, "num_classes")
    if num_classes is None or num_classes < 0:
        return "one_hot without num_classes reads the input's max to the host"
    return None


_FUNCTIONS: dict[str, Callable[[tuple[Any, ...], dict[str, Any]], str | None]] = {"one_hot": _one_hot}

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_THIS = os.path.abspath(__file__)
_CONTEXTLIB = os.path.dirname(os.__file__) + os.sep + "contextlib.py"


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs.get(name)


def dispatch_sync_reason(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why the aten op ``func`` would make the host wait for an accelerator, or None."""
    packet = func.overloadpacket
    reason = _ALWAYS.get(packet)
    if reason is not None:
        return reason
    if packet is _aten.repeat_interleave:
        if func is _aten.repeat_interleave.Tensor and _arg(args, kwargs, 1, "output_size") is None:
            return "repeat_interleave without output_size reads the total to the host"
        return None
    if packet is _aten.histc:
        lo, hi = _arg(args, kwargs, 2, "min"), _arg(args, kwargs, 3, "max")
        return "histc with min == max reads min and max of the input" if (lo or 0) == (hi or 0) else None
    if packet in _INDEX:
        indices = _arg(args, kwargs, 1, "indices") or ()
        return "boolean-mask indexing expands the mask with nonzero" if any(map(_is_mask, indices)) else None
    if packet in _INDEX_PUT:
        indices = _arg(args, kwargs, 1, "indices") or ()
        if not any(map(_is_mask, indices)):
            return None
        value = _arg(args, kwargs, 2, "values")
        masks = [i for i in indices if i is not None]
        if len(masks) == 1 and isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu":
            return None  # torch runs it as masked_fill_ (canDispatchToMaskedFill)
        return "a masked index_put_ expands the mask with nonzero"
    if packet in _COPIES:
        if packet is _aten._to_copy:
            src, dst_dev, non_blocking = _arg(args, kwargs, 0, "self"), kwargs.get("device"), kwargs.get("non_blocking")
        else:  # copy_(self, src, non_blocking), copy(self, src, non_blocking), _copy_from(self, dst, non_blocking)
            a, b = _arg(args, kwargs, 0, "self"), _arg(args, kwargs, 1, "src")
            src, dst = (a, b) if packet is _aten._copy_from else (b, a)
            dst_dev = dst.device if isinstance(dst, torch.Tensor) else None
            non_blocking = _arg(args, kwargs, 2, "non_blocking")
        if (isinstance(src, torch.Tensor) and _accelerator(src.device) and dst_dev is not None
                and torch.device(dst_dev).type == "cpu" and not non_blocking):
            return "a blocking device-to-host copy"
    return None


def method_sync_reason(name: str, self_: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why the Tensor method ``name`` would make the host wait (the host copies), or None."""
    reason = _METHODS.get(name)
    if reason is not None:
        return reason
    if name == "to":
        dev = kwargs.get("device")
        for a in args:
            if isinstance(a, (str, torch.device)):
                dev = a
            elif isinstance(a, torch.Tensor):
                dev = a.device
        if dev is None or torch.device(dev).type != "cpu" or kwargs.get("non_blocking", False):
            return None
        if not isinstance(dev, str) and torch.device(dev) == self_.device:
            return None  # to(t.device) onto the tensor's own device: no copy on any device ("cpu" named is a copy)
        return "copies the tensor to the host"
    return None


def _accelerator(device: torch.device) -> bool:
    return device.type not in ("cpu", "meta")


def user_site() -> str:
    """``file:line`` of the innermost frame outside torch and this module."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith(_TORCH_DIR) or name == _THIS or name == _CONTEXTLIB or name.startswith("<frozen")):
            return f"{name}:{f.f_lineno}"
        f = f.f_back  # type: ignore[assignment]
    return "<unknown>"


@dataclass(frozen=True)
class SyncRecord:
    """One op that would make the host wait: ``op`` (``aten.nonzero``, ``Tensor.tolist``),
    ``where`` (the user's ``file:line``), ``reason``, the ubatch that issued it (None outside
    a DBO run) and the device of its first tensor."""

    op: str
    where: str
    reason: str
    ubatch: int | None
    device: str

    def __str__(self) -> str:
        ub = "" if self.ubatch is None else f" (ubatch {self.ubatch})"
        return f"{self.op} at {self.where}{ub}: {self.reason}"


class HostSyncError(AsyncDBOException, RuntimeError):
    """An op that would make the host wait for the device ran under ``HostSyncs(forbid=True)``."""

    def __init__(self, record: SyncRecord) -> None:
        super().__init__(f"host sync forbidden here: {record}")
        self.record = record


def _first_device(args: Any) -> torch.device | None:
    for t in tree_flatten(args)[0]:
        if isinstance(t, torch.Tensor):
            return t.device
    return None


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: HostSyncs) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        owner = self.owner
        if owner._inside or func.namespace != "aten":
            return func(*args, **kwargs)
        reason = dispatch_sync_reason(func, args, kwargs)
        if reason is None:
            return func(*args, **kwargs)
        return owner._sync(f"aten.{func.overloadpacket.__name__}", reason, _first_device((args, kwargs)),
                           func, args, kwargs)


class _Methods(TorchFunctionMode):
    def __init__(self, owner: HostSyncs) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        owner = self.owner
        judge = _FUNCTIONS.get(name)
        if judge is not None and not owner._inside:
            reason = judge(args, kwargs)
            if reason is not None:
                return owner._sync(f"F.{name}", reason, _first_device(args), func, args, kwargs)
            owner._inside = True  # what its CPU kernel reads is no sync on a device
            try:
                return func(*args, **kwargs)
            finally:
                owner._inside = False
        if owner._inside or name not in _METHODS and name != "to" or not args or not isinstance(args[0], torch.Tensor):
            return func(*args, **kwargs)
        reason = method_sync_reason(name, args[0], args[1:], kwargs)
        if reason is None:
            return func(*args, **kwargs)
        return owner._sync(f"Tensor.{name}", reason, args[0].device, func, args, kwargs)


class HostSyncs:
    """Records (or with ``forbid`` refuses) every op that would make the host wait for an
    accelerator, while the block runs (see the module doc). Not reentrant; one per block.

    ``count``, ``records``, :meth:`by_op` and :meth:`report` read the result; :meth:`allowed`
    lets a known sync through (recorded, not refused) inside a forbidding block."""

    def __init__(self, *, forbid: bool = False, device_only: bool = False,
                 on_sync: Callable[[SyncRecord, tuple[Any, ...]], None] | None = None) -> None:
        self.forbid = forbid
        self.device_only = device_only
        self.on_sync = on_sync
        self.records: list[SyncRecord] = []
        self._inside = False
        self._allow = 0
        self._modes: tuple[_Methods, _Dispatch] | None = None

    @property
    def count(self) -> int:
        return len(self.records)

    def by_op(self) -> dict[str, int]:
        """Syncs per op name, most frequent first."""
        return dict(Counter(r.op for r in self.records).most_common())

    def report(self) -> str:
        """One line per record (for an assertion message)."""
        return "\n".join(map(str, self.records)) or "no host syncs"

    def allowed(self) -> _Allowed:
        """A block in which syncs are recorded but not refused."""
        return _Allowed(self)

    def __enter__(self) -> HostSyncs:
        if self._modes is not None:
            raise RuntimeError("HostSyncs is not reentrant: use a new one per block")
        self._modes = (_Methods(self), _Dispatch(self))
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._modes is not None
        methods, disp = self._modes
        self._modes = None
        disp.__exit__(None, None, None)
        methods.__exit__(None, None, None)

    def _sync(self, op: str, reason: str, device: torch.device | None, func: Any, args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> Any:
        if self.device_only and (device is None or not _accelerator(device)):
            return func(*args, **kwargs)
        ub = get_ubatch()
        record = SyncRecord(op, user_site(), reason, None if ub is None else ub.id,
                            "?" if device is None else str(device))
        if self.forbid and not self._allow:
            raise HostSyncError(record)
        self._inside = True  # the op's own inner ops (.tolist's copy, .item's read) are this sync
        try:
            out = func(*args, **kwargs)
        finally:
            self._inside = False
        self.records.append(record)
        if self.on_sync is not None:
            self.on_sync(record, args)
        return out


class _Allowed:
    __slots__ = ("owner",)

    def __init__(self, owner: HostSyncs) -> None:
        self.owner = owner

    def __enter__(self) -> None:
        self.owner._allow += 1

    def __exit__(self, *exc: object) -> None:
        self.owner._allow -= 1
