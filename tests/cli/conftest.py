"""The ``--launcher local`` demos run in this process on the session's shared ranks.

A demo starts its ranks through one seam, :func:`asyncdbo.cli.demo_config.start_ranks`; a test
that takes :func:`shared_demo_ranks` points it at the session's pool of that many ranks (left
open after the run; one a failed rank closed is replaced for the next test), instead of spawning
fresh ranks that import torch again: seconds per test on a loaded 2-core machine. The pool's
group timeout (``tests/conftest.py``) stands in for ``--timeout``, which none of these tests
sets. The tests of how the demo starts and ends its own processes (rank limits, signals,
``torchrun``, a terminal) do not take it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

from asyncdbo.cli import demo_config


@pytest.fixture
def shared_demo_ranks(rank_pools: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(demo_config, "start_ranks", lambda ranks, timeout_s: contextlib.nullcontext(rank_pools.get(ranks)))
