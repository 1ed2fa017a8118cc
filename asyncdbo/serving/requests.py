"""What a user hands the :class:`~asyncdbo.serving.Engine` and what it hands back: a request, its
status while it is served, its output when it ends (finished, or failed with its error), and a
run's report.

Every field is checked where the request enters (here, and against the vocabulary in
:meth:`Engine.add_request`), so a request is refused by name before any step, never lost in one.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..plan import StepRecord
from .sampling import SamplingParams

__all__ = ["EngineReport", "FinishReason", "Request", "RequestOutput", "RequestStatus", "trace_requests"]

#: Why a request ended: a stop token or EOS, ``max_tokens``, or an error (:attr:`RequestOutput.error`).
FinishReason = Literal["stop", "length", "error"]


class RequestStatus(enum.Enum):
    """Where a request is: not arrived yet, queued, in the running batch, or ended."""

    PENDING = "pending"  # added, its arrival time not reached
    WAITING = "waiting"  # arrived, not admitted yet (FIFO)
    RUNNING = "running"  # admitted: holds KV blocks, one token per step
    FINISHED = "finished"  # stopped or reached max_tokens
    FAILED = "failed"  # ended by an error named in its output


@dataclass(frozen=True, kw_only=True)
class Request:
    """A request of a trace: its id (unique on this rank), prompt token ids, sampling and the time
    it arrives (seconds from the start of :meth:`Engine.run`)."""

    request_id: int
    prompt: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", tuple(self.prompt))
        if isinstance(self.request_id, bool) or not isinstance(self.request_id, int):
            raise ValueError(f"request_id must be an int (got {self.request_id!r})")
        if not self.prompt:
            raise ValueError(f"request {self.request_id}: the prompt is empty; give at least one token id")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"request {self.request_id}: params must be a SamplingParams "
                             f"(got {type(self.params).__name__})")
        if not (isinstance(self.arrival_s, (int, float)) and not isinstance(self.arrival_s, bool)
                and math.isfinite(self.arrival_s) and self.arrival_s >= 0):
            raise ValueError(f"request {self.request_id}: arrival_s must be a finite time >= 0 in seconds "
                             f"(got {self.arrival_s!r})")


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """An ended request: its tokens, why it ended, and when (seconds from the run's start).
    ``finish_reason="error"``: it failed, ``error`` says why (the exception's type and message);
    ``output_ids`` then holds the tokens it had before the failure."""

    request_id: int
    prompt: tuple[int, ...]
    output_ids: tuple[int, ...]
    finish_reason: FinishReason
    arrival_s: float
    first_token_s: float
    finish_s: float
    error: str | None = None

    @property
    def status(self) -> RequestStatus:
        return RequestStatus.FAILED if self.finish_reason == "error" else RequestStatus.FINISHED

    @property
    def ttft_s(self) -> float:
        """Time to first token: arrival to the end of the step that sampled it."""
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None for a one-token output)."""
        n = len(self.output_ids)
        return (self.finish_s - self.first_token_s) / (n - 1) if n > 1 else None


@dataclass(frozen=True, kw_only=True)
class EngineReport:
    """One rank's replay of a trace: the outputs handed over by the run (every request that ended
    in it, and any ended earlier and not taken yet), and its steps' records and times (the last
    ``keep_records`` of them)."""

    outputs: dict[int, RequestOutput]
    records: tuple[StepRecord, ...]
    step_s: tuple[float, ...]
    makespan_s: float  # the run's start to the end of its last step

    @property
    def output_tokens(self) -> int:
        return sum(len(o.output_ids) for o in self.outputs.values())

    @property
    def failed(self) -> dict[int, RequestOutput]:
        """The requests that ended by an error (their ``error`` says which)."""
        return {rid: o for rid, o in self.outputs.items() if o.finish_reason == "error"}

    @property
    def tokens_per_s(self) -> float:
        """Output tokens over the run's wall time (its start to the last step's end)."""
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def mean_ttft_s(self) -> float:
        return statistics.fmean(o.ttft_s for o in self.outputs.values()) if self.outputs else 0.0

    @property
    def mean_tpot_s(self) -> float:
        tpots = [t for o in self.outputs.values() if (t := o.tpot_s) is not None]
        return statistics.fmean(tpots) if tpots else 0.0

    @property
    def microbatched_steps(self) -> int:
        return sum(rec.microbatched for rec in self.records)

    def summary(self) -> str:
        failed = f", {len(self.failed)} failed" if self.failed else ""
        n = len(self.records)
        return (f"{len(self.outputs)} request{'s' if len(self.outputs) != 1 else ''}{failed}, {self.output_tokens} "
                f"token{'s' if self.output_tokens != 1 else ''} in {n} step{'s' if n != 1 else ''} "
                f"({self.microbatched_steps} microbatched), {self.tokens_per_s:.1f} tokens/s, "
                f"TTFT {self.mean_ttft_s * 1e3:.1f} ms, TPOT {self.mean_tpot_s * 1e3:.1f} ms (means over the "
                "requests of one run: a single sample of the engine's speed)")


def trace_requests(prompts: Sequence[Sequence[int]], arrivals_s: Sequence[float],
                   params: SamplingParams | Sequence[SamplingParams]) -> list[Request]:
    """Requests ``0..n-1`` of a trace: prompt ``i`` arriving at ``arrivals_s[i]``."""
    if len(prompts) != len(arrivals_s):
        raise ValueError(f"{len(prompts)} prompts but {len(arrivals_s)} arrival times; give one each")
    each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    return [Request(request_id=i, prompt=tuple(p), params=sp, arrival_s=a)
            for i, (p, a, sp) in enumerate(zip(prompts, arrivals_s, each, strict=True))]
