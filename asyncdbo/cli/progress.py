"""Progress lines for commands that run longer than a few seconds (``check``, ``demo``, and the
benchmarks of the source tree through ``benchmarks/_progress.py``).

On a terminal, a long command first says how much it will run ("5 configurations to run") and
then keeps one status line up to date ("[2/5] 32 tokens/rank, role streams"), rewritten in place
with a carriage return and erased before the real output is printed, so the output itself reads
the same as without progress. Nothing is written when stderr is not a terminal (a pipe, a file,
CI logs) or with ``-q``: progress is for a person watching, never part of what a script parses.
"""

from __future__ import annotations

import sys
from typing import TextIO

__all__ = ["Progress", "wants_progress"]

_ERASE = "\r\033[K"  # carriage return, then erase to the end of the line


def wants_progress(quiet: bool, stream: TextIO | None = None) -> bool:
    """Progress is shown on a terminal unless ``-q`` was given."""
    stream = sys.stderr if stream is None else stream
    return not quiet and stream.isatty()


class Progress:
    """``total`` units of ``what`` (e.g. "configurations"); :meth:`step` before each unit,
    :meth:`clear` before printing real output, :meth:`done` at the end."""

    def __init__(self, total: int | None, what: str, *, enabled: bool, stream: TextIO | None = None) -> None:
        self.total = total
        self.what = what
        self.enabled = enabled
        self.stream = sys.stderr if stream is None else stream
        self._shown = False
        if enabled:  # total None: not known up front (the steps then show [index] alone)
            self.stream.write(f"{what} to run\n" if total is None else f"{total} {what} to run\n")
            self.stream.flush()

    def step(self, index: int, label: str) -> None:
        """Show ``[index/total] label`` (``index`` counts from 1, as a user counts)."""
        if self.enabled:
            count = f"[{index}]" if self.total is None else f"[{index}/{self.total}]"
            self.stream.write(f"{_ERASE}{count} {label} ...")
            self.stream.flush()
            self._shown = True

    def note(self, label: str) -> None:
        """Show ``label`` alone: a phase before or after the counted units (starting ranks,
        loading a checkpoint), rewritten in place like a step."""
        if self.enabled:
            self.stream.write(f"{_ERASE}{label} ...")
            self.stream.flush()
            self._shown = True

    def clear(self) -> None:
        """Erase the status line so the next line of output starts clean."""
        if self.enabled and self._shown:
            self.stream.write(_ERASE)
            self.stream.flush()
            self._shown = False

    def done(self) -> None:
        self.clear()
