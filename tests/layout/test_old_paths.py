"""asyncdbo 0.1's import paths keep working for one release, each with a DeprecationWarning that
names the new path; the objects they give are the very same ones."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import asyncdbo
from asyncdbo._compat import MOVED_MODULES, MOVED_NAMES


@pytest.mark.timeout(120)
def test_every_old_module_path_warns_and_is_the_new_module() -> None:
    """In a fresh interpreter (a module imported once is cached and would not warn again), each
    old path, parents first, warns once naming its new path and gives the new module itself."""
    code = (
        "import importlib, warnings\n"
        "from asyncdbo._compat import MOVED_MODULES\n"
        "for old in sorted(MOVED_MODULES):\n"
        "    new = importlib.import_module(MOVED_MODULES[old])\n"
        "    with warnings.catch_warnings(record=True) as seen:\n"
        "        warnings.simplefilter('always')\n"
        "        got = importlib.import_module(old)\n"
        "    print(old, got is new, [str(w.message) for w in seen if w.category is DeprecationWarning])\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110, check=False)
    assert proc.returncode == 0, proc.stderr
    expected = [
        f"{old} True ['{old} moved to {new} in asyncdbo 0.2; import from {new} (the old path goes away in 0.3)']"
        for old, new in sorted(MOVED_MODULES.items())
    ]
    assert proc.stdout.splitlines() == expected


@pytest.mark.parametrize("name", sorted(MOVED_NAMES))
def test_an_old_top_level_name_warns_and_is_the_same_object(name: str) -> None:
    new = MOVED_NAMES[name]
    with pytest.warns(DeprecationWarning) as record:
        value = getattr(asyncdbo, name)
    assert str(record[0].message) == f"asyncdbo.{name} moved to {new}.{name} in asyncdbo 0.2; the old name goes away in 0.3"
    assert record[0].filename == __file__  # the warning points at the caller's line
    assert value is getattr(importlib.import_module(new), name)


def test_the_top_level_is_the_small_public_api() -> None:
    assert len(asyncdbo.__all__) <= 31  # 30, and the one error root (issue 52)
    assert set(asyncdbo.__all__).isdisjoint(MOVED_NAMES)
    for name in asyncdbo.__all__:
        getattr(asyncdbo, name)
    with pytest.raises(AttributeError, match=r"module 'asyncdbo' has no attribute 'nonsense'"):
        asyncdbo.nonsense  # noqa: B018
