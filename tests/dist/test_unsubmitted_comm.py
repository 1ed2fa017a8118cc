"""Comm the scheduler does not know about (issue 22, item 3), on 2 real gloo ranks.

A ubatch that issues ``dist.all_to_all_single(..., group=ubatch_group(), async_op=True)`` and
never hands the work to ``dbo_submit`` reads the output before it arrives: before this check,
such a layer's DBO steps differed from serial in 9 of 10 rank-steps with no error, and in 10 of
10 with ``debug=True``.

* debug mode fails the run at the ubatch's next yield, park or return, naming the line that
  issued the collective (and an op that reads its output before then fails at once);
* outside debug mode each ubatch that issued more collectives on the groups ``ubatch_group()``
  handed it than it submitted gets a ``RuntimeWarning`` when the run ends (a note, if the run
  failed), naming the line that asked for the group.

The layers are in tests/helpers/_comm_ranks.py (see its docstring for the variants).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncdbo.testing import RankPool

from _comm_ranks import steps

pytestmark = pytest.mark.slow



def own_failures(per_rank: list[list[dict]]) -> list[dict]:
    """Each step's records on the ranks that failed it by their own error; at least one rank did
    (a rank whose peer posted the same failure first has only the peer's line, see ``steps``)."""
    own = []
    for records in zip(*per_rank):  # one step on every rank
        assert any(r["notes"] is not None for r in records)
        own += [r for r in records if r["notes"] is not None]
    return own


HELPER = str(Path(__file__).resolve().parent.parent / "helpers" / "_comm_ranks.py")
SOURCE = Path(HELPER).read_text().splitlines()


def line(marker: str) -> int:
    """The helper's line that carries ``# SITE: marker``."""
    (number,) = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# SITE: {marker}")]
    return number


ADVICE = (
    "Pass each work to asyncdbo.dbo_submit(work, ...) right after issuing it, and await the handle (or a "
    "comm->compute switch) before reading the output."
)


def count_warning(ub: int, issued: int) -> str:
    return (
        f"ubatch {ub} issued {issued} collective(s) on the per-ubatch group(s) asyncdbo.ubatch_group() handed it at "
        f"{HELPER}:{line('ubatch_group')}, but handed only 0 work(s) to dbo_submit. The scheduler waits only for "
        "submitted works: an async one (async_op=True) it does not know is read before it arrives (wrong numbers), and "
        "a synchronous one blocks every ubatch on this thread. Pass each work to asyncdbo.dbo_submit(work, ...) right "
        "after issuing it; run_ubatches(..., debug=True) names the line of each collective it was not handed."
    )


@pytest.mark.timeout(180)
def test_debug_mode_fails_every_step_that_drops_a_work_naming_the_line_that_issued_it(pool: RankPool) -> None:
    # ubatch 0 is the first to yield after issuing: the run fails there, before it reads the rows
    expected = (
        f"UnsubmittedCommError: ubatch 0 yielded at 'experts' with 1 async collective(s) not handed to dbo_submit: "
        f"c10d.alltoall_base_ at {HELPER}:{line('issue')} in layer. The scheduler waits only for the works it knows, "
        "so this ubatch would read their output before it arrived (wrong numbers, or garbage split sizes). " + ADVICE
    )
    for per_rank in pool.run(steps, "dropped", True, 5):
        assert [r["error"] for r in per_rank] == [expected] * 5
        assert [r["warnings"] for r in per_rank] == [[]] * 5


@pytest.mark.timeout(120)
def test_debug_mode_fails_an_op_that_reads_the_output_before_the_work_is_submitted(pool: RankPool) -> None:
    for per_rank in pool.run(steps, "read_early", True, 2):
        for r in per_rank:
            assert r["error"] == (
                f"UnsubmittedCommError: ubatch 0 used the output of c10d.alltoall_base_ (issued with async_op=True at "
                f"{HELPER}:{line('issue')} in layer) in aten.mul.Tensor before handing its work to dbo_submit: nothing "
                "waited for it, so the data is not there yet. Pass the work to asyncdbo.dbo_submit(work, ...) right "
                "after issuing it, and await the handle (or a comm->compute switch) before reading the output."
            )


@pytest.mark.timeout(120)
def test_debug_mode_names_the_unsubmitted_collective_on_an_error_raised_after_it(pool: RankPool) -> None:
    per_rank = pool.run(steps, "raise_after", True, 2)
    for records in per_rank:
        assert [r["error"] for r in records] == ["ValueError: the layer failed after issuing its dispatch"] * 2
    for r in own_failures(per_rank):
        assert r["notes"] == [
            "asyncdbo: raised in ubatch 0 of 2 while running (last yield point 'dispatch'); the other ubatches "
            "were cancelled",
            f"asyncdbo: when this was raised, ubatch 0 had issued c10d.alltoall_base_ with async_op=True at "
            f"{HELPER}:{line('issue')} in layer and not handed its work to dbo_submit: its output was not ready "
            "to read",
        ]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("variant", ["submitted", "sync", "p2p_sync"])
def test_debug_mode_passes_submitted_works_and_collectives_that_wait_for_themselves(
    pool: RankPool, variant: str
) -> None:
    for per_rank in pool.run(steps, variant, True, 2):
        assert [(r["error"], r["warnings"], r["equal"]) for r in per_rank] == [(None, [], True)] * 2


@pytest.mark.timeout(180)
def test_outside_debug_mode_the_run_warns_for_each_ubatch_naming_the_line_that_asked_for_the_group(
    pool: RankPool,
) -> None:
    for per_rank in pool.run(steps, "dropped", False, 3):
        for r in per_rank:
            assert r["error"] is None
            # stacklevel: the warning points at the caller of run_ubatches
            assert r["warnings"] == [("RuntimeWarning", count_warning(ub, 1), HELPER) for ub in (0, 1)]


@pytest.mark.timeout(120)
def test_outside_debug_mode_a_failed_run_gets_the_count_as_a_note(pool: RankPool) -> None:
    per_rank = pool.run(steps, "raise_after", False, 2)
    for records in per_rank:
        assert [(r["error"], r["warnings"]) for r in records] == [
            ("ValueError: the layer failed after issuing its dispatch", [])] * 2
    for r in own_failures(per_rank):
        assert r["notes"][1:] == [f"asyncdbo: {count_warning(0, 1)}"]


@pytest.mark.timeout(120)
def test_outside_debug_mode_a_blocking_collective_on_gloo_warns_too(pool: RankPool) -> None:
    # correct numbers, but each one held the thread every ubatch runs on until the peer answered
    for per_rank in pool.run(steps, "p2p_sync", False, 2):
        for r in per_rank:
            assert r["equal"] is True
            assert r["warnings"] == [("RuntimeWarning", count_warning(ub, 2), HELPER) for ub in (0, 1)]


@pytest.mark.timeout(180)
def test_submitted_works_run_quietly_and_equal_the_serial_run(pool: RankPool) -> None:
    for per_rank in pool.run(steps, "submitted", False, 5):
        assert [(r["error"], r["warnings"], r["equal"]) for r in per_rank] == [(None, [], True)] * 5
