"""``asyncdbo demo | bench | trace | check``: one entry point, each subcommand in its own module.

Subcommand modules are imported only when chosen, so ``asyncdbo --help`` stays fast and a missing
optional extra (matplotlib for PNGs) only matters to the command that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["main"]

# name -> (module, help). Each module defines add_arguments(parser) and main(args) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("asyncdbo.cli.demo", "run the DP+EP MoE model on W local ranks, serial vs DBO, and print the table"),
    "trace": ("asyncdbo.cli.trace", "render an exported trace JSON as a PNG timeline and print its numbers"),
    "check": ("asyncdbo.cli.check", "predict DBO gain on a simulated device and link (no GPU needed)"),
    "bench": ("asyncdbo.cli.bench", "moved to benchmarks/switch_cost.py in the source tree"),
}


def main(argv: Sequence[str] | None = None) -> int:
    as_program = argv is None  # the process's own entry point (not a caller in a bigger program)
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    if chosen != "demo":
        return _main(argv, chosen)
    if as_program and _launched_by_torchrun(argv):
        # First of all, before the stack-dump handler that marks a rank as started: a torchrun
        # worker ends with its agent. Armed later, an agent killed meanwhile (during the imports)
        # leaves the worker orphaned: its parent pid is then the reaper's, which looks alive.
        from ..testing.process import exit_with_parent

        exit_with_parent()
    # Before the demo imports torch or starts a rank: from here to exit, SIGUSR1 prints this
    # process's stacks instead of ending it (a torchrun worker is a rank itself).
    from ..observe.stacks import install_stack_dump_signal

    uninstall = install_stack_dump_signal()
    try:
        return _main(argv, chosen)
    finally:
        if not as_program:
            uninstall()


def _launched_by_torchrun(argv: list[str]) -> bool:
    """``demo --launcher env`` (one rank of a torchrun job), read before argparse runs."""
    return "--launcher=env" in argv or any(a == "--launcher" and b == "env" for a, b in zip(argv, argv[1:]))


def _main(argv: list[str], chosen: str | None) -> int:
    parser = argparse.ArgumentParser(prog="asyncdbo", description="Dual Batch Overlap on asyncio coroutines")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    if chosen == "bench":  # moved out of the library: say where, whatever its old flags were
        from .bench import moved

        return moved()
    for name, (modname, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            mod = importlib.import_module(modname)
            mod.add_arguments(p)
            p.set_defaults(_main=mod.main)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(args._main(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
