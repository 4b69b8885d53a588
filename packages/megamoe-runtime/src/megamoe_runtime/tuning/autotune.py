"""Pick the fastest of a set of candidates, alone or collectively across ranks.

Collectively, every rank times the same candidates in the same order (lockstep), the times are
reduced with MAX, and the candidate whose slowest rank is fastest wins: the choice is identical on
every rank, and it optimises what the step waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

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
        seconds = all_reduce_max(seconds, process_group)
    best = min(range(len(candidates)), key=lambda index: seconds[index])
    if seconds[best] == float("inf"):
        raise RuntimeError("every candidate failed: " + "; ".join(failures))
    return candidates[best], seconds


def all_reduce_max(values: Sequence[float], process_group) -> list[float]:
    """Each value's maximum over the ranks of `process_group` (every rank passes as many)."""
    import torch.distributed as dist

    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(process_group) == "nccl"
        else torch.device("cpu")
    )
    reduced = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=process_group)
    return reduced.tolist()
