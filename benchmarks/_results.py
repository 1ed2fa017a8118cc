"""What every results file in benchmarks/results/ opens with, and where it goes: the machine (CPU,
cores, versions, load average at the start), the exact command, and the next free file name."""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["hardware_tag", "machine_info", "publish_results", "results_preamble", "results_stem"]


def machine_info() -> dict[str, str]:
    """What a result file must name: CPU model and cores, kernel, and the versions that matter."""
    import os
    import platform

    model = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    info = {
        "cpu": model,
        "cores": str(os.cpu_count()),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }
    for mod in ("torch", "uvloop"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = "not installed"
    import torch

    info["torch threads"] = str(torch.get_num_threads())
    info["accelerator"] = str(getattr(torch, "accelerator", None) and torch.accelerator.current_accelerator())
    return info


def hardware_tag(info: dict[str, str]) -> str:
    """Short name for result files: ``cpu-2c`` or ``cuda-<gpu>``."""
    acc = info.get("accelerator", "None")
    if acc not in ("None", ""):
        return acc.replace(":", "")
    return f"cpu-{info['cores']}c"


def results_preamble(title: str, command: str, machine_label: str = "Machine") -> tuple[list[str], dict[str, str]]:
    """The opening lines every results file carries (title, machine with its load average at the
    start, the exact command) and the machine info they came from."""
    import os

    info = machine_info()
    info["load average at start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [
        f"# {title}\n",
        f"{machine_label}: " + ", ".join(f"{k} {v}" for k, v in info.items()) + "\n",
        f"Command: `{command}` at {_commit()}\n",
    ]
    return lines, info


def _commit() -> str:
    """The checkout's commit, with ``+changes`` when the package or the benchmarks differ from it."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "asyncdbo", "benchmarks")
    except (OSError, subprocess.SubprocessError):
        return "an unknown commit (no git)"
    return f"{head}{'+changes' if dirty else ''}" if head else "an unknown commit (not a git checkout)"


def results_stem(out: Any, theme: str, info: dict[str, str]) -> Any:
    """``out/<theme>_<hardware>_<date>[_runN]`` (a ``pathlib.Path`` without suffix), the first one
    with no ``.md`` yet: earlier runs of the day stay, since noisy machines need more than one."""
    import datetime
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    base = f"{theme}_{hardware_tag(info)}_{datetime.date.today().isoformat()}"
    stem, n = out / base, 2
    while stem.with_suffix(".md").exists():
        stem, n = out / f"{base}_run{n}", n + 1
    return stem


def publish_results(text: str, out: Any, theme: str, info: dict[str, str]) -> None:
    """Print a results report, and write it to the next free results file when ``out`` is set."""
    print(text)
    if out is not None:
        path = results_stem(out, theme, info).with_suffix(".md")
        path.write_text(text)
        print(f"wrote {path}", file=sys.stderr)
