"""Which slice of the step the running ubatch holds (:func:`current_slice`): set by
:class:`~asyncdbo.serving.DBORunner` around each step's run, read by models."""

from __future__ import annotations

import contextvars

from .._core import get_ubatch
from ..plan import UBatchSlice

__all__ = ["current_slice"]

# The name of the running step's run and its plan slices, set by the runner around the run (the
# ubatches' contexts are copies of the step's): a ubatch of that run holds the slice of its index, so
# a model can tell whether its first request continues one of the previous ubatch (see
# asyncdbo.models.mini). None outside a runner step.
RUNNING_STEP: contextvars.ContextVar[tuple[str, tuple[UBatchSlice, ...]] | None] = contextvars.ContextVar(
    "asyncdbo_step_slices", default=None)


def current_slice() -> UBatchSlice | None:
    """The :class:`~asyncdbo.plan.UBatchSlice` the running ubatch of a
    :class:`~asyncdbo.serving.DBORunner` step holds (its token and request ranges, whether its
    first request continues the previous ubatch's), or None outside a runner step's ubatches (a
    run a ubatch starts of its own included). A step that falls back runs one whole-batch slice."""
    step = RUNNING_STEP.get()
    if step is None:
        return None
    ub = get_ubatch()
    if ub is None or ub.run.name != step[0]:
        return None
    return step[1][ub.id]
