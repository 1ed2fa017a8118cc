"""Stream backends by name: ``get_backend("host")``, and ``register_backend`` for new devices.

Backends are imported only when chosen, so ``import asyncdbo`` stays free of torch and a machine
without an accelerator never imports the accelerator backend.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .base import StreamBackend

__all__ = ["backend_names", "get_backend", "register_backend"]

# name -> "module:attribute" of a factory taking the backend's keyword options
_REGISTRY: dict[str, str | Callable[..., StreamBackend]] = {
    "host": "asyncdbo.backends.host:host_backend",
    "cuda": "asyncdbo.backends.accelerator:cuda_backend",
    "npu": "asyncdbo.backends.accelerator:npu_backend",
    "xpu": "asyncdbo.backends.accelerator:xpu_backend",
    "accelerator": "asyncdbo.backends.accelerator:AcceleratorBackend",
}  # "sim" is registered by asyncdbo/__init__.py: the sim package is above this one


# Names whose factory, called without options, returns the process's one backend of that kind
# whatever the caller's state (the host's; a device backend depends on the current device), and
# what they resolved to: a run that names its backend then resolves it with one dict lookup
# (benchmarks/run_setup.py's "backend" phase). Never "auto": it follows what torch says the
# accelerator is now, which can change (tests/backends/test_fake_device.py).
_PROCESS_SHARED = {"host"}
_RESOLVED: dict[str, StreamBackend] = {}


def register_backend(name: str, factory: str | Callable[..., StreamBackend]) -> None:
    """Make ``get_backend(name, **options)`` call ``factory(**options)`` (a callable, or a
    ``"module:attribute"`` string imported on first use)."""
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"a backend name must be a non-empty string other than 'auto' (got {name!r})")
    _REGISTRY[name] = factory
    _PROCESS_SHARED.discard(name)
    _RESOLVED.clear()


def backend_names() -> tuple[str, ...]:
    """Every name :func:`get_backend` accepts."""
    return ("auto", *_REGISTRY)


def get_backend(name: str | StreamBackend | None = "auto", **options: Any) -> StreamBackend:
    """A backend by name: ``auto`` (the accelerator if torch has one, else ``host``), ``host``,
    ``cuda``, ``npu``, ``xpu``, ``accelerator``, ``sim`` (simulated device), or one registered
    with :func:`register_backend`; a :class:`StreamBackend` instance is returned as it is."""
    if type(name) is not str:
        if isinstance(name, StreamBackend):
            return name
    elif not options and (resolved := _RESOLVED.get(name)) is not None:
        return resolved
    asked = name
    if name is None or name == "auto":
        try:
            import torch
        except ImportError:  # no torch, no accelerator: the kernel and primitives still run on the host
            acc = None
        else:
            acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        name = "host" if acc is None else acc.type
    factory = _REGISTRY.get(name) if isinstance(name, str) else None
    if factory is None:
        raise ValueError(f"unknown stream backend {name!r}; choose one of {backend_names()}")
    if isinstance(factory, str):
        spec = factory
        module, _, attr = spec.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        if _REGISTRY.get(name) == spec:  # resolved once (unless the import registered another)
            _REGISTRY[name] = factory
    backend = factory(**options)
    if not options and name in _PROCESS_SHARED and asked == name:
        _RESOLVED[asked] = backend
    return backend
