"""What a lost-overlap finding (:class:`~asyncdbo.sim.races.LostOverlap`) says, per kind: the
places it names and the fix, after its head (the kind and the counterfactual's cost)."""

from __future__ import annotations

from typing import Any

__all__ = ["describe"]


def describe(lo: Any, head: str) -> str:
    """The report of ``lo`` (a :class:`~asyncdbo.sim.races.LostOverlap`), starting with ``head``."""
    if lo.kind == "comm-wait-blocks-other":
        assert lo.other is not None and lo.blocked is not None
        return "\n".join([
            f"{head}: a wait on comm on stream {lo.site.stream} held up ubatch {lo.foreign_ubatch}'s work",
            *lo.site.lines(),
            *lo.other.lines("on the transfer: "),
            *lo.blocked.lines("held up: "),
            f"    ubatch {lo.site.ubatch} waited for its transfer before its own next op on the stream, so ubatch "
            f"{lo.foreign_ubatch}'s work queued meanwhile, which reads nothing the transfer delivered, could not "
            "run while it was in flight: wait where the data is used (after the yield), or on the ubatch's own stream",
        ])
    if lo.kind == "record-after-yield":
        assert lo.other is not None
        return "\n".join([
            f"{head}: a wait on stream {lo.site.stream} also waits for ubatch {lo.foreign_ubatch}'s work",
            *lo.site.lines(),
            *lo.other.lines("after a yield: "),
            f"    the event covers work ubatch {lo.foreign_ubatch} queued on stream {lo.other.stream} after "
            f"ubatch {lo.other.ubatch}'s own, so the ubatches serialize: record it before yielding",
        ])
    if lo.kind == "send-after-yield":
        return "\n".join([
            f"{head}: a transfer on stream {lo.site.stream} was issued after a yield its data did not need",
            *lo.site.lines("send "),
            f"    it was issued after a yield, so it leaves only once the work ubatch {lo.foreign_ubatch} "
            "queued meanwhile is done: issue the send before yielding",
        ])
    if lo.kind == "host-sync":
        return "\n".join([
            f"{head}: the host waits for stream {lo.site.stream} between yields",
            *lo.site.lines("host sync "),
            "    the CPU stops launching every ubatch's work until the stream drains: keep the value on the "
            "device (or read it where a yield has already queued the other ubatch's work)",
        ])
    if lo.kind == "comm-not-overlapped":
        return "\n".join([
            f"{head}: a transfer is used with no yield around it",
            *lo.site.lines("transfer "),
            "    its data was produced, sent and used between the same two yields, so no other ubatch's work "
            "could run while it was in flight: yield between the send and the use (or between the data and "
            "the send)",
        ])
    if lo.kind == "unneeded-comm-wait":
        assert lo.other is not None
        return "\n".join([
            f"{head}: compute on stream {lo.site.stream} waited for a transfer it does not read",
            *lo.site.lines(),
            *lo.other.lines("behind: "),
            "    it reads nothing the transfer delivered, yet was queued after the wait for it, so it could not "
            "run while the transfer was in flight: issue it before the wait (before the yield or the switch "
            "that waits)",
        ])
    if lo.kind == "empty-recv-hook":
        assert lo.other is not None
        return "\n".join([
            f"{head}: the recv hook of ubatch {lo.site.ubatch} received nothing",
            *lo.site.lines("the transfer: "),
            *lo.other.lines("first received by its owner: "),
            f"    ubatch {lo.site.ubatch} yielded with a recv hook out after this send, and the hook ran without waiting "
            "for the transfer, so its own wait received it instead (this fails whatever it cost here: with DeepEP's "
            "low-latency kernels only the hook launches the receive): register the receive as the hook "
            "(dbo_register_recv_hook(handle.stream_wait)), so the next ubatch launches it after queuing its own compute",
        ])
    if lo.kind == "compute-on-comm-stream":
        return "\n".join([
            f"{head}: a compute kernel runs on stream {lo.site.stream}",
            *lo.site.lines(),
            "    it shares the SMs with the compute stream and holds up the transfers queued behind it on "
            "the comm stream: switch to the compute stream for it",
        ])
    return "\n".join([
        f"{head}: ubatch {lo.site.ubatch} yielded holding the recv hook of ubatch {lo.foreign_ubatch}",
        *lo.site.lines(),
        f"    no dbo_maybe_run_recv_hook() ran before this yield, so ubatch {lo.foreign_ubatch}'s receive is "
        "launched late (when the holder parks, exits or next calls it): call it after queuing this ubatch's "
        "compute, before yielding",
    ])


