"""``asyncdbo bench`` moved: the switch-cost benchmark lives in the source tree's benchmarks/."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_arguments", "main", "moved"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No flags: every invocation only says where the benchmark went."""


def main(args: argparse.Namespace) -> int:
    return moved()


def moved() -> int:
    print(
        "asyncdbo bench: moved to the source tree's benchmarks/switch_cost.py (it measures against a copy "
        "of the kernel's hot loop, which is not library code): git clone the repository, then run "
        "`python benchmarks/switch_cost.py --quick` from its root",
        file=sys.stderr,
    )
    return 2
