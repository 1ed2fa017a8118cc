"""Greedy generation through the runner, and its parity with the transformers forward.

:func:`greedy_generate` runs one rank's requests: a prefill step with every prompt, then decode
steps of one token per request, each token the argmax of the previous step's last logits.  Every
rank of the DP group must call it with the same number of decode steps (an idle rank passes no
prompts and still joins every step).  It can drive several runners in lockstep over the same
batches (serial and DBO, each on its own model and KV cache): the tokens fed come from the first
runner, and each runner records its own logits and argmax tokens, so their steps are timed back to
back on the same inputs.

:func:`compare_with_hf` scores a generation against transformers' own forward over each request's
fed tokens: the largest logits difference and how many greedy tokens agree.
"""

# Shape legend: S = tokens fed for one request, V = vocab.

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...plan import StepRecord
from ...serving.sampling import NonFiniteLogitsError, finite_rows

__all__ = ["Generation", "Parity", "compare_with_hf", "greedy_generate", "worst_diff"]


@dataclass(frozen=True)
class Generation:
    """One runner's side of a greedy generation on one rank.

    ``fed[r]``: the tokens request ``r`` fed (prompt, then one per decode step); ``logits[r]``:
    ``[S, V]``, one row per fed token; ``greedy[r]``: the argmax of each step's last row (so
    ``greedy[r][:-1] == fed[r][len(prompt):]`` for the runner that fed them)."""

    fed: dict[int, list[int]] = field(default_factory=dict)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    greedy: dict[int, list[int]] = field(default_factory=dict)
    step_s: list[float] = field(default_factory=list)
    records: list[StepRecord] = field(default_factory=list)
    switches: list[int] = field(default_factory=list)


async def greedy_generate(runners: Sequence[tuple[Any, bool]], builder: Any, prompts: Mapping[int, Sequence[int]],
                          *, decode_steps: int, barrier: Any = None,
                          on_step: Callable[[int, int], None] | None = None) -> list[Generation]:
    """Run ``prompts`` (request id -> token ids) for a prefill and ``decode_steps`` decode steps
    on every ``(runner, enabled)`` in lockstep (module docstring).  ``builder`` is the
    :class:`~asyncdbo.serving.BatchBuilder` of the runners' KV caches (all alike: one batch serves
    each).  ``barrier`` (a callable) runs before each runner's step, e.g. to line ranks up for
    timing.  ``on_step(i, n)`` is called before step ``i`` (0: the prefill) of ``n = decode_steps + 1``
    (a progress line's hook)."""
    if decode_steps < 0:
        raise ValueError(f"decode_steps must be >= 0 (got {decode_steps})")
    gens = [Generation() for _ in runners]
    for gen in gens:
        for r, prompt in prompts.items():
            gen.fed[r], gen.greedy[r] = list(prompt), []
    chunks = [(r, list(p)) for r, p in prompts.items()]
    for step in range(decode_steps + 1):
        if on_step is not None:
            on_step(step, decode_steps + 1)
        batch = builder.build(chunks)
        for (runner, enabled), gen in zip(runners, gens):
            if barrier is not None:
                barrier()
            t0 = time.perf_counter()
            res = await runner.step(batch, enabled=enabled)
            gen.step_s.append(time.perf_counter() - t0)
            gen.records.append(res.record)
            gen.switches.append(res.num_switches)
            last_R = torch.tensor([len(toks) for _, toks in chunks], dtype=torch.int64).cumsum(0) - 1
            bad = (~finite_rows(res.logits_TV[last_R.to(res.logits_TV.device)].float())).nonzero().flatten().tolist()
            if bad:  # an argmax over NaN is token 0: never a token
                raise NonFiniteLogitsError(
                    f"step {step} ({'serial' if not enabled else 'DBO'}): the last logits rows of requests "
                    f"{[chunks[i][0] for i in bad]} hold NaN or +inf (or only -inf); no greedy token is taken from them")
            offset = 0
            for r, toks in chunks:
                rows_SV = res.logits_TV[offset: offset + len(toks)]
                offset += len(toks)
                gen.logits[r] = rows_SV if step == 0 else torch.cat([gen.logits[r], rows_SV])
                gen.greedy[r].append(int(rows_SV[-1].argmax()))
        if step < decode_steps:
            chunks = [(r, [gens[0].greedy[r][-1]]) for r, _ in chunks]
            for gen in gens:
                for r, toks in chunks:
                    gen.fed[r].extend(toks)
    return gens


def worst_diff(diffs: Iterable[float]) -> float:
    """The largest of ``diffs`` (0.0 for none), NaN if any is NaN. Python's ``max`` is not that:
    a comparison with NaN is false, so ``max(0.0, nan)`` is 0.0, and a NaN logits row reduced
    with it vanished from the worst difference (a check ``worst <= tol`` then passed on NaN
    logits, issue 45)."""
    worst = 0.0
    for d in diffs:
        if math.isnan(d):
            return math.nan
        worst = max(worst, d)
    return worst


@dataclass(frozen=True)
class Parity:
    """A generation against the transformers forward: the largest ``|logits diff|`` over every
    fed token (NaN if a row of either side is NaN: :func:`worst_diff`), and the greedy tokens that
    agree out of all compared."""

    max_abs_diff: float
    greedy_equal: int
    greedy_total: int

    @property
    def tokens_identical(self) -> bool:
        return self.greedy_equal == self.greedy_total


@torch.no_grad()
def compare_with_hf(hf_model: Any, gen: Generation) -> Parity:
    """Score ``gen`` against ``hf_model``'s forward over each request's fed tokens (module doc)."""
    from .reference import hf_logits

    diffs: list[float] = []
    equal, total = 0, 0
    for r, fed in gen.fed.items():
        ref_SV = hf_logits(hf_model, fed)
        diffs.append(float((ref_SV - gen.logits[r]).abs().max()))  # a NaN element gives NaN
        prompt_len = len(fed) - (len(gen.greedy[r]) - 1)
        ref_greedy = ref_SV[prompt_len - 1:].argmax(-1).tolist()
        equal += sum(int(a == b) for a, b in zip(ref_greedy, gen.greedy[r]))
        total += len(gen.greedy[r])
    return Parity(max_abs_diff=worst_diff(diffs), greedy_equal=equal, greedy_total=total)
