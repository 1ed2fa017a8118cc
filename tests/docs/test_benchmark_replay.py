"""The replay of a run's own schedule (benchmarks/_replay.py, reported by moe_step.py), on
hand-built traces with exact times, and the dependencies the recorder reads off a real run.

Times are binary fractions, so every sum is exact and the replay's times compare with ``==``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # the benchmarks' helpers

from _replay import Msg, SetBy, Step, replay  # noqa: E402

from asyncdbo.backends.links import LinkSpec  # noqa: E402

#: 0.25 s latency, 4 bytes per second: a message of n bytes holds the link n / 4 s.
LINK = LinkSpec(name="test", latency_s=0.25, bandwidth_Bps=4.0)


def test_without_messages_the_replay_is_the_sum_of_the_steps() -> None:
    steps = [[Step(duration_s=1.0), Step(duration_s=0.5)], [Step(duration_s=0.25), Step(duration_s=2.0)]]
    assert replay(steps, [], LINK) == 3.75


def test_a_ubatch_woken_while_the_other_runs_waits_for_that_step_to_end() -> None:
    # ub0 issues 2 bytes 0.5 s into its first step: released at 0.5 + 0.25 + 0.5 = 1.25, while ub1's
    # 2 s step (1..3) runs. ub0 resumes at 3 (ahead of ub1, which switched), not at 1.25.
    steps = [[Step(duration_s=1.0), Step(duration_s=1.0, parked=True, after_msgs=(0,))],
             [Step(duration_s=2.0), Step(duration_s=0.5)]]
    assert replay(steps, [Msg(ub=0, step=0, offset_s=0.5, nbytes=2)], LINK) == 3.0 + 1.0 + 0.5


def test_the_link_is_shared_in_issue_order() -> None:
    # Two 4-byte messages, issued at 0.5 and 1.0, each hold the link 1 s: the second starts when the
    # first frees it (1.5), so it is released at 1.5 + 0.25 + 1 = 2.75, not at 2.25.
    steps = [[Step(duration_s=0.5), Step(duration_s=0.25, parked=True, after_msgs=(i,))] for i in (0, 1)]
    msgs = [Msg(ub=i, step=0, offset_s=0.5, nbytes=4) for i in (0, 1)]
    assert replay(steps, msgs, LINK) == 2.75 + 0.25


def test_a_ubatch_that_parked_on_what_already_arrived_goes_to_the_back_of_the_queue() -> None:
    # ub0's message (0 bytes, issued at 0) is released at 0.25, before its 0.5 s step ends; the run
    # parked there, so ub0 queues behind ub1 (0.5..0.75, whose message arrives at 1), runs 0.75..1.25,
    # then ub1. Had ub0 kept the CPU, ub1's message would have come at 1.5, the end at 1.75.
    steps = [[Step(duration_s=0.5), Step(duration_s=0.5, parked=True, after_msgs=(0,))],
             [Step(duration_s=0.25), Step(duration_s=0.25, parked=True, after_msgs=(1,))]]
    msgs = [Msg(ub=0, step=0, offset_s=0.0), Msg(ub=1, step=0, offset_s=0.25)]
    log: list[tuple[int, int, float]] = []
    assert replay(steps, msgs, LINK, log) == 1.5
    assert log == [(0, 0, 0.0), (1, 0, 0.5), (0, 1, 0.75), (1, 1, 1.25)]


def test_a_ubatch_that_switched_parks_at_the_head_until_its_message_arrives() -> None:
    # ub0 switched after issuing (released at 0.75); at the head at 0.625 it parks, ub1 runs its
    # last step, the CPU idles until 0.75, then ub0 runs.
    steps = [[Step(duration_s=0.5), Step(duration_s=0.5, after_msgs=(0,))],
             [Step(duration_s=0.125), Step(duration_s=0.125)]]
    assert replay(steps, [Msg(ub=0, step=0, offset_s=0.5)], LINK) == 1.25


def test_a_signal_set_by_another_step_wakes_the_waiter_when_that_step_ends() -> None:
    # ub1 sets ub0's signal (a recv hook) 0.125 s into its 1 s step (0.5..1.5): ub0 runs at 1.5.
    steps = [[Step(duration_s=0.5), Step(duration_s=0.5, parked=True, after_sets=(SetBy(ub=1, step=0, offset_s=0.125),))],
             [Step(duration_s=1.0), Step(duration_s=0.25)]]
    assert replay(steps, [], LINK) == 2.25


def test_without_a_link_model_messages_take_their_measured_time() -> None:
    steps = [[Step(duration_s=1.0), Step(duration_s=0.5, parked=True, after_msgs=(0,))], [Step(duration_s=0.25)]]
    assert replay(steps, [Msg(ub=0, step=0, offset_s=0.5, nbytes=1 << 20, measured_s=1.5)], None) == 2.5


def test_a_trace_that_cannot_finish_is_refused() -> None:
    steps = [[Step(duration_s=0.5), Step(duration_s=0.5, parked=True, after_sets=(SetBy(ub=0, step=1, offset_s=0.0),))]]
    with pytest.raises(ValueError, match=r"^the trace deadlocks: ubatches wait for what no step produces: "
                                         r"\{0: \[\"\('set', 0, 1, 0.0\)\"\]\}$"):
        replay(steps, [], LINK)


def test_a_message_outside_its_step_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^message 0 is issued 0.75 s into a step of 0.5 s; the offset must lie "
                                         r"inside its step$"):
        replay([[Step(duration_s=0.5)]], [Msg(ub=0, step=0, offset_s=0.75)], LINK)


# ------------------------------------------------------------------ the recorder, on a real run
@pytest.fixture(scope="module")
def recorded(rank_pools: Any) -> list[tuple[Any, list[tuple[int, str]]]]:
    from _replay_ranks import recorded_run

    return rank_pools.get(2).run(recorded_run)  # type: ignore[no-any-return]


@pytest.mark.timeout(120)
def test_the_recorder_ties_each_park_to_what_woke_it(recorded: list[tuple[Any, list[tuple[int, str]]]]) -> None:
    """See tests/helpers/_replay_ranks.py: every ubatch parks on a message awaited directly and on
    a role-stream wait; ubatch 0 also parks on the recv hook that ubatch 1 runs in its first step."""
    from _replay_ranks import LINK as RUN_LINK

    for (steps, msgs), whats in recorded:
        msg = {uw: i for i, uw in enumerate(whats)}
        assert sorted(whats) == [(0, "direct"), (0, "streamed"), (1, "direct"), (1, "streamed")]
        assert [[st.parked for st in ub] for ub in steps] == [[False, True, False, True, False, False, True],
                                                              [False, False, False, True, False, False, True]]
        assert [(m.ub, m.step) for m in msgs] == [(u, 1 if w == "direct" else 4) for u, w in whats]
        hook = steps[0][1].after_sets
        assert [(s.ub, s.step) for s in hook] == [(1, 0)] and hook[0].offset_s <= steps[1][0].duration_s
        for u in (0, 1):
            assert steps[u][3].after_msgs == (msg[u, "direct"],)  # the direct await
            # the role-stream wait: its own work, and the other ubatch's if it was on the shared stream
            assert msg[u, "streamed"] in steps[u][6].after_msgs
            assert set(steps[u][6].after_msgs) <= {msg[0, "streamed"], msg[1, "streamed"]}
            assert [st.after_msgs for k, st in enumerate(steps[u]) if k not in (3, 6)] == [()] * 5
        # one ubatch's two messages are waited for one after the other, each held >= the latency
        assert replay(steps, msgs, RUN_LINK) >= 2 * RUN_LINK.latency_s
