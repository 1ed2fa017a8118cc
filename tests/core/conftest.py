"""Every kernel spec in this folder runs twice: on the kernel's C fast loop (asyncdbo/_core/_spin.c,
what an install with a C compiler runs) and on its Python loop, the reference."""

from __future__ import annotations

import pytest

from asyncdbo._core import kernel

KERNEL_LOOPS = ["c", "python"] if kernel._spin is not None else ["python"]


@pytest.fixture(autouse=True, params=KERNEL_LOOPS)
def kernel_loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "python":
        monkeypatch.setattr(kernel, "_spin", None)
    return str(request.param)
