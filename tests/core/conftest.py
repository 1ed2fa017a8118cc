"""Every kernel spec in this folder runs twice: on the kernel's C fast loop (asyncdbo/_core/_spin.c,
what an install with a C compiler runs) and on its Python loop, the reference (``kernel_loop``,
tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def on_each_kernel_loop(kernel_loop: str) -> str:
    return kernel_loop
