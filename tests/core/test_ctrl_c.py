"""Ctrl-C in or between steps that never wait interrupts that step, on each kernel loop.

A fresh process per case (a real SIGINT, as in a terminal): a plain test, not one of
test_failure_paths.py's async ones, since the event loop those repeat on (asyncio's and uvloop)
would only run the same process twice; the script runs its own ``asyncio.run``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_CTRL_C = r"""
import asyncio, signal, sys
from asyncdbo import dbo_yield, run_ubatches

signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job ignores it)
where = sys.argv[1]

def press(at):  # Ctrl-C: asyncio.run's handler cancels its main task
    if at == where:
        signal.raise_signal(signal.SIGINT)

async def forward(i, step):
    for k in range(3):
        if i == 0 and k == 1 and step == 0:
            press("in a step")
        await dbo_yield()
    return i

async def serve():
    for step in range(3):
        if step == 1:
            press("between steps")  # in the loop's own code, between steps 0 and 1
        print(f"step {step}:", await run_ubatches(forward, [(0, step), (1, step)], name=f"step{step}"), flush=True)

try:
    asyncio.run(serve())
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("where", "printed"), [
    ("in a step", "KeyboardInterrupt\n"),  # before: steps 0, 1 and 2 ran, then the interrupt
    ("between steps", "step 0: [0, 1]\nKeyboardInterrupt\n"),  # before: the same
])
def test_ctrl_c_in_or_between_steps_that_never_wait_interrupts_that_step(kernel_loop: str, where: str,
                                                                        printed: str) -> None:
    env = dict(os.environ, ASYNCDBO_PURE_PYTHON="1" if kernel_loop == "python" else "0")
    out = subprocess.run([sys.executable, "-c", _CTRL_C, where], capture_output=True, text=True, timeout=100, env=env,
                         check=False)
    assert (out.stdout, out.returncode) == (printed, 0), out.stderr
