"""The sim against published numbers: DeepEP's tables fit the comm presets, and the shipped presets
reproduce the published-vs-predicted table (asyncdbo.sim.calibration.TABLE, docs/sim.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncdbo.sim.calibration import TABLE, Row, band, compare, error
from asyncdbo.sim.comm import COMMS, fit_low_latency, payload_scale, wire_share
from asyncdbo.sim.devices import device_spec
from asyncdbo.sim.published import DEEPEP_LL, END_TO_END

DOCS = Path(__file__).resolve().parents[2] / "docs" / "sim.md"


def test_the_low_latency_fit_passes_within_six_percent_of_every_deepep_row_it_uses() -> None:
    fixed_s, eff, rows = fit_low_latency()
    assert [ep for ep, kind, _, _ in rows if kind == "dispatch"] == [r.ep for r in DEEPEP_LL if r.ep >= 32]
    for ep, kind, published, fitted in rows:
        assert abs(fitted - published) / published < 0.06, (ep, kind, published, fitted)
    assert 0 < eff <= 1 and fixed_s > 0
    deepep = COMMS["deepep"]
    assert deepep.ll_efficiency == (("ib400", eff),)
    assert deepep.ll_fixed_s == pytest.approx(fixed_s - 10e-6)  # the link's own 10 us latency is added apart
    # normal mode: the mean of DeepEP's measured bandwidths over the link's peak (capped at 1)
    assert dict(deepep.efficiency) == {"nvlink": pytest.approx(155.5 / 200), "ib400": 1.0}


def test_fp8_payloads_and_the_share_of_bytes_on_the_link() -> None:
    assert payload_scale(True) == pytest.approx((7168 + 7168 / 128 * 4) / (7168 * 2))
    assert wire_share(32, 8, scale_out=True) == 24 / 32  # other nodes only: NVLink carries the rest
    assert wire_share(8, 8, scale_out=True) == 7 / 8 == wire_share(8, 8, scale_out=False)


def test_errors_count_points_outside_a_published_range_or_bound() -> None:
    assert error(-0.27, -0.288) == pytest.approx(-1.8)
    assert error((0.27, 0.35), 0.30) == 0.0 and error((0.27, 0.35), 0.394) == pytest.approx(4.4)
    assert error((None, 0.0), -0.1) == 0.0 and error((0.0, None), -0.02) == pytest.approx(-2.0)


def test_the_hopper_presets_carry_the_calibrated_pair() -> None:
    h100 = device_spec("h100")
    assert (h100.kernel_overhead_s, h100.small_kernel_overhead_s, h100.mem_efficiency) == (2e-6, 0.5e-6, 0.45)


@pytest.mark.timeout(300)
def test_the_shipped_presets_reproduce_the_published_vs_predicted_table() -> None:
    assert [r.label for r in TABLE] == [p.label for p in END_TO_END]
    got = compare()
    for want, row in zip(TABLE, got):
        assert (row.label, row.use, row.published) == (want.label, want.use, want.published)
        assert row.predicted == pytest.approx(want.predicted, abs=5e-4), row
        assert row.error_pts == pytest.approx(want.error_pts, abs=0.05), row
    cal = [r for r in got if r.use == "calibrate"]
    assert max(abs(r.error_pts) for r in cal) < 3  # the fit holds its calibration points


def test_docs_carry_the_table_with_the_calibration_points_marked() -> None:
    text = DOCS.read_text()
    for r in TABLE:
        line = f"| {r.label} | {'**calibration**' if r.use == 'calibrate' else 'held out'} | {r.published} | " \
               f"{r.predicted * 100:+.1f}% | {r.error_pts:+.1f} |"
        assert line in text, line
    assert band(TABLE) in text


def test_the_band_names_the_calibration_residual_and_every_held_out_error() -> None:
    rows = (Row("a", "calibrate", "-27%", -0.28, -1.0), Row("b", "held-out", "+12%", 0.5, 38.0))
    assert band(rows) == ("error band: calibrated on SGLang's H100+IB decode curve (residual <= 1.0 points); held-out "
                          "errors in points of speedup (1 point = 0.01x): b +38.0 (docs/sim.md)")
