"""Workload replay: does DBO pay on *this* traffic? Per-step batch compositions across DP ranks go
through the real planner (:mod:`asyncdbo.plan`) and the sim, with and without DBO.

**The file format** (JSON lines, one step per line)::

    {"ranks": [[[1, 2048], [1, 1500]], [[512, 0], [1, 900]], []]}

``ranks`` holds one list per DP rank (every line the same number of ranks): that rank's requests
this step as ``[new_tokens, cached_tokens]`` pairs (a decode request is ``[1, context]``, or
``[1 + K, context]`` with K draft tokens of MTP or speculative verify; a prefill chunk
``[chunk_len, prefix_len]``; ``cached_tokens`` at most :data:`MAX_CACHED_TOKENS`); an empty list is
an idle rank. Other keys (``"step"``, comments under ``"note"``) are ignored. Blank lines and lines
starting with ``#`` are skipped.

**Per step**: every rank's local vote (:func:`asyncdbo.plan.plan_step` without a group: threshold,
split policy), the group's decision (:func:`asyncdbo.plan.decide_from_votes`: all ranks split or
none, idle ranks follow with padding), then each rank's slices (:func:`asyncdbo.plan.plan_slices`
padded to the group's count). Each rank's step is simulated (:func:`asyncdbo.sim.predict.simulate`,
per MoE layer in steady state) serially and, when the step microbatched, as the planned ubatches
(padding tokens included: they cost compute). EP all-to-alls hold every rank to the slowest, so
a step takes its slowest rank's time. Throughput is real tokens over time; the gain is DBO's
throughput over the same steps run unsplit. Steps whose ranks all decode (multi-token decode
included: :func:`~asyncdbo.sim.model.is_decode`) run with the decode
defaults (``ll``, graph replay), others with the prefill ones (``ht``, eager), unless the
deployment fixes them.

The planner sees the exact requests; the sim sees each rank's decode requests summarized (their
count, and their mean context per query count rounded to ``context_bucket``: decode attention reads every cached
token once, so its cost follows the sum) beside its prefill chunks as they are, and caches
simulations by that composition. Races are checked on the first simulation of each split
(serial, microbatched); the others only time.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..plan import PlanReason, RankVote, ThresholdConfig, decide_from_votes, plan_slices, plan_step
from .model import is_decode
from .predict import Deployment, ModelShape, Request, simulate

__all__ = ["ReplayResult", "StepOutcome", "StepSims", "load_workload", "replay", "step_shape", "synthetic_workload"]

Step = list[list[Request]]  # per DP rank, its requests

#: The most ``cached_tokens`` a request may have: 2**24, over 100 times the longest context window
#: of the models the sim ships (DeepSeek-V3's 163,840 positions). The sim sizes its attention
#: tensors by a request's context (meta tensors: nothing is allocated, but torch still computes
#: their bytes in int64): 10**18 failed with "Storage size calculation overflowed" after the
#: table's header. At the bound, a prefill chunk's largest tensor (DeepSeek-V3's keys expanded
#: per head, 128 KiB per key in float32) takes 2**41 bytes, and a rank's decode requests, summed
#: into one attention call (DeepSeek-V3's latent cache: 2,304 bytes per key and request;
#: Mixtral's keys: 4,096) would need over 10**8 requests to reach 2**63.
MAX_CACHED_TOKENS = 2**24


def load_workload(path: str | Path, *, check_rank: Callable[[int], str | None] | None = None) -> list[Step]:
    """Read a JSON-lines workload (module docstring); a ValueError names the file, the line and
    the fix: a file that cannot be read, a malformed line (a token count that is not a whole
    number >= its bound, JSON's ``true`` and ``false`` included: Python reads them as ints, or
    ``cached_tokens`` over :data:`MAX_CACHED_TOKENS`), a
    file without steps or whose steps have no tokens at all (nothing to replay).
    ``check_rank(tokens)``: what is wrong with simulating one rank's ``tokens`` new tokens in a
    step (e.g. more than the memory holds), or None; a rank it objects to is refused as it is
    read, naming the line, the rank and its largest request, before anything is simulated."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the workload ({exc.strerror}); give a JSON-lines file, one step "
                         'per line like {"ranks": [[[1, 2048]], [[512, 0]], []]}') from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); give a JSON-lines file, "
                         'one step per line like {"ranks": [[[1, 2048]], [[512, 0]], []]}') from None
    steps: list[Step] = []
    width = None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg}); each line is one step like "
                             '{"ranks": [[[1, 2048]], [[512, 0]], []]}') from None
        ranks = obj.get("ranks") if isinstance(obj, dict) else None
        if not isinstance(ranks, list) or not ranks:
            raise ValueError(f'{where}: a step needs "ranks": a non-empty list with one request list per DP rank')
        if width is None:
            width = len(ranks)
        elif len(ranks) != width:
            raise ValueError(f"{where}: {len(ranks)} ranks, but the first step has {width}; every step lists every DP rank")
        step: Step = []
        for r, reqs in enumerate(ranks):
            if not isinstance(reqs, list):
                raise ValueError(f"{where}: rank {r} must be a list of [new_tokens, cached_tokens] pairs (got {reqs!r})")
            for req in reqs:
                why = _bad_request(req)
                if why is not None:
                    raise ValueError(f"{where}: rank {r} has request {json.dumps(req)}; a request is [new_tokens >= 1, "
                                     f"cached_tokens >= 0]{why}")
                if req[1] > MAX_CACHED_TOKENS:
                    raise ValueError(f"{where}: rank {r} has request {json.dumps(req)}; cached_tokens (the request's "
                                     f"context) must be at most {MAX_CACHED_TOKENS} (2**24, over 100 times the longest "
                                     "context window of the models the sim ships, DeepSeek-V3's 163,840 tokens); "
                                     "give the tokens the request's KV cache holds")
            tokens = sum(q for q, _ in reqs)
            problem = check_rank(tokens) if check_rank is not None and tokens else None
            if problem is not None:
                largest = max(reqs, key=lambda req: req[0])
                raise ValueError(f"{where}: rank {r} has {tokens} new tokens (its largest request "
                                 f"{json.dumps(largest)}); {problem}")
            step.append([(q, c) for q, c in reqs])
        steps.append(step)
    if not steps:
        raise ValueError(f"{path}: no steps (one JSON object per line)")
    if not any(reqs for step in steps for reqs in step):
        raise ValueError(f"{path}: no step has tokens (every rank is idle in all {len(steps)} step(s)), so there is "
                         "nothing to replay; give a busy rank its requests, like [[1, 2048]] for a decode "
                         "request over 2048 cached tokens")
    return steps


def _bad_request(req: object) -> str | None:
    """None for a well-formed ``[new_tokens, cached_tokens]`` pair, else what the error adds ("" when
    the form says it all)."""
    if not (isinstance(req, list) and len(req) == 2):
        return ""
    for v in req:
        if isinstance(v, bool):  # an int to Python: true would be one token
            return f": {json.dumps(v)} is a JSON bool, not a number of tokens"
        if not isinstance(v, int):
            return f": {json.dumps(v)} is not a whole number of tokens"
    return None if req[0] >= 1 and req[1] >= 0 else ""


def synthetic_workload(*, ranks: int = 4, steps: int = 16, seed: int = 0, spec_tokens: int = 0) -> list[Step]:
    """A mixed serving trace: mostly decode steps whose batch sizes differ per rank (some below
    the decode threshold), some steps where a prefill chunk joins a rank's decodes, and now and
    then an idle rank. Deterministic in ``seed``. Each decode request carries ``1 + spec_tokens``
    tokens (MTP, speculative verify)."""
    rng = random.Random(seed)
    out: list[Step] = []
    for _ in range(steps):
        step: Step = []
        for _ in range(ranks):
            kind = rng.random()
            if kind < 0.1:
                step.append([])  # idle rank
                continue
            batch = rng.choice((8, 16, 24, 48, 64, 96, 128, 160, 192, 256))
            reqs = [(1 + spec_tokens, rng.randrange(256, 4096)) for _ in range(batch)]
            if kind > 0.8:  # a prefill chunk joins this rank's decodes
                reqs.append((rng.choice((256, 512, 1024, 2048)), rng.choice((0, 0, 1024, 4096))))
            step.append(reqs)
        out.append(step)
    return out


@dataclass(frozen=True)
class StepOutcome:
    """One replayed step: the group's decision, each rank's tokens, and the step's time (per MoE
    layer) without and with DBO."""

    microbatched: bool
    reason: PlanReason
    detail: str
    tokens: tuple[int, ...]
    serial_s: float
    dbo_s: float
    local: tuple[PlanReason, ...]  # each busy rank's own reason (MICROBATCHED when it voted yes)


@dataclass
class ReplayResult:
    steps: list[StepOutcome] = field(default_factory=list)
    simulations: int = 0

    @property
    def tokens(self) -> int:
        return sum(sum(s.tokens) for s in self.steps)

    @property
    def serial_s(self) -> float:
        return sum(s.serial_s for s in self.steps)

    @property
    def dbo_s(self) -> float:
        return sum(s.dbo_s for s in self.steps)

    @property
    def gain(self) -> float:
        """DBO's throughput over the unsplit run's, minus 1."""
        return self.serial_s / self.dbo_s - 1.0

    @property
    def microbatched_share(self) -> float:
        return sum(s.microbatched for s in self.steps) / len(self.steps)

    def reasons(self) -> Counter[PlanReason]:
        return Counter(s.reason for s in self.steps if not s.microbatched)

    def rank_reasons(self) -> Counter[PlanReason]:
        """Why ranks voted no, over the steps that fell out."""
        return Counter(r for s in self.steps if not s.microbatched for r in s.local if r is not PlanReason.MICROBATCHED)


def _summary(reqs: Sequence[Request], bucket: int) -> list[Request]:
    """Decode requests (one token, or the few of MTP and speculative verify over a longer cache:
    :func:`~asyncdbo.sim.model.is_decode`) at the mean context of their query count (rounded to
    ``bucket``), prefill chunks as they are."""
    by_q: dict[int, list[int]] = {}
    chunks: list[Request] = []
    for q, c in reqs:
        if is_decode(q, q + c):
            by_q.setdefault(q, []).append(c)
        else:
            chunks.append((q, c))
    out: list[Request] = []
    for q in sorted(by_q):
        ctx = by_q[q]
        out += [(q, max(1, round(sum(ctx) / len(ctx) / bucket)) * bucket)] * len(ctx)
    return out + chunks


class StepSims:
    """The simulations of a replay, cached by composition: one rank's requests (decode requests
    summarized, see :func:`_summary`) under one split, on one deployment and stream policy. Races
    are checked on the first simulation of each ubatch count; the others only time. Shared by the
    policies one ``asyncdbo check --workload`` replays, so a composition two policies run is
    simulated once."""

    def __init__(self, *, model: ModelShape, deployment: Deployment = Deployment(), stream_policy: str = "role",
                 context_bucket: int = 512, check_races: bool = True, fail_on: Sequence[str] = ()) -> None:
        self.model, self.deployment, self.stream_policy = model, deployment, stream_policy
        self.context_bucket, self.check_races, self.fail_on = context_bucket, check_races, tuple(fail_on)
        self.cache: dict[Any, list[float]] = {}
        self.checked: set[int] = set()  # ubatch counts whose schedule the race checker has seen
        self.simulations = 0

    def timed(self, reqs: list[Request], splits: list[list[int]], shape: str) -> list[float]:
        """Per-layer times of ``reqs`` under each split, simulated once per composition. Runs its
        own event loop: call it outside one."""
        import asyncdbo

        summary = _summary(reqs, self.context_bucket)
        key = (tuple(summary), tuple(map(tuple, splits)), shape)
        if key not in self.cache:
            check = self.check_races and len(splits[0]) not in self.checked
            self.checked.add(len(splits[0]))

            async def run() -> Any:
                return await simulate(summary, splits, model=self.model, shape=shape,  # type: ignore[arg-type]
                                      deployment=self.deployment, stream_policy=self.stream_policy,  # type: ignore[arg-type]
                                      check_races=check, fail_on=self.fail_on if check else ())

            self.cache[key] = [per_layer for _, per_layer in asyncdbo.run(run, loop="asyncio")]
            self.simulations += 1
        return self.cache[key]

    def serial(self, reqs: Sequence[Request], shape: str) -> float:
        """One rank's step run unsplit (0 for an idle rank: it is never the slowest)."""
        real = sum(q for q, _ in reqs)
        return self.timed(list(reqs), [[real]], shape)[0] if real else 0.0

    def split(self, reqs: Sequence[Request], parts: list[int], shape: str) -> float:
        """One rank's step as ubatches of ``parts`` padded tokens (padding tokens cost compute and
        attend to nothing)."""
        real = sum(q for q, _ in reqs)
        full = list(reqs) + [(1, 0)] * (sum(parts) - real)
        return self.timed(full, [parts], shape)[0]


def step_shape(step: Step) -> str:
    """The sim's shape of a step: ``decode`` where every request of every rank decodes, multi-token
    decode (MTP, speculative verify) included (the decode defaults: ``ll``, graph replay), else
    ``prefill``."""
    return "decode" if all(is_decode(q, q + c) for reqs in step for q, c in reqs) else "prefill"


def replay(
    steps: Sequence[Step],
    *,
    model: ModelShape,
    deployment: Deployment = Deployment(),
    ubatches: int = 2,
    policy: str = "token",
    thresholds: ThresholdConfig = ThresholdConfig(),
    stream_policy: str = "role",
    context_bucket: int = 512,
    check_races: bool = True,
    on_step: Callable[[int, int], None] | None = None,
    fail_on: Sequence[str] = (),
    sims: StepSims | None = None,
) -> ReplayResult:
    """Replay ``steps`` (module docstring). Runs its own event loops: call it outside one.
    ``fail_on`` (``["lost-overlap"]``): lost overlap in a checked schedule raises too.
    ``on_step(i, n)`` is called before step ``i`` (from 1) of ``n``: a progress line's hook.
    ``sims``: a :class:`StepSims` to share with other replays of the same steps (its deployment,
    stream policy and checks then hold, not the arguments here)."""
    if sims is None:
        sims = StepSims(model=model, deployment=deployment, stream_policy=stream_policy, context_bucket=context_bucket,
                        check_races=check_races, fail_on=fail_on)
    before = sims.simulations
    result = ReplayResult()

    for i, step in enumerate(steps):
        if on_step is not None:
            on_step(i + 1, len(steps))
        qsls = [[0, *_cumsum(q for q, _ in reqs)] for reqs in step]
        votes, local = [], []
        for r, qsl in enumerate(qsls):
            idle = qsl[-1] == 0
            rec = plan_step(qsl, num_ubatches=ubatches, policy=policy,  # type: ignore[arg-type]
                            thresholds=thresholds, is_idle=idle).record
            vote = "idle" if idle else ("yes" if rec.microbatched else "no")
            votes.append(RankVote(r, vote, rec.reason, qsl[-1], qsl[-1]))
            if not idle:
                local.append(rec.reason)
        decision = decide_from_votes(votes)
        shape = step_shape(step)
        serial, dbo = [], []
        for reqs, qsl in zip(step, qsls):
            alone = sims.serial(reqs, shape)
            serial.append(alone)
            if decision.should_ubatch:
                padded = decision.num_tokens_padded
                slices = plan_slices(qsl, ubatches, policy, num_tokens_padded=padded)  # type: ignore[arg-type]
                dbo.append(sims.split(reqs, [s.num_tokens_padded for s in slices], shape))
            else:
                dbo.append(alone)
        result.steps.append(StepOutcome(decision.should_ubatch, decision.reason, decision.detail,
                                        tuple(q[-1] for q in qsls), max(serial, default=0.0), max(dbo, default=0.0),
                                        tuple(local)))
    result.simulations = sims.simulations - before
    return result


def _cumsum(xs: Any) -> list[int]:
    out, t = [], 0
    for x in xs:
        t += x
        out.append(t)
    return out

