"""The kernel's public face, for tool and backend writers (trio's ``trio.lowlevel`` idea).

An :class:`Instrument` receives the kernel's :class:`DBORun` and :class:`UBatch` records; a stream
backend attaches to a :class:`DBORun`; a custom awaitable parks a ubatch on a :class:`Signal`.
Model code never needs this module: the primitives in :mod:`asyncdbo` are its whole interface.
"""

from ._core import (
    SWITCH,
    Clock,
    DBORun,
    Fanout,
    Instrument,
    MonotonicClock,
    Signal,
    UBatch,
    UBatchState,
    VirtualClock,
    current_ubatch,
    get_ubatch,
    switch,
    trap,
)

__all__ = [
    "SWITCH",
    "Clock",
    "DBORun",
    "Fanout",
    "Instrument",
    "MonotonicClock",
    "Signal",
    "UBatch",
    "UBatchState",
    "VirtualClock",
    "current_ubatch",
    "get_ubatch",
    "switch",
    "trap",
]
