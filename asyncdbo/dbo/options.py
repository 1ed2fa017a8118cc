"""The options of a DBO run (:class:`DBOOptions`) and how keyword options become one, cached by
call site (``run_ubatches(fn, args, backend="host", debug=True)`` builds its options once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from numbers import Real
from typing import Any

from .._core import LOOP_POLL_S, Clock, Instrument
from ..backends import StreamBackend, StreamPolicy

__all__ = ["DBOOptions", "check_instrument"]


@dataclass(frozen=True, kw_only=True)
class DBOOptions:
    """Options of one DBO run.

    backend: a :class:`StreamBackend` or its name (``auto``: the accelerator if torch has one, else
        ``host``). stream_policy: ``role`` (vLLM: shared compute + comm streams) or ``ubatch`` (CANN:
        a stream per ubatch). watchdog_s: fail with the ubatch stacks when every ubatch stays parked
        this long (default 300 s, so that no wait inside a run is unbounded; a rank that fails
        tells its peers at once anyway, see :mod:`asyncdbo.dist.recovery`; None or inf: no bound). instrument: scheduler hooks (tracing, checks), one or a
        sequence. debug: also run the yield-discipline checker (asyncdbo.dbo.debug.YieldChecker), which
        reports the first place the ubatches' yield-tag sequences diverge. name: shows in errors
        and traces. clock: the time source of timers and the watchdog (default: real monotonic
        time; ``asyncdbo.lowlevel.VirtualClock()`` for tests that must take no wall time).
        debug: also make every dropped awaitable an error naming its line, report steps that block
        the CPU for more than ``blocking_s`` (None: don't), and fail a run whose ubatches share a
        process group (see :mod:`asyncdbo.dbo.debug`). loop_poll_s: while a ubatch waits on the
        event loop (a sleep, a future) and others keep switching, let the loop run this often.
    """

    backend: str | StreamBackend | None = "auto"
    stream_policy: StreamPolicy = "role"
    watchdog_s: float | None = 300.0
    instrument: Instrument | Sequence[Instrument] | None = None
    debug: bool = False
    name: str | None = None
    clock: Clock | None = None
    blocking_s: float | None = 0.01
    loop_poll_s: float = LOOP_POLL_S

    def __post_init__(self) -> None:
        for name, optional in (("watchdog_s", True), ("blocking_s", True), ("loop_poll_s", False)):
            value = getattr(self, name)
            if type(value) is float or (value is None and optional):  # the common cases, without the ABC check
                continue
            if isinstance(value, bool) or not isinstance(value, Real):
                raise TypeError(f"{name} must be a number of seconds{' or None' if optional else ''} "
                                f"(got {value!r} of type {type(value).__name__}); {_seconds_fix(name, value)}")
        for name, kinds, want in (("debug", bool, "True or False"), ("name", (str, type(None)), "a str or None")):
            if not isinstance(getattr(self, name), kinds):
                raise TypeError(f"{name} must be {want} (got {getattr(self, name)!r} of type {type(getattr(self, name)).__name__})")
        if self.stream_policy not in ("role", "ubatch"):
            raise ValueError(f"stream_policy must be 'role' or 'ubatch' (got {self.stream_policy!r})")
        if self.watchdog_s is not None and not self.watchdog_s > 0:
            raise ValueError(f"watchdog_s must be > 0 seconds or None (got {self.watchdog_s!r})")
        if self.blocking_s is not None and not self.blocking_s > 0:
            raise ValueError(f"blocking_s must be > 0 seconds or None (got {self.blocking_s!r})")
        if not 0 < self.loop_poll_s < float("inf"):
            raise ValueError(f"loop_poll_s must be a positive number of seconds (got {self.loop_poll_s!r})")
        check_instrument(self.instrument)


def check_instrument(insts: object) -> None:
    """Raise TypeError unless ``insts`` is an Instrument, a sequence of them, or None."""
    if type(insts) in (list, tuple) and all(isinstance(i, Instrument) for i in insts):  # type: ignore[attr-defined]
        return
    if insts is not None and not isinstance(insts, Instrument):
        if isinstance(insts, (str, bytes)) or not isinstance(insts, Sequence) or not all(
            isinstance(i, Instrument) for i in insts
        ):
            raise TypeError(
                f"instrument must be an asyncdbo.lowlevel.Instrument, a list of them, or None (got {insts!r}); "
                "subclass Instrument and override the hooks you need"
            )


def _seconds_fix(name: str, value: object) -> str:
    """``watchdog_s="5"`` (read from a config file or the environment) gets ``write watchdog_s=5.0``."""
    if isinstance(value, str):
        try:
            seconds = float(value)
        except ValueError:
            pass
        else:
            if 0 < seconds < float("inf"):
                return f"write {name}={seconds!r}"
    return f"write e.g. {name}={_SECONDS_EXAMPLE[name]!r}"


_SECONDS_EXAMPLE = {"watchdog_s": 10.0, "blocking_s": 0.01, "loop_poll_s": LOOP_POLL_S}


# The key is the keyword options in the order they were passed (a call site passes them in one
# order; another order only adds an equal entry); where one is a number or a flag, with their types
# too (1 == True, yet debug=1 is refused), in a map of its own. Names and None need no types: a
# str or None equals only a str or None (a str subclass is not plain, never a key).
_PLAIN = frozenset((str, int, float, bool, type(None)))
_OPTIONS_CACHE: dict[tuple[tuple[str, Any], ...], DBOOptions] = {}
_TYPED_OPTIONS_CACHE: dict[tuple[tuple[tuple[str, Any], ...], tuple[type, ...]], DBOOptions] = {}
_OPTION_NAMES: frozenset[str] = frozenset()


def _options(options: dict[str, Any], where: str = "run_ubatches") -> DBOOptions:
    opts = options.pop("options", None)
    if opts is None:
        typed = False
        for value in options.values():
            if value is None or type(value) is str:
                continue
            if type(value) not in _PLAIN:
                return _new_options(options, None, None, where)
            typed = True
        items = tuple(options.items())
        if not typed:
            if (cached := _OPTIONS_CACHE.get(items)) is not None:
                return cached
            return _new_options(options, _OPTIONS_CACHE, items, where)
        key = (items, tuple(map(type, options.values())))  # debug=1 is not debug=True
        if (made := _TYPED_OPTIONS_CACHE.get(key)) is not None:
            return made
        return _new_options(options, _TYPED_OPTIONS_CACHE, key, where)
    if options:
        raise TypeError(f"pass either options=DBOOptions(...) or keyword options, not both (got {sorted(options)})")
    if not isinstance(opts, DBOOptions):
        raise TypeError(f"options must be a DBOOptions (got {type(opts).__name__})")
    return opts


def _new_options(options: dict[str, Any], cache: dict[Any, DBOOptions] | None, key: object, where: str) -> DBOOptions:
    """The DBOOptions of keyword ``options`` (validated), kept in ``cache`` under ``key`` if given."""
    global _OPTION_NAMES
    if not _OPTION_NAMES:
        _OPTION_NAMES = frozenset(f.name for f in fields(DBOOptions))
    unknown = sorted(set(options) - _OPTION_NAMES)
    if unknown:
        raise TypeError(
            f"{where}() got an unexpected keyword argument {unknown[0]!r}; valid options are the fields "
            f"of DBOOptions ({', '.join(f.name for f in fields(DBOOptions))})"
        )
    made = DBOOptions(**options)
    if cache is not None and len(cache) < 256:
        cache[key] = made
    return made
