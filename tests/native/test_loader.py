"""How the extensions are loaded (asyncdbo/_core/extensions.py): a switch for all of them and one
for each, and an import that fails in any way (a warning raised as an error included) leaves the
Python code in charge instead of breaking ``import asyncdbo``."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest

from asyncdbo._core import extensions

CODE = (
    "import asyncdbo, asyncdbo._core.fastpath as k, asyncdbo._core.ubatch as u, asyncdbo.dbo.primitives as p;"
    "print(k.C is not None, u._Resume is not None, p.FAST is not None)"
)


def loaded(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCDBO_")}
    out = subprocess.run([sys.executable, "-c", CODE], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    return out.stdout.split()


@pytest.mark.timeout(300)
def test_each_extension_has_its_own_switch() -> None:
    if extensions.load_extension("asyncdbo._core._spin") is None or extensions.load_extension("asyncdbo.dbo._speedups") is None:
        pytest.skip("the C extensions are not built here (or a switch is set)")
    assert loaded() == ["True", "True", "True"]
    assert loaded(ASYNCDBO_NO_C_KERNEL="1") == ["False", "False", "True"]
    assert loaded(ASYNCDBO_NO_C_PRIMITIVES="1") == ["True", "True", "False"]
    assert loaded(ASYNCDBO_PURE_PYTHON="1") == ["False", "False", "False"]
    assert loaded(ASYNCDBO_NO_C_KERNEL="0") == ["True", "True", "True"]


@pytest.mark.parametrize("raised", [ImportError("no such module"), RuntimeWarning("the GIL has been enabled")])
def test_an_import_that_fails_or_warns_as_an_error_leaves_python_in_charge(
    raised: BaseException, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(name: str) -> None:
        raise raised

    monkeypatch.setattr(importlib, "import_module", fail)
    assert extensions.load_extension("asyncdbo._core._spin") is None


def test_no_extension_on_a_free_threaded_build_running_without_the_gil(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both extensions declare that they need the GIL; importing one would turn it back on."""
    monkeypatch.setattr(sys, "_is_gil_enabled", lambda: False, raising=False)
    assert extensions.load_extension("asyncdbo._core._spin") is None
    assert extensions.load_extension("asyncdbo.dbo._speedups") is None
