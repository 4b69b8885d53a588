"""The baseline to beat: two torch._grouped_mm calls with torch ops around them.

FP8 weights are dequantized once to bf16 (the baseline has no FP8 path of its own).

Bias-free silu(gate) * up experts: silu(gate) * up in the rows' dtype on the gate-up GEMM's
output. Experts with expert math (`Unquantized.expert_math`: per-expert biases, gpt-oss's
clamped SwiGLU, Inkling2's softcapped one, ungated relu^2 experts) compute it in the oracle's
order, in fp32 after each GEMM: the gate-up (or up) output plus each row's expert's bias, then
megamoe_kernels.reference.swiglu (gate clamped to at most `limit`, up to [-limit, limit],
gate * sigmoid(alpha * gate) * (up + up_offset), the softcaps) or relu(up)^2, rounded to the
rows' dtype for the down GEMM; the down output plus its bias, then the row scale.
torch._grouped_mm writes its output in its inputs' dtype and takes no bias, so its
accumulators are rounded to bf16 before a bias is added (the cutedsl kernels add it to the fp32
accumulators). Each row's expert comes from a search in the offsets on the device: no host
sync, so a call captures in a CUDA graph. Autograd differentiates all of it.

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


class _RowBiases:
    """Per-expert biases [E, N] as a GEMM's output rows take them: [E, 1, N] against a masked
    batch's [E, S, N] output; [capacity, N] against a tight batch's, each valid row its
    expert's bias and the rows past them zeros (their unspecified values, and the gradients a
    backward leaves in them, never reach a bias)."""

    def __init__(self, batch: ExpertBatch):
        self.masked = batch.is_masked
        self.expert_of_row_M = None
        if not self.masked:
            offsets = batch.expert_offsets
            rows_M = torch.arange(batch.capacity, device=offsets.device, dtype=offsets.dtype)
            # how many experts end at or before each row: the row's own expert (an empty one
            # ends where it starts), E past the valid rows
            self.expert_of_row_M = torch.searchsorted(offsets[1:], rows_M, right=True)

    def __call__(self, bias_EN: torch.Tensor) -> torch.Tensor:
        if self.masked:
            return bias_EN.unsqueeze(1)
        with_zeros_EN = torch.cat((bias_EN, bias_EN.new_zeros(1, bias_EN.shape[1])))
        return with_zeros_EN.index_select(0, self.expert_of_row_M)


class GroupedMMExperts:
    name = "grouped_mm"
    supports_autograd = True
    captures_in_graphs = True

    def prepare(self, weights: WeightPack) -> Unquantized:
        if isinstance(weights, Prequantized):
            return dequantize(weights, torch.bfloat16)
        if weights.w13_E2IH.dtype != torch.bfloat16:
            raise TypeError(f"grouped_mm runs bf16 weights, got {weights.w13_E2IH.dtype}")
        return weights  # the layer's autograd forwards hand it the live parameters

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
        w13_bias, w2_bias = prepared.w13_bias_E2I, prepared.w2_bias_EH
        row_biases = _RowBiases(batch) if w13_bias is not None or w2_bias is not None else None
        gate_up = torch._grouped_mm(rows, prepared.w13_E2IH.transpose(1, 2), offs=offs)
        if prepared.expert_math:
            gate_up = gate_up.float()  # a copy of the bf16 output: the bias adds in place
            if w13_bias is not None:
                gate_up += row_biases(w13_bias)
            if prepared.gated:
                hidden = prepared.swiglu(gate_up[..., :intermediate], gate_up[..., intermediate:])
            else:
                hidden = torch.relu(gate_up).square()
            hidden = hidden.to(rows.dtype)
        else:
            hidden = F.silu(gate_up[..., :intermediate]) * gate_up[..., intermediate:]
        out = torch._grouped_mm(hidden, prepared.w2_EHI.transpose(1, 2), offs=offs)
        if w2_bias is None and row_scale_M is None:
            return out.reshape(batch.capacity, batch.hidden_size)  # a view
        out_fp32 = out.float()
        if w2_bias is not None:
            out_fp32 += row_biases(w2_bias)
        out_fp32 = out_fp32.reshape(batch.capacity, batch.hidden_size)
        if row_scale_M is not None:
            out_fp32 = out_fp32 * row_scale_M.unsqueeze(-1)
        return out_fp32.to(out.dtype)
