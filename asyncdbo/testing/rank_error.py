"""What a failed multi-rank call reports: every failing rank, and which one to blame first.

When one rank fails, its peers usually fail a moment later because of it: a killed rank's peers
see a closed connection, a stopped rank's peers time out, and asyncdbo's step recovery ends the
peers' steps with :class:`~asyncdbo.dist.StepAborted`. Listing the lowest failing rank first
blames a bystander (killing rank 1 of the demo printed rank 0's "raised in ubatch 1" note and hid
"rank 1 process died"). :attr:`RankError.root` orders the evidence instead:

1. a rank whose process died, or stayed stopped (SIGSTOP) for the pool's timeout;
2. a rank that raised an error of its own (not a peer's closed connection or a timeout);
3. a rank that did not answer (stopped, or stuck) while others failed;
4. a rank that raised because of a peer (closed connection, reset, time-out, ``StepAborted``);

ties go to the rank whose failure arrived first.
"""

from __future__ import annotations

import re
import traceback

from .._core import AsyncDBOException

__all__ = ["RankError", "exception_line"]

# Errors a rank raises because a peer failed or went silent, not because of anything it did.
_CONSEQUENCE = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Timed out waiting|timed out|Wait timeout|"
    r"Timeout waiting for key|WatchdogTimeout|StepAborted|Socket Timeout|no answer within",
    re.IGNORECASE,
)
_DIED, _RAISED, _SILENT, _AFTER_PEER = range(4)


def exception_line(exc: BaseException) -> str:
    """``Type: first line of the message``, as a traceback's last line shows it (without the notes
    Python 3.11 prints after it, such as asyncdbo's "raised in ubatch 1")."""
    lines = traceback.format_exception_only(type(exc), exc)
    return lines[0].strip() if lines else type(exc).__name__


class RankError(AsyncDBOException, RuntimeError):
    """One or more ranks failed: raised, died, or did not answer in time.

    ``ranks`` lists the failing ranks in order; ``details`` maps each to its remote traceback text
    (or a one-line reason for a death or a timeout); ``silent`` lists the ranks that had not
    answered when the call gave up after a failure; ``errors`` maps every rank of both to one line
    (the exception line, or the reason); ``blame_order`` lists them root cause first (module
    docstring) and ``root`` is the first.
    """

    def __init__(
        self,
        summary: str,
        details: dict[int, str],
        *,
        errors: dict[int, str] | None = None,
        died: tuple[int, ...] = (),  # died or stopped
        silent: tuple[int, ...] = (),
        order: tuple[int, ...] = (),
    ) -> None:
        self.ranks: tuple[int, ...] = tuple(sorted(details))
        self.details: dict[int, str] = dict(details)
        self.died = tuple(died)
        self.silent = tuple(silent)
        given = errors or {}
        self.errors: dict[int, str] = {r: given.get(r) or _last_line(t) for r, t in self.details.items()}
        for rank in self.silent:
            self.errors.setdefault(rank, given.get(rank) or "no answer (stopped or stuck)")
        arrival = {rank: i for i, rank in enumerate(order)}

        def rank_key(rank: int) -> tuple[int, int, int]:
            if rank in self.died:
                kind = _DIED
            elif rank in self.silent:
                kind = _SILENT
            elif _CONSEQUENCE.search(self.errors[rank]):
                kind = _AFTER_PEER
            else:
                kind = _RAISED
            return kind, arrival.get(rank, len(arrival)), rank

        self.blame_order: tuple[int, ...] = tuple(sorted(set(self.ranks) | set(self.silent), key=rank_key))
        self.root: int | None = self.blame_order[0] if self.blame_order else None
        parts = [summary]
        for rank in self.ranks:
            parts.append(f"--- rank {rank} ---\n{self.details[rank].rstrip()}")
        super().__init__("\n".join(parts))

    def root_line(self) -> str:
        """One line for a person: the root-cause rank and its error first, then who else failed."""
        if self.root is None:
            return str(self).splitlines()[0]
        line = f"rank {self.root}: {self.errors[self.root]}"
        others = [r for r in self.blame_order if r != self.root]
        if others:
            line += f" (then rank(s) {others} failed too)"
        return line


def _last_line(text: str) -> str:
    """A traceback text's exception line (its last unindented ``Name: message`` line that is not
    an asyncdbo note), or the text itself when it is a one-line reason."""
    lines = [ln for ln in text.strip().splitlines() if ln and not ln[0].isspace()]
    found = [
        ln for ln in lines
        if ":" in ln and " " not in ln.split(":", 1)[0] and not ln.startswith(("Traceback", "asyncdbo:"))
    ]
    return found[-1] if found else (lines[-1] if lines else text.strip())


RankError.__module__ = "asyncdbo.testing"  # tracebacks print the public path, not this private module
