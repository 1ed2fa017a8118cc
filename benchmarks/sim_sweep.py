"""Predicted DBO gain on H200 specs across tokens per rank and links, beside peers' numbers.

Each point is :func:`asyncdbo.sim.predict.predict`: DeepSeek-V3 (its published config, the
library's MoE layer) on one rank of an EP group, run serially and as 2 DBO ubatches on the
simulated device with the deployment defaults (decode: the ``ll`` schedule and CUDA-graph replay;
prefill: ``ht``, eager; DeepEP kernels; EP 32 over InfiniBand and Ethernet, EP 8 inside one NVLink
node); the speedup is the per-layer ``serial / dbo`` (asyncdbo's one speed convention). The peer numbers are published end-to-end
measurements of SGLang's two-batch overlap on H100 (the sim's calibration and held-out points, see
docs/sim.md), on the plot beside the H200 predictions.

    python benchmarks/sim_sweep.py            # full sweep, a few minutes on 2 cores; writes .md + .png to benchmarks/results
    python benchmarks/sim_sweep.py --quick    # one tiny point, prints only
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True, kw_only=True)
class PeerPoint:
    system: str
    shape: str
    tokens_per_gpu: int
    gain: float
    source: str


# Published, end-to-end, DeepSeek-V3 on H100 over InfiniBand, SGLang two-batch overlap vs off,
# LMSYS blog 2025-05-05 (decode: 9 nodes, EP 72; the threshold lies "between 64 and 128 tokens").
PEERS = [
    PeerPoint(system="SGLang TBO, 72xH100 IB", shape="decode", tokens_per_gpu=32, gain=-0.27, source="LMSYS blog 2025-05-05"),
    PeerPoint(system="SGLang TBO, 72xH100 IB", shape="decode", tokens_per_gpu=256, gain=0.255, source="LMSYS blog 2025-05-05"),
]
PEER_NOTES = [
    "SGLang TBO decode, 72xH100 IB: gains only past a threshold between 64 and 128 tokens/device (LMSYS blog 2025-05-05).",
    "SGLang TBO prefill, 32xH100 IB: +27-35% at equal tokens/device (LMSYS blog 2025-05-05; tokens/device not stated there).",
    "SGLang TBO prefill, AMD MI355X, DeepSeek-V4: +8.5% throughput (SGLang PR #29362).",
    "vLLM DBO: no isolated number published; maintainers expect no speed-up within one node (vLLM #23693).",
]

FULL = {
    "decode_tokens": (32, 64, 128, 256, 512, 1024),
    "decode_links": ("nvlink", "ib400", "eth100"),
    "prefill_tokens": (1024, 4096, 8192),
    "prefill_links": ("ib400",),
}
EP = {"nvlink": 8, "ib400": 32, "eth100": 32}  # NVLink: the EP group inside one node


def sweep(quick: bool, quiet: bool = False) -> list[dict[str, object]]:
    import asyncdbo
    from asyncdbo.sim.predict import Deployment, ModelShape, predict

    if quick:
        model = ModelShape(name="tiny", hidden=128, intermediate=64, experts=8, top_k=2, heads=2, kv_heads=1, head_dim=32,
                           v_head_dim=32, layers=3)
        points = [("decode", 16, "ib400")]
    else:
        model = ModelShape.of("deepseek-v3")
        points = [("decode", t, link) for link in FULL["decode_links"] for t in FULL["decode_tokens"]]
        points += [("prefill", t, link) for link in FULL["prefill_links"] for t in FULL["prefill_tokens"]]
    rows = []
    import _progress

    _progress.start(quiet, "points to simulate (serial and DBO in 2 ubatches each)", len(points))
    for shape, tokens, link in points:
        _progress.step(f"{shape}, {tokens} tokens/rank, {link}")
        t0 = time.perf_counter()
        dep = Deployment(device="h200", link=link, ep=4 if quick else EP[link])
        p = asyncdbo.run(lambda: predict(tokens, model=model, shape=shape, deployment=dep))  # noqa: B023
        rows.append({
            "shape": shape, "tokens": tokens, "link": link, "serial_us": p.serial_layer_s * 1e6, "dbo_us": p.dbo_layer_s * 1e6,
            "gain": p.gain, "hidden": p.hidden_comm_share, "cpu_s": time.perf_counter() - t0,
        })
    _progress.done()
    return rows


def plot(rows: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for (shape, link), marker in zip(sorted({(r["shape"], r["link"]) for r in rows}), "osd^v<>"):
        pts = sorted((r["tokens"], r["gain"]) for r in rows if r["shape"] == shape and r["link"] == link)
        ax.plot([t for t, _ in pts], [1 + g for _, g in pts], marker=marker, label=f"asyncdbo sim: {shape}, H200, {link}")
    for p in PEERS:
        ax.scatter([p.tokens_per_gpu], [1 + p.gain], marker="*", s=180, color="black", zorder=5)
        ax.annotate(f"{p.system} {p.shape}\n{1 + p.gain:.2f}x (measured)", (p.tokens_per_gpu, 1 + p.gain),
                    textcoords="offset points", xytext=(8, -4), fontsize=7)
    ax.axhline(1, color="grey", lw=0.8)  # 1x: DBO as fast as serial
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank (GPU)")
    ax.set_ylabel("speedup, serial / DBO (above 1x: DBO is faster)")
    ax.set_title("Predicted DBO speedup (simulated H200, DeepSeek-V3, 2 ubatches) vs SGLang on H100", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    import _progress

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one tiny point, print only (smoke test)")
    parser.add_argument("--out", type=Path, default=None, help="results folder (default benchmarks/results, not with --quick)")
    _progress.add_quiet_flag(parser)
    args = parser.parse_args(argv)
    logging.getLogger("asyncdbo").setLevel(logging.ERROR)  # the fake EP group's timeout note, once per point
    from _results import results_preamble, results_stem

    lines, info = results_preamble(
        "Simulated DBO gain: H200 specs, tokens per rank x link, beside peers",
        f"python benchmarks/sim_sweep.py{' --quick' if args.quick else ''}",
        machine_label="Machine (runs the simulation; the times are the modeled H200's)",
    )
    t0 = time.perf_counter()
    rows = sweep(args.quick, args.quiet)
    lines.append(
        "Model: DeepSeek-V3 (`ModelShape.of(\"deepseek-v3\")`: hidden 7168, 256 experts of 2048, top-8, 1 shared, "
        "MLA, FP8 weights), `Deployment` defaults on H200 (decode: ll schedule, graph replay, 2000 cached tokens per "
        "request; prefill: ht schedule, eager, 4096-token prompts; DeepEP kernels), EP 32 (EP 8 on NVLink), 2 ubatches, "
        "role streams. Times are per MoE layer in steady state (the middle of 3 simulated layers).\n"
    )
    lines += ["| shape | tokens/rank | link | serial us/layer | DBO us/layer | speedup | comm hidden (DBO) | DBO split |",
              "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['tokens']} | {r['link']} | {r['serial_us']:.1f} | {r['dbo_us']:.1f} | "
            f"{1 + r['gain']:.2f}x | {r['hidden']:.0%} | 2 ubatches (predict always splits) |"
        )
    lines += ["", "Published peer numbers (measured end to end on real clusters, other systems):", ""]
    lines += [f"- {p.system}, {p.shape}, {p.tokens_per_gpu} tokens/GPU: {1 + p.gain:.2f}x ({p.gain:+.1%} as published; {p.source})"
              for p in PEERS]
    lines += [f"- {n}" for n in PEER_NOTES]
    lines.append(f"\nTotal sweep time {time.perf_counter() - t0:.0f} s.")
    out = args.out if args.out is not None else (None if args.quick else RESULTS)
    if out is not None:
        stem = results_stem(out, "sim_sweep", info)
        png = stem.with_suffix(".png")
        plot(rows, png)
        lines.append(f"\n![predicted gain vs peers]({png.name})")
    text = "\n".join(lines) + "\n"
    print(text)
    if out is not None:
        stem.with_suffix(".md").write_text(text)
        print(f"wrote {stem.with_suffix('.md')} and {png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
