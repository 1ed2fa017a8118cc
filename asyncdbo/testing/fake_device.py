"""CUDA's stream rules, enforced on a CPU: a fake ``torch.accelerator``/``torch.cuda`` under which
the real :class:`~asyncdbo.backends.accelerator.AcceleratorBackend` runs, and which reports every
place where the same program would be wrong on a GPU.

``with FakeDevice() as dev:`` makes torch report a ``cuda`` accelerator whose streams and events
are fakes; tensors stay on the CPU and every op still computes its real numbers. What the fake
adds is the device's *order*: each op a thread issues is a kernel queued on that thread's
**current** stream (what ``torch.accelerator.set_stream`` made current, exactly as on CUDA, where
the current stream is per OS thread and every coroutine of a run shares it). Streams are FIFO
queues with vector clocks; events copy a stream's clock when recorded and merge it into the
waiting stream. Kernels take virtual time (``dev.kernel(ms)``, ``torch.cuda._sleep``, or a
``cost`` per op), so ``Event.elapsed_time`` gives a makespan in which streams run concurrently.

What fails the ``with`` block (:class:`StreamRuleError`, every problem with its place):

* **wrong stream**: a kernel issued by a ubatch on a stream other than its lane's current one
  (``ub.ext.stream``), or issued outside any ubatch on a side stream of a run in progress (another
  task's work landing on a DBO comm stream while the run waits on the event loop);
* **race**: two accesses to one tensor storage from different streams, not ordered by events
  (read-after-write, write-after-read, write-after-write), the happens-before rule of PyTorch's
  CUDA sanitizer;
* **entry and exit joins**: a run's side stream that runs a kernel before it waited for the
  caller's stream as it was when the run started, a side stream whose work the caller's stream
  does not wait for when the run ends, and a thread left on another stream than the caller's;
* **free while in use**: the caching allocator hands a freed block to the next allocation on the
  stream that allocated it; a block freed while another stream's use of it is not ordered before
  that stream's next kernel (and not declared with ``Tensor.record_stream``) is reported there;
* **host syncs** (``capturable=True``): anything that makes the CPU wait for the device
  (``synchronize``, ``query``, and every op :class:`asyncdbo.syncs.HostSyncs` counts:
  ``.item()``, ``.tolist()``, ``nonzero``, ``bincount``, ...), which a CUDA graph capture
  forbids; without ``capturable`` they are only listed in ``host_syncs``.

It lives in :mod:`asyncdbo.testing` (not the test tree) so a model's own test suite can run its
DBO forward under the same rules on a CPU-only CI machine. On a real GPU the same checks come from
PyTorch's CUDA sanitizer (races) and :class:`StreamDiscipline` (the wrong-stream rule), which reads
the real current stream. Collectives (c10d ops) are not placed on streams: a multi-rank run's
device order is the sim backend's to check (:mod:`asyncdbo.sim.races`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._core import AsyncDBOException, DBORun, get_ubatch
from ..syncs import HostSyncs
from .fake_streams import (
    _ACTIVE, FakeEvent, FakeStream, StreamDiscipline, _active_device, _rows_of, _storage, _tensors, _who,
)

__all__ = ["FakeDevice", "FakeEvent", "FakeStream", "StreamDiscipline", "StreamRuleError"]

_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIP = tuple(os.path.join(_PKG, d) for d in ("_core", "dbo", "backends", "syncs.py", "testing")) + (
    os.path.dirname(os.path.abspath(str(torch.__file__))), os.path.dirname(str(os.__file__)), "<")


class StreamRuleError(AsyncDBOException, AssertionError):
    """What the fake device found; ``problems`` lists them, one string each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        shown = problems[:12]
        more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        super().__init__(f"{len(problems)} stream rule violation(s) a GPU would suffer:\n  " + "\n  ".join(shown) + more)


def _place(depth: int = 2) -> str:
    """The innermost frame outside asyncdbo's machinery, torch and the standard library."""
    f: FrameType | None = sys._getframe(depth)
    while f is not None and f.f_code.co_filename.startswith(_SKIP):
        f = f.f_back
    if f is None:
        return "?"
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno} in {f.f_code.co_name}"


@dataclass
class _Block:
    """One storage's history: the stream that allocated it (None: made outside the fake), the
    last write, the reads since it, every other stream's last use, streams declared with
    ``record_stream``."""

    alloc: FakeStream | None
    write: tuple[FakeStream, int, str] | None = None
    reads: dict[int, tuple[FakeStream, int, str]] = field(default_factory=dict)
    uses: dict[int, tuple[FakeStream, int, str]] = field(default_factory=dict)
    recorded: set[int] = field(default_factory=set)
    rows: dict[int, _Block] = field(default_factory=dict)  # row -> its history (index ops, see _ROWS)


@dataclass
class _RunWatch:
    home: FakeStream
    home_seq: int
    streams: list[FakeStream]
    started: set[int] = field(default_factory=set)


class _Kernels(TorchDispatchMode):
    """Places every op on the thread's current fake stream."""

    def __init__(self, dev: FakeDevice) -> None:
        super().__init__()
        self.dev = dev

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.dev._on_op(func, args, kwargs, out)
        return out


class FakeDevice:
    """The fake device (see the module docstring). ``cost(func, args, kwargs, out)`` gives an
    op's virtual milliseconds (default: 0); ``capturable`` makes every host sync a problem;
    ``cycles_per_ms`` is what ``torch.cuda._sleep(cycles)`` counts in a virtual millisecond."""

    def __init__(self, device_type: str = "cuda", *, capturable: bool = False,
                 cost: Callable[[Any, tuple[Any, ...], dict[str, Any], Any], float] | None = None,
                 cycles_per_ms: float = 1e6) -> None:
        self.device_type = device_type
        self.capturable = capturable
        self.cost = cost
        self.cycles_per_ms = cycles_per_ms
        self.problems: list[str] = []
        self._seen: set[str] = set()
        self.host_syncs: list[str] = []
        self.kernels = 0
        self.streams: list[FakeStream] = []
        self._current: dict[int, FakeStream] = {}
        self._blocks: dict[int, _Block] = {}
        self._freed: dict[int, list[tuple[_Block, str]]] = {}
        self._runs: dict[int, _RunWatch] = {}
        self._side: dict[int, DBORun] = {}  # side stream id -> the run in progress that uses it
        self._stack = contextlib.ExitStack()
        self.default: FakeStream | None = None
        #: per thread, the open ``torch.cuda.stream`` blocks: (stream, the ubatch that entered it, where)
        self._contexts: dict[int, list[tuple[FakeStream, Any, str]]] = {}
        self._seen_held: set[tuple[int, str, int]] = set()

    # ------------------------------------------------------------------ streams
    def current(self) -> FakeStream:
        s = self._current.get(threading.get_ident())
        assert self.default is not None
        return self.default if s is None else s

    def set_current(self, stream: Any) -> None:
        if not isinstance(stream, FakeStream):
            raise TypeError(f"set_stream() got {stream!r}, not a stream of this fake device")
        self._current[threading.get_ident()] = stream

    def kernel(self, ms: float, name: str = "kernel") -> None:
        """Queue a kernel of ``ms`` virtual milliseconds that touches no tensor on the current
        stream (``torch.cuda._sleep``)."""
        self._queue(self.current(), name, ms)

    def host_sync(self, what: str, where: str | None = None) -> None:
        """The CPU waits for the device (``what`` names the call): a problem when capturable."""
        entry = f"host sync {what} from {_who()} at {where or _place()}"
        self.host_syncs.append(entry)
        if self.capturable:
            self.problems.append(entry + " (not allowed while capturing a CUDA graph)")

    def makespan_ms(self) -> float:
        """When the last kernel queued on any stream ends."""
        return max((s.t for s in self.streams), default=0.0)

    def _problem(self, text: str) -> None:
        if len(self.problems) < 1000 and text not in self._seen:  # once per op and place, not per row
            self._seen.add(text)
            self.problems.append(text)

    # ------------------------------------------------------------------ kernels
    def _queue(self, stream: FakeStream, name: str, ms: float) -> int:
        self._check_frees(stream)
        self._check_side(stream, name)
        stream.seq += 1
        stream.vc[stream.id] = stream.seq
        stream.t += ms
        self.kernels += 1
        return stream.seq

    def _check_side(self, stream: FakeStream, name: str) -> None:
        ub = get_ubatch()
        if ub is not None and isinstance(getattr(ub.ext, "stream", None), FakeStream):
            if stream is not ub.ext.stream:
                self._problem(f"wrong stream: {name} from {_who()} at {_place()} ran on {stream.name}, "
                              f"not its own stream {ub.ext.stream.name}")
                held = self._contexts.get(threading.get_ident())
                if held and held[-1][0] is stream and held[-1][1] is not None and held[-1][1] is not ub \
                        and (key := (stream.id, held[-1][2], ub.id)) not in self._seen_held:
                    self._seen_held.add(key)  # once per block and ubatch: its first kernel there
                    _, owner, where = held[-1]
                    self._problem(f"stream context held across a yield: `with torch.cuda.stream({stream.name})` "
                                  f"entered by ubatch {owner.id} of {owner.run.name!r} at {where} was still current "
                                  f"when ubatch {ub.id} resumed, so its kernels went to {stream.name} (the first: "
                                  f"{name} at {_place()}); leave the block before the yield (docs/troubleshooting.md)")
        elif ub is None and stream.id in self._side:
            self._problem(f"wrong stream: {name} issued outside ubatches at {_place()} ran on {stream.name}, a side "
                          f"stream of run {self._side[stream.id].name!r} in progress")
        run = ub.run if ub is not None else self._side.get(stream.id)
        watch = None if run is None else self._runs.get(id(run))
        if watch is not None and stream is not watch.home and stream.id not in watch.started:
            watch.started.add(stream.id)
            if stream.vc.get(watch.home.id, 0) < watch.home_seq:
                self._problem(f"entry join: side stream {stream.name} of run {run.name!r} ran {name} at {_place()} "  # type: ignore[union-attr]
                              f"before waiting for the caller's stream {watch.home.name} (the run's inputs may "
                              "still be being written)")

    def _on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        if func.namespace == "c10d":
            return  # collectives: see the module docstring
        stream = self.current()
        name = str(func)
        ms = 0.0 if self.cost is None else float(self.cost(func, args, kwargs, out))
        schema = func._schema
        rets = schema.returns
        if rets and all(r.alias_info is not None and not r.alias_info.is_write for r in rets):
            return  # a view: no kernel, no access
        seq = self._queue(stream, name, ms)
        site = f"{name} from {_who()} at {_place()}"
        factory = schema.name.split("::")[-1].endswith("_like") or schema.name.split("::")[-1].startswith("new_")
        rows = _rows_of(func, args)
        for i, a in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(a.name)
            for t in _tensors(value):
                written = a.alias_info is not None and a.alias_info.is_write
                if written or not factory:
                    self._access(t, stream, seq, site, write=written, rows=rows if i == 0 else None)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for r, o in zip(rets, outs):
            if r.alias_info is None:
                for t in _tensors(o):
                    self._allocated(t, stream)
                    self._access(t, stream, seq, site, write=True)

    def _ordered(self, stream: FakeStream, before: tuple[FakeStream, int, str]) -> bool:
        other, seq, _ = before
        return other is stream or stream.vc.get(other.id, 0) >= seq

    def _access(self, t: torch.Tensor, stream: FakeStream, seq: int, site: str, *, write: bool,
                rows: list[int] | None = None) -> None:
        st = _storage(t)
        if st is None or t.device.type == "meta":
            return
        key = st.data_ptr()
        block = self._blocks.get(key)
        if block is None:
            block = self._blocks[key] = _Block(alloc=None)
        if block.alloc is not None and stream is not block.alloc:
            block.uses[stream.id] = (stream, seq, site)
        if rows is None:
            for row in block.rows.values():  # a whole-tensor access meets every row's history
                self._check(row, stream, site, write=write)
            if write:
                block.rows.clear()
            self._check(block, stream, site, write=write)
            self._note(block, stream, seq, site, write=write)
            return
        self._check(block, stream, site, write=write)
        for r in rows:
            row = block.rows.get(r) or block.rows.setdefault(r, _Block(alloc=None))
            self._check(row, stream, site, write=write)
            self._note(row, stream, seq, site, write=write)

    def _check(self, block: _Block, stream: FakeStream, site: str, *, write: bool) -> None:
        if block.write is not None and not self._ordered(stream, block.write):
            kind = "write-after-write" if write else "read-after-write"
            self._problem(f"race ({kind}) on stream {stream.name}: {site}\n      after unordered write on stream "
                          f"{block.write[0].name}: {block.write[2]}")
        if write:
            for r in block.reads.values():
                if not self._ordered(stream, r):
                    self._problem(f"race (write-after-read) on stream {stream.name}: {site}\n      after unordered read "
                                  f"on stream {r[0].name}: {r[2]}")
                    break

    @staticmethod
    def _note(block: _Block, stream: FakeStream, seq: int, site: str, *, write: bool) -> None:
        if write:
            block.write, block.reads = (stream, seq, site), {}
        else:
            block.reads[stream.id] = (stream, seq, site)

    def _allocated(self, t: torch.Tensor, stream: FakeStream) -> None:
        st = _storage(t)
        if st is None:
            return
        key = st.data_ptr()
        block = self._blocks[key] = _Block(alloc=stream)
        weakref.finalize(st, self._free, key, block)

    def _free(self, key: int, block: _Block) -> None:
        if self._blocks.get(key) is block:
            del self._blocks[key]
        if block.alloc is not None and block.uses:
            self._freed.setdefault(block.alloc.id, []).append((block, _place()))

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        st = _storage(t)
        if st is not None and isinstance(stream, FakeStream):
            block = self._blocks.get(st.data_ptr())
            if block is not None:
                block.recorded.add(stream.id)

    def _check_frees(self, stream: FakeStream) -> None:
        pending = self._freed.pop(stream.id, None)
        for block, where in pending or ():
            for use in block.uses.values():
                if use[0].id not in block.recorded and not self._ordered(stream, use):
                    self._problem(f"free while in use: a block allocated on {stream.name} was freed at {where} and may "
                                  f"be reused by its next kernel while stream {use[0].name} still uses it "
                                  f"({use[2]}); call record_stream({use[0].name}) or join that stream first")
                    break

    # ------------------------------------------------------------------ runs
    def _attached(self, run: DBORun, home: FakeStream, state: Any) -> None:
        streams: dict[int, FakeStream] = {}
        for lane in state.lanes:
            for s in lane.streams.values():
                if isinstance(s, FakeStream) and s is not home:
                    streams[s.id] = s
        self._runs[id(run)] = _RunWatch(home, home.seq, list(streams.values()))
        for sid in streams:
            self._side[sid] = run

    def _detached(self, run: DBORun) -> None:
        watch = self._runs.pop(id(run), None)
        if watch is None:
            return
        for s in watch.streams:
            if self._side.get(s.id) is run:
                del self._side[s.id]
            if watch.home.vc.get(s.id, 0) < s.seq:
                self._problem(f"exit join: stream {s.name} of run {run.name!r} still has work the caller's stream "
                              f"{watch.home.name} does not wait for after the run")
        cur = self.current()
        if cur is not watch.home:
            self._problem(f"caller's stream not restored: after run {run.name!r} the thread is on {cur.name}, "
                          f"not the caller's {watch.home.name}")

    # ------------------------------------------------------------------ install
    def __enter__(self) -> FakeDevice:
        from ..backends import accelerator
        from ..backends.accelerator import AcceleratorBackend

        if _ACTIVE:
            raise RuntimeError("a FakeDevice is already active")
        _ACTIVE.append(self)
        self.default = FakeStream(name="default")
        st = self._stack
        st.callback(_ACTIVE.remove, self)
        dev = torch.device(self.device_type, 0)

        def patch(obj: Any, name: str, value: Any) -> None:
            missing = object()
            old = getattr(obj, name, missing)
            setattr(obj, name, value)
            st.callback(lambda: delattr(obj, name) if old is missing else setattr(obj, name, old))

        acc = torch.accelerator
        patch(acc, "is_available", lambda: True)
        patch(acc, "current_accelerator", lambda check_available=False: dev)
        patch(acc, "current_device_index", lambda: 0)
        patch(acc, "device_count", lambda: 1)
        patch(acc, "current_stream", lambda device=None: self.current())
        patch(acc, "set_stream", self.set_current)
        patch(acc, "synchronize", lambda device=None: self.host_sync("torch.accelerator.synchronize()"))
        patch(torch, "Stream", FakeStream)
        patch(torch, "Event", FakeEvent)
        cuda = torch.cuda
        patch(cuda, "is_available", lambda: True)
        patch(cuda, "current_stream", lambda device=None: self.current())
        patch(cuda, "set_stream", self.set_current)
        patch(cuda, "stream", _stream_context)
        patch(cuda, "Stream", FakeStream)
        patch(cuda, "Event", FakeEvent)
        patch(cuda, "synchronize", lambda device=None: self.host_sync("torch.cuda.synchronize()"))
        patch(cuda, "_sleep", lambda cycles: self.kernel(cycles / self.cycles_per_ms, "_sleep"))
        patch(torch.Tensor, "record_stream", lambda t, stream: self.record_stream(t, stream))
        patch(AcceleratorBackend, "stand_in", True)  # its "cuda" tensors are CPU tensors
        attach, detach = AcceleratorBackend.attach, AcceleratorBackend.detach

        def watched_attach(be: Any, run: DBORun, state: Any) -> None:
            home = self.current()
            attach(be, run, state)
            self._attached(run, home, state)

        def watched_detach(be: Any, run: DBORun, state: Any) -> None:
            detach(be, run, state)
            self._detached(run)

        patch(AcceleratorBackend, "attach", watched_attach)
        patch(accelerator, "_SHARED", {})  # the process's backends hold real streams: none of them here
        patch(AcceleratorBackend, "detach", watched_detach)
        mode = _Kernels(self)
        mode.__enter__()
        st.callback(mode.__exit__, None, None, None)
        # The ops that would make the host wait on a device (.item(), .tolist(), nonzero, ...): on
        # CPU tensors torch never waits, so the detector treats them as device tensors.
        syncs = HostSyncs(on_sync=lambda rec, args: self.host_sync(f"{rec.op} ({rec.reason})", rec.where))
        st.enter_context(syncs)
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._stack.close()
        for pending in self._freed.values():  # frees whose stream never ran again cannot be reused early
            pending.clear()
        if exc_type is None and self.problems:
            raise StreamRuleError(self.problems)

    def check(self) -> None:
        """Raise :class:`StreamRuleError` now if anything was found (and forget it)."""
        problems, self.problems = self.problems, []
        if problems:
            raise StreamRuleError(problems)


@contextlib.contextmanager
def _stream_context(stream: FakeStream | None) -> Iterator[FakeStream | None]:
    """``torch.cuda.stream(s)``: current for the block, the previous one restored after."""
    dev = _active_device()
    assert isinstance(dev, FakeDevice)
    if stream is None:
        yield None
        return
    prev = dev.current()
    dev.set_current(stream)
    entry = (stream, get_ubatch(), _place(1))
    held = dev._contexts.setdefault(threading.get_ident(), [])
    held.append(entry)  # a block that spans a yield is found by the next ubatch's kernel (_check_side)
    try:
        yield stream
    finally:
        if entry in held:
            held.remove(entry)
        dev.set_current(prev)
