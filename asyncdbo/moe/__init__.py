"""The reference DP+EP Mixture-of-Experts layer, written as ``async def`` for DBO."""

from __future__ import annotations

from .config import MoEConfig
from .layer import MoELayer
from .router import route

__all__ = ["MoEConfig", "MoELayer", "route"]
