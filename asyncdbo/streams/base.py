"""The interface every stream backend implements, and backend selection by name."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from .._core import DBORun, Signal

__all__ = ["READY", "ROLES", "DoneWork", "StreamBackend", "StreamPolicy", "get_backend"]

StreamPolicy = Literal["role", "ubatch"]
"""``role`` (vLLM): one compute and one comm stream shared by all ubatches; a role switch moves a
ubatch between them. ``ubatch`` (CANN prefill case): each ubatch owns one stream for both roles
(ubatch 0 the current stream, the others side streams); cross-ubatch order is explicit events."""

ROLES = ("compute", "comm")


class DoneWork:
    """A comm handle with nothing left to wait for: work that completed before it was handed over
    (outside a run), or device comm whose order already lives on the streams. ``await`` is free."""

    __slots__ = ("what", "nbytes", "work")

    def __init__(self, what: str = "comm", nbytes: int = 0, work: Any = None) -> None:
        self.what, self.nbytes, self.work = what, nbytes, work

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def __await__(self) -> Any:
        return iter(())

    def __repr__(self) -> str:
        return f"<DoneWork {self.what}>"


READY = DoneWork("ready")
"""The shared done awaitable: what comm paths that issued no work (EP size 1, serial calls) and
the yield primitives outside a run return."""


class StreamBackend(ABC):
    """Streams, events and comm completion for one kind of device.

    Event rule (vLLM's, kept everywhere): a ubatch records its done-event on the stream it leaves
    *before* yielding, and the stream it enters waits on it *after* resuming. Recording after the
    yield would cover the other ubatch's queued work and silently serialize them (vLLM #38451).
    """

    name: str = "?"

    @abstractmethod
    def attach(self, run: DBORun, policy: StreamPolicy) -> None:
        """Give each ubatch its ``streams`` (role -> stream), ``events`` (role -> done-event) and
        starting ``stream`` (compute). Called once before the run starts."""

    def detach(self, run: DBORun) -> None:
        """Called after the run; restore whatever ``attach`` changed."""

    @property
    def install_stream(self) -> Any:
        """Callable that makes a stream the device's current one, or None when there is nothing to
        install (host). The scheduler calls it on every resume whose stream differs."""
        return None

    @abstractmethod
    def new_event(self) -> Any:
        """A fresh, never-recorded event."""

    @abstractmethod
    def record(self, event: Any, stream: Any) -> None:
        """Record ``event`` on ``stream`` (captures the work queued there so far)."""

    @abstractmethod
    def wait(self, stream: Any, event: Any) -> Signal | None:
        """Make ``stream`` wait for ``event``. Returns None if the device orders it (no CPU wait),
        or a Signal the calling ubatch must park on before it may go on (host)."""

    @abstractmethod
    def submit(self, work: Any, *, nbytes: int = 0, what: str = "comm") -> Any:
        """Take a ``torch.distributed`` async work issued by the running ubatch on its current
        stream. Returns a handle to wait on (see each backend)."""

    def describe(self) -> str:
        return self.name


def get_backend(name: str | StreamBackend | None = "auto", **kwargs: Any) -> StreamBackend:
    """A backend by name: ``auto`` (the accelerator if torch has one, else ``host``), ``host``,
    ``cuda``, ``npu``, ``xpu``, ``accelerator``, or ``sim`` (simulated device). Imported lazily."""
    if isinstance(name, StreamBackend):
        return name
    if name is None or name == "auto":
        import torch

        acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        name = "host" if acc is None else acc.type
    if name == "host":
        from .host import HostBackend

        return HostBackend(**kwargs)
    if name in ("cuda", "npu", "xpu", "accelerator"):
        from .accelerator import AcceleratorBackend

        return AcceleratorBackend(None if name == "accelerator" else name, **kwargs)
    if name == "sim":
        try:
            mod = importlib.import_module("asyncdbo.streams.sim")
        except ImportError as exc:  # pragma: no cover - sim ships with asyncdbo
            raise LookupError(f"the sim backend failed to import: {exc}") from exc
        return mod.SimBackend(**kwargs)
    raise ValueError(
        f"unknown stream backend {name!r}; choose 'auto', 'host', 'cuda', 'npu', 'xpu', 'accelerator' or 'sim'"
    )
