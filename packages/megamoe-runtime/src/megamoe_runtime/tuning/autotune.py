"""Pick the fastest of a set of candidates, alone or collectively across ranks.

Collectively, every rank times the same candidates in the same order (lockstep), the times are
reduced with MAX, and the candidate whose slowest rank is fastest wins: the choice is identical on
every rank, and it optimises what the step waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from megamoe_runtime.measure import slowest_across_ranks

Candidate = TypeVar("Candidate")


def pick_fastest(
    candidates: Sequence[Candidate],
    seconds_of: Callable[[Candidate], float],
    *,
    process_group=None,
) -> tuple[Candidate, list[float]]:
    """Returns (fastest candidate, seconds per candidate). A candidate whose timing raises counts as
    infinitely slow (it is reported, never chosen); if every candidate fails, raises."""
    if not candidates:
        raise ValueError("candidates must not be empty")
    seconds = []
    failures = []
    for candidate in candidates:
        try:
            seconds.append(float(seconds_of(candidate)))
        except Exception as error:  # a candidate that cannot run on this input loses
            seconds.append(float("inf"))
            failures.append(f"{candidate}: {error}")
    if process_group is not None:
        seconds = slowest_across_ranks(seconds, process_group)
    best = min(range(len(candidates)), key=lambda index: seconds[index])
    if seconds[best] == float("inf"):
        raise RuntimeError("every candidate failed: " + "; ".join(failures))
    return candidates[best], seconds
