"""`megamoe tune`: find the fastest cutedsl knobs per geometry and token count, store them in the
knob cache ($MEGAMOE_KNOB_CACHE), where the cutedsl backend finds them on later runs.

Each GEMM is timed as the geometry's layer runs it: its epilogue variant (gpt-oss-120b's biases
and clamped SwiGLU) and, as the entry's key, the class the backend looks up for the layer's
batch. The key names the op, the GPU, the dtype, the weight dims and the rows per expert, not
the epilogue: the entry serves any layer of those dims, and was timed with this geometry's."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megamoe_kernels import GemmKnobs
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.experts.cutedsl import CuteDSLExperts, CuteDSLWeights
from megamoe_runtime.geometries import Geometry
from megamoe_runtime.measure import median_graph_replay_seconds
from megamoe_runtime.tuning.cache import KnobCache, KnobKey
from megamoe_runtime.tuning.expert_knobs import gemm_candidates, tune_gemm

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


@dataclass(frozen=True)
class TuningPoint:
    """One (geometry, tokens) point as a layer of the geometry hands it to the cutedsl backend:
    the batch its local dispatch makes of random tokens its own router routed, its expert
    weights as the backend prepares them (with the geometry's expert math: biases and the
    SwiGLU, epilogue variants of the kernels), and the knob-cache key of each GEMM the backend
    looks up for that batch (`CuteDSLExperts.knob_keys`), under which the tuner stores it."""

    batch: ExpertBatch
    prepared: CuteDSLWeights
    keys: dict[str, KnobKey]


@torch.no_grad()
def tuning_point(geometry: Geometry, tokens: int, *, device: torch.device) -> TuningPoint:
    layer = bench.build_layer(geometry, device=device, dtype=torch.bfloat16)
    x_TH, ids, weights = bench.routed_tokens(layer, tokens)
    batch, _ = LocalDispatcher(geometry.num_experts).dispatch(x_TH, ids, weights)
    backend = CuteDSLExperts()
    prepared = backend.prepare(layer.expert_weight_pack())
    return TuningPoint(batch=batch, prepared=prepared, keys=backend.knob_keys(batch, prepared))


@torch.no_grad()
def gemm_runners(
    point: TuningPoint, *, l2_bytes: int | None = None
) -> dict[str, Callable[[GemmKnobs | None], torch.Tensor]]:
    """One runner per op (knobs or None -> output) of the point's GEMMs, with the epilogue the
    layer's run (the pack's biases and SwiGLU); the down GEMM reads the gate-up output of the
    default knobs. Each runner cycles through copies of its weights, so timed calls read them
    cold from HBM as a layer does (weight_copies_for_cold_l2 with an L2 of `l2_bytes`; None:
    the batch's GPU's). An op's weight dims (N, K) are its key's out and in features."""
    from megamoe_kernels import down, gate_up_swiglu

    batch, prepared = point.batch, point.prepared
    if l2_bytes is None:
        l2_bytes = torch.cuda.get_device_properties(batch.rows_MH.device).L2_cache_size
    rows_MH, offsets = batch.rows_MH, batch.expert_offsets
    gate_up_epilogue = {"w13_bias_EB2G": prepared.w13_bias_EB2G, "swiglu": prepared.swiglu}
    down_epilogue = {"w2_bias_EH": prepared.w2_bias_EH}
    hidden_MI = gate_up_swiglu(rows_MH, offsets, prepared.w13_EB2GH, **gate_up_epilogue)
    experts_with_rows = int((offsets.diff() > 0).sum())
    w13s, w2s = (
        _cycled_copies(weight, experts_with_rows=experts_with_rows, l2_bytes=l2_bytes)
        for weight in (prepared.w13_EB2GH, prepared.w2_EHI)
    )
    return {
        "gate_up": lambda knobs: gate_up_swiglu(
            rows_MH, offsets, next(w13s), knobs=knobs, **gate_up_epilogue
        ),
        "down": lambda knobs: down(hidden_MI, offsets, next(w2s), knobs=knobs, **down_epilogue),
    }


@torch.no_grad()
def tune_point(
    geometry: Geometry,
    tokens: int,
    *,
    cache: KnobCache,
    repeats: int = 10,
    quick: bool = False,
    device: torch.device | None = None,
) -> list[TuneResult]:
    """Tunes gate-up and down for one (geometry, tokens) point on `device` (None: the current
    GPU), each with the geometry's own epilogue, and stores the fastest under the key the
    layer looks it up by; `quick` times only the deepest ring of each tile shape."""
    device = torch.device("cuda") if device is None else device
    point = tuning_point(geometry, tokens, device=device)
    results = []
    for op, run in gemm_runners(point).items():

        def seconds_of(knobs, run=run):
            return median_graph_replay_seconds(lambda: run(knobs), device=device, repeats=repeats)

        candidates = gemm_candidates(op, quick=quick)
        default_seconds = seconds_of(None)
        best, best_seconds = tune_gemm(
            op, key=point.keys[op], seconds_of=seconds_of, cache=cache, candidates=candidates
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
