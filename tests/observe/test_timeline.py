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
            "otherData": {"asyncdbo": {"title": "asyncdbo demo: step 6 of 6 (1 warm-up + 5 timed), its DBO run (each step runs serial, then DBO)",
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


def drawn_styles(fig: Any) -> set[str]:
    palette = {matplotlib.colors.to_rgba(c): name for name, (c, _) in STYLES.items()}
    return {palette[tuple(c)] for coll in fig.axes[0].collections for c in coll.get_facecolors()}


def test_every_colour_drawn_is_defined_in_the_legend_and_no_other(fig: Any) -> None:
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    # ub1's dispatch runs under ub0's experts (hidden by another ubatch); blocking is not compute;
    # no comm runs under its own ubatch's compute here, so "own" is not in the legend
    assert drawn_styles(fig) == {"compute", "issue", "wait", "comm", "hidden", "blocking"}
    assert [entry.split(":", 1)[0] for entry in legend] == ["compute", "issue", "blocking", "wait", "comm", "hidden"]
    assert legend[-1] == "hidden: comm in flight while another ubatch computed: the overlap DBO adds"
    assert legend[1].startswith("issue: issuing comm")


def test_the_own_colour_is_defined_without_naming_a_shared_expert() -> None:
    # ub0 computes while its own dispatch is in flight: comm hidden by its own ubatch
    events = [span(0, 0, "compute", "ub0:start", 0, 10, **{"from": "start", "role": "comm"}),
              span(0, 0, "comm", "dispatch", 5, 20),
              span(0, 0, "compute", "ub0:attn", 10, 5, **{"from": "attn", "role": "compute"})]
    fig = timeline_figure({"traceEvents": events}, width_px=1200)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "own" in drawn_styles(fig) and "hidden" not in drawn_styles(fig)
    assert legend == [
        "compute: computing: a ubatch's step between two yields (label: the yield it resumed from)",
        "issue: issuing comm: a step that ends on the comm stream (label: the yield it resumed from)",
        "comm: comm in flight, exposed: no ubatch on this rank computed meanwhile (label: what was sent)",
        "own: comm in flight while its own ubatch computed (work between issuing it and waiting for it): no DBO needed",
    ]


def label_boxes(fig: Any) -> list[tuple[str, Any]]:
    """The labels as drawn: their text and pixel extent on the rendered figure."""
    renderer = fig.canvas.get_renderer()
    return [(t.get_text(), t.get_window_extent(renderer)) for t in fig.axes[0].texts]


def comm_works(*names: str) -> dict[str, Any]:
    """One rank, one ubatch: ``names`` sent at the same moment, in flight for the same 40 ms."""
    events = [span(0, 0, "compute", "ub0:start", 0, 10, **{"from": "start", "role": "comm"})]
    events += [span(0, 0, "comm", name, 10, 40) for name in names]
    return {"traceEvents": events}


def test_labels_of_works_in_flight_together_are_stacked_not_overlapped() -> None:
    fig = timeline_figure(comm_works("dispatch", "dispatch_ids"), width_px=800)
    boxes = label_boxes(fig)
    assert sorted(text for text, _ in boxes) == ["dispatch", "dispatch_ids", "start"]
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1:]:
            assert not box_a.overlaps(box_b), (a, b)
    heights = sorted(t.get_position()[1] for t in fig.axes[0].texts if t.get_text().startswith("dispatch"))
    assert heights[0] < 0 < heights[1]  # the comm lane is row 0: one label over its centre, one under
    assert not any("left out" in t.get_text() for t in fig.legends[0].get_texts())


def test_a_label_with_no_room_is_left_out_and_counted_in_the_legend() -> None:
    fig = timeline_figure(comm_works("dispatch", "dispatch_ids", "counts"), width_px=800)
    boxes = label_boxes(fig)
    assert sorted(text for text, _ in boxes) == ["dispatch", "dispatch_ids", "start"]  # the third has no row left
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1:]:
            assert not box_a.overlaps(box_b), (a, b)
    assert [t.get_text() for t in fig.legends[0].get_texts()][-1] == (
        "1 label(s) left out where works of one lane overlap (the JSON in ui.perfetto.dev names every one)")


def test_no_drawn_label_overlaps_another_or_leaves_its_bar(fig: Any) -> None:
    boxes = label_boxes(fig)
    for i, (a, box_a) in enumerate(boxes):
        for b, box_b in boxes[i + 1:]:
            assert not box_a.overlaps(box_b), (a, b)


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
    assert title[0] == "asyncdbo demo: step 6 of 6 (1 warm-up + 5 timed), its DBO run (each step runs serial, then DBO)"
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
