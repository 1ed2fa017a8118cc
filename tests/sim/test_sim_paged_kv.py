"""The serving path on the sim: races tracked per byte range of a storage (the slots of a paged KV
cache), and ``asyncdbo check --paged-kv`` (the runner with the paged KV cache and a request cut
between ubatches) on the library, and on the library with its KV wait removed.

Shape legend: S slots of the cache, H heads, K head dim, T tokens of a ubatch.
"""

from __future__ import annotations

import argparse
import functools
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from _mutants import mutated

import asyncdbo
from asyncdbo.cli.check import add_arguments
from asyncdbo.cli.check import main as check_main
from asyncdbo.dbo import dbo_record_event, dbo_wait_event, dbo_yield
from asyncdbo.lowlevel import get_ubatch
from asyncdbo.models import attention, mini, tiled_attention
from asyncdbo.serving import kv_cache
from asyncdbo.sim.backend import SimBackend

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ slots of one storage
async def kv_step(k_TK: torch.Tensor, cache_SK: torch.Tensor, wait: bool, read_other: bool) -> torch.Tensor:
    """Each ubatch writes its own 4 slots of one cache; ubatch 1 then reads its own slots or, with
    ``read_other``, ubatch 0's too (a request cut between them), after waiting on ubatch 0's
    event if ``wait``."""
    ub = get_ubatch().id
    cache_SK.index_copy_(0, torch.arange(4 * ub, 4 * ub + 4), k_TK)  # WRITE OWN SLOTS
    if ub == 1 and wait:
        await dbo_wait_event(("kv", 0))
    dbo_record_event(("kv", ub))
    slots = torch.arange(0, 8) if ub == 1 and read_other else torch.arange(4 * ub, 4 * ub + 4)
    out_TK = cache_SK.index_select(0, slots)  # READ SLOTS
    await dbo_yield("moe")
    return out_TK


def kv_races(wait: bool, read_other: bool) -> list[str]:
    async def go() -> list[str]:
        be = SimBackend(on_problem="record")
        cache_SK = torch.zeros(16, 8)
        k_TK = torch.randn(8, 8)
        await asyncdbo.run_ubatches(functools.partial(kv_step, cache_SK=cache_SK, wait=wait, read_other=read_other),
                                    [(k_TK[:4],), (k_TK[4:],)], backend=be, stream_policy="ubatch")
        assert be.report is not None
        return [f"{r.kind}: {r.now.op} after {r.before.op}" for r in be.report.races]

    return asyncdbo.run(go, loop="asyncio")


def test_disjoint_slots_of_one_storage_are_no_conflict() -> None:
    # Per storage, ubatch 1's write of slots 4-7 after ubatch 0's read of slots 0-3 was a
    # write-after-read race (issue 27: 2 reports on the paged KV cache of unmodified code).
    assert kv_races(wait=False, read_other=False) == []


def test_a_read_of_slots_another_stream_wrote_needs_the_wait() -> None:
    assert kv_races(wait=False, read_other=True) == ["read-after-write: aten::index_select after aten::index_copy_"]
    assert kv_races(wait=True, read_other=True) == []


# ------------------------------------------------------------------ asyncdbo check --paged-kv
def _check(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return check_main(parser.parse_args(argv))


def test_check_paged_kv_passes_the_library_under_both_stream_policies(capsys: pytest.CaptureFixture[str]) -> None:
    assert _check(["--paged-kv", "-q"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("asyncdbo check --paged-kv: DBORunner with the paged KV cache: MiniModel (1 layer, hidden 32, "
                      "4 experts top-2, KV blocks of 4), MoE over a fake EP group of 2; checked step: 16 tokens of 3 "
                      "requests (5 new on 4 cached, 6 new on 6 cached, 5 new on 0 cached), token split into 2 ubatches")
    assert out[1:3] == ["deployment: h200 + ib400, deepep comm, eager host, schedule ht, 2 ubatches",
                        "checks: races, dead waits and lost overlap"]
    for pol, text in zip(("role", "ubatch"), out[3:5]):
        assert text.startswith(f"{pol} streams: cut 8 | 8 (ubatch 1 continues a request of the one before); no race, "
                               "no dead wait, no lost overlap; step "), text
    assert len(out) == 5


def _without_kv_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutant: wait_for_earlier_kv records its event but no longer waits on the previous one."""
    monkeypatch.setattr(mini, "wait_for_earlier_kv", mutated(
        attention.wait_for_earlier_kv, ('await dbo_wait_event(("models.kv", id(owner), layer, ub.id - 1))', "pass")))


def at(module: Any, text: str) -> str:
    """``path:line`` of the one line of ``module``'s source that contains ``text``."""
    path = Path(inspect.getsourcefile(module) or "")
    (line,) = [i + 1 for i, s in enumerate(path.read_text().splitlines()) if text in s]
    return f"{path.relative_to(ROOT)}:{line}"


def _race(place: str) -> str:
    mini_write = at(mini, "self.kv_cache.write(layer")
    mini_attn = at(mini, "await self._attention(layer")
    gather = at(tiled_attention, "k_rows, v_rows = k_flat.index_select(0, slots)")
    chunk = at(tiled_attention, "_attend_chunk(out_THK, q_THK")
    tiled = at(attention, "tiled_causal_attention(q_THK, positions_T")
    return "\n".join([
        "read-after-write race: aten::index_select on stream ub1 reads a buffer aten::index_copy_ on stream ub0 wrote, "
        "with no event between them",
        "    1. write by aten::index_copy_: ubatch 0 before its first yield, stream ub0",
        f"        at {place} in write",
        f"           {mini_write} in _attention",
        f"           {mini_attn} in forward",
        "    2. read by aten::index_select: ubatch 1 before its first yield, stream ub1",
        f"        at {gather} in _attend_chunk",
        f"           {chunk} in tiled_causal_attention",
        f"           {tiled} in paged_causal_attention",
        f"    missing: no wait on stream ub0 between aten::index_copy_ ({place} in write) and aten::index_select "
        f"({gather} in _attend_chunk): record an event on ub0 after the write and make stream ub1 wait on it before "
        "the read",
    ])


def test_check_paged_kv_exits_1_with_the_kv_wait_removed(monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # Role streams order the read by launch order (vLLM's shared stream), so only the per-ubatch
    # streams' run fails (the default checks both). The two findings: the keys' and the values'
    # cache (kv_cache.py's two index_copy_ lines), read by ubatch 1's attention over the request
    # ubatch 0 began.
    _without_kv_wait(monkeypatch)
    assert _check(["--paged-kv", "-q", "--stream-policy", "ubatch", "--schedule", "ll"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[3:] == ["ubatch streams: 2 finding(s)", "",
                       "ubatch streams: asyncdbo sim: 2 ordering problem(s):",
                       *f"  1. {_race(at(kv_cache, 'flat_k.index_copy_(0, slots'))}".splitlines(),
                       *f"  2. {_race(at(kv_cache, 'flat_v.index_copy_(0, slots'))}".splitlines()]


def test_check_paged_kv_refuses_a_workload(capsys: pytest.CaptureFixture[str]) -> None:
    assert _check(["--paged-kv", "--workload", "synthetic"]) == 2
    assert capsys.readouterr().err == ("asyncdbo check: error: --paged-kv checks one serving step of its own; drop "
                                       "--workload (or --paged-kv)\n")


def test_an_indexed_op_claims_the_byte_ranges_of_the_rows_it_names() -> None:
    """The regions are the rows' bytes (16 per row of a [8, 4] float32 cache), negative indices
    wrap, repeats count once, touching rows merge; a view starts at its storage offset; an
    index with ~10^6 entries (an expanded dispatch index) is read without a Python loop."""
    from asyncdbo.sim.ops import self_region

    aten = torch.ops.aten
    cache_SK = torch.zeros(8, 4)
    region = self_region(aten.index_select.default, (cache_SK, 0, torch.tensor([5, 1, 2, 2, -1])), {})
    assert region == ((16, 48), (80, 96), (112, 128))
    assert self_region(aten.index_copy_.default, (cache_SK[2:], 0, torch.tensor([0]), torch.zeros(1, 4)), {}) \
        == ((32, 48),)
    assert self_region(aten.index_select.default, (cache_SK, 0, torch.tensor([], dtype=torch.long)), {}) == ()
    big = torch.arange(8).repeat_interleave(125_000)  # every row, 10^6 entries
    assert self_region(aten.index_select.default, (cache_SK, 0, big), {}) == ((0, 128),)
    # along dim 1 a "row" is a column: strided, so each named column claims its span down the rows
    assert self_region(aten.index_select.default, (cache_SK, 1, torch.tensor([3])), {}) == ((12, 128),)
