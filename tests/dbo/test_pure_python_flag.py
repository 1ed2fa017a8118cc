"""``ASYNCDBO_PURE_PYTHON=1`` runs the Python primitives (the switch for debugging the C ones).

A fresh process, so a plain test, once: test_speedups.py's specs repeat on both kernel loops and
both event loops of this process, which the process it starts never sees.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(60)
def test_pure_python_on_request() -> None:
    code = "import asyncdbo, asyncdbo.dbo.primitives as p; print(p.FAST is None, asyncdbo.dbo_yield is p.PURE['dbo_yield'])"
    env = {**os.environ, "ASYNCDBO_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "True"]
