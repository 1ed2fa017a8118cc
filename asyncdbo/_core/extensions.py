"""Where asyncdbo's optional C extensions are loaded: one switch and one fallback for all of them.

Each extension is a fast path of code that also exists in Python, which stays the reference:

* ``asyncdbo._core._spin`` (``asyncdbo/_core/_spin.c``): the kernel's switch loop;
* ``asyncdbo.dbo._speedups`` (``asyncdbo/dbo/_speedups.c``): the DBO yield and switch primitives.

An extension is missing where the install had no C compiler. Switches, read at import:
``ASYNCDBO_PURE_PYTHON=1`` leaves every one unloaded; ``ASYNCDBO_NO_C_KERNEL=1`` leaves only the
kernel loop's, ``ASYNCDBO_NO_C_PRIMITIVES=1`` only the primitives' (benchmarks/host_overhead.py
measures each share with them). On a free-threaded build running without the GIL none is loaded
(they rely on the GIL, see their ``Py_mod_gil`` comments; importing one would turn the GIL back
on), and an import that fails in any way, a warning turned into an error included (``-W error``),
leaves Python in charge instead of breaking ``import asyncdbo``.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

__all__ = ["SWITCHES", "gil_disabled", "load_extension"]

#: The environment variable that turns each extension off (besides ASYNCDBO_PURE_PYTHON).
SWITCHES = {
    "asyncdbo._core._spin": "ASYNCDBO_NO_C_KERNEL",
    "asyncdbo.dbo._speedups": "ASYNCDBO_NO_C_PRIMITIVES",
}


def _on(var: str) -> bool:
    return os.environ.get(var, "") not in ("", "0")


def gil_disabled() -> bool:
    """Whether this is a free-threaded build running without the GIL (3.13t)."""
    is_enabled = getattr(sys, "_is_gil_enabled", None)  # 3.13+
    return is_enabled is not None and not is_enabled()


def load_extension(name: str) -> ModuleType | None:
    """The extension module ``name``, or None where it was not built, was switched off, or could
    not be imported cleanly."""
    switch = SWITCHES.get(name)
    if _on("ASYNCDBO_PURE_PYTHON") or (switch is not None and _on(switch)) or gil_disabled():
        return None
    try:
        return importlib.import_module(name)
    except (ImportError, Warning):
        return None
