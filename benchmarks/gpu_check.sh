#!/usr/bin/env bash
# GPU check: on a machine with a CUDA GPU, install asyncdbo (keeping the CUDA torch already there),
# run the CUDA tests and the GPU benchmarks, and write everything to
# benchmarks/results/gpu_check_<date>.md. The whole script is bounded by `timeout 470` (< 8 min).
#
#   bash benchmarks/gpu_check.sh            # from anywhere inside the repository
#
# GPU benchmarks (each timed on the device with CUDA events, medians of several repetitions):
#   1. overlap: 2 ubatches x 4 layers; compute = matmuls on the compute stream, comm = a pinned
#      device->host->device copy on the comm stream (the copy engines stand in for the NIC on one
#      GPU). Serial (one ubatch, same code) vs asyncdbo DBO.
#   2. cuda graph: a launch-bound interleaved forward (8 layers of small ops, 2 ubatches) eager
#      vs one captured CUDA graph of the whole interleaving.
#   3. switch cost with streams: host-side ns per `dbo_yield()` and per compute->comm->compute
#      switch pair (event record + stream wait + set_stream) on the cuda backend; plus
#      `asyncdbo bench` (pure handoff cost) on this host's CPU.
#   4. deterministic mode on the GPU: serial vs DBO logits of the mini model (EP 1), prefill and
#      decode, mode off and on: bitwise equal or the max |diff| (docs/design.md, "Numerics").
set -euo pipefail

if [[ "${ASYNCDBO_GPU_CHECK_INNER:-}" != "1" ]]; then
    export ASYNCDBO_GPU_CHECK_INNER=1
    exec timeout 470 bash "$0" "$@"
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python}"
OUT="benchmarks/results/gpu_check_$(date -u +%Y-%m-%d).md"
mkdir -p benchmarks/results
LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT

section() { printf '\n## %s\n\n' "$1" >>"$OUT"; }
fence() { printf '```text\n' >>"$OUT"; cat >>"$OUT"; printf '```\n' >>"$OUT"; }

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: torch does not see a CUDA device (install a CUDA build of torch first)" >&2
    exit 2
fi

# Install asyncdbo without touching the CUDA torch; then the test/bench tools.
"$PY" -m pip install -q -e . --no-deps
"$PY" -m pip install -q numpy uvloop pytest pytest-asyncio pytest-timeout hypothesis matplotlib

{
    echo "# GPU check $(date -u +%Y-%m-%dT%H:%MZ)"
    echo
    echo "Command: \`bash benchmarks/gpu_check.sh\` (commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
} >"$OUT"
section "Machine"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    lscpu | grep -E 'Model name|^CPU\(s\)' || true
    "$PY" -c 'import sys, torch, uvloop; print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda, "| uvloop", uvloop.__version__)'
} 2>&1 | fence

section "CUDA tests (pytest -m cuda)"
set +e
timeout 200 "$PY" -m pytest -m cuda -q -p no:cacheprovider tests/ >"$LOG" 2>&1
rc=$?
set -e
tail -n 25 "$LOG" | fence
echo "pytest exit status: $rc" >>"$OUT"

section "GPU benchmarks"
set +e
timeout 200 "$PY" - >"$LOG" 2>&1 <<'PYEOF'
"""GPU benchmarks for gpu_check.sh (see the header of that script). Legend: T tokens, D hidden."""
import statistics
import time

import torch

import asyncdbo
from asyncdbo import (
    dbo_yield,
    dbo_yield_and_switch_from_comm_to_compute,
    dbo_yield_and_switch_from_compute_to_comm,
    run_ubatches,
)
from asyncdbo._core import get_ubatch

dev = torch.device("cuda")
torch.manual_seed(0)


def device_ms(fn, reps=7):
    """Median device time of fn() in ms (CUDA events around it, synchronized after)."""
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times), min(times), max(times)


# ---------------------------------------------------------------- 1. overlap
LAYERS, T, D = 4, 4096, 4096
w_DD = torch.randn(D, D, device=dev) / D**0.5
x_TD = torch.randn(T, D, device=dev)
pinned = {}


def host_buf(key, like):
    if key not in pinned:
        pinned[key] = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
    return pinned[key]


async def layer_stack(x_TD, ub_key):
    for layer in range(LAYERS):
        h_TD = torch.relu(x_TD @ w_DD) @ w_DD  # compute stream
        await dbo_yield_and_switch_from_compute_to_comm(f"L{layer}:dispatch")
        buf = host_buf((ub_key, x_TD.shape[0]), h_TD)
        buf.copy_(h_TD, non_blocking=True)  # comm stream: device -> host
        back_TD = torch.empty_like(h_TD)
        back_TD.copy_(buf, non_blocking=True)  # comm stream: host -> device
        await dbo_yield_and_switch_from_comm_to_compute(f"L{layer}:combine")
        x_TD = x_TD + back_TD
    return x_TD


def serial():
    asyncdbo.run(lambda: run_ubatches(layer_stack, [(x_TD, "s")], backend="cuda"))


def dbo():
    asyncdbo.run(lambda: run_ubatches(layer_stack, [(x_TD[: T // 2], 0), (x_TD[T // 2 :], 1)], backend="cuda"))


serial(); dbo()  # warm-up
s_med, s_lo, s_hi = device_ms(serial)
d_med, d_lo, d_hi = device_ms(dbo)
print(f"### 1. overlap: {LAYERS} layers, {T} tokens x {D} hidden, fp32; comm = pinned D2H+H2D copy on the comm stream")
print(f"serial {s_med:.2f} ms [{s_lo:.2f}..{s_hi:.2f}], DBO {d_med:.2f} ms [{d_lo:.2f}..{d_hi:.2f}], speedup {s_med / d_med:.2f}x (serial / DBO)")

# ---------------------------------------------------------------- 2. cuda graph
L2, T2, D2 = 8, 64, 256
w2 = torch.randn(D2, D2, device=dev) / 16
xin = [torch.randn(T2, D2, device=dev) for _ in range(2)]
outs = [torch.empty(T2, D2, device=dev) for _ in range(2)]


async def small(i):
    h = xin[i]
    for layer in range(L2):
        h = torch.relu(h @ w2)
        await dbo_yield_and_switch_from_compute_to_comm(f"L{layer}:d")
        h = h * 0.5
        await dbo_yield_and_switch_from_comm_to_compute(f"L{layer}:c")
    outs[i].copy_(h)


def eager():
    asyncdbo.run(lambda: run_ubatches(small, [(0,), (1,)], backend="cuda"))


side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    eager()
torch.cuda.current_stream().wait_stream(side)
want = [o.clone() for o in outs]
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    eager()
e_med, e_lo, e_hi = device_ms(eager, reps=11)
g_med, g_lo, g_hi = device_ms(graph.replay, reps=11)
for o, w in zip(outs, want):
    torch.testing.assert_close(o, w)
t0 = time.perf_counter(); eager(); torch.cuda.synchronize(); eager_host = (time.perf_counter() - t0) * 1e3
print(f"\n### 2. CUDA graph of the interleaved forward: {L2} layers x 2 ubatches, {T2}x{D2}")
print(f"eager DBO {e_med:.3f} ms [{e_lo:.3f}..{e_hi:.3f}] (host wall {eager_host:.2f} ms), graph replay {g_med:.3f} ms [{g_lo:.3f}..{g_hi:.3f}], replay/eager {g_med / e_med:.2f}; outputs equal")

# ---------------------------------------------------------------- 3. switch cost with streams
K = 20000


async def yields(i):
    for _ in range(K):
        await dbo_yield("y")


async def role_switches(i):
    for _ in range(K // 2):
        await dbo_yield_and_switch_from_compute_to_comm("c2m")
        await dbo_yield_and_switch_from_comm_to_compute("m2c")


def per_switch_ns(fn):
    vals = []
    for _ in range(5):
        t0 = time.perf_counter()
        asyncdbo.run(lambda: run_ubatches(fn, [(0,), (1,)], backend="cuda"))
        torch.cuda.synchronize()
        vals.append((time.perf_counter() - t0) / (2 * K) * 1e9)
    return statistics.median(vals), min(vals), max(vals)


y = per_switch_ns(yields)
r = per_switch_ns(role_switches)
print(f"\n### 3. switch cost on the cuda backend, 2 ubatches, host ns per switch (median [min..max] of 5)")
print(f"dbo_yield: {y[0]:.0f} [{y[1]:.0f}..{y[2]:.0f}]; compute<->comm switch (event record + wait_event + set_stream): {r[0]:.0f} [{r[1]:.0f}..{r[2]:.0f}]")

# ---------------------------------------------------------------- 4. deterministic mode
# Serial vs DBO logits of the mini model on one device (EP = 1), deterministic mode off and on:
# is DBO bitwise equal to serial here, and if not, by how much does it differ?
from functools import partial as _partial

from asyncdbo.models import MiniConfig, MiniModel
from asyncdbo.plan import ThresholdConfig
from asyncdbo.runner import BatchBuilder, DBORunner, RunnerConfig

_always = ThresholdConfig(prefill_threshold=0, decode_threshold=0)
print("\n### 4. deterministic mode: serial vs DBO logits, mini model (hidden 256, 8 experts top-2, 2 layers), EP 1")
for _shape in ("prefill", "decode"):
    for _det in (False, True):
        for _ub, _pol in ((2, "role"), (3, "ubatch")):
            _cfg = MiniConfig(num_kv_blocks=512, deterministic=_det)
            _runner = DBORunner(MiniModel(_cfg, device=dev),
                                RunnerConfig(thresholds=_always, num_ubatches=_ub, stream_policy=_pol,
                                             backend="cuda" if dev.type == "cuda" else "host"))
            _builder = BatchBuilder(_cfg.kv_cache_config, device=dev)
            _g = torch.Generator().manual_seed(0)
            if _shape == "prefill":
                _chunks = [(r, torch.randint(0, 1024, (n,), generator=_g).tolist()) for r, n in enumerate((300, 170, 42))]
            else:
                asyncdbo.run(_partial(_runner.step, enabled=False), _builder.build([(r, torch.randint(0, 1024, (40,), generator=_g).tolist()) for r in range(96)]))
                _chunks = [(r, [int(torch.randint(0, 1024, (1,), generator=_g))]) for r in range(96)]
            _batch = _builder.build(_chunks)
            _serial = asyncdbo.run(_partial(_runner.step, enabled=False), _batch).logits_TV
            _builder.reset()
            _batch = _builder.build(_chunks) if _shape == "prefill" else _batch
            _dbo = asyncdbo.run(_runner.step, _batch).logits_TV
            print(f"{_shape}, deterministic={_det}, {_ub} ubatches, {_pol} streams: "
                  f"{'bitwise equal' if torch.equal(_serial, _dbo) else 'differs'}, max |diff| {float((_serial - _dbo).abs().max()):.3g}")
PYEOF
rc=$?
set -e
cat "$LOG" >>"$OUT"
echo >>"$OUT"
echo "GPU benchmark exit status: $rc" >>"$OUT"

section "Switch cost on this host's CPU (asyncdbo bench)"
set +e
timeout 60 "$PY" -m asyncdbo bench --switches 100000 --rounds 5 -n 2 4 2>&1 | fence
set -e

echo "gpu_check: wrote $OUT" >&2
