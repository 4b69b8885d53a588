"""The oracle as a backend: fp32 accumulation per expert, on any device (it syncs: not for speed)."""

from __future__ import annotations

import torch
from megamoe_kernels.reference import expert_mlp_reference

from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.experts.base import check_batch_matches_weights
from megamoe_runtime.weights import Unquantized


class ReferenceExperts:
    name = "reference"
    supports_autograd = True

    def prepare(self, weights: Unquantized) -> Unquantized:
        return weights

    def __call__(
        self, batch: ExpertBatch, prepared: Unquantized, *, row_scale_M: torch.Tensor | None = None
    ) -> torch.Tensor:
        check_batch_matches_weights(batch, prepared)
        out_MH = expert_mlp_reference(
            batch.rows_MH, batch.expert_offsets, prepared.w13_E2IH, prepared.w2_EHI, row_scale_M
        )
        return out_MH.to(batch.rows_MH.dtype)
