"""The baseline to beat: two torch._grouped_mm calls with an unfused SwiGLU between them.

FP8 weights are dequantized once to bf16 (the baseline has no FP8 path of its own)."""

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
        if weights.w13_E2IH.dtype != torch.bfloat16:
            raise TypeError(f"grouped_mm runs bf16 weights, got {weights.w13_E2IH.dtype}")
        return weights

    def __call__(
        self, batch: ExpertBatch, prepared: Unquantized, *, row_scale_M: torch.Tensor | None = None
    ) -> torch.Tensor:
        if batch.row_scales_GM is not None:
            raise TypeError("grouped_mm takes full-precision batch rows, not FP8 ones")
        check_batch_matches_weights(batch, prepared)
        group_ends_E = batch.expert_offsets[1:]
        intermediate = prepared.intermediate_size
        gate_up_M2I = torch._grouped_mm(
            batch.rows_MH, prepared.w13_E2IH.transpose(1, 2), offs=group_ends_E
        )
        hidden_MI = F.silu(gate_up_M2I[:, :intermediate]) * gate_up_M2I[:, intermediate:]
        out_MH = torch._grouped_mm(hidden_MI, prepared.w2_EHI.transpose(1, 2), offs=group_ends_E)
        if row_scale_M is not None:
            out_MH = (out_MH.float() * row_scale_M.unsqueeze(-1)).to(out_MH.dtype)
        return out_MH
