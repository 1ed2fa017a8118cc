"""benchmarks/first_contact.py, the script for the first GPU: on a CPU its ``--dry-run`` runs every
step's code under the fake device (asyncdbo.testing.fake_device) in its own process, and each
step writes its JSON line; without ``--dry-run`` and without CUDA it stops after the environment."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "first_contact.py"
STEPS = ["env", "headline", "invariants", "syncs", "graph", "tests", "numerics"]


def _lines(out: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in (out / "first_contact.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """One whole ``--dry-run`` (every step) for the tests that read its lines: its process and its
    ``--out`` folder."""
    out = tmp_path_factory.mktemp("dry_run")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)], capture_output=True,
                          text=True, timeout=1750, check=False)
    return proc, out


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_dry_run_starts_every_step_and_writes_its_line(dry_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, tmp_path = dry_run
    lines = _lines(tmp_path)
    assert [ln["step"] for ln in lines] == STEPS, proc.stdout + proc.stderr
    assert [(ln["step"], ln["ok"], ln.get("error")) for ln in lines] == [(s, True, None) for s in STEPS], \
        (tmp_path / "steps.log").read_text()[-5000:]
    assert proc.returncode == 0
    by = {ln["step"]: ln for ln in lines}
    # under the fake, time is virtual: the overlap program takes max(20, 20) ms, not 40
    assert {p: r["ratio"] for p, r in by["headline"]["sleep_overlap_program"].items()} == {"role": 0.5, "ubatch": 0.5}
    assert all(c["equal"] and c["caller_stream_restored"] and not c["wrong_stream"] for c in by["invariants"]["cases"])
    assert by["graph"]["toy"]["captured"] is True
    # the accelerator's settings, also on a CPU: the MoE layer's sync-free path, 0 host syncs
    assert by["syncs"]["moe_config"] == {"sync_free": True, "deterministic": False}
    assert [c["hostsyncs_count"] for c in by["syncs"]["cases"]] == [0, 0]
    assert by["graph"]["moe_ht"] == {"captured": True, "host_syncs": [], "other_problems": []}
    assert all(m["bitwise_equal"] is not None and not m["wrong_stream"] for m in by["invariants"]["moe_layer"])
    assert sorted(f.name for f in tmp_path.iterdir()) == ["first_contact.jsonl", "junit.xml", "steps.log"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the script runs for real")
@pytest.mark.timeout(300)
def test_without_cuda_it_stops_after_the_environment_with_status_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=280, check=False)
    assert proc.returncode == 2
    assert "first_contact: torch sees no CUDA device here; on a CPU run --dry-run" in proc.stderr
    (env,) = _lines(tmp_path)
    assert (env["step"], env["ok"], env["cuda_available"]) == ("env", False, False)


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("first_contact", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_first_call_fits_300_s_at_its_limits_and_the_readme_quotes_the_plan() -> None:
    """The budget is summed in one place (budget_s); here the sums are redone by hand."""
    fc = _script()
    limits = dict(fc.STEPS)
    assert [s for s, _ in fc.STEPS] == STEPS
    first, second = fc.CALLS
    assert first == ("env", "headline")
    assert sorted(set(first) | set(second)) == sorted(STEPS)  # every step runs in one of the calls
    assert fc.budget_s(first) == limits["env"] + limits["headline"] + fc.DRIVER_S == 170
    assert fc.budget_s(first) <= fc.FIRST_CALL_MAX_S == 300
    assert fc.budget_s(second) == sum(limits[s] for s in second) + fc.PIP_S + fc.DRIVER_S == 460
    assert fc.budget_s(second) <= 600  # the device tool's most for one command
    assert fc.budget_s(limits) == sum(limits.values()) + fc.PIP_S + fc.DRIVER_S == 580
    # a 15-minute lease: a first start (at most 2 minutes, assumed), the first call at its limits,
    # and still the 4 minutes a fresh machine needs to start
    assert 15 * 60 - 120 - fc.budget_s(first) >= 4 * 60
    readme = (SCRIPT.parent / "README.md").read_text()
    for row in fc.plan().splitlines()[:2]:
        assert row in readme, row
    assert "580 s (steps 510, pip 60, driver 10)" in readme and "All steps in one call" in readme
    for name, limit in fc.STEPS:
        assert f"| `{name}` | {limit} s |" in readme, name


@pytest.mark.timeout(300)
def test_a_dry_first_call_runs_only_its_steps_within_its_budget(tmp_path: Path) -> None:
    fc = _script()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--only", ",".join(fc.CALLS[0]), "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=280, check=False)
    lines = _lines(tmp_path)
    assert [(ln["step"], ln["ok"]) for ln in lines] == [("env", True), ("headline", True)], proc.stderr[-3000:]
    assert proc.returncode == 0
    # each step's limit is its own (x DRY_SLACK): the call's budget is never the tighter one here
    assert [ln["timeout_s"] for ln in lines] == [fc.DRY_SLACK * dict(fc.STEPS)[s] for s in fc.CALLS[0]]
    assert sum(ln["wall_s"] for ln in lines) < fc.budget_s(fc.CALLS[0]) * fc.DRY_SLACK
    assert lines[0]["carried_wheels"] == {"wheels": [], "installed": False}


def _python312() -> str | None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import first_contact_prepare
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return first_contact_prepare.default_python()  # type: ignore[no-any-return]


@pytest.mark.timeout(300)
def test_the_carried_cp312_extensions_are_put_in_place_and_load_under_python_3_12(tmp_path: Path) -> None:
    """What the GPU machine does with the carried folder, rehearsed with this machine's Python 3.12
    on a copy of the tree without any built extension (as the device gets it: *.so is gitignored).
    torch is not needed: ``import asyncdbo`` and its C extensions take none."""
    python = _python312()
    if python is None:
        pytest.skip("no Python 3.12 here")
    root = SCRIPT.parents[1]
    tree = tmp_path / "tree"
    shutil.copytree(root / "asyncdbo", tree / "asyncdbo", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copytree(root / "benchmarks", tree / "benchmarks", ignore=shutil.ignore_patterns("results", "__pycache__"))
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy2(root / name, tree / name)
    carried = tree / ".whl"
    subprocess.run([sys.executable, str(tree / "benchmarks/first_contact_prepare.py"), "--dest", str(carried),
                    "--python", python, "--no-wheels"], check=True, capture_output=True, timeout=240)
    prepared = json.loads((carried / "prepared.json").read_text())
    assert prepared["native"]["built"] == ["asyncdbo/_core/_spin.cpython-312-x86_64-linux-gnu.so",
                                           "asyncdbo/dbo/_speedups.cpython-312-x86_64-linux-gnu.so"]
    probe = (f"import sys; sys.path.insert(0, {str(tree / 'benchmarks')!r}); import first_contact as fc; "
             f"import json, pathlib; print(json.dumps(fc._place_native(pathlib.Path({str(carried)!r})))); "
             "from asyncdbo._core import fastpath; from asyncdbo.dbo import primitives; "
             "print(fastpath.C is not None, primitives.FAST is not None, 'torch' in sys.modules)")
    proc = subprocess.run([python, "-c", probe], cwd=tree, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ASYNCDBO_PURE_PYTHON")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    placed, loaded = proc.stdout.splitlines()
    assert json.loads(placed)["placed"] == prepared["native"]["built"]
    assert loaded == "True True False"
    # a change to the C sources makes the carried build stale: it is not placed
    (tree / "asyncdbo/_native/slots.h").write_text((tree / "asyncdbo/_native/slots.h").read_text() + "\n")
    for so in prepared["native"]["built"]:
        (tree / so).unlink()
    proc = subprocess.run([python, "-c", probe.split("; from asyncdbo")[0]], cwd=tree, capture_output=True, text=True,
                          timeout=120)
    assert json.loads(proc.stdout)["reason"].startswith("built from other C sources"), proc.stderr[-3000:]


@pytest.mark.timeout(1800)  # alone (-k), it pays for the whole dry run
def test_the_tests_step_runs_with_plugin_autoload_off_and_its_plugins_named(
        dry_run: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, tmp_path = dry_run
    (line,) = [ln for ln in _lines(tmp_path) if ln["step"] == "tests"]
    assert line["ok"] and line["returncode"] == 0, (tmp_path / "steps.log").read_text()[-3000:]
    assert line["plugin_autoload"] is False and line["plugins"] == {"pytest_timeout": True, "pytest_asyncio": True}
    assert "-p pytest_timeout -p pytest_asyncio.plugin" in line["command"]
    assert "tests/observe/test_trace.py" in line["command"] and "--noconftest" not in line["command"]
    assert proc.returncode == 0


def test_comm_hidden_is_taken_from_the_two_ubatch_runs() -> None:
    fc = _script()
    assert fc.comm_hidden(10.0, 6.0, 10.0) == 1.0  # d = max(c, m): all of the comm hid
    assert fc.comm_hidden(10.0, 6.0, 16.0) == 0.0  # d = c + m: none
    assert fc.comm_hidden(10.0, 6.0, 13.0) == 0.5


def test_device_ms_times_device_work_after_a_lead_sleep_and_refuses_a_returned_value() -> None:
    from asyncdbo.testing.fake_device import FakeDevice

    fc = _script()
    with FakeDevice() as dev:
        fc._CYCLES_PER_MS.clear()
        events: list[str] = []
        real_sleep = torch.cuda._sleep

        def sleep(cycles: int) -> None:
            events.append(f"sleep {round(cycles / fc.cycles_per_ms(), 3)} ms" if fc._CYCLES_PER_MS else "probe")
            real_sleep(cycles)

        torch.cuda._sleep = sleep  # type: ignore[assignment]
        try:
            assert fc.device_ms(lambda: dev.kernel(3.0), 2) == [3.0, 3.0]  # the 5-ms lead is outside the figure
        finally:
            torch.cuda._sleep = real_sleep  # type: ignore[assignment]
        assert events == ["probe", f"sleep {fc.LEAD_MS} ms", f"sleep {fc.LEAD_MS} ms"]
        with pytest.raises(TypeError, match="a timed call must return None"):
            fc.device_ms(lambda: [1], 1)
    fc._CYCLES_PER_MS.clear()


@pytest.mark.timeout(120)
def test_the_driver_gives_a_step_no_more_than_what_is_left_of_its_calls_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The call's budget is enforced, not only printed: with a budget of 12 s (x4 dry) the first
    step gets what is left less the driver's share, whatever its own limit."""
    fc = _script()
    monkeypatch.setattr(fc, "budget_s", lambda names: 2 + fc.DRIVER_S)
    assert fc.drive(tmp_path, True, {"env"}, tmp_path / "no-wheels") == 0
    (line,) = _lines(tmp_path)
    assert line["ok"] and line["timeout_s"] <= 2 * fc.DRY_SLACK < dict(fc.STEPS)["env"] * fc.DRY_SLACK


def _probe_wheel(folder: Path, module: str) -> Path:
    """A pure-Python wheel of one module, written by hand (no index, no build backend)."""
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{module}-0.1.dist-info"
    files = {f"{module}.py": "PROBE = True\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{dist}/RECORD"] = "".join(f"{name},,\n" for name in files) + f"{dist}/RECORD,,\n"
    wheel = folder / f"{module}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return wheel


@pytest.mark.timeout(240)
def test_a_dry_call_with_the_tests_step_installs_the_carried_wheels_and_its_steps_see_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As on the device, a dry call that runs ``tests`` installs the carried wheels into the private
    target, and a step (a forked child) finds them on its sys.path as a fresh interpreter would
    through PYTHONPATH: under an image without pytest-asyncio the dry ``tests`` step then takes the
    device's path (both plugins named, the conftest) instead of the narrowed one."""
    fc = _script()
    module = "first_contact_carried_probe"
    carried = tmp_path / "carried"
    wheel = _probe_wheel(carried, module)
    monkeypatch.setattr(fc, "SITE", tmp_path / "site")

    def probe(st: Any) -> None:
        st.put(found=importlib.util.find_spec(module) is not None, ok=True)

    monkeypatch.setattr(fc, "STEP_FUNCS", {**fc.STEP_FUNCS, "tests": probe})
    assert fc.drive(tmp_path / "out", True, {"env", "tests"}, carried) == 0, (tmp_path / "out/steps.log").read_text()
    env, tests = _lines(tmp_path / "out")
    assert env["carried_wheels"] == {"wheels": [wheel.name], "installed": True}
    assert tests["step"] == "tests" and tests["found"] is True
    assert importlib.util.find_spec(module) is None  # only the step's sys.path held it
