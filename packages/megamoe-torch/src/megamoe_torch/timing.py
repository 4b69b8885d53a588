"""Timing helpers: CUDA events (eager), CUDA-graph replay, or the host clock on a CPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(
    fn: Callable[[], object], *, device: torch.device, repeats: int = 30, warmup: int = 3
) -> float:
    """Median wall time of `fn()` over `repeats` calls, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)
    torch.cuda.synchronize(device)
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
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    seconds = median_seconds(graph.replay, device=device, repeats=repeats, warmup=warmup)
    return seconds / calls_per_graph


def host_seconds_per_call(
    fn: Callable[[], object], *, device: torch.device, calls: int = 10, rounds: int = 9
) -> float:
    """CPU time to issue one call (Python + launches), the GPU left to run behind: the overhead a
    forward costs with CUDA graphs off. The median over `rounds` of the mean of `calls` calls in
    a row, the GPU drained before each round: the launch queue stays shallow (a deep one makes
    launches wait for the GPU), and a round that another process's burst on a shared host
    slows down does not move the median."""
    fn()
    samples = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(samples)
