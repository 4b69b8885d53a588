"""What a time means: rates and fractions of the hardware's limits.

The limits are the H200's, measured (`megamoe_runtime.geometries`): a dense bf16 (or, for FP8
experts, e4m3) product's FLOP/s in a burst and the HBM copy rate. A fraction of the roofline floor
is the floor (the time the FLOPs or the bytes need at those limits, whichever is longer) over the
time taken: 1.0 runs at the limit.
"""

from __future__ import annotations

from megamoe_runtime.geometries import Geometry, roofline_floor_seconds


def tflops(flops: float, seconds: float) -> float:
    """TFLOP/s of `flops` done in `seconds`."""
    return flops / seconds / 1e12


def gigabytes_per_second(num_bytes: float, seconds: float) -> float:
    """GB/s (1e9 bytes) of `num_bytes` moved in `seconds`."""
    return num_bytes / seconds / 1e9


def speedup(baseline_seconds: float | None, seconds: float) -> float | None:
    """How many times faster than the baseline (> 1: faster); None without a baseline."""
    return None if baseline_seconds is None else baseline_seconds / seconds


def expert_roofline_fraction(
    geometry: Geometry,
    *,
    rows: int,
    active_experts: int,
    seconds: float,
    weight_dtype: str | None = None,
) -> float:
    """The expert MLP's roofline floor over `seconds` (the gate-up and down GEMMs of `rows`
    rows over `active_experts` experts' bf16 weights, or e4m3 ones with weight_dtype="fp8")."""
    floor = roofline_floor_seconds(geometry, rows, active_experts, weight_dtype=weight_dtype)
    return floor / seconds
