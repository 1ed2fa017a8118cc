"""The DBO loop core: scheduler, the one trap, per-ubatch context, stack printer.

Nothing here imports torch or knows about streams, comm or models; everything else in asyncdbo
is built on this package's names (curio's rule: new features go outside the kernel).
"""

from .context import UBatch, current_ubatch, get_ubatch
from .errors import AsyncDBOError, DeadlockError, NoOverlapWarning, WatchdogTimeout, YieldMismatchError
from .scheduler import DBORun, Fanout, Instrument
from .stacks import await_chain, format_run, format_ubatch
from .traps import SWITCH, Signal, trap

__all__ = [
    "SWITCH",
    "AsyncDBOError",
    "DBORun",
    "DeadlockError",
    "Fanout",
    "Instrument",
    "NoOverlapWarning",
    "Signal",
    "UBatch",
    "WatchdogTimeout",
    "YieldMismatchError",
    "await_chain",
    "current_ubatch",
    "format_run",
    "format_ubatch",
    "get_ubatch",
    "trap",
]
