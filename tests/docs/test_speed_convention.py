"""One speed convention in every output: ``speedup = serial time / DBO time`` (README). No source
that prints results (the package, the benchmarks, the examples) may print the inverse ratio."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INVERSE = re.compile(r"\b(DBO|dbo)\s*/\s*serial\b|\bDBO\s+over\s+serial\b")
SOURCES = sorted([*(ROOT / "asyncdbo").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
                  *(ROOT / "examples").glob("*.py")])


def test_no_output_prints_dbo_over_serial() -> None:
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in SOURCES
             for n, line in enumerate(p.read_text().splitlines(), 1) if INVERSE.search(line)]
    assert found == [], "print speedup = serial / DBO instead:\n" + "\n".join(found)


def test_the_check_finds_the_inverse_ratio() -> None:
    assert INVERSE.search('"| comm hidden | DBO / serial wall |"')
    assert not INVERSE.search('"| speedup (serial / DBO wall) |"')


def test_real_dims_prints_the_speedup_as_serial_over_dbo() -> None:
    import importlib
    import sys

    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = importlib.import_module("real_dims")

    def row(mode: str, wall_s: float) -> dict[str, object]:
        return {"link": "none", "shape": "prefill", "mode": mode, "wall_s": wall_s, "cpu_s": 0.1, "torch_s": 0.1,
                "comm_call_s": 0.0, "idle_s": 0.0, "host_s": 0.01, "comm_s": 0.01, "hidden": 0.5,
                "hidden_by_other": 0.4, "tokens": 64, "microbatched": mode == "dbo", "reason": "microbatched"}

    est = {"describe": "2 GiB", "weights": 2**30, "kv_cache": 2**20, "per_rank": 2**31}
    pr = {"rank": 0, "load_s": 1.0, "param_bytes": 2**30, "kv_bytes": 2**20, "load_peak": 2**31, "step_peak": 2**31,
          "peak_reset": True, "rows": [row("serial", 0.3), row("dbo", 0.2)]}
    settings = {"layers": 2, "dtype": "bf16", "prefill_tokens": 64, "decode_requests": 4, "context": 64, "warmup": 1,
                "steps": 1, "link": "ib400", "link_scale": 1000}
    run = {"name": "qwen3-moe", "estimate": est, "per_rank": [pr], "settings": settings, "command": "cmd",
           "write_s": 1.0, "started": "now", "load_start": "0.1", "load_last": "0.1", "status": "complete",
           "config": "c"}
    text = "\n".join(bench.render_run(run))
    assert "speedup: serial wall / DBO wall, above 1x DBO is faster." in text
    assert "| none | prefill | 0 | 64 | dbo | 200.0 | 320 | 100.0 |" in text  # 64 tokens in 200 ms
    assert "| comm | comm hidden | speedup (serial / DBO wall) | microbatched |" in text
    assert "| 50% (40%) | 1.50x | 1/1 |" in text  # serial 300 ms, DBO 200 ms
