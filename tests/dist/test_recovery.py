"""Step recovery on real gloo ranks: a step that fails or is cancelled on any rank, at any point,
leaves every rank able to run the next one, and the next ones compute what they computed before.

Before recovery existed, the step after a staggered cancel aborted the process within a second:
gloo's "Received data size doesn't match expected size" (a stale all-to-all of the failed step
paired with the next step's first one). Each test runs ten DBO steps and ten serial steps on
healthy groups, the failing step, then the same ten batches with DBO again: they must equal the
DBO run before the failure bitwise and the serial run within the runner's tolerance (EP changes
which rows the expert matmuls block together: not bitwise against serial).
"""

from __future__ import annotations

import pytest
from _recovery_ranks import GOOD_STEPS, Failure, fail_then_step

from asyncdbo.testing import RankPool

pytestmark = pytest.mark.slow

TOL = 1e-5


def _check_recovered(results: list[dict], expected_epochs: int = 1) -> None:
    for rank, r in enumerate(results):
        assert r["epochs"] == expected_epochs, (rank, r)
        assert r["microbatched"] == [True] * GOOD_STEPS, (rank, r)
        assert r["equal_before_after"] == [True] * GOOD_STEPS, (rank, r)
        assert r["max_diff_serial"] <= TOL, (rank, r)


def _ended_by_failure(outcome: str) -> bool:
    return outcome == "cancelled" or outcome.startswith("StepAborted: step aborted: rank ")


@pytest.mark.timeout(120)
def test_two_ranks_cancel_a_step_at_different_yields_then_ten_steps_equal_the_serial_run(pool: RankPool) -> None:
    results = pool.run(fail_then_step, Failure(cancel_after=(3, 17)), timeout_s=90.0)
    assert results[0]["outcome"] == "cancelled"
    assert _ended_by_failure(results[1]["outcome"]), results[1]["outcome"]
    _check_recovered(results)


@pytest.mark.timeout(120)
def test_four_ranks_cancel_a_step_at_staggered_yields_then_ten_steps_equal_the_serial_run(pool4: RankPool) -> None:
    results = pool4.run(fail_then_step, Failure(cancel_after=(9, 2, 25, 14)), timeout_s=90.0)
    assert results[1]["outcome"] == "cancelled"  # the first to cancel cannot have heard of another
    assert all(_ended_by_failure(r["outcome"]) for r in results), [r["outcome"] for r in results]
    _check_recovered(results)


@pytest.mark.timeout(120)
def test_two_ranks_one_ubatch_raises_the_peer_is_told_which_rank_then_ten_good_steps(pool: RankPool) -> None:
    results = pool.run(fail_then_step, Failure(raise_on=1), timeout_s=90.0)
    assert results[1]["outcome"] == "RuntimeError: expert weights lost in ubatch 1"
    assert results[0]["outcome"] == (
        "StepAborted: step aborted: rank 1 failed it (RuntimeError: expert weights lost in ubatch 1); "
        "the next step recovers on every rank"
    )
    _check_recovered(results)


@pytest.mark.timeout(120)
def test_four_ranks_one_ubatch_raises_every_peer_names_it_then_ten_good_steps(pool4: RankPool) -> None:
    results = pool4.run(fail_then_step, Failure(raise_on=2), timeout_s=90.0)
    assert results[2]["outcome"] == "RuntimeError: expert weights lost in ubatch 1"
    for rank in (0, 1, 3):
        assert results[rank]["outcome"].startswith("StepAborted: step aborted: rank 2 failed it (RuntimeError: "), rank
    _check_recovered(results)


@pytest.mark.timeout(120)
def test_a_rank_that_fails_after_the_last_collective_recovers_its_peers_at_the_next_run(pool: RankPool) -> None:
    # Rank 0 finished the step; rank 1's failure notice is in the store before rank 1 joins the
    # next step's vote, so rank 0's next run reads it and renews with rank 1.
    results = pool.run(fail_then_step, Failure(late_on=1), timeout_s=90.0)
    assert [r["outcome"] for r in results] == ["completed", "completed"]
    _check_recovered(results)
