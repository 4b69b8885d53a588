"""Timing on a GPU or a CPU: CUDA events (eager), CUDA-graph replay, or the host clock.

The online autotuner (`megamoe_runtime.tuning.online`) times its candidates with these; the
offline tuner, the bench and the scripts use them through `megamoe_torch.timing`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

# How long a GPU is kept busy before it is timed. An H200 leaves its boost clock within about
# 100 ms of a heavy load starting (its power limit pulls it down by up to a third), so without
# this the first backend timed after an idle pause (a compile, a reference computation) would
# run on a faster clock than the one timed right after it (docs/benchmarks.md, "The power
# limit").
SETTLE_SECONDS = 0.2


def keep_busy(fn: Callable[[], object], *, device: torch.device, seconds: float) -> int:
    """Calls `fn()` (at least once) until `seconds` have passed, waiting for the device after
    each call, so that a GPU's clock settles where the load holds it. Returns the calls made."""
    calls = 0
    start = time.perf_counter()
    while calls == 0 or time.perf_counter() - start < seconds:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        calls += 1
    return calls


def median_seconds(
    fn: Callable[[], object],
    *,
    device: torch.device,
    repeats: int = 30,
    warmup: int = 3,
    settle_seconds: float = SETTLE_SECONDS,
) -> float:
    """Median wall time of `fn()` over `repeats` calls, after `warmup` calls and, on a GPU,
    after `settle_seconds` of calls (keep_busy): every workload is timed on the clock that a
    sustained load gets, whatever ran or idled before it."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)
    keep_busy(fn, device=device, seconds=settle_seconds)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(repeats)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def median_graph_replay_seconds(
    fn: Callable[[], object],
    *,
    device: torch.device,
    repeats: int = 30,
    warmup: int = 3,
    calls_per_graph: int = 10,
) -> float:
    """Captures `calls_per_graph` calls of `fn()` in one CUDA graph and times its replays: the
    per-call kernel time without launch gaps (the replay's own launch is amortised)."""
    graph = captured_graph(fn, device=device, calls=calls_per_graph, warmup=warmup)
    seconds = median_seconds(graph.replay, device=device, repeats=repeats, warmup=warmup)
    return seconds / calls_per_graph


def captured_graph(
    fn: Callable[[], object], *, device: torch.device, calls: int, warmup: int = 3
) -> torch.cuda.CUDAGraph:
    """`calls` calls of `fn()` in one CUDA graph, captured after `warmup` calls on a side stream
    (compiles, allocations and lazy initialisation stay out of the capture)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph
