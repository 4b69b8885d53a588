"""Expert-compute backends and the choice between them.

| backend    | where                   | what                                          |
|------------|-------------------------|-----------------------------------------------|
| reference  | CPU or any GPU          | pure torch, fp32 accumulate: the oracle        |
| grouped_mm | sm_90 GPU, torch >= 2.8 | torch._grouped_mm composition: the baseline    |
| cutedsl    | sm_90a GPU              | megamoe's CuTe DSL kernels                     |

`auto` picks the first of cutedsl, grouped_mm, reference that can run, and says why.
"""

from __future__ import annotations

import torch

from megamoe_runtime.experts.base import (
    ExpertBackend,
    check_batch_matches_weights,
    expert_slice,
    first_experts,
)
from megamoe_runtime.experts.cutedsl import CuteDSLExperts, cutedsl_status
from megamoe_runtime.experts.grouped_mm import GroupedMMExperts, grouped_mm_status
from megamoe_runtime.experts.reference import ReferenceExperts
from megamoe_runtime.weights import UNGATED_RELU2

BACKEND_NAMES = ("cutedsl", "grouped_mm", "reference")


def backend_status(
    name: str,
    device: torch.device,
    *,
    masked_batches: bool = False,
    fp8_rows: bool = False,
    fp8_weights: bool = False,
    expert_math: tuple[str, ...] = (),
) -> tuple[bool, str]:
    """(can run, why) for one backend on `device`, for the batches a layer's dispatcher hands
    out: `masked_batches` (the masked layout: a DeepEP low-latency receive buffer) and
    `fp8_rows` (e4m3 rows with scales: FP8 dispatch), with `fp8_weights` or not, and for
    experts with `expert_math` (WeightPack.expert_math: biases, a clamped SwiGLU)."""
    refusal = _batch_refusal(
        name,
        masked_batches=masked_batches,
        fp8_rows=fp8_rows,
        fp8_weights=fp8_weights,
        expert_math=expert_math,
    )
    if refusal is not None:
        return False, refusal
    if name == "reference":
        return True, "pure torch runs everywhere"
    if name == "grouped_mm":
        return grouped_mm_status(device)
    if name == "cutedsl":
        return cutedsl_status(device)
    raise ValueError(f"backend must be one of {('auto', *BACKEND_NAMES)}, got {name!r}")


def _batch_refusal(
    name: str,
    *,
    masked_batches: bool,
    fp8_rows: bool,
    fp8_weights: bool,
    expert_math: tuple[str, ...] = (),
) -> str | None:
    """Why backend `name` cannot compute such batches or experts (None: it can)."""
    if name == "cutedsl" and UNGATED_RELU2 in expert_math:
        return f"the cutedsl kernels compute gated (SwiGLU) experts, not {UNGATED_RELU2}"
    # FP8 weights (a Prequantized pack) hold no biases: their expert math is the SwiGLU's
    # variant, which the cutedsl FP8 kernels compute as the bf16 ones do
    # FP8 rows (an FP8 dispatch) run on every backend: bf16 experts dequantize the batch
    # (ExpertBatch.dequantized), the reference computes on the values the rows stand for
    return None


def select_backend(
    requested: str,
    device: torch.device,
    *,
    masked_batches: bool = False,
    fp8_rows: bool = False,
    fp8_weights: bool = False,
    expert_math: tuple[str, ...] = (),
) -> tuple[str, str]:
    """Resolves 'auto' (or checks an explicit name) to (backend name, reason); the batch and
    expert keywords as for `backend_status`."""
    device = torch.device(device)
    batches = {
        "masked_batches": masked_batches,
        "fp8_rows": fp8_rows,
        "fp8_weights": fp8_weights,
        "expert_math": expert_math,
    }
    if requested != "auto":
        available, reason = backend_status(requested, device, **batches)
        if not available:
            raise ValueError(f"backend {requested!r} cannot run on {device}: {reason}")
        return requested, reason
    skipped = []
    for name in BACKEND_NAMES:
        available, reason = backend_status(name, device, **batches)
        if available:
            because = f"; skipped {'; '.join(skipped)}" if skipped else ""
            return name, f"auto: {name} ({reason}){because}"
        skipped.append(f"{name}: {reason}")
    raise AssertionError("the reference backend always runs")


def make_backend(name: str, *, tile_pack: bool = False) -> ExpertBackend:
    """The backend `name`; tile_pack: the cutedsl backend lays its weights out in packets
    (CuteDSLExperts(tile_pack=True)); the others keep their own layout."""
    backends = {
        "reference": ReferenceExperts,
        "grouped_mm": GroupedMMExperts,
        "cutedsl": CuteDSLExperts,
    }
    if name not in backends:
        raise ValueError(f"backend must be one of {tuple(backends)}, got {name!r}")
    if name == "cutedsl":
        return CuteDSLExperts(tile_pack=tile_pack)
    return backends[name]()


__all__ = [
    "BACKEND_NAMES",
    "CuteDSLExperts",
    "ExpertBackend",
    "GroupedMMExperts",
    "ReferenceExperts",
    "backend_status",
    "check_batch_matches_weights",
    "expert_slice",
    "first_experts",
    "make_backend",
    "select_backend",
]
