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

Every rule here is checked on a CPU by :mod:`asyncdbo.testing.fake_device` (tests/backends/
test_fake_device.py), which runs this backend against a fake ``torch.accelerator``.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from .base import DoneWork, RunStreams, StreamBackend, UBatchStreams

if TYPE_CHECKING:
    from collections.abc import Generator

    from .._core import DBORun, Signal

__all__ = ["AcceleratorBackend", "DeviceWork", "cuda_backend", "npu_backend", "shared_backend", "xpu_backend"]


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
    """Streams and events of the current accelerator (see the module docstring).

    The backend owns its side streams and reuses them in every run: one comm stream under the
    role policy, a compute stream (ubatches 1..N-1) and a comm stream per ubatch index under the
    ubatch policy. A new stream per run would grow the caching allocator's per-stream pools run
    after run, and a CUDA graph captured after a warm-up run would capture streams the warm-up
    never touched. :func:`cuda_backend` and friends (what ``backend="cuda"`` resolves to) return
    one backend per device, so every run of a process shares those streams.

    Every run forks from the caller's stream and joins back to it (CUDA's rule for side streams,
    and what graph capture requires): at entry each side stream waits for what the caller queued
    before the run (its inputs), at exit the caller's stream waits for every side stream (the
    outputs, and the blocks the ubatches allocated there, which the caller may free), and the
    caller's stream is current again.
    """

    def __init__(self, device_type: str | None = None) -> None:
        import torch

        self.device_type = _resolve_device_type(device_type)
        self.name = self.device_type
        self.device = torch.device(self.device_type, torch.accelerator.current_device_index())
        self._torch = torch
        self._saved: dict[int, Any] = {}
        self._comm: Any = None  # the role policy's comm stream
        self._compute_side: list[Any] = []  # ubatch policy: compute streams of ubatches 1, 2, ...
        self._comm_side: list[Any] = []  # ubatch policy: comm streams of ubatches 0, 1, ...

    @property
    def install_stream(self) -> Any:
        return self._torch.accelerator.set_stream

    def _stream(self, pool: list[Any], i: int) -> Any:
        while len(pool) <= i:
            pool.append(self._torch.Stream(device=self.device))
        return pool[i]

    @staticmethod
    def _side_streams(state: RunStreams, main: Any) -> list[Any]:
        """The run's streams other than the caller's ``main``, each once."""
        seen: dict[int, Any] = {}
        for lane in state.lanes:
            for stream in lane.streams.values():
                if stream is not main:
                    seen.setdefault(id(stream), stream)
        return list(seen.values())

    def attach(self, run: DBORun, state: RunStreams) -> None:
        torch = self._torch
        main = torch.accelerator.current_stream(self.device)
        self._saved[id(run)] = main
        run.home = main  # current while the run waits on the event loop (the kernel's invariant 9)
        for lane in state.lanes:
            i = lane.ub.id
            if state.policy == "role":
                if self._comm is None:
                    self._comm = torch.Stream(device=self.device)
                lane.streams = {"compute": main, "comm": self._comm}
            else:
                own = main if i == 0 else self._stream(self._compute_side, i - 1)
                lane.streams = {"compute": own, "comm": self._stream(self._comm_side, i)}
            lane.events = {"compute": torch.Event(device=self.device), "comm": torch.Event(device=self.device)}
            lane.stream = lane.ub.resume_with = lane.streams["compute"]
        fork = torch.Event(device=self.device)
        fork.record(main)
        for stream in self._side_streams(state, main):
            stream.wait_event(fork)  # the inputs the caller queued before the run

    def detach(self, run: DBORun, state: RunStreams) -> None:
        main = self._saved.get(id(run))
        if main is None:
            return
        for stream in self._side_streams(state, main):
            join = self._torch.Event(device=self.device)
            join.record(stream)
            main.wait_event(join)  # the outputs, and blocks the caller may free
        del self._saved[id(run)]
        self._torch.accelerator.set_stream(main)  # not run.install: its record of what is current may be stale

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


_SHARED: dict[tuple[str, int], AcceleratorBackend] = {}
"""One backend per (device type, device index): what the backend names resolve to."""


def shared_backend(device_type: str) -> AcceleratorBackend:
    """The process's backend for ``device_type`` on the current device (made on first use), so
    runs that name their backend share its streams (see :class:`AcceleratorBackend`)."""
    import torch

    device_type = _resolve_device_type(device_type)
    key = (device_type, torch.accelerator.current_device_index())
    backend = _SHARED.get(key)
    if backend is None:
        backend = _SHARED[key] = AcceleratorBackend(device_type)
    return backend


def cuda_backend() -> AcceleratorBackend:
    return shared_backend("cuda")


def npu_backend() -> AcceleratorBackend:
    return shared_backend("npu")


def xpu_backend() -> AcceleratorBackend:
    return shared_backend("xpu")
