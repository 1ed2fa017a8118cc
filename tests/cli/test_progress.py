"""Long commands say how much they will run and how far they are, on a terminal only.

``check``, ``demo`` (the mini model and ``--model``) and the benchmarks run under a pseudo-terminal (the ``pty`` module), as a user at a shell
would: stderr is a TTY there, so the up-front "N ... to run" line and the ``[i/N]`` status line
appear, each status rewritten in place and erased before the real output. With ``-q``, or when
stderr is a pipe, none of it is written.

``demo`` runs as a ``python -m asyncdbo`` process on the terminal (its ranks write there too);
``check`` and the benchmark compute in-process (no ranks), so they run here with ``sys.stdout``
and ``sys.stderr`` on the terminal (:func:`in_a_terminal`): a fresh interpreter per run imported
torch again, most of such a test's time.
"""

from __future__ import annotations

import os
import pty
import re
import select
import contextlib
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

from asyncdbo.cli import main as cli_main

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
sys.path.insert(0, BENCH)  # the benchmarks import their helpers as top-level modules

CHECK = ["check", "--model", "qwen3-moe", "--hidden", "64", "--intermediate", "32", "--experts", "8", "--heads", "4",
         "--ep", "4", "--tokens", "16,32"]
DEMO = ["demo", "--hidden", "64", "--layers", "1", "--experts", "4", "--steps", "2", "--warmup", "1", "--tokens", "64"]
ERASE = "\r\x1b[K"


def run_in_a_terminal(argv: list[str], timeout_s: float = 100.0) -> tuple[int, str]:
    """``python -m asyncdbo *argv`` with stdin, stdout and stderr on a pseudo-terminal; its exit
    status and everything it wrote (a terminal turns "\\n" into "\\r\\n")."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "asyncdbo", *argv], stdin=slave, stdout=slave, stderr=slave,
                            close_fds=True)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if not ready:
                if proc.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal (EIO on Linux)
                break
            if not chunk:
                break
            out += chunk
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        os.close(master)
    return proc.returncode, out.decode().replace("\r\n", "\n")


def in_a_terminal(argv: list[str], main: Callable[[list[str]], int] = cli_main) -> tuple[int, str]:
    """``main(argv)`` (``asyncdbo.cli.main``, or a benchmark's) in this process with ``sys.stdout``
    and ``sys.stderr`` on one pseudo-terminal (both a TTY, in the order written, as in a shell);
    its status and everything written there, read by a thread as it comes (a terminal's buffer is
    a few KiB)."""
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # every slave end closed, buffer drained (EIO on Linux)
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=drain, name="pty-drain", daemon=True)
    reader.start()
    try:
        with open(slave, "w", encoding="utf-8", closefd=True) as term:
            assert term.isatty()
            with contextlib.redirect_stdout(term), contextlib.redirect_stderr(term):
                rc = main(argv)
    finally:
        reader.join(timeout=30)
        alive = reader.is_alive()
        os.close(master)
    assert not alive, "the terminal's reader did not see the end of the output"
    return rc, b"".join(chunks).decode().replace("\r\n", "\n")


@pytest.mark.timeout(120)
def test_check_says_how_many_configurations_and_which_one_runs() -> None:
    rc, out = in_a_terminal(CHECK)
    assert rc == 0, out
    lines = out.split("\n")
    assert lines[0] == "2 configurations (serial and DBO each) to run"  # before anything else
    assert lines[1].startswith("asyncdbo check: qwen3-moe: hidden 64")
    assert f"{ERASE}[1/2] 16 tokens/rank, role streams ...{ERASE}         16 " in out
    assert f"{ERASE}[2/2] 32 tokens/rank, role streams ...{ERASE}         32 " in out


@pytest.mark.timeout(120)
def test_check_with_q_prints_no_progress_on_a_terminal() -> None:
    rc, out = in_a_terminal([*CHECK, "-q"])
    assert rc == 0, out
    assert "to run" not in out and "[1/2]" not in out and "\x1b[K" not in out
    assert out.startswith("asyncdbo check: qwen3-moe: hidden 64")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_demo_counts_its_steps_as_the_user_does() -> None:
    rc, out = run_in_a_terminal(DEMO)
    assert rc == 0, out
    assert out.startswith("3 steps (each serial, then DBO) on 2 ranks to run\n")
    for i, kind in ((1, "warm-up"), (2, "timed"), (3, "timed")):
        assert f"{ERASE}[{i}/3] step {i} ({kind}): serial, then DBO ..." in out
    # the status line is erased before the table, which reads as it does without a terminal
    assert f"{ERASE}asyncdbo demo: 2 ranks x 64 tokens (prefill), 1 layer" in out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_demo_of_a_hugging_face_model_shows_each_phase_and_step() -> None:
    rc, out = run_in_a_terminal(["demo", "--model", "qwen3-moe", "--tokens", "48", "--steps", "2", "--warmup", "1",
                                 "--prefill-threshold", "1"], timeout_s=190)
    assert rc == 0, out
    assert out.startswith("3 steps (a prefill, then 2 decode; each serial, then DBO) after 1 untimed warm-up "
                          "generation(s) on 2 ranks to run\n")
    phases = ["saving the tiny random model as a checkpoint ...",
              "starting 2 ranks, each loading its share of the checkpoint ...",
              "warm-up generation 1 of 1 (untimed) ...",
              "[1/3] prefill: serial, then DBO ...",
              "[2/3] decode step 1: serial, then DBO ...",
              "[3/3] decode step 2: serial, then DBO ...",
              "comparing with transformers' forward ...",
              "asyncdbo demo: qwen3-moe"]
    assert ERASE.join(phases) in out  # in this order, each erasing the one before
    # the decode steps (1-4 requests per rank) stay below the decode threshold: no speedup for them
    assert "(no speedup: none of the 2 steps microbatched)\n" in out
    # ... and the report says which flag value would reach them
    assert re.search(r"^DBO steps: 2 of 3 steps ran unsplit \(one batch per rank, as in the serial run\):\n"
                     r"  2 of 2 decode steps ran unsplit, below the threshold: a rank splits a decode batch from 32 "
                     r"tokens up \(--decode-threshold 32\), and the ranks with requests had \d( to \d)? tokens; "
                     r"--decode-threshold \d would split them\n  \(the thresholds' defaults are vLLM's", out, re.MULTILINE), out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_demo_of_a_hugging_face_model_with_q_prints_no_progress() -> None:
    rc, out = run_in_a_terminal(["demo", "--model", "qwen3-moe", "--tokens", "48", "--steps", "1", "--warmup", "0", "-q"],
                                timeout_s=190)
    assert rc == 0, out
    assert "\x1b[K" not in out and "to run" not in out and out.startswith("asyncdbo demo: qwen3-moe")


@pytest.mark.timeout(120)
def test_no_progress_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(CHECK) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert "[1/2]" not in captured.out and captured.out.startswith("asyncdbo check: qwen3-moe")


@pytest.mark.timeout(120)
def test_check_workload_counts_its_steps() -> None:
    rc, out = in_a_terminal(["check", "--workload", "synthetic", "--policy", "fixed", *CHECK[1:-2]])
    assert rc == 0, out
    assert "\n16 workload steps (each composition simulated once) to run\n" in out
    assert f"{ERASE}[1/16] fixed, role streams: step 1 of 16 ...{ERASE}[2/16] fixed, role streams: step 2 of 16 ..." in out
    assert f"[16/16] fixed, role streams: step 16 of 16 ...{ERASE}throughput, real tokens of all ranks" in out


@pytest.mark.timeout(150)
def test_a_benchmark_shows_its_progress_on_a_terminal_and_not_with_q(tmp_path: "os.PathLike[str]") -> None:
    import sim_sweep

    level = logging.getLogger("asyncdbo").level  # the script quiets the asyncdbo logger: put it back
    try:
        rc, out = in_a_terminal(["--quick", "--out", str(tmp_path)], sim_sweep.main)
        assert rc == 0, out
        assert out.startswith("1 points to simulate (serial and DBO in 2 ubatches each) to run\n")
        assert f"{ERASE}[1/1] decode, 16 tokens/rank, ib400 ...{ERASE}" in out
        rc, out = in_a_terminal(["--quick", "-q"], sim_sweep.main)  # no --out: -q alone matters
        assert rc == 0, out
        assert "\x1b[K" not in out and "to run" not in out
    finally:
        logging.getLogger("asyncdbo").setLevel(level)
