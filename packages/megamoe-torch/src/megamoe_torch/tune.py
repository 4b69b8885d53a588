"""`megamoe tune`: find the fastest cutedsl knobs per geometry and token count, store them in the
knob cache ($MEGAMOE_KNOB_CACHE), where the cutedsl backend finds them on later runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megamoe_kernels import candidate_knobs
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.experts.cutedsl import CuteDSLExperts
from megamoe_runtime.geometries import Geometry
from megamoe_runtime.tuning.cache import KnobCache
from megamoe_runtime.tuning.expert_knobs import gemm_key, tune_gemm
from megamoe_runtime.weights import Unquantized

from megamoe_torch import bench
from megamoe_torch.timing import median_graph_replay_seconds


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
    return batch, {
        "gate_up": (
            (2 * intermediate, hidden),
            lambda knobs: gate_up_swiglu(
                batch.rows_MH, batch.expert_offsets, prepared.w13_EB2GH, knobs=knobs
            ),
        ),
        "down": (
            (hidden, intermediate),
            lambda knobs: down(hidden_MI, batch.expert_offsets, prepared.w2_EHI, knobs=knobs),
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
        candidates = candidate_knobs(op, stage_choices=("max",)) if quick else candidate_knobs(op)
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
