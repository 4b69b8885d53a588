"""Tuning the cutedsl expert GEMMs: candidate knobs, the cache key of a batch, the lookup of
tuned knobs, and the tuning of one GEMM class.

The key of a GEMM is its op, the GPU's name, the dtype, the weight dims and the bucket of rows per
expert (capacity / E, as the kernels' default profile keys it; a batch's typical rows / E where
its capacity is sized for a worst case), so one tuned entry serves every batch of the same class.
The cutedsl backend reads the cache when no knobs are given explicitly; `megamoe tune` (offline)
and `OnlineAutotuner` (in the layer, `knobs="auto"`) fill it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace

import torch
from megamoe_kernels import FP8_DTYPE, GemmKnobs, candidate_knobs, knob_problems
from megamoe_kernels.shim.knobs import FP8_OPS

from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.tuning.autotune import pick_fastest
from megamoe_runtime.tuning.cache import (
    KnobCache,
    KnobKey,
    rows_per_expert_bucket,
    shipped_knob_cache,
)


def gemm_candidates(op: str, *, quick: bool = False, same_numbers: bool = False) -> list[GemmKnobs]:
    """The knobs a tuner times for `op`: every valid tile shape in both orientations, with the
    pingpong, 2-CTA cluster and split-K variants (`candidate_knobs`); `quick`: only the
    default profile's ring of each shape (the deepest that fits, but 64 KiB of weights for the
    FP8 decode tiles: default_stages). `same_numbers`: only knobs that sum each output over K
    whole, in ascending K tiles, as the default profile does but for the FP8 decode gate-up on
    few experts (with_the_numbers_of): no split-K (its slices are added in a fixed order,
    deterministic but not bitwise equal to the unsplit sum; docs/tuning.md)."""
    candidates = candidate_knobs(op, stage_choices=("profile",)) if quick else candidate_knobs(op)
    if same_numbers:
        candidates = [knobs for knobs in candidates if knobs.split_k == 1]
    return candidates


def with_the_numbers_of(untuned: GemmKnobs, candidates: list[GemmKnobs]) -> list[GemmKnobs]:
    """`candidates` (summing K whole: gemm_candidates(same_numbers=True)) made to keep the
    numbers of `untuned`, the knobs a batch runs without a tuned entry: where those sum K in S
    slices (the FP8 decode gate-up's split over idle SMs), each swap-AB candidate takes the same
    S slices, and each prefill one, which cannot split K, becomes `untuned` again (the list
    keeps its length: ranks time it in lockstep)."""
    if untuned.split_k == 1:
        return list(candidates)
    return [
        replace(knobs, split_k=untuned.split_k) if knobs.swap_ab else untuned
        for knobs in candidates
    ]


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


def batch_gemm_key(op: str, batch: ExpertBatch, *, weight_dims: tuple[int, int]) -> KnobKey:
    """The class of `batch` for `op`: its typical rows where the batch has them (a capacity sized
    for a worst case), else its capacity, over its experts. An FP8 op's dtype is e4m3, what it
    reads, whether the batch holds e4m3 rows or bf16 ones quantized before the GEMM."""
    return gemm_key(
        op,
        device=batch.rows_MH.device,
        dtype=FP8_DTYPE if op in FP8_OPS else batch.rows_MH.dtype,
        weight_dims=weight_dims,
        capacity=batch.capacity if batch.typical_rows is None else batch.typical_rows,
        num_experts=batch.num_experts,
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


def looked_up_knobs(cache: KnobCache, key: KnobKey) -> GemmKnobs | None:
    """The tuned knobs for `key`: from `cache`, else from the entries megamoe ships, else None
    (the default profile)."""
    return knobs_from_cache(cache, key) or knobs_from_cache(shipped_knob_cache(), key)


def store_tuned(cache: KnobCache, key: KnobKey, knobs: GemmKnobs, *, seconds: float) -> None:
    cache.put(key, cache_fields(knobs), microseconds=seconds * 1e6)


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
    store_tuned(cache, key, best, seconds=best_seconds)
    return best, best_seconds
