"""benchmarks/first_contact.py, the script for the first GPU: on a CPU its ``--dry-run`` runs every
step's code under the fake device (asyncdbo.testing.fake_device) in its own process, and each
step writes its JSON line; without ``--dry-run`` and without CUDA it stops after the environment."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "first_contact.py"
STEPS = ["env", "headline", "invariants", "syncs", "graph", "tests", "numerics"]


def _lines(out: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in (out / "first_contact.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_dry_run_starts_every_step_and_writes_its_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)], capture_output=True,
                          text=True, timeout=1750, check=False)
    lines = _lines(tmp_path)
    assert [ln["step"] for ln in lines] == STEPS, proc.stdout + proc.stderr
    assert [(ln["step"], ln["ok"], ln.get("error")) for ln in lines] == [(s, True, None) for s in STEPS], \
        (tmp_path / "steps.log").read_text()[-5000:]
    assert proc.returncode == 0
    by = {ln["step"]: ln for ln in lines}
    # under the fake, time is virtual: the overlap program takes max(20, 20) ms, not 40
    assert {p: r["ratio"] for p, r in by["headline"]["sleep_overlap_program"].items()} == {"role": 0.5, "ubatch": 0.5}
    assert all(c["equal"] and c["caller_stream_restored"] and not c["wrong_stream"] for c in by["invariants"]["cases"])
    assert by["graph"]["toy"]["captured"] is True
    assert sorted(f.name for f in tmp_path.iterdir()) == ["first_contact.jsonl", "junit.xml", "steps.log"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the script runs for real")
@pytest.mark.timeout(300)
def test_without_cuda_it_stops_after_the_environment_with_status_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=280, check=False)
    assert proc.returncode == 2
    assert "first_contact: torch sees no CUDA device here; on a CPU run --dry-run" in proc.stderr
    (env,) = _lines(tmp_path)
    assert (env["step"], env["ok"], env["cuda_available"]) == ("env", False, False)
