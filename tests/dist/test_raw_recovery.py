"""Recovery on the raw API: ``run_ubatches`` on per-ubatch gloo groups, with no runner and no call
the user must remember. A run that is cancelled, times out or raises, at staggered points per
rank, leaves every rank able to run the next one, and the next ten equal the serial run bit for bit
(``_raw_recovery_ranks``: the tutorial's all-to-all layer, three per step).

Before, ``asyncio.wait_for(run_ubatches(...), 0.3)`` timing out and then a normal run on both ranks
aborted the process (gloo's "Received data size doesn't match expected size", SIGABRT, 3 of 3
tries), and the peer of a raising rank waited for its watchdog, or for ever without one.
"""

from __future__ import annotations

import pytest
from _raw_recovery_ranks import GOOD_STEPS, Fault, a_rank_that_never_asks, fail_then_ten, mismatched_max_ubatches

from asyncdbo.testing import RankPool

pytestmark = pytest.mark.slow

ABORTED = "StepAborted: step aborted: rank "
RECOVERS = "; the next step recovers on every rank"


def _recovered(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        assert r["equal"] == [True] * GOOD_STEPS, (rank, r)
        assert r["epochs"] == 1, (rank, r)  # one renewal on every rank: the renewals paired up


def _ended_by(outcome: str, *own: str) -> bool:
    return outcome in own or outcome.startswith(ABORTED)


@pytest.mark.timeout(180)
def test_two_ranks_cancelled_at_different_yields_then_ten_runs_equal_the_serial_run(pool: RankPool) -> None:
    results = pool.run(fail_then_ten, {0: Fault("cancel", 3), 1: Fault("cancel", 17)}, timeout_s=150)
    assert results[0]["outcome"] == "CancelledError"  # the first to cancel cannot have heard of another
    assert _ended_by(results[1]["outcome"], "CancelledError"), results[1]
    _recovered(results)


@pytest.mark.timeout(180)
def test_two_ranks_timed_out_at_different_yields_then_ten_runs_equal_the_serial_run(pool: RankPool) -> None:
    results = pool.run(fail_then_ten, {0: Fault("timeout", 14), 1: Fault("timeout", 5)}, timeout_s=150)
    assert results[1]["outcome"] == "TimeoutError"
    assert _ended_by(results[0]["outcome"], "TimeoutError"), results[0]
    _recovered(results)


@pytest.mark.timeout(180)
def test_wait_for_around_a_run_times_out_on_both_ranks_then_ten_runs_equal_the_serial_run(pool: RankPool) -> None:
    # The reproduction: rank 1 is busy for 1 s, both runs sit in wait_for(..., 0.3).
    faults = {0: Fault("wait_for", 3), 1: Fault("wait_for", 3, block_s=1.0)}
    results = pool.run(fail_then_ten, faults, timeout_s=150)
    assert results[0]["outcome"] == "TimeoutError"
    assert _ended_by(results[1]["outcome"], "TimeoutError"), results[1]
    _recovered(results)


@pytest.mark.timeout(120)
def test_two_ranks_a_raising_rank_is_named_by_its_peer_with_the_watchdog_off(pool: RankPool) -> None:
    # No watchdog, and the pool's call limit (40 s) is below gloo's collective timeout (60 s): the
    # peer can only fail in time because the failing rank told it.
    results = pool.run(fail_then_ten, {1: Fault("raise", 1)}, None, timeout_s=40)
    assert results[1]["outcome"] == "RuntimeError: expert weights lost in layer 1"
    assert results[0]["outcome"] == f"{ABORTED}1 failed it (RuntimeError: expert weights lost in layer 1){RECOVERS}"
    _recovered(results)


@pytest.mark.timeout(180)
def test_four_ranks_cancelled_at_staggered_yields_then_ten_runs_equal_the_serial_run(pool4: RankPool) -> None:
    faults = {0: Fault("cancel", 9), 1: Fault("cancel", 2), 2: Fault("cancel", 25), 3: Fault("cancel", 14)}
    results = pool4.run(fail_then_ten, faults, timeout_s=150)
    assert results[1]["outcome"] == "CancelledError"
    assert all(_ended_by(r["outcome"], "CancelledError") for r in results), [r["outcome"] for r in results]
    _recovered(results)


@pytest.mark.timeout(180)
def test_four_ranks_one_cancels_one_times_out_one_raises_then_ten_runs_equal_the_serial_run(pool4: RankPool) -> None:
    faults = {0: Fault("cancel", 11), 1: Fault("timeout", 6), 2: Fault("raise", 2)}
    results = pool4.run(fail_then_ten, faults, None, timeout_s=150)
    own = {0: "CancelledError", 1: "TimeoutError", 2: "RuntimeError: expert weights lost in layer 2"}
    for rank, r in enumerate(results):
        assert _ended_by(r["outcome"], *own.values()), (rank, r)
        assert r["outcome"] in (own.get(rank), *[o for o in (r["outcome"],) if o.startswith(ABORTED)]), (rank, r)
    _recovered(results)


@pytest.mark.timeout(120)
def test_four_ranks_a_raising_rank_is_named_by_every_peer_with_the_watchdog_off(pool4: RankPool) -> None:
    results = pool4.run(fail_then_ten, {2: Fault("raise", 1)}, None, timeout_s=40)
    assert results[2]["outcome"] == "RuntimeError: expert weights lost in layer 1"
    for rank in (0, 1, 3):
        assert results[rank]["outcome"] == f"{ABORTED}2 failed it (RuntimeError: expert weights lost in layer 1){RECOVERS}"
    _recovered(results)


@pytest.mark.timeout(180)
def test_four_ranks_a_stopped_rank_is_the_one_every_survivor_names(pool4: RankPool) -> None:
    # Rank 1 stops itself (SIGSTOP) mid-run; the survivors' watchdogs (2 s) fire, and whichever
    # fires first, the roll call names rank 1 on all of them. Rank 0 resumes rank 1 afterwards.
    results = pool4.run(fail_then_ten, {1: Fault("stop")}, 2.0, timeout_s=150)
    for rank in (0, 2, 3):
        outcome = results[rank]["outcome"]
        assert outcome.startswith(f"{ABORTED}1 failed it (silent: no answer to a roll call within 5 s after rank "), outcome
        assert outcome.endswith(f"'s wait ran out, so it is stopped, hung or dead; silent rank(s) [1]){RECOVERS}"), outcome
    assert results[1]["outcome"].startswith(ABORTED), results[1]
    _recovered(results)


@pytest.mark.timeout(120)
def test_ranks_built_with_different_max_ubatches_get_an_error_naming_each_value(pool: RankPool) -> None:
    msgs = pool.run(mismatched_max_ubatches, timeout_s=60)
    assert msgs[0] == msgs[1]
    assert msgs[0].startswith("ranks ask for different numbers of per-ubatch clones of process group ")
    assert msgs[0].endswith(
        " (rank 0: 2, rank 1: 4); making a clone is a collective, so the ranks that ask for more would wait for the "
        "others until the group timeout. Build every rank's model with the same max_ubatches (call "
        "ubatch_groups(n, group) with one n on every rank)"
    )


@pytest.mark.timeout(120)
def test_a_rank_that_never_asks_for_clones_is_named_after_the_group_timeout(pool: RankPool) -> None:
    msgs = pool.run(a_rank_that_never_asks, timeout_s=60)
    assert msgs[1] == "built"
    assert msgs[0].startswith("ubatch_groups(2) on process group ")
    assert msgs[0].endswith(
        ": rank(s) [1] did not ask for per-ubatch clones of it within 2 s (the group timeout), so they would never "
        "take part in making them. Every rank of the group must call ubatch_groups(n, group) with the same n at the "
        "same point (build every rank's model with the same max_ubatches)"
    )
