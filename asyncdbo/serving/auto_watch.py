"""Change detection for a settled ``"auto"`` bucket (:mod:`asyncdbo.serving.auto`, step 4).

Once a bucket has settled (no trial left), its choice's first
``reference`` steps set a reference: their median and robust relative sigma (or the exploration's
pooled pair noise over sqrt(2), or :data:`SIGMA_FLOOR`, whichever is largest). Every later step
of the choice adds its time, normalized to that reference in sigmas and capped at ±:data:`CLIP`,
to a two-sided CUSUM (Page's: ``up = max(0, up + z - detect_slack)``, ``down`` the same for
``-z``). Where either exceeds ``detect`` the bucket explores again: the same schedule and bounds
as the first time, its choice the incumbent (warmed up), every other configuration's samples,
warm-ups and verdicts cleared. A change that makes the settled choice slower or faster is seen
in its own time; one that leaves it where it was but makes another configuration faster is
not, which is what **probing** is for (``probe_every``, off by default): one step in K runs a
runner-up of a near-tie (the configurations that lost to the choice with a ``tie`` verdict, in
turn), paired with the choice's next step; a one-sided CUSUM per runner-up on the pair's ratio
(``1 - margin - ratio`` in the ratio's sigma, sqrt(2) times the reference's, slack
``detect_slack / 2``) explores again where it exceeds ``detect / 2``. A pair whose choice step is
beyond ``CLIP`` sigmas of its reference (a hiccup) is dropped. Every re-exploration is kept
(:attr:`~asyncdbo.serving.AutoPolicy.reexplorations`), named in the bucket's evidence and in :meth:`~asyncdbo.serving.AutoPolicy.summary`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .auto_config import Arm, AutoConfig
from .compare import paired_sigma, relative_sigma

__all__ = ["CLIP", "SIGMA_FLOOR", "Reexploration", "Watch", "summarize"]

#: A watched step's contribution to the change detection's CUSUM is capped at this many standard
#: deviations either way, so that one host hiccup (a step 10x slower) adds at most this much.
CLIP = 3.0
#: The least relative sigma the change detection assumes for a settled choice (a noiseless
#: injected clock would otherwise make any change, however small, an infinite one).
SIGMA_FLOOR = 0.01


@dataclass
class Watch:
    """A settled bucket's change detection (``AutoConfig.reference``, ``detect``, ``probe_every``):
    the reference its choice measured after settling, the CUSUM sums, and the probing of the
    runners-up of near-ties."""

    runners_up: list[Arm]  # the configurations that tied with the choice, lowest pairs' median ratio first
    ref: list[float] = field(default_factory=list)  # the choice's first steps after settling
    level: float = 0.0  # their median (seconds per token)
    sigma: float = 0.0  # their robust sigma over the median, at least SIGMA_FLOOR
    up: float = 0.0  # CUSUM of steps slower than the reference
    down: float = 0.0  # CUSUM of steps faster than it
    watched: int = 0  # steps compared with the reference
    since_probe: int = 0  # the choice's steps since the last probe
    turn: int = 0  # probes so far: runners_up[turn % len] is the next one probed
    probe: tuple[Arm, float] | None = None  # a probe's sample, waiting for its pair
    faster: dict[Arm, float] = field(default_factory=dict)  # per runner-up, the CUSUM of it being faster
    last_ratio: dict[Arm, float] = field(default_factory=dict)  # per runner-up, its last probe pair's ratio

    def next_probe(self) -> Arm | None:
        return self.runners_up[self.turn % len(self.runners_up)] if self.runners_up else None

    def describe(self, cfg: AutoConfig, incumbent: Arm) -> str:
        """What :meth:`AutoPolicy.watching <asyncdbo.serving.AutoPolicy.watching>` says."""
        if self.level <= 0:
            return f"watching {incumbent.label}: reference {len(self.ref)}/{cfg.reference} steps"
        text = (f"watching {incumbent.label}: reference {self.level * 1e6:.2f} us/token ±{self.sigma:.1%} "
                f"({cfg.reference} steps), CUSUM up {self.up:.1f} down {self.down:.1f} of {cfg.detect}")
        if cfg.probe_every is not None:
            text += "".join(f"; runner-up {a.label} last ratio {self.last_ratio[a]:.3f}, CUSUM faster {self.faster[a]:.1f}"
                            for a in self.runners_up if a in self.last_ratio)
        return text

    def take_probe(self, arm: Arm, x: float) -> None:
        """A runner-up's probe step: kept until the choice's next step pairs it."""
        self.probe, self.since_probe = (arm, x), 0
        self.turn += 1

    def step(self, cfg: AutoConfig, incumbent: Arm, x: float,
             pairs: Callable[[], Sequence[tuple[Sequence[float], Sequence[float]]]]) -> str:
        """The choice's step of ``x`` seconds per token: the reference's (until it has
        ``cfg.reference``; ``pairs()`` gives the exploration's compared pairs for its noise), or one
        the CUSUMs take. Returns why the bucket must explore again, or ``""``."""
        if self.level <= 0:
            self.ref.append(x)
            if len(self.ref) >= cfg.reference:
                # the reference's own spread, or the exploration's pairs' (pooled over every comparison: a
                # ratio of two steps has sqrt(2) times one step's sigma), whichever is larger
                self.level = statistics.median(self.ref)
                self.sigma = max(relative_sigma(self.ref), paired_sigma(list(pairs())) / math.sqrt(2.0), SIGMA_FLOOR)
            return ""
        self.since_probe += 1
        self.watched += 1
        raw = (x / self.level - 1.0) / self.sigma
        z = max(-CLIP, min(CLIP, raw))
        self.up = max(0.0, self.up + z - cfg.detect_slack)
        self.down = max(0.0, self.down - z - cfg.detect_slack)
        why = ""
        if self.probe is not None and abs(raw) > CLIP:
            self.probe = None  # the choice's step of the pair is an outlier (a hiccup): the ratio says nothing
        if self.probe is not None:
            (probed, y), self.probe = self.probe, None
            ratio = self.last_ratio[probed] = y / x
            zp = max(-CLIP, min(CLIP, (1.0 - cfg.margin - ratio) / (self.sigma * math.sqrt(2.0))))
            g = self.faster[probed] = max(0.0, self.faster.get(probed, 0.0) + zp - cfg.detect_slack / 2)
            if cfg.detect is not None and g > cfg.detect / 2:
                why = (f"runner-up {probed.label} probed faster than {incumbent.label}: last pair's ratio "
                       f"{ratio:.3f}, CUSUM faster {g:.1f} > {cfg.detect / 2:g} after {self.turn} probes")
        if not why and cfg.detect is not None and max(self.up, self.down) > cfg.detect:
            side = "slower" if self.up >= self.down else "faster"
            why = (f"{incumbent.label} ran {side} than its reference {self.level * 1e6:.2f} us/token ±{self.sigma:.1%}: "
                   f"this step {x / self.level:.2f}x, CUSUM {side} {max(self.up, self.down):.1f} > {cfg.detect} after "
                   f"{self.watched} steps")
        return why


@dataclass(frozen=True)
class Reexploration:
    """One time a settled bucket explored again: the bucket, its measured step that set it off
    (``step``: the bucket's steps measured so far, counting from 1, that one included), the
    configuration it had settled on, and why (the CUSUM that fired and what it had seen)."""

    bucket: str
    step: int
    incumbent: Arm
    why: str


def summarize(reexplorations: Sequence[Reexploration]) -> str:
    """What :meth:`AutoPolicy.summary <asyncdbo.serving.AutoPolicy.summary>` says: one clause per
    bucket, how many times, the last one's step and why; '' where none."""
    last: dict[str, tuple[int, Reexploration]] = {}
    for r in reexplorations:
        last[r.bucket] = (last.get(r.bucket, (0, r))[0] + 1, r)
    if not last:
        return ""
    return "explored again: " + ", ".join(
        f"{b} {'' if n == 1 else f'{n} times, last '}at its step {r.step} ({r.why})" for b, (n, r) in last.items())
