"""Comparing an :class:`~asyncdbo.serving.Engine`'s modes (serial, DBO, auto) on the same steps.

An engine admits a request once its clock reaches the request's arrival time. On a wall clock
the steps of a slower mode last longer, so more requests have arrived at each admission and the
two runs batch the trace differently: serial, DBO and auto then run different numbers of steps,
and their tokens/s compare different work. :class:`StepClock` moves a fixed
time per engine step instead, so each arrival lands on the same step in every mode and the runs
take the same steps with the same tokens; each step's own time is still measured
(``EngineReport.step_s``, ``time.perf_counter`` around the step). :func:`compare_modes` checks
that two reports ran the same steps, says where they part if not, and compares their step times
with the sample count and the spread (speedup = base / other, as everywhere in asyncdbo).
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .requests import EngineReport

__all__ = ["ModeComparison", "StepClock", "compare_modes"]


class StepClock:
    """An engine clock that moves ``step_s`` seconds per engine step (pass the same one kind to
    every mode: ``Engine(..., clock=c, sleep=c.sleep)`` with ``c = StepClock()`` per run).

    The engine reads its clock twice per step (before admission, after sampling: the Engine's
    module docstring), so each read moves ``step_s / 2``; an idle wait for the next arrival
    moves it by the wait. A request arriving at ``t`` is therefore admitted at the same step in
    every run, whatever that run's steps cost."""

    def __init__(self, step_s: float = 0.01) -> None:
        if isinstance(step_s, bool) or not isinstance(step_s, (int, float)) or not (0 < step_s < math.inf):
            raise ValueError(f"StepClock step_s must be a finite number of seconds > 0 (got {step_s!r}); "
                             "e.g. StepClock(step_s=0.01)")
        self.step_s = float(step_s)
        self.t = 0.0

    def __call__(self) -> float:
        self.t += self.step_s / 2
        return self.t

    async def sleep(self, dt: float) -> None:
        """The engine's idle wait: no wall time passes, the clock jumps (the loop still runs once)."""
        self.t += max(0.0, dt)
        await asyncio.sleep(0)


def _ms(xs: Sequence[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.2f} ms [{min(xs) * 1e3:.2f}..{max(xs) * 1e3:.2f}]"


@dataclass(frozen=True)
class ModeComparison:
    """Two engine runs of one trace (:func:`compare_modes`). ``same_steps``: both ran the same
    number of steps with the same real tokens in each (``reason`` says where they part if not);
    ``base_s``/``other_s``: each step's measured seconds."""

    names: tuple[str, str]
    reason: str  # "" where the runs took the same steps
    base_s: tuple[float, ...]
    other_s: tuple[float, ...]
    output_tokens: tuple[int, int] = (0, 0)  # each run's output tokens

    @property
    def same_steps(self) -> bool:
        return not self.reason

    @property
    def tokens_per_s(self) -> tuple[float, float]:
        """Each run's output tokens over its steps' measured time (not over its clock's makespan,
        which a :class:`StepClock` makes a count of steps)."""
        return tuple(n / sum(t) if sum(t) > 0 else 0.0  # type: ignore[return-value]
                     for n, t in zip(self.output_tokens, (self.base_s, self.other_s)))

    @property
    def speedup(self) -> float:
        """Base over other, total step time over the same steps (nan unless ``same_steps``)."""
        if not self.same_steps or not self.other_s or sum(self.other_s) <= 0:
            return math.nan
        return sum(self.base_s) / sum(self.other_s)

    @property
    def step_ratios(self) -> tuple[float, ...]:
        """Base over other, step by step (empty unless ``same_steps``)."""
        if not self.same_steps:
            return ()
        return tuple(b / o for b, o in zip(self.base_s, self.other_s) if o > 0)

    def summary(self) -> str:
        a, b = self.names
        if not self.same_steps:
            return f"{a} and {b} not compared: {self.reason}"
        n, ratios = len(self.base_s), self.step_ratios
        if n == 0:
            return f"{a} and {b} ran no steps"
        per_step = (f"per-step {a} / {b}: median {statistics.median(ratios):.2f}x [{min(ratios):.2f}..{max(ratios):.2f}]"
                    if ratios else "no step had a measurable time")
        ta, tb = self.tokens_per_s
        return (f"{a} vs {b} on the same {n} step{'s' if n != 1 else ''} (the same tokens in each): step time {_ms(self.base_s)} "
                f"vs {_ms(self.other_s)} (median [min..max] of {n}); speedup {a} / {b} {self.speedup:.2f}x over "
                f"their total; {per_step}; output tokens per second of step time {ta:.1f} vs {tb:.1f}. One run of "
                "each: repeat the pair to see the spread between runs")


#: Why two runs of one trace batch it differently, and the fix.
_WHY = ("the engine admits a request when its clock reaches the request's arrival, and on a wall clock a mode whose "
        "steps take longer admits more requests per step: give each run Engine(clock=c, sleep=c.sleep) with its own "
        "c = StepClock(), and the same max_num_seqs and KV cache")


def _tokens(report: EngineReport) -> list[int]:
    return [sum(rec.ubatch_num_tokens) for rec in report.records]


def compare_modes(base: EngineReport, other: EngineReport, *, names: tuple[str, str] = ("serial", "DBO")
                  ) -> ModeComparison:
    """Compare two runs of one trace (e.g. ``enabled=False`` and ``True``) step by step.

    They compare only when they ran the same steps: the same number, each with the same real
    tokens. Otherwise the result says where they part and why that happens (a wall clock: use a
    :class:`StepClock`), and its speedup is nan rather than a ratio of different work."""
    ta, tb = _tokens(base), _tokens(other)
    a, b = names
    reason = ""
    if len(base.step_s) != len(ta) or len(other.step_s) != len(tb):
        reason = "a report holds only its last keep_records steps; raise Engine(keep_records=...) above the run's steps"
    elif len(ta) != len(tb):
        reason = f"{a} ran {len(ta)} steps and {b} {len(tb)}, so they batched the trace differently; {_WHY}"
    elif (k := next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)) is not None:
        reason = f"step {k} ran {ta[k]} tokens under {a} and {tb[k]} under {b}, so they batched the trace differently; {_WHY}"
    return ModeComparison(names=names, reason=reason, base_s=tuple(base.step_s),
                          other_s=tuple(other.step_s), output_tokens=(base.output_tokens, other.output_tokens))
