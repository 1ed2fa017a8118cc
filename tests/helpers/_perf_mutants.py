"""Performance-only mutants of the library's MoE schedules: each keeps the numbers right and
loses overlap, and the sim must report it with a non-zero measured cost
(tests/sim/test_sim_perf_mutants.py). Each is a source edit applied by :func:`_mutants.mutated`
(an edit must match the library's source exactly once)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from asyncdbo.moe import layer as layer_mod

__all__ = ["HOOK_AFTER_SHARED", "MISSED", "PerfMutant", "missed_mutants", "perf_mutants"]


@dataclass(frozen=True)
class PerfMutant:
    name: str
    target: Any  # (owner, attribute name)
    edits: tuple[tuple[str, str], ...]
    expect: str  # the lost-overlap kind ("" for MISSED ones: no finding of a named kind fits them)


_EXPERTS = "y_RD = self._experts(plan, recv_x_RD)"


def perf_mutants(schedule: str, policy: str) -> Iterator[PerfMutant]:
    """The performance-only mutants that exist for this schedule and stream policy."""
    L = layer_mod
    ht, ll, role = schedule == "ht", schedule == "ll", policy == "role"
    fwd = (L.MoELayer, f"_forward_{schedule}")
    # a host sync between yields: a read of the router's weights (real on the sim's CPU) after the experts
    yield PerfMutant("host sync after the experts", fwd, ((_EXPERTS, f"{_EXPERTS}\n        float(topk_w_TK.sum())"),),
                     "host-sync")
    # compute issued on the comm stream: the expert GEMMs, then the shared expert
    yield PerfMutant("experts on the comm stream", fwd,
                     ((_EXPERTS, f"await dbo_switch_to_comm_sync()\n        {_EXPERTS}\n"
                                 "        await dbo_switch_to_compute_sync()"),), "compute-on-comm-stream")
    if ll:
        yield PerfMutant("shared expert on the comm stream", fwd,
                         (("shared_TD = self._shared(x_TD)  # overlaps the combine in flight",
                           "await dbo_switch_to_comm_sync()\n        shared_TD = self._shared(x_TD)\n"
                           "        await dbo_switch_to_compute_sync()"),), "compute-on-comm-stream")
    if ht and role:
        yield PerfMutant("shared expert on the comm stream", fwd,
                         (("dbo_switch_to_compute()  # no sync: the shared expert overlaps the combine in flight\n"
                           "            shared_TD = self._shared(x_TD)\n            dbo_switch_to_comm()",
                           "shared_TD = self._shared(x_TD)"),), "compute-on-comm-stream")
    # a missing yield around comm: the combine sent and used between the same two yields
    if ll:
        yield PerfMutant("combine yield dropped", fwd, (('        await dbo_yield("combine_send")\n', ""),),
                         "comm-not-overlapped")
    # comm awaited before the yield: the counts exchange waited for before the dispatch yield
    if ht:
        yield PerfMutant("counts awaited before the yield", fwd,
                         (('await _to_comm(st, "dispatch", after="routed")\n        await counts',
                           'await counts\n        await _to_comm(st, "dispatch", after="routed")'),), "comm-not-overlapped")
    # an event recorded after the yield (vLLM #38451); under per-ubatch streams it covers nothing foreign
    if ht and role:
        yield PerfMutant("record after yield", (L, "_to_comm"),
                         (("await dbo_yield_and_switch_from_compute_to_comm(tag)",
                           "await dbo_yield(tag)\n        await dbo_switch_to_comm_sync()"),), "record-after-yield")
    # a wait on the combine issued before the yield (the general form: the other ubatch's work queued
    # on the shared compute stream meanwhile waits for the combine too)
    if ht and role:
        yield PerfMutant("combine synced before the yield", fwd, ((
            'await dbo_yield_and_switch_from_comm_to_compute("combine_done")',
            'await dbo_switch_to_compute_sync()\n            await dbo_yield("combine_done")'),), "comm-wait-blocks-other")
    # the rows sent after the yield
    if ll:
        yield PerfMutant("rows sent after the yield", fwd,
                         (("recv_x_RD, dispatched = plan.start_tokens(x_TD)  # the send half, issued before the yield\n"
                           "        received = dbo_register_recv_hook(_receive(dispatched))\n"
                           "        await dbo_yield(\"dispatch_send\")",
                           "received = dbo_register_recv_hook(_noop)\n        await dbo_yield(\"dispatch_send\")\n"
                           "        recv_x_RD, dispatched = plan.start_tokens(x_TD)"),), "send-after-yield")
    # the recv hook held across a yield (under per-ubatch streams the hook does nothing: no cost)
    if ll and role:
        yield PerfMutant("skipped recv hook", fwd,
                         (("dbo_maybe_run_recv_hook()  # launch the previous ubatch's pending receive\n", "\n"),),
                         "skipped-recv-hook")


#: Issue 50's performance mutants that the named lost-overlap kinds used to miss: (schedule, policy,
#: name); tests/sim/test_sim_perf_mutants.py pins the kind each is found as now.
MISSED = [("ht", "role", "combine on the compute stream"), ("ht", "role", "no yield around the combine"),
          ("ht", "role", "shared expert after the combine's sync"), ("ll", "role", "shared expert after the combine"),
          ("ll", "role", "no-op recv hooks")]


def missed_mutants(schedule: str, policy: str) -> Iterator[PerfMutant]:
    """The mutants of :data:`MISSED` for this schedule and stream policy, and issue 50's host syncs
    after the router (M22: ``.item()``, N06: ``.cpu()``) that passed under graph replay."""
    L = layer_mod
    fwd = (L.MoELayer, f"_forward_{schedule}")
    route = "topk_w_TK, plan = self._prepare(x_TD)"
    yield PerfMutant("item after the router", fwd, ((route, f"{route}\n        topk_w_TK.max().item()"),), "host-sync")
    yield PerfMutant("cpu after the router", fwd, ((route, f"{route}\n        topk_w_TK.cpu()"),), "host-sync")
    combine = 'await _to_comm(st, "combine", after="experts")'
    if schedule == "ht" and policy == "role":
        yield PerfMutant("combine on the compute stream", fwd, ((combine, 'await dbo_yield("combine")'),), "")
        yield PerfMutant("no yield around the combine", fwd, (
            (combine, "await dbo_switch_to_comm_sync()"),
            ('await dbo_yield_and_switch_from_comm_to_compute("combine_done")', "await dbo_switch_to_compute_sync()")), "")
        yield PerfMutant("shared expert after the combine's sync", fwd, ((
            "dbo_switch_to_compute()  # no sync: the shared expert overlaps the combine in flight\n"
            "            shared_TD = self._shared(x_TD)\n            dbo_switch_to_comm()\n"
            '            await dbo_yield_and_switch_from_comm_to_compute("combine_done")',
            'await dbo_yield_and_switch_from_comm_to_compute("combine_done")\n'
            "            shared_TD = self._shared(x_TD)"),), "")
    if schedule == "ll" and policy == "role":
        yield PerfMutant("shared expert after the combine", fwd, (
            ("        shared_TD = self._shared(x_TD)  # overlaps the combine in flight\n", ""),
            ("        await combined\n", "        await combined\n        shared_TD = self._shared(x_TD)\n")), "")
        yield PerfMutant("no-op recv hooks", fwd, (
            ("received = dbo_register_recv_hook(_receive(dispatched))", "received = dbo_register_recv_hook(_noop)"),
            ("received = dbo_register_recv_hook(_receive(combined))", "received = dbo_register_recv_hook(_noop)")), "")


#: Not a defect: the ``ll`` schedule's combine-side ``dbo_maybe_run_recv_hook()`` moved after the
#: shared expert, so the previous ubatch's combine receive follows this ubatch's own compute (the
#: placement the layer's docstring describes); the no-op recv hooks mutant is measured against it.
HOOK_AFTER_SHARED = PerfMutant("combine hook after the shared expert", (layer_mod.MoELayer, "_forward_ll"), ((
    "        dbo_maybe_run_recv_hook()\n        back_ND, combined = plan.start_combine(y_RD)  # the send half of the combine\n"
    "        shared_TD = self._shared(x_TD)  # overlaps the combine in flight\n",
    "        back_ND, combined = plan.start_combine(y_RD)  # the send half of the combine\n"
    "        shared_TD = self._shared(x_TD)  # overlaps the combine in flight\n        dbo_maybe_run_recv_hook()\n"),), "")
