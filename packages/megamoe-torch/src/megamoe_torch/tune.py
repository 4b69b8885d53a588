"""`megamoe tune`: find the fastest cutedsl knobs per geometry, token count and weight dtype, and
store them in the knob cache ($MEGAMOE_KNOB_CACHE) under the keys the cutedsl backend looks
them up by (`CuteDSLExperts.knob_keys`), where a layer finds them on later runs: bf16 experts
tune the ops gate_up and down, FP8 ones (e4m3 weights with 128 x 128 block scales) gate_up_fp8
and down_fp8, on e4m3 rows with their row scales as the FP8 dispatch writes them.

Each GEMM is timed as the geometry's layer runs it: its epilogue variant (gpt-oss-120b's expert
biases and clamped SwiGLU) on the batch the layer's router and dispatch make of random tokens.
The key names the op, the GPU, the dtype, the weight dims and the rows per expert, not the
epilogue: the entry serves any layer of those dims, and was timed with this geometry's."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megamoe_kernels import GemmKnobs
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.experts.cutedsl import CuteDSLExperts, CuteDSLFP8Weights, CuteDSLWeights
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

# one GEMM of a point with some knobs (None: the default profile) -> its output
Runner = Callable[[GemmKnobs | None], object]


def weight_copies_for_cold_l2(*, active_bytes: int, l2_bytes: int, tensor_bytes: int) -> int:
    """How many copies of a weight tensor (tensor_bytes each, the original included) a timed
    runner cycles through, when one call reads active_bytes of it."""
    if active_bytes <= 0:
        return 1
    wanted = -(-COLD_L2_FACTOR * l2_bytes // active_bytes)
    affordable = 1 + WEIGHT_COPY_BUDGET_BYTES // max(tensor_bytes, 1)
    return max(1, min(wanted, affordable))


def _cycled_copies(weights: tuple[torch.Tensor, ...], *, experts_with_rows: int, l2_bytes: int):
    """An endless cycle of `weights` (an expert-stacked weight, with its block scales for FP8)
    and enough clones of them for cold-L2 timing."""
    per_expert_bytes = sum(tensor[0].numel() * tensor.element_size() for tensor in weights)
    copies = weight_copies_for_cold_l2(
        active_bytes=experts_with_rows * per_expert_bytes,
        l2_bytes=l2_bytes,
        tensor_bytes=sum(tensor.numel() * tensor.element_size() for tensor in weights),
    )
    clones = (_clone_keeping_layout(weights) for _ in range(copies - 1))
    return itertools.cycle([weights, *clones])


def _clone_keeping_layout(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Clones of `tensors` with their strides, those that share an allocation sharing the
    clone of it (a packed weight and its scale words: megamoe_kernels.pack_weight_tiles)."""
    storages: dict[int, torch.UntypedStorage] = {}
    clones = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in storages:
            storages[storage.data_ptr()] = storage.clone()
        clone = storages[storage.data_ptr()]
        clones.append(
            torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
                clone, tensor.storage_offset(), tensor.shape, tensor.stride()
            )
        )
    return tuple(clones)


@dataclass(frozen=True)
class TuningProblem:
    """One point's expert GEMMs as a layer's cutedsl backend meets them: the tight batch of the
    geometry's router on random tokens, the weights as the backend prepared them, and the
    knob-cache key of each GEMM by op (gate-up first), the backend's own `knob_keys`."""

    batch: ExpertBatch
    prepared: CuteDSLWeights | CuteDSLFP8Weights
    keys: dict[str, KnobKey]


@torch.no_grad()
def tuning_problem(
    geometry: Geometry, tokens: int, *, device: torch.device, weight_dtype: str | None = None
) -> TuningProblem:
    """The point's batch, prepared weights and keys; weight_dtype="fp8": the same random weights
    quantized per 128 x 128 block (bench.build_layer), so the keys are the FP8 ops'."""
    layer = bench.build_layer(
        geometry, device=device, dtype=torch.bfloat16, weight_dtype=weight_dtype
    )
    x_TH, ids, weights = bench.routed_tokens(layer, tokens)
    batch, _ = LocalDispatcher(geometry.num_experts).dispatch(x_TH, ids, weights)
    backend = CuteDSLExperts()  # no explicit knobs: every op is looked up, so every op is keyed
    prepared = backend.prepare(layer.expert_weight_pack())
    return TuningProblem(batch=batch, prepared=prepared, keys=backend.knob_keys(batch, prepared))


@torch.no_grad()
def gemm_runners(problem: TuningProblem, *, l2_bytes: int | None = None) -> dict[str, Runner]:
    """One runner per op of `problem`: bf16 rows and weights, or for FP8 weights the rows quantized
    to e4m3 per 128 columns (what the FP8 dispatch writes) and the weights with their block scales.
    The down GEMM reads the gate-up output of the default knobs. Each runner cycles through copies
    of its weights, so timed calls read them cold from HBM as a layer does
    (weight_copies_for_cold_l2 with an L2 of `l2_bytes`; None: the batch's GPU's). bf16 GEMMs run
    the pack's epilogue (its expert biases and SwiGLU variant), as the layer does; the FP8 kernels
    have none."""
    from megamoe_kernels import down, down_fp8, gate_up_swiglu, gate_up_swiglu_fp8, quantize_rows

    batch, prepared = problem.batch, problem.prepared
    # the GEMMs take (rows..., offsets, weights..., knobs=): rows and weights are one tensor
    # each in bf16, a tensor and its scales in FP8
    if isinstance(prepared, CuteDSLFP8Weights):
        gate_up_gemm, down_gemm = gate_up_swiglu_fp8, down_fp8
        rows = quantize_rows(batch.rows_MH)
        w13 = (prepared.w13, prepared.w13_scales)
        w2 = (prepared.w2_EHI, prepared.w2_scales)
    else:
        gate_up_gemm = functools.partial(
            gate_up_swiglu, w13_bias_EB2G=prepared.w13_bias_EB2G, swiglu=prepared.swiglu
        )
        down_gemm = functools.partial(down, w2_bias_EH=prepared.w2_bias_EH)
        rows, w13, w2 = (batch.rows_MH,), (prepared.w13,), (prepared.w2_EHI,)
    offsets = batch.expert_offsets
    hidden = gate_up_gemm(*rows, offsets, *w13)
    hidden = hidden if isinstance(hidden, tuple) else (hidden,)  # FP8: e4m3 and its scales
    experts_with_rows = int((offsets.diff() > 0).sum())
    if l2_bytes is None:
        l2_bytes = torch.cuda.get_device_properties(offsets.device).L2_cache_size
    w13s, w2s = (
        _cycled_copies(weights, experts_with_rows=experts_with_rows, l2_bytes=l2_bytes)
        for weights in (w13, w2)
    )
    gate_up_op, down_op = problem.keys
    return {
        gate_up_op: lambda knobs: gate_up_gemm(*rows, offsets, *next(w13s), knobs=knobs),
        down_op: lambda knobs: down_gemm(*hidden, offsets, *next(w2s), knobs=knobs),
    }


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
def tune_point(
    geometry: Geometry,
    tokens: int,
    *,
    cache: KnobCache,
    weight_dtype: str | None = None,
    repeats: int = 10,
    quick: bool = False,
    device: torch.device | None = None,
    timer: Callable[[Callable[[], object]], float] | None = None,
) -> list[TuneResult]:
    """Tunes gate-up and down for one (geometry, tokens) point on `device` (default: the current
    GPU), for bf16 experts or weight_dtype="fp8" ones; `quick` times only the deepest ring of
    each tile shape. timer: the seconds of one call (default: the median CUDA-graph replay of
    `repeats`)."""
    device = torch.device("cuda") if device is None else device

    def replay_seconds(call: Callable[[], object]) -> float:
        return median_graph_replay_seconds(call, device=device, repeats=repeats)

    timer = replay_seconds if timer is None else timer
    problem = tuning_problem(geometry, tokens, device=device, weight_dtype=weight_dtype)
    runners = gemm_runners(problem)
    results = []
    for op, key in problem.keys.items():

        def seconds_of(knobs: GemmKnobs | None, run: Runner = runners[op]) -> float:
            return timer(lambda: run(knobs))

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
