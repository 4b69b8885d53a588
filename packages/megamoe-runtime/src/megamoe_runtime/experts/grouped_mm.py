"""The baseline to beat: two torch._grouped_mm calls with an unfused SwiGLU between them.

FP8 weights are dequantized once to bf16 (the baseline has no FP8 path of its own). Experts
with biases or a clamped SwiGLU are refused (`prepare`): the baseline computes silu(gate) * up.

A tight batch is one grouped GEMM per projection over the expert offsets. A masked batch is a
batched GEMM over its [E, S, H] view (torch._grouped_mm 3-D x 3-D, no copy): every row of each
expert's stride is computed, so it costs the capacity's rows, not the valid ones; the rows past
an expert's count feed only their own output rows, which are unspecified."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.experts.base import check_batch_matches_weights
from megamoe_runtime.weights import Prequantized, Unquantized, WeightPack, dequantize


def grouped_mm_status(device: torch.device) -> tuple[bool, str]:
    if not hasattr(torch, "_grouped_mm"):
        return False, f"torch {torch.__version__} has no torch._grouped_mm (needs >= 2.8)"
    if device.type != "cuda":
        return False, f"torch._grouped_mm needs a CUDA device, got {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return False, f"torch._grouped_mm bf16 runs on sm_90; this GPU is sm_{major}{minor}"
    return True, "sm_90 GPU with torch._grouped_mm"


class GroupedMMExperts:
    name = "grouped_mm"
    supports_autograd = True
    captures_in_graphs = True

    def prepare(self, weights: WeightPack) -> Unquantized:
        if isinstance(weights, Prequantized):
            return dequantize(weights, torch.bfloat16)
        if weights.expert_math:
            raise ValueError(
                f"grouped_mm computes bias-free silu(gate) * up experts; these have "
                f"{', '.join(weights.expert_math)}: use backend 'cutedsl' or 'reference'"
            )
        if weights.w13_E2IH.dtype != torch.bfloat16:
            raise TypeError(f"grouped_mm runs bf16 weights, got {weights.w13_E2IH.dtype}")
        return weights

    def __call__(
        self, batch: ExpertBatch, prepared: Unquantized, *, row_scale_M: torch.Tensor | None = None
    ) -> torch.Tensor:
        batch = batch.materialized().dequantized()  # FP8 rows: their bf16 values
        check_batch_matches_weights(batch, prepared)
        intermediate = prepared.intermediate_size
        if batch.is_masked:
            shape = (batch.num_experts, batch.expert_stride, batch.hidden_size)
            rows, offs = batch.rows_MH.view(shape), None
        else:
            rows, offs = batch.rows_MH, batch.expert_offsets[1:]
        gate_up = torch._grouped_mm(rows, prepared.w13_E2IH.transpose(1, 2), offs=offs)
        hidden = F.silu(gate_up[..., :intermediate]) * gate_up[..., intermediate:]
        out_MH = torch._grouped_mm(hidden, prepared.w2_EHI.transpose(1, 2), offs=offs)
        out_MH = out_MH.reshape(batch.capacity, batch.hidden_size)  # a view
        if row_scale_M is not None:
            out_MH = (out_MH.float() * row_scale_M.unsqueeze(-1)).to(out_MH.dtype)
        return out_MH
