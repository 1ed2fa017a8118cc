#!/usr/bin/env python3
"""First contact with a GPU: what asyncdbo's device path does on one, in two calls of 170 s and 460 s at most.

Written for the lent machine (one NVIDIA H100 or H200, no network, Python 3.12 with torch + CUDA;
only files under ``$OUT`` come back, at most 8). Nothing is fetched: what it needs that the image
may lack is in a carried folder (``--wheels``, default ``.whl``) that
benchmarks/first_contact_prepare.py fills beforehand: the wheels of pytest-asyncio and
pytest-timeout (installed into a private target, only by a call that runs ``tests``; a missing
one only narrows that step), the C extensions built for Python 3.12 (put in place before any
step) and the commit.

Every step runs in a child process with its own timeout and writes one JSON line to
``$OUT/first_contact.jsonl`` as soon as it ends (a step that is killed still leaves what it had
measured, written as it went), so a later failure never loses an earlier result. Output, three
files: ``first_contact.jsonl``, ``steps.log`` (each step's stdout and stderr) and ``junit.xml``
(the ``cuda`` tests). Most informative first; the plan and what each step settles is in
benchmarks/README.md ("First contact").

    python3 benchmarks/first_contact.py --plan          # the two device calls and their timeout_s (budget_s)
    python3 benchmarks/first_contact.py --only env,headline   # call 1 on the GPU machine ($OUT or ./out/first_contact)
    python3 benchmarks/first_contact.py --dry-run       # on a CPU: every step starts, under the fake device
    python3 benchmarks/first_contact.py --only headline,syncs

``--dry-run`` runs each step's code under :class:`asyncdbo.testing.fake_device.FakeDevice` (tiny
sizes, virtual time) instead of CUDA, each step in a forked child of the driver (which imported
torch once) rather than a fresh interpreter: it checks that every step imports, builds its
programs and writes its line, not the numbers. Legend: T tokens, D hidden.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
HELPERS = ROOT / "tests" / "helpers"

#: (step, limit in seconds), in the order they run: most informative first. What a call may take
#: at its limits is :func:`budget_s`, the one place that sums them (``--plan`` prints it per call).
STEPS: tuple[tuple[str, int], ...] = (
    ("env", 40),
    ("headline", 120),
    ("invariants", 70),
    ("syncs", 50),
    ("graph", 50),
    ("tests", 120),
    ("numerics", 60),
)
#: pip's limit for installing the carried wheels; only a call with the ``tests`` step installs them
PIP_S = 60
#: the driver's own share beside its steps' (its start, the carried C extensions put in place, the lines)
DRIVER_S = 10
#: The plan: two device calls, each on whatever machine it gets (a machine stays warm 30 s only),
#: so each starts with ``env``. The first holds the headline and fits FIRST_CALL_MAX_S at its
#: limits, leaving a 15-minute lease room for a fresh start (4 minutes) after a first call that
#: ran to them; the second holds the rest.
CALLS: tuple[tuple[str, ...], ...] = (("env", "headline"), ("env", "invariants", "syncs", "graph", "tests", "numerics"))
FIRST_CALL_MAX_S = 300


def budget_s(names: Iterable[str]) -> int:
    """The most a run of the steps ``names`` takes on the GPU machine: their limits, pip's when
    ``tests`` is among them, and the driver's share. The driver stops at this deadline whatever
    its steps do, and it is the device call's ``timeout_s`` (``--plan``)."""
    chosen = set(names)
    limits = dict(STEPS)
    return sum(limits[n] for n in chosen) + (PIP_S if "tests" in chosen else 0) + DRIVER_S


def plan() -> str:
    """The device calls of the plan with their budgets, as benchmarks/README.md quotes them."""
    rows = [f"call {i}: python3 benchmarks/first_contact.py --only {','.join(names)}    timeout_s {budget_s(names)}"
            for i, names in enumerate(CALLS, 1)]
    rows.append(f"all steps in one call: timeout_s {budget_s(dict(STEPS))} (steps {sum(dict(STEPS).values())}, pip {PIP_S}, "
                f"driver {DRIVER_S})")
    return "\n".join(rows)


SITE = Path(tempfile.gettempdir()) / "asyncdbo_first_contact_site"
#: --dry-run runs on a CI machine's CPU, slower than the GPU machine's 16 cores: each limit times this.
DRY_SLACK = 4


# ------------------------------------------------------------------------------------ the driver
def _install_wheels(wheels: Path, log: Any) -> dict[str, Any]:
    found = sorted(str(p) for p in wheels.glob("*.whl")) if wheels.is_dir() else []
    if not found:
        return {"wheels": [], "installed": False}
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--target", str(SITE), *found]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return {"wheels": [Path(w).name for w in found], "installed": False, "error": "pip timed out after 60 s"}
    log.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    return {"wheels": [Path(w).name for w in found], "installed": proc.returncode == 0,
            **({} if proc.returncode == 0 else {"error": proc.stderr[-2000:]})}


def _place_native(carried: Path) -> dict[str, Any]:
    """The C extensions built for this Python by benchmarks/first_contact_prepare.py, copied into
    the tree (they are gitignored, so none travel otherwise) where none is there yet, and only if
    they were built from these sources. Before any step imports asyncdbo."""
    import hashlib
    import shutil
    import sysconfig

    try:
        prepared = json.loads((carried / "prepared.json").read_text())
    except (OSError, ValueError) as exc:
        return {"placed": [], "reason": f"no prepared.json in {carried}: {type(exc).__name__}"}
    h = hashlib.sha256()
    for rel in ("asyncdbo/_core/_spin.c", "asyncdbo/dbo/_speedups.c", "asyncdbo/_native/slots.h"):
        h.update(rel.encode() + b"\0" + (ROOT / rel).read_bytes() + b"\0")  # first_contact_prepare.sources_sha256
    if h.hexdigest() != prepared.get("sources_sha256"):
        return {"placed": [], "reason": "built from other C sources than these (rerun first_contact_prepare.py)"}
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    placed, present = [], []
    for so in sorted((carried / "native").rglob(f"*{suffix}")):
        rel = so.relative_to(carried / "native")
        dest = ROOT / rel
        if dest.exists():
            present.append(str(rel))
        else:
            shutil.copy2(so, dest)
            placed.append(str(rel))
    return {"placed": placed, "present": present, **({} if placed or present else {"reason": f"no {suffix} build"})}


def _preload_for_forked_steps() -> None:
    """What every --dry-run step imports first: torch, and torch._dynamo, which a dispatch mode
    (the fake device, HostSyncs) imports on its first op. A fresh interpreter per step paid both
    again, most of a dry step's CPU time (the measurement is in the commit that added this)."""
    import torch._dynamo  # noqa: F401

    import asyncdbo  # noqa: F401
    from asyncdbo.testing import fake_device  # noqa: F401


def _forked_step(name: str, result_path: str, out: Path, log: Any, limit: float, env: dict[str, str]) -> int | None:
    """Under --dry-run, one step in a forked child of this driver, which imported torch once
    (:func:`_preload_for_forked_steps`): its own process, its output to ``log``, killed after
    ``limit`` seconds (None then), as the GPU run's fresh interpreter per step; the return code
    otherwise. Only on a CPU: a forked child must not inherit a CUDA context."""
    import multiprocessing as mp

    proc = mp.get_context("fork").Process(target=_step_child, args=(name, result_path, str(out), log.fileno(), env, limit),
                                          name=f"first_contact-{name}")
    proc.start()
    proc.join(limit)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        return None
    return proc.exitcode


def _step_child(name: str, result_path: str, out: str, log_fd: int, env: dict[str, str], limit: float) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.chdir(ROOT)
    os.environ.clear()
    os.environ.update(env)  # what the step's own interpreter would get (the tests step passes it on)
    # and its sys.path: PYTHONPATH's entries (the carried wheels' target, the tree, tests/helpers)
    # first, as a fresh interpreter puts them, or the tests step would not see the carried plugins
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    try:
        rc = main(["--step", name, "--result", result_path, "--out", out, "--limit", str(limit), "--dry-run"])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(rc)


def drive(out: Path, dry: bool, only: set[str] | None, wheels: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    native = _place_native(wheels)
    if dry:
        _preload_for_forked_steps()
    lines, log_path = out / "first_contact.jsonl", out / "steps.log"
    failed = 0
    with open(log_path, "a") as log, open(lines, "a") as jl:
        selected = [name for name, _ in STEPS if only is None or name in only]
        slack = DRY_SLACK if dry else 1
        deadline = time.monotonic() + budget_s(selected) * slack  # the call's budget, enforced
        # the carried wheels, for a call that runs ``tests``, dry or not: a dry run of the device's
        # calls under an image without pytest-asyncio then takes the device's path (both plugins)
        needs_wheels = "tests" in selected
        wheel_info = _install_wheels(wheels, log) if needs_wheels else {"wheels": [], "installed": False,
                                                                        **({} if dry else {"skipped": "no tests step"})}
        env = dict(os.environ, PYTHONUNBUFFERED="1", FIRST_CONTACT_CARRIED=str(wheels))
        paths = [str(SITE)] if wheel_info["installed"] else []
        env["PYTHONPATH"] = os.pathsep.join([*paths, str(ROOT), str(HELPERS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        for name, limit in STEPS:
            if name not in selected:
                continue
            # its own limit, or what is left of the call's budget (less the driver's share)
            limit = max(1, min(limit * slack, int(deadline - time.monotonic() - DRIVER_S * slack)))
            with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as tmp:
                result_path = tmp.name
            cmd = [sys.executable, str(Path(__file__).resolve()), "--step", name, "--result", result_path,
                   "--out", str(out), "--limit", str(limit), *(["--dry-run"] if dry else [])]
            log.write(f"\n===== {name} (timeout {limit} s) =====\n")
            log.flush()
            t0 = time.perf_counter()
            rc: int | None
            if dry:
                rc = _forked_step(name, result_path, out, log, limit, env)
            else:
                try:
                    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=limit, cwd=ROOT)
                    rc = proc.returncode
                except subprocess.TimeoutExpired:
                    rc = None
            wall = round(time.perf_counter() - t0, 2)
            try:
                result = json.loads(Path(result_path).read_text() or "{}")
            except (OSError, ValueError):
                result = {}
            with contextlib.suppress(OSError):
                os.unlink(result_path)
            ok = rc == 0 and bool(result.get("ok"))
            if rc is None:
                result["error"] = f"timed out after {limit} s (what it had measured is kept)"
            elif rc != 0 and "error" not in result:
                result["error"] = f"exited with status {rc} (see steps.log)"
            if name == "env":
                result["carried_wheels"], result["carried_c_extensions"] = wheel_info, native
            line = {"step": name, "ok": ok, "dry_run": dry, "wall_s": wall, "timeout_s": limit, **result}
            line.pop("ok_", None)
            jl.write(json.dumps(line, default=str) + "\n")
            jl.flush()
            failed += not ok
            print(f"first_contact: {name}: {'ok' if ok else 'FAILED'} in {wall} s", flush=True)
            if name == "env" and not dry and result.get("cuda_available") is False:
                print("first_contact: torch sees no CUDA device here; on a CPU run --dry-run", file=sys.stderr)
                return 2
    print(f"first_contact: wrote {lines}", flush=True)
    return 1 if failed else 0


# ------------------------------------------------------------------------------ a step's context
class Step:
    """A step's result, written to its file after every update (a killed step keeps its part)."""

    def __init__(self, path: str, dry: bool, out: Path, limit: float) -> None:
        self.path, self.dry, self.out, self.limit = path, dry, out, limit  # limit: the driver's for this step
        self.data: dict[str, Any] = {"ok": False}

    def put(self, **items: Any) -> None:
        self.data.update(items)
        Path(self.path).write_text(json.dumps(self.data, default=str))


@contextlib.contextmanager
def device(dry: bool, **fake: Any) -> Iterator[Any]:
    """CUDA, or under --dry-run the fake device (CPU tensors, virtual time)."""
    if not dry:
        yield None
        return
    from asyncdbo.testing.fake_device import FakeDevice

    with FakeDevice(**fake) as dev:
        yield dev


def _dev(dry: bool) -> Any:
    import torch

    return torch.device("cpu" if dry else "cuda")


#: What MoEConfig's None fields resolve to for accelerator inputs (asyncdbo/moe/layer.py), spelled
#: out in every step that builds an MoE layer: under --dry-run the fake device's tensors are CPU
#: tensors, which would take the exact path (22 host syncs) and deterministic mode instead, a path
#: the GPU does not run.
ACCEL_MOE = {"sync_free": True, "deterministic": False}


def accelerator_moe(model: Any) -> Any:
    """``model``'s MoE layers (MiniModel's, whose config leaves sync_free to the input) set to
    :data:`ACCEL_MOE`'s sync-free path, as on the GPU."""
    import dataclasses

    for layer in model.layers:
        layer["moe"].cfg = dataclasses.replace(layer["moe"].cfg, sync_free=True)
    return model


#: the device sleep queued before each timed call's start event (:func:`device_ms`)
LEAD_MS = 5.0
_CYCLES_PER_MS: list[float] = []


def cycles_per_ms() -> float:
    """What ``torch.cuda._sleep`` counts in a millisecond here, measured once."""
    import torch

    if not _CYCLES_PER_MS:
        probe = 10_000_000
        (ms,) = device_ms(lambda: torch.cuda._sleep(probe), 1, lead_ms=0.0)
        _CYCLES_PER_MS.append(probe / max(ms, 1e-6))
    return _CYCLES_PER_MS[0]


def device_ms(fn: Callable[[], None], reps: int, lead_ms: float = LEAD_MS) -> list[float]:
    """Device time of each of ``reps`` calls of ``fn`` in ms, device work only: a ``lead_ms``
    device sleep is queued before the start event, so the host sets the call up (``asyncdbo.run``'s
    loop, the first launches) while the device is still busy, and the start event fires with work
    already queued behind it (without it the host's set-up, about 80 us, was idle device time
    inside the figure). ``fn`` returns nothing: what it made is not freed between the events."""
    import torch

    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if lead_ms:
            torch.cuda._sleep(int(lead_ms * cycles_per_ms()))
        s.record()
        returned = fn()
        e.record()
        e.synchronize()
        if returned is not None:
            raise TypeError(f"a timed call must return None (got {type(returned).__name__})")
        times.append(round(s.elapsed_time(e), 4))
    return times


def _med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


# --------------------------------------------------------------------------------------- 1. env
def step_env(st: Step) -> None:
    import torch

    import asyncdbo
    from asyncdbo._core import fastpath
    from asyncdbo.dbo import primitives

    info: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "asyncdbo": getattr(asyncdbo, "__version__", "?"),
        "c_loop": fastpath.C is not None, "c_primitives": primitives.FAST is not None,
    }
    from importlib import metadata

    for dist in ("uvloop", "pytest", "pytest-asyncio", "pytest-timeout", "hypothesis", "transformers"):
        try:
            info[dist] = metadata.version(dist)  # without importing it (transformers takes seconds)
        except metadata.PackageNotFoundError:
            info[dist] = None
    try:  # no .git travels to the GPU machine: there the commit is the one first_contact_prepare.py wrote
        prepared = json.loads((Path(os.environ.get("FIRST_CONTACT_CARRIED", ROOT / ".whl")) / "prepared.json").read_text())
        info["commit"], info["commit_dirty"] = prepared.get("commit"), prepared.get("dirty")
    except (OSError, ValueError):
        info["commit"] = None
    if (ROOT / ".git").exists():
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            info["commit"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                                            text=True, timeout=10).stdout.strip() or info["commit"]
            info["commit_dirty"] = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                                       capture_output=True, text=True, timeout=10).stdout.strip())
    st.put(**info)
    if not st.dry:
        p = torch.cuda.get_device_properties(0)
        st.put(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
               memory_gib=round(p.total_memory / 2**30, 1))
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=15)
            st.put(nvidia_smi=smi.stdout.strip())
        except (OSError, subprocess.TimeoutExpired) as exc:
            st.put(nvidia_smi=f"unavailable: {exc}")
    st.put(ok=st.dry or bool(info["cuda_available"]))


# ---------------------------------------------------------------------------------- 2. headline
def _sleep_concurrency(st: Step) -> None:
    """Two torch.cuda._sleep kernels (no memory traffic) on two streams: concurrent or not."""
    import torch

    cycles = int(cycles_per_ms() * 10.0)  # about 10 ms
    a, b = torch.cuda.Stream(), torch.cuda.Stream()

    def two_streams() -> None:
        cur = torch.cuda.current_stream()
        a.wait_stream(cur)
        b.wait_stream(cur)
        for s in (a, b):
            with torch.cuda.stream(s):
                torch.cuda._sleep(cycles)
        cur.wait_stream(a)
        cur.wait_stream(b)

    one = device_ms(lambda: torch.cuda._sleep(cycles), 3)
    both = device_ms(two_streams, 3)
    st.put(sleep_concurrency={"one_kernel_ms": one, "two_streams_ms": both, "ratio": round(_med(both) / _med(one), 3)})


def _overlap_program(st: Step, be: Any) -> None:
    """tests/helpers/_device_scenarios.overlap_forward (what test_cuda.py and the fake time)."""
    import torch
    from _device_scenarios import overlap_forward

    import asyncdbo

    cycles = int(cycles_per_ms() * 20.0)

    def comm() -> None:
        torch.cuda._sleep(cycles)

    out: dict[str, Any] = {}
    for policy in ("role", "ubatch"):
        def dbo(policy: str = policy) -> None:
            asyncdbo.run(lambda: asyncdbo.run_ubatches(overlap_forward, [(0, comm, comm), (1, comm, comm)],
                                                       backend=be, stream_policy=policy))

        dbo()
        def serial_run() -> None:
            comm()
            comm()

        serial = device_ms(serial_run, 3)
        overlapped = device_ms(dbo, 3)
        out[policy] = {"serial_ms": serial, "dbo_ms": overlapped, "ratio": round(_med(overlapped) / _med(serial), 3)}
    st.put(sleep_overlap_program=out)


def comm_hidden(c: float, m: float, d: float) -> float:
    """The share of the hideable time that DBO hid: ``(c + m - d) / min(c, m)`` with ``c`` and
    ``m`` the compute-only and comm-only runs and ``d`` the DBO run, all of the same two ubatches
    (1: d = max(c, m), all hidden; 0: d = c + m, none)."""
    return round((c + m - d) / max(min(c, m), 1e-9), 3)


def _comm_backend(priority: int) -> Any:
    """The cuda backend whose role-policy comm stream has ``priority`` (0 the default; -1 above
    the compute stream's 0)."""
    import torch

    from asyncdbo.backends.accelerator import AcceleratorBackend

    be = AcceleratorBackend("cuda")
    be._comm = torch.cuda.Stream(priority=priority)  # what attach() would make, with a priority
    return be


def _moe_like(st: Step, dry: bool) -> None:
    """A layer stack with a comm stand-in on the comm stream, two kinds: ``copy_engine``, a pinned
    device->host->device copy that occupies no SMs (the copy engines standing in for the NIC: an
    upper bound on what DBO hides), and ``sm_copy``, a dtype-converting copy there and back, a
    kernel that occupies SMs as NCCL's does; each with the comm stream at the default priority (0)
    and above compute (-1). Per case: serial (one ubatch), DBO (two), and the compute-only and
    comm-only runs of two ubatches, timed on the device (:func:`device_ms`); the comm hidden is
    ``(c + m - d) / min(c, m)`` of those 2-ubatch runs (1: all that could hide did, 0: nothing),
    and the tracer's comm-hidden share of a DBO run is measured from device events."""
    import torch

    import asyncdbo
    from asyncdbo import dbo_yield_and_switch_from_comm_to_compute, dbo_yield_and_switch_from_compute_to_comm
    from asyncdbo.observe import Tracer

    dev = _dev(dry)
    layers, T, D = (4, 4096, 4096) if not dry else (2, 16, 8)
    dtype = torch.bfloat16 if not dry else torch.float32
    wide = torch.float32 if not dry else torch.float64  # the SM copy's other dtype: a conversion kernel
    g = torch.Generator(device=dev).manual_seed(0)
    w_DD = torch.randn(D, D, device=dev, dtype=dtype, generator=g) / D**0.5
    x_TD = torch.randn(T, D, device=dev, dtype=dtype, generator=g)
    bufs: dict[Any, torch.Tensor] = {}
    reps = {"mm": 1, "copy": 1}

    async def stack(x_TD: torch.Tensor, key: int, compute: bool, comm: bool, kind: str) -> None:
        for layer in range(layers):
            h_TD = x_TD
            if compute:
                for _ in range(reps["mm"]):
                    h_TD = torch.relu(h_TD @ w_DD)
            back_TD = torch.empty_like(h_TD)  # allocated on compute: the comm stream writes it
            await dbo_yield_and_switch_from_compute_to_comm(f"L{layer}:dispatch")
            if comm:
                buf = bufs.get((kind, key, h_TD.shape))
                if buf is None:
                    buf = bufs[(kind, key, h_TD.shape)] = (
                        torch.empty(h_TD.shape, dtype=dtype, pin_memory=not dry) if kind == "copy_engine"
                        else torch.empty(h_TD.shape, dtype=wide, device=dev))
                for _ in range(reps["copy"] if kind == "sm_copy" else 1):
                    buf.copy_(h_TD, non_blocking=True)  # out: to the host, or widened on the SMs
                    back_TD.copy_(buf, non_blocking=True)  # and back
            else:
                back_TD.copy_(h_TD)
            await dbo_yield_and_switch_from_comm_to_compute(f"L{layer}:combine")
            x_TD = x_TD + back_TD

    def run(be: Any, n: int, kind: str, compute: bool = True, comm: bool = True, instrument: Any = None) -> None:
        parts = [(x_TD[k * T // n:(k + 1) * T // n], k, compute, comm, kind) for k in range(n)]
        asyncdbo.run(lambda: asyncdbo.run_ubatches(stack, parts, backend=be, instrument=instrument))

    out: dict[str, Any] = {"layers": layers, "T": T, "D": D, "dtype": str(dtype), "lead_ms": LEAD_MS}
    st.put(moe_like=out)
    for kind in ("copy_engine", "sm_copy"):
        be0 = _comm_backend(0)
        for n in (2, 1):
            run(be0, n, kind)  # warm-up: cuBLAS, buffers, streams
        # one layer's compute about its comm, calibrated on the one-ubatch runs
        reps["mm"], reps["copy"] = (1, 1) if kind == "copy_engine" else (4, 1)
        c1, m1 = _med(device_ms(lambda: run(be0, 1, kind, comm=False), 3)), _med(device_ms(lambda: run(be0, 1, kind, compute=False), 3))
        if not dry and kind == "copy_engine":
            reps["mm"] = max(1, min(16, round(m1 / max(c1, 1e-6))))
        elif not dry:
            reps["copy"] = max(1, min(64, round(c1 / max(m1, 1e-6))))
        for priority in (0, -1):
            be = be0 if priority == 0 else _comm_backend(priority)
            run(be, 2, kind)
            res: dict[str, Any] = {"comm_stream_priority": priority, "matmuls_per_layer": reps["mm"],
                                   "copies_per_layer": reps["copy"], "calibration_ms": {"compute_1ub": c1, "comm_1ub": m1}}
            for label, n, compute, comm in (("serial", 1, True, True), ("dbo", 2, True, True),
                                            ("compute_only", 2, True, False), ("comm_only", 2, False, True)):
                res[f"{label}_ms"] = device_ms(lambda n=n, c=compute, m=comm: run(be, n, kind, c, m), 5 if not dry else 1)
                out[f"{kind}_prio{priority}"] = res
                st.put(moe_like=out)
            s_, d, c, m = (_med(res[f"{k}_ms"]) for k in ("serial", "dbo", "compute_only", "comm_only"))
            tracer = Tracer()
            run(be, 2, kind, instrument=tracer)
            nums = tracer.numbers()
            res.update(speedup_over_serial=round(s_ / max(d, 1e-9), 3),
                       comm_hidden=comm_hidden(c, m, d),
                       tracer_comm_s=nums.comm_s, tracer_compute_s=nums.compute_s,
                       tracer_comm_hidden_share=round(nums.comm_hidden_share, 3),
                       tracer_comm_hidden_by_other_s=nums.comm_hidden_by_other_s)
            out[f"{kind}_prio{priority}"] = res
            st.put(moe_like=out)


def _switch_cost(st: Step, be: Any) -> None:
    """Host ns per dbo_yield and per compute->comm->compute pair on the device backend."""
    import asyncdbo
    from asyncdbo import dbo_yield, dbo_yield_and_switch_from_comm_to_compute, dbo_yield_and_switch_from_compute_to_comm

    K = 4000 if not st.dry else 50

    async def yields(i: int) -> None:
        for _ in range(K):
            await dbo_yield("y")

    async def roles(i: int) -> None:
        for _ in range(K // 2):
            await dbo_yield_and_switch_from_compute_to_comm("c2m")
            await dbo_yield_and_switch_from_comm_to_compute("m2c")

    out = {}
    for name, fn in (("dbo_yield", yields), ("role_switch", roles)):
        vals = []
        for _ in range(3):
            t0 = time.perf_counter()
            asyncdbo.run(lambda fn=fn: asyncdbo.run_ubatches(fn, [(0,), (1,)], backend=be))
            vals.append(round((time.perf_counter() - t0) / (2 * K) * 1e9))
        out[f"{name}_host_ns"] = vals
    st.put(switch_cost=out)


def step_headline(st: Step) -> None:
    from asyncdbo.backends.accelerator import AcceleratorBackend

    import torch

    priced = {torch.ops.aten.mm.default, torch.ops.aten.copy_.default}  # virtual ms under --dry-run
    with device(st.dry, cost=lambda func, *_: 1.0 if func in priced else 0.0):
        be = AcceleratorBackend("cuda")
        _sleep_concurrency(st)
        _overlap_program(st, be)
        _moe_like(st, st.dry)
        _switch_cost(st, be)
    st.put(ok=True)


# -------------------------------------------------------------------------------- 3. invariants
def step_invariants(st: Step) -> None:
    """The fake device's rules on the real device: the race rule from PyTorch's CUDA sanitizer
    (CSAN), the wrong-stream rule from StreamDiscipline, the joins and the restored caller's
    stream read directly. Both policies, N = 2-4, one and two concurrent runs, the MoE layer."""
    import asyncio

    import torch

    import asyncdbo
    from asyncdbo import dbo_yield_and_switch_from_comm_to_compute, dbo_yield_and_switch_from_compute_to_comm
    from asyncdbo.backends.accelerator import AcceleratorBackend
    from asyncdbo.testing.fake_device import StreamDiscipline

    dev = _dev(st.dry)
    if not st.dry:
        import torch.cuda._sanitizer as csan

        csan.enable_cuda_sanitizer()

    async def stage(x_T: torch.Tensor) -> torch.Tensor:
        y_T = torch.empty_like(x_T)
        await dbo_yield_and_switch_from_compute_to_comm("dispatch")
        torch.mul(x_T, 2, out=y_T)
        await asyncio.sleep(0)  # an event-loop wait: the other run installs its streams here
        await dbo_yield_and_switch_from_comm_to_compute("combine")
        return y_T + 1

    cases: list[dict[str, Any]] = []
    with device(st.dry):
        be = AcceleratorBackend("cuda")
        home = torch.cuda.current_stream()
        grid = [(p, n, r) for p in ("role", "ubatch") for n in (2, 3, 4) for r in (1, 2)]
        for policy, n, runs in grid if not st.dry else [("role", 2, 1), ("ubatch", 4, 2)]:
            case: dict[str, Any] = {"policy": policy, "n": n, "runs": runs}
            xs = [[torch.full((1024,), float(k + r), device=dev) for k in range(n)] for r in range(runs)]

            async def main(xs: list[list[torch.Tensor]] = xs, policy: str = policy) -> list[list[torch.Tensor]]:
                return list(await asyncio.gather(*(asyncdbo.run_ubatches(stage, [(x,) for x in group], backend=be,
                                                                         stream_policy=policy) for group in xs)))

            disc = StreamDiscipline()
            try:
                with disc:
                    outs = asyncdbo.run(main)
                want = [[2 * (k + r) + 1.0] * 1024 for r in range(runs) for k in range(n)]
                case.update(equal=[o.tolist() for group in outs for o in group] == want,
                            wrong_stream=disc.violations[:3], ops_checked=disc.ops,
                            caller_stream_restored=torch.cuda.current_stream() == home)
            except Exception as exc:  # CSAN reports a race by raising
                case.update(error=f"{type(exc).__name__}: {str(exc)[:1500]}")
            cases.append(case)
            st.put(cases=cases)
        streams_per_run = []
        for _ in range(2):
            asyncdbo.run(lambda: asyncdbo.run_ubatches(stage, [(torch.ones(8, device=dev),)] * 2, backend=be, stream_policy="ubatch"))
            streams_per_run.append(sorted(str(s) for s in (be._comm_side + be._compute_side)))
        st.put(streams_reused=streams_per_run[0] == streams_per_run[1])
        moe = _moe_cases(st, be, dev)
    # The verdict is the stream findings: a race (CSAN raises: ``error``), an op on another ubatch's
    # stream, the caller's stream not restored, streams not reused, and the toy's values, small
    # integers that any rounding keeps exact (a wrong one is a race). The MoE layer's bit equality
    # with its plain call is reported beside it (``moe_bitwise_equal``), not judged: with
    # deterministic mode off, as on CUDA, a 10- and a 14-row GEMM may round otherwise than a
    # 24-row one, and its last bits may differ.
    good = all(c.get("equal") and not c.get("wrong_stream") and c.get("caller_stream_restored") for c in cases)
    moe_clean = all("error" not in m and not m.get("wrong_stream") for m in moe)
    st.put(moe_layer=moe, moe_bitwise_equal=all(m.get("bitwise_equal") for m in moe),
           moe_max_abs_diff=max((m.get("max_abs_diff", 0.0) for m in moe), default=0.0),
           ok=good and moe_clean and bool(st.data["streams_reused"]))


def _moe_cases(st: Step, be: Any, dev: Any) -> list[dict[str, Any]]:
    import torch
    from _moe_ranks import DEEPSEEK_LIKE

    import asyncdbo
    from asyncdbo.moe import MoEConfig, MoELayer
    from asyncdbo.testing.fake_device import StreamDiscipline

    out = []
    combos = [(s, p) for s in ("ht", "ll") for p in ("role", "ubatch")]
    for schedule, policy in combos if not st.dry else [("ht", "role"), ("ll", "ubatch")]:
        case: dict[str, Any] = {"schedule": schedule, "policy": policy}
        try:
            layer = MoELayer(MoEConfig(**DEEPSEEK_LIKE, schedule=schedule, **ACCEL_MOE), seed=3).to(dev)
            x_TD = torch.randn(24, 32, generator=torch.Generator().manual_seed(1)).to(dev)
            ref = asyncdbo.run(layer, x_TD)
            disc = StreamDiscipline()
            with disc:
                outs = asyncdbo.run(lambda: asyncdbo.run_ubatches(layer, [(x_TD[:10],), (x_TD[10:],)], backend=be,
                                                                  stream_policy=policy))
            got = torch.cat(outs)
            case.update(bitwise_equal=bool(torch.equal(got, ref)), max_abs_diff=float((got - ref).abs().max()),
                        wrong_stream=disc.violations[:3])
        except Exception as exc:
            case.update(error=f"{type(exc).__name__}: {str(exc)[:1500]}")
        out.append(case)
        st.put(moe_layer=out)
    return out


# ------------------------------------------------------------------------------------- 4. syncs
def step_syncs(st: Step) -> None:
    """Host syncs in one DBO step of the MoE layer (EP 1) on its sync-free path (the accelerator's
    default, :data:`ACCEL_MOE`, also under --dry-run), per schedule and policy: torch's own count
    (set_sync_debug_mode("warn"), what the GPU really does) beside asyncdbo's HostSyncs, which must
    count 0 for the step to pass."""
    import warnings

    import torch
    from _moe_ranks import DEEPSEEK_LIKE

    import asyncdbo
    from asyncdbo.backends.accelerator import AcceleratorBackend
    from asyncdbo.syncs import HostSyncs
    from asyncdbo.moe import MoEConfig, MoELayer

    dev = _dev(st.dry)
    out = []
    with device(st.dry):
        be = AcceleratorBackend("cuda")
        combos = [(s, p) for s in ("ht", "ll") for p in ("role", "ubatch")]
        for schedule, policy in combos if not st.dry else [("ht", "role"), ("ll", "ubatch")]:
            layer = MoELayer(MoEConfig(**DEEPSEEK_LIKE, schedule=schedule, **ACCEL_MOE), seed=3).to(dev)
            x_TD = torch.randn(24, 32, generator=torch.Generator().manual_seed(1)).to(dev)

            def step(layer: Any = layer, x_TD: Any = x_TD, policy: str = policy) -> Any:
                return asyncdbo.run(lambda: asyncdbo.run_ubatches(layer, [(x_TD[:10],), (x_TD[10:],)], backend=be,
                                                                  stream_policy=policy))

            step()  # warm-up
            case: dict[str, Any] = {"schedule": schedule, "policy": policy}
            with warnings.catch_warnings(record=True) as caught, HostSyncs(device_only=not st.dry) as syncs:
                warnings.simplefilter("always")
                if not st.dry:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    step()
                finally:
                    if not st.dry:
                        torch.cuda.set_sync_debug_mode("default")
            torch_syncs = [str(w.message).splitlines()[0][:160] for w in caught if "synchroniz" in str(w.message)]
            case.update(torch_sync_count=None if st.dry else len(torch_syncs), torch_syncs=torch_syncs[:5],
                        hostsyncs_count=syncs.count, hostsyncs_by_op=syncs.by_op())
            out.append(case)
            st.put(cases=out, moe_config=ACCEL_MOE)
    # the sync-free path is the accelerator's default: a host sync in it is a failure, dry or not
    st.put(ok=all(c["hostsyncs_count"] == 0 for c in out))


# ------------------------------------------------------------------------------------- 5. graph
def step_graph(st: Step) -> None:
    """CUDA-graph capture of a two-ubatch step: a toy interleaved forward (must capture and replay
    equal) and one DBO step of the MoE layer on its sync-free path (:data:`ACCEL_MOE`), which must
    capture too (under --dry-run: no host sync seen)."""
    import torch
    from _device_scenarios import capture_forward
    from _moe_ranks import DEEPSEEK_LIKE

    import asyncdbo
    from asyncdbo.backends.accelerator import AcceleratorBackend
    from asyncdbo.moe import MoEConfig, MoELayer

    dev = _dev(st.dry)
    with device(st.dry, capturable=False) as fake:
        be = AcceleratorBackend("cuda")
        w = torch.randn(256, 256, device=dev) / 16
        x_in = [torch.randn(64, 256, device=dev) for _ in range(2)]
        outs = [torch.empty(64, 256, device=dev) for _ in range(2)]

        async def toy(i: int) -> None:
            await capture_forward(i, x_in, w, outs)  # test_cuda.py's captured program

        layer = MoELayer(MoEConfig(**DEEPSEEK_LIKE, schedule="ht", **ACCEL_MOE), seed=3).to(dev)
        x_TD = torch.randn(24, 32, generator=torch.Generator().manual_seed(1)).to(dev)
        moe_out: list[Any] = []

        async def moe_step() -> None:
            moe_out[:] = await asyncdbo.run_ubatches(layer, [(x_TD[:10],), (x_TD[10:],)], backend=be)

        for name, fn in (("toy", lambda: asyncdbo.run(lambda: asyncdbo.run_ubatches(toy, [(0,), (1,)], backend=be))),
                         ("moe_ht", lambda: asyncdbo.run(moe_step))):
            case: dict[str, Any] = {}
            try:
                if st.dry:
                    assert fake is not None
                    fake.capturable, before = True, len(fake.problems)
                    fn()
                    fake.capturable = False
                    found = fake.problems[before:]
                    del fake.problems[before:]
                    syncs = [p for p in found if p.startswith("host sync")]
                    case.update(captured=not syncs, host_syncs=syncs[:5],
                                other_problems=[p for p in found if not p.startswith("host sync")][:5])
                else:
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        fn()  # warm-up outside capture (cuBLAS handles, allocator, the backend's streams)
                    torch.cuda.current_stream().wait_stream(side)
                    eager = [o.clone() for o in (outs if name == "toy" else moe_out)]
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        fn()
                    graph.replay()
                    torch.cuda.synchronize()
                    got = outs if name == "toy" else moe_out
                    case.update(captured=True, replay_equal=all(torch.equal(a, b) for a, b in zip(got, eager)))
            except Exception as exc:
                case.update(captured=False, error=f"{type(exc).__name__}: {str(exc)[:1500]}")
            st.put(**{name: case})
    # the MoE step runs its sync-free path: it must capture (under --dry-run: 0 host syncs seen)
    st.put(ok=bool(st.data.get("toy", {}).get("captured")) and bool(st.data.get("moe_ht", {}).get("captured")))


# ------------------------------------------------------------------------------------- 6. tests
def step_tests(st: Step) -> None:
    """The ``cuda`` tests with junit output, independent of the image's plugins: autoload off
    (``PYTEST_DISABLE_PLUGIN_AUTOLOAD``), the two the suite needs named (pytest-timeout and
    pytest-asyncio, both carried as wheels), so the project's strict config and "warnings are
    errors" meet only those. Without one of them only tests/backends/test_cuda.py runs, without
    the conftest, under a minimal ini (``--strict-config`` would refuse ``timeout`` or the
    ``asyncio_*`` keys)."""
    import importlib.util

    have = {mod: importlib.util.find_spec(mod) is not None for mod in ("pytest_timeout", "pytest_asyncio")}
    junit = st.out / "junit.xml"
    plugins = [arg for mod, name in (("pytest_timeout", "pytest_timeout"), ("pytest_asyncio", "pytest_asyncio.plugin"))
               if have[mod] for arg in ("-p", name)]
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugins, f"--junitxml={junit}", "-m", "cuda"]
    if all(have.values()):
        cmd = [*base, "tests/backends/test_cuda.py", "tests/observe/test_trace.py"]
    else:
        ini = Path(tempfile.gettempdir()) / "asyncdbo_first_contact.ini"
        ini.write_text("[pytest]\nmarkers =\n    cuda: needs a CUDA device\n    slow: slow\n    timeout: per-test limit\n")
        cmd = [*base, "--noconftest", "-c", str(ini), "--rootdir", str(ROOT), "tests/backends/test_cuda.py"]
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    st.put(command=" ".join(cmd[1:]), plugins=have, plugin_autoload=False)
    # the limit the driver gave this step less 10 s to report (x DRY_SLACK on a CPU: 110 s ran out at load average 22)
    limit = max(1, st.limit - 10)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, cwd=ROOT, env=env)
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    st.put(returncode=proc.returncode, summary=(proc.stdout.strip().splitlines() or ["?"])[-1],
           ok=proc.returncode in (0, 5) if st.dry else proc.returncode == 0)


# ---------------------------------------------------------------------------------- 7. numerics
def step_numerics(st: Step) -> None:
    """Serial vs DBO logits of the mini model on the GPU (EP 1), deterministic mode off and on,
    prefill and decode: bitwise equal or the max |diff| (docs/design.md, "Numerics")."""
    from functools import partial

    import torch

    import asyncdbo
    from asyncdbo.models import MiniConfig, MiniModel
    from asyncdbo.plan import ThresholdConfig
    from asyncdbo.serving import BatchBuilder, DBORunner, RunnerConfig

    dev = _dev(st.dry)
    always = ThresholdConfig(prefill_threshold=0, decode_threshold=0)
    lens, reqs, ctx_len = ((300, 170, 42), 96, 40) if not st.dry else ((12, 7, 3), 6, 8)
    out = []
    grid = [(sh, det, n, p) for sh in ("prefill", "decode") for det in (False, True) for n, p in ((2, "role"), (3, "ubatch"))]
    small = dict(vocab_size=1024, hidden_size=64, num_layers=1, num_heads=2, head_dim=32, moe_intermediate_size=64,
                 num_kv_blocks=64) if st.dry else {"num_kv_blocks": 512}
    with device(st.dry):
        for shape, det, n, policy in grid if not st.dry else [("prefill", True, 2, "role"), ("decode", False, 3, "ubatch")]:
            cfg = MiniConfig(deterministic=det, **small)  # type: ignore[arg-type]
            runner = DBORunner(accelerator_moe(MiniModel(cfg, device=dev)), RunnerConfig(thresholds=always, num_ubatches=n,
                                                                        stream_policy=policy))  # type: ignore[arg-type]
            builder = BatchBuilder(cfg.kv_cache_config, device=dev)
            g = torch.Generator().manual_seed(0)
            if shape == "prefill":
                chunks = [(r, torch.randint(0, 1024, (k,), generator=g).tolist()) for r, k in enumerate(lens)]
            else:
                ctx = builder.build([(r, torch.randint(0, 1024, (ctx_len,), generator=g).tolist()) for r in range(reqs)])
                asyncdbo.run(partial(runner.step, enabled=False), ctx)
                chunks = [(r, [int(torch.randint(0, 1024, (1,), generator=g))]) for r in range(reqs)]
            batch = builder.build(chunks)
            serial = asyncdbo.run(partial(runner.step, enabled=False), batch).logits_TV
            if shape == "prefill":
                builder.reset()
                batch = builder.build(chunks)
            dbo = asyncdbo.run(runner.step, batch).logits_TV
            out.append({"shape": shape, "deterministic": det, "ubatches": n, "policy": policy,
                        "bitwise_equal": bool(torch.equal(serial, dbo)),
                        "max_abs_diff": float((serial - dbo).abs().max())})
            st.put(cases=out)
    st.put(ok=True)


STEP_FUNCS: dict[str, Callable[[Step], None]] = {
    "env": step_env, "headline": step_headline, "invariants": step_invariants, "syncs": step_syncs,
    "graph": step_graph, "tests": step_tests, "numerics": step_numerics,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "out" / "first_contact"),
                    help="where the three output files go (default: $OUT, else out/first_contact)")
    ap.add_argument("--dry-run", action="store_true", help="run every step on a CPU under the fake device")
    ap.add_argument("--only", help="comma-separated steps to run (default: all)")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="carried wheels to install first (default: .whl)")
    ap.add_argument("--plan", action="store_true", help="print the device calls and their timeout_s, then exit")
    ap.add_argument("--step", choices=list(STEP_FUNCS), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.plan:
        print(plan())
        return 0
    if args.step is None:
        only = None
        if args.only:
            only = set(args.only.split(","))
            unknown = sorted(only - set(STEP_FUNCS))
            if unknown:
                ap.error(f"--only names unknown steps {unknown}; choose from {list(STEP_FUNCS)}")
        return drive(args.out, args.dry_run, only, args.wheels)
    limit = args.limit if args.limit is not None else dict(STEPS)[args.step] * (DRY_SLACK if args.dry_run else 1)
    st = Step(args.result, args.dry_run, args.out, limit)
    st.put()
    try:
        STEP_FUNCS[args.step](st)
    except Exception as exc:
        traceback.print_exc()
        st.put(ok=False, error=f"{type(exc).__name__}: {str(exc)[:2000]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
