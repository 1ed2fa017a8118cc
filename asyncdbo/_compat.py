"""Import paths of asyncdbo 0.1 that moved in 0.2, kept working for one release.

``import asyncdbo.loop`` (or ``from asyncdbo.runner import DBORunner``) still works: a finder on
``sys.meta_path`` answers each old module name with the module that now holds its names and warns
once with a :class:`DeprecationWarning` naming the new path. Top-level names that left
``asyncdbo`` itself (``asyncdbo.Tracer``...) are answered by ``asyncdbo.__getattr__`` the same way.
Nothing here is imported by asyncdbo's own code.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

__all__ = ["MOVED_MODULES", "MOVED_NAMES", "install", "moved_name"]

#: old module -> the module that holds its names now
MOVED_MODULES: dict[str, str] = {
    "asyncdbo.loop": "asyncdbo.dbo",
    "asyncdbo.primitives": "asyncdbo.dbo",
    "asyncdbo.streams": "asyncdbo.backends",
    "asyncdbo.streams.base": "asyncdbo.backends.base",
    "asyncdbo.streams.host": "asyncdbo.backends.host",
    "asyncdbo.streams.accelerator": "asyncdbo.backends.accelerator",
    "asyncdbo.streams.links": "asyncdbo.backends.links",
    "asyncdbo.streams.sim": "asyncdbo.sim.backend",
    "asyncdbo.comm": "asyncdbo.dist.ep",
    "asyncdbo.groups": "asyncdbo.dist.groups",
    "asyncdbo.runner": "asyncdbo.serving",
    "asyncdbo.trace": "asyncdbo.observe",
    "asyncdbo.timeline": "asyncdbo.observe.timeline",
    "asyncdbo.checks": "asyncdbo.dbo.debug",
    "asyncdbo.debug": "asyncdbo.observe.stacks",
    "asyncdbo.launch": "asyncdbo.testing.ranks",
    "asyncdbo.demo": "asyncdbo.cli.demo",
    "asyncdbo.trace_cli": "asyncdbo.cli.trace",
    "asyncdbo.sim.check": "asyncdbo.cli.check",
    "asyncdbo.hf": "asyncdbo.moe.hf",
    "asyncdbo.backends.syncs": "asyncdbo.syncs",  # a sync detector, not a backend: a room of its own
}

#: top-level name that left ``asyncdbo`` -> the module that exports it now
MOVED_NAMES: dict[str, str] = {
    "Instrument": "asyncdbo.lowlevel",
    "Signal": "asyncdbo.lowlevel",
    "RecvHookHandle": "asyncdbo.dbo",
    "LinkSpec": "asyncdbo.backends",
    "StreamBackend": "asyncdbo.backends",
    "get_backend": "asyncdbo.backends",
    "link_spec": "asyncdbo.backends",
    "install_stack_dump_signal": "asyncdbo.observe",
    "RunNumbers": "asyncdbo.observe",
    "Tracer": "asyncdbo.observe",
    "MoEConfig": "asyncdbo.moe",
    "MoELayer": "asyncdbo.moe",
    "moe_from_hf": "asyncdbo.moe.hf",
    "AttentionMetadata": "asyncdbo.plan",
    "PlanReason": "asyncdbo.plan",
    "PlanStats": "asyncdbo.plan",
    "StepPlan": "asyncdbo.plan",
    "StepRecord": "asyncdbo.plan",
    "UBatchSlice": "asyncdbo.plan",
    "plan_step": "asyncdbo.plan",
    "DBORunner": "asyncdbo.serving",
    "RunnerConfig": "asyncdbo.serving",
    "RankPool": "asyncdbo.testing",
    "run_ranks": "asyncdbo.testing",
}


def moved_name(name: str) -> Any:
    """``asyncdbo.<name>`` for a name that moved: warn, then return it from its new module."""
    module = MOVED_NAMES[name]
    warnings.warn(
        f"asyncdbo.{name} moved to {module}.{name} in asyncdbo 0.2; the old name goes away in 0.3",
        DeprecationWarning,
        stacklevel=3,
    )
    return getattr(importlib.import_module(module), name)


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old module name with the new module object itself (so ``from old import name``
    and ``isinstance`` checks see the very same objects)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new} in asyncdbo 0.2; import from {new} (the old path goes away in 0.3)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        return None


_FINDER = _Alias()


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once). First, because an old package path that
    is now an alias (``asyncdbo.streams``) would otherwise let the path finder load its old
    submodules (``asyncdbo.streams.host``) a second time from the new package's folder."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
