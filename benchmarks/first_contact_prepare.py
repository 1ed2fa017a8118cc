#!/usr/bin/env python3
"""Fill the folder that ``benchmarks/first_contact.py`` carries to the GPU machine (``.whl``), here,
before the session: what its ``tests`` step needs that the device image may lack, and what the
device cannot make for itself (it has no registry and no ``.git``).

* the wheels of pytest-asyncio and pytest-timeout for CPython 3.12, at the versions installed
  here (the ones the suite runs with), from this machine's package index;
* the C extensions built for the device's Python (3.12, given by ``--python``): they are
  gitignored, so without them the device would run the pure-Python kernel loop and primitives and
  its host figures would not be the shipped ones; ``first_contact.py`` puts them in place there
  when they match its Python and the sources they were built from;
* ``prepared.json``: the commit (and whether the tree differed from it), a hash of the C sources,
  the interpreter and the wheels, written now because no ``.git`` travels.

    python3 benchmarks/first_contact_prepare.py                      # .whl, Python 3.12 from pyenv
    python3 benchmarks/first_contact_prepare.py --python /path/to/python3.12 --no-wheels
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: what setup.py compiles (and includes): a change to any of them makes a carried build stale
NATIVE_SOURCES = ("asyncdbo/_core/_spin.c", "asyncdbo/dbo/_speedups.c", "asyncdbo/_native/slots.h")
WHEELS = ("pytest-asyncio", "pytest-timeout")
NATIVE_DIR = "native"  # under the carried folder, the extensions at their package paths
PREPARED = "prepared.json"


def sources_sha256(root: Path = ROOT) -> str:
    h = hashlib.sha256()
    for rel in NATIVE_SOURCES:
        h.update(rel.encode() + b"\0" + (root / rel).read_bytes() + b"\0")
    return h.hexdigest()


def default_python() -> str | None:
    """A Python 3.12 that runs: pyenv's own installs first (its shim on PATH may name a version
    that is not selected), then python3.12 on PATH."""
    pyenv = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    for cand in [*sorted(glob.glob(f"{pyenv}/versions/3.12*/bin/python3"), reverse=True), shutil.which("python3.12")]:
        if cand is None:
            continue
        try:
            proc = subprocess.run([cand, "-c", "import sys; print(sys.version_info[:2] == (3, 12))"], capture_output=True,
                                  text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if proc.stdout.strip() == "True":
            return cand
    return None


def commit_info() -> dict[str, object]:
    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout.strip() if proc.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def download_wheels(dest: Path) -> list[str]:
    pins = [f"{name}=={metadata.version(name)}" for name in WHEELS]
    for old in dest.glob("*.whl"):
        if any(old.name.lower().startswith(name.replace("-", "_") + "-") for name in WHEELS):
            old.unlink()  # one version of each: two stop the whole install there
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "-d", str(dest), *pins], check=True)
    return sorted(p.name for p in dest.glob("*.whl"))


def build_native(python: str, dest: Path) -> dict[str, object]:
    """Both extensions built by setup.py with ``python`` (in a throwaway venv that has setuptools),
    from a copy of the sources, into ``dest/native/<package path>``."""
    with tempfile.TemporaryDirectory(prefix="first-contact-build-") as tmp:
        venv, src = Path(tmp) / "venv", Path(tmp) / "src"
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", "setuptools"], check=True)
        for rel in ("setup.py", "pyproject.toml", *NATIVE_SOURCES):
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
        out = dest / NATIVE_DIR
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.run([str(venv / "bin/python"), "setup.py", "-q", "build_ext", "--build-lib", str(out)],
                              cwd=src, capture_output=True, text=True)
        built = sorted(str(p.relative_to(out)) for p in out.rglob("*.so"))
        if proc.returncode != 0 or len(built) != 2:
            raise SystemExit(f"building the extensions with {python} failed:\n{proc.stdout}{proc.stderr}")
        version = subprocess.run([str(venv / "bin/python"), "-c", "import platform; print(platform.python_version())"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    return {"python": version, "built": built}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=ROOT / ".whl", help="the carried folder (default: .whl)")
    ap.add_argument("--python", default=default_python(), help="the device's Python, 3.12 (default: from PATH or pyenv)")
    ap.add_argument("--no-wheels", action="store_true", help="leave the wheels as they are (no index here)")
    args = ap.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    if args.python is None:
        ap.error("no Python 3.12 found: pass --python")
    info: dict[str, object] = commit_info()
    info["wheels"] = sorted(p.name for p in args.dest.glob("*.whl")) if args.no_wheels else download_wheels(args.dest)
    info["native"] = build_native(args.python, args.dest)
    info["sources_sha256"] = sources_sha256()
    (args.dest / PREPARED).write_text(json.dumps(info, indent=1) + "\n")
    size = sum(p.stat().st_size for p in args.dest.rglob("*") if p.is_file())
    print(json.dumps({**info, "carried_bytes": size}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
