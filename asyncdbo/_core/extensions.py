"""Where asyncdbo's optional C extensions are loaded: one switch and one fallback for all of them.

Each extension (``asyncdbo/_core/_spin.c``, ``asyncdbo/dbo/_speedups.c``) is a fast path of code
that also exists in Python, which stays the reference. An extension is missing where the install
had no C compiler; ``ASYNCDBO_PURE_PYTHON=1`` (read at import) leaves every one unloaded.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["load_extension"]


def load_extension(name: str) -> ModuleType | None:
    """The extension module ``name``, or None where it was not built or pure Python is asked for."""
    if os.environ.get("ASYNCDBO_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None
