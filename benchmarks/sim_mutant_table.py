"""The sim's performance-mutant table (issue 50): for each performance-only mutant of the library's
MoE layer (tests/helpers/_perf_mutants.py), in the configuration tests/sim/test_sim_perf_mutants.py
runs it (a mid-sized model, hidden 2048, 16 experts, EP 4, 256 tokens decode, 2 ubatches), whether
`asyncdbo check` flags it by default, the cost it reports, and the mutant's makespan minus the
unmutated schedule's. Writes benchmarks/results/sim_mutant_table_<date>.md. Virtual time: the
numbers do not depend on the machine. Usage: python benchmarks/sim_mutant_table.py"""

from __future__ import annotations

import datetime
import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "helpers"))

import asyncdbo  # noqa: E402
from _mutants import mutated  # noqa: E402
from _perf_mutants import HOOK_AFTER_SHARED, MISSED, missed_mutants, perf_mutants  # noqa: E402
from asyncdbo.sim.predict import Deployment, ModelShape, default_requests, simulate  # noqa: E402

MID = ModelShape(name="mid", hidden=2048, intermediate=1024, experts=16, top_k=4, shared_experts=1, heads=16,
                 kv_heads=4, head_dim=128, v_head_dim=128, layers=2)
sys.path.insert(0, os.path.join(HERE, "..", "tests", "sim"))
from test_sim_perf_mutants import CASES  # noqa: E402


def dbo(schedule: str, policy: str, comm: str, host: str):
    run = functools.partial(simulate, default_requests(256, "decode", 2000), [[128, 128]], model=MID, shape="decode",
                            stream_policy=policy, fail_on=[],
                            deployment=Deployment(ep=4, schedule=schedule, comm=comm, host=host))
    ((report, _),) = asyncdbo.run(run, loop="asyncio")
    report.fail_on = ("lost-overlap",)  # what check fails on by default (recorded here, not raised)
    return report


def row(schedule: str, policy: str, comm: str, host: str, m, clean, *, base=None, label: str = "") -> str:
    owner, attr = m.target
    orig = getattr(owner, attr)
    start = mutated(orig, *base.edits) if base is not None else orig
    setattr(owner, attr, mutated(start, *m.edits))
    try:
        rep = dbo(schedule, policy, comm, host)
    finally:
        setattr(owner, attr, orig)
    delta = (rep.makespan_s - clean.makespan_s) * 1e6
    flagged = [lo for lo in rep.problems]
    each = {f"{lo.kind} {(lo.cost_s or 0.0) * 1e6:.1f}": None for lo in rep.lost_overlaps if lo in flagged}
    kinds = ", ".join(sorted(each)) or "-"
    cost = (rep.lost_overlap_s or 0.0) * 1e6
    return (f"| {m.name}{label} | {schedule} | {policy} | {comm} | {host} | {'yes' if flagged else 'NO'} | {kinds} | "
            f"{cost:.1f} | {delta:+.1f} |")


def main() -> None:
    clean: dict[tuple[str, ...], object] = {}
    lines = ["| mutant | schedule | streams | comm | host | flagged | findings (each one's cost, us) | cost reported (us) | makespan delta (us) |",
             "|---|---|---|---|---|---|---|---|---|"]
    cases = [(c[:4], m) for c in CASES for m in perf_mutants(c[0], c[1]) if m.name == c[4]]
    cases += [((s, p, "deepep", "graph"), m) for s, p, name in MISSED for m in missed_mutants(s, p) if m.name == name]
    cases += [((s, "role", "deepep", "graph"), m) for s in ("ht", "ll") for m in missed_mutants(s, "role")
              if "router" in m.name]
    for cfg, m in cases:
        if cfg not in clean:
            clean[cfg] = dbo(*cfg)
        lines.append(row(*cfg, m, clean[cfg]))
        print(lines[-1], flush=True)
    # the no-op recv hooks against the library with its combine-side hook after the shared expert
    ll = ("ll", "role", "deepep", "graph")
    lines.append(row(*ll, HOOK_AFTER_SHARED, clean[ll], label=" (the library, hook moved)"))
    owner, attr = HOOK_AFTER_SHARED.target
    orig = getattr(owner, attr)
    setattr(owner, attr, mutated(orig, *HOOK_AFTER_SHARED.edits))
    try:
        base = dbo(*ll)
    finally:
        setattr(owner, attr, orig)
    (noop,) = [m for m in missed_mutants("ll", "role") if m.name == "no-op recv hooks"]
    lines.append(row(*ll, noop, base, base=HOOK_AFTER_SHARED, label=" (vs the library with the hook moved)"))
    print(*lines[-2:], sep="\n", flush=True)
    day = datetime.date.today().isoformat()
    out = os.path.join(HERE, "results", f"sim_mutant_table_{day}.md")
    with open(out, "w", encoding="utf-8") as f:
        f.write(f"# Performance mutants under the sim's check (issue 50), {day}\n\n"
                f"`python benchmarks/sim_mutant_table.py` at {os.popen('git rev-parse --short HEAD').read().strip()}: "
                "mid model (hidden 2048, 16 experts top-4, EP 4), 256 tokens decode, 2 ubatches. Virtual time (the "
                "sim): the same on any machine. 'findings' are those that fail the check, each with its own "
                "counterfactual cost (the run with that one fixed); 'cost reported' is what they cost together "
                "(SimReport.lost_overlap_s: the run with all of them fixed at once); 'makespan delta' is the mutant's "
                "DBO makespan minus the unmutated one's. The last two rows: the library with its ll combine-side "
                "recv hook moved after the shared expert (tests/helpers/_perf_mutants.py: HOOK_AFTER_SHARED), and "
                "the no-op recv hooks measured against that.\n\n")
        f.write("\n".join(lines) + "\n")
    print(out)


if __name__ == "__main__":
    main()
