"""A failed engine step changes nothing, on every rank: the failing rank raises its error, its
peers :class:`~asyncdbo.dist.StepAborted` naming it (never a wait for the group's timeout), and
calling ``run()`` again serves every request with the tokens of a clean run: none lost, none
changed. Failures in the model, in sampling and at admission, at a prefill step (0) and at a
decode step (3), on one rank and on two (:mod:`_engine_faults`)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("transformers")

from _engine_faults import Fault, clean_and_faulty, on_ranks  # noqa: E402

from asyncdbo.testing import RankPool  # noqa: E402

pytestmark = pytest.mark.timeout(240)

CASES = [Fault(where, step) for where in ("model", "sampling", "admission") for step in (0, 3)]


def _check(result: dict, outcome: str | None) -> None:
    clean, faulty = result["clean"], result["faulty"]
    assert clean["outcomes"] == []
    assert faulty["outcomes"] == ([] if outcome is None else [outcome])
    assert faulty["outputs"] == clean["outputs"] and len(clean["outputs"]) == 7
    assert faulty["steps"] == clean["steps"]  # a failed step is not a step
    assert faulty["free"] and faulty["statuses"] == ["finished"]


@pytest.mark.parametrize("fault", CASES, ids=lambda f: f"{f.where}-step{f.step}")
def test_one_rank_a_failed_step_is_retried_by_the_next_run_with_the_clean_runs_tokens(fault: Fault) -> None:
    result = asyncio.run(clean_and_faulty(None, 0, fault))
    _check(result, f"RuntimeError: injected {fault.where} failure at step {fault.step}")


@pytest.mark.slow
@pytest.mark.parametrize("fault", [Fault(f.where, f.step, rank=1) for f in CASES], ids=lambda f: f"{f.where}-step{f.step}")
def test_two_ranks_the_peer_of_a_failing_rank_is_told_its_name_and_both_serve_the_clean_tokens(
        pool: RankPool, fault: Fault) -> None:
    r0, r1 = pool.run(on_ranks, fault, timeout_s=200.0)
    message = f"injected {fault.where} failure at step {fault.step}"
    _check(r1, f"RuntimeError: {message}")
    _check(r0, f"StepAborted: step aborted: rank 1 failed it (RuntimeError: {message}); "
               "the next step recovers on every rank")



@pytest.mark.slow
@pytest.mark.parametrize("where", ["cancel-in-step", "cancel-between"])
def test_two_ranks_a_run_cancelled_on_one_rank_mid_step_or_between_steps_leaves_both_able_to_go_on(
        pool: RankPool, where: str) -> None:
    """Cancelled inside the runner's run, the step is undone on every rank and the peer is told;
    cancelled between steps, the peer waiting in the next agreement is told; cancelled while an
    agreement is in flight, the cancellation waits for the step's end. Every way, calling run()
    again serves the clean run's tokens on both ranks."""
    r0, r1 = pool.run(on_ranks, Fault(where, 3, rank=1), timeout_s=200.0)
    _check(r1, "CancelledError: ")
    peer = r0["faulty"]["outcomes"]
    assert peer in ([], ["StepAborted: step aborted: rank 1 failed it (cancelled); the next step recovers on every "
                         "rank"]), peer
    _check(r0, peer[0] if peer else None)
