"""EP dispatch/combine on a real 2-rank gloo group: uneven and zero-length splits, an idle rank,
serial and inside a DBO run, and the per-ubatch process groups."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from asyncdbo.testing import RankPool

from _moe_ranks import comm_round_trip, group_sizes, renew_sub_group_clones

pytestmark = pytest.mark.slow


# 4 experts over 2 ranks (2 local experts each); top-2 ids per token, flattened.
# Rank 0 sends tokens 0..2 to experts (0,3), (1,2), (0,1): 4 rows to itself, 2 rows to rank 1.
# Rank 1 sends one token to experts (2,3): nothing to rank 0 (a zero-length split), 2 rows to itself.
UNEVEN = [[0, 3, 1, 2, 0, 1], [2, 3]]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_run", [False, True], ids=["serial", "dbo"])
def test_uneven_and_zero_length_splits_round_trip(pool: RankPool, in_run: bool) -> None:
    r0, r1 = pool.run(comm_round_trip, UNEVEN, in_run)
    # rank 0 receives (source rank, local expert): from itself 2 rows for expert 0 and 2 for expert 1
    assert r0["recv_PL"] == [[2, 2], [0, 0]]
    # rows are (source rank, token), grouped by expert in flat (token, k) order:
    # expert 0 <- tokens 0, 2; expert 1 <- tokens 1, 2
    assert r0["recv_rows"] == [[0.0, 0.0], [0.0, 2.0], [0.0, 1.0], [0.0, 2.0]]
    assert r0["local_ids"] == [0, 0, 1, 1]
    # rank 1 holds experts 2, 3: token 1 of rank 0 (expert 2), token 0 of rank 0 (expert 3), then its own token
    assert r1["recv_PL"] == [[1, 1], [1, 1]]
    assert r1["recv_rows"] == [[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [1.0, 0.0]]
    assert r1["local_ids"] == [0, 1, 0, 1]
    assert [r["back_ok"] for r in (r0, r1)] == [True, True]
    assert [r["finish_ok"] for r in (r0, r1)] == [True, True]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_run", [False, True], ids=["serial", "dbo"])
def test_rank_with_no_tokens_still_takes_part(pool: RankPool, in_run: bool) -> None:
    r0, r1 = pool.run(comm_round_trip, [UNEVEN[0], []], in_run)
    assert r0["recv_PL"] == [[2, 2], [0, 0]]
    assert r1["recv_PL"] == [[1, 1], [0, 0]]
    assert r1["recv_rows"] == [[0.0, 1.0], [0.0, 0.0]]
    assert [r["back_ok"] and r["finish_ok"] for r in (r0, r1)] == [True, True]


@pytest.mark.timeout(60)
def test_each_ubatch_slot_gets_its_own_group_over_the_same_ranks(pool: RankPool) -> None:
    assert pool.run(group_sizes) == [[2, 2, 2, 2], [2, 2, 2, 2]]


@pytest.mark.timeout(60)
def test_a_sub_groups_clones_renew_again_and_again(pool: RankPool) -> None:
    # torch names them by a hash of the ranks and the number of live groups: without asyncdbo's
    # own suffix the second renewal's names were the first's ("already been created").
    assert pool.run(renew_sub_group_clones, 3) == [[3.0] * 6] * 2


@pytest.mark.timeout(90)
def test_destroy_process_groups_joins_every_groups_gloo_threads() -> None:
    """The torchrun abort at exit: gloo threads of groups that asyncdbo's caches kept alive needed
    the GIL while Python finalized. After destroy_process_groups() no group object is left, so
    each group's threads (2 workers and 1 transport loop) were joined before it returned."""
    from asyncdbo.testing import run_ranks

    from _moe_ranks import teardown_after_a_dbo_step

    for r in run_ranks(teardown_after_a_dbo_step, 2, timeout_s=60.0):
        assert r["groups"] == 5  # the default group and 4 per-ubatch clones (max_ubatches=4)
        assert r["alive_after"] == 0
        assert r["threads_joined"] >= 3 * r["groups"]


@pytest.mark.timeout(60)
def test_debug_mode_stops_two_ubatches_sharing_a_group_before_gloo_can_abort(pool: RankPool) -> None:
    from _moe_ranks import ubatches_share_the_default_group

    msgs = pool.run(ubatches_share_the_default_group, True)
    assert msgs[0] == msgs[1]
    assert msgs[0].startswith(
        "DBOUsageError: ubatches 0 and 1 both issue collectives on process group '0' in one run ("
    )
    assert msgs[0].endswith(
        ": their order across ranks is timing, and gloo aborts the process when ranks pair different ubatches' "
        "collectives. Call asyncdbo.ubatch_groups(2, group) once on every rank before the run, and issue each "
        "ubatch's collectives on asyncdbo.ubatch_group(group)."
    )


@pytest.mark.timeout(60)
def test_the_missing_clones_error_names_the_number_the_run_needs(pool: RankPool) -> None:
    from _moe_ranks import ubatch_group_without_clones

    msgs = pool.run(ubatch_group_without_clones)
    assert msgs[0].startswith("ubatch 0 needs its own clone of process group")
    assert "call asyncdbo.ubatch_groups(3, group) on every rank before the DBO run" in msgs[0]
