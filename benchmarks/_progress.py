"""Progress for the benchmarks: the status line asyncdbo's own commands keep
(:mod:`asyncdbo.cli.progress`), on stderr, only on a terminal, never with ``-q``.

A benchmark calls :func:`start` once (after parsing its flags, with ``add_quiet_flag``'s
``--quiet``), :func:`step` before each unit of work (a case, a cell, a round) and :func:`done`
before it prints or writes its results. Results go to stdout and files as before: progress is
for a person watching, never part of what a script parses.
"""

from __future__ import annotations

import argparse

from asyncdbo.cli.progress import Progress, wants_progress

__all__ = ["add_quiet_flag", "done", "start", "step"]

_bar = Progress(None, "", enabled=False)
_count = 0


def add_quiet_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress lines (they are only written to a terminal anyway)")


def start(quiet: bool, what: str, total: int | None = None) -> None:
    """``total`` units of ``what`` (None: not known up front)."""
    global _bar, _count
    _bar = Progress(total, what, enabled=wants_progress(quiet))
    _count = 0


def step(label: str) -> None:
    """The next unit begins: ``[i/total] label ...`` (or ``[i] label ...``)."""
    global _count
    _count += 1
    _bar.step(_count, label)


def done() -> None:
    _bar.done()
