"""The DBO yield and switch primitives, declared once: one row each, under vLLM's names.

A row gives the name, the kind (:data:`asyncdbo.dbo.kinds.Kind`), the stream move (``src`` ->
``dst``), the default tag, what a dropped ``await`` risks and the docstring. From it
:func:`~asyncdbo.dbo.kinds.declare` makes the Python reference and the C fast path, and the rows
drive the exports (``asyncdbo.dbo`` star-imports this module, which defines no other public
name; the top level keeps vLLM's seven, by name), the missing-await wording and the differential tests' list. Adding a primitive
of an existing kind is one row here and its test (docs/maintaining.md).

Outside a DBO run every primitive is a no-op: it returns a done awaitable at once.
"""

from .kinds import declare as _declare

dbo_yield = _declare(
    "dbo_yield", "yield", tag="yield", risk="overlap",
    doc="""``await dbo_yield(tag)``: hand the CPU to the next ubatch; come back after every other
    runnable ubatch had a turn. ``tag`` names the yield point in traces, stack dumps and the
    yield-discipline checker. Outside a run it returns at once.

    The hottest path in asyncdbo: a plain call that marks the ubatch (the missing-await check,
    :mod:`asyncdbo.dbo.awaits`) and returns the kernel's switch.""")

dbo_yield_and_switch_from_compute_to_comm = _declare(
    "dbo_yield_and_switch_from_compute_to_comm", "role", src="compute", dst="comm", tag="compute->comm", risk="data",
    doc="""Record compute-done, yield, then continue on the comm stream after compute-done.""")

dbo_yield_and_switch_from_comm_to_compute = _declare(
    "dbo_yield_and_switch_from_comm_to_compute", "role", src="comm", dst="compute", tag="comm->compute", risk="data",
    doc="""Record comm-done, yield, then continue on the compute stream after comm-done.

    On the host backend this parks the ubatch until its comm work has completed.""")

dbo_switch_to_comm_sync = _declare(
    "dbo_switch_to_comm_sync", "sync", dst="comm", risk="data",
    doc="""Continue on the comm stream after everything this ubatch queued on its current stream.""")

dbo_switch_to_compute_sync = _declare(
    "dbo_switch_to_compute_sync", "sync", dst="compute", risk="data",
    doc="""Continue on the compute stream after this ubatch's comm. Await it: on the host backend it
    parks the ubatch until the comm work completes.""")

dbo_switch_to_comm = _declare(
    "dbo_switch_to_comm", "plain", dst="comm", risk="nothing",
    doc="""Continue on the comm stream, with no dependency on earlier compute.""")

dbo_switch_to_compute = _declare(
    "dbo_switch_to_compute", "plain", dst="compute", risk="nothing",
    doc="""Continue on the compute stream, with no dependency on earlier comm.""")
