"""The user's own layer on the simulated device (``asyncdbo check --layer FILE:NAME``).

The layer is an object with ``async forward(x_TD)`` (``x_TD``: ``[tokens, hidden]``, returns a
tensor), or a factory that takes the EP process group and returns one. The check makes a fake
EP group of ``ep`` ranks (this process is rank 0; collectives on it are timed by the link and
comm presets, their data is not exchanged), calls ``ubatch_groups(ubatches, group)`` so the layer
may issue on ``ubatch_group(group)``, builds the layer once, and for each token count runs it
serially (one ubatch, and the plain serial run without DBO's yields and hooks) and as
``ubatches`` DBO ubatches (the tokens cut evenly) on a
:class:`~asyncdbo.sim.SimBackend` with the race checker. Lost overlap is costed by a
counterfactual run per finding (:func:`~asyncdbo.sim.measure_lost_overlap`); every host sync
between two yields fails, with its cost at this size and the cost model's estimate with eager
launches on the modeled device. ``hidden`` defaults to the layer's ``hidden_size`` attribute.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .counterfactual import measure_lost_overlap
from .backend import SimBackend
from .model import fake_ep_group
from .races import SimCheckError
from .report import SimReport

__all__ = ["LayerCheck", "LayerRow", "check_layer", "load_layer"]


@dataclass(frozen=True)
class LayerRow:
    """One token count: the serial run (one ubatch) and the DBO run, each the sim's report."""

    tokens: int
    serial: SimReport
    dbo: SimReport
    plain: SimReport  # the serial run without DBO's yields and hooks (SimBackend(plain=True))

    @property
    def speedup(self) -> float:
        """Serial time (one ubatch) / DBO time (above 1: DBO is faster)."""
        return self.serial.makespan_s / self.dbo.makespan_s if self.dbo.makespan_s > 0 else 1.0

    @property
    def plain_speedup(self) -> float:
        """Plain serial time / DBO time: a schedule that slows its own one-ubatch run cannot raise it."""
        return self.plain.makespan_s / self.dbo.makespan_s if self.dbo.makespan_s > 0 else 1.0


@dataclass(frozen=True)
class LayerCheck:
    """Every row, and every finding that fails the check (races, dead waits, lost overlap)."""

    rows: tuple[LayerRow, ...]
    problems: tuple[object, ...]


def load_layer(spec: str) -> Any:
    """``FILE:NAME`` -> the object ``NAME`` of the Python file ``FILE`` (imported as a module of
    its own; its directory goes first on ``sys.path`` so its own imports resolve)."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"--layer takes FILE:NAME, e.g. my_moe.py:make_layer (got {spec!r})")
    if not os.path.isfile(path):
        raise ValueError(f"--layer {spec}: no file {path!r}")
    module_name = f"asyncdbo_user_layer_{os.path.splitext(os.path.basename(path))[0]}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    sys.modules[module_name] = module
    loader.loader.exec_module(module)
    if not hasattr(module, name):
        found = sorted(n for n in vars(module) if not n.startswith("_"))
        raise ValueError(f"--layer {spec}: {path} defines no {name!r}; it defines {', '.join(found) or 'nothing public'}")
    return getattr(module, name)


def _build(layer: Any, group: Any) -> Any:
    """The object with ``async forward``: ``layer`` itself, or what the factory ``layer(group)`` made."""
    if not isinstance(layer, type) and inspect.iscoroutinefunction(getattr(layer, "forward", None)):
        return layer
    if callable(layer):  # a factory, or a class whose constructor takes the group
        built = layer(group)
        if inspect.iscoroutinefunction(getattr(built, "forward", None)):
            return built
        raise ValueError(f"the layer factory {getattr(layer, '__name__', layer)!r} returned {type(built).__name__}, "
                         "which has no 'async def forward(self, x_TD)'; return the layer object")
    raise ValueError(f"{layer!r} is neither an object with 'async def forward(self, x_TD)' nor a factory taking the "
                     "EP group that returns one")


async def check_layer(
    layer: Any,
    *,
    tokens: Sequence[int] = (64,),
    ubatches: int = 2,
    ep: int = 8,
    hidden: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str = "h200",
    link: str = "ib400",
    comm: str = "a2a",
    host: str = "eager",
    stream_policy: Literal["role", "ubatch"] = "role",
    check_races: bool = True,
    fail_on: Sequence[str] = ("lost-overlap",),
    estimate_host: str | None = "eager",
    raise_problems: bool = True,
    seed: int = 0,
) -> LayerCheck:
    """Check ``layer`` (see the module docstring) at each token count: races, dead waits, lost
    overlap (each costed; host syncs between yields fail at any cost, with the cost model's
    estimate under ``estimate_host`` launches), and serial vs DBO step time on the modeled
    ``device``/``link``/``comm``/``host``. Raises :class:`~asyncdbo.sim.SimCheckError` with every
    failing finding of every row when ``raise_problems`` (else returns them in ``problems``)."""
    if not 2 <= ubatches <= 8:
        raise ValueError(f"ubatches must be between 2 and 8 (got {ubatches})")
    if ep < 1:
        raise ValueError(f"ep must be a number of ranks >= 1 (got {ep})")
    bad = [t for t in tokens if t < ubatches]
    if not tokens or bad:
        raise ValueError(f"every token count must be >= ubatches ({ubatches}) so each ubatch gets a token (got "
                         f"{list(tokens)})")
    from ..dbo import run_ubatches
    from ..plan import split_tokens
    from ..dist import ubatch_groups

    rows: list[LayerRow] = []
    problems: list[object] = []
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad(), fake_ep_group(ep) as group:
        if group is not None:
            ubatch_groups(ubatches, group)
        obj = _build(layer, group)
        width = hidden if hidden is not None else getattr(obj, "hidden_size", None)
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"the layer's input width is unknown: give --hidden (hidden=) or a 'hidden_size' "
                             f"attribute on the layer (got {width!r})")
        for n in tokens:
            x_TD = torch.randn(n, width, generator=gen).to(dtype)
            reports: list[SimReport] = []
            cut = [s.num_tokens for s in split_tokens([0, n], ubatches, n)]  # the planner's token split
            for parts, plain in (([n], False), (cut, False), ([n], True)):
                def make(_plain: bool = plain, **overrides: Any) -> SimBackend:
                    return SimBackend(**{**dict(device=device, link=link, comm=comm, host=host, check_races=check_races,
                                                fail_on=fail_on, plain=_plain), **overrides})

                async def run(be: SimBackend, _parts: list[int] = parts) -> None:
                    args = [(x,) for x in x_TD.split(_parts)]
                    await run_ubatches(obj.forward, args, backend=be, stream_policy=stream_policy)

                estimate = {"host": estimate_host} if estimate_host is not None and len(parts) > 1 else None
                rep, _ = await measure_lost_overlap(run, make, raise_problems=False, estimate=estimate)
                reports.append(rep)
                problems += rep.problems
            rows.append(LayerRow(n, reports[0], reports[1], reports[2]))
    if raise_problems and problems:
        raise SimCheckError(problems)
    return LayerCheck(tuple(rows), tuple(problems))
