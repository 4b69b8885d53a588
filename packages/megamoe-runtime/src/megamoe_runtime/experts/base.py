"""The protocol every expert-compute backend follows.

Expert compute sees an ExpertBatch and weights, nothing else: routing weights reach it only as an
optional per-row scale (`row_scale_M`) that its down-projection epilogue may apply.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, Protocol

import torch

from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.weights import WeightPack


class ExpertBackend(Protocol):
    name: str
    # whether autograd can differentiate its output (the layer trains only through such backends)
    supports_autograd: bool
    # whether a call captures in a CUDA graph (no host sync: the offsets stay on the device)
    captures_in_graphs: bool

    def prepare(self, weights: WeightPack) -> Any:
        """Transforms the weights (bf16 or FP8) into this backend's layout; run once, the result
        is cached."""
        ...

    def __call__(
        self, batch: ExpertBatch, prepared: Any, *, row_scale_M: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Returns expert_out_MH ([capacity, H], the rows' dtype); rows past the valid count are
        unspecified."""
        ...


def check_batch_matches_weights(
    batch: ExpertBatch, weights: WeightPack, *, same_dtype: bool = True
) -> None:
    """The batch fits the weights: experts, hidden size, device, and with `same_dtype` the
    rows' dtype (FP8 weights and the reference's fp32 ones take bf16 rows)."""
    if batch.num_experts != weights.num_experts:
        raise ValueError(
            f"batch has {batch.num_experts} experts but the weights hold {weights.num_experts}"
        )
    if batch.hidden_size != weights.hidden_size:
        raise ValueError(
            f"batch rows have hidden size {batch.hidden_size}, weights expect {weights.hidden_size}"
        )
    if same_dtype and batch.row_scales_GM is None and batch.rows_MH.dtype != weights.w13_E2IH.dtype:
        raise TypeError(
            f"batch rows are {batch.rows_MH.dtype} but weights are {weights.w13_E2IH.dtype}"
        )
    if batch.rows_MH.device != weights.w13_E2IH.device:
        raise ValueError(
            f"batch on {batch.rows_MH.device} but weights on {weights.w13_E2IH.device}"
        )


def expert_slice(weights: Any, first: int, last: int) -> Any:
    """Weights (a pack, or any backend's prepared weights: a frozen dataclass whose tensors
    lead with the expert dimension) for experts first .. last - 1, as views."""
    views = {
        field.name: value[first:last]
        for field in fields(weights)
        if isinstance(value := getattr(weights, field.name), torch.Tensor)
    }
    return replace(weights, **views)


def first_experts(prepared: Any, count: int) -> Any:
    """Prepared weights for their first `count` experts, as views (expert_slice): a batch of
    the routed experts alone on weights prepared with shared experts after them."""
    return expert_slice(prepared, 0, count)
