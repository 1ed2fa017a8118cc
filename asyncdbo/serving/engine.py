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
3. the DP group agrees (one small all-reduce): requests left, requests ready, whether admission
   failed on any rank;
4. the runner plans (microbatch or not, the DP vote), runs and merges the step;
5. each request's last logits row gives its next token (:mod:`asyncdbo.serving.sampling`); a row
   holding NaN or ``+inf`` (or only ``-inf``) fails its request (:class:`~asyncdbo.serving.NonFiniteLogitsError`), never
   becomes a token;
6. the DP group agrees again, on whether the step failed anywhere; then, and only then, the step
   takes effect: tokens are appended, and a request that hit EOS, a stop token or ``max_tokens``
   finishes and its KV blocks go back to the pool (:meth:`BatchBuilder.free`).

**A step is a transaction.** Until step 6 nothing of it is visible: a step that fails on any rank,
anywhere (admission, the model, sampling), leaves every request on every rank as it was before it
(queues, KV blocks, outputs, sampling generators), the failing rank raises its error and the
others :class:`~asyncdbo.dist.StepAborted` naming it (:mod:`asyncdbo.serving.dp_agree`). Call
:meth:`Engine.run` (or :meth:`Engine.step`) again on every rank: it resumes where the last good
step left off, and a retried step draws the same tokens a clean run draws.

Under DP every rank must step together (the runner's collectives): a rank with nothing to do steps
with an empty batch while another works, every rank waits while no rank has an arrived request,
and all stop together.

Times come from ``clock`` (seconds; injected in tests), read once before each step's admission
and once after its tokens are sampled; an idle wait for the next arrival calls ``sleep``, and
:meth:`Engine.run` yields to the event loop after every step, so a request another task adds
during the run joins it.

**Memory is bounded:** step records and times are kept in rings of ``keep_records``; a finished
request's output is handed over (returned by :meth:`Engine.step`, in :meth:`Engine.run`'s report,
or by :meth:`Engine.take_finished`) and then forgotten; the statuses of the last ``keep_records``
ended requests stay readable through :meth:`Engine.status`.
"""

# Shape legend: T = tokens of a step, R = requests sampled in a step, V = vocab.

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..plan import StepRecord
from ..plan._checks import check_bool
from .batch import Batch, BatchBuilder
from .dp_agree import DPAgreement
from .requests import EngineReport, FinishReason, Request, RequestOutput, RequestStatus, trace_requests
from .runner import DBORunner
from .sampling import SEED_LIMIT, NonFiniteLogitsError, finite_rows, sample_finite

__all__ = ["Engine", "EngineReport", "Request", "RequestOutput", "RequestStatus", "trace_requests"]

log = logging.getLogger("asyncdbo.serving")


@dataclass(eq=False)
class _Running:
    req: Request
    generator: torch.Generator | None
    blocks: int  # reserved at admission
    output: list[int] = field(default_factory=list)
    first_token_s: float = 0.0


@dataclass(eq=False)
class _Txn:
    """What a step changed before it took effect, to undo it (:meth:`Engine._undo`)."""

    chunks: list[tuple[int, list[int]]]
    admitted: list[Request]
    seeds_state: torch.Tensor | None  # the engine's seed generator before the step drew any
    builder_mark: dict[int, tuple[int | None, int]] | None = None
    gen_states: list[tuple[torch.Generator, torch.Tensor]] = field(default_factory=list)
    batch: Batch | None = None


class Engine:
    """Continuous batching over ``runner`` with the KV blocks of ``builder`` (module docstring).

    ``builder`` must be the runner's model's cache builder and hold no request yet; the engine
    owns it. ``enabled``: microbatch (None: the runner's config; False: the serial baseline).
    ``seed`` draws the seeds of sampling requests that give none. ``dp_group``: the group whose
    ranks step together (default: the runner's). ``clock``/``sleep``: seconds, and an idle wait.
    ``keep_records``: how many step records and times, and ended requests' statuses, are kept.
    """

    def __init__(self, runner: DBORunner, builder: BatchBuilder, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enabled: bool | None = None, seed: int = 0,
                 dp_group: Any = None, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep, keep_records: int = 1024) -> None:
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("keep_records", keep_records)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Engine {name} must be an int >= 1 (got {value!r})")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT:
            raise ValueError(f"Engine seed must be an int in [0, 2**64) (got {seed!r})")
        check_bool("Engine ", "enabled", enabled, none="None: RunnerConfig.enabled")
        if builder.blocks or builder.num_computed:
            raise ValueError(f"the builder already holds requests {sorted(builder.num_computed)}; "
                             "give the engine a fresh BatchBuilder (or reset() it)")
        self.runner, self.builder = runner, builder
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.enabled = enabled
        self.dp_group = runner.dp_group if dp_group is None else dp_group
        self._dp = DPAgreement(self.dp_group, runner.sync, runner.device)
        self.clock, self.sleep = clock, sleep
        self.keep_records = keep_records
        self._seeds = torch.Generator().manual_seed(seed)
        self._pending: deque[Request] = deque()  # not arrived yet, by arrival time
        self._waiting: deque[Request] = deque()
        self._running: dict[int, _Running] = {}
        self._reserved = 0
        self._t0 = self._end_s = 0.0
        self._started = False
        self._finished: dict[int, RequestOutput] = {}  # ended, not handed over yet
        self._live: set[int] = set()  # the ids of the unfinished requests: pending, waiting, running
        self._ended: OrderedDict[int, RequestStatus] = OrderedDict()  # the last keep_records
        self.records: deque[StepRecord] = deque(maxlen=keep_records)
        self.step_s: deque[float] = deque(maxlen=keep_records)
        self.num_steps = 0  # steps that took effect

    # -- requests --------------------------------------------------------------------------------

    def _blocks_for(self, req: Request) -> int:
        # The last sampled token is never fed, so the cache holds prompt + max_tokens - 1 tokens.
        return -(-(len(req.prompt) + req.params.max_tokens - 1) // self.builder.cache_cfg.block_size)

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary token ids are checked against: the builder's, else the model's."""
        if self.builder.vocab_size is not None:
            return self.builder.vocab_size
        hf = getattr(self.runner.model, "hf", None)
        size = getattr(hf, "vocab_size", None) or getattr(getattr(self.runner.model, "cfg", None), "vocab_size", None)
        return size if isinstance(size, int) else None

    def add_request(self, req: Request) -> None:
        """Queue ``req`` (it joins a step once the run's clock reaches its ``arrival_s``).
        Everything a step could trip on is refused here, naming the request and the field."""
        if not isinstance(req, Request):
            raise ValueError(f"add_request takes an asyncdbo.serving.Request (got {type(req).__name__})")
        rid = req.request_id
        if rid in self._live or rid in self._ended:
            raise ValueError(f"request {rid} was added already; request ids must be unique")
        cfg = self.builder.cache_cfg
        if self._blocks_for(req) > cfg.num_blocks:
            raise ValueError(
                f"request {rid}: {len(req.prompt)} prompt tokens + max_tokens {req.params.max_tokens} "
                f"need {self._blocks_for(req)} KV blocks of {cfg.block_size}, the cache has {cfg.num_blocks}; "
                "lower max_tokens or raise num_kv_blocks")
        if len(req.prompt) > self.max_num_batched_tokens:
            raise ValueError(f"request {rid}: a prompt of {len(req.prompt)} tokens exceeds "
                             f"max_num_batched_tokens ({self.max_num_batched_tokens}); raise it")
        self.builder._token_ids(rid, req.prompt)  # refuse bad ids now, not in a step
        vocab = self.vocab_size
        stops = (*req.params.stop_token_ids, *(() if req.params.eos_token_id is None else (req.params.eos_token_id,)))
        if vocab is not None:
            outside = [t for t in stops if t >= vocab]
            if outside:
                raise ValueError(f"request {rid}: stop_token_ids/eos_token_id {outside} are outside the vocabulary "
                                 f"of {vocab} (0 .. {vocab - 1}); such a token is never sampled, so it never stops "
                                 "the request")
        at = next((i for i, p in enumerate(self._pending) if p.arrival_s > req.arrival_s), len(self._pending))
        self._pending.insert(at, req)
        self._live.add(rid)

    @property
    def num_unfinished(self) -> int:
        return len(self._pending) + len(self._waiting) + len(self._running)

    def _status_live(self, rid: int) -> RequestStatus | None:
        if rid not in self._live:
            return None
        if rid in self._running:
            return RequestStatus.RUNNING
        if any(r.request_id == rid for r in self._waiting):
            return RequestStatus.WAITING
        if any(r.request_id == rid for r in self._pending):
            return RequestStatus.PENDING
        return None

    def status(self, request_id: int) -> RequestStatus:
        """Where request ``request_id`` is (:class:`RequestStatus`); a KeyError for an id never
        added, or ended longer ago than the last ``keep_records`` requests."""
        found = self._status_live(request_id) or self._ended.get(request_id)
        if found is None:
            raise KeyError(f"request {request_id} is not known to this engine (never added, or ended before "
                           f"the last {self.keep_records} requests)")
        return found

    def take_finished(self) -> dict[int, RequestOutput]:
        """Hand over the requests that ended and were not handed over yet (by request id); the
        engine keeps only their status."""
        out, self._finished = self._finished, {}
        return out

    @property
    def outputs(self) -> dict[int, RequestOutput]:
        """The ended requests not handed over yet (see :meth:`take_finished`)."""
        return dict(self._finished)

    def _now(self) -> float:
        return self.clock() - self._t0

    def _arrive(self, now: float) -> None:
        while self._pending and self._pending[0].arrival_s <= now:
            self._waiting.append(self._pending.popleft())

    # -- a step: begin, agree, run, sample, agree, commit (or undo) ------------------------------

    def _begin(self) -> _Txn:
        """Schedule and build the step without letting any of it take effect yet."""
        chunks = [(rid, [run.output[-1]]) for rid, run in self._running.items()]
        txn = _Txn(chunks=chunks, admitted=[], seeds_state=None)
        budget = self.max_num_batched_tokens - len(chunks)
        reserved = self._reserved
        try:
            while self._waiting and len(chunks) < self.max_num_seqs:
                req = self._waiting[0]
                blocks = self._blocks_for(req)
                if len(req.prompt) > budget or reserved + blocks > self.builder.cache_cfg.num_blocks:
                    break  # FIFO: a later request does not overtake the head
                self._waiting.popleft()
                txn.admitted.append(req)
                gen = None
                if not req.params.greedy:
                    seed = req.params.seed
                    if seed is None:
                        if txn.seeds_state is None:
                            txn.seeds_state = self._seeds.get_state()
                        seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
                    gen = torch.Generator().manual_seed(seed)
                self._running[req.request_id] = _Running(req=req, generator=gen, blocks=blocks)
                reserved += blocks
                budget -= len(req.prompt)
                chunks.append((req.request_id, list(req.prompt)))
            self._reserved = reserved
            txn.builder_mark = self.builder.mark([rid for rid, _ in chunks])
            txn.batch = self.builder.build(chunks)
        except BaseException:
            self._undo(txn)
            raise
        return txn

    def _undo(self, txn: _Txn) -> None:
        """Put every request back as it was before ``txn``'s step."""
        for gen, state in txn.gen_states:
            gen.set_state(state)
        if txn.builder_mark is not None:
            self.builder.rollback(txn.builder_mark)
        for req in txn.admitted:
            run = self._running.pop(req.request_id, None)
            if run is not None:
                self._reserved -= run.blocks
        self._waiting.extendleft(reversed(txn.admitted))
        if txn.seeds_state is not None:
            self._seeds.set_state(txn.seeds_state)

    def _sample(self, txn: _Txn, logits_TV: torch.Tensor) -> list[int | NonFiniteLogitsError]:
        """Each request's next token, or the error that fails it (its row is not finite)."""
        last_T = torch.tensor([len(t) for _, t in txn.chunks], dtype=torch.int64).cumsum(0) - 1
        rows_RV = logits_TV[last_T.to(logits_TV.device)].detach().float().cpu()
        ok_R = finite_rows(rows_RV).tolist()
        runs = [self._running[rid] for rid, _ in txn.chunks]
        good = [r for r, ok in enumerate(ok_R) if ok]
        txn.gen_states = [(gen, gen.get_state()) for r in good if (gen := runs[r].generator) is not None]
        tokens = sample_finite(rows_RV[good] if len(good) < len(runs) else rows_RV,
                               [runs[r].req.params for r in good], [runs[r].generator for r in good])
        out: list[int | NonFiniteLogitsError] = []
        it = iter(tokens)
        for r, ok in enumerate(ok_R):
            out.append(next(it) if ok else NonFiniteLogitsError(
                f"request {txn.chunks[r][0]}: its logits at step {self.num_steps} hold NaN or +inf, or only -inf "
                f"({int(rows_RV[r].isnan().sum())} NaN, {int(rows_RV[r].isinf().sum())} inf of {rows_RV.shape[1]}); "
                "no token was sampled from them"))
        return out

    def _commit(self, txn: _Txn, drawn: list[int | NonFiniteLogitsError], now: float) -> list[RequestOutput]:
        self.num_steps += 1
        ended = []
        for (rid, _), token in zip(txn.chunks, drawn):
            run = self._running[rid]
            params = run.req.params
            reason: FinishReason | None
            error = None
            if isinstance(token, NonFiniteLogitsError):
                reason, error = "error", f"{type(token).__name__}: {token}"
                log.warning("%s", error)
            else:
                if not run.output:
                    run.first_token_s = now
                run.output.append(token)
                reason = ("stop" if params.stops_at(token)
                          else "length" if len(run.output) >= params.max_tokens else None)
            if reason is None:
                continue
            self.builder.free(rid)
            self._reserved -= run.blocks
            del self._running[rid]
            self._live.discard(rid)
            out = RequestOutput(request_id=rid, prompt=run.req.prompt, output_ids=tuple(run.output),
                                finish_reason=reason, arrival_s=run.req.arrival_s,
                                first_token_s=run.first_token_s if run.output else now, finish_s=now, error=error)
            self._ended[rid] = out.status
            while len(self._ended) > self.keep_records:
                self._ended.popitem(last=False)
            ended.append(out)
        return ended

    async def _cycle(self, now: float) -> tuple[int, int, list[RequestOutput] | None]:
        """Agree on the group's requests left and ready and, if any is ready, run one step (module
        docstring). Returns (left, ready, the requests that ended: None when no step ran).

        A cancellation lands at the step's end, once its outcome is agreed (the peers wait for
        this rank's part of every agreement), except inside the runner's run, which ends at once
        and tells the peers (:mod:`asyncdbo.dist.recovery`); either way every rank takes the step
        or undoes it alike."""
        self._dp.recover()  # after a failed step: every rank renews its groups here
        self._arrive(now)
        left, ready = self.num_unfinished, len(self._waiting) + len(self._running)
        txn: _Txn | None = None
        error: BaseException | None = None
        try:
            try:
                txn = self._begin() if ready else None
            except Exception as exc:  # admission failed here: every rank hears it in the agreement
                error = exc
                self._dp.post(exc)
            left, ready, flag = await self._dp.agree([left, ready, self._dp.flag(error is not None)])
            self._raise_if_failed(flag, error)
            if not ready:
                self._dp.raise_deferred()
                return left, ready, None
            if txn is None:  # an idle rank steps with the group
                txn = _Txn(chunks=[], admitted=[], seeds_state=None, batch=self.builder.build([]))
            assert txn.batch is not None
            drawn: list[int | NonFiniteLogitsError] = []
            t_step = time.perf_counter()
            try:
                result = await self.runner.step(txn.batch, enabled=self.enabled)
                if txn.chunks:
                    drawn = self._sample(txn, result.logits_TV)
            except BaseException as exc:  # the runner posted its own failures; this posts sampling's
                error = exc
                self._dp.post(exc)
            step_s = time.perf_counter() - t_step
            (flag,) = await self._dp.agree([self._dp.flag(error is not None)])
            self._raise_if_failed(flag, error)
        except BaseException as exc:
            self._dp.failed()
            if txn is not None:
                self._undo(txn)
            exc.add_note(f"asyncdbo: engine step {self.num_steps} did not take effect on this rank: every request "
                         "is as it was before it; call Engine.run() (or step()) again on every rank to go on")
            self._dp.raise_deferred(exc)
            raise
        self.records.append(result.record)
        self.step_s.append(step_s)
        now = self._end_s = self._now()
        finished = self._commit(txn, drawn, now)
        for out in finished:  # kept until handed over, also if a deferred cancellation ends the run now
            self._finished[out.request_id] = out
        self._dp.raise_deferred()
        return left, ready, finished

    def _raise_if_failed(self, flag: int, error: BaseException | None) -> None:
        rank = self._dp.failed_rank(flag)
        if error is not None:
            raise error
        if rank is not None:
            raise self._dp.aborted(rank)

    async def step(self) -> list[RequestOutput]:
        """One step: admit, run, sample; returns the requests that ended in it (handed over: the
        engine keeps only their status). Every rank of the DP group calls it together (:meth:`run`
        does). A step that fails on any rank raises and changes nothing (module docstring)."""
        if not self._started:
            self._t0, self._started = self.clock(), True
        _, _, finished = await self._cycle(self._now())
        for out in finished or ():
            self._finished.pop(out.request_id, None)  # handed over here
        return finished or []

    async def run(self, requests: Iterable[Request] = ()) -> EngineReport:
        """Replay ``requests`` (arrival times from now) to the end on every rank of the DP group,
        each with its own requests (an idle rank passes none); returns this rank's report.

        A run that starts while requests of an earlier one are unfinished (it raised) resumes it
        on the same clock; a request added by another task while it runs joins it."""
        resume = self._started and self.num_unfinished > 0
        for req in requests:
            self.add_request(req)
        if not resume:
            self._t0, self._started = self.clock(), True
        steps0 = self.num_steps
        while True:
            now = self._now()
            left, ready, finished = await self._cycle(now)
            if not left:
                break
            try:
                if finished is None:  # nobody has an arrived request: wait for this rank's next one
                    nxt = self._pending[0].arrival_s - now if self._pending else 0.0
                    await self.sleep(max(nxt, 0.0))
                else:
                    await asyncio.sleep(0)  # let other tasks of the loop run (and add requests) between steps
            except BaseException as exc:  # cancelled between steps: the peers may wait in the next agreement
                self._dp.post(exc)
                self._dp.failed()
                raise
        kept = min(self.num_steps - steps0, len(self.records))
        steps, times = list(self.records)[len(self.records) - kept:], list(self.step_s)[len(self.step_s) - kept:]
        return EngineReport(outputs=self.take_finished(), records=tuple(steps), step_s=tuple(times),
                            makespan_s=self._end_s)
