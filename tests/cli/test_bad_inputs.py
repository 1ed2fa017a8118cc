"""Every bad input gets one clear line before anything runs: the value, and the fix.

One table per command; each row is the flags and the exact message. Sizes that do not fit are
refused from an estimate before any rank starts; the available memory is pinned to 8 GiB here, and
the process's memory limits to none, so the messages are exact on any machine (one test sets a
real limit, in a subprocess).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import asyncdbo
from asyncdbo.cli import inputs
from asyncdbo.cli import main as cli_main
from asyncdbo.cli.demo import DemoConfig
from asyncdbo.cli.demo_memory import check_memory

GIB = 2**30
MIB = 2**20


@pytest.fixture(autouse=True)
def eight_gib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inputs, "available_bytes", lambda: 8 * GIB)
    monkeypatch.setattr(inputs, "process_limits", lambda: [])  # as if no ulimit were set


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "not_a_dir"
    path.write_text("x")
    return path


DEMO = [
    (["--timeout", "0"], "--timeout 0 is not a positive number of seconds; use e.g. --timeout 120"),
    (["--timeout", "-1"], "--timeout -1 is not a positive number of seconds; use e.g. --timeout 120"),
    (["--timeout", "nan"], "--timeout nan is not a positive number of seconds; use e.g. --timeout 120"),
    (["--timeout", "inf"], "--timeout inf is longer than a day (86400 s), the longest wait asyncdbo can bound; "
                           "use at most --timeout 86400"),
    (["--timeout", "1e12"], "--timeout 1e+12 is longer than a day (86400 s), the longest wait asyncdbo can bound; "
                            "use at most --timeout 86400"),
    (["--link", "ib400", "--link-scale", "inf"], "--link-scale must be a finite number > 0 (got inf); the default is 1000"),
    (["--tokens", "5000000"], "--tokens 5000000 needs about 2.2 PiB for 2 rank(s) on this machine (estimated before "
                              "starting them; the prefill step's attention scores dominate), but 8.0 GiB is available; "
                              "use --tokens 8803 or fewer"),
    (["--tokens", "5000000", "--shape", "decode"],
     "--tokens 5000000 needs about 8.5 TiB for 2 rank(s) on this machine (estimated before starting them; the decode "
     "step's KV cache and activations dominate), but 8.0 GiB is available; use --tokens 4309 or fewer"),
]


@pytest.mark.parametrize(("flags", "message"), DEMO, ids=[" ".join(f) for f, _ in DEMO])
def test_demo_refuses_before_any_rank_starts(capsys: pytest.CaptureFixture[str], flags: list[str], message: str) -> None:
    assert cli_main(["demo", *flags]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"asyncdbo demo: error: {message}\n")


def test_demo_trace_must_be_a_writable_directory_before_the_run(capsys: pytest.CaptureFixture[str], a_file: Path) -> None:
    for path, why in ((a_file, "is a file; give a directory (it is created if missing)"),
                      (a_file / "sub", "is not a writable directory (Not a directory); give one you can write")):
        assert cli_main(["demo", "--trace", str(path)]) == 2
        captured = capsys.readouterr()
        assert (captured.out, captured.err) == ("", f"asyncdbo demo: error: --trace {str(path)!r} {why}\n")


CHECK = [
    (["--ubatches", "0"], "--ubatches must be 2, 3 or 4 (got 0); 1 is the serial run every row has anyway"),
    (["--ubatches", "5"], "--ubatches must be 2, 3 or 4 (got 5); 1 is the serial run every row has anyway"),
    (["--tokens", "100000000"], "--tokens 100000000 needs about 667.9 GiB (the sim routes every token on this CPU; "
                                "estimated before running it), but 8.0 GiB is available; use --tokens up to 1151561"),
    (["--tokens", "100000000", "--shape", "prefill"],
     "--tokens 100000000 needs about 667.9 GiB (the sim routes every token on this CPU; "
     "estimated before running it), but 8.0 GiB is available; use --tokens up to 1151561"),
    (["--ep", "0"], "--ep must be a number of ranks >= 1 (got 0); the default is 32"),
    (["--gpus-per-node", "-1"], "--gpus-per-node must be a number of ranks >= 1 (got -1); the default is 8"),
    (["--context", "0"], "--context must be a number of tokens >= 1 (got 0); the default is 2000 for decode, 4096 for prefill"),
    # decode requests of 10**18 cached tokens: torch overflowed sizing the sim's attention, after the header
    (["--tokens", "64", "--context", "1000000000000000000"],
     "--context is the cached tokens of each decode request, at most 16777216 (got 1000000000000000000; 2**24, "
     "over 100 times the longest context window of the models the sim ships, DeepSeek-V3's 163,840 tokens); "
     "the default is 2000"),
    (["--imbalance", "0.5"], "--imbalance is the busiest rank's expert work over this rank's, >= 1 (got 0.5); 1 is balanced"),
    (["--imbalance", "nan"], "--imbalance is the busiest rank's expert work over this rank's, >= 1 (got nan); 1 is balanced"),
]


@pytest.mark.parametrize(("flags", "message"), CHECK, ids=[" ".join(f) for f, _ in CHECK])
def test_check_refuses_before_the_first_row(capsys: pytest.CaptureFixture[str], flags: list[str], message: str) -> None:
    assert cli_main(["check", *flags]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"asyncdbo check: error: {message}\n")


def test_check_workload_refuses_a_rank_the_memory_cannot_simulate_and_a_bool_token_count(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # A rank of 10**12 tokens ended in an allocation failure inside the sim (the router's scores of
    # every token); JSON's true passed for one token (Python reads it as an int).
    path = tmp_path / "trace.jsonl"
    for line, message in (
        ('{"ranks": [[[1, 5]], [[1, 5]]]}\n{"ranks": [[[1, 2000], [1000000000000, 0]], []]}',
         f"{path}:2: rank 0 has 1000000000001 new tokens (its largest request [1000000000000, 0]); simulating them "
         "needs about 6.4 PiB (the sim routes every token on this CPU; estimated before running it), but 8.0 GiB is "
         "available; give a rank at most 1151561 new tokens a step (cut a long prefill into chunks), or simulate "
         "fewer experts (--experts)"),
        ('{"ranks": [[[1, 5]], [[true, 5]]]}',
         f"{path}:1: rank 1 has request [true, 5]; a request is [new_tokens >= 1, cached_tokens >= 0]: true is a JSON "
         "bool, not a number of tokens"),
    ):
        path.write_text(line + "\n")
        assert cli_main(["check", "--workload", str(path), "-q"]) == 2
        captured = capsys.readouterr()
        assert (captured.out, captured.err) == ("", f"asyncdbo check: error: {message}\n")


@pytest.mark.parametrize(("available", "limits", "bound"), [
    (8 * GIB, [], (8 * GIB, "is available")),
    (None, [], None),  # nothing known: nothing is refused
    (8 * GIB, [inputs.ProcessLimit("RLIMIT_AS", "ulimit -v", "address-space", 2 * GIB, 400 * MIB)],
     (2 * GIB - 400 * MIB, "is left under this process's address-space limit (RLIMIT_AS, ulimit -v: 2.0 GiB, of which "
                           "400.0 MiB is mapped but not resident)")),
    (8 * GIB, [inputs.ProcessLimit("RLIMIT_AS", "ulimit -v", "address-space", 16 * GIB, 400 * MIB)],
     (8 * GIB, "is available")),  # a limit above the memory bounds nothing
    (None, [inputs.ProcessLimit("RLIMIT_AS", "ulimit -v", "address-space", 4 * GIB, 400 * MIB),
            inputs.ProcessLimit("RLIMIT_DATA", "ulimit -d", "data", 3 * GIB, 0)],
     (3 * GIB, "is left under this process's data limit (RLIMIT_DATA, ulimit -d: 3.0 GiB)")),
])
def test_the_memory_bound_is_the_smallest_of_the_memory_and_the_limits(
        available: int | None, limits: list[inputs.ProcessLimit], bound: tuple[int, str] | None) -> None:
    # a limit counts the mappings that are not resident too, which the estimates leave out: it
    # leaves the resident set only what they do not take
    assert inputs.memory_bound(available, limits) == bound


_UNDER_A_LIMIT = """
import resource, sys
import torch
import asyncdbo.cli.check, asyncdbo.cli.check_workload, asyncdbo.sim.tuning, asyncdbo.sim.workload
from asyncdbo.cli import main

name, path = sys.argv[1:]
with open("/proc/self/status") as f:
    status = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[-1:] == ["kB"]}
limit = getattr(resource, name)
# set after the imports, 512 MiB above what the limit counts now: room for the check, not for the sim
resource.setrlimit(limit, (status["VmSize" if name == "RLIMIT_AS" else "VmData"] + 512 * 2**20,
                           resource.getrlimit(limit)[1]))
sys.exit(main(["check", "--workload", path, "-q"]))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the process's sizes from /proc")
@pytest.mark.parametrize(("name", "limit"), [("RLIMIT_AS", "address-space limit (RLIMIT_AS, ulimit -v"),
                                             ("RLIMIT_DATA", "data limit (RLIMIT_DATA, ulimit -d")])
def test_check_workload_holds_a_rank_to_the_process_memory_limit_and_names_it(
        tmp_path: Path, name: str, limit: str) -> None:
    # The machine's memory would take the rank (1.6 GiB), the process's limit would not: it used to
    # pass, and the sim failed to allocate. The limit is set in a subprocess after its imports (torch
    # maps 0.6 GiB on a CPU build, more with CUDA), so only the sizes vary from machine to machine.
    available = inputs.available_bytes()
    if available is None or available < 4 * GIB:
        pytest.skip("the machine's available memory would be the smaller bound")
    path = tmp_path / "trace.jsonl"
    path.write_text('{"ranks": [[[200000, 0]], [[1, 100]]]}\n')
    env = dict(os.environ, PYTHONPATH=str(Path(asyncdbo.__file__).resolve().parent.parent))
    proc = subprocess.run([sys.executable, "-c", _UNDER_A_LIMIT, name, str(path)], capture_output=True, text=True,
                          env=env, timeout=300)
    expected = (f"asyncdbo check: error: {path}:1: rank 0 has 200000 new tokens (its largest request [200000, 0]); "
                "simulating them needs about 1.6 GiB (the sim routes every token on this CPU; estimated before running "
                f"it), but <SIZE> is left under this process's {limit}: <SIZE><MAPPED>); give a rank at most <N> new "
                "tokens a step (cut a long prefill into chunks), or simulate fewer experts (--experts)\n")
    size = r"[0-9.]+ (?:MiB|GiB)"
    pattern = (re.escape(expected).replace("<SIZE>", size).replace("<N>", "[0-9]+")
               .replace("<MAPPED>", f"(?:, of which {size} is mapped but not resident)?"))
    assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
    assert re.fullmatch(pattern, proc.stderr), proc.stderr


def test_demo_holds_each_rank_to_the_data_limit_the_ranks_inherit() -> None:
    # The machine has room for both ranks; the data limit (ulimit -d) counts each rank's own data, so
    # the per-rank need (1.1 GiB) is held to it. An address-space limit is not checked: a rank maps
    # far more than this process beyond what it keeps resident, unknown before it starts.
    cfg = DemoConfig(tokens=4096)
    limit = inputs.ProcessLimit("RLIMIT_DATA", "ulimit -d", "data", 1024 * MIB, 0)
    with pytest.raises(ValueError) as info:
        check_memory(cfg, available=64 * GIB, limits=[limit])
    assert str(info.value) == (
        "--tokens 4096 needs about 1.1 GiB per rank (estimated before starting them; the prefill step's attention "
        "scores dominate), but 1.0 GiB is left under each rank's data limit (RLIMIT_DATA, ulimit -d: 1.0 GiB; the "
        "ranks inherit this process's); use --tokens 3779 or fewer")
    check_memory(cfg, available=64 * GIB, limits=[dataclasses.replace(limit, limit=2 * GIB)])  # fits
    check_memory(cfg, available=64 * GIB, limits=[inputs.ProcessLimit("RLIMIT_AS", "ulimit -v", "address-space",
                                                                       1024 * MIB, 400 * MIB)])  # not checked


def test_check_trace_must_be_a_writable_directory(capsys: pytest.CaptureFixture[str], a_file: Path) -> None:
    assert cli_main(["check", "--trace", str(a_file / "sub")]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", (
        f"asyncdbo check: error: --trace {str(a_file / 'sub')!r} is not a writable directory (Not a directory); "
        "give one you can write\n"
    ))


def test_demo_launcher_env_outside_torchrun_names_what_is_missing(capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    assert cli_main(["demo", "--launcher", "env"]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", (
        "asyncdbo demo: error: --launcher env runs one rank of a torchrun job, but WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
        "are not set (not started by torchrun?); run it as `torchrun --nproc-per-node 2 -m asyncdbo demo --launcher env`, "
        "or drop --launcher env to start the ranks here\n"
    ))


@pytest.mark.parametrize("width", ["0", "-5", "199"])
def test_trace_width_too_narrow_is_refused_before_reading(capsys: pytest.CaptureFixture[str], width: str) -> None:
    assert cli_main(["trace", "/nonexistent.json", "--png", "/nonexistent.png", "--width", width]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", (
        f"asyncdbo trace: error: --width {width} px is too narrow for a timeline; use at least --width 200 (default 1600)\n"
    ))


def _trace_cases(tmp: Path) -> list[tuple[str, str]]:
    def write(name: str, data: object) -> str:
        (tmp / name).write_text(json.dumps(data))
        return str(tmp / name)

    deep = str(tmp / "deep.json")
    (tmp / "deep.json").write_text('{"traceEvents": ' + "[" * 100_000 + "]" * 100_000 + "}")
    step = {"step": 0, "wall_s": 1.0, "compute_s": 1.0, "comm_s": 0.5, "comm_hidden_s": 0.1,
            "comm_hidden_share": 0.2, "parked_s": 0.0, "switches": 3, "yields_per_ubatch": [1]}
    return [
        ("/dev/zero", "it goes on past 256 MiB (a device or a pipe, not a trace file)"),
        (write("other.json", {"name": "not a trace", "traceEvents": 3}),
         "it is JSON but not a Chrome trace: no 'traceEvents' list at the top level"),
        (write("foreign.json", {"traceEvents": [], "otherData": {"asyncdbo": {"ranks": [{"rank": 0, "steps": [{"wall_s": 1}]}]}}}),
         "otherData.asyncdbo.ranks[0].steps[0] lacks ['compute_s', 'comm_s', 'comm_hidden_s', 'comm_hidden_share', "
         "'parked_s', 'switches', 'step', 'yields_per_ubatch'] (not written by asyncdbo's Tracer?)"),
        (write("strings.json", {"traceEvents": [], "otherData": {"asyncdbo": {"ranks": [{"rank": 0, "steps": [dict(step, wall_s="1")]}]}}}),
         "otherData.asyncdbo.ranks[0].steps[0] has non-numbers in ['wall_s']"),
        (write("odd_span.json", {"traceEvents": [{"ph": "X", "args": {"ub": 0, "kind": "compute"}, "ts": "0", "dur": 1, "pid": 0}]}),
         "traceEvents[0] (an asyncdbo span) lacks ['ts'] or has non-numbers there"),
        (write("scalar.json", 5), "it is JSON but not a Chrome trace: no 'traceEvents' list at the top level"),
        (deep, f"it nests arrays or objects deeper than Python's JSON reader follows (recursion limit "
               f"{sys.getrecursionlimit()}); a Chrome trace nests a few levels, so this is not one"),
    ]


def test_trace_reads_a_bounded_amount_and_names_what_is_missing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for path, why in _trace_cases(tmp_path):
        assert cli_main(["trace", path]) == 2, path
        captured = capsys.readouterr()
        assert (captured.out, captured.err) == ("", f"asyncdbo trace: cannot read {path!r}: {why}\n")


@pytest.mark.parametrize("instrument", [5, "tracer", [object()]], ids=["int", "str", "list of non-instruments"])
def test_a_wrong_instrument_is_a_type_error_before_any_coroutine_exists(instrument: object) -> None:
    async def forward(x: int) -> int:
        return x

    async def main() -> None:
        await asyncdbo.run_ubatches(forward, [(1,), (2,)], instrument=instrument)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coroutine that was never awaited warns at collection
        with pytest.raises(TypeError) as info:
            asyncdbo.run(main)
        gc.collect()
    assert str(info.value) == (
        f"instrument must be an asyncdbo.lowlevel.Instrument, a list of them, or None (got {instrument!r}); "
        "subclass Instrument and override the hooks you need"
    )
