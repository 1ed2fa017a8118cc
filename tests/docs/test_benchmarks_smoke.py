"""The benchmarks still run (``--quick``), and the designs they compare do what they claim.

Benchmarks measure, tests assert: nothing here checks a time, only that each benchmark runs end
to end on tiny sizes and that every handoff design hands over in strict round-robin order (a
design that did not would be timing something else).

Most scripts' ``main(argv)`` runs in this process (a fresh interpreter per script imported torch
again, most of such a test's time), the ones with ranks on the session's shared 2 ranks
(``main(..., pool=pool)``); what a script changes in the process (torch's threads, the asyncdbo
logger's level) a fixture puts back. The ones that pin threads to cores or export and build a
git revision run as ``python SCRIPT --quick``.
"""

from __future__ import annotations

import importlib.util
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from asyncdbo import cli
from asyncdbo.testing import RankPool

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))  # the benchmarks import their helpers as top-level modules

from _switch_bench import DESIGNS, chain, check_round_robin, measure, median_table  # noqa: E402


def in_git_checkout(root: Path) -> bool:
    """Whether ``root`` is the top of a git work tree with a commit: what the benchmarks that
    read the history (``git archive``, ``rev-parse HEAD``) need. An unpacked tarball or sdist is
    not one, nor is a folder inside some other repository."""
    try:
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=root, capture_output=True, text=True,
                             timeout=30, check=False)
        head = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "HEAD"], cwd=root, capture_output=True,
                              timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):  # no git on this machine
        return False
    return top.returncode == 0 and head.returncode == 0 and Path(top.stdout.strip()).resolve() == root.resolve()


needs_git_history = pytest.mark.skipif(
    not in_git_checkout(BENCH.parent),
    reason="needs the git history of a checkout (the benchmark exports a revision with git); this source tree has "
           "none (an unpacked tarball or sdist)",
)


def test_the_git_check_tells_a_checkout_from_a_tree_without_history(tmp_path: Path) -> None:
    tree = tmp_path / "asyncdbo-src"
    (tree / "sub").mkdir(parents=True)
    assert not in_git_checkout(tree)  # an unpacked tarball
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    try:
        subprocess.run([*git, "init", "-q", str(tree)], check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("git is not installed")
    assert not in_git_checkout(tree)  # a repository with no commit yet
    (tree / "f").write_text("x")
    subprocess.run([*git, "-C", str(tree), "add", "f"], check=True, capture_output=True, timeout=60)
    subprocess.run([*git, "-C", str(tree), "commit", "-q", "-m", "m"], check=True, capture_output=True, timeout=60)
    assert in_git_checkout(tree)
    assert not in_git_checkout(tree / "sub")  # a folder inside another repository


@pytest.fixture
def asyncdbo_log_level() -> Iterator[None]:
    """The ``asyncdbo`` logger's level as it was, after a simulating benchmark run here quieted it
    (its fake EP group's timeout note, once per point)."""
    logger = logging.getLogger("asyncdbo")
    before = logger.level
    try:
        yield
    finally:
        logger.setLevel(before)


def _load(name: str) -> ModuleType:
    path = BENCH / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(mod)
    return mod


def test_every_design_hands_over_round_robin() -> None:
    orders = check_round_robin(N=3, K=4, depth=3)
    assert orders == {name: [0, 1, 2] * 4 for name in DESIGNS}


def test_chain_depth_must_be_positive() -> None:
    async def leaf(i: int) -> None:
        return None

    with pytest.raises(ValueError, match=r"depth must be >= 1 async def frame \(got 0\)"):
        chain(0, leaf)


def test_median_table_ratios_come_from_the_same_samples() -> None:
    rows = median_table({"tramp": [100.0, 300.0, 200.0], "asyncdbo": [300.0], "threads": [6000.0]})
    assert rows == [
        "| design | median ns | [min..max] | x tramp | threads / design |",
        "|---|---:|---|---:|---:|",
        "| bare `coro.send()` trampoline | 200 | 100..300 | 1.00 | 30.0 |",
        "| asyncdbo `dbo_yield` (uvloop) | 300 | 300..300 | 1.50 | 20.0 |",
        "| vLLM thread baton (`threading.Event`) | 6,000 | 6,000..6,000 | 30.00 | 1.0 |",
    ]


def test_measure_gives_one_sample_per_round_for_each_design() -> None:
    samples = measure(["tramp", "asyncdbo"], N=2, depth=2, switches={"fast": 200}, rounds=3)
    assert sorted(samples) == ["asyncdbo", "tramp"]
    assert [len(v) for v in samples.values()] == [3, 3]
    assert all(v > 0 for vals in samples.values() for v in vals)


def test_the_old_bench_command_says_where_the_benchmark_went(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--switches", "200"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "asyncdbo bench: moved to the source tree's benchmarks/switch_cost.py (it measures against a copy "
        "of the kernel's hot loop, which is not library code): git clone the repository, then run "
        "`python benchmarks/switch_cost.py --quick` from its root\n"
    )


@pytest.mark.timeout(60)
def test_switch_cost_quick(capsys: pytest.CaptureFixture[str]) -> None:
    mod = _load("switch_cost")
    assert mod.main(["--quick"]) == 0
    out = capsys.readouterr().out
    for section in ("## plain", "## Goals", "## busy", "## torch"):
        assert section in out


@pytest.mark.timeout(120)
def test_moe_step_quick(pool: RankPool, capsys: pytest.CaptureFixture[str]) -> None:
    """The session's two gloo ranks run serial, asyncdbo (ht, ll, split and fused dispatch) and the
    three thread-baton designs on one tiny case; the script exits 1 unless every design's logits
    equal the serial ones bit for bit (deterministic mode)."""
    import moe_step

    rc = moe_step.main(["--quick"], pool=pool)
    out = capsys.readouterr().out
    assert rc == 0, out
    for design in ("serial", "asyncdbo ht", "asyncdbo ll", "asyncdbo ht fused", "asyncdbo ll fused", "threads vLLM",
                   "threads GPU-like", "threads handoff"):
        assert f"| {design} |" in out
    assert "| ll | " in out  # the split-vs-fused table
    assert "Replay checks over 20 steps x ranks:" in out  # 5 replayed designs x 2 steps x 2 ranks


@needs_git_history
@pytest.mark.timeout(60)
def test_host_overhead_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "host_overhead.py"), "--quick"], capture_output=True, text=True, timeout=50,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "threads pinned ns/yield CPU" in proc.stdout


@pytest.mark.timeout(60)
def test_run_setup_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run_setup.py"), "--quick"], capture_output=True, text=True, timeout=50,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for n in (2, 4, 8):
        assert f"\n| {n} | " in proc.stdout


@pytest.mark.timeout(120)
def test_deterministic_quick(pool: RankPool, capsys: pytest.CaptureFixture[str]) -> None:
    """The session's two gloo ranks run serial and DBO with deterministic mode off and on; the
    script exits 1 unless every DBO step with the mode on equals its serial step bit for bit."""
    import deterministic

    rc = deterministic.main(["--quick"], pool=pool)
    out = capsys.readouterr().out
    assert rc == 0, out
    on_row = next(ln for ln in out.splitlines() if ln.startswith("| decode 16 req/rank, 1 layer | on |"))
    assert on_row.endswith("| 0 |")


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("one_thread")  # the script sets torch to one thread: this process gets its own back
def test_sync_free_quick(capsys: pytest.CaptureFixture[str]) -> None:
    """One small layer on both MoE paths: the sync-free one issues no host sync, computes the
    padding rows, and gives the exact path's output bit for bit (else the script exits 1)."""
    import sync_free

    rc = sync_free.main(["--quick"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {ln.split(" | ")[1]: ln.split(" | ") for ln in out.splitlines() if ln.startswith("| decode T=16 |")}
    # host syncs, torch ops, expert rows, equal: 16 tokens, top-2 of 8 experts
    assert rows["exact"][5] == "21" and rows["exact"][7] == "32" and rows["exact"][8] == "True |"
    assert rows["sync-free"][5] == "0" and rows["sync-free"][7] == "128" and rows["sync-free"][8] == "True |"


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("asyncdbo_log_level")
def test_sim_sweep_quick_writes_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import sim_sweep

    rc = sim_sweep.main(["--quick", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| decode | 16 | ib400 |" in out
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".md", ".png"]


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("asyncdbo_log_level")
def test_sim_calibrate_quick_scores_one_grid_point(capsys: pytest.CaptureFixture[str]) -> None:
    import sim_calibrate

    rc = sim_calibrate.main(["--quick"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "| kernel overhead us | HBM eff 0.6 |" in out
    assert "Best: kernel_overhead_s = 6 us (small kernels a quarter of it), mem_efficiency = 0.6." in out


def test_gpu_check_is_a_deprecated_wrapper_of_first_contact() -> None:
    script = BENCH / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, check=False).returncode == 0
    proc = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "gpu_check.sh is deprecated and runs benchmarks/first_contact.py; call that directly\n"
    assert proc.stdout.startswith("usage: first_contact.py")


@needs_git_history
@pytest.mark.timeout(120)
def test_compare_commits_quick_measures_both_packages_side_by_side() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "compare_commits.py"), "--base", "HEAD", "--quick"],
        capture_output=True, text=True, timeout=110, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    row = next(ln for ln in proc.stdout.splitlines() if ln.startswith("| 2 | 2 |"))
    assert float(row.rsplit("|", 2)[-2]) > 0


@pytest.mark.timeout(120)
def test_auto_regime_runs_quick(capsys: pytest.CaptureFixture[str]) -> None:
    import auto_regime

    assert auto_regime.main(["--quick", "--workloads", "link 5x slower: DBO starts to pay"]) == 0
    out = capsys.readouterr().out
    assert "| link 5x slower: DBO starts to pay | uniform | " in out and "| heavy | " in out
    with pytest.raises(SystemExit, match="unknown workloads"):
        auto_regime.main(["--quick", "--workloads", "link 6x slower"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_compiled_segments_quick(pool: RankPool, capsys: pytest.CaptureFixture[str]) -> None:
    """The session's two gloo ranks run the Qwen3-MoE step eager and with every segment through
    torch.compile (Dynamo's ``eager`` backend in --quick: tracing without inductor's minutes of
    compiling), and the compiled model's logits are eager's."""
    import compiled_segments

    rc = compiled_segments.main(["--quick"], pool=pool)
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [ln.split("|") for ln in out.splitlines() if ln.startswith("| prefill") or ln.startswith("| decode")]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [
        ("prefill 24", "serial"), ("prefill 24", "dbo"), ("decode 4", "serial"), ("decode 4", "dbo")]
    assert all(float(r[-2]) == 0.0 for r in rows)  # Dynamo's eager backend runs the same ops
    assert "| fixed cost: x + 1, one element |" in out


def test_auto_measured_refuses_an_unknown_link_by_name() -> None:
    import auto_measured  # on BENCH, a plain module: the pool's ranks import its functions by name

    with pytest.raises(SystemExit, match=r"unknown link or workload \['ib401'\]; links: \['loopback', 'ib400', "):
        auto_measured.main(["--links", "ib401"])


def test_auto_measured_workloads_have_the_shapes_they_name() -> None:
    import random

    import auto_measured

    trace = auto_measured.mixed_arrivals(24, random.Random(0))
    arrivals = [i for i, step in enumerate(trace) if step != ((32, 0), (32, 0))]
    assert len(arrivals) == 6  # a quarter of the steps, whatever the seed
    assert [trace[i] for i in arrivals] == [((32, 256), (32, 0)), ((32, 0), (32, 256))] * 3  # alternating ranks
    assert {s for s in auto_measured.decode_small(24, random.Random(0))} == {((16, 0), (16, 0)), ((48, 0), (48, 0))}
    assert {s for s in auto_measured.prefill_heavy(24, random.Random(0))} == {((0, 128), (0, 128)), ((0, 512), (0, 512))}
    trace = auto_measured.regime_change(auto_measured.REGIME_MIN_STEPS, random.Random(0))
    assert set(trace) == {((48, 0), (48, 0))} and auto_measured.REGIME_SLOWER == {"regime-change": 5.0}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_auto_measured_runs_one_cell_on_the_shared_ranks(pool: RankPool) -> None:
    """One tiny cell of the measured auto benchmark on the session's 2 gloo ranks: a sweep of three
    of the 13 configurations (one step), then one round of off, today's rule, the best fixed one
    and auto (two steps), every configuration's trace timed on both ranks."""
    import argparse

    import auto_measured

    args = argparse.Namespace(steps=2, rounds=1, sweep_rounds=1, sweep_steps=1, warmup=0, link_scale=1000.0, seed=0,
                              timeout=150.0)
    space = auto_measured.sweep_configs()
    assert len(space) == 13 and space[0] == auto_measured.OFF  # off and N 2-4 x 2 splits x 2 dispatches
    sweep = [space[0], space[1], space[-1]]
    row = auto_measured.measure_cell(pool, "loopback", "decode-small", args, sweep=sweep)
    assert sorted(row["total"]) == ["auto", "best fixed", "fixed N=2 today", "off"]
    assert all(len(v) == 1 and v[0] > 0 for v in row["total"].values())
    assert list(row["sweep"]) == ["off", "fixed N=2 token auto", "fixed N=4 balanced split"]
    assert row["best_label"] in row["sweep"]
    assert row["exploring_steps"] == [2]  # a fresh auto explores its first steps of each bucket
    assert row["choices"] and all(c.startswith("decode ") for c in row["choices"])
    # the two steps (48 decode requests each) are one bucket's first: the prior's warm-up, off's
    assert row["history"] == ["  - decode 32-63: N=2 token auto (warm-up), off (warm-up)"]
    table = auto_measured.render([row], args)
    assert "| loopback | decode-small | " in table and "\n- loopback decode-small:\n  - decode " in table


def test_auto_measured_history_names_each_step_and_why() -> None:
    """The choice history the results file keeps: per bucket, run-length coded over the rounds."""
    import auto_measured

    a, b = "decode 16-31", "decode 32-63"
    history = [
        [(a, "N=2 token auto", "warm-up"), (b, "N=2 token auto", "warm-up"), (a, "off", "warm-up"), (a, "off", "pair"),
         (a, "N=2 token auto", "pair"), ("(no vote)", "off", "no vote")],
        [(a, "off", "chosen"), (a, "off", "chosen"), (b, "off", "extra pair")],
    ]
    assert auto_measured.history_lines(history) == [
        "  - (no vote): off (no vote)",
        "  - decode 16-31: N=2 token auto (warm-up), off (warm-up), off (pair), N=2 token auto (pair), | off x2 (chosen)",
        "  - decode 32-63: N=2 token auto (warm-up), | off (extra pair)",
    ]


def test_auto_runner_cost_buckets_name_the_trace_shapes_in_order() -> None:
    import auto_runner_cost

    assert auto_runner_cost.buckets_of([((0, 512), (0, 512)), ((0, 128), (0, 128)), ((0, 512), (0, 0))]) == [
        "mixed 512-1023", "mixed 128-255"]
    assert auto_runner_cost.buckets_of([((48, 0), (48, 0)), ((32, 256), (32, 0))]) == ["decode 32-63", "mixed 256-511"]


def test_auto_runner_cost_feeds_the_policy_until_the_arm_is_chosen_everywhere() -> None:
    """The converged runner's account: every bucket of the trace ends on the arm, none explores."""
    import random

    import auto_measured
    import auto_runner_cost

    from asyncdbo.plan import ThresholdConfig
    from asyncdbo.serving.auto import Arm, AutoConfig, AutoPolicy, threshold_prior

    cfg = AutoConfig()
    policy = AutoPolicy(cfg, threshold_prior(ThresholdConfig(), cfg))
    trace = auto_measured.prefill_heavy(24, random.Random(0))
    auto_runner_cost.converge(policy, cfg.arms(), trace, Arm(3))
    assert sorted(policy.buckets) == ["mixed 128-255", "mixed 512-1023"]
    assert [policy.choose(b) for b in sorted(policy.buckets)] == [
        (Arm(3), f"{b}: {policy.evidence(b)}") for b in sorted(policy.buckets)]


def test_auto_runner_cost_summed_ratio_pairs_the_steps() -> None:
    import auto_runner_cost

    ratio, lo, hi = auto_runner_cost.summed_ratio([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])
    assert (ratio, lo, hi) == (0.5, 0.5, 0.5)  # every resample of exactly paired halves is a half


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_auto_runner_cost_runs_on_the_shared_ranks(pool: RankPool) -> None:
    """Two steps of each runner, interleaved, then one round of the switching comparison: every auto
    runner ran what the fixed runner ran, and the tables name every runner."""
    import argparse

    import auto_runner_cost

    args = argparse.Namespace(link="ib400", workload="prefill-heavy", arm=3, steps=2, rounds=1, switch_rounds=1,
                              link_scale=1000.0, seed=0, timeout=150.0)
    lines, trace = auto_runner_cost.measure(pool, args)
    table = "".join(lines)
    assert trace == [((0, 512), (0, 512)), ((0, 512), (0, 512))]
    for label in ("fixed again", "auto converged", "auto pinned"):
        assert f"| {label} | 2 | " in table and table.split(f"| {label} | 2 | ")[1].split("\n")[0].endswith(
            "| 2 of 2 |")
    assert "| auto switching | " in table
    # the 512-token bucket is the trace's only one, so switching pins it to the arm: the step after one of N = 3
    assert "| 512 | N=3 token auto | N=3 token auto | 1 | " in table


@pytest.mark.timeout(120)
def test_memory_estimate_check_rows_set_the_cli_estimate_against_a_measured_peak() -> None:
    # one check row: a subprocess runs the sim at 16 tokens; its estimate is check_bytes's for the default model
    from asyncdbo.cli.check import check_bytes
    from asyncdbo.sim.predict import ModelShape

    [row] = _load("memory_estimate").check_rows({"decode": [16]})
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:2] == ["decode", "16"]
    assert cells[3] == f"{check_bytes(ModelShape.of('deepseek-v3'), 16) / 2**20:.0f}"
    assert float(cells[2]) > 0


@pytest.mark.timeout(120)
def test_tp_dense_quick(pool: RankPool, capsys: pytest.CaptureFixture[str]) -> None:
    """The session's two gloo ranks run the dense TP demo's measurement on one small Llama,
    loopback and ib400."""
    pytest.importorskip("transformers")
    import tp_dense

    rc = tp_dense.main(["--quick"], pool=pool)
    out = capsys.readouterr().out
    assert rc == 0, out
    for link in ("loopback", "ib400"):
        for phase in ("prefill", "decode"):
            assert f"| llama | 2 | {link} | {phase} |" in out, out
