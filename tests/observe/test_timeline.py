"""The PNG timeline explains itself: read off the drawn figure's text and colours, on a trace
with fixed times (two ranks, two ubatches, one MoE layer: dispatch, experts, combine)."""

from __future__ import annotations

import re
from typing import Any

import matplotlib.colors
import pytest

from asyncdbo.observe.timeline import STYLES, timeline_figure


def span(pid: int, ub: int, kind: str, name: str, t_ms: float, dur_ms: float, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": kind, "pid": pid, "tid": ub * 100 + (kind == "comm"), "ts": t_ms * 1e3,
            "dur": dur_ms * 1e3, "args": {"ub": ub, "kind": kind, **args}}


def one_rank(pid: int, t0: float) -> list[dict[str, Any]]:
    """ub0 computes while ub1's dispatch is in flight, and the other way round (times in ms)."""
    return [
        span(pid, 0, "compute", "ub0:start", t0 + 0, 20, **{"from": "start", "role": "comm"}),
        span(pid, 1, "compute", "ub1:start", t0 + 20, 20, **{"from": "start", "role": "comm"}),
        span(pid, 0, "comm", "dispatch", t0 + 20, 30),
        span(pid, 0, "wait", "wait: dispatch", t0 + 20, 30),
        span(pid, 1, "comm", "dispatch", t0 + 40, 30),
        span(pid, 1, "wait", "wait: dispatch", t0 + 40, 30),
        span(pid, 0, "compute", "ub0:experts", t0 + 50, 20, **{"from": "experts", "role": "comm"}),
        span(pid, 0, "comm", "combine", t0 + 70, 30),
        span(pid, 1, "compute", "ub1:experts", t0 + 70, 20, **{"from": "experts", "role": "compute"}),
        span(pid, 0, "blocking", "ub0:combine", t0 + 100, 20, **{"from": "combine"}),
    ]


def trace() -> dict[str, Any]:
    numbers = {"wall_s": 0.12, "compute_s": 0.08, "comm_s": 0.09, "comm_hidden_s": 0.05, "comm_hidden_by_other_s": 0.04,
               "parked_s": 0.06, "switches": 4, "blocking_s": 0.02}
    return {"traceEvents": one_rank(0, 0.0) + one_rank(1, 7.5), "displayTimeUnit": "ms",
            "otherData": {"asyncdbo": {"title": "asyncdbo demo: the DBO run of step 6 of 6",
                                       "ranks": [{"rank": r, "steps": [numbers]} for r in (0, 1)]}}}


@pytest.fixture(scope="module")
def fig() -> Any:
    return timeline_figure(trace(), width_px=1600)


def test_bars_carry_their_tags(fig: Any) -> None:
    labels = [t.get_text() for t in fig.axes[0].texts]
    # comm bars name what was sent, compute bars the yield point they resumed from, waits what
    # they wait on: dispatch and combine no longer look alike
    assert sorted(set(labels)) == ["combine", "dispatch", "experts", "start"]
    assert labels.count("combine") == 2 * 2  # per rank: the combine sent, and the blocked step after it


def test_every_colour_drawn_is_defined_in_the_legend(fig: Any) -> None:
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert [entry.split(":", 1)[0] for entry in legend] == list(STYLES)
    assert legend[list(STYLES).index("hidden")] == "hidden: comm in flight while another ubatch computed: the overlap DBO adds"
    assert legend[list(STYLES).index("issue")].startswith("issue: issuing comm")
    palette = {matplotlib.colors.to_rgba(c): name for name, (c, _) in STYLES.items()}
    drawn = {palette[tuple(c)] for coll in fig.axes[0].collections for c in coll.get_facecolors()}
    # ub1's dispatch runs under ub0's experts (hidden by another ubatch); blocking is not compute
    assert drawn == {"compute", "issue", "wait", "comm", "hidden", "blocking"}


def test_ranks_are_aligned_and_the_offset_is_stated(fig: Any) -> None:
    (note,) = [t.get_text() for t in fig.texts]
    assert note == ("Ranks aligned: each is drawn from its own step start (x = 0); on the shared clock they started "
                    "at rank 0 +0.0 ms, rank 1 +7.5 ms. Blocked steps are drawn red.")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "ms since the rank's step start"
    # rank 1 began 7.5 ms later, yet its "start" steps sit where rank 0's do: centred at 10 and 30 ms
    centres = sorted(t.get_position()[0] for t in ax.texts if t.get_text() == "start")
    assert centres == [10.0, 10.0, 30.0, 30.0]


def test_the_title_names_the_step_as_the_caller_counts_it(fig: Any) -> None:
    title = fig.axes[0].get_title(loc="left").split("\n")
    assert title[0] == "asyncdbo demo: the DBO run of step 6 of 6"
    assert re.fullmatch(r"rank 0: 1 step\(s\), wall 120\.0 ms, compute 80\.0 ms, comm 90\.0 ms \(56% hidden, 44% by "
                        r"another ubatch\), parked 60\.0 ms, 4 yields, blocked 20\.0 ms", title[1]), title[1]


@pytest.mark.parametrize(("size", "message"), [
    ({"width_px": 0}, "PNG width 0 px is too narrow for a timeline; use at least 200"),
    ({"height_px": 50}, "PNG height 50 px is too short for a timeline; use at least 100 (or None to fit the lanes)"),
])
def test_a_size_too_small_is_named_alone(size: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError) as info:
        timeline_figure(trace(), **size)
    assert str(info.value) == message
