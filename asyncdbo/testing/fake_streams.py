"""The fake device's streams and events (:class:`FakeStream`, :class:`FakeEvent`), what an op
touches (storages, the rows of an index op), and :class:`StreamDiscipline`: the parts of
:class:`~asyncdbo.testing.FakeDevice` (``asyncdbo/testing/fake_device.py``) that need no device.
A stream or event acts on the active ``FakeDevice`` (the innermost ``with FakeDevice():``)."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._core import get_ubatch

__all__ = ["FakeEvent", "FakeStream", "StreamDiscipline"]


class _Device(Protocol):
    """What a stream or event uses of the active FakeDevice."""

    device_type: str
    streams: list[FakeStream]

    def current(self) -> FakeStream: ...
    def set_current(self, stream: Any) -> None: ...
    def host_sync(self, what: str, where: str | None = None) -> None: ...


def _who() -> str:
    ub = get_ubatch()
    if ub is None:
        return "outside ubatches"
    return f"ubatch {ub.id} of {ub.run.name!r} after {ub.tag!r}" if ub.tag else f"ubatch {ub.id} of {ub.run.name!r} at its start"


class FakeStream:
    """A FIFO stream: ``seq`` counts its kernels, ``vc`` is its vector clock (stream id -> the
    last kernel of that stream known complete before this stream's next one), ``t`` the virtual
    time (ms) its queued work ends."""

    _ids = iter(range(1 << 62))

    def __init__(self, device: Any = None, priority: int = 0, *, name: str | None = None) -> None:
        dev = _active_device()
        self.id = next(FakeStream._ids)
        self.name = name or f"s{self.id}"
        self.device = torch.device(dev.device_type, 0)
        self.device_type = dev.device_type
        self.device_index = 0
        self.stream_id = self.id
        self.seq = 0
        self.vc: dict[int, int] = {}
        self.t = 0.0
        dev.streams.append(self)

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"

    def wait_event(self, event: FakeEvent) -> None:
        if event.vc is None:
            return  # CUDA: waiting on a never-recorded event does not wait
        for k, v in event.vc.items():
            if self.vc.get(k, 0) < v:
                self.vc[k] = v
        self.t = max(self.t, event.t)

    def wait_stream(self, other: FakeStream) -> None:
        self.wait_event(other.record_event())

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = FakeEvent() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        _active_device().host_sync(f"stream {self.name}.query()")
        return True

    def synchronize(self) -> None:
        _active_device().host_sync(f"stream {self.name}.synchronize()")

    def __enter__(self) -> FakeStream:
        dev = _active_device()
        self._prev = dev.current()
        dev.set_current(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _active_device().set_current(self._prev)


class FakeEvent:
    """An event: ``record`` copies the stream's clock and end time; a wait merges them."""

    def __init__(self, device: Any = None, *, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.vc: dict[int, int] | None = None
        self.t = 0.0
        self.stream: FakeStream | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        stream = _active_device().current() if stream is None else stream
        self.vc = dict(stream.vc)
        self.t = stream.t
        self.stream = stream

    def wait(self, stream: FakeStream | None = None) -> None:
        (_active_device().current() if stream is None else stream).wait_event(self)

    def query(self) -> bool:
        _active_device().host_sync("event.query()")
        return True

    def synchronize(self) -> None:
        _active_device().host_sync("event.synchronize()")

    def elapsed_time(self, end: FakeEvent) -> float:
        """Virtual milliseconds from this event to ``end`` (as CUDA: both must be recorded)."""
        if self.vc is None or end.vc is None:
            raise RuntimeError("elapsed_time() needs both events recorded")
        return end.t - self.t


#: The active devices, innermost last (``FakeDevice.__enter__`` pushes, its exit pops).
_ACTIVE: list[_Device] = []


def _active_device() -> _Device:
    if not _ACTIVE:
        raise RuntimeError("a fake stream or event was used outside `with FakeDevice():`")
    return _ACTIVE[-1]


def _storage(t: torch.Tensor) -> Any:
    return t.untyped_storage() if t.numel() else None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


#: Ops that touch rows of their first argument picked by an index tensor along dim 0 (a paged KV
#: cache's slots): tracked per row, so ubatches that write and read disjoint slots of one cache
#: from their own streams are no race, while a read of a slot another stream wrote still is.
_ROWS = {"aten::index_copy_": 2, "aten::index_select": 2, "aten::index.Tensor": 1}


def _rows_of(func: Any, args: tuple[Any, ...]) -> list[int] | None:
    """The rows of ``args[0]`` an index op touches (None: the whole tensor)."""
    where = _ROWS.get(func._schema.name + ("." + func._overloadname if func._schema.name == "aten::index" else ""))
    if where is None or len(args) <= where:
        return None
    if where == 2 and args[1] != 0:
        return None
    index = args[where]
    if isinstance(index, (list, tuple)):
        if len(index) != 1 or not isinstance(index[0], torch.Tensor):
            return None
        index = index[0]
    if not isinstance(index, torch.Tensor) or index.dtype == torch.bool or index.device.type == "meta":
        return None
    base = args[0]
    return sorted({base.storage_offset() + int(r) * base.stride(0) for r in index.flatten().tolist()})


class StreamDiscipline(TorchDispatchMode):
    """The wrong-stream rule alone, on any device: every op a ubatch issues must go to its lane's
    current stream (``torch.accelerator.current_stream()`` is ``ub.ext.stream``). On a GPU it
    reads the real current stream; ``violations`` collects what it found."""

    def __init__(self) -> None:
        super().__init__()
        self.violations: list[str] = []
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        ub = get_ubatch()
        if ub is not None and getattr(ub.ext, "stream", None) is not None:
            self.ops += 1
            cur = torch.accelerator.current_stream()
            if cur != ub.ext.stream and len(self.violations) < 100:
                self.violations.append(f"{func} from {_who()} ran on {cur}, not its stream {ub.ext.stream}")
        return out
