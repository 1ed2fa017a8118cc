"""Shared test configuration.

Every async test runs on both event loops asyncdbo supports (asyncio's default loop and uvloop),
through pytest-asyncio's loop-factory hook.
"""

from __future__ import annotations

import asyncio

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
    uvloop = None


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict:
    factories = {"asyncio": asyncio.new_event_loop}
    if uvloop is not None:
        factories["uvloop"] = uvloop.new_event_loop
    return factories
