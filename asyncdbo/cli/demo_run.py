"""One rank of ``asyncdbo demo`` (:func:`demo_rank`: each step serial, then DBO), and the table
made of every rank's numbers (:func:`summarize`, :func:`passed`, the report)."""

from __future__ import annotations

import logging
import math
import os
import statistics
import sys
from dataclasses import asdict
from typing import Any

import torch

from .demo_config import MATCH_ATOL, DemoConfig
from .reasons import REASON_WORDS, plural

__all__ = ["decode_chunks", "demo_rank", "error_line", "passed", "prefill_chunks", "split_note", "summarize"]

logger = logging.getLogger("asyncdbo.cli.demo")


def prefill_chunks(cfg: DemoConfig, rank: int, step: int, vocab: int) -> list[tuple[int, list[int]]]:
    """The demo's prefill step ``step`` on ``rank``: ``cfg.tokens`` new tokens in 1-4 requests of
    uneven, seeded lengths, as ``(request id, token ids)`` for ``BatchBuilder.build``."""
    g = torch.Generator().manual_seed(cfg.seed * 100003 + rank * 1009 + step)
    num_reqs = min(cfg.tokens, int(torch.randint(1, 5, (1,), generator=g)))
    cuts = sorted(torch.randperm(cfg.tokens - 1, generator=g)[: num_reqs - 1].add(1).tolist()) if num_reqs > 1 else []
    bounds = [0, *cuts, cfg.tokens]
    ids = torch.randint(0, vocab, (cfg.tokens,), generator=g).tolist()
    return [(step * 1000 + r, ids[bounds[r] : bounds[r + 1]]) for r in range(num_reqs)]


def decode_chunks(cfg: DemoConfig, rank: int, step: int, vocab: int, length: int) -> list[tuple[int, list[int]]]:
    """The demo's decode step ``step`` on ``rank``: ``cfg.tokens`` requests of ``length`` seeded
    tokens each (``length`` > 1 with ``step = -1`` fills their context first)."""
    g = torch.Generator().manual_seed(cfg.seed * 100003 + rank * 1009 + step)
    ids = torch.randint(0, vocab, (cfg.tokens, length), generator=g).tolist()
    return [(r, ids[r]) for r in range(cfg.tokens)]


async def _demo_rank_async(rank: int, world: int, cfg: DemoConfig, device: torch.device) -> dict[str, Any]:
    import torch.distributed as dist

    from ..models import MiniModel
    from ..observe import Tracer
    from ..plan import ThresholdConfig
    from ..serving import BatchBuilder, DBORunner, RunnerConfig

    group = dist.group.WORLD if dist.is_initialized() and world > 1 else None
    mcfg = cfg.model_config()
    model = MiniModel(mcfg, ep_group=group, max_ubatches=max(cfg.ubatches, 2), device=device)
    runner = DBORunner(
        model,
        RunnerConfig(num_ubatches=cfg.ubatches, stream_policy=cfg.stream_policy,  # type: ignore[arg-type]
                     thresholds=ThresholdConfig(prefill_threshold=cfg.prefill_threshold,
                                                decode_threshold=cfg.decode_threshold),
                     backend="host" if cfg.link else "auto", link=cfg.link_spec(), watchdog_s=cfg.timeout_s),
        dp_group=group,
        device=device,
    )
    builder = BatchBuilder(mcfg.kv_cache_config, device=device, vocab_size=mcfg.vocab_size)  # ids checked on the host

    def barrier() -> None:
        if group is not None:
            dist.barrier()

    if cfg.shape == "decode":  # fill every request's context once, untimed
        await runner.step(builder.build(decode_chunks(cfg, rank, -1, mcfg.vocab_size, cfg.context)), enabled=False)
    from ..moe.batch_invariant import is_deterministic

    out: dict[str, Any] = {"rank": rank, "serial": [], "dbo": [], "max_abs_diff": 0.0, "trace": None, "bitwise": True,
                           "deterministic": is_deterministic(mcfg.deterministic, torch.empty(0, device=device))}
    for i in range(cfg.warmup + cfg.steps):
        if cfg.shape == "prefill":
            builder.reset()
            batch = builder.build(prefill_chunks(cfg, rank, i, mcfg.vocab_size))
        else:
            batch = builder.build(decode_chunks(cfg, rank, i, mcfg.vocab_size, 1))
        last = i == cfg.warmup + cfg.steps - 1
        if cfg.progress and rank == 0:
            _show_step(i, cfg)
        results = {}
        for mode in ("serial", "dbo"):
            tracer = Tracer(rank=rank)
            barrier()
            res = await runner.step(batch, enabled=(mode == "dbo"), instrument=tracer)
            results[mode] = res
            if i >= cfg.warmup:
                n = tracer.numbers()
                out[mode].append({
                    "step_s": res.step_s, "comm_s": n.comm_s, "hidden_share": n.comm_hidden_share,
                    "hidden_by_other_share": n.comm_hidden_by_other_share,
                    "idle_s": n.idle_s, "switches": n.switches, "reason": res.record.reason.value,
                    "detail": res.record.detail, "ubatch_tokens": list(res.record.ubatch_num_tokens),
                    "messages": len(res.comm), "fused": any(c.what == "dispatch+counts" for c in res.comm),
                })
            if last and mode == "dbo" and cfg.trace:
                out["trace"] = tracer.to_chrome()
                out["trace"]["otherData"]["asyncdbo"]["title"] = (
                    f"asyncdbo demo: step {i + 1} of {cfg.warmup + cfg.steps} ({cfg.warmup} warm-up + {cfg.steps} "
                    f"timed), its DBO run (each step runs serial, then DBO)")
        diff = (results["serial"].logits_TV - results["dbo"].logits_TV).abs().max().item() if batch.num_tokens else 0.0
        # NaN stays NaN (max(0.0, nan) is 0.0: asyncdbo.models.hf.generate.worst_diff says why)
        out["max_abs_diff"] = diff if math.isnan(diff) else max(out["max_abs_diff"], diff)
        out["bitwise"] &= torch.equal(results["serial"].logits_TV, results["dbo"].logits_TV)
    return out


def _show_step(i: int, cfg: DemoConfig) -> None:
    """Rank 0's status line, counted as the user counts (1..N; warm-up steps first, as in the
    header), rewritten in place; the launcher erases it before printing the table."""
    kind = "warm-up" if i < cfg.warmup else "timed"
    sys.stderr.write(f"\r\033[K[{i + 1}/{cfg.warmup + cfg.steps}] step {i + 1} ({kind}): serial, then DBO ...")
    sys.stderr.flush()


def demo_rank(rank: int, world: int, cfg: DemoConfig) -> dict[str, Any]:
    """The work of one rank, for either launcher: the process group is already initialised.
    ``kill -USR1 <pid>`` of a rank prints its ubatches' await chains (it keeps running)."""
    from ..dbo import run
    from ..observe import install_stack_dump_signal

    install_stack_dump_signal()

    device = torch.device("cpu")
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    return run(_demo_rank_async, rank, world, cfg, device, loop=cfg.loop)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ report
def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def summarize(cfg: DemoConfig, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over steps of the slowest rank's step time; comm numbers averaged over ranks."""
    summary: dict[str, Any] = {
        "max_abs_diff": max(r["max_abs_diff"] for r in per_rank),
        "bitwise": all(r["bitwise"] for r in per_rank),
        "deterministic": all(r["deterministic"] for r in per_rank),
    }
    for mode in ("serial", "dbo"):
        steps = list(zip(*(r[mode] for r in per_rank)))  # per step: one entry per rank
        summary[mode] = {
            "step_s": _median([max(e["step_s"] for e in s) for s in steps]),
            "comm_s": _median([statistics.fmean(e["comm_s"] for e in s) for s in steps]),
            "hidden_share": _median([statistics.fmean(e["hidden_share"] for e in s) for s in steps]),
            "hidden_by_other_share": _median([statistics.fmean(e["hidden_by_other_share"] for e in s) for s in steps]),
            "switches": _median([statistics.fmean(e["switches"] for e in s) for s in steps]),
            "messages": _median([statistics.fmean(e.get("messages", 0) for e in s) for s in steps]),
            # steps in which the MoE dispatches went fused (on rank 0: every rank chooses alike)
            "fused_steps": sum(bool(s[0].get("fused", False)) for s in steps),
            "steps": len(steps),
            "reasons": sorted({(e["reason"], e["detail"]) for s in steps for e in s}),
            "ubatch_tokens": [r[mode][-1]["ubatch_tokens"] for r in per_rank] if steps else [],
        }
    # DBO steps that microbatched: a step counts when it did on every rank (DP agreement makes the
    # ranks agree; a rank that did not is what a rank_declined step reports).
    dbo_steps = list(zip(*(r["dbo"] for r in per_rank)))
    summary["microbatched_steps"] = sum(all(e["reason"] == "microbatched" for e in s) for s in dbo_steps)
    # The speed convention everywhere in asyncdbo's output: speedup = serial time / DBO time.
    # Over steps none of which microbatched it would compare two serial runs: noise, not a result.
    summary["speedup"] = (summary["serial"]["step_s"] / summary["dbo"]["step_s"]
                          if summary["dbo"]["step_s"] and summary["microbatched_steps"] else None)
    # Its spread: step i serial against step i DBO (slowest rank each), over the steps that microbatched.
    paired = [max(e["step_s"] for e in ser) / max(e["step_s"] for e in dbo)
              for ser, dbo in zip(zip(*(r["serial"] for r in per_rank)), dbo_steps)
              if all(e["reason"] == "microbatched" for e in dbo) and max(e["step_s"] for e in dbo) > 0]
    summary["speedup_range"] = (min(paired), max(paired)) if paired else None
    return summary


def _reason_words(reason: str, cfg: DemoConfig) -> str:
    """A fall-out reason in words, once; below a threshold with the threshold, its flag and the
    value that would split the demo's batch (every rank has ``--tokens`` tokens)."""
    if reason != "below_threshold":
        return REASON_WORDS.get(reason, reason)
    flag, threshold = (("--decode-threshold", cfg.decode_threshold) if cfg.shape == "decode" else
                       ("--prefill-threshold", cfg.prefill_threshold))
    return (f"every rank's batch was below the threshold: a rank splits a {cfg.shape} batch from "
            f"{plural(threshold, 'token')} up ({flag} {threshold}), and each rank had {plural(cfg.tokens, 'token')}; "
            f"{flag} {cfg.tokens} would split them")


def split_note(s: dict[str, Any]) -> str:
    """What the DBO column summarizes, for the lines that show a speedup or an overlap share."""
    n, total = s["microbatched_steps"], s["dbo"]["steps"]
    if n == 0:
        return f"no speedup: none of the {total} DBO steps microbatched (see 'DBO steps' below), DBO ran serially"
    return f"DBO microbatched {'all' if n == total else n} of {total} steps"


def spread_note(s: dict[str, Any]) -> str:
    """The speedup's sample count and spread: one step is a single sample, more give the range of
    the per-step speedups (serial step i / DBO step i) around the medians' ratio."""
    rng, n = s.get("speedup_range"), s["microbatched_steps"]
    if rng is None:
        return ""
    if n == 1:
        return "; one step: a single sample"
    return f"; medians of {n} steps, per-step speedups {rng[0]:.2f}-{rng[1]:.2f}x"


def passed(s: dict[str, Any]) -> bool:
    """Serial and DBO agree: bit for bit in deterministic mode, else within MATCH_ATOL."""
    return bool(s["bitwise"]) if s["deterministic"] else s["max_abs_diff"] <= MATCH_ATOL


def _dispatch_line(modeled: bool, ser: dict[str, Any], dbo: dict[str, Any]) -> str:
    """How the MoE layers sent the per-expert counts (RunnerConfig.dispatch="auto": fused where
    asyncdbo.dist.choose_dispatch prices one message below two, never for the ht schedule with 2
    ubatches)."""
    if not modeled:
        return "MoE dispatch: split (counts, then tokens); with no link model to price it, never fused"

    def said(m: dict[str, Any]) -> str:
        if m["fused_steps"] == 0:
            return "split"
        return "fused" if m["fused_steps"] == m["steps"] else f"fused in {m['fused_steps']} of {m['steps']} steps"

    return (f"MoE dispatch, chosen per step from the link model and the schedule: serial {said(ser)}, DBO {said(dbo)} "
            "(fused: the counts ride in the token message; split: counts, then tokens)")


#: Rows whose DBO figure depends on whether the steps microbatched: they say how many did.
_SPLIT_ROWS = ("speedup", "  by the other ubatch")


def _format(cfg: DemoConfig, s: dict[str, Any]) -> str:
    spec = cfg.link_spec()
    if spec is None:
        comm = "comm: real gloo all-to-all over loopback (it shares the CPU with compute)"
    else:
        comm = (f"comm: MODELED LINK {cfg.link} x{cfg.link_scale:g} ({spec.latency_s * 1e6:g} us + "
                f"{spec.bandwidth_Bps / 1e6:g} MB/s per message; the real all-to-all runs, its "
                f"completion is released on the modeled link)")

    ser, dbo = s["serial"], s["dbo"]
    def own(m: dict[str, Any]) -> str:
        return f"{max(0.0, m['hidden_share'] - m['hidden_by_other_share']):.0%}"

    rows = [
        ("", "serial", "DBO"),
        ("step time (median)", f"{ser['step_s'] * 1e3:.2f} ms", f"{dbo['step_s'] * 1e3:.2f} ms"),
        ("speedup", "", "-" if s["speedup"] is None else f"{s['speedup']:.2f}x"),
        ("time in comm", f"{ser['comm_s'] * 1e3:.2f} ms", f"{dbo['comm_s'] * 1e3:.2f} ms"),
        ("comm hidden", f"{ser['hidden_share']:.0%}", f"{dbo['hidden_share']:.0%}"),
        ("  by the other ubatch", f"{ser['hidden_by_other_share']:.0%}", f"{dbo['hidden_by_other_share']:.0%}"),
        ("  by its own ubatch", own(ser), own(dbo)),
        ("yields / step", f"{ser['switches']:g}", f"{dbo['switches']:g}"),
        ("messages / step", *(f"{m['messages']:g}" if m["messages"] else "-" for m in (ser, dbo))),
    ]
    fell_back = [(r, d) for r, d in dbo["reasons"] if r != "microbatched"]
    if not fell_back:
        sizes = " ".join(str(t) for t in dbo["ubatch_tokens"])
        why = f"DBO steps: microbatched, every step on every rank (real tokens per ubatch by rank: {sizes})"
    else:
        which = "any step" if not s["microbatched_steps"] else "some steps"
        why = f"DBO steps: NOT microbatched in {which}: " + "; ".join(
            _reason_words(r, cfg) for r in sorted({r for r, _ in fell_back}))
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [
        (f"asyncdbo demo: {plural(cfg.ranks, 'rank')} x {plural(cfg.tokens, 'token')} ({cfg.shape}), "
        f"{plural(cfg.layers, 'layer')}, {plural(cfg.experts, 'expert')} top-{cfg.top_k}, hidden {cfg.hidden}, "
        f"schedule {cfg.schedule}, stream policy {cfg.stream_policy}, {plural(cfg.ubatches, 'ubatch', 'ubatches')}, "
        f"loop {cfg.loop}, {plural(cfg.steps, 'step')} after {cfg.warmup} warm-up"),
        comm,
        "",
        *(f"  {a:<{w0}}  {b:>{w1}}  {c:>{w1}}" + (f"  ({split_note(s)}{spread_note(s) if a == 'speedup' else ''})"
                                                   if a in _SPLIT_ROWS else "")
          for a, b, c in rows),
        "",
        "speedup = serial step time / DBO step time (above 1x: DBO is faster)",
        "comm hidden: share of comm time during which some ubatch computed; by the other ubatch: the overlap DBO adds;",
        "  by its own ubatch: the shared expert, which runs while its own combine is in flight, with or without DBO",
        "messages: the all-to-alls a rank issued per step (per MoE layer and ubatch: counts, dispatch, combine;",
        "  a fused dispatch sends the counts with the tokens); - where the backend tracks none (accelerators)",
        "serial steps: one batch per rank (DBO off), run as a single ubatch on the same backend",
        why,
        _dispatch_line(spec is not None, ser, dbo),
    ]
    if s["deterministic"]:
        verdict = "bitwise equal" if s["bitwise"] else "MISMATCH: deterministic mode promises bitwise equality"
        rule = "deterministic mode"
    else:
        verdict = "bitwise equal" if s["bitwise"] else ("match" if passed(s) else "MISMATCH")
        rule = f"tolerance {MATCH_ATOL:g}, deterministic mode off"
    lines.append(f"outputs serial vs DBO: max |logits diff| = {s['max_abs_diff']:.3g} ({verdict}; {rule})")
    return "\n".join(lines)


def _report(cfg: DemoConfig, per_rank: list[dict[str, Any]]) -> int:
    s = summarize(cfg, per_rank)
    if cfg.progress:  # erase rank 0's status line (torchrun: this process is rank 0)
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()
    print(_format(cfg, s))
    if cfg.trace:
        import json

        from ..observe import write_traces

        paths = write_traces(cfg.trace, [r["trace"] for r in per_rank if r["trace"] is not None])
        paths.append(os.path.join(cfg.trace, "numbers.json"))
        with open(paths[-1], "w", encoding="utf-8") as f:
            json.dump({"config": asdict(cfg), "summary": s}, f, indent=1, default=str)
        print(f"trace of the last DBO step (open the JSON in ui.perfetto.dev): {', '.join(paths)}")
    return 0 if passed(s) else 1


def error_line(details: str) -> str:
    """The exception line of a rank's traceback text (its last unindented ``Name: message`` line,
    which for a multi-line message such as a deadlock report is not the text's last line)."""
    lines = [ln for ln in details.strip().splitlines() if ln and not ln[0].isspace()]
    for ln in reversed(lines):
        head = ln.split(":", 1)[0]
        if ":" in ln and " " not in head and not ln.startswith("Traceback"):
            return ln
    return lines[-1] if lines else details.strip()
