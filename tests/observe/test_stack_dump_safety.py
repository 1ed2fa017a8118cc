"""The stack dump is safe at every moment from start-up to exit, and says who printed it; an
interruption that ends a run (a timeout, a cancellation, Ctrl-C) says where each ubatch was."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

import pytest

from asyncdbo import dbo_yield, run_ubatches
from asyncdbo.observe import stacks
from asyncdbo.observe.stacks import dump_stacks, install_stack_dump_signal
from asyncdbo.testing import RankPool

from _procs import children, signal_masks

HERE = __file__


def line_of(marker: str) -> int:
    with open(HERE, encoding="utf-8") as f:
        hits = [i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, (marker, hits)
    return hits[0]


# ------------------------------------------------------------------------- who printed it
def test_a_dump_names_the_rank_from_the_environment_and_the_pid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert dump_stacks() == f"asyncdbo stacks of rank 3 of 4, pid {os.getpid()}, printed by dump_stacks()\nasyncdbo: no live DBO run\n"


def test_the_handler_writes_to_descriptor_2_when_stderr_is_gone(capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    uninstall = install_stack_dump_signal(signal.SIGUSR1)
    try:
        monkeypatch.setattr(sys, "stderr", None)
        signal.raise_signal(signal.SIGUSR1)
    finally:
        monkeypatch.undo()
        uninstall()
    assert capfd.readouterr().err == (
        f"asyncdbo stacks of pid {os.getpid()}, printed by the signal handler (SIGUSR1)\nasyncdbo: no live DBO run\n"
    )


def test_the_handler_never_raises_and_never_nests(monkeypatch: pytest.MonkeyPatch) -> None:
    buf = io.StringIO()
    uninstall = install_stack_dump_signal(signal.SIGUSR1, file=buf)
    calls = []

    def broken() -> list[object]:
        calls.append(1)
        signal.raise_signal(signal.SIGUSR1)  # a second signal while the first dump is being made
        raise RuntimeError("registry in an odd state")

    try:
        monkeypatch.setattr(stacks, "live_runs", broken)
        signal.raise_signal(signal.SIGUSR1)
    finally:
        uninstall()
    assert calls == [1]
    assert buf.getvalue().endswith(
        ": the signal handler could not format them (RuntimeError: registry in an odd state)\n"
    )


def test_at_exit_the_signal_is_ignored_rather_than_fatal() -> None:
    """Interpreter teardown resets a Python handler to the default action (which ends the process
    on SIGUSR1); from the atexit hook on, the signal is ignored instead."""
    code = (
        "import atexit, os, signal\n"
        "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGUSR1), print('sent at exit')))\n"
        "from asyncdbo.observe import install_stack_dump_signal\n"
        "install_stack_dump_signal()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "sent at exit\n"
    assert out.stderr.count("printed by the signal handler (SIGUSR1)") == 1  # the one sent while running


# ------------------------------------------------------------------------- a rank's start-up
def install_and_report(rank: int, world: int) -> int:
    install_stack_dump_signal()  # what asyncdbo demo's ranks do first; a held signal prints now
    return os.getpid()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_signalled_from_its_first_moment_survives_and_prints_once_it_can(capfd: pytest.CaptureFixture[str]) -> None:
    """SIGUSR1 to every worker of a RankPool from the moment it exists: the workers start with it
    blocked, so none dies of it; the one held is printed when the handler is installed."""
    stop = threading.Event()
    signalled: set[int] = set()

    def storm() -> None:
        while not stop.is_set():
            for pid in children(os.getpid()):
                try:
                    os.kill(pid, signal.SIGUSR1)
                    signalled.add(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.005)

    sender = threading.Thread(target=storm, daemon=True)
    sender.start()
    try:
        with RankPool(2, timeout_s=120, start_timeout_s=240) as pool:
            pids = pool.run(install_and_report)
            procs = list(pool._procs)
    finally:
        stop.set()
        sender.join()
    assert set(pids) <= signalled  # each was signalled while it started up
    assert [p.exitcode for p in procs] == [0, 0]
    err = capfd.readouterr().err
    for rank, pid in enumerate(pids):
        assert f"asyncdbo stacks of rank {rank} of 2, pid {pid}, printed by the signal handler (SIGUSR1)\n" in err


# ------------------------------------------------------------------------- interruptions
async def _parked_forever(i: int) -> None:
    await dbo_yield("attn")
    if i == 0:
        await asyncio.get_running_loop().create_future()  # PARKED
    while True:
        await dbo_yield("spin")  # SPIN


def _where(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


@pytest.mark.asyncio
async def test_a_timeout_around_a_run_says_where_each_ubatch_was() -> None:
    try:
        await asyncio.wait_for(run_ubatches(_parked_forever, [(0,), (1,)], backend="host", name="slow"), 0.05)
    except TimeoutError as exc:
        text = _where(exc)
    else:
        raise AssertionError("no timeout")
    assert "asyncdbo: run 'slow' ended by CancelledError; where its ubatches were:\n" in text
    assert "ubatch 0: parked, last yield point 'attn', parked on <Future" in text
    assert f'File "{HERE}", line {line_of("PARKED")}, in _parked_forever' in text
    assert "ubatch 1: ready, last yield point 'spin'" in text
    assert f'File "{HERE}", line {line_of("SPIN")}, in _parked_forever' in text


@pytest.mark.asyncio
async def test_a_cancelled_run_says_where_each_ubatch_was() -> None:
    task = asyncio.ensure_future(run_ubatches(_parked_forever, [(0,), (1,)], backend="host", name="cancelled"))
    await asyncio.sleep(0.05)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError as exc:
        notes = exc.__notes__
    assert notes[0].startswith("asyncdbo: run 'cancelled' ended by CancelledError; where its ubatches were:\n"
                               "ubatch 0: parked, last yield point 'attn', parked on <Future")


_CTRL_C = r"""
import asyncio, os, signal
import asyncdbo
from asyncdbo import dbo_yield
from asyncdbo.observe.stacks import install_stack_dump_signal

# A Ctrl-C must reach this process whatever it inherited: an ignored signal and the signal mask
# pass through exec, so the test's own process state cannot leak in.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
install_stack_dump_signal()  # the test asks for the stacks if this ever hangs

async def forward(i):
    await dbo_yield("attn")
    if i == 0:
        asyncio.get_running_loop().call_later(0.1, os.kill, os.getpid(), signal.SIGINT)
        await asyncio.sleep(30)
    while True:
        await dbo_yield("spin")

async def main():
    return await asyncdbo.run_ubatches(forward, [(0,), (1,)], backend="host", name="interrupted")

asyncdbo.run(main, loop=os.environ["LOOP"])
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_ctrl_c_during_a_run_says_where_each_ubatch_was(loop: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _CTRL_C], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, LOOP=loop))
    try:
        stdout, stderr = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:  # say where it stood: its signal masks and its ubatches
        masks = signal_masks(proc.pid)
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"the interrupted run did not end within 90 s\n{masks}\n{stderr}")
    out = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert out.returncode != 0
    assert out.stderr.rstrip().endswith("KeyboardInterrupt"), out.stderr
    assert "asyncdbo: run 'interrupted' ended by " in out.stderr, out.stderr
    assert "ubatch 0: parked, last yield point 'attn', parked on " in out.stderr
    assert "ubatch 1: ready, last yield point 'spin'" in out.stderr
