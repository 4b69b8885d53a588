"""`megamoe tune`: find the fastest cutedsl knobs per geometry and token count, store them in the
knob cache ($MEGAMOE_KNOB_CACHE), where the cutedsl backend finds them on later runs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.experts.cutedsl import CuteDSLExperts
from megamoe_runtime.geometries import Geometry
from megamoe_runtime.measure import median_graph_replay_seconds
from megamoe_runtime.tuning.cache import KnobCache
from megamoe_runtime.tuning.expert_knobs import gemm_candidates, gemm_key, tune_gemm
from megamoe_runtime.weights import Unquantized

from megamoe_torch import bench

# A layer's GEMMs read their weights from HBM: the two GEMMs (and the rest of the model) evict
# each other from L2. A GEMM timed alone re-reads the same weights, so its runner cycles through
# copies of them until consecutive calls' active weights add up to COLD_L2_FACTOR x the L2,
# spending at most WEIGHT_COPY_BUDGET_BYTES on the copies.
COLD_L2_FACTOR = 2
WEIGHT_COPY_BUDGET_BYTES = 16 << 30


def weight_copies_for_cold_l2(*, active_bytes: int, l2_bytes: int, tensor_bytes: int) -> int:
    """How many copies of a weight tensor (tensor_bytes each, the original included) a timed
    runner cycles through, when one call reads active_bytes of it."""
    if active_bytes <= 0:
        return 1
    wanted = -(-COLD_L2_FACTOR * l2_bytes // active_bytes)
    affordable = 1 + WEIGHT_COPY_BUDGET_BYTES // max(tensor_bytes, 1)
    return max(1, min(wanted, affordable))


def _cycled_copies(weight: torch.Tensor, *, experts_with_rows: int, l2_bytes: int):
    """An endless cycle of `weight` and enough clones of it for cold-L2 timing."""
    per_expert_bytes = weight[0].numel() * weight.element_size()
    copies = weight_copies_for_cold_l2(
        active_bytes=experts_with_rows * per_expert_bytes,
        l2_bytes=l2_bytes,
        tensor_bytes=weight.numel() * weight.element_size(),
    )
    return itertools.cycle([weight, *(weight.clone() for _ in range(copies - 1))])


@dataclass(frozen=True)
class TuneResult:
    geometry: str
    tokens: int
    op: str
    knobs: object
    microseconds: float
    default_microseconds: float
    candidates: int


@torch.no_grad()
def gemm_runners(geometry: Geometry, tokens: int, *, device: torch.device):
    """The geometry's own router on random tokens, the tight batch, and one runner per op
    (knobs or None -> output; the down GEMM reads the gate-up output of the default knobs).
    Each runner cycles through copies of its weights, so timed calls read them cold from HBM
    as a layer does (weight_copies_for_cold_l2).

    Returns (batch, {op: (weight_dims, runner)})."""
    from megamoe_kernels import down, gate_up_swiglu

    layer = bench.build_layer(geometry, device=device, dtype=torch.bfloat16)
    x_TH, ids, weights = bench.routed_tokens(layer, tokens)
    batch, _ = LocalDispatcher(geometry.num_experts).dispatch(x_TH, ids, weights)
    prepared = CuteDSLExperts().prepare(
        Unquantized(w13_E2IH=layer.w13.detach(), w2_EHI=layer.w2.detach())
    )
    hidden_MI = gate_up_swiglu(batch.rows_MH, batch.expert_offsets, prepared.w13_EB2GH)
    hidden, intermediate = geometry.hidden_size, geometry.intermediate_size
    experts_with_rows = int((batch.expert_offsets.diff() > 0).sum())
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    w13s, w2s = (
        _cycled_copies(weight, experts_with_rows=experts_with_rows, l2_bytes=l2_bytes)
        for weight in (prepared.w13_EB2GH, prepared.w2_EHI)
    )
    return batch, {
        "gate_up": (
            (2 * intermediate, hidden),
            lambda knobs: gate_up_swiglu(
                batch.rows_MH, batch.expert_offsets, next(w13s), knobs=knobs
            ),
        ),
        "down": (
            (hidden, intermediate),
            lambda knobs: down(hidden_MI, batch.expert_offsets, next(w2s), knobs=knobs),
        ),
    }


@torch.no_grad()
def tune_point(
    geometry: Geometry, tokens: int, *, cache: KnobCache, repeats: int = 10, quick: bool = False
) -> list[TuneResult]:
    """Tunes gate-up and down for one (geometry, tokens) point on the current GPU; `quick` times
    only the deepest ring of each tile shape."""
    device = torch.device("cuda")
    batch, ops = gemm_runners(geometry, tokens, device=device)
    results = []
    for op, (weight_dims, run) in ops.items():

        def seconds_of(knobs, run=run):
            return median_graph_replay_seconds(lambda: run(knobs), device=device, repeats=repeats)

        key = gemm_key(
            op,
            device=device,
            dtype=torch.bfloat16,
            weight_dims=weight_dims,
            capacity=batch.capacity,
            num_experts=geometry.num_experts,
        )
        candidates = gemm_candidates(op, quick=quick)
        default_seconds = seconds_of(None)
        best, best_seconds = tune_gemm(
            op, key=key, seconds_of=seconds_of, cache=cache, candidates=candidates
        )
        results.append(
            TuneResult(
                geometry.name,
                tokens,
                op,
                best,
                best_seconds * 1e6,
                default_seconds * 1e6,
                len(candidates),
            )
        )
    return results
