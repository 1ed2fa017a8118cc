"""The thread-baton DBO driver of ``moe_step.py`` and ``host_overhead.py``: vLLM's
``UBatchWrapper`` control flow around asyncdbo's ubatch coroutines, with three waiting policies
(see ``moe_step.py``'s module docstring for what each one models)."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import torch

__all__ = ["WAIT_POLICIES", "run_threads"]


#: How a thread waits for comm it needs: "hold" keeps the baton while it blocks (vLLM on the host
#: backend: every wait blocks the CPU); "counts" holds it only for the counts exchange and hands it
#: on for the others (vLLM on a GPU, where the dispatch and combine waits are stream waits and only
#: the counts are read on the CPU); "handoff" hands it on for every wait (asyncdbo's policy).
WAIT_POLICIES = ("hold", "counts", "handoff")


class _Baton:
    """vLLM's baton (one ``threading.Event`` per ubatch thread: a thread runs only while its event
    is set) plus a ready queue, so that a thread that waits for comm can hand the baton on and get
    it back, in round-robin order, once its comm completed (what asyncdbo's kernel does)."""

    def __init__(self, n: int) -> None:
        self.lock = threading.Lock()
        self.events = [threading.Event() for _ in range(n)]
        self.ready: deque[int] = deque(range(n))
        self.holder: int | None = None

    def _give_next(self) -> None:  # under the lock
        if self.ready:
            self.holder = self.ready.popleft()
            self.events[self.holder].set()
        else:
            self.holder = None

    def start(self) -> None:
        with self.lock:
            self._give_next()

    def acquire(self, i: int) -> None:
        self.events[i].wait()
        self.events[i].clear()

    def yield_(self, i: int) -> None:
        """Back of the queue, baton to the next ready thread (``_cpu_yield``)."""
        with self.lock:
            self.ready.append(i)
            self._give_next()
        self.acquire(i)

    def park(self, i: int, signal: Any) -> None:
        """Hand the baton on until ``signal`` completes, then queue up for it again."""
        with self.lock:
            self._give_next()
        signal.add_waiter(lambda: self._wake(i))  # at once, inline, if it already completed
        self.acquire(i)

    def _wake(self, i: int) -> None:
        with self.lock:
            if self.holder is None:
                self.holder = i
                self.events[i].set()
            else:
                self.ready.append(i)

    def finish(self) -> None:
        with self.lock:
            self._give_next()


def run_threads(fn: Any, ubatch_args: list[tuple[Any, ...]], backend: Any, policy: str = "role",
                wait: str = "hold") -> tuple[list[Any], Any, list[tuple[int, float, float]]]:
    """Drive ``fn(*args)`` per ubatch the vLLM way (``moe_step.py``'s docstring), waiting for comm
    per ``wait`` (:data:`WAIT_POLICIES`). Returns the results, the DBORun (for its comm works)
    and the CPU step spans as (ubatch, start, end)."""
    from asyncdbo.dbo.hooks import run_pending_hook
    from asyncdbo.dbo.state import Lane, RunState
    from asyncdbo.lowlevel import SWITCH, DBORun, Signal

    if wait not in WAIT_POLICIES:
        raise ValueError(f"unknown wait policy {wait!r}; use one of {WAIT_POLICIES}")
    coros = [fn(*a) for a in ubatch_args]
    run = DBORun(coros, install=backend.install_stream, at_exit=run_pending_hook, name="threads")
    state = RunState(backend=backend, policy=policy, lanes=[Lane(ub) for ub in run.ubatches])
    run.ext = state
    for ub, lane in zip(run.ubatches, state.lanes):
        ub.ext = lane
    backend.attach(run, state)
    n = len(coros)
    baton = _Baton(n)
    spans: list[tuple[int, float, float]] = []
    errors: list[BaseException] = []
    # The modeled link's releases are timers; the main thread fires them (under a lock: threads
    # add timers as they issue comm) while the ubatch threads run.
    timer_lock = threading.Lock()
    timers_changed = threading.Event()
    kernel_call_at = run.call_at

    def call_at(deadline: float, cb: Any) -> None:
        with timer_lock:
            kernel_call_at(deadline, cb)
        timers_changed.set()

    run.call_at = call_at  # type: ignore[method-assign]

    def holds(signal: Signal) -> bool:
        return wait == "hold" or (wait == "counts" and signal.what == "counts")

    def block_on(signal: Signal) -> None:
        woke = threading.Event()
        signal.add_waiter(woke.set)
        woke.wait()

    def body(i: int) -> None:
        ub = run.ubatches[i]
        with torch.inference_mode():
            baton.acquire(i)
            try:
                while True:
                    t0 = time.perf_counter()
                    try:
                        request = ub.resume()
                    except StopIteration as stop:
                        spans.append((i, t0, time.perf_counter()))
                        run._finish(ub, stop.value)  # runs the pending recv hook, like __exit__
                        return
                    spans.append((i, t0, time.perf_counter()))
                    if request is SWITCH:
                        run.num_switches += 1
                        baton.yield_(i)
                    elif isinstance(request, Signal):
                        ub.ctx_run(run_pending_hook, ub)  # as asyncdbo's before_park: launch the receive it holds
                        if holds(request):
                            block_on(request)
                        else:
                            baton.park(i, request)
                    else:
                        raise TypeError(f"thread driver cannot wait on {request!r}")
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)
                for e in baton.events:
                    e.set()
            finally:
                baton.finish()
                timers_changed.set()  # the main thread stops waiting once every thread ended

    threads = [threading.Thread(target=body, args=(i,), name=f"ubatch-{i}") for i in range(n)]
    for t in threads:
        t.start()
    baton.start()
    while any(t.is_alive() for t in threads):
        timers_changed.clear()  # before looking: a timer added from now on sets it again
        with timer_lock:
            run._fire_timers()
            due = run._timers[0][0] if run._timers else None
        timeout = 0.05 if due is None else min(0.05, max(0.0, due - run.clock.now()))
        timers_changed.wait(timeout)
    for t in threads:
        t.join()
    backend.detach(run, state)
    if errors:
        raise errors[0]
    return [ub.result for ub in run.ubatches], run, spans
