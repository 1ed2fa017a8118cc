"""The C sources build from an sdist: every local header they include is shipped (MANIFEST.in)
and listed as a dependency of each extension that includes it (setup.py), so editing it rebuilds."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "asyncdbo/_core/_spin.c", ROOT / "asyncdbo/dbo/_speedups.c"]


def test_every_local_header_is_shipped_and_a_dependency() -> None:
    manifest = (ROOT / "MANIFEST.in").read_text()
    setup = (ROOT / "setup.py").read_text()
    headers = {h for src in SOURCES for h in re.findall(r'#include "([^"]+)"', src.read_text())}
    assert headers == {"slots.h"}
    for header in headers:
        path = f"asyncdbo/_native/{header}"
        assert (ROOT / path).is_file()
        assert f"include {path}" in manifest
        assert 'HEADERS = [f"{NATIVE}/slots.h"]' in setup and 'NATIVE = "asyncdbo/_native"' in setup
