"""Why an abandoned ubatch's coroutine outlives the interpreter (asyncdbo._core.cancel._keep_forever).

A ubatch that ignored CancelledError and then GeneratorExit is abandoned by its run. Finalizing it
later throws GeneratorExit in once more, outside any run, where the primitives are no-ops: a
coroutine that swallows it around a primitive then loops without suspending, and the interpreter's
exit hangs in it. Each case runs in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)


_ABANDON_AND_EXIT = r"""
import asyncio, os, sys
from asyncdbo import dbo_yield, run_ubatches
from asyncdbo._core import cancel

if sys.argv[1] == "no-extra-reference":
    cancel._keep_forever = cancel.ABANDONED.append  # what the kernel would do without Py_IncRef

spins = 0

async def forward(i):
    global spins
    if i == 0:
        await dbo_yield("start")
        raise ValueError("ub0 failed")
    while True:  # swallows everything; outside a run dbo_yield is a no-op, so this loop never suspends
        try:
            await dbo_yield("stubborn")
        except BaseException:
            pass
        spins += 1
        if spins == 100_000:  # bounded here, so that the test sees the spin without hanging
            os.write(1, b"finalized at exit and spun\n")
            return

try:
    asyncio.run(run_ubatches(forward, [(0,), (1,)], backend="host"))
except ValueError as exc:
    print(exc.__notes__[1].split(";")[1].strip())
"""


@pytest.mark.parametrize("extra_reference", [True, False], ids=["as-shipped", "no-extra-reference"])
def test_an_abandoned_ubatch_is_never_finalized_so_the_interpreter_exits(kernel_loop: str, extra_reference: bool) -> None:
    """Why cancel._keep_forever takes a reference that is never dropped: without it, interpreter
    exit finalizes the abandoned coroutine, which swallows GeneratorExit once more and spins."""
    env = dict(os.environ, ASYNCDBO_PURE_PYTHON="1" if kernel_loop == "python" else "0")
    out = subprocess.run(
        [sys.executable, "-c", _ABANDON_AND_EXIT, "as-shipped" if extra_reference else "no-extra-reference"],
        capture_output=True, text=True, timeout=120, env=env, check=False,
    )
    assert out.returncode == 0, out.stderr
    expected = "it was abandoned (its cleanup did not finish). Let CancelledError and GeneratorExit propagate.\n"
    if not extra_reference:
        expected += "finalized at exit and spun\n"
    assert out.stdout == expected
