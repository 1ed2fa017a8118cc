"""The yield and switch primitives are declared once, as rows of asyncdbo/dbo/table.py: each row
makes the Python reference, the C fast path, the exports and the missing-await wording. A primitive
of an existing kind is one row and its test; the tests below add two (docs/maintaining.md, "Add a
primitive", followed step by step) and check that each runs the same in Python and C, is reported
by its own name when its ``await`` is dropped, and is exported."""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Callable
from typing import Any

import pytest
from _recording_backend import RecordingBackend

import asyncdbo
import asyncdbo.dbo
from asyncdbo import run_ubatches
from asyncdbo.dbo import MissingAwaitError, kinds, table
from asyncdbo.dbo.kinds import FAST, PURE, TABLE, PrimitiveRow

pytestmark = [pytest.mark.timeout(60)]

IMPLS = ["python", "c"] if FAST is not None else ["python"]


def test_every_row_is_exported_from_the_dbo_layer_as_the_implementation_in_use() -> None:
    """``asyncdbo.dbo`` exports every row; the top level keeps vLLM's seven (its size is pinned:
    tests/layout/test_old_paths.py), the very same objects."""
    assert list(TABLE) == [n for n in vars(table) if not n.startswith("_")]
    for name in TABLE:
        in_use = (FAST or PURE)[name]
        assert name in asyncdbo.dbo.__all__
        assert getattr(asyncdbo.dbo, name) is getattr(table, name) is in_use
        assert asyncdbo.dbo.primitives.__dict__[name] is in_use  # the old import path still works
        if name.startswith(("dbo_yield", "dbo_switch_to_")):  # vLLM's names
            assert name in asyncdbo.__all__ and getattr(asyncdbo, name) is in_use


def test_a_row_that_does_not_fit_its_kind_is_refused_naming_what_it_takes() -> None:
    with pytest.raises(ValueError, match=r"dbo_bad: a yield primitive takes no src, no dst and a default tag"):
        PrimitiveRow("dbo_bad", "yield", "compute", None, "t", "overlap", "doc")
    with pytest.raises(ValueError, match=r"dbo_bad: kind must be one of"):
        PrimitiveRow("dbo_bad", "bogus", None, None, None, "overlap", "doc")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="declared twice"):
        kinds.declare("dbo_yield", "yield", tag="yield", risk="overlap", doc="again")


@pytest.fixture
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """declare() below adds to copies of the registry, so the rest of the suite sees the real one."""
    monkeypatch.setattr(kinds, "TABLE", dict(TABLE))
    monkeypatch.setattr(kinds, "PURE", dict(PURE))
    monkeypatch.setattr(kinds, "FAST", None if FAST is None else dict(FAST))


def declare_new_rows() -> tuple[Any, Any]:
    """What a maintainer adds to asyncdbo/dbo/table.py: one row each."""
    dbo_yield_to_peer = kinds.declare(
        "dbo_yield_to_peer", "yield", tag="peer", risk="overlap",
        doc="Hand over to the peer ubatch while this one's shared expert runs.")
    dbo_yield_and_switch_to_comm_early = kinds.declare(
        "dbo_yield_and_switch_to_comm_early", "role", src="compute", dst="comm", tag="early", risk="data",
        doc="Record compute-done, yield, then continue on comm (the dispatch's first half).")
    return dbo_yield_to_peer, dbo_yield_and_switch_to_comm_early


def layer(y: Callable[..., Any], to_comm: Callable[..., Any], log: list[str]) -> Callable[[int], Any]:
    async def forward(i: int) -> int:
        log.append(f"ub{i} attn")
        await y()
        log.append(f"ub{i} shared expert")
        await to_comm("dispatch")
        log.append(f"ub{i} dispatch")
        await asyncdbo.dbo_yield_and_switch_from_comm_to_compute("done")
        return i

    return forward


@pytest.mark.usefixtures("fresh_registry")
def test_a_new_row_is_a_working_primitive_in_python_and_in_c() -> None:
    new_yield, new_role = declare_new_rows()
    assert kinds.TABLE["dbo_yield_to_peer"].kind == "yield"
    traces = {}
    for impl in IMPLS:
        y = kinds.PURE["dbo_yield_to_peer"] if impl == "python" else kinds.FAST["dbo_yield_to_peer"]  # type: ignore[index]
        r = kinds.PURE["dbo_yield_and_switch_to_comm_early"] if impl == "python" else kinds.FAST["dbo_yield_and_switch_to_comm_early"]  # type: ignore[index]
        log: list[str] = []
        assert asyncio.run(run_ubatches(layer(y, r, log), [(0,), (1,)], backend=RecordingBackend(log))) == [0, 1]
        traces[impl] = log
    assert (new_yield, new_role) == ((kinds.FAST or kinds.PURE)["dbo_yield_to_peer"],
                                    (kinds.FAST or kinds.PURE)["dbo_yield_and_switch_to_comm_early"])
    steps = [e for e in traces["python"] if not e.startswith("install")]
    assert steps[:5] == ["ub0 attn", "ub1 attn", "ub0 shared expert", "ub0 record ub0.compute_done on compute",
                         "ub1 shared expert"]
    assert len(set(map(tuple, traces.values()))) == 1, traces  # the C twin did what the reference did


@pytest.mark.usefixtures("fresh_registry")
@pytest.mark.parametrize("impl", IMPLS)
def test_a_new_row_is_reported_by_its_own_name_when_its_await_is_dropped(impl: str) -> None:
    declare_new_rows()
    table_ = kinds.PURE if impl == "python" else kinds.FAST
    assert table_ is not None
    y, r = table_["dbo_yield_to_peer"], table_["dbo_yield_and_switch_to_comm_early"]

    async def drops_the_yield(i: int) -> None:
        y()  # DROPPED
        await asyncdbo.dbo_yield()

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        asyncio.run(run_ubatches(drops_the_yield, [(0,), (1,)], backend="host"))
    messages = [str(w.message) for w in seen if w.category is RuntimeWarning]
    assert messages and messages[0].startswith("asyncdbo: dbo_yield_to_peer('peer') in ubatch 0 was never awaited")
    assert messages[0].endswith("it did not hand over, so nothing overlapped there. Write `await dbo_yield_to_peer('peer')`.")

    async def drops_the_switch(i: int) -> None:
        r("dispatch")  # DROPPED
        await asyncdbo.dbo_yield()

    with pytest.raises(MissingAwaitError, match=r"dbo_yield_and_switch_to_comm_early\('dispatch'\) in ubatch 0 was never"):
        asyncio.run(run_ubatches(drops_the_switch, [(0,), (1,)], backend="host"))
