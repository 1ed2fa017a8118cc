"""Type checks of the configs' fields and flags (:class:`~asyncdbo.plan.ThresholdConfig`,
:func:`~asyncdbo.plan.plan_step`'s flags, :class:`~asyncdbo.serving.AutoConfig`,
:class:`~asyncdbo.serving.RunnerConfig`), each a TypeError naming the field, the value and the fix,
and the one range check they share (:func:`check_finite`, a ValueError).
They live in :mod:`asyncdbo.plan`, the lowest package that takes such input: serving imports plan,
plan imports no other package of asyncdbo.

The range checks stay with each config; these come first, so that a value of the wrong type gets
a message about its type, not a comparison error (``"0.03" <= 1.0``) or, worse, no error at all:
``True`` is an int to Python (``samples=True`` ran as one sample), and any truthy value would pass
for ``enabled``."""

from __future__ import annotations

import math
from numbers import Integral, Real

__all__ = ["check_bool", "check_config", "check_finite", "check_int", "check_number"]


def _parsed(value: object, kind: type) -> object | None:
    """``value`` as ``kind`` where it spells a finite one (a str read from a file or the environment,
    an integral float for an int), else None: the fix the message suggests."""
    try:
        if isinstance(value, str):
            out = kind(value.strip())
        elif kind is int and isinstance(value, float) and value.is_integer():
            out = int(value)
        else:
            return None
    except (ValueError, OverflowError):
        return None
    # "nan" and "inf" parse, but no field takes them: the range check would refuse the suggested fix
    return out if not isinstance(out, float) or math.isfinite(out) else None


def _type(value: object) -> str:
    """The type's name in a message: numpy's scalars say so (numpy's bool is named bool)."""
    t = type(value)
    return f"numpy.{t.__name__}" if t.__module__ == "numpy" else t.__name__


def _write(name: str, fix: object | None, example: object) -> str:
    return f"write {name}={fix!r}" if fix is not None else f"write e.g. {name}={example!r}"


def _numpy_bool(value: object) -> bool:
    """Whether ``value`` is numpy's bool scalar (what a numpy comparison gives; no numpy import)."""
    return type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")


def check_bool(owner: str, name: str, value: object, *, none: str = "") -> None:
    """Raise TypeError unless ``value`` is True or False, Python's or numpy's (or None, where
    ``none`` says what None means)."""
    if isinstance(value, bool) or _numpy_bool(value) or (none and value is None):
        return
    allowed = f"True, False or None ({none})" if none else "True or False"
    raise TypeError(f"{owner}{name} must be {allowed}, got {_type(value)} {value!r}; use True or False")


def check_int(owner: str, name: str, value: object, example: int) -> None:
    """Raise TypeError unless ``value`` is an integer, Python's or another integral type's such as
    numpy's (a bool is not one here)."""
    if isinstance(value, Integral) and not isinstance(value, bool) and not _numpy_bool(value):
        return
    fix = _parsed(value, int)
    why = " (True and False are not counts)" if isinstance(value, bool) or _numpy_bool(value) else ""
    raise TypeError(f"{owner}{name} must be an int, got {_type(value)} {value!r}{why}; {_write(name, fix, example)}")


def check_number(owner: str, name: str, value: object, example: float, *, none: str = "") -> None:
    """Raise TypeError unless ``value`` is a real number, not a bool (or None, where ``none`` says
    what None means)."""
    if (isinstance(value, Real) and not isinstance(value, bool)) or (none and value is None):
        return
    fix = _parsed(value, float)
    allowed = f"a number or None ({none})" if none else "a number"
    raise TypeError(f"{owner}{name} must be {allowed}, got {_type(value)} {value!r}; {_write(name, fix, example)}")


def check_finite(name: str, value: float | None, meaning: str, fix: str) -> None:
    """Raise ValueError where ``value`` is infinite (or nan), saying what it would mean and the fix.
    For fields whose range check lets ``inf`` through (``>= 0``, ``> 0``): an infinite share or
    ratio is never reached, which is what None says where the field takes it, or nothing useful
    where it does not; call it after the range check, whose message nan and -inf keep."""
    if value is not None and not math.isfinite(value):
        raise ValueError(f"{name} ({value}) must be finite: {meaning}; {fix}")


def check_config(where: str, field: str, value: object, cls: type, qualname: str, example: str) -> None:
    """Raise TypeError unless ``value`` is a ``cls`` (``qualname``: its public name, e.g.
    ``"asyncdbo.plan.ThresholdConfig"``): a config field given a dict or a number otherwise fails
    where it is first read, with an AttributeError deep in the code. The message writes the fix out,
    a dict's items as keywords, else ``example``."""
    if isinstance(value, cls):
        return
    fix = (f"{cls.__name__}({', '.join(f'{k}={v!r}' for k, v in value.items())})" if isinstance(value, dict)
           else example)
    raise TypeError(f"{where} must be an {qualname}, got {type(value).__name__} {value!r}; write {field}={fix}")
