"""Every runner step is measured: the comm it exposed on the critical path, the comm other
ubatches hid, the comm its own ubatch hid, its time, and the configuration it ran; the runner's
report sums them up in one line (issue 26, item 1)."""

from __future__ import annotations

import pytest
from _measure_ranks import timed_steps

from asyncdbo.backends import CommRecord
from asyncdbo.dbo import RunStats
from asyncdbo.plan import PlanReason, StepRecord, StepTiming
from asyncdbo.serving import RunnerConfig
from asyncdbo.serving.measure import OverlapLedger, host_timing, shape_bucket, step_timing, union_s
from asyncdbo.testing import RankPool


def _stats(comm: tuple[CommRecord, ...], asleep: float, n: int = 2) -> RunStats:
    return RunStats(num_ubatches=n, num_switches=0, num_parks=0, time_asleep_s=asleep, comm=comm)


def test_union_counts_overlapping_intervals_once() -> None:
    assert union_s([]) == 0.0
    assert union_s([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0), (3.5, 3.6), (5.0, 5.0)]) == 3.0


def test_host_timing_splits_comm_into_exposed_hidden_by_others_and_own() -> None:
    # ub0's dispatch flies 0..4; ub0 computes until 1, then parks on it; ub1 computes 1..3, then
    # parks on its own work (issued at 2, ready at 5): everything parked 3..4 (exposed), then ub0
    # runs while ub1 waits for 4..5 (hidden by the other ubatch).
    comm = (
        CommRecord(ub=0, what="dispatch", nbytes=8, t_issue=0.0, t_done=4.0, t_wait=1.0),
        CommRecord(ub=1, what="dispatch", nbytes=8, t_issue=2.0, t_done=3.0, t_release=5.0, t_wait=3.0),
        CommRecord(ub=1, what="counts", nbytes=8, t_issue=0.5, t_done=0.75),  # done before any wait
    )
    t = host_timing(_stats(comm, asleep=1.0), step_s=6.0)
    assert t == StepTiming(step_s=6.0, num_ubatches=2, comm_s=5.0, exposed_s=1.0, hidden_by_others_s=3.0,
                           hidden_own_s=1.0, source="host")
    assert t.describe() == "step 6000.00 ms, comm 5000.00 ms (1000.00 exposed, 3000.00 hidden by other ubatches, 1000.00 by its own)"


def test_with_one_ubatch_all_waiting_is_exposed() -> None:
    # the kernel's asleep time reads a little short of the wait (its bookkeeping around the park):
    # with nobody else to run, none of the wait is hidden by another ubatch
    comm = (CommRecord(ub=0, what="dispatch", nbytes=8, t_issue=0.0, t_done=4.0, t_wait=1.0),)
    assert host_timing(_stats(comm, asleep=2.99998, n=1), step_s=5.0) == StepTiming(
        step_s=5.0, num_ubatches=1, comm_s=4.0, exposed_s=3.0, hidden_by_others_s=0.0, hidden_own_s=1.0,
        source="host")


def test_host_timing_without_comm() -> None:
    assert host_timing(_stats((), asleep=0.0, n=1), 0.5) == StepTiming(
        step_s=0.5, num_ubatches=1, comm_s=0.0, exposed_s=0.0, hidden_by_others_s=0.0, hidden_own_s=0.0, source="host")
    # parked on something no backend tracked (an accelerator's run): the step time alone
    assert host_timing(_stats((), asleep=0.1), 0.5) == StepTiming(step_s=0.5, num_ubatches=2)


def test_step_timing_summarizes_the_comm_of_every_kth_step_only() -> None:
    comm = (CommRecord(ub=0, what="dispatch", nbytes=8, t_issue=0.0, t_done=4.0, t_wait=1.0),)
    stats = _stats(comm, asleep=3.0)
    full = host_timing(stats, 5.0)
    assert [step_timing(stats, 5.0, step, 3) for step in range(4)] == [
        full, StepTiming(step_s=5.0, num_ubatches=2), StepTiming(step_s=5.0, num_ubatches=2), full]
    assert all(step_timing(stats, 5.0, step, 1) == full for step in range(3))


def test_measure_every_is_a_positive_int() -> None:
    with pytest.raises(ValueError, match=r"^measure_every \(0\) must be at least 1: the comm of every k-th step is "
                       r"summarized \(1: every step, the default; e\.g\. measure_every=16\)$"):
        RunnerConfig(measure_every=0)
    with pytest.raises(TypeError, match=r"^RunnerConfig\.measure_every must be an int, got float 2\.0; write measure_every=2$"):
        RunnerConfig(measure_every=2.0)  # type: ignore[arg-type]


def test_ledger_averages_the_comm_over_the_steps_that_have_it() -> None:
    ledger = OverlapLedger()
    full = StepTiming(step_s=2.0, num_ubatches=2, comm_s=1.0, exposed_s=0.5, hidden_by_others_s=0.25,
                      hidden_own_s=0.25, source="host")
    for step, timing in enumerate((full, StepTiming(step_s=2.0, num_ubatches=2))):
        rec = StepRecord(step=step, microbatched=True, reason=PlanReason.MICROBATCHED, ubatch_num_tokens=(4, 4),
                         config="N=2 token split", timing=timing)
        ledger.add(rec, 8, "decode 8-15")
    assert ledger.summary() == ("2 steps: N=2 token split 2 steps 250000.0 us/token, comm 1000.00 ms/step 50% exposed "
                                "25% hidden by other ubatches")


def test_shape_buckets() -> None:
    assert [shape_bucket(n, True) for n in (0, 1, 63, 64, 127, 128)] == [
        "idle", "decode 1-1", "decode 32-63", "decode 64-127", "decode 64-127", "decode 128-255"]
    assert shape_bucket(600, False) == "mixed 512-1023"


def _rec(step: int, config: str, step_s: float, microbatched: bool, reason: PlanReason = PlanReason.MICROBATCHED,
         comm: tuple[float, float, float] | None = None) -> StepRecord:
    timing = StepTiming(step_s=step_s, num_ubatches=2 if microbatched else 1)
    if comm is not None:
        timing = StepTiming(step_s=step_s, num_ubatches=timing.num_ubatches, comm_s=comm[0], exposed_s=comm[1],
                            hidden_by_others_s=comm[2], hidden_own_s=comm[0] - comm[1] - comm[2], source="host")
    return StepRecord(step=step, microbatched=microbatched, reason=reason, config=config, timing=timing)


def test_ledger_says_in_one_line_what_dbo_paid_and_why_steps_fell_out() -> None:
    ledger = OverlapLedger()
    assert ledger.summary() == "0 steps"
    ledger.add(_rec(0, "N=2 token auto", 0.010, True, comm=(0.004, 0.001, 0.003)), 100, "decode 64-127")
    ledger.add(_rec(1, "N=2 token auto", 0.010, True, comm=(0.004, 0.001, 0.003)), 100, "decode 64-127")
    ledger.add(_rec(2, "off", 0.012, False, PlanReason.DISABLED, comm=(0.004, 0.004, 0.0)), 100, "decode 64-127")
    ledger.add(_rec(3, "off", 0.002, False, PlanReason.BELOW_THRESHOLD, comm=(0.001, 0.001, 0.0)), 10, "decode 8-15")
    assert ledger.speedups() == [("decode 64-127", "N=2 token auto", pytest.approx(1.2))]
    assert ledger.summary() == (
        "4 steps: N=2 token auto 2 steps 100.0 us/token, comm 4.00 ms/step 25% exposed 75% hidden by other ubatches; "
        "off 2 steps 127.3 us/token, comm 2.50 ms/step 100% exposed 0% hidden by other ubatches; "
        "speedup vs off (off's time per token / DBO's, each summed over its steps): decode steps of 64-127 tokens, "
        "N=2 token auto 1.20x (2 vs 1 off steps); ran unsplit: 1 step below the token threshold (below_threshold), "
        "1 step with DBO off (disabled)")


def test_bucket_words() -> None:
    from asyncdbo.serving.measure import _bucket_words

    assert [_bucket_words(b) for b in ("decode 1-1", "mixed 64-127", "idle")] == [
        "decode steps of 1 token", "mixed steps of 64-127 tokens", "idle steps"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_runner_records_what_each_step_exposed_and_hid_on_a_modeled_link(pool: RankPool) -> None:
    results = pool.run(timed_steps, timeout_s=150.0)
    # Somewhere one ubatch computed while the other waited. Not in every step: on a loaded machine
    # the compute can outlast every message, and then the comm is done before anyone waits.
    assert any(rec.timing.hidden_by_others_s > 0 for r in results for rec in r["dbo"])
    for r in results:
        for rec in r["dbo"] + r["off"]:
            t = rec.timing
            assert t is not None and t.source == "host" and t.comm_s > 0 and t.step_s > t.exposed_s
            parts = t.exposed_s + t.hidden_by_others_s + t.hidden_own_s
            assert parts == pytest.approx(t.comm_s, rel=1e-9), t
        for rec in r["dbo"]:
            assert rec.microbatched and rec.config == "N=2 token split" and rec.timing.num_ubatches == 2
        for rec in r["off"]:
            assert not rec.microbatched and rec.config == "off" and rec.timing.num_ubatches == 1
            assert rec.timing.hidden_by_others_s == 0.0  # one ubatch: nobody else to hide it
        assert r["report"].startswith("4 steps: ")
        assert "N=2 token split 2 steps" in r["report"] and "off 2 steps" in r["report"]
        assert r["report"].endswith("ran unsplit: 2 steps with DBO off (disabled)")  # disabled on every rank: the vote says so


def test_the_array_fold_gives_the_unions_of_union_s_bit_for_bit() -> None:
    """host_timing folds the stamps as arrays; its unions are union_s's, to the last bit (the spans
    added in the same order), on random intervals with ties, empty ones and works in flight."""
    import random

    rng = random.Random(46)
    for trial in range(300):
        comm, flight, waits = [], [], []
        for _ in range(rng.randrange(0, 30)):
            start = rng.choice([round(rng.uniform(0, 10), 1), rng.uniform(0, 10)])
            end = rng.choice([start, start - 0.5, start + rng.uniform(0, 3)])
            wait = rng.choice([None, start + rng.uniform(-0.1, 2)])
            done = rng.random() > 0.1
            comm.append(CommRecord(ub=0, what="w", nbytes=1, t_issue=start, t_done=end if done else None, t_wait=wait))
            if done:
                flight.append((start, end))
                if wait is not None:
                    waits.append((wait, end))
        t = host_timing(_stats(tuple(comm), asleep=0.0), 1.0)
        if not comm:
            continue
        assert t.comm_s == union_s(flight), trial
        assert t.hidden_by_others_s == min(union_s(waits), union_s(flight)), trial
