"""Device and link presets as docs/sim.md states them, and multi-token decode (MTP, speculative
verify) modeled as decode."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

import asyncdbo
from asyncdbo.backends.links import LINKS
from asyncdbo.sim.devices import DEVICES
from asyncdbo.sim.model import attention_groups, default_requests, order
from asyncdbo.sim.predict import Deployment, ModelShape, predict

DOCS = (Path(__file__).resolve().parents[2] / "docs" / "sim.md").read_text()
TINY = ModelShape(name="tiny", hidden=64, intermediate=32, experts=8, top_k=2, shared_experts=1, heads=2, kv_heads=1,
                  head_dim=16, v_head_dim=16, layers=2)


def _tflops(flops: float) -> str:
    return f"{flops / 1e12:,.0f} TFLOP/s"


@pytest.mark.parametrize("name", ["h20", "b200"])
def test_the_new_device_presets_are_the_docs_numbers(name: str) -> None:
    d = DEVICES[name]
    row = f"| `{name}` | {_tflops(d.peak_flops)} | {_tflops(d.peak_8bit_flops)} | {d.hbm_Bps / 1e12:.1f} TB/s |"
    assert row in DOCS, row
    assert (d.kernel_overhead_s, d.mem_efficiency, d.min_tile) == (2e-6, 0.45, 64)  # Hopper's: not calibrated


def test_the_pcie_link_is_the_docs_numbers() -> None:
    link = LINKS["pcie5"]
    assert 32e9 * 16 * 128 / 130 / 8 == pytest.approx(link.bandwidth_Bps, rel=0.01)  # PCIe 5.0 x16
    assert f"| `pcie5` | {link.bandwidth_Bps / 1e9:.0f} GB/s | {link.latency_s * 1e6:.0f} us |" in DOCS


def test_multi_token_decode_requests_are_attended_as_decode() -> None:
    reqs = order([(4096, 0), *default_requests(6, "decode", 2000, spec_tokens=2), (3, 0), (1, 500)])
    assert reqs == [(1, 500), (3, 2000), (3, 2000), (4096, 0), (3, 0)]
    # (first row, rows, queries per request, keys): one call per query count; a 3-token prompt
    # with nothing cached is prefill
    assert attention_groups([(1, 501), (3, 2003), (3, 2003), (4096, 4096), (3, 3)]) == [
        (0, 1, 1, 501), (1, 6, 3, 2003), (7, 4096, 4096, 4096), (4103, 3, 3, 3)]
    with pytest.raises(ValueError, match=r"tokens \(7\) must be a multiple of 3"):
        default_requests(7, "decode", 2000, spec_tokens=2)


def test_predict_runs_multi_token_decode_clean() -> None:
    run = functools.partial(predict, 12, model=TINY, deployment=Deployment(ep=4), spec_tokens=1, ubatches=2)
    p = asyncdbo.run(run, loop="asyncio")
    assert (p.serial.races, p.dbo.races, p.dbo.lost_overlaps) == ([], [], [])
    assert p.serial_layer_s > 0 and p.dbo_layer_s > 0
