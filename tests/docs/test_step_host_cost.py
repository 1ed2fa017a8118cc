"""``benchmarks/step_host_cost.py`` still runs, and measures what it says (no time is checked).

One worker round in this process on tiny sizes: each part of a step is there, the auto runners
settled on their targets (the worker asserts it), the 61-layer measurement ran every step and
sampled; and the report's tables come out of the rounds given.
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the benchmarks import their helpers as top-level modules

import step_host_cost  # noqa: E402


def test_a_worker_round_measures_every_part_and_both_settled_auto_runners() -> None:
    out = step_host_cost.worker([8, 16], 20)
    for size in ("8", "16"):
        assert set(out[size]) == set(step_host_cost.PARTS)
        parts = out[size]
        assert parts["split"] > 0 and parts["plan"] >= parts["split"]  # the split is timed, inside the plan
        assert parts["fixed"] == parts["step"] - parts["run_ubatches"]
    assert set(out["auto"]) == {"fixed", "auto", "off", "auto off"} and min(out["auto"].values()) > 0
    assert set(out["measure61"]) == {"every step", "sampled"}
