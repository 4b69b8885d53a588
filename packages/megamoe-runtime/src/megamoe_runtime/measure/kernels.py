"""Where a call's GPU time goes: each kernel's device time per call, from the torch profiler's
CUDA activity (launch gaps excluded; copies and fills count as kernels, by their names)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class KernelTime(NamedTuple):
    """One kernel's device time (us) and launches, per call."""

    us: float
    launches: float


def kernel_times(
    fn: Callable[[], object], *, device: torch.device | str, calls: int = 1
) -> dict[str, KernelTime]:
    """{kernel name: its KernelTime per call} over one `fn()` that makes `calls` calls (a loop of
    forwards, a graph of that many), after one unprofiled `fn()` (compiles, first-touch
    allocations), largest time first."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"kernel_times times the kernels of a CUDA device, got device={device}")
    if calls < 1:
        raise ValueError(f"calls must be at least 1, got {calls}")
    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        fn()
        torch.cuda.synchronize(device)
    times = {
        event.key: KernelTime(event.device_time_total / calls, event.count / calls)
        for event in profiler.key_averages()
        if event.device_type.name == "CUDA" and event.device_time_total > 0
    }
    return dict(sorted(times.items(), key=lambda item: -item[1].us))
