"""One forked child per case, for the native tests' case scripts (_start_cases.py, _adversarial.py).

``python SCRIPT --each CASE...`` imports the package once, then forks one child per case; each
child then runs its case exactly as ``python SCRIPT CASE`` would from there (its stdout and stderr
going to files, its own interpreter exit at the end), so a crash, a hang or an error ends that child
only and the driver reports it as that case's outcome. The driver prints one JSON object: case ->
``{"status": the child's exit status (negative: the signal that ended it), "stdout": ..., "stderr":
...}``. What this saves is the start of a fresh interpreter per case (a few tenths of a second each,
over thirty of them in tests/native).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any


def fork_each(cases: list[str], limit_s: int) -> str | None:
    """In each child: its case, with fds 1 and 2 on its own files and an alarm (SIGALRM ends it)
    after ``limit_s``; the caller runs the case and exits normally. In the driver, after every
    child has ended: ``None``, the report printed."""
    folder = Path(tempfile.mkdtemp(prefix="fork-each-"))
    report: dict[str, dict[str, object]] = {}
    for i, case in enumerate(cases):
        out, err = folder / f"{i}.out", folder / f"{i}.err"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for fd, path in ((1, out), (2, err)):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
            signal.alarm(limit_s)
            return case
        _, status = os.waitpid(pid, 0)
        report[case] = {"status": os.waitstatus_to_exitcode(status), "stdout": out.read_text(),
                        "stderr": err.read_text()}
        out.unlink()
        err.unlink()
    folder.rmdir()
    json.dump(report, sys.stdout)
    return None


def outcome(case: str, child: dict[str, Any], limit_s: int) -> Any:
    """The case's JSON output, or an ``AssertionError`` naming how its child ended."""
    status = child["status"]
    if status == -signal.SIGALRM:
        raise AssertionError(f"{case}: still running after {limit_s} s (ended by SIGALRM)\n{str(child['stderr'])[-3000:]}")
    assert status == 0, f"{case}: exit status {status}\n{str(child['stderr'])[-3000:]}"
    return json.loads(str(child["stdout"]))
