"""Tuning the cutedsl expert GEMMs: candidate knobs, the cache key of a batch, the offline tuner.

The key of a GEMM is its op, the GPU's name, the dtype, the weight dims and the bucket of rows per
expert (capacity / E, as the kernels' default profile keys it), so one tuned entry serves every
batch of the same class. The cutedsl backend reads the cache when no knobs are given explicitly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import torch
from megamoe_kernels import GemmKnobs, candidate_knobs, knob_problems

from megamoe_runtime.tuning.autotune import pick_fastest
from megamoe_runtime.tuning.cache import KnobCache, KnobKey, rows_per_expert_bucket


def gemm_key(
    op: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    weight_dims: tuple[int, int],
    capacity: int,
    num_experts: int,
) -> KnobKey:
    """weight_dims: (N, K) of the op: gate-up (2I, H), down (H, I)."""
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    return KnobKey(
        op=op,
        device_name=device_name,
        dtype=str(dtype).removeprefix("torch."),
        out_features=weight_dims[0],
        in_features=weight_dims[1],
        rows_per_expert_bucket=rows_per_expert_bucket(capacity / max(num_experts, 1)),
    )


def cache_fields(knobs: GemmKnobs) -> dict:
    """`knobs` as a knob-cache entry stores them (JSON: the cluster as a list)."""
    fields = asdict(knobs)
    fields["cluster"] = list(fields["cluster"])
    return fields


def knobs_from_cache(cache: KnobCache, key: KnobKey) -> GemmKnobs | None:
    """The cached knobs for `key`, or None; an entry that is no longer valid is ignored."""
    fields = cache.get(key)
    if fields is None:
        return None
    fields = dict(fields)
    fields["cluster"] = tuple(fields.get("cluster", (1, 1)))
    try:
        knobs = GemmKnobs(**fields)
    except TypeError:  # written by another version of the knobs
        return None
    return None if knob_problems(knobs, key.op) else knobs


def tune_gemm(
    op: str,
    *,
    key: KnobKey,
    seconds_of: Callable[[GemmKnobs], float],
    cache: KnobCache,
    candidates: list[GemmKnobs] | None = None,
    process_group=None,
) -> tuple[GemmKnobs, float]:
    """Times every candidate (lockstep across `process_group` if given), stores the fastest in
    `cache` under `key` and returns it with its time in seconds."""
    candidates = candidate_knobs(op) if candidates is None else candidates
    best, seconds = pick_fastest(candidates, seconds_of, process_group=process_group)
    best_seconds = min(seconds)
    cache.put(key, cache_fields(best), microseconds=best_seconds * 1e6)
    return best, best_seconds
