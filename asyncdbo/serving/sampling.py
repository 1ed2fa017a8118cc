"""Choosing each request's next token from its last logits row: greedy, or temperature and top-p
with a per-request seeded generator.

A seeded request draws from its own ``torch.Generator`` (one draw per token), so its tokens depend
on its seed and its own logits only, not on which requests share its steps, their order, or
whether the step was microbatched: equal logits give equal tokens, serial or DBO. Sampling runs on
the host in float32 (the engine needs the ids there anyway to build the next step), so a seed
gives the same draws on every device.

A row that holds NaN or ``+inf``, or only ``-inf``, is never sampled: :func:`sample_tokens` raises
:class:`NonFiniteLogitsError` naming the rows (an argmax over NaN is token 0, silently), and the
engine fails exactly those requests. Every finite temperature > 0 is accepted: the row's maximum is
subtracted before dividing (so a small temperature sends every other token to ``-inf``, not the
row to ``inf - inf = NaN``), and a temperature below :data:`MIN_TEMPERATURE` samples as that one
(in float32 a smaller divisor rounds to 0): the most likely token, ties drawn among themselves.
"""

# Shape legend: R = requests of a step, V = vocab, K = candidates kept by top-p.

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._core import AsyncDBOException

__all__ = ["NonFiniteLogitsError", "SamplingParams", "finite_rows", "sample_tokens"]

#: The smallest temperature sampling divides by (a normal float32); below it, it samples as this.
MIN_TEMPERATURE = 1e-30
#: Seeds a ``torch.Generator`` takes: ``0 .. 2**64 - 1``.
SEED_LIMIT = 2**64


class NonFiniteLogitsError(AsyncDBOException, ArithmeticError):
    """A request's logits row held NaN or Inf at the step that would have sampled from it: the
    request fails with this error (the engine's :attr:`RequestOutput.error`), never with a token
    drawn from garbage (a greedy argmax over NaN is token 0)."""


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request generates.

    ``temperature=0`` is greedy (argmax; ``top_p`` and ``seed`` unused). Otherwise the logits are
    divided by ``temperature``, the smallest set of most likely tokens whose probability reaches
    ``top_p`` is kept (``1.0``: all) and one token is drawn with a generator seeded by ``seed``
    (None: the engine's own generator draws the request's seed). Generation stops after
    ``max_tokens`` tokens, or at a token of ``stop_token_ids`` or ``eos_token_id`` (kept as the
    request's last output token, as transformers' ``generate()`` keeps its EOS)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1 (got {self.max_tokens!r})")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, 0 for greedy (got {self.temperature!r})")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], 1.0 keeping every token (got {self.top_p!r})")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < SEED_LIMIT):
            raise ValueError(f"seed must be an int in [0, 2**64) or None, what torch.Generator.manual_seed takes "
                             f"(got {self.seed!r})")
        stops = tuple(self.stop_token_ids)
        for t in (*stops, *(() if self.eos_token_id is None else (self.eos_token_id,))):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids and eos_token_id must be token ids (ints >= 0), got {t!r}")
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def stops_at(self, token: int) -> bool:
        """Whether ``token`` ends the request (a stop token or the EOS)."""
        return token == self.eos_token_id or token in self.stop_token_ids


def finite_rows(rows_RV: torch.Tensor) -> torch.Tensor:
    """``[R]`` bool: which rows a token can be drawn from: no NaN, no ``+inf``, and at least one
    finite value (``-inf`` is a token ruled out, as a logits processor marks one). One reduction:
    a row's max is NaN if it holds a NaN (``amax`` propagates it), ``+inf`` if it holds one, and
    ``-inf`` if nothing else is left, so the row is usable exactly when its max is finite."""
    return torch.isfinite(rows_RV.amax(dim=-1))


def sample_tokens(logits_RV: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator | None]) -> list[int]:
    """One token per row of ``logits_RV``: row ``r`` with ``params[r]``, drawing (when not greedy)
    from ``generators[r]``, a CPU generator. A row :func:`finite_rows` refuses raises
    :class:`NonFiniteLogitsError` naming it, before any draw."""
    if logits_RV.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"{logits_RV.shape[0]} logits rows, {len(params)} params and {len(generators)} generators; "
                         "pass one of each per request")
    rows_RV = logits_RV.detach().float().cpu()
    bad = (~finite_rows(rows_RV)).nonzero().flatten().tolist()
    if bad:
        raise NonFiniteLogitsError(f"logits rows {bad} hold NaN or +inf (or only -inf); no token is sampled from them")
    return sample_finite(rows_RV, params, generators)


def sample_finite(rows_RV: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator | None]) -> list[int]:
    """:func:`sample_tokens` on float32 host rows already known to be finite (the engine checks
    them once, to fail exactly the requests whose rows are not)."""
    tokens = rows_RV.argmax(dim=-1).tolist()  # every greedy row in one call
    for r, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        if gen is None:
            raise ValueError(f"request row {r} samples (temperature {p.temperature}) but has no generator")
        row_V = rows_RV[r]
        probs_V = torch.softmax((row_V - row_V.max()) / max(p.temperature, MIN_TEMPERATURE), dim=-1)
        if p.top_p < 1:
            sorted_K, order_K = probs_V.sort(descending=True, stable=True)
            before_K = sorted_K.cumsum(0) - sorted_K  # mass of the more likely tokens
            keep = int((before_K < p.top_p).sum())  # the first token is always kept
            probs_V = torch.zeros_like(probs_V).index_fill_(0, order_K[:keep], 1.0) * probs_V
        tokens[r] = int(torch.multinomial(probs_V, 1, generator=gen))
    return tokens
