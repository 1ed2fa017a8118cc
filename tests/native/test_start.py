"""DBORun.restart refills its records in C (``asyncdbo._core._spin.start``) exactly as the Python
loop over ``UBatch._start`` does.

The differential spec compares the records each fills, field by field, for N = 1..8 and every kind
of record (an exact UBatch, a subclass with its own ``_start``); the adversarial cases
(tests/native/_start_cases.py: a deleted slot, ``__class__`` reassigned by a call out or a
finalizer, a coroutine without ``send``, the list of records shrunk by a finalizer, the entry point
called wrongly) each run in their own process (a child forked from one driver per side, so a
crash or hang fails that case only: tests/native/_fork_each.py), on the C extension and under
``ASYNCDBO_PURE_PYTHON=1``, and must report the same outcome.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncdbo._core import fastpath
from asyncdbo._core.kernel import DBORun

import _fork_each  # noqa: I001  (tests/native is on sys.path)
from _start_cases import CASES, OwnStart, body, summary

SCRIPT = Path(__file__).resolve().parent / "_start_cases.py"
#: one case's limit (its child's alarm), and the driver's, which runs every case of one side in turn
CASE_LIMIT_S = 60
TIMEOUT_S = 200
needs_c = pytest.mark.skipif(fastpath.C is None, reason="the C kernel extension is not loaded here")

pytestmark = pytest.mark.timeout(2 * TIMEOUT_S)


def each(cases: list[str], **env: str) -> dict[str, dict[str, Any]]:
    """How each case's forked child ended (_fork_each.py): the driver itself runs no case."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--each", str(CASE_LIMIT_S), *cases], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"the driver's exit status {proc.returncode}\n{proc.stderr[-3000:]}"
    children: dict[str, dict[str, Any]] = json.loads(proc.stdout)
    assert sorted(children) == sorted(cases)
    return children


def outcome(case: str, children: dict[str, dict[str, Any]]) -> dict[str, Any]:
    report: dict[str, Any] = _fork_each.outcome(case, children[case], CASE_LIMIT_S)
    return report


def refilled(n: int, loop: str, own_start: int | None) -> list[dict[str, Any]]:
    with fastpath.kernel_loop(loop):
        run = asyncio.run(_driven(n))
        if own_start is not None:
            run.ubatches[own_start].__class__ = OwnStart
        run.ubatches[0].num_yields, run.ubatches[-1].cancels = 5, 2
        coros = [body(i) for i in range(n)]
        run.restart(coros)
        records = [summary(run, ub) for ub in run.ubatches]
        assert asyncio.run(run.drive()) == [i * 10 for i in range(n)]
    return records


async def _driven(n: int) -> DBORun:
    run = DBORun.released(n)
    run.restart([body(i) for i in range(n)])
    await run.drive()
    return run


@needs_c
@pytest.mark.parametrize("n", range(1, 9))
def test_the_c_refill_fills_every_record_as_python_does(n: int) -> None:
    for own_start in (None, n - 1):
        OwnStart.log.clear()
        c = refilled(n, "c", own_start)
        c_log = list(OwnStart.log)
        OwnStart.log.clear()
        assert c == refilled(n, "python", own_start)
        assert c_log == OwnStart.log == ([] if own_start is None else [f"own _start of ub{own_start}"])
    assert c[0] == {"class": "OwnStart" if n == 1 else "UBatch", "run": "the run", "coro": "coroutine",
                    "ctx": "ctx, current ubatch is it", "ctx_run": "ctx.run", "send": "callable, send is resume",
                    "resume": "callable, send is resume", "state": "ready", "tag": "None", "num_yields": "0",
                    "unawaited_at": "None", "cancels": "0"}


ADVERSARIAL = [c for c in CASES if c != "bad arguments"]


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, Any]]:
    children = each(ADVERSARIAL, ASYNCDBO_PURE_PYTHON="1")
    return {case: outcome(case, children) for case in ADVERSARIAL}


@pytest.fixture(scope="module")
def on_c() -> dict[str, dict[str, Any]]:
    """How each case's child on the C extension ended (checked by the case's own test)."""
    return each(list(CASES))


@needs_c
@pytest.mark.parametrize("case", ADVERSARIAL)
def test_an_adversarial_refill_behaves_as_python(case: str, reference: dict[str, dict[str, Any]],
                                                 on_c: dict[str, dict[str, Any]]) -> None:
    got = outcome(case, on_c)
    assert got.pop("c extension") is True
    expected = dict(reference[case])
    assert expected.pop("c extension") is False
    assert got == expected


def test_the_adversarial_reference_is_what_python_says(reference: dict[str, dict[str, Any]]) -> None:
    assert reference["no send"]["restart raised"] == "AttributeError: 'NoSend' object has no attribute 'send'"
    assert reference["deleted ctx"]["results"] == [0, 10]
    assert reference["own _start"]["log"] == ["own _start of ub1"]
    assert [r["class"] for r in reference["finalizer swaps the class"]["records"]] == ["Sub", "UBatch", "UBatch"]
    assert len(reference["finalizer shrinks the list"]["records"]) == 1
    # the tag's finalizer runs at the tag's store: run..state are new, num_yields and cancels still old
    seen = reference["finalizer looks"]["seen by the finalizer"][0]
    assert (seen["state"], seen["num_yields"], seen["cancels"]) == ("ready", "7", "3")


@needs_c
def test_the_entry_point_refuses_bad_arguments_with_errors(on_c: dict[str, dict[str, Any]]) -> None:
    assert outcome("bad arguments", on_c)["errors"] == [
        "TypeError: start() takes 5 arguments (0 given)",
        "TypeError: start() takes 5 arguments (4 given)",
        "TypeError: start(): ubatches and coros must be lists",
        "TypeError: start(): var must be a ContextVar (got 'not a var')",
        "AttributeError: 'object' object has no attribute 'send'",
    ]
