"""A stream backend that records every stream/event call, to specify the primitives' ordering.

Streams are names ("compute", "comm", or "ub0"... under the ubatch policy) and events are named by
owner and role, so a test can assert the whole sequence of record/wait/install calls: the ordering
rules are the contract, and a CPU has no device queue to observe them on.
"""

from __future__ import annotations

from typing import Any

from asyncdbo.backends import RunStreams, StreamBackend, UBatchStreams
from asyncdbo.lowlevel import get_ubatch


class RecordingBackend(StreamBackend):
    name = "recording"

    def __init__(self, log: list[str]) -> None:
        self.log = log
        self._n = 0

    def attach(self, run: Any, state: RunStreams) -> None:
        for lane in state.lanes:
            i = lane.ub.id
            if state.policy == "role":
                lane.streams = {"compute": "compute", "comm": "comm"}
            else:
                own = f"ub{i}"  # one stream object for both roles
                lane.streams = {"compute": own, "comm": own}
            lane.events = {"compute": f"ub{i}.compute_done", "comm": f"ub{i}.comm_done"}
            lane.stream = lane.ub.resume_with = lane.streams["compute"]

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

    def submit(self, work: Any, lane: UBatchStreams | None, *, nbytes: int = 0, what: str = "comm", **options: Any) -> Any:
        raise NotImplementedError("the recording backend has no comm")
