"""``asyncio.wait_for`` around a comm handle and around the role switch that waits for comm, on a
real 2-rank gloo group: the same data arrives as when they are awaited directly (the
troubleshooting page's table: wait_for behaves inside a ubatch as in a task)."""

from __future__ import annotations

import pytest

from asyncdbo.testing import RankPool

pytest.importorskip("torch", reason="real gloo ranks (CI runs tests/dbo on 3.12/3.13 without torch)")

from _wait_for_ranks import wait_for_comm  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_wait_for_around_comm_receives_what_awaiting_it_does(pool: RankPool) -> None:
    # rank r, ubatch u sends 10 r + u to every rank (then 100 more): each ubatch receives its own
    # ubatch's values from ranks 0 and 1, on its own group
    assert pool.run(wait_for_comm) == [[[0.0, 10.0, 100.0, 110.0], [1.0, 11.0, 101.0, 111.0]]] * 2
