"""Observing DBO runs: the tracer (spans, numbers, hidden comm), Chrome/Perfetto export, PNG
timelines, stack dumps of live runs, and the yield-discipline checker.

:mod:`asyncdbo.observe.tracer` and :mod:`~asyncdbo.observe.chrome` import nothing heavy;
:mod:`~asyncdbo.observe.timeline` needs matplotlib (the ``plot`` extra).
"""

from ..dbo.debug import YieldChecker
from .chrome import chrome_trace, merge_traces, write_traces
from .intervals import hidden_seconds, union_seconds
from .spans import RunNumbers, Span
from .stacks import dump_stacks, install_stack_dump_signal, live_runs
from .tracer import StepRecorder, Tracer

__all__ = [
    "RunNumbers",
    "Span",
    "StepRecorder",
    "Tracer",
    "YieldChecker",
    "chrome_trace",
    "dump_stacks",
    "hidden_seconds",
    "install_stack_dump_signal",
    "live_runs",
    "merge_traces",
    "union_seconds",
    "write_traces",
]
