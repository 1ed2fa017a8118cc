"""The reference counts that decide whether a run shell and its host streams are reused
(``asyncdbo._core.refcounts``): the C ``counts``/``same_counts`` (``asyncdbo/_core/_spin.c``) and
their Python twins read the same quantities and decide alike, on every change of a count, on
arguments of the wrong type or length, on expected entries that are not plain ints (including
ones whose ``==`` raises or changes a count), and past the C code's on-stack buffer; and a run
shell is reused, or not, alike on either."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from asyncdbo import dbo_yield, run_ubatches
from asyncdbo._core import fastpath, refcounts
from asyncdbo.backends import host
from asyncdbo.dbo import shell
from asyncdbo.lowlevel import get_ubatch

C = fastpath.C
IMPLS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "python": (refcounts.py_counts, refcounts.py_same_counts)
}
if C is not None:
    IMPLS["c"] = (C.counts, C.same_counts)

needs_c = pytest.mark.skipif(C is None, reason="the C kernel extension is not loaded here")

pytestmark = pytest.mark.timeout(60)


class Obj:
    """Has a weak reference slot."""


class Bare:
    """Has none (getweakrefcount is 0 for it)."""

    __slots__ = ("x",)


def test_the_module_runs_the_c_functions_where_the_extension_is_loaded() -> None:
    if C is None:
        assert (fastpath.counts, fastpath.same_counts) == (refcounts.py_counts, refcounts.py_same_counts)
    else:
        assert (fastpath.counts, fastpath.same_counts) == (C.counts, C.same_counts)


@needs_c
def test_c_and_python_count_the_same_references_the_strong_ones_one_apart() -> None:
    objs = (Obj(), Obj(), Bare(), Obj())
    held = [objs[0], objs[0], objs[3]]
    # two weak references to objs[0]: one with a callback (a plain one is shared, not a second)
    refs = [weakref.ref(objs[0]), weakref.ref(objs[0], print), weakref.ref(objs[1])]
    weak = (objs[0], objs[1], objs[3], objs[2])
    py, c = refcounts.py_counts(objs, weak), C.counts(objs, weak)
    assert len(py) == len(c) == 8
    offsets = {p - k for p, k in zip(py[:4], c[:4])}
    assert len(offsets) == 1 and offsets.pop() >= 0  # getrefcount's own reference, if any
    assert py[4:] == c[4:] == (2, 1, 0, 0)
    assert [c[i] - c[1] for i in range(4)] == [2, 0, 0, 1]  # objs[0] held twice more, objs[3] once
    del held, refs


def changes() -> Iterator[tuple[str, Callable[[tuple[Any, ...], list[Any]], None], bool]]:
    """(what, a change of the objects' references made through ``keep``, whether counts still agree)."""
    yield "nothing", lambda objs, keep: None, True
    yield "a strong reference", lambda objs, keep: keep.append(objs[1]), False
    yield "a weak reference", lambda objs, keep: keep.append(weakref.ref(objs[0])), False
    yield "a weak reference to an object only counted strongly", lambda objs, keep: keep.append(weakref.ref(objs[2])), True
    yield "a reference to the tuple only", lambda objs, keep: keep.append(objs), True
    yield "a reference that went again", lambda objs, keep: keep.append(objs[0]) or keep.clear(), True
    yield "an outside reference deleted", lambda objs, keep: OUTSIDE.clear(), False
    yield "a weak reference deleted", lambda objs, keep: WEAK.clear(), False


OUTSIDE: list[Any] = []
WEAK: list[Any] = []


@pytest.mark.parametrize("what,change,same", list(changes()), ids=[c[0] for c in changes()])
def test_both_see_every_change_of_a_count_alike(what: str, change: Callable[..., None], same: bool) -> None:
    decided = {}
    for name, (counts, same_counts) in IMPLS.items():
        objs = (Obj(), Obj(), Obj(), Bare())
        OUTSIDE[:] = [objs[3]]
        WEAK[:] = [weakref.ref(objs[1])]
        weak = objs[:2]
        baseline = counts(objs, weak)
        assert same_counts(objs, weak, baseline) is True
        keep: list[Any] = []
        change(objs, keep)
        decided[name] = same_counts(objs, weak, baseline)
        del keep
        OUTSIDE.clear()
        WEAK.clear()
    assert decided == dict.fromkeys(IMPLS, same)


def test_arguments_that_are_not_tuples_raise_the_same_type_error() -> None:
    objs = (Obj(),)
    for bad in ([Obj()], None, type("T", (tuple,), {})((Obj(),))):
        errors = set()
        for counts, same_counts in IMPLS.values():
            for call in (lambda: counts(bad, ()), lambda: counts(objs, bad),
                         lambda: same_counts(bad, (), (1,)), lambda: same_counts(objs, bad, (1,))):
                with pytest.raises(TypeError) as err:
                    call()
                errors.add(str(err.value))
        name = type(bad).__name__
        assert errors == {
            f"counts(): objs and weak must be tuples (got {name} and tuple)",
            f"counts(): objs and weak must be tuples (got tuple and {name})",
            f"same_counts(): objs and weak must be tuples (got {name} and tuple)",
            f"same_counts(): objs and weak must be tuples (got tuple and {name})",
        }


@needs_c
def test_the_c_functions_refuse_a_wrong_number_of_arguments() -> None:
    with pytest.raises(TypeError, match=r"^counts\(\) takes 2 arguments \(1 given\)$"):
        C.counts(())
    with pytest.raises(TypeError, match=r"^same_counts\(\) takes 3 arguments \(4 given\)$"):
        C.same_counts((), (), (), ())


class EqAlways(int):
    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = int.__hash__


class EqRaises(int):
    def __eq__(self, other: object) -> bool:
        raise RuntimeError("no comparing")

    __hash__ = int.__hash__


class EqKeeps:
    """Equal to anything, and takes a reference to an object whose count was read already."""

    def __init__(self, obj: object) -> None:
        self.obj = obj
        self.kept: list[object] = []

    def __eq__(self, other: object) -> bool:
        self.kept.append(self.obj)
        return True

    __hash__ = object.__hash__


def expected_variants(base: tuple[int, ...], objs: tuple[Any, ...]) -> Iterator[tuple[str, object]]:
    """Expected values derived from one implementation's own baseline ``base`` (3 entries)."""
    yield "the baseline", base
    yield "a list", list(base)
    yield "a tuple subclass", type("T", (tuple,), {})(base)
    yield "one entry short", base[:-1]
    yield "one entry more", (*base, base[-1])
    yield "empty", ()
    yield "a float equal to the count", (float(base[0]), *base[1:])
    yield "a bool for a count of 1", (*base[:2], True) if base[2] == 1 else (*base[:2], base[2])
    yield "a string", ("1", *base[1:])
    yield "None", (*base[:1], None, base[2])
    yield "an int too big for C", (2**100, *base[1:])
    yield "a negative int", (-1, *base[1:])
    yield "an int subclass equal to anything", (EqAlways(12345), *base[1:])
    yield "an int subclass whose == raises", (base[0], EqRaises(base[1]), base[2])
    yield "a first entry that differs before one whose == raises", (base[0] + 1, EqRaises(base[1]), base[2])
    yield "an entry whose == takes a reference", (EqKeeps(objs[0]), *base[1:])


VARIANTS = [v[0] for v in expected_variants((1, 2, 1), (None,))]


@pytest.mark.parametrize("variant", VARIANTS)
def test_expected_values_of_any_kind_are_compared_alike(variant: str) -> None:
    outcomes = {}
    for name, (counts, same_counts) in IMPLS.items():
        objs = (Obj(), Obj())
        weak = (objs[0],)
        ref = weakref.ref(objs[0])  # so the weak count is 1
        expected = dict(expected_variants(counts(objs, weak), objs))[variant]
        try:
            outcomes[name] = same_counts(objs, weak, expected)
        except RuntimeError as exc:
            outcomes[name] = f"RuntimeError: {exc}"
        del ref
    assert len(set(outcomes.values())) == 1, outcomes
    want = {"the baseline": True, "a float equal to the count": True, "an int subclass equal to anything": True,
            "a bool for a count of 1": True, "an entry whose == takes a reference": True,
            "an int subclass whose == raises": "RuntimeError: no comparing"}.get(variant, False)
    assert outcomes.popitem()[1] == want


def test_more_objects_than_the_c_stack_buffer_holds_are_counted_alike() -> None:
    decided = []
    for counts, same_counts in IMPLS.values():
        objs = tuple(Obj() for _ in range(300))
        weak = objs[:100]
        refs = [weakref.ref(o) for o in objs[::7]]
        baseline = counts(objs, weak)
        assert len(baseline) == 400
        kept = objs[299]
        decided.append((same_counts(objs, weak, baseline), same_counts(objs, weak, baseline[:-1])))
        del kept
        decided.append((same_counts(objs, weak, baseline),))
        del refs
        decided.append((same_counts(objs, weak, baseline),))
    assert decided == [(False, False), (True,), (False,)] * len(IMPLS)


def test_objects_deleted_everywhere_else_are_counted_from_the_tuple_alone() -> None:
    decided = []
    for counts, same_counts in IMPLS.values():
        a, b = Obj(), Obj()
        objs = (a, b)
        ref = weakref.ref(b)
        baseline = counts(objs, objs)
        del a, b  # only the tuple holds them now
        gc.collect()
        decided.append((same_counts(objs, objs, baseline), ref() is objs[1]))
        rebuilt = counts(objs, objs)
        decided.append((same_counts(objs, objs, rebuilt),))
    assert decided == [(False, True), (True,)] * len(IMPLS)


# ------------------------------------------------------------------ through the run shells


@pytest.fixture(params=list(IMPLS))
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    counts, same_counts = IMPLS[request.param]
    for module in (shell, host):
        monkeypatch.setattr(module, "counts", counts)
        monkeypatch.setattr(module, "same_counts", same_counts)
    shell._IDLE.clear()  # baselines read by the other implementation
    yield str(request.param)
    shell._IDLE.clear()


def test_a_shell_is_reused_only_while_nothing_else_holds_its_records(impl: str) -> None:
    kept: list[Any] = []

    async def fwd(i: int, keep: bool) -> int:
        if keep:
            kept.append(get_ubatch())
        await dbo_yield("y")
        return i

    async def main() -> list[bool]:
        reused = []
        for keep in (False, False, True, False, False):
            before = list(shell._IDLE.get(2, ()))
            assert await run_ubatches(fwd, [(0, keep), (1, keep)], backend="host") == [0, 1]
            reused.append(shell._IDLE.get(2, []) == before and bool(before))
        return reused

    # the first run builds a shell; the next reuses it; a record kept past its run drops it, and a
    # new one is built and kept by the run after
    assert asyncio.run(main()) == [False, True, False, False, True]
    assert len(kept) == 2
