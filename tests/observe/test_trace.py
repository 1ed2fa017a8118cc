"""Tracer: spans and numbers of a step, Chrome trace export, profiler ranges, PNG, `asyncdbo trace`."""

from __future__ import annotations

import asyncio
import json
import struct
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from asyncdbo import dbo_current_ubatch_id, dbo_yield, run_ubatches
from asyncdbo.cli import main as cli_main
from asyncdbo.cli.trace import COLUMN_NOTES
from asyncdbo.observe import (
    RunNumbers,
    Tracer,
    hidden_seconds,
    merge_traces,
    union_seconds,
)
from asyncdbo.observe.timeline import render_png
from asyncdbo.plan.records import PlanReason, StepRecord

pytestmark = pytest.mark.timeout(60)


async def two_stage(x: int) -> int:
    await dbo_yield("attn")
    x += 1
    await dbo_yield("moe")
    return x * 2


async def parks_on_a_timer(x: int) -> int:
    await dbo_yield("attn")
    if dbo_current_ubatch_id() == 0:
        await asyncio.sleep(0.02)  # ubatch 0 waits; ubatch 1 runs on
    await dbo_yield("moe")
    return x


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# ----------------------------------------------------------------------------------- intervals
def test_union_and_hidden_seconds_count_overlaps_once() -> None:
    comm = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]  # union: [0, 3] + [5, 6] = 4 s
    compute = [(2.5, 5.5), (0.5, 1.0), (0.8, 0.9)]  # union: [0.5, 1] + [2.5, 5.5]
    assert union_seconds(comm) == 4.0
    assert hidden_seconds(comm, compute) == pytest.approx(0.5 + 0.5 + 0.5)
    assert union_seconds([]) == 0.0 and hidden_seconds([], compute) == 0.0


# ----------------------------------------------------------------------------------- spans
@pytest.mark.asyncio
async def test_spans_follow_the_round_robin_with_yield_points_between_them() -> None:
    tracer = Tracer(rank=3)
    assert await run_ubatches(two_stage, [(1,), (10,)], backend="host", instrument=tracer, name="s") == [4, 22]
    assert [(s.ub, s.kind, s.name, s.args["to"]) for s in tracer.spans()] == [
        (0, "compute", "ub0:start", "attn"),
        (1, "compute", "ub1:start", "attn"),
        (0, "compute", "ub0:attn", "moe"),
        (1, "compute", "ub1:attn", "moe"),
        (0, "compute", "ub0:moe", "finished"),
        (1, "compute", "ub1:moe", "finished"),
    ]
    spans = tracer.spans()
    assert all(a.t1 <= b.t0 for a, b in zip(spans, spans[1:]))  # one thread: CPU steps never overlap
    assert [(ub, tag) for ub, tag, _ in tracer.steps[0].instants] == [(0, "attn"), (1, "attn"), (0, "moe"), (1, "moe")]
    n = tracer.numbers()
    assert (n.rank, n.step, n.name, n.backend, n.num_ubatches) == (3, 0, "s", "host", 2)
    assert (n.switches, n.parks, n.yields_per_ubatch) == (4, 0, (2, 2))
    assert (n.comm_s, n.comm_hidden_s, n.comm_hidden_share, n.num_comm_works, n.parked_s) == (0.0, 0.0, 0.0, 0, 0.0)
    assert n.compute_s == pytest.approx(sum(s.t1 - s.t0 for s in spans))
    assert n.wall_s >= n.compute_s


@pytest.mark.asyncio
async def test_a_park_is_a_wait_span_and_counts_as_time_parked() -> None:
    tracer = Tracer()
    await run_ubatches(parks_on_a_timer, [(0,), (1,)], backend="host", instrument=tracer)
    spans = tracer.spans()
    assert [(s.ub, s.kind, s.name) for s in spans] == [
        (0, "compute", "ub0:start"),
        (1, "compute", "ub1:start"),
        (0, "compute", "ub0:attn"),  # ends parked on the timer's future
        (0, "wait", "wait: Future"),
        (1, "compute", "ub1:attn"),
        (1, "compute", "ub1:moe"),  # ubatch 1 finishes while ubatch 0 still waits
        (0, "compute", "ub0:attn"),  # the rest of ubatch 0's stage, after the wait
        (0, "compute", "ub0:moe"),
    ]
    assert spans[2].args["to"] == "parked on Future"
    wait = spans[3]
    assert wait.t1 - wait.t0 >= 0.015  # a 20 ms timer; uvloop's timers have 1 ms resolution and may fire early
    n = tracer.numbers()
    assert (n.switches, n.parks, n.yields_per_ubatch) == (4, 1, (2, 2))
    assert n.parked_s == pytest.approx(wait.t1 - wait.t0)
    assert 0 < n.idle_s <= n.parked_s


@pytest.mark.asyncio
async def test_steps_are_kept_apart_and_carry_their_plan_record() -> None:
    tracer = Tracer()
    tracer.mark_step(StepRecord(step=0, microbatched=True, reason=PlanReason.MICROBATCHED))
    await run_ubatches(two_stage, [(1,), (2,)], backend="host", instrument=tracer)
    tracer.mark_step(StepRecord(step=1, microbatched=False, reason=PlanReason.BELOW_THRESHOLD))
    await run_ubatches(two_stage, [(1,)], backend="host", instrument=tracer)
    first, second = tracer.step_numbers()
    assert (first.step, first.microbatched, first.reason, first.yields_per_ubatch) == (0, True, "microbatched", (2, 2))
    assert (second.step, second.microbatched, second.reason, second.yields_per_ubatch) == (1, False, "below_threshold", (2,))
    assert tracer.numbers() == second
    assert second.summary().endswith(", 2 switches, yields/ub [2], not microbatched (below_threshold)")
    with pytest.raises(ValueError, match=r"mark_step expects a record with \.microbatched and \.reason"):
        tracer.mark_step("microbatched")
    with pytest.raises(ValueError, match=r"this Tracer has recorded no step yet"):
        Tracer().numbers()


# ----------------------------------------------------------------------------------- export
def check_chrome_trace(trace: dict) -> None:
    """The Chrome trace event format, as ui.perfetto.dev and chrome://tracing read it."""
    assert set(trace) == {"traceEvents", "displayTimeUnit", "otherData"} and trace["displayTimeUnit"] == "ms"
    json.loads(json.dumps(trace))  # plain JSON, no NaN
    named_threads = set()
    for e in trace["traceEvents"]:
        assert e["ph"] in ("M", "X", "i") and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index")
            if e["name"] == "thread_name":
                named_threads.add((e["pid"], e["tid"]))
        else:
            assert isinstance(e["name"], str) and e["ts"] >= 0 and (e["pid"], e["tid"]) in named_threads
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["cat"] in ("compute", "wait", "comm") and e["args"]["kind"] == e["cat"]
        if e["ph"] == "i":
            assert e["s"] == "t" and e["cat"] == "yield"
    # per ubatch and track, spans are in time order and never partly overlap
    by_track: dict[tuple[int, int], list[dict]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            by_track.setdefault((e["pid"], e["tid"]), []).append(e)
    for events in by_track.values():
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(events, events[1:]))


@pytest.mark.asyncio
async def test_chrome_export_has_a_track_per_ubatch_and_the_numbers(tmp_path: Path) -> None:
    tracer = Tracer(rank=1)
    await run_ubatches(parks_on_a_timer, [(0,), (1,)], backend="host", instrument=tracer)
    trace = tracer.to_chrome()
    check_chrome_trace(trace)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {0: "ub0 compute", 100: "ub1 compute"}
    assert [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"] == ["rank 1"]
    xs = [(e["tid"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "X"]
    assert xs == [(0, "ub0:start"), (0, "ub0:attn"), (0, "wait: Future"), (0, "ub0:attn"), (0, "ub0:moe"),
                  (100, "ub1:start"), (100, "ub1:attn"), (100, "ub1:moe")]  # track by track, each in time order
    origin = tracer.steps[0].t0  # the step's first resume, on perf_counter
    assert trace["otherData"]["asyncdbo"]["ranks"] == [{"rank": 1, "steps": [_asdict(tracer.numbers())], "origin_s": origin}]
    # timestamps count from the step's start; the absolute origin is in the metadata
    assert trace["otherData"]["asyncdbo"]["origin_s"] == origin
    assert min(e["ts"] for e in trace["traceEvents"] if e["ph"] == "X") == 0.0
    path = tmp_path / "rank1.json"
    tracer.export(path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(trace))


def _asdict(n: RunNumbers) -> dict:
    """RunNumbers as the trace stores it: plain JSON values."""
    return dict(asdict(n), yields_per_ubatch=list(n.yields_per_ubatch))


@pytest.mark.asyncio
async def test_merge_gives_one_process_lane_per_rank() -> None:
    traces = []
    for rank in (1, 0):
        tracer = Tracer(rank=rank)
        await run_ubatches(two_stage, [(1,), (2,)], backend="host", instrument=tracer)
        traces.append(tracer.to_chrome())
    merged = merge_traces(traces)
    check_chrome_trace(merged)
    lanes = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name"}
    assert lanes == {0: "rank 0", 1: "rank 1"}
    assert [r["rank"] for r in merged["otherData"]["asyncdbo"]["ranks"]] == [0, 1]
    with pytest.raises(ValueError, match=r"rank\(s\) \[1\] appear in more than one trace; give each Tracer its own rank="):
        merge_traces([traces[0], traces[0]])
    with pytest.raises(ValueError, match=r"traces\[0\] is not a Chrome trace dict"):
        merge_traces([{"events": []}])


# ----------------------------------------------------------------------------------- profiler
@pytest.mark.asyncio
async def test_profiler_ranges_name_each_stage_by_ubatch_and_tag() -> None:
    tracer = Tracer(profiler_ranges=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        await run_ubatches(two_stage, [(1,), (2,)], backend="host", instrument=tracer)
    names = [e.name for e in prof.events() if e.name.startswith("ub")]
    assert sorted(names) == sorted(["ub0:start", "ub1:start", "ub0:attn", "ub1:attn", "ub0:moe", "ub1:moe"])


# ----------------------------------------------------------------------------------- PNG + CLI
@pytest.mark.asyncio
async def test_png_timeline_and_the_trace_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tracer = Tracer()
    tracer.mark_step(StepRecord(step=0, microbatched=True, reason=PlanReason.MICROBATCHED))
    await run_ubatches(parks_on_a_timer, [(0,), (1,)], backend="host", instrument=tracer)
    out = tmp_path / "direct.png"
    # height: 16 + 12 px per title line (1), 34 px per lane (2), 52 + 12 per note line (1) + 14 per
    # legend row (2: the colours drawn, compute and parked, and room for a "left out" entry) + 10
    assert render_png(tracer.to_chrome(), out, width_px=800) == (800, 198)
    assert png_size(out) == (800, 198)

    path = tmp_path / "trace.json"
    tracer.export(path)
    cli_png = tmp_path / "cli.png"
    assert cli_main(["trace", str(path), "--png", str(cli_png), "--width", "640"]) == 0  # numbers printed too
    assert png_size(cli_png) == (640, 198)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"wrote {cli_png} (640x198 px)"
    assert lines[1].split() == ["rank", "step", "wall", "ms", "compute", "ms", "comm", "ms", "hidden", "parked", "ms",
                                "switches", "yields/ub", "plan"]
    assert lines[2].split()[:2] == ["0", "0"] and lines[2].endswith("[2, 2]  microbatched")
    # under the table, every column is defined, "parked ms" as the sum over ubatches it is
    assert lines[3] == "" and lines[4:] == list(COLUMN_NOTES)
    columns = ["rank", "step", "wall ms", "compute ms", "comm ms", "hidden", "parked ms", "switches", "yields/ub", "plan"]
    for column in columns:
        assert any(note.startswith(f"{column}:") or f" {column}:" in note or note.startswith(f"{column},")
                   or f", {column}:" in note for note in COLUMN_NOTES), column
    assert "parked ms: time ubatches waited for their comm or an event, summed over ubatches" in lines[4:][5]


def test_the_trace_command_reports_unreadable_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert cli_main(["trace", str(bad)]) == 2
    assert capsys.readouterr().err == (
        f"asyncdbo trace: cannot read {str(bad)!r}: it is JSON but not a Chrome trace: no 'traceEvents' list at the top level\n"
    )
    with pytest.raises(ValueError, match=r"the trace has no asyncdbo spans to draw"):
        render_png({"traceEvents": []}, tmp_path / "x.png")


def test_a_tracer_that_saw_no_run_exports_an_empty_valid_trace() -> None:
    trace = Tracer(rank=0).to_chrome()
    check_chrome_trace(trace)
    assert trace["otherData"]["asyncdbo"]["ranks"] == [{"rank": 0, "steps": []}]


# ----------------------------------------------------------------------------------- accelerator
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.asyncio
async def test_device_spans_come_from_timing_events_on_the_streams() -> None:
    from asyncdbo import (
        dbo_yield_and_switch_from_comm_to_compute,
        dbo_yield_and_switch_from_compute_to_comm,
    )

    x_NN = torch.randn(2048, 2048, device="cuda")

    async def forward(x_NN: torch.Tensor) -> torch.Tensor:
        y_NN = x_NN @ x_NN  # queued on the compute stream
        await dbo_yield_and_switch_from_compute_to_comm("dispatch")
        z_NN = y_NN @ x_NN  # queued on the comm stream (stands in for comm kernels)
        await dbo_yield_and_switch_from_comm_to_compute("combine")
        return z_NN.sum()

    tracer = Tracer()
    results = await run_ubatches(forward, [(x_NN,), (x_NN,)], backend="cuda", instrument=tracer)
    torch.cuda.synchronize()
    assert torch.equal(results[0], results[1])
    device = [s for s in tracer.spans() if s.args.get("device")]
    assert {(s.ub, s.role) for s in device} == {(0, "compute"), (1, "compute"), (0, "comm"), (1, "comm")}
    assert all(s.t1 > s.t0 for s in device)
    n = tracer.numbers()
    assert n.compute_s > 0 and n.comm_s > 0 and 0 <= n.comm_hidden_share <= 1
    check_chrome_trace(tracer.to_chrome())


@pytest.mark.asyncio
async def test_on_the_sim_backend_the_tracer_keeps_host_spans() -> None:
    # The simulated device has its own timeline (asyncdbo.sim); the tracer records what the CPU did.
    tracer = Tracer()
    assert await run_ubatches(two_stage, [(1,), (10,)], backend="sim", instrument=tracer) == [4, 22]
    assert tracer.steps[0].device is None
    assert [s.name for s in tracer.spans()] == ["ub0:start", "ub1:start", "ub0:attn", "ub1:attn", "ub0:moe", "ub1:moe"]
    assert tracer.numbers().backend == "sim"


# ----------------------------------------------------------------------------------- blocking
@pytest.mark.asyncio
async def test_a_step_debug_mode_finds_blocking_is_a_blocking_span_in_the_trace_and_the_png(tmp_path: Path) -> None:
    import time

    async def forward(i: int) -> int:
        await dbo_yield("attn")
        if i == 0:
            time.sleep(0.05)
        await dbo_yield("moe")
        return i

    tracer = Tracer()
    await run_ubatches(forward, [(0,), (1,)], instrument=tracer, debug=True, blocking_s=0.02)
    (span,) = [s for s in tracer.spans() if s.kind == "blocking"]
    assert (span.ub, span.args["from"], span.args["to"]) == (0, "attn", "moe")
    assert span.args["blocked_ms"] >= 40
    assert tracer.numbers().blocking_s >= 0.04
    events = [e for e in tracer.to_chrome()["traceEvents"] if e.get("cat") == "blocking"]
    assert [e["name"] for e in events] == ["ub0:attn"]
    import matplotlib.colors

    from asyncdbo.observe.timeline import STYLES, timeline_figure

    fig = timeline_figure(tracer.to_chrome())
    ax = fig.axes[0]
    red = matplotlib.colors.to_rgba(STYLES["blocking"][0])
    assert any(tuple(c) == red for coll in ax.collections for c in coll.get_facecolors())  # drawn as blocking
    assert "attn" in {t.get_text() for t in ax.texts}  # the blocked step's tag: the yield it resumed from
    notes = [t.get_text() for t in fig.texts]
    assert any(n.endswith("Blocked steps are drawn red.") for n in notes), notes
    assert ", blocked " in ax.get_title(loc="left")
