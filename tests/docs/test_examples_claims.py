"""The claims the examples make, checked: 04 (the host sync made a park) beats 03 (the host sync
that blocks the thread) on the modeled link, as a ratio measured in one run.

Both examples run in one fresh interpreter (they set torch's thread count at import), alternating
three times, each call timing five serial/DBO pairs and returning medians; the test compares the
medians of the two examples' speedups (serial / DBO), each step's time taken as its wall time less
the time its thread waited for a CPU core (other jobs' load; Linux's schedstat). On a 2-core VM
shared with other jobs at load average 10-11, 04/03 measured 1.23-1.35 that way in four runs (04
1.12-1.21x, 03 0.84-0.95x), where the plain wall-time ratio of the same runs spread over
1.10-2.03; the stated margin is 1.15. The blocked time is a measure of the schedule, not of the
machine's speed: 03 blocks the CPU for most of one link latency (4 ms) per ubatch and layer (2.7-3.5
ms on average over a step's 6 in one run on that VM), 04 never.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARGIN = 1.15  # stated in both examples' docstrings and docs/troubleshooting.md

SCRIPT = """
import importlib.util, json, statistics, sys

def load(name):
    spec = importlib.util.spec_from_file_location(name.replace(".py", ""), f"examples/{name}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

broken = load("03_item_kills_overlap_broken.py")
fixed = load("04_item_kills_overlap_fixed.py")
runs = {"broken": [], "fixed": []}
for _ in range(3):
    runs["broken"].append(broken.main(quiet=True, rounds=5))
    runs["fixed"].append(fixed.main(quiet=True, rounds=5))
print(json.dumps({"runs": runs, "latency_s": broken.LINK.latency_s, "layers": broken.LAYERS,
                  "blocking_s": broken.BLOCKING_S}))
"""


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_fixed_example_beats_the_broken_one_by_the_stated_margin() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=140,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = data["runs"]

    def median(values: list[float]) -> float:
        return sorted(values)[len(values) // 2]

    broken = median([r["speedup"] for r in runs["broken"]])
    fixed = median([r["speedup"] for r in runs["fixed"]])
    assert fixed / broken >= MARGIN, (fixed, broken, runs)

    # 03 blocks the thread once per ubatch and layer for most of the link latency (less what the
    # other ubatch's work already covered of it, and only steps past the example's 3 ms blocking
    # threshold count); 04 parks instead.
    expected_block_s = 2 * data["layers"] * data["latency_s"]
    assert median([r["dbo_blocked_s"] for r in runs["broken"]]) >= 0.5 * expected_block_s, runs
    assert median([r["dbo_blocked_s"] for r in runs["fixed"]]) <= 0.25 * expected_block_s, runs
