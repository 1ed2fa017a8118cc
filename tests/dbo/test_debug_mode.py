"""The yield-discipline checker: the first divergence of yield tags, named exactly."""

from __future__ import annotations

import asyncio

import pytest

from asyncdbo import YieldMismatchError, dbo_current_ubatch_id, dbo_yield, run_ubatches
from asyncdbo.dbo.debug import YieldChecker

#: the async specs run on both event loops (tests/conftest.py); the first-run test below is sync:
#: its subject is a fresh process, the same on either loop
pytestmark = [pytest.mark.timeout(30)]


def layer(tags_by_ub: dict[int, list[str]], log: list[str]):
    async def forward() -> int:
        ub = dbo_current_ubatch_id()
        for tag in tags_by_ub[ub]:
            log.append(f"ub{ub}:{tag}")
            await dbo_yield(tag)
        return ub

    return forward


@pytest.mark.asyncio
async def test_matching_yields_pass_in_debug_mode() -> None:
    log: list[str] = []
    tags = {0: ["attn", "dispatch", "combine"], 1: ["attn", "dispatch", "combine"]}
    assert await run_ubatches(layer(tags, log), [(), ()], debug=True) == [0, 1]
    assert log == ["ub0:attn", "ub1:attn", "ub0:dispatch", "ub1:dispatch", "ub0:combine", "ub1:combine"]


@pytest.mark.asyncio
async def test_a_mismatched_pair_is_reported_at_the_first_divergence() -> None:
    log: list[str] = []
    tags = {0: ["attn", "dispatch", "combine"], 1: ["attn", "combine", "dispatch"]}
    msg = (
        r"^yield mismatch in run 'mismatch': ubatch 1 yield #1 is 'combine' at .*tests/dbo/test_debug_mode\.py:\d+ "
        r"in layer\.<locals>\.forward but ubatch 0 yield #1 was 'dispatch' at .*tests/dbo/test_debug_mode\.py:\d+ "
        r"in layer\.<locals>\.forward\. "
        r"Sequences so far: ubatch 0: \['attn', 'dispatch'\]; ubatch 1: \['attn', 'combine'\]\. "
    )
    with pytest.raises(YieldMismatchError, match=msg):
        await run_ubatches(layer(tags, log), [(), ()], debug=True, name="mismatch")
    # the run stopped right there: ubatch 0 never reached its third yield
    assert log == ["ub0:attn", "ub1:attn", "ub0:dispatch", "ub1:combine"]


@pytest.mark.asyncio
async def test_a_ubatch_that_stops_yielding_early_is_a_length_mismatch() -> None:
    tags = {0: ["attn", "dispatch", "combine"], 1: ["attn", "dispatch"]}
    msg = (
        r"^yield mismatch in run 'short': ubatch 1 finished after 2 yields \(the last one at "
        r".*tests/dbo/test_debug_mode\.py:\d+ in layer\.<locals>\.forward\) but ubatch 0 made 3 "
        r"\(its yield #2 was 'combine' at .*tests/dbo/test_debug_mode\.py:\d+ in layer\.<locals>\.forward\)\. "
        r"Sequences: ubatch 0: \['attn', 'dispatch', 'combine'\]; "
        r"ubatch 1: \['attn', 'dispatch'\]\. "
    )
    with pytest.raises(YieldMismatchError, match=msg):
        await run_ubatches(layer(tags, []), [(), ()], debug=True, name="short")


@pytest.mark.asyncio
async def test_an_empty_ubatch_that_never_yields_is_allowed() -> None:
    tags = {0: ["attn", "combine"], 1: [], 2: ["attn", "combine"]}
    assert await run_ubatches(layer(tags, []), [(), (), ()], debug=True) == [0, 1, 2]


@pytest.mark.asyncio
async def test_parking_on_a_completion_is_not_a_yield() -> None:
    # ubatch 0 parks on an asyncio timer between its yields; ubatch 1 does not. Same yield tags.
    async def forward() -> int:
        ub = dbo_current_ubatch_id()
        await dbo_yield("a")
        if ub == 0:
            await asyncio.sleep(0.01)
        await dbo_yield("b")
        return ub

    assert await run_ubatches(forward, [(), ()], debug=True) == [0, 1]


@pytest.mark.asyncio
async def test_the_checker_works_as_an_explicit_instrument_and_is_reusable() -> None:
    checker = YieldChecker()
    tags = {0: ["x", "y"], 1: ["x", "y"]}
    await run_ubatches(layer(tags, []), [(), ()], instrument=checker)
    with pytest.raises(YieldMismatchError, match=r"ubatch 1 yield #0 is 'y' at .* but ubatch 0 yield #0 was 'x'"):
        await run_ubatches(layer({0: ["x"], 1: ["y"]}, []), [(), ()], instrument=checker)
    await run_ubatches(layer(tags, []), [(), ()], instrument=checker)


# ---------------------------------------------------------------- blocking code between yields
@pytest.mark.asyncio
async def test_debug_mode_reports_a_step_that_blocks_with_its_yield_points_and_lines(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The detector's clocks are this test's: ubatch 1's step between 'attn' and 'moe' takes 50 ms
    of wall time, 5 ms of it on the CPU (compute, on the host backend) and 7 ms waiting for a CPU
    (the machine's doing): blocked 38 ms, above the 20 ms threshold; every other step takes none."""
    from asyncdbo import run_ubatches_with_stats
    from asyncdbo.dbo import debug

    now = {"wall": 0.0, "cpu": 0.0, "runq": 0.0}
    monkeypatch.setattr(debug, "_wall", lambda: now["wall"])
    monkeypatch.setattr(debug._ThreadTimes, "read", lambda self: (now["cpu"], now["runq"]))

    async def forward(i: int) -> int:
        await dbo_yield("attn")
        if i == 1:  # a host sync in disguise: nothing else can run meanwhile
            now["wall"] += 0.050
            now["cpu"] += 0.005
            now["runq"] += 0.007
        await dbo_yield("moe")  # BLOCKED BEFORE THIS
        return i

    with open(__file__) as f:
        line = next(n + 1 for n, ln in enumerate(f) if ln.rstrip().endswith("# BLOCKED BEFORE THIS"))
    _, stats = await run_ubatches_with_stats(forward, [(0,), (1,)], debug=True, blocking_s=0.02)
    (step,) = stats.blocking
    assert (step.ub, step.from_tag, step.to_tag) == (1, "attn", "moe")
    assert step.to_where.endswith(f"tests/dbo/test_debug_mode.py:{line} in test_debug_mode_reports_a_step_that_blocks_with_its_yield_points_and_lines.<locals>.forward")
    assert step.blocked_s == pytest.approx(0.038)
    assert (step.cpu_s, step.runq_s, step.host) == (pytest.approx(0.005), pytest.approx(0.007), True)
    text = step.describe()
    assert text.startswith("asyncdbo: ubatch 1 was off the CPU for 38.0 ms between yield points 'attn'")
    assert text.endswith(
        "no other ubatch could run meanwhile. Measured: 50.0 ms wall = 5.0 ms computing on this thread + 7.0 ms "
        "waiting for a free core + 38.0 ms neither. On the CPU backend a host sync (.item(), .tolist()) waits for "
        "nothing, so it is not one: look for a time.sleep, a lock or a blocking wait (work.wait()); on a loaded "
        "machine, torch's intra-op threads that this thread waits for count here too (torch.set_num_threads(1) "
        "rules them out).")


def test_on_a_device_backend_the_blocking_warning_suggests_a_host_sync() -> None:
    from asyncdbo.dbo.debug import BlockingStep

    step = BlockingStep(0, "attn", "moe", "f.py:1", "f.py:2", 0.030, 0.025, 0.0, 0.030, 0.0, 0.005, False)
    assert step.describe() == (
        "asyncdbo: ubatch 0 blocked the CPU for 25.0 ms between yield points 'attn' (f.py:1) and 'moe' (f.py:2); "
        "no other ubatch could run meanwhile. Measured: 30.0 ms wall, less 5.0 ms waiting for a free core. On a "
        "device backend the CPU only launches work, so look for a host sync (.item(), .tolist(), .cpu(); "
        "asyncdbo.syncs.HostSyncs names each one and its line), a time.sleep or a lock in that stretch.")


def test_on_a_device_the_blocking_warning_names_the_host_syncs_it_saw_or_says_it_saw_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The detector watches each stretch with asyncdbo.syncs.HostSyncs on a device backend (here
    the fake device): ubatch 0's stretch reads a value to the host, ubatch 1's does not; both take
    30 ms of the test's clock. The warning names the sync and its line where there was one, and
    says none was seen (so it suggests none) where there was not."""
    torch = pytest.importorskip("torch", reason="a device backend (CI runs tests/dbo on 3.12/3.13 without torch)")
    import asyncdbo
    from asyncdbo import run_ubatches_with_stats
    from asyncdbo.backends.accelerator import AcceleratorBackend
    from asyncdbo.dbo import debug
    from asyncdbo.testing.fake_device import FakeDevice

    now = {"wall": 0.0}
    monkeypatch.setattr(debug, "_wall", lambda: now["wall"])
    monkeypatch.setattr(debug._ThreadTimes, "read", lambda self: (0.0, 0.0))

    async def forward(i: int, x: torch.Tensor) -> float:
        await dbo_yield("attn")
        total = x.sum()
        if i == 0:
            total.item()  # THE SYNC
        now["wall"] += 0.030
        await dbo_yield("moe")
        return 0.0

    with open(__file__) as f:
        line = next(n + 1 for n, ln in enumerate(f) if ln.rstrip().endswith("# THE SYNC"))
    with FakeDevice():
        x = torch.ones(4)
        _, stats = asyncdbo.run(lambda: run_ubatches_with_stats(
            forward, [(0, x), (1, x)], backend=AcceleratorBackend("cuda"), debug=True, blocking_s=0.02))
    synced, clean = stats.blocking
    assert (synced.ub, clean.ub) == (0, 1) and (synced.host, clean.host) == (False, False)
    (sync,) = synced.syncs
    assert sync.startswith(f"aten._local_scalar_dense at {__file__}:{line} (ubatch 0): ")
    assert synced.describe().endswith(
        f"In that stretch asyncdbo.syncs.HostSyncs saw 1 host sync, each a wait for the device: {sync}. Keep the "
        "value on the device, or move the read out of the stretch (before a yield point, or after the step).")
    assert clean.syncs == ()
    assert clean.describe().endswith(
        "Measured: 30.0 ms wall, less 0.0 ms waiting for a free core. asyncdbo.syncs.HostSyncs watched the stretch "
        "and saw no host sync in it, so the CPU was held by something else: a time.sleep, a lock, a blocking wait "
        "(work.wait()), or launching that much work.")


@pytest.mark.asyncio
async def test_the_thread_times_are_this_threads_cpu_and_run_queue_wait() -> None:
    from asyncdbo.dbo.debug import _ThreadTimes

    times = _ThreadTimes()
    try:
        cpu0, runq0 = times.read()
        sum(range(10**6))
        cpu1, runq1 = times.read()
    finally:
        times.close()
    assert cpu1 > cpu0 and runq1 >= runq0


@pytest.mark.asyncio
async def test_outside_debug_mode_nothing_is_measured() -> None:
    import time

    from asyncdbo import run_ubatches_with_stats

    async def forward(i: int) -> int:
        time.sleep(0.03)
        await dbo_yield("y")
        return i

    _, stats = await run_ubatches_with_stats(forward, [(0,), (1,)], blocking_s=0.01)
    assert stats.blocking == ()


@pytest.mark.asyncio
async def test_a_checker_that_fails_the_run_at_its_end_leaves_no_dispatch_mode_behind() -> None:
    pytest.importorskip("torch", reason="the checker is a torch dispatch mode (CI runs tests/dbo on 3.12/3.13 without torch)")
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    before = len(_get_current_dispatch_mode_stack())
    with pytest.raises(YieldMismatchError):
        await run_ubatches(layer({0: ["a", "b"], 1: ["a"]}, []), [(), ()], debug=True)
    assert len(_get_current_dispatch_mode_stack()) == before


# ---------------------------------------------------------------- what a user reads
@pytest.mark.asyncio
async def test_a_mismatch_names_both_yield_lines_of_the_users_file() -> None:
    async def uneven(skip_first: bool) -> None:
        if not skip_first:
            await dbo_yield("attention")  # line A
        await dbo_yield("moe")  # line B

    import inspect

    src, first = inspect.getsourcelines(uneven)
    line_a = first + next(i for i, s in enumerate(src) if "# line A" in s)
    line_b = first + next(i for i, s in enumerate(src) if "# line B" in s)
    with pytest.raises(YieldMismatchError) as info:
        await run_ubatches(uneven, [(False,), (True,)], debug=True)
    text = str(info.value)
    assert f"ubatch 1 yield #0 is 'moe' at {__file__}:{line_b} in " in text
    assert f"but ubatch 0 yield #0 was 'attention' at {__file__}:{line_a} in " in text



# ---------------------------------------------------------------- one-time set-up
FIRST_DEBUG_RUN = """
import json, sys
import torch
import asyncdbo
from asyncdbo import dbo_yield, run_ubatches
from asyncdbo.lowlevel import Instrument
from asyncdbo.observe import Tracer

class Modules(Instrument):
    def run_started(self, run): self.before = set(sys.modules)
    def run_finished(self, run, exc): self.after = set(sys.modules)

async def body(x):
    for _ in range(2):
        x = x @ x
        await dbo_yield("layer")
    return x

at_import = "torch._dynamo" in sys.modules
seen = Modules()
asyncdbo.run(lambda: run_ubatches(body, [(torch.eye(4),), (torch.eye(4),)], debug=True,
                                  instrument=[seen, Tracer()]), loop="asyncio")
print(json.dumps({"at_import": at_import, "at_start": "torch._dynamo" in seen.before,
                  "imported_in_run": sorted(seen.after - seen.before)}))
"""


@pytest.mark.timeout(150)
def test_the_first_debug_run_pays_its_one_time_set_up_before_its_steps() -> None:
    # torch's first op under a dispatch mode (debug mode's group guard is one) imports
    # torch._dynamo, seconds of CPU: it must happen before the run starts, where no step and no
    # Tracer counts it as compute, and not at `import asyncdbo` either. A fresh process shows it.
    pytest.importorskip("torch", reason="the set-up is torch's (CI runs tests/dbo on 3.12/3.13 without torch)")
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", FIRST_DEBUG_RUN], capture_output=True, text=True, timeout=140,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["at_import"] is False  # importing asyncdbo does not pay it
    assert seen["at_start"] is True  # the debug run paid it before its first step
    assert not [m for m in seen["imported_in_run"] if m.startswith("torch._dynamo")]


@pytest.mark.asyncio
async def test_the_one_time_set_up_is_paid_once() -> None:
    from asyncdbo.dbo.debug import prepare_dispatch_mode

    prepare_dispatch_mode()
    assert prepare_dispatch_mode() == 0.0
