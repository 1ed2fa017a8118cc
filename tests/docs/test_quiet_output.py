"""No other library's noise in a command's output: torch.profiler's kineto prints
``USDT: ... profiler_start`` / ``profiler_stop`` on stderr at every profile unless its log level
is raised, which benchmarks/real_dims.py does for itself and its ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ("import torch\nfrom torch.profiler import ProfilerActivity, profile\n"
           "with profile(activities=[ProfilerActivity.CPU]):\n    torch.ones(3) + 1\n")


def test_real_dims_sets_the_quiet_levels_before_torch_starts() -> None:
    text = (ROOT / "benchmarks" / "real_dims.py").read_text()
    quiet = text.index('os.environ.setdefault("KINETO_LOG_LEVEL", "6")')
    assert quiet < text.index("import torch")
    assert 'os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")' in text


def test_kineto_level_6_silences_the_profiler_lines() -> None:
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    quiet = subprocess.run([sys.executable, "-c", PROFILE], env={**env, "KINETO_LOG_LEVEL": "6"},
                           capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert "USDT" not in quiet.stderr and "profiler_start" not in quiet.stderr, quiet.stderr
