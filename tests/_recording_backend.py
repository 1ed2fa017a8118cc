"""A stream backend that records every stream/event call, to specify the primitives' ordering.

Streams are names ("compute", "comm", or "ub0"... under the ubatch policy) and events are named by
owner and role, so a test can assert the whole sequence of record/wait/install calls: the ordering
rules are the contract, and a CPU has no device queue to observe them on.
"""

from __future__ import annotations

from typing import Any

from asyncdbo._core import get_ubatch
from asyncdbo.streams.base import StreamBackend


class RecordingBackend(StreamBackend):
    name = "recording"

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self._n = 0

    def attach(self, run: Any, policy: str) -> None:
        run.backend = self
        for ub in run.ubatches:
            if policy == "role":
                ub.streams = {"compute": "compute", "comm": "comm"}
            else:
                own = f"ub{ub.id}"  # one stream object for both roles
                ub.streams = {"compute": own, "comm": own}
            ub.events = {"compute": f"ub{ub.id}.compute_done", "comm": f"ub{ub.id}.comm_done"}
            ub.stream = ub.streams["compute"]

    @property
    def install_stream(self) -> Any:
        return lambda s: self.log.append(f"install {s}")

    def new_event(self) -> str:
        self._n += 1
        return f"ev{self._n}"

    def record(self, event: Any, stream: Any) -> None:
        ub = get_ubatch()
        self.log.append(f"ub{ub.id if ub else '-'} record {event} on {stream}")

    def wait(self, stream: Any, event: Any) -> None:
        ub = get_ubatch()
        self.log.append(f"ub{ub.id if ub else '-'} {stream} waits {event}")
        return None

    def submit(self, work: Any, *, nbytes: int = 0, what: str = "comm") -> Any:
        raise NotImplementedError("the recording backend has no comm")
