"""The host (CPU) timeline of a simulated run: what launching kernels and blocking syncs cost.

A device op cannot start before the CPU has launched it. All ubatches share one CPU thread, so the
sim keeps one host clock ``t``: every kernel launch advances it by ``launch_s`` and the op becomes
ready no earlier than the launch ends; every collective by ``comm_launch_s``; every ubatch switch
by ``switch_s``. A blocking sync (every op :mod:`asyncdbo.syncs` counts: a read to the
host such as ``.item()``, ``int(t)`` or ``.tolist()``, or an op whose output size depends on the
data such as ``nonzero``, ``unique`` or ``repeat_interleave`` without ``output_size``; e.g. the
receive counts of a dispatch) moves the host clock to the end of the work queued on the
stream it reads, so a CPU that waits leaves the device without new work: the bubble DeepEP's
normal dispatch causes when nothing else was queued before it (SGLang's "launch order").

``graph`` replays a captured graph: kernels cost no CPU time each, one ``replay_s`` per run.
(A captured graph cannot contain a host sync; a schedule that syncs still pays for it here, so
``graph`` with such a schedule is optimistic only about launches.)

Presets are modeling choices, not measurements: ``eager`` charges 5 us per kernel and 10 us per
collective (PyTorch's Python-to-driver path), ``graph`` charges nothing per kernel and 10 us per
replay, ``none`` makes the host free (the device timeline alone: what the sim did before it had
a host, and what hand-computed timelines in the tests assume). Override any field:
``host_spec("eager", launch_s=8e-6)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.links import preset

__all__ = ["HOSTS", "HostSpec", "HostTimeline", "host_spec"]


@dataclass(frozen=True, kw_only=True)
class HostSpec:
    """CPU costs of issuing work (seconds)."""

    name: str
    launch_s: float
    comm_launch_s: float
    switch_s: float
    graph: bool = False
    replay_s: float = 0.0

    def __post_init__(self) -> None:
        for f in ("launch_s", "comm_launch_s", "switch_s", "replay_s"):
            if getattr(self, f) < 0:
                raise ValueError(f"HostSpec {self.name!r}: {f} must be >= 0 (got {getattr(self, f)!r})")


HOSTS: dict[str, HostSpec] = {
    "none": HostSpec(name="none", launch_s=0.0, comm_launch_s=0.0, switch_s=0.0),
    "eager": HostSpec(name="eager", launch_s=5e-6, comm_launch_s=10e-6, switch_s=0.3e-6),
    "graph": HostSpec(name="graph", launch_s=0.0, comm_launch_s=0.0, switch_s=0.0, graph=True, replay_s=10e-6),
}


def host_spec(name_or_spec: str | HostSpec, **overrides: object) -> HostSpec:
    """A preset by name (``eager``, ``graph``, ``none``), with fields overridden."""
    return preset(HOSTS, name_or_spec, "host", **overrides)


class HostTimeline:
    """The one CPU thread of a run on the virtual clock (see the module docstring)."""

    def __init__(self, spec: HostSpec) -> None:
        self.spec = spec
        self.t = spec.replay_s if spec.graph else 0.0
        self.blocked_s = 0.0  # time the CPU spent waiting in syncs
        self.syncs = 0

    def launch(self) -> float:
        """A kernel launch: the time the device may start it."""
        self.t += self.spec.launch_s
        return self.t

    def launch_comm(self) -> float:
        self.t += self.spec.comm_launch_s
        return self.t

    def switch(self) -> None:
        self.t += self.spec.switch_s

    def sync(self, until: float) -> None:
        """A blocking read of work that ends at ``until``."""
        self.syncs += 1
        if until > self.t:
            self.blocked_s += until - self.t
            self.t = until
