"""Accelerator backend: CUDA, NPU (torch_npu), XPU through torch's device-generic stream API.

``torch.Stream``/``torch.Event`` and ``torch.accelerator`` cover every device that registers a
DeviceGuard with streams, so one class serves them all. The current stream is per OS thread in
C++; since all ubatches share one thread, the scheduler re-installs the resuming ubatch's stream
(``torch.accelerator.set_stream``) whenever it differs from the installed one.

Comm completion is a stream dependency, never a CPU wait: NCCL/HCCL works complete their CPU
future at enqueue time, and ``work.wait()`` makes the *current* stream wait for the collective's
internal stream. Where that wait goes is the schedule's choice:

* a collective issued from a comm stream (the ``ht`` schedule) is waited for there at once, and
  the done-events the primitives record carry that order to compute;
* a collective issued from the compute role (the ``ll`` schedule: send now, receive later) is not
  waited for at issue, which would stall the shared compute stream until the rows arrive and
  leave nothing to overlap; the handle's ``stream_wait()`` (run from a recv hook by the next
  ubatch, after it queued its own compute) or ``await handle`` makes the then-current stream wait.

Under the ubatch policy each ubatch has its own compute stream and its own comm stream.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from .base import DoneWork, RunStreams, StreamBackend, UBatchStreams

if TYPE_CHECKING:
    from collections.abc import Generator

    from .._core import DBORun, Signal

__all__ = ["AcceleratorBackend", "DeviceWork", "cuda_backend", "npu_backend", "xpu_backend"]


class DeviceWork:
    """A collective issued from the compute role: nothing waits for it until ``stream_wait()``
    or ``await`` makes the current stream wait (``work.wait()``); the CPU never blocks."""

    __slots__ = ("what", "nbytes", "work", "_waited")

    def __init__(self, what: str, nbytes: int, work: Any) -> None:
        self.what, self.nbytes, self.work, self._waited = what, nbytes, work, False

    def done(self) -> bool:
        return self._waited

    def stream_wait(self) -> None:
        self.work.wait()  # the current stream waits for the collective's stream
        self._waited = True

    wait = stream_wait

    def __await__(self) -> Generator[Any, Any, None]:
        self.stream_wait()
        return
        yield

    def __repr__(self) -> str:
        return f"<DeviceWork {self.what} {'waited' if self._waited else 'in flight'}>"


def _resolve_device_type(device_type: str | None) -> str:
    import torch

    if device_type == "npu" and importlib.util.find_spec("torch_npu") is None:
        raise LookupError(
            "the 'npu' backend needs torch_npu (Ascend's PyTorch adapter): install the torch_npu build that "
            "matches your torch and CANN versions, then `import torch_npu` before asyncdbo runs"
        )
    if device_type == "npu":
        importlib.import_module("torch_npu")
    acc = torch.accelerator.current_accelerator()
    if device_type is None:
        if acc is None:
            raise LookupError("no accelerator is available to torch; use the 'host' backend on a CPU-only machine")
        return acc.type
    if acc is None or acc.type != device_type:
        raise LookupError(
            f"backend {device_type!r} requested but torch's current accelerator is "
            f"{None if acc is None else acc.type!r}; pick backend='host' on a CPU-only machine"
        )
    return device_type


class AcceleratorBackend(StreamBackend):
    """Streams and events of the current accelerator (see the module docstring)."""

    def __init__(self, device_type: str | None = None) -> None:
        import torch

        self.device_type = _resolve_device_type(device_type)
        self.name = self.device_type
        self.device = torch.device(self.device_type, torch.accelerator.current_device_index())
        self._torch = torch
        self._saved: dict[int, Any] = {}

    @property
    def install_stream(self) -> Any:
        return self._torch.accelerator.set_stream

    def attach(self, run: DBORun, state: RunStreams) -> None:
        torch = self._torch
        main = torch.accelerator.current_stream(self.device)
        self._saved[id(run)] = main
        comm = torch.Stream(device=self.device)
        for lane in state.lanes:
            if state.policy == "role":
                lane.streams = {"compute": main, "comm": comm}
            else:
                own = main if lane.ub.id == 0 else torch.Stream(device=self.device)
                lane.streams = {"compute": own, "comm": torch.Stream(device=self.device)}
            lane.events = {"compute": torch.Event(device=self.device), "comm": torch.Event(device=self.device)}
            lane.stream = lane.ub.resume_with = lane.streams["compute"]

    def detach(self, run: DBORun, state: RunStreams) -> None:
        main = self._saved.pop(id(run), None)
        if main is not None:
            run.install(main)

    def new_event(self) -> Any:
        return self._torch.Event(device=self.device)

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait(self, stream: Any, event: Any) -> Signal | None:
        stream.wait_event(event)
        return None

    def submit(self, work: Any, lane: UBatchStreams | None, *, nbytes: int = 0, what: str = "comm",
               **options: Any) -> DoneWork | DeviceWork:
        if lane is not None and lane.role == "compute":
            return DeviceWork(what, nbytes, work)  # waited where the schedule says (module docstring)
        work.wait()  # the current (comm) stream waits for the collective; the CPU does not
        return DoneWork(what, nbytes, work)


def cuda_backend() -> AcceleratorBackend:
    return AcceleratorBackend("cuda")


def npu_backend() -> AcceleratorBackend:
    return AcceleratorBackend("npu")


def xpu_backend() -> AcceleratorBackend:
    return AcceleratorBackend("xpu")
