"""Accelerator backend: CUDA, NPU (torch_npu), XPU through torch's device-generic stream API.

``torch.Stream``/``torch.Event`` and ``torch.accelerator`` cover every device that registers a
DeviceGuard with streams, so one class serves them all. The current stream is per OS thread in
C++; since all ubatches share one thread, the scheduler re-installs the resuming ubatch's stream
(``torch.accelerator.set_stream``) whenever it differs from the installed one.

Comm completion is a stream dependency, never a CPU wait: NCCL/HCCL works complete their CPU
future at enqueue time, and ``work.wait()`` makes the *current* stream wait for the collective's
internal stream. The done-events the primitives record then carry that order to the other role.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from .base import DoneWork, RunStreams, StreamBackend, UBatchStreams

if TYPE_CHECKING:
    from .._core import DBORun, Signal

__all__ = ["AcceleratorBackend", "cuda_backend", "npu_backend", "xpu_backend"]


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
                lane.streams = {"compute": own, "comm": own}
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
               **options: Any) -> DoneWork:
        work.wait()  # current stream waits for the collective; the CPU does not
        return DoneWork(what, nbytes, work)


def cuda_backend() -> AcceleratorBackend:
    return AcceleratorBackend("cuda")


def npu_backend() -> AcceleratorBackend:
    return AcceleratorBackend("npu")


def xpu_backend() -> AcceleratorBackend:
    return AcceleratorBackend("xpu")
