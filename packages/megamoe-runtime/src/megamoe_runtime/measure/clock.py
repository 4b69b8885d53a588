"""The clock: how long a call takes on a GPU or a CPU.

Three ways, each after warm-up calls that keep compiles and first-touch allocations out:
- `median_seconds`: CUDA events around each eager call, after the GPU's clock settled (a CPU:
  the host clock);
- `median_graph_replay_seconds`: calls captured in one CUDA graph and replayed (kernel time
  without launch gaps);
- `median_step_seconds`: events around each step of a sequence that repeats (dispatch, then
  combine; a forward behind a barrier), the first iterations dropped.
`host_seconds_per_call` is the CPU time to issue a call; `alternating_readings` times several
candidates in alternating rounds; `slowest_across_ranks` reduces a time with MAX over a group.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

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


def host_seconds_per_call(
    fn: Callable[[], object],
    *,
    device: torch.device,
    rounds: int = 21,
    calls_per_round: int = 1,
) -> float:
    """CPU time to issue one call (Python + launches), the GPU left to run behind: the overhead a
    forward costs the host. The median over `rounds` rounds, each after the GPU drained, of the
    time per call of `calls_per_round` calls. With one call per round nothing the call issues
    waits for earlier work (back-to-back calls fill the launch queue and, for a replayed CUDA
    graph, wait for its previous launch), and a round that another process's burst on a shared
    host slows down does not move the median; more calls per round time a steady stream of
    issues (a short step whose single-call time is near the clock's resolution)."""
    fn()
    samples = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(calls_per_round):
            fn()
        samples.append((time.perf_counter() - start) / calls_per_round)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(samples)


def median_step_seconds(
    steps: Mapping[str, Callable[[], object]],
    *,
    device: torch.device,
    iterations: int,
    skip: int,
    before_each: Callable[[], object] | None = None,
) -> dict[str, float]:
    """The median time of each step of a sequence that runs `iterations` times in order (each
    step right behind the one before, on the device's stream), over the iterations after the
    first `skip` (compiles, first-touch allocations, a peer still arriving). `before_each`
    (a barrier across ranks) runs before each iteration, outside every step's time. On a GPU
    each step is timed by CUDA events around it, so the host's launch time counts only where
    the GPU waits for it; on a CPU by the host clock."""
    if iterations <= skip:
        raise ValueError(f"iterations must be more than skip={skip}, got {iterations}")
    samples: dict[str, list] = {name: [] for name in steps}
    for _ in range(iterations):
        if before_each is not None:
            before_each()
        if device.type == "cuda":
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(steps) + 1)]
            marks[0].record()
            for index, (name, step) in enumerate(steps.items()):
                step()
                marks[index + 1].record()
                samples[name].append((marks[index], marks[index + 1]))
        else:
            for name, step in steps.items():
                start = time.perf_counter()
                step()
                samples[name].append(time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return {
            name: statistics.median(start.elapsed_time(end) for start, end in pairs[skip:]) / 1e3
            for name, pairs in samples.items()
        }
    return {name: statistics.median(values[skip:]) for name, values in samples.items()}


@dataclass(frozen=True)
class Readings:
    """Several timings of one candidate (seconds), each a median of its own: the best is what
    the candidate can do on the clock it got at its best, the spread how far apart the
    readings fell. A difference between candidates smaller than their spread is noise."""

    seconds: tuple[float, ...]

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def spread(self) -> float:
        """(slowest - fastest) / fastest reading."""
        return (max(self.seconds) - self.best) / self.best

    def median_and_range_us(self) -> str:
        """'median (fastest-slowest)' in microseconds."""
        worst = max(self.seconds)
        return f"{self.median * 1e6:.1f} ({self.best * 1e6:.1f}-{worst * 1e6:.1f})"

    def __str__(self) -> str:
        return "/".join(f"{seconds * 1e6:.1f}" for seconds in self.seconds)


def alternating_readings(
    readers: Mapping[object, Callable[[], float]], *, rounds: int
) -> dict[object, Readings]:
    """Each reader (a call that times one candidate and returns its seconds, e.g.
    `lambda: median_graph_replay_seconds(fn, device=device)`) `rounds` times, alternating
    (A B C A B C ...): a drift of the GPU's clock under load falls on every candidate alike
    instead of on the last."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    readings: dict[object, list[float]] = {name: [] for name in readers}
    for _ in range(rounds):
        for name, read in readers.items():
            readings[name].append(read())
    return {name: Readings(tuple(values)) for name, values in readings.items()}


def slowest_across_ranks(values: Sequence[float], process_group=None) -> list[float]:
    """Each value's maximum over the ranks of `process_group` (every rank passes as many): the
    time a collective step waits for is its slowest rank's. Every rank gets the same list."""
    import torch.distributed as dist

    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend(process_group) == "nccl"
        else torch.device("cpu")
    )
    reduced = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=process_group)
    return reduced.tolist()
