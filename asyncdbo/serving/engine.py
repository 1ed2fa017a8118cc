"""A continuous-batching generation loop over :class:`~asyncdbo.serving.DBORunner`: requests
arrive and finish between steps, each step samples one token per running request, and a replayed
arrival trace is reported as an integrator measures an engine (tokens/s, time to first token,
time per output token).

Per step, on every rank:

1. requests whose arrival time has passed join the waiting queue (FIFO);
2. the step holds one decode token for every running request, then admits waiting requests with
   their whole prompt (a prefill) while the step stays within ``max_num_batched_tokens`` and
   ``max_num_seqs`` and the KV cache can hold the request at its longest (prompt plus
   ``max_tokens``: blocks are reserved at admission, so a running request never finds the cache
   full and nothing is preempted);
3. the runner plans (microbatch or not, the DP vote), runs and merges the step;
4. each request's last logits row gives its next token (:mod:`asyncdbo.serving.sampling`); a
   request that hit EOS, a stop token or ``max_tokens`` finishes, and its KV blocks go back to the
   pool (:meth:`BatchBuilder.free`).

Under DP every rank must step together (the runner's collectives): :meth:`Engine.run` all-reduces
"requests left" and "requests ready" over the DP group before each step (one small collective per
step), so a rank with nothing to do steps with an empty batch while another works, every rank
waits while no rank has an arrived request, and all stop together.

Times come from ``clock`` (seconds; injected in tests), read once before each step's admission
and once after its tokens are sampled; an idle wait for the next arrival calls ``sleep``.
"""

# Shape legend: T = tokens of a step, V = vocab.

from __future__ import annotations

import asyncio
import statistics
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from ..plan import StepRecord
from ..plan._checks import check_bool
from .batch import BatchBuilder
from .runner import DBORunner
from .sampling import SamplingParams, sample_tokens

__all__ = ["Engine", "EngineReport", "Request", "RequestOutput", "trace_requests"]

FinishReason = Literal["stop", "length"]


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
        if not self.prompt:
            raise ValueError(f"request {self.request_id}: the prompt is empty; give at least one token id")
        if not (isinstance(self.arrival_s, (int, float)) and self.arrival_s >= 0):
            raise ValueError(f"request {self.request_id}: arrival_s must be a time >= 0 in seconds "
                             f"(got {self.arrival_s!r})")


@dataclass(frozen=True, kw_only=True)
class RequestOutput:
    """A finished request: its tokens, why it stopped, and when (seconds from the run's start)."""

    request_id: int
    prompt: tuple[int, ...]
    output_ids: tuple[int, ...]
    finish_reason: FinishReason
    arrival_s: float
    first_token_s: float
    finish_s: float

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
    """One rank's replay of a trace: every request's output, every step's record and time."""

    outputs: dict[int, RequestOutput]
    records: tuple[StepRecord, ...]
    step_s: tuple[float, ...]
    makespan_s: float  # the run's start to the end of its last step

    @property
    def output_tokens(self) -> int:
        return sum(len(o.output_ids) for o in self.outputs.values())

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
        return (f"{len(self.outputs)} requests, {self.output_tokens} tokens in {len(self.records)} steps "
                f"({self.microbatched_steps} microbatched), {self.tokens_per_s:.1f} tokens/s, "
                f"TTFT {self.mean_ttft_s * 1e3:.1f} ms, TPOT {self.mean_tpot_s * 1e3:.1f} ms (means)")


@dataclass(eq=False)
class _Running:
    req: Request
    generator: torch.Generator | None
    blocks: int  # reserved at admission
    output: list[int] = field(default_factory=list)
    first_token_s: float = 0.0


class Engine:
    """Continuous batching over ``runner`` with the KV blocks of ``builder`` (module docstring).

    ``builder`` must be the runner's model's cache builder and hold no request yet; the engine
    owns it. ``enabled``: microbatch (None: the runner's config; False: the serial baseline).
    ``seed`` draws the seeds of sampling requests that give none. ``dp_group``: the group whose
    ranks step together (default: the runner's). ``clock``/``sleep``: seconds, and an idle wait.
    """

    def __init__(self, runner: DBORunner, builder: BatchBuilder, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enabled: bool | None = None, seed: int = 0,
                 dp_group: Any = None, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1 (got {value!r})")
        check_bool("Engine ", "enabled", enabled, none="None: RunnerConfig.enabled")
        if builder.blocks or builder.num_computed:
            raise ValueError(f"the builder already holds requests {sorted(builder.num_computed)}; "
                             "give the engine a fresh BatchBuilder (or reset() it)")
        self.runner, self.builder = runner, builder
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.enabled = enabled
        self.dp_group = runner.dp_group if dp_group is None else dp_group
        self.clock, self.sleep = clock, sleep
        self._seeds = torch.Generator().manual_seed(seed)
        self._pending: deque[Request] = deque()  # not arrived yet, by arrival time
        self._waiting: deque[Request] = deque()
        self._running: dict[int, _Running] = {}
        self._reserved = 0
        self._t0 = self._end_s = 0.0
        self._ids: set[int] = set()
        self.outputs: dict[int, RequestOutput] = {}
        self.records: list[StepRecord] = []
        self.step_s: list[float] = []

    # -- requests --------------------------------------------------------------------------------

    def _blocks_for(self, req: Request) -> int:
        # The last sampled token is never fed, so the cache holds prompt + max_tokens - 1 tokens.
        return -(-(len(req.prompt) + req.params.max_tokens - 1) // self.builder.cache_cfg.block_size)

    def add_request(self, req: Request) -> None:
        """Queue ``req`` (it joins a step once the run's clock reaches its ``arrival_s``)."""
        if req.request_id in self._ids:
            raise ValueError(f"request {req.request_id} was added already; request ids must be unique")
        cfg = self.builder.cache_cfg
        if self._blocks_for(req) > cfg.num_blocks:
            raise ValueError(
                f"request {req.request_id}: {len(req.prompt)} prompt tokens + max_tokens {req.params.max_tokens} "
                f"need {self._blocks_for(req)} KV blocks of {cfg.block_size}, the cache has {cfg.num_blocks}; "
                "lower max_tokens or raise num_kv_blocks")
        if len(req.prompt) > self.max_num_batched_tokens:
            raise ValueError(f"request {req.request_id}: a prompt of {len(req.prompt)} tokens exceeds "
                             f"max_num_batched_tokens ({self.max_num_batched_tokens}); raise it")
        self.builder._token_ids(req.request_id, req.prompt)  # refuse bad ids now, not in a step
        self._ids.add(req.request_id)
        at = next((i for i, p in enumerate(self._pending) if p.arrival_s > req.arrival_s), len(self._pending))
        self._pending.insert(at, req)

    @property
    def num_unfinished(self) -> int:
        return len(self._pending) + len(self._waiting) + len(self._running)

    def _now(self) -> float:
        return self.clock() - self._t0

    def _arrive(self, now: float) -> None:
        while self._pending and self._pending[0].arrival_s <= now:
            self._waiting.append(self._pending.popleft())

    # -- steps -----------------------------------------------------------------------------------

    def _schedule(self) -> list[tuple[int, list[int]]]:
        chunks = [(rid, [run.output[-1]]) for rid, run in self._running.items()]
        budget = self.max_num_batched_tokens - len(chunks)
        while self._waiting and len(chunks) < self.max_num_seqs:
            req = self._waiting[0]
            blocks = self._blocks_for(req)
            if len(req.prompt) > budget or self._reserved + blocks > self.builder.cache_cfg.num_blocks:
                break  # FIFO: a later request does not overtake the head
            self._waiting.popleft()
            seed = req.params.seed
            gen = None
            if not req.params.greedy:
                if seed is None:
                    seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
                gen = torch.Generator().manual_seed(seed)
            self._running[req.request_id] = _Running(req=req, generator=gen, blocks=blocks)
            self._reserved += blocks
            budget -= len(req.prompt)
            chunks.append((req.request_id, list(req.prompt)))
        return chunks

    async def step(self) -> list[RequestOutput]:
        """One step: admit, run, sample; returns the requests that finished in it. Every rank of
        the DP group calls it together (:meth:`run` does)."""
        return await self._step(self._now())

    async def _step(self, now: float) -> list[RequestOutput]:
        self._arrive(now)
        chunks = self._schedule()
        batch = self.builder.build(chunks)
        t_step = time.perf_counter()
        result = await self.runner.step(batch, enabled=self.enabled)
        self.step_s.append(time.perf_counter() - t_step)
        self.records.append(result.record)
        last_T = torch.tensor([len(t) for _, t in chunks], dtype=torch.int64).cumsum(0) - 1
        runs = [self._running[rid] for rid, _ in chunks]
        tokens = sample_tokens(result.logits_TV[last_T.to(result.logits_TV.device)],
                               [r.req.params for r in runs], [r.generator for r in runs])
        now = self._end_s = self._now()
        finished = []
        for run, token in zip(runs, tokens):
            if not run.output:
                run.first_token_s = now
            run.output.append(token)
            params = run.req.params
            reason: FinishReason | None = ("stop" if params.stops_at(token)
                                           else "length" if len(run.output) >= params.max_tokens else None)
            if reason is None:
                continue
            rid = run.req.request_id
            self.builder.free(rid)
            self._reserved -= run.blocks
            del self._running[rid]
            out = RequestOutput(request_id=rid, prompt=run.req.prompt, output_ids=tuple(run.output),
                                finish_reason=reason, arrival_s=run.req.arrival_s,
                                first_token_s=run.first_token_s, finish_s=now)
            self.outputs[rid] = out
            finished.append(out)
        return finished

    def _agree(self, left: int, ready: int) -> tuple[int, int]:
        """The DP group's most requests left and ready (local values without a group)."""
        group = self.dp_group
        if group is None or torch.distributed.get_world_size(group) == 1:
            return left, ready
        t = torch.tensor([left, ready], dtype=torch.int64, device=self.runner.device or "cpu")
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=group)
        return int(t[0]), int(t[1])

    async def run(self, requests: Iterable[Request] = ()) -> EngineReport:
        """Replay ``requests`` (arrival times from now) to the end on every rank of the DP group,
        each with its own requests (an idle rank passes none); returns this rank's report."""
        for req in requests:
            self.add_request(req)
        self._t0 = self.clock()
        while True:
            now = self._now()
            self._arrive(now)
            left, ready = self._agree(self.num_unfinished, len(self._waiting) + len(self._running))
            if not left:
                break
            if not ready:  # nobody has an arrived request: wait for this rank's next one
                nxt = self._pending[0].arrival_s - now if self._pending else 0.0
                await self.sleep(max(nxt, 0.0))
                continue
            await self._step(now)
        return EngineReport(outputs=dict(self.outputs), records=tuple(self.records), step_s=tuple(self.step_s),
                            makespan_s=self._end_s)


def trace_requests(prompts: Sequence[Sequence[int]], arrivals_s: Sequence[float],
                   params: SamplingParams | Sequence[SamplingParams]) -> list[Request]:
    """Requests ``0..n-1`` of a trace: prompt ``i`` arriving at ``arrivals_s[i]``."""
    if len(prompts) != len(arrivals_s):
        raise ValueError(f"{len(prompts)} prompts but {len(arrivals_s)} arrival times; give one each")
    each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    return [Request(request_id=i, prompt=tuple(p), params=sp, arrival_s=a)
            for i, (p, a, sp) in enumerate(zip(prompts, arrivals_s, each, strict=True))]
