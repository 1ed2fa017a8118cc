"""Why a DBO step ran unsplit, in plain words, for the CLI's and the examples' output.

A :class:`~asyncdbo.plan.StepRecord` names its reason with an enum value (``below_threshold``)
and, under a DP group, each rank's vote; a reader of the demo's output should not need either.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

__all__ = ["REASON_WORDS", "plural", "why_unsplit"]

REASON_WORDS: dict[str, str] = {
    "disabled": "microbatching was off for the step (DBO disabled by the caller)",
    "single_ubatch": "one ubatch configured (--ubatches 1): nothing to split",
    "below_threshold": "too few tokens to split (below ThresholdConfig's prefill_threshold or decode_threshold)",
    "policy_refused": "the split policy could not give every ubatch real tokens",
    "rank_declined": "another DP rank could not split, and the ranks split together or not at all",
    "imbalance": "the busy DP ranks' token counts differed more than the allowed ratio (max_imbalance)",
    "all_idle": "no rank had tokens",
    "auto_off": 'tuning="auto" measured (or, before measuring, its prior says) DBO is slower on this batch size',
}


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 layer``, ``2 layers``; ``many`` where adding an s is wrong."""
    return f"{n} {word if n == 1 else many or word + 's'}"


def why_unsplit(records: Iterable[Any], *, skip: Iterable[str] = ()) -> list[str]:
    """One line per reason the given records (one per step, as one rank or every rank agreed)
    did not microbatch: how many steps, and the reason in words; reasons in ``skip`` left out
    (a caller that explains them itself)."""
    skipped = set(skip)
    counts = Counter(rec.reason.value for rec in records if not rec.microbatched)
    return [f"{plural(n, 'step')}: {REASON_WORDS.get(reason, reason)}"
            for reason, n in sorted(counts.items()) if reason not in skipped]
