"""Timing helpers: CUDA events (eager), CUDA-graph replay, or the host clock on a CPU.

The device timers live in `megamoe_runtime.timing` (the online autotuner uses them too) and are
re-exported here; the host-side cost of a call is measured here."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from megamoe_runtime.timing import (
    SETTLE_SECONDS,
    captured_graph,
    keep_busy,
    median_graph_replay_seconds,
    median_seconds,
)

__all__ = [
    "SETTLE_SECONDS",
    "captured_graph",
    "host_seconds_per_call",
    "keep_busy",
    "median_graph_replay_seconds",
    "median_seconds",
]


def host_seconds_per_call(
    fn: Callable[[], object], *, device: torch.device, rounds: int = 21
) -> float:
    """CPU time to issue one call (Python + launches), the GPU left to run behind: the overhead a
    forward costs the host. The median over `rounds` single calls, each after the GPU drained:
    nothing the call issues waits for earlier work (back-to-back calls fill the launch queue
    and, for a replayed CUDA graph, wait for its previous launch), and a round that another
    process's burst on a shared host slows down does not move the median."""
    fn()
    samples = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(samples)
