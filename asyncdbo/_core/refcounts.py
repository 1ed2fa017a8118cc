"""Reference counts of a set of objects, read to tell that nothing else came to refer to them.

A run shell (:mod:`asyncdbo.dbo.shell`) and the streams the host backend keeps for the next run
(:meth:`asyncdbo.backends.HostBackend.keep`) are reused only while their objects' counts are what
they were when they were built idle: ``counts`` reads that baseline, ``same_counts``
compares every run's end with it. Each count of ``objs`` is that object's reference count, each of
``weak`` its number of weak references, in that order, all of them read before any comparison.
The numbers are for comparing with each other only: the C extension (``asyncdbo/_core/_spin.c``,
what an install with a compiler runs) reads a strong count without holding the object itself,
:func:`sys.getrefcount` with one more reference, so a baseline is compared with the function that
made it: :mod:`asyncdbo._core.fastpath` picks one, once, at import, as its ``counts`` and
``same_counts`` (what the run shells and the host backend call).

The functions below are the references (what runs where the extension is not loaded);
tests/native/test_refcounts.py checks that both decide alike on the same changes, bad arguments
included.
"""

from __future__ import annotations

import sys
import weakref

__all__ = ["py_counts", "py_same_counts"]

_refcount, _weakcount = sys.getrefcount, weakref.getweakrefcount


def py_counts(objs: tuple[object, ...], weak: tuple[object, ...]) -> tuple[int, ...]:
    """The reference count of each of ``objs``, then the weak reference count of each of ``weak``
    (the twin of the C ``counts``)."""
    if type(objs) is not tuple or type(weak) is not tuple:
        raise TypeError(f"counts(): objs and weak must be tuples (got {type(objs).__name__} and {type(weak).__name__})")
    return (*map(_refcount, objs), *map(_weakcount, weak))


def py_same_counts(objs: tuple[object, ...], weak: tuple[object, ...], expected: object) -> bool:
    """Whether ``py_counts(objs, weak) == expected``; False at once when ``expected`` is not a
    tuple (exactly) of as many entries (the twin of the C ``same_counts``)."""
    if type(objs) is not tuple or type(weak) is not tuple:
        raise TypeError(
            f"same_counts(): objs and weak must be tuples (got {type(objs).__name__} and {type(weak).__name__})"
        )
    if type(expected) is not tuple or len(expected) != len(objs) + len(weak):
        return False
    return (*map(_refcount, objs), *map(_weakcount, weak)) == expected

