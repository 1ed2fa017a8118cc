"""Replay a DBO run's own schedule with zero host overhead (issue 17: the schedule as the target).

``moe_step.py`` compares each step with a lower bound, ``max(compute, comm, longest chain)``. No
term of that bound counts what one CPU costs a schedule: a ubatch whose message arrived still waits
for the other ubatch's step in progress, because steps are not preemptive. The replay measures
exactly that. It runs the run's own CPU steps (same durations, as measured) in the kernel's
policy, on an ideal runtime that costs nothing between steps:

* one CPU takes the head of a FIFO ready queue whenever it is free and idles otherwise; all
  ubatches start in the queue in id order;
* a step that ends with a switch puts its ubatch at the back of the queue at once, behind the
  ubatches woken during the step (the kernel drains its wake-ups before it pushes the switcher);
* a step that ends with a park: its ubatch joins the queue when the last thing it waits for
  completes (at that instant; the CPU still finishes the step it is running). If that already
  happened, it still joins at the back of the queue, as the run's park did: the replay keeps the
  run's order, because the dependencies below were read under that order;
* a ubatch that reaches the head of the queue while something its next step needs is missing
  (it came from a switch, and its await did not park in the run) parks there at no cost;
* each message is issued at the same offset into its issuing step as in the run. On a modeled
  link it travels as ``HostBackend.submit`` models it: one shared link, ``start = max(issue,
  link free)``, the link busy ``bytes / bandwidth`` from ``start``, the message released at
  ``start + latency + bytes / bandwidth``. Without a link model (real loopback) it takes its
  measured time from issue to completion.

The replay is not a lower bound: round-robin FIFO is one policy, not the best order of these
steps, and the steps keep their run's boundaries. It is what the run's schedule reaches with a
perfect runtime, so ``step / replay`` is what the runtime costs and ``replay / bound`` what the
schedule loses to the one CPU. It never ends before the bound's compute term (the steps run one
at a time) nor, when the last message is awaited by some step, before the link's busy time.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from asyncdbo.backends.links import LinkSpec

__all__ = ["Msg", "SetBy", "Step", "replay"]


@dataclass(frozen=True, kw_only=True)
class Msg:
    """A message issued by ubatch ``ub`` ``offset_s`` into its step ``step``. ``measured_s``: the
    run's time from issue to completion, used when there is no link model."""

    ub: int
    step: int
    offset_s: float
    nbytes: int = 0
    measured_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class SetBy:
    """A signal that ubatch ``ub`` set ``offset_s`` into its step ``step`` (a recv hook it ran, an
    event it recorded)."""

    ub: int
    step: int
    offset_s: float


@dataclass(frozen=True, kw_only=True)
class Step:
    """One CPU step of a ubatch and what must be complete before it starts.

    ``parked``: the ubatch came to it from a park (the step before it ended waiting); otherwise
    from a switch (or it is the first step). ``after_msgs``: indices of messages; ``after_sets``:
    signals set by other steps; ``after_s``: a wake-up from outside the run at this time (seconds
    after the run's first step started), for waits the trace cannot tie to a step or message."""

    duration_s: float
    parked: bool = False
    after_msgs: tuple[int, ...] = ()
    after_sets: tuple[SetBy, ...] = ()
    after_s: float | None = None


def _check(steps: Sequence[Sequence[Step]], msgs: Sequence[Msg]) -> None:
    def step_of(ub: int, k: int, what: str) -> Step:
        if not (0 <= ub < len(steps) and 0 <= k < len(steps[ub])):
            raise ValueError(f"{what} names step {k} of ubatch {ub}, which the trace does not have")
        return steps[ub][k]

    for i, m in enumerate(msgs):
        st = step_of(m.ub, m.step, f"message {i}")
        if not 0.0 <= m.offset_s <= st.duration_s:
            raise ValueError(f"message {i} is issued {m.offset_s} s into a step of {st.duration_s} s; "
                             "the offset must lie inside its step")
    for u, ub_steps in enumerate(steps):
        for k, st in enumerate(ub_steps):
            if st.duration_s < 0:
                raise ValueError(f"step {k} of ubatch {u} lasts {st.duration_s} s; durations must be >= 0")
            bad = [i for i in st.after_msgs if not 0 <= i < len(msgs)]
            if bad:
                raise ValueError(f"step {k} of ubatch {u} waits for messages {bad}, which the trace does not have")
            for s in st.after_sets:
                src = step_of(s.ub, s.step, f"step {k} of ubatch {u} waits for a signal that")
                if not 0.0 <= s.offset_s <= src.duration_s:
                    raise ValueError(f"step {k} of ubatch {u} waits for a signal set {s.offset_s} s into a step of "
                                     f"{src.duration_s} s; the offset must lie inside that step")


def replay(steps: Sequence[Sequence[Step]], msgs: Sequence[Msg], link: LinkSpec | None,
           log: list[tuple[int, int, float]] | None = None) -> float:
    """Seconds from the first step's start to the last step's end when ``steps`` (per ubatch, in
    order) and ``msgs`` run on the ideal runtime of the module docstring; ``log`` gets (ubatch,
    step, start) of each step as it runs. A trace whose waits can never all complete raises
    ValueError (a wrong dependency, not a schedule)."""
    _check(steps, msgs)
    issued: dict[tuple[int, int], list[int]] = {}
    for i in sorted(range(len(msgs)), key=lambda i: msgs[i].offset_s):
        issued.setdefault((msgs[i].ub, msgs[i].step), []).append(i)
    sets: dict[tuple[int, int], set[float]] = {}
    for ub_steps in steps:
        for st in ub_steps:
            for s in st.after_sets:
                sets.setdefault((s.ub, s.step), set()).add(s.offset_s)

    def needs(u: int, k: int) -> set[Hashable]:
        st = steps[u][k]
        keys: set[Hashable] = {("msg", i) for i in st.after_msgs}
        keys |= {("set", s.ub, s.step, s.offset_s) for s in st.after_sets}
        if st.after_s is not None:
            keys.add(("outside", u, k))
        return keys

    completions: list[tuple[float, int, Hashable]] = []  # (time, order, what): a min-heap
    seq = itertools.count()
    for u, ub_steps in enumerate(steps):
        for k, st in enumerate(ub_steps):
            if st.after_s is not None:
                heapq.heappush(completions, (st.after_s, next(seq), ("outside", u, k)))
    complete: set[Hashable] = set()
    waiting: dict[int, set[Hashable]] = {}  # parked ubatch -> what it still waits for
    ready = deque(u for u in range(len(steps)) if steps[u])
    next_step = [0] * len(steps)
    left = sum(len(s) for s in steps)
    now = link_free = 0.0

    def drain(t: float) -> None:
        """Complete everything due by ``t``, in time order, waking ubatches whose waits are over."""
        while completions and completions[0][0] <= t:
            _, _, key = heapq.heappop(completions)
            complete.add(key)
            for u in [u for u, keys in waiting.items() if key in keys]:
                keys = waiting[u]
                keys.discard(key)
                if not keys:
                    del waiting[u]
                    ready.append(u)

    while left:
        if not ready:
            if not completions:
                stuck = {u: sorted(map(str, keys)) for u, keys in waiting.items()}
                raise ValueError(f"the trace deadlocks: ubatches wait for what no step produces: {stuck}")
            now = max(now, completions[0][0])
            drain(now)
            continue
        u = ready.popleft()
        k = next_step[u]
        missing = needs(u, k) - complete
        if missing:  # resumed, found its wait unmet, parked: no cost on an ideal runtime
            waiting[u] = missing
            continue
        start, st = now, steps[u][k]
        if log is not None:
            log.append((u, k, start))
        now = start + st.duration_s
        for i in issued.get((u, k), ()):
            m = msgs[i]
            t_issue = start + m.offset_s
            if link is None:
                t_done = t_issue + m.measured_s
            else:
                begin = max(t_issue, link_free)
                link_free = begin + m.nbytes / link.bandwidth_Bps
                t_done = begin + link.transfer_s(m.nbytes)
            heapq.heappush(completions, (t_done, next(seq), ("msg", i)))
        for off in sorted(sets.get((u, k), ())):
            heapq.heappush(completions, (start + off, next(seq), ("set", u, k, off)))
        next_step[u] += 1
        left -= 1
        drain(now)
        if next_step[u] == len(steps[u]):
            continue  # returned
        missing = needs(u, next_step[u]) - complete if steps[u][next_step[u]].parked else set()
        if missing:
            waiting[u] = missing
        else:
            ready.append(u)  # switched, or parked on what is complete: behind those woken during its step
    return now
