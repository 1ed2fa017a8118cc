"""Run recovery: after a run fails, is cancelled or times out on any rank, at any point, every rank
can run the next one; and the ranks that were waiting for the failed one learn which it was.

Why a failed run poisons the next one: gloo pairs the collectives of a group by their sequence
number on that group. A run cancelled on rank 0 after its third all-to-all on a per-ubatch group
and on rank 1 after its fifth leaves rank 1's fourth and fifth in flight; rank 0's next run issues
its fourth there, which receives rank 1's stale data, and gloo's transport thread aborts the
process ("Received data size doesn't match expected size"; reproduced with two ranks cancelling a
run at different yields, and with ``asyncio.wait_for(run_ubatches(...), 0.3)`` followed by a
normal run: exit -6 at the next run, 3 of 3 tries).

What torch offers does not help on gloo (torch 2.13, measured with two ranks): ``abort()`` of a
gloo group is a no-op (a pending all-to-all on the aborting rank and on its peer kept waiting until
the group timeout, and the group stayed usable), and ``shrink_group`` needs a backend that supports
shrinking, which gloo does not (and drops ranks, where every rank is still alive here). So the
per-ubatch groups are replaced instead, and every rank of the job agrees on when, through the
rendezvous store the ranks already share (no collective that a failed run could leave half-done).

:func:`asyncdbo.run_ubatches` runs this protocol itself (:func:`_guard`, registered with the DBO
layer below, which may not import this one), as soon as per-ubatch groups exist:

1. A rank whose run ends by an exception, a cancellation or a timeout posts a notice under the
   current *epoch* in the store (the first poster of an epoch is the one everybody names) and
   remembers that it must recover (:meth:`RunSync.post_failure`).
2. While a run waits (the event loop runs only when every ubatch is parked, or between polls), it
   looks at the notice every :data:`POLL_S` seconds; on one it cancels its ubatches and raises
   :class:`StepAborted`, naming the rank and its exception's line. No watchdog is needed for that.
3. A run whose wait bound ran out (``watchdog_s``) cannot tell whether it is the culprit: it posts
   a *timeout* notice, and every rank that sees one checks in to a roll call
   (:func:`roll_call`); the ranks that do not check in within :data:`ROLL_CALL_S` (stopped, hung or
   dead) are the ones named, on every survivor alike.
4. Before its first ubatch step, every run looks at the notice of the current epoch (one store
   read; :file:`benchmarks/results/run_guard_*.md` measures it). If there is one, or this rank
   must recover, every per-ubatch clone is replaced (:func:`asyncdbo.dist.renew_ubatch_groups`)
   and the epoch advances, once per run. Every rank renews exactly once per epoch that has a
   notice (seen at a run's start, or by its poll, which fails that run and leaves the renewal to
   the next), so the renewals (collectives) pair up; the new groups have nothing in flight, so
   nothing of the failed run can be consumed by the next one. A notice carries the number of the
   failed run within its epoch (every rank counts its runs alike): a rank that starts that same
   run after the notice landed fails it at once with :class:`StepAborted`, so every rank fails
   the same run and renews at the same next one.

A rank that finished the failed run cleanly and starts the next one before the failing rank's
notice lands (a race of a few microseconds) issues its first collective on an old group, parks,
sees the notice at its next poll and raises :class:`StepAborted`; its next run recovers. A rank that
died cannot be recovered this way (its peers' collectives fail with a closed connection or time
out): restart every rank. The notice is job-wide: a failure on any rank ends the waiting runs of
every rank, which is coarser than needed when disjoint groups do not talk to each other, but
always consistent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from .._core import AsyncDBOException, WatchdogTimeout
from ..dbo.hooks import set_run_guard
from .groups import _CLONES, _base, clone_group, on_destroy, renew_ubatch_groups

__all__ = ["POLL_S", "ROLL_CALL_S", "RunSync", "StepAborted", "StepSync", "roll_call", "run_sync", "step_sync"]

log = logging.getLogger("asyncdbo.recovery")

#: Seconds between two looks at the failure notice while a run waits.
POLL_S = 0.05
#: After a wait bound ran out, seconds every rank waits for the others to check in to the roll
#: call; the ranks that do not are named as the cause (stopped, hung or dead).
ROLL_CALL_S = 5.0

_FAILED = "F"  # notice kinds: a rank's run failed (raised, was cancelled)
_TIMEOUT = "T"  # a rank's wait bound ran out: a roll call names the silent ranks


class StepAborted(AsyncDBOException, RuntimeError):
    """This rank's step was ended because rank ``rank`` failed the same step (``reason``: its
    exception line, ``cancelled``, or why it is silent). Call the next step (``run_ubatches`` or
    ``DBORunner.step()``) on every rank: the ranks recover first."""

    def __init__(self, rank: int, reason: str) -> None:
        self.rank = rank
        self.reason = reason
        super().__init__(f"step aborted: rank {rank} failed it ({reason}); the next step recovers on every rank")


def _describe(exc: BaseException) -> str:
    """The line peers print for this rank's failure: ``Type: first line of the message``."""
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    if isinstance(exc, StepAborted):
        return f"aborted after rank {exc.rank} failed"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class RunSync:
    """The recovery state of this process: one for every group, since a renewal replaces every
    per-ubatch clone. Get it with :func:`run_sync`.

    ``epoch``: recoveries so far (the same on every rank once each has run again). ``failure``:
    why this rank must recover before its next run, or None."""

    def __init__(self, store: Any, rank: int, world: int) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self.epoch = 0
        self.seq = 0  # runs this rank started in this epoch: the same count on every rank
        self.failure: str | None = None

    @property
    def must_recover(self) -> bool:
        return self.failure is not None

    def _key(self) -> str:
        return f"asyncdbo/run-failed/{self.epoch}"

    def heal(self) -> None:
        """Before a run: if this rank or another failed a run in this epoch, renew every group;
        if a peer failed *this* run (its notice names this run's number) before this rank started
        it, raise :class:`StepAborted` instead, so that every rank fails the same run and renews at
        the same next one.

        Once, not until no notice is left: a peer that renewed with this rank may have failed its
        next run already (a notice in the new epoch), and renewing again now would wait for that
        peer's next run. This run's poll finds that notice instead, and the next run renews."""
        self.seq += 1
        if self.failure is None:
            if not self.store.check([self._key()]):
                return
            notice = self._notice()
            assert notice is not None
            kind, rank, seq, reason = notice
            if seq >= self.seq and rank != self.rank:  # the run a peer failed: fail it here too
                aborted = self._roll_call(rank, reason) if kind == _TIMEOUT else StepAborted(rank, reason)
                aborted = aborted or StepAborted(rank, reason)
                self.failure = _describe(aborted)
                raise aborted
        self.renew()
        self.seq = 1

    def renew(self, ranks: tuple[int, ...] = ()) -> None:
        """Replace every per-ubatch group and start the next epoch (every rank does, once per
        epoch with a notice). ``ranks``: deprecated, ignored (the ranks of an old recover vote)."""
        notice = self.store.get(self._key()).decode() if self.store.check([self._key()]) else "none"
        count = renew_ubatch_groups()
        log.info("recovered from a failed run (notice %r): %d per-ubatch groups replaced, epoch %d",
                 notice, count, self.epoch + 1)
        self.epoch += 1
        self.seq = 0
        self.failure = None

    def post_failure(self, exc: BaseException) -> None:
        """This rank's run failed: remember to recover, and tell the other ranks (the first rank to
        post in an epoch is the one they name)."""
        if self.failure is None:
            self.failure = _describe(exc)
        kind = _TIMEOUT if isinstance(exc, WatchdogTimeout) else _FAILED
        try:
            self.store.compare_set(self._key(), "", f"{kind}{self.rank}:{self.seq}:{self.failure}")
        except Exception as post_exc:  # a store that is gone: the peers fail by their own bounds
            log.warning("could not post the failed run to the store: %s", post_exc)

    def _notice(self) -> tuple[str, int, int, str] | None:
        """The notice of this epoch: kind, rank, the number of its failed run, reason; or None."""
        key = self._key()
        if not self.store.check([key]):
            return None
        head, _, rest = self.store.get(key).decode().partition(":")
        seq, _, reason = rest.partition(":")
        return head[0], int(head[1:]), int(seq), reason

    def peer_failure(self) -> StepAborted | None:
        """A :class:`StepAborted` for the rank that posted a failure in this epoch, if another did
        (after a timeout notice: the ranks that miss the roll call, see :data:`ROLL_CALL_S`)."""
        notice = self._notice()
        if notice is None:
            return None
        kind, rank, _, reason = notice
        if kind == _TIMEOUT:
            return self._roll_call(rank, reason)
        return None if rank == self.rank else StepAborted(rank, reason)

    def _roll_call(self, poster: int, reason: str) -> StepAborted | None:
        silent = roll_call(f"run/{self.epoch}", ROLL_CALL_S)
        if silent:
            return StepAborted(silent[0], f"silent: no answer to a roll call within {ROLL_CALL_S:g} s after rank "
                                          f"{poster}'s wait ran out, so it is stopped, hung or dead; "
                                          f"silent rank(s) {silent}")
        return None if poster == self.rank else StepAborted(poster, reason)

    async def watch(self, run: asyncio.Future[Any]) -> StepAborted | None:
        """Poll the notice until a peer posts one, then cancel ``run`` and return it."""
        while True:
            await asyncio.sleep(POLL_S)
            aborted = self.peer_failure()
            if aborted is not None:
                run.cancel()
                return aborted

    async def drive(self, run: Any) -> list[Any]:
        """Drive the DBO run ``run`` (a :class:`asyncdbo.lowlevel.DBORun`) while polling the notice;
        on a failure, post it, or turn the ending a peer caused into :class:`StepAborted`."""
        watch = _watch(self, asyncio.get_running_loop())
        watch.start(run)
        try:
            return await run.drive()
        except BaseException as exc:
            raise_instead = self._ended(exc, watch.stop(run))
            task = asyncio.current_task()
            if raise_instead is None and task is not None and task.cancelling():
                # Our task was cancelled, but the run may have ended by another error before the
                # request reached an await (a ubatch the poll cancelled): take it here, or Python
                # 3.11 (whose uncancel() leaves it pending) raises it at the caller's next await.
                try:
                    await asyncio.sleep(0)
                except asyncio.CancelledError:
                    pass
            if raise_instead is None:
                raise
            for note in getattr(exc, "__notes__", ()):  # where each ubatch was
                raise_instead.add_note(note)
            raise raise_instead from (None if isinstance(exc, asyncio.CancelledError) else exc)
        finally:
            watch.stop(run)

    def _ended(self, exc: BaseException, aborted: StepAborted | None) -> StepAborted | None:
        """The run ended by ``exc``: post it; return the error to raise instead, if a peer caused it."""
        task = asyncio.current_task()
        if aborted is not None and isinstance(exc, asyncio.CancelledError) and not (task and task.cancelling()):
            self.failure = _describe(aborted)  # the notice is there already
            return aborted
        self.post_failure(exc)
        if isinstance(exc, WatchdogTimeout):  # whoever posted first: name the silent ranks
            try:
                return self.peer_failure()
            except Exception as call_exc:  # the store is gone too: the watchdog's stacks are all we have
                log.warning("roll call after a timeout failed: %s", call_exc)
        return None


class _Watch:
    """Polls the failure notice every :data:`POLL_S` while runs of this event loop last; on a
    notice, cancels every ubatch of each. One loop timer serves every run of the loop: armed when a
    run starts and none is armed, re-armed by its callback only while runs are live, so back-to-back
    runs arm no timer each (a timer per run cost more than the poll: uvloop releases a cancelled
    timer only at the loop's next turn, which runs that never park do not reach)."""

    __slots__ = ("sync", "loop", "runs", "armed")

    def __init__(self, sync: RunSync, loop: asyncio.AbstractEventLoop) -> None:
        self.sync, self.loop = sync, loop
        self.runs: dict[Any, StepAborted | None] = {}  # live runs -> the notice that ended them
        self.armed = False

    def start(self, run: Any) -> None:
        self.runs[run] = None
        if not self.armed:
            self.armed = True
            self.loop.call_later(POLL_S, self.poll)

    def stop(self, run: Any) -> StepAborted | None:
        return self.runs.pop(run, None)

    def poll(self) -> None:
        self.armed = False
        live = [run for run, aborted in self.runs.items() if aborted is None]
        if not live:
            return
        try:
            aborted = self.sync.peer_failure()
        except Exception as exc:  # a store that is gone: the runs' own bounds end them
            log.warning("could not read the failure notice: %s", exc)
            aborted = None
        if aborted is None:
            self.armed = True
            self.loop.call_later(POLL_S, self.poll)
            return
        for run in live:
            self.runs[run] = aborted
            for ub in run.ubatches:
                run.cancel_ubatch(ub, f"asyncdbo: {aborted}")


_WATCHES: dict[asyncio.AbstractEventLoop, _Watch] = {}


def _watch(sync: RunSync, loop: asyncio.AbstractEventLoop) -> _Watch:
    watch = _WATCHES.get(loop)
    if watch is None or watch.sync is not sync:
        if len(_WATCHES) > 16:  # loops come and go (asyncdbo.run makes one per call)
            for old in [lp for lp in _WATCHES if lp.is_closed()]:
                del _WATCHES[old]
        watch = _WATCHES[loop] = _Watch(sync, loop)
    return watch


_SYNC: list[RunSync] = []  # this process's RunSync, made on first use


def _forget() -> None:
    _SYNC.clear()
    _SYNCS.clear()
    _WATCHES.clear()


def run_sync() -> RunSync | None:
    """This process's :class:`RunSync`, made on first use; None without an initialised process
    group of more than one rank (or in the simulator's fake world, which has no real store)."""
    if _SYNC:
        return _SYNC[0]
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if dist.get_backend() == "fake":
        return None
    from torch.distributed import distributed_c10d as c10d

    sync = RunSync(c10d._get_default_store(), dist.get_rank(), dist.get_world_size())
    _SYNC.append(sync)
    return sync


def _guard() -> RunSync | None:
    """Called by every ``run_ubatches`` before its first step: nothing without per-ubatch groups;
    else heal (renew the groups if a run failed in this epoch) and return the sync to drive with."""
    if not _CLONES:
        return None
    sync = run_sync()
    if sync is not None:
        sync.heal()
    return sync


class StepSync:
    """The DP vote group of a :class:`asyncdbo.serving.DBORunner` on this rank, and (delegated to
    :func:`run_sync`) the recovery state; get it with :func:`step_sync`.

    ``group``: the clone of the DP group that carries the step votes (a vote is synchronous, so it
    cannot be left half-done). ``epoch``: recoveries so far. ``failure``: why this rank must
    recover before its next step, or None."""

    def __init__(self, base: Any) -> None:
        import torch.distributed as dist

        self.group = clone_group(base)
        self.rank = dist.get_rank()
        sync = run_sync()
        assert sync is not None, "a StepSync needs a process group of more than one rank"
        self.run = sync

    @property
    def epoch(self) -> int:
        return self.run.epoch

    @property
    def failure(self) -> str | None:
        return self.run.failure

    @property
    def must_recover(self) -> bool:
        return self.run.must_recover

    def post_failure(self, exc: BaseException) -> None:
        """This rank's step failed: remember to recover, and tell the other ranks."""
        self.run.post_failure(exc)

    def peer_failure(self) -> StepAborted | None:
        """A :class:`StepAborted` for the rank that posted a failure in this epoch, if another did."""
        return self.run.peer_failure()

    async def watch(self, run: asyncio.Future[Any]) -> StepAborted | None:
        """Poll the notice until a peer posts one, then cancel ``run`` and return it."""
        return await self.run.watch(run)

    def renew(self, ranks: tuple[int, ...] = ()) -> None:
        """Replace every per-ubatch group and start the next epoch."""
        self.run.renew(ranks)


_SYNCS: dict[str, StepSync] = {}
on_destroy(_forget)


def step_sync(group: Any = None) -> StepSync | None:
    """The :class:`StepSync` of DP group ``group`` (None: the default group), made on first use
    (a collective: every rank of the group, in the same order, outside a DBO run); None without an
    initialised process group of more than one rank."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    base = _base(group)
    if dist.get_world_size(base) == 1 or run_sync() is None:
        return None
    sync = _SYNCS.get(base.group_name)
    if sync is None:
        sync = _SYNCS[base.group_name] = StepSync(base)
    return sync


def roll_call(tag: str, wait_s: float) -> list[int] | None:
    """Check in under ``tag`` in the rendezvous store and wait up to ``wait_s`` seconds for every
    rank of the default group to do the same; return the ranks that did not (a stopped, hung or
    dead rank never does), or None if the store cannot be reached.

    For a failure path: every rank that fails calls it with the same ``tag``, so the survivors of a
    silent peer name it instead of the peer they happened to be waiting on."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    try:
        store = c10d._get_default_store()
        rank, world = dist.get_rank(), dist.get_world_size()
        store.set(f"asyncdbo/roll-call/{tag}/{rank}", "here")
        deadline = time.monotonic() + wait_s
        missing = [r for r in range(world) if r != rank]
        while True:
            missing = [r for r in missing if not store.check([f"asyncdbo/roll-call/{tag}/{r}"])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(POLL_S)
    except Exception as exc:  # the store's host is gone too
        log.warning("roll call %r failed: %s", tag, exc)
        return None


set_run_guard(_guard)

StepAborted.__module__ = "asyncdbo.dist"  # tracebacks print the public path, not this private module
