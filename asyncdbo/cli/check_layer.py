"""``asyncdbo check --layer FILE:NAME``: the user's own layer on the simulated device
(:mod:`asyncdbo.sim.layer`): for each ``--tokens`` value, serial vs DBO step time under each
stream policy, and every race, dead wait, lost overlap and host sync between yields, each at the
user's line; any of them exits 1."""

from __future__ import annotations

import argparse
import functools
from typing import Any, Literal

__all__ = ["main_layer"]


def main_layer(args: argparse.Namespace, fail_on: list[str]) -> int:
    import asyncdbo

    from ..sim.layer import check_layer, load_layer
    from ..sim.races import SimCheckError

    if args.workload:
        raise ValueError("--layer checks your layer on its own; drop --workload (or --layer)")
    layer = load_layer(args.layer)
    host = args.host or "eager"
    policies: list[Literal["role", "ubatch"]] = ["role", "ubatch"] if args.stream_policy == "both" else [args.stream_policy]
    print(f"asyncdbo check --layer {args.layer}: {args.ubatches} ubatches, EP {args.ep} (a fake group: collectives "
          "are timed, their data is not exchanged)")
    print(f"deployment: {args.device} + {args.link}, {args.comm} comm, {host} host; host syncs also estimated with "
          f"eager launches")
    print(f"checks: {'races, dead waits, lost overlap and host syncs' if args.check_races else 'none (--no-check-races)'}"
          f"{'; lost overlap is reported, not failed (--allow-lost-overlap)' if not fail_on else ''}")
    head = f"{'tokens':>7} {'serial us':>10}" + "".join(f" | {p + ' DBO us':>14} {'speedup':>7}" for p in policies)
    print(head)
    print("-" * len(head))
    failed: list[tuple[str, SimCheckError]] = []
    results: dict[str, Any] = {}
    for pol in policies:
        try:
            results[pol] = asyncdbo.run(functools.partial(
                check_layer, layer, tokens=args.tokens, ubatches=args.ubatches, ep=args.ep, hidden=args.hidden,
                device=args.device, link=args.link, comm=args.comm, host=host, stream_policy=pol,
                check_races=args.check_races, fail_on=fail_on, raise_problems=False), loop="asyncio")
        except SimCheckError as exc:  # raised by a run itself (a race found while a counterfactual ran)
            failed.append((pol, exc))
    for i, n in enumerate(args.tokens):
        row = f"{n:>7}"
        for j, pol in enumerate(policies):
            res = results.get(pol)
            if res is None:
                row += (" " * 11 if j == 0 else "") + f" | {'-':>14} {'-':>7}"
                continue
            r = res.rows[i]
            if j == 0:
                row += f" {r.serial.makespan_s * 1e6:>10.1f}"
            row += f" | {r.dbo.makespan_s * 1e6:>14.1f} {r.speedup:>6.2f}x"
        print(row)
    print("speedup: serial time (one ubatch) / DBO time on the modeled device (above 1x: DBO is faster)")
    plain = [f"{r.tokens} {name} {r.plain_speedup:.2f}x" for name, res in results.items() for r in res.rows]
    print(f"over the serial run without DBO's yields and hooks (one stream; a schedule that loses its own overlap "
          f"slows the one-ubatch run, not this one): {', '.join(plain)}")
    for name, res in results.items():
        if res.problems:
            failed.append((name, SimCheckError(list(dict.fromkeys(map(str, res.problems))))))
        elif not fail_on:
            for text in dict.fromkeys(str(lo) for r in res.rows for lo in r.dbo.lost_overlaps):
                print(f"\nwarning ({name} streams): {text}")
    for name, res in results.items():  # findings of one cause each measure part of it: what they cost together
        for r in res.rows:
            if len({lo.key for lo in r.dbo.lost_overlaps}) > 1 and r.dbo.lost_overlap_s is not None:
                print(f"\n{name} streams, {r.tokens} tokens: the lost overlap costs {r.dbo.lost_overlap_s * 1e6:.1f} us "
                      "of this run together (a run with every finding fixed at once)")
    for name, err in failed:
        print(f"\n{name} streams: {err}")
    return 1 if failed else 0
