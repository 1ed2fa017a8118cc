"""The C extensions under attack behave as the pure-Python code does, and never crash.

Each group of cases (tests/native/_adversarial.py) runs in its own process on the C extensions (a
child forked from one driver: tests/native/_fork_each.py), on both kernel loops, so a crash or a
hang fails that group only; its outcomes (results, exceptions with
their messages and notes, warnings) must equal those of the pure-Python reference
(``ASYNCDBO_PURE_PYTHON=1``), which one subprocess computes for every group. The cases: every slot
of the UBatch and Lane records deleted before a primitive's call or between the call and its
await; an awaitable re-entered from a backend's install and from the signal it waits on; values
sent and exceptions thrown into it by hand; a primitive stored as a class attribute; a replaced
``ub.coro``; the recorded call site (``ub.unawaited_at``, refilled in place on C) kept by the
program, freeing a code object whose weakref callback reads the ubatch, or untracked by the
collector; configure() of each extension given types without those slots or with another
class's member descriptors; and the C primitive's constructor given every argument by position and
by keyword, missing, doubled or of the wrong type.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from asyncdbo._core import fastpath
from asyncdbo.dbo import primitives

import _fork_each  # noqa: I001  (tests/native is on sys.path)
from _adversarial import KERNEL_FIELDS, LANE_FIELDS, UB_FIELDS

SCRIPT = Path(__file__).resolve().parent / "_adversarial.py"
GROUPS = (
    [f"ub.{f}" for f in UB_FIELDS]
    + [f"lane.{f}" for f in LANE_FIELDS]
    + [f"kernel.{f}" for f in KERNEL_FIELDS]
    + ["reentry", "by_hand", "site", "configure", "primitive_new"]
)
#: one group's limit on the C extensions (its child's alarm); TIMEOUT_S bounds each driver process
GROUP_LIMIT_S = 60
TIMEOUT_S = 240

pytestmark = pytest.mark.timeout(2 * TIMEOUT_S)


def run(args: list[str], **env: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stderr[-3000:]}"
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """Every group's outcomes on the pure-Python kernel loop and primitives."""
    return run(GROUPS, ASYNCDBO_PURE_PYTHON="1")


@pytest.fixture(scope="module")
def on_c() -> dict[str, Any]:
    """How each group's child on the C extensions ended (checked by the group's own test)."""
    children = run(["--each", str(GROUP_LIMIT_S), *GROUPS])
    assert sorted(children) == sorted(GROUPS)
    return children


@pytest.mark.skipif(primitives.FAST is None or fastpath.C is None, reason="the C extensions are not loaded here")
@pytest.mark.parametrize("group", GROUPS)
def test_the_c_extensions_behave_as_python(group: str, reference: dict[str, Any], on_c: dict[str, Any]) -> None:
    c = _fork_each.outcome(group, on_c[group], GROUP_LIMIT_S)
    assert c, f"no case ran for {group}"
    for case, by_loop in c.items():
        assert set(by_loop) == {"c", "python"}, case
        expected = reference[case]["python"]
        for loop, got in by_loop.items():
            assert got == expected, f"{case} on the {loop} kernel loop"


def test_the_reference_is_what_python_says(reference: dict[str, Any]) -> None:
    """A few reference outcomes spelled out, so the comparison above compares something real."""
    reentry = reference["reentry: role from install"]["python"]
    assert reentry["raised"] == "ValueError: generator already executing"
    assert reference["reentry: sync from wait"]["python"]["raised"] == "ValueError: generator already executing"
    deleted = reference["lane.streams: to_comm after the call, host"]["python"]
    assert re.fullmatch(r"AttributeError: '(asyncdbo\.dbo\.state\.)?Lane' object has no attribute 'streams'",
                        deleted["raised"])  # 3.13 names the class with its module
    by_hand = {k.split(": ")[1]: v["python"] for k, v in reference.items() if k.startswith("by_hand")}
    assert by_hand["send_value"]["result"] == repr(["TypeError: can't send non-None value to a just-started generator"] * 2)
    assert any("dbo_yield('by hand') in ubatch 0 was never awaited" in w for w in by_hand["send_value"]["warnings"])
    assert by_hand["class_attribute"]["result"] == repr(["<Model>", "<Model>"])
    assert by_hand["replace_coro"]["result"] == repr(["the original ran"] * 2)
    assert by_hand["throw_arity"]["result"] == repr([["TypeError: throw expected at least 1 argument, got 0",
                                                      "TypeError: throw expected at most 3 arguments, got 4",
                                                      "TypeError: throw expected at most 3 arguments, got 5"]] * 2)
    assert reference["configure: after a failed configure"]["python"]["result"] == "[0, 1]"
