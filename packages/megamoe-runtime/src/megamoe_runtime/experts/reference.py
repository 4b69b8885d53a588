"""The oracle as a backend: fp32 accumulation per expert, on any device (it syncs: not for speed).

The whole expert math of the pack: its biases and its activation (SwiGLU, or ungated relu^2).
FP8 weights are dequantized once, to float32 (exactly the values they stand for). Both batch
layouts: a masked batch's rows past each expert's count are never read, and their outputs are
zero (as the rows past a tight batch's valid count are)."""

from __future__ import annotations

import torch
from megamoe_kernels.reference import expert_mlp_reference

from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.experts.base import check_batch_matches_weights
from megamoe_runtime.weights import Prequantized, Unquantized, WeightPack, dequantize


class ReferenceExperts:
    name = "reference"
    supports_autograd = True
    captures_in_graphs = False  # it reads the expert offsets on the host

    def prepare(self, weights: WeightPack) -> Unquantized:
        if isinstance(weights, Prequantized):
            return dequantize(weights, torch.float32)
        return weights

    def __call__(
        self, batch: ExpertBatch, prepared: Unquantized, *, row_scale_M: torch.Tensor | None = None
    ) -> torch.Tensor:
        check_batch_matches_weights(batch, prepared, same_dtype=False)
        batch = batch.materialized()
        rows_MH = batch.rows_MH
        if batch.row_scales_GM is not None:  # FP8 rows: the values they stand for
            from megamoe_kernels import dequantize_rows

            rows_MH = dequantize_rows(rows_MH, batch.row_scales_GM)
        out_MH = expert_mlp_reference(
            rows_MH,
            batch.expert_offsets,
            prepared.w13_E2IH,
            prepared.w2_EHI,
            row_scale_M,
            w13_bias_E2I=prepared.w13_bias_E2I,
            w2_bias_EH=prepared.w2_bias_EH,
            **prepared.swiglu.constants(),
            expert_counts=batch.expert_counts,
            activation=prepared.activation,
        )
        return out_MH.to(batch.output_dtype)
