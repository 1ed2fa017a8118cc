"""The simulated device: predict what a DBO schedule gains on a GPU cluster, and check its event
order, on a laptop.

* :mod:`~asyncdbo.sim.devices`: device specs (H200, H100, Ascend 910B) with their sources;
* :mod:`~asyncdbo.sim.cost`: op durations from torch's FLOP formulas and bytes moved;
* :mod:`~asyncdbo.sim.clock`: virtual streams, events, engines and the timeline;
* :mod:`~asyncdbo.sim.races`: vector-clock happens-before checking, dead waits, lost overlap;
* :mod:`~asyncdbo.sim.predict`: serial vs DBO step time for the reference MoE model;
* the backend itself is :class:`asyncdbo.sim.backend.SimBackend` (``backend="sim"``).
"""

from __future__ import annotations

from .cost import CostModel, OpCost
from .devices import DEVICES, DeviceSpec, device_spec
from .races import DeadWait, LostOverlap, Race, SimCheckError, Site

__all__ = [
    "DEVICES",
    "CostModel",
    "DeadWait",
    "DeviceSpec",
    "LostOverlap",
    "OpCost",
    "Race",
    "SimCheckError",
    "Site",
    "device_spec",
]
