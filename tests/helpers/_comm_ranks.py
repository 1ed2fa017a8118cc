"""Rank functions for tests/dist/test_unsubmitted_comm.py: a ubatch's collectives on its own
group (``ubatch_group()``), handed to ``dbo_submit`` or not (module level: pickled by reference).

Each layer is example 06's dispatch (equal row blocks to every rank) in one of these variants:

* ``submitted``: the work goes to ``dbo_submit`` right after it is issued (correct);
* ``dropped``: the work is never submitted and the output is read after the comm->compute switch;
* ``read_early``: the output is read before the ubatch yields, the work not submitted;
* ``raise_after``: the ubatch raises after issuing the work, before submitting it;
* ``sync``: a synchronous all_to_all_single (``async_op`` left False) on the ubatch's group;
* ``p2p_sync``: ``dist.send``/``dist.recv`` (synchronous) to and from the other rank.

Legend (shape suffixes): T rows of a ubatch on this rank, D hidden.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

import asyncdbo
from asyncdbo import (
    dbo_submit,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    ubatch_group,
    ubatch_groups,
)
from asyncdbo.dist.recovery import StepAborted

ROWS, D = 8, 4


async def layer(x_TD: torch.Tensor, variant: str) -> torch.Tensor:
    await dbo_yield_and_switch_from_compute_to_comm("dispatch")
    out_TD = torch.empty_like(x_TD)
    group = ubatch_group()  # SITE: ubatch_group
    if variant == "sync":
        dist.all_to_all_single(out_TD, x_TD, group=group)
    elif variant == "p2p_sync":
        peer = 1 - dist.get_rank()
        if peer == 1:
            dist.send(x_TD, peer, group=group)
            dist.recv(out_TD, peer, group=group)
        else:
            dist.recv(out_TD, peer, group=group)
            dist.send(x_TD, peer, group=group)
    else:
        work = dist.all_to_all_single(out_TD, x_TD, group=group, async_op=True)  # SITE: issue
        if variant == "read_early":
            out_TD = out_TD * 2.0  # SITE: read
        if variant == "raise_after":
            raise ValueError("the layer failed after issuing its dispatch")
        if variant == "submitted":
            dbo_submit(work, nbytes=x_TD.numel() * x_TD.element_size(), what="dispatch")
    await dbo_yield_and_switch_from_comm_to_compute("experts")
    return out_TD * 2.0 + 1.0


def steps(rank: int, world_size: int, variant: str, debug: bool, num_steps: int) -> list[dict[str, Any]]:
    """``num_steps`` DBO steps of ``layer`` (2 ubatches); each one's error (its first line, and
    its notes), the warnings it gave and whether it equals the serial run of the same halves.

    Every rank runs the same failing program, so a rank whose peer posted the failure first gets
    :class:`StepAborted` with the peer's error line instead of its own (``notes`` None then)."""
    ubatch_groups(2)
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(num_steps):
        x_TD = torch.randn(ROWS, D, generator=g)
        halves = [(half, variant) for half in x_TD.split(ROWS // 2)]

        async def serial_and_dbo() -> tuple[torch.Tensor | None, torch.Tensor]:
            serial_TD = torch.cat([await layer(*args) for args in halves]) if variant != "raise_after" else None
            return serial_TD, torch.cat(await asyncdbo.run_ubatches(layer, halves, backend="host", debug=debug))

        record: dict[str, Any] = {"error": None, "notes": [], "warnings": [], "equal": None}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                serial_TD, dbo_TD = asyncdbo.run(serial_and_dbo)
                record["equal"] = serial_TD is not None and torch.equal(serial_TD, dbo_TD)
            except StepAborted as exc:  # the peer posted the same failure first (timing): its line
                record["error"] = exc.reason
                record["notes"] = None  # the peer's notes stayed with the peer
            except (RuntimeError, ValueError) as exc:
                record["error"] = f"{type(exc).__name__}: {exc}"
                record["notes"] = list(getattr(exc, "__notes__", []))
        record["warnings"] = [(w.category.__name__, str(w.message), w.filename) for w in caught
                              if w.category is RuntimeWarning]
        out.append(record)
    return out
