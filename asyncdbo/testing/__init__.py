"""Tools for testing DBO code: yield assertions inside a ubatch, and pools of real
torch.distributed ranks on this machine.

* :func:`assert_yields` / :func:`assert_no_yields`: a block hands over exactly where expected.
* :class:`RankPool` / :func:`run_ranks`: worker processes joined into one gloo group on
  127.0.0.1, reused across calls, failing in bounded time (:class:`RankError`).
* :class:`~asyncdbo.lowlevel.VirtualClock`: timers and watchdogs in no wall time.
"""

from ..lowlevel import VirtualClock
from .ranks import RankError, RankPool, free_port, rank_world, run_ranks
from .yields import assert_no_yields, assert_yields

__all__ = [
    "RankError",
    "RankPool",
    "VirtualClock",
    "assert_no_yields",
    "assert_yields",
    "free_port",
    "rank_world",
    "run_ranks",
]
