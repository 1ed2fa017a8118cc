"""Published measurements the sim is calibrated on and checked against, with their sources.

Nothing here is a prediction: every number is copied from a public source named next to it.
:mod:`asyncdbo.sim.comm` fits its DeepEP parameters to :data:`DEEPEP_LL` and
:data:`DEEPEP_NORMAL`; :mod:`asyncdbo.sim.calibration` compares predictions with
:data:`END_TO_END` (some points calibrate, the others are held out).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEEPEP_LL", "DEEPEP_NORMAL", "END_TO_END", "DeepEPLatency", "EndToEnd"]

DEEPEP_SOURCE = "deepseek-ai/DeepEP docs/legacy.md (V1 performance tables, H800 + CX7 400 Gb/s)"


@dataclass(frozen=True)
class DeepEPLatency:
    """One row of DeepEP's low-latency table: 128 tokens per rank, hidden 7168, top-8, FP8
    dispatch (7168 bytes + one float32 scale per 128 values) and BF16 combine, pure RDMA."""

    ep: int
    dispatch_us: float
    combine_us: float


#: DeepEP V1 low-latency kernels (``DEEPEP_SOURCE``).
DEEPEP_LL: tuple[DeepEPLatency, ...] = (
    DeepEPLatency(8, 77, 114),
    DeepEPLatency(16, 118, 195),
    DeepEPLatency(32, 155, 273),
    DeepEPLatency(64, 173, 314),
    DeepEPLatency(128, 192, 369),
    DeepEPLatency(256, 194, 360),
)
LL_TOKENS, LL_HIDDEN, LL_TOP_K = 128, 7168, 8

#: DeepEP V1 normal kernels: (link, achieved GB/s per direction, the link's peak GB/s in that
#: test): intranode NVLink on H800 (dispatch 153, combine 158; H800 NVLink is 400 GB/s
#: bidirectional), internode RDMA at EP16/32/64 (43/43, 58/57, 51/50; CX7 400 Gb/s = 50 GB/s).
DEEPEP_NORMAL: dict[str, tuple[tuple[float, ...], float]] = {
    "nvlink": ((153.0, 158.0), 200.0),
    "ib400": ((43.0, 43.0, 58.0, 57.0, 51.0, 50.0), 50.0),
}


@dataclass(frozen=True, kw_only=True)
class EndToEnd:
    """A published end-to-end DBO/TBO gain (throughput with / without - 1) and the deployment it
    was measured on. ``gain`` is a point, or ``(low, high)`` for a published range or bound
    (``None`` for an open end). ``use``: ``calibrate`` or ``held-out``."""

    label: str
    system: str
    source: str
    use: str
    model: str
    shape: str  # "decode" | "prefill"
    tokens: int  # per rank (GPU/NPU)
    context: int  # decode: cached tokens per request; prefill: prompt length
    device: str
    link: str
    ep: int
    gpus_per_node: int
    schedule: str  # the asyncdbo schedule that issues comm the way the system does
    comm: str  # sim comm preset
    host: str  # sim host preset
    weights: str  # "fp8" | "int8" | "bf16"
    gain: float | tuple[float | None, float | None]
    experts: int | None = None  # physical experts when the deployment added redundant ones
    spec_tokens: int = 0  # decode: draft tokens per request (MTP), each request 1 + spec_tokens tokens a step
    baseline_tokens: int | None = None  # the baseline ran a different batch: compare throughput per token


_SGLANG = "LMSYS blog 2025-05-05, 'Deploying DeepSeek with PD Disaggregation and Large-scale EP on 96 H100 GPUs'"
_SGL_DECODE = dict(system="SGLang TBO decode, DeepSeek-V3, 9x8 H100 + IB (EP72), DeepEP low-latency, CUDA graphs",
                   source=_SGLANG, model="deepseek-v3", shape="decode", context=2000, device="h100", link="ib400",
                   ep=72, gpus_per_node=8, schedule="ll", comm="deepep", host="graph", weights="fp8",
                   experts=288)  # 256 + 32 redundant experts (EPLB): 4 per GPU
# SGLang's "simulated MTP": "we firstly double the batch size and halve the Key-Value KV cache length
# to maintain the same workload for GroupedGeMM computation and memory access ... insert dummy kernels
# after the real attention computation to ensure the attention phase takes the same time as in
# DeepSeek's profile"; its decode table: batch 128, KV cache length 4,000, 9 nodes.
_SGL_MTP = dict(_SGL_DECODE, context=4000)
_SGL_PREFILL = dict(system="SGLang TBO prefill, DeepSeek-V3, 4x8 H100 + IB (EP32), DeepEP normal, eager",
                    source=_SGLANG, model="deepseek-v3", shape="prefill", context=4096, device="h100", link="ib400",
                    ep=32, gpus_per_node=8, schedule="ht", comm="deepep", host="eager", weights="fp8")

#: End-to-end gains. SGLang's decode curve (the blog: "a threshold between 64 and 128 tokens",
#: -27% at 32, +25.5% at 256) calibrates; SGLang's prefill (+27% to +35% at equal tokens per
#: device, 4096-token prompts; +40.5% for TBO at 16,384 tokens per device against the best
#: configuration without it, which ran out of memory at 16,384 and so ran 8,192), SGLang's
#: simulated-MTP decode (128 requests making 256 tokens a step, KV cache length 4,000: 17,552
#: against 12,929 tokens/s) and vllm-ascend's 910B prefill (PR #941: QPS 0.90 -> 1.01 on
#: TP16/EP16, DeepSeek-R1 W8A8, 4k input) are held out.
END_TO_END: tuple[EndToEnd, ...] = (
    EndToEnd(label="SGLang decode 32", tokens=32, use="calibrate", gain=-0.27, **_SGL_DECODE),  # type: ignore[arg-type]
    EndToEnd(label="SGLang decode 64", tokens=64, use="calibrate", gain=(None, 0.0), **_SGL_DECODE),  # type: ignore[arg-type]
    EndToEnd(label="SGLang decode 128", tokens=128, use="calibrate", gain=(0.0, None), **_SGL_DECODE),  # type: ignore[arg-type]
    EndToEnd(label="SGLang decode 256", tokens=256, use="calibrate", gain=0.255, **_SGL_DECODE),  # type: ignore[arg-type]
    EndToEnd(label="SGLang prefill 4096", tokens=4096, use="held-out", gain=(0.27, 0.35), **_SGL_PREFILL),  # type: ignore[arg-type]
    EndToEnd(label="SGLang prefill 8192", tokens=8192, use="held-out", gain=(0.27, 0.35), **_SGL_PREFILL),  # type: ignore[arg-type]
    EndToEnd(label="SGLang prefill 16384 vs 8192", tokens=16384, baseline_tokens=8192, use="held-out",
             gain=0.405, **_SGL_PREFILL),  # type: ignore[arg-type]
    EndToEnd(label="SGLang decode MTP 256", tokens=256, spec_tokens=1, use="held-out",
             gain=17552 / 12929 - 1.0, **_SGL_MTP),  # type: ignore[arg-type]
    EndToEnd(
        label="vllm-ascend prefill", system="vllm-ascend DBO prefill, DeepSeek-R1 W8A8, 910B TP16/EP16 (2 nodes), HCCL",
        source="vllm-project/vllm-ascend PR #941 (prefill QPS 0.90 -> 1.01)", use="held-out", model="deepseek-v3",
        shape="prefill", tokens=4096, context=4096, device="ascend910b", link="roce200", ep=16, gpus_per_node=8,
        schedule="ht", comm="a2a", host="eager", weights="int8", gain=1.01 / 0.90 - 1.0,
    ),
)
