"""What every stream backend implements, and the typed per-ubatch state it fills.

A backend owns three things for a run: the streams each ubatch computes and communicates on, the
events that order them, and how a comm work's completion reaches the ubatch waiting for it. It
keeps them in a :class:`RunStreams` (one per run) holding a :class:`UBatchStreams` per ubatch;
the DBO layer subclasses both to add its own fields, and hands them to :meth:`StreamBackend.attach`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from .stamps import CommRecord, CommStamps

if TYPE_CHECKING:
    from .._core import DBORun, Signal, UBatch

__all__ = [
    "COMPLETED",
    "ROLES",
    "CommHandle",
    "CommRecord",
    "CommStamps",
    "DoneWork",
    "Role",
    "RunStreams",
    "StreamBackend",
    "StreamPolicy",
    "UBatchStreams",
]

StreamPolicy = Literal["role", "ubatch"]
"""``role`` (vLLM): one compute and one comm stream shared by all ubatches; a role switch moves a
ubatch between them. ``ubatch`` (CANN prefill case): each ubatch owns a compute stream (ubatch 0
the current stream, the others side streams) and a comm stream of its own, as NCCL and HCCL give
each communicator; explicit events order them, across roles and across ubatches."""

Role = Literal["compute", "comm"]
ROLES: tuple[Role, Role] = ("compute", "comm")


class CommHandle(Protocol):
    """What :meth:`StreamBackend.submit` returns: ``await handle`` waits for the work the way the
    backend needs (the host parks the ubatch; a device orders its current stream), ``wait()``
    blocks outside a run, ``done()`` says whether anything is left to wait for, and
    ``stream_wait()`` orders the *current* stream after the work without blocking the CPU (what a
    recv hook does on a device; nothing on the host, where only a park can wait)."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...

    def stream_wait(self) -> None: ...

    def __await__(self) -> Generator[Any, Any, None]: ...


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

    def stream_wait(self) -> None:
        return None

    def __await__(self) -> Generator[Any, Any, None]:
        return
        yield  # a generator that finishes at once: nothing to wait for

    def __repr__(self) -> str:
        return f"<DoneWork {self.what}>"


COMPLETED = DoneWork("completed")
"""The shared done awaitable: what comm paths that issued no work (EP size 1, serial calls) and
the primitives outside a run return."""


@dataclass(eq=False, slots=True)
class UBatchStreams:
    """One ubatch's place on the device: its streams and done-events by role, the role and stream
    it is on now. ``ub`` is the kernel's record (its id, its run's clock and timers)."""

    ub: UBatch
    streams: dict[Role, Any] = field(default_factory=dict)
    events: dict[Role, Any] = field(default_factory=dict)
    role: Role = "compute"
    stream: Any = None

    def set_stream(self, stream: Any) -> None:
        """Make ``stream`` this ubatch's current stream, now and on every later resume."""
        self.stream = stream
        ub = self.ub
        ub.resume_with = stream
        run = ub.run
        if run.installs:  # a host has no device stream to make current
            run.install(stream)


@dataclass(eq=False)
class RunStreams:
    """A run's device state: its backend, policy, the ubatches' :class:`UBatchStreams` (by id) and
    a log of the comm works the backend tracked (the host backend logs every work; device
    backends leave the timing to device events)."""

    backend: StreamBackend
    policy: StreamPolicy
    lanes: list[Any]  # list[UBatchStreams] (or the DBO layer's subclass)
    comm: list[Any] = field(default_factory=list)  # backend-specific work handles, in issue order
    # the times of the works in ``comm`` (the host backend stamps them; None until a run's first work)
    stamps: CommStamps | None = None
    # what the backend kept of an earlier run of these lanes for the next one (StreamBackend.keep)
    kept: Any = field(default=None, init=False, repr=False)

    def comm_records(self) -> list[CommRecord]:
        """Every tracked work as a :class:`CommRecord` (the backend knows its handles' fields)."""
        if self.stamps is not None and len(self.stamps) == len(self.comm):
            return self.stamps.records()
        return [self.backend.comm_record(w) for w in self.comm]


class StreamBackend(ABC):
    """Streams, events and comm completion for one kind of device.

    Event rule (vLLM's, kept everywhere): a ubatch records its done-event on the stream it leaves
    *before* yielding, and the stream it enters waits on it *after* resuming. Recording after the
    yield would cover the other ubatch's queued work and silently serialize them (vLLM #38451).
    """

    name: str = "?"
    #: The backend's device tensors are host tensors standing in for device ones (the simulator,
    #: :class:`asyncdbo.testing.fake_device.FakeDevice`): a host read of any tensor then counts as a device
    #: sync. False on a real device, where reading a CPU tensor waits for nothing.
    stand_in: bool = False

    @abstractmethod
    def attach(self, run: DBORun, state: RunStreams) -> None:
        """Give each lane of ``state`` its ``streams`` (role -> stream), ``events`` (role ->
        done-event) and starting ``stream`` (compute, also set as the ubatch's ``resume_with``).
        A role whose stream runs its work synchronously (the host's CPU) may get None for its
        done-event: nothing can be pending there, so leaving it records nothing and the stream
        entered next waits for nothing (the primitives skip both calls). Called once before the
        run starts."""

    def detach(self, run: DBORun, state: RunStreams) -> None:
        """Called after the run; restore whatever ``attach`` changed."""

    def keep(self, state: RunStreams) -> bool:
        """The run of ``state`` ended cleanly and its lanes are kept for a next run with as many
        ubatches (``asyncdbo.dbo``'s run shells), each lane's ``stream`` reset to None: return
        True to keep each lane's ``streams`` and ``events`` for that run's :meth:`attach`, after
        dropping everything of this run they hold, or False to have the lanes emptied (the
        default: ``attach`` builds every run's)."""
        return False

    @property
    def install_stream(self) -> Any:
        """Callable that makes a stream the device's current one, or None when there is nothing to
        install (host). The kernel calls it on every resume whose stream differs."""
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
    def submit(self, work: Any, lane: UBatchStreams | None, *, nbytes: int = 0, what: str = "comm",
               **options: Any) -> CommHandle:
        """Take a ``torch.distributed`` async work issued by the running ubatch (``lane``; None
        outside a run: wait for it at once) on its current stream. Returns a handle to wait on."""

    def comm_record(self, handle: Any) -> CommRecord:
        """The :class:`CommRecord` of a handle this backend put in ``RunStreams.comm``."""
        raise NotImplementedError(f"the {self.name} backend tracks no comm works")

    def describe(self) -> str:
        return self.name
