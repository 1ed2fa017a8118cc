"""One error root: every exception class asyncdbo defines derives from :class:`asyncdbo.AsyncDBOException`
(issue 52 item 5), and keeps the builtin base it had before, so ``except RuntimeError`` (or
``ArithmeticError``, ``AssertionError``) around asyncdbo calls catches what it always caught."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import asyncdbo
from asyncdbo import AsyncDBOException

#: exception -> the builtin base it keeps beside the root (every other one derives from the root alone)
BUILTIN_BASE: dict[str, type[BaseException]] = {
    "DBOUsageError": RuntimeError,
    "StepAborted": RuntimeError,
    "HostSyncError": RuntimeError,
    "RankError": RuntimeError,
    "NonFiniteLogitsError": ArithmeticError,
    "StreamRuleError": AssertionError,
}


def _exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(asyncdbo.__path__, "asyncdbo."):
        if info.name.startswith("asyncdbo._compat") or info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional dependency (transformers...) missing here
            continue
        for value in vars(module).values():
            if (isinstance(value, type) and issubclass(value, BaseException) and not issubclass(value, Warning)
                    and value.__module__.startswith("asyncdbo")):
                found[value.__qualname__] = value
    return found


@pytest.mark.timeout(120)
def test_every_asyncdbo_exception_derives_from_the_one_root_and_keeps_its_builtin_base() -> None:
    classes = _exception_classes()
    assert {"StepAborted", "HostSyncError", "DBOUsageError", "DeadlockError", "RecoveryVote"} <= set(classes)
    assert [name for name, cls in classes.items() if not issubclass(cls, AsyncDBOException)] == []
    for name, base in BUILTIN_BASE.items():
        assert issubclass(classes[name], base), name
