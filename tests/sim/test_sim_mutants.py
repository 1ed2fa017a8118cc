"""Mutants: event-order bugs applied to the library's own MoE schedules, each of which the sim must
flag (and the unmutated schedules must pass clean: tests/sim/test_sim_races.py).

A mutant is a source edit of the library's code (``asyncdbo/moe/layer.py``, ``asyncdbo/dist/ep.py``),
compiled in place of the original with its own file name and line numbers, so a finding points at
the mutated line. Every edit must match the library's source exactly once: when the library
changes, the mutant fails loudly instead of silently testing nothing. Each runs both schedules
(``ht``, ``ll``) under both stream policies where the bug exists there; where it cannot exist the
reason is stated beside it (and, for a late record, that the checker stays quiet).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

import asyncdbo
from _mutants import SHARED, mutated

from asyncdbo.dist import ep as ep_mod
from asyncdbo.moe import layer as layer_mod
from asyncdbo.sim import SimCheckError
from asyncdbo.sim.predict import Deployment, ModelShape, predict

pytestmark = pytest.mark.timeout(120)

TINY = ModelShape(name="tiny", hidden=64, intermediate=32, experts=8, top_k=2, shared_experts=1, heads=2, kv_heads=1,
                  head_dim=16, v_head_dim=16, layers=2)
@dataclass(frozen=True)
class Mutant:
    name: str
    target: Any  # (owner, attribute name)
    edits: tuple[tuple[str, str], ...]
    expect: str  # a race kind ("race": any of them), "dead wait", or a lost-overlap kind


def mutants(schedule: str, policy: str) -> Iterator[Mutant]:
    """The mutants that are bugs for this schedule and policy."""
    L, EP = layer_mod, ep_mod.DispatchPlan
    ht, ll, role = schedule == "ht", schedule == "ll", policy == "role"
    # missing wait: the experts read the received rows with nothing ordering them after the dispatch
    if ht and role:
        yield Mutant("missing wait", (L, "_to_compute"), (("await dbo_switch_to_compute_sync()", "dbo_switch_to_compute()"),),
                     "read-after-write")
    if ht and not role:
        yield Mutant("missing wait", (L, "_to_compute"),
                     (("await dbo_switch_to_compute()\n        await st.wait(after)", "await dbo_switch_to_compute()"),),
                     "read-after-write")
    if ll:
        yield Mutant("missing wait", (L.MoELayer, "_forward_ll"),
                     (("await dispatched\n", "\n"), ("_receive(dispatched)", "_noop")), "read-after-write")
    # record after yield (vLLM #38451): the done-event covers the other ubatch's work queued meanwhile.
    # Under per-ubatch streams no other ubatch queues on this one's streams: a late record is harmless.
    if ht and role:
        yield Mutant("record after yield", (L, "_to_comm"),
                     (("await dbo_yield_and_switch_from_compute_to_comm(tag)",
                       "await dbo_yield(tag)\n        await dbo_switch_to_comm_sync()"),), "record-after-yield")
    if ll and role:  # its ll form: the rows sent after the yield wait for the other ubatch's compute
        yield Mutant("record after yield", (L.MoELayer, "_forward_ll"),
                     (("recv_x_RD, dispatched = plan.start_tokens(x_TD)  # the send half, issued before the yield\n"
                       "        received = dbo_register_recv_hook(_receive(dispatched))\n"
                       "        await dbo_yield(\"dispatch_send\")",
                       "received = dbo_register_recv_hook(_noop)\n        await dbo_yield(\"dispatch_send\")\n"
                       "        recv_x_RD, dispatched = plan.start_tokens(x_TD)"),), "send-after-yield")
    # buffer reused in flight: both ubatches receive into one buffer
    yield Mutant("buffer reused in flight", (EP, "start_tokens"),
                 (("recv_x_RD = send_x_ND.new_empty((int(self.recv_PL.sum()), x_TD.shape[1]))",
                   "recv_x_RD = SHARED.setdefault((int(self.recv_PL.sum()), x_TD.shape[1]), "
                   "send_x_ND.new_empty((int(self.recv_PL.sum()), x_TD.shape[1])))"),), "race")
    # dead wait: a wait on an event no one records
    yield Mutant("dead wait", (L.MoELayer, f"_forward_{schedule}"), (("await dispatched\n", "await dispatched\n        _dead_wait()\n"),),
                 "dead wait")
    # stale or cross-ubatch wait: a wait on an event that does not cover the rows it should
    if ht and role:  # stale: the comm done-event recorded before the dispatch was issued
        yield Mutant("stale wait", (L.MoELayer, "_forward_ht"),
                     (("recv_x_RD, dispatched = plan.start_tokens(x_TD)\n        await _to_compute(st, after=\"dispatched\")",
                       "stale = _record_comm_now()\n        recv_x_RD, dispatched = plan.start_tokens(x_TD)\n"
                       "        await _wait_stale(stale)"),), "read-after-write")
    if ht and not role:  # cross-ubatch: each ubatch waits on the next one's stage events
        yield Mutant("cross-ubatch wait", (L._Stages, "wait"),
                     (("dbo_wait_event((*self.prefix, stage))",
                       "dbo_wait_event((*self.prefix[:2], (self.prefix[2] + 1) % dbo_num_ubatches(), stage))"),),
                     "read-after-write")
    if ll:  # stale: the receive waits on the counts handle, not the rows'
        yield Mutant("stale wait", (L.MoELayer, "_forward_ll"),
                     (("await plan.start_counts()", "counts = plan.start_counts()\n        await counts"),
                      ("_receive(dispatched)", "_receive(counts)"), ("await dispatched\n", "await counts\n")),
                     "read-after-write")
    # wrong stream: the weighted sum runs on the comm stream; the next layer reads it on compute
    yield Mutant("wrong stream", (L.MoELayer, f"_forward_{schedule}"),
                 (("return self._finalize(plan, back_ND, topk_w_TK, shared_TD, x_TD)",
                   "await dbo_switch_to_comm()\n        out = self._finalize(plan, back_ND, topk_w_TK, shared_TD, x_TD)\n"
                   "        await dbo_switch_to_compute()\n        return out"),), "read-after-write")
    # the combine's handle not awaited, its recv hook kept: under role streams the next ubatch's hook
    # orders the device stream, but the host backend delivers the rows only when the owner awaits
    # the handle (wrong numbers on the CPU, issue 27); under per-ubatch streams it is an early read
    if ll:
        yield Mutant("combine not awaited", (L.MoELayer, "_forward_ll"), (("        await combined\n", ""),),
                     "read-before-await" if role else "read-after-write")
    # skipped recv hook (ll only: ht has no hooks)
    if ll:
        yield Mutant("skipped recv hook", (L.MoELayer, "_forward_ll"),
                     (("dbo_maybe_run_recv_hook()  # launch the previous ubatch's pending receive\n", "\n"),),
                     "skipped-recv-hook")


CASES = [(s, p, m.name) for s in ("ht", "ll") for p in ("role", "ubatch") for m in mutants(s, p)]


def findings(schedule: str, policy: str) -> list[Any]:
    """Every finding of a serial and a DBO run of the tiny model: the problems it failed with, or
    its lost overlap (found from the order of ops at any width; its measured cost at this tiny
    width may be zero, which does not fail the run: tests/sim/test_sim_perf_mutants.py costs them)."""
    run = functools.partial(predict, 8, model=TINY, stream_policy=policy, deployment=Deployment(ep=4, schedule=schedule),
                            fail_on=["lost-overlap"])
    try:
        p = asyncdbo.run(run, loop="asyncio")
    except SimCheckError as exc:
        return exc.findings
    return [*p.serial.lost_overlaps, *p.dbo.lost_overlaps]


def kinds(f: Any) -> set[str]:
    if type(f).__name__ == "DeadWait":
        return {"dead wait"}
    return {f.kind, "race"} if type(f).__name__ == "Race" else {f.kind}


@pytest.mark.parametrize(("schedule", "policy", "name"), CASES, ids=[f"{s}-{p}-{n.replace(' ', '_')}" for s, p, n in CASES])
def test_the_checker_flags_each_mutant(schedule: str, policy: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    (m,) = [m for m in mutants(schedule, policy) if m.name == name]
    owner, attr = m.target
    monkeypatch.setattr(owner, attr, mutated(getattr(owner, attr), *m.edits))
    SHARED.clear()
    found = findings(schedule, policy)
    assert any(m.expect in kinds(f) for f in found), [str(f) for f in found]
    flagged = next(f for f in found if m.expect in kinds(f))
    text = str(flagged)
    assert "asyncdbo/moe/layer.py:" in text or "asyncdbo/dist/ep.py:" in text or "tests/sim/test_sim_mutants.py:" in text, text
    if type(flagged).__name__ == "Race" and flagged.kind != "read-before-await":
        assert "\n    missing: no wait on stream " in text
    if getattr(flagged, "kind", None) == "read-before-await":
        assert "\n    missing: ubatch 0 never awaited the handle of " in text
    if name == "cross-ubatch wait":
        assert any("last waited on an event ubatch " in str(f) for f in found), [str(f) for f in found]


def test_every_mutant_kind_runs_under_both_schedules_and_policies() -> None:
    covered = {(s, p) for s, p, _ in CASES}
    assert covered == {(s, p) for s in ("ht", "ll") for p in ("role", "ubatch")}
    names = {n for _, _, n in CASES}
    assert names == {"missing wait", "record after yield", "buffer reused in flight", "dead wait", "stale wait",
                     "cross-ubatch wait", "wrong stream", "skipped recv hook", "combine not awaited"}


def test_a_late_record_under_per_ubatch_streams_is_not_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    # The stage event recorded after the yield covers nothing foreign: no other ubatch queues work
    # on this ubatch's streams. The checker must stay quiet (no false positive).
    late = mutated(layer_mod._to_comm, ("st.record(after)\n        await dbo_yield(tag)",
                                        "await dbo_yield(tag)\n        st.record(after)"))
    monkeypatch.setattr(layer_mod, "_to_comm", late)
    assert findings("ht", "ubatch") == []
