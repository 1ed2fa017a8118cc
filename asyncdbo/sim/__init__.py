"""The simulated device: check a DBO schedule's event order and predict what DBO gains on a GPU or
NPU cluster, on a laptop.

* :mod:`~asyncdbo.sim.backend`: :class:`SimBackend` (``backend="sim"``): virtual streams, the
  race checker, the host timeline; :mod:`~asyncdbo.sim.transfers`: where comm runs and who waits;
* :mod:`~asyncdbo.sim.races`: happens-before checking and the findings (races, dead waits, lost
  overlap); :mod:`~asyncdbo.sim.counterfactual`: the cost of lost overlap, measured by rerunning
  the schedule without it;
* :mod:`~asyncdbo.sim.cost`, :mod:`~asyncdbo.sim.kernels`, :mod:`~asyncdbo.sim.devices`,
  :mod:`~asyncdbo.sim.comm`, :mod:`~asyncdbo.sim.host`: what an op, a kernel, a transfer and a
  launch cost, with the presets and their sources;
* :mod:`~asyncdbo.sim.layer`: :func:`check_layer`, the user's own layer (``asyncdbo check --layer``);
* :mod:`~asyncdbo.sim.predict` (with :mod:`~asyncdbo.sim.shapes`, :mod:`~asyncdbo.sim.model`,
  :mod:`~asyncdbo.sim.models`): serial vs DBO for real architectures through the library's MoE
  layer;
* :mod:`~asyncdbo.sim.published`, :mod:`~asyncdbo.sim.calibration`: the published numbers, the
  calibration and the error band;
* :mod:`~asyncdbo.sim.workload`: replaying per-step batch compositions through the planner.
"""

from __future__ import annotations

from .cost import CostModel, OpCost
from .counterfactual import measure_lost_overlap
from .devices import DEVICES, DeviceSpec, device_spec
from .layer import LayerCheck, check_layer
from .races import DeadWait, LostOverlap, Race, SimCheckError, Site

__all__ = [
    "DEVICES",
    "CostModel",
    "DeadWait",
    "DeviceSpec",
    "LayerCheck",
    "LostOverlap",
    "OpCost",
    "Race",
    "SimCheckError",
    "Site",
    "check_layer",
    "device_spec",
    "measure_lost_overlap",
]
