"""The input checks and expert-ownership rule every dispatcher shares.

Shape legend: T tokens, K experts per token, H hidden size, E experts.
Each check reads shapes, dtypes and devices only (no host sync), except `check_expert_ids`.
"""

from __future__ import annotations

import torch

# what crosses NVLink in the nvshmem dispatcher's dispatch and combine (SymmetricDispatcher)
WIRE_DTYPES = ("bf16", "fp8")


def check_wire_dtypes(*, dispatch_dtype: str, combine_dtype: str, hidden_size: int) -> None:
    """Raises unless the dispatch and combine wire dtypes are known and the rows take them."""
    for name, value in (("dispatch_dtype", dispatch_dtype), ("combine_dtype", combine_dtype)):
        if value not in WIRE_DTYPES:
            raise ValueError(f"{name} must be one of {WIRE_DTYPES}, got {value!r}")
        if value == "fp8" and hidden_size % 16:
            raise ValueError(
                f"{name}='fp8' needs a hidden size that is a multiple of 16 (whole 16-byte e4m3 "
                f"vectors), got hidden_size={hidden_size}; use {name}='bf16'"
            )


def experts_per_rank(num_experts: int, world_size: int) -> int:
    """L = E / world; raises unless the experts split evenly (each rank owns a contiguous block)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if num_experts % world_size:
        raise ValueError(
            f"num_experts={num_experts} must be divisible by the expert-parallel world size "
            f"{world_size} (each rank owns num_experts / world_size contiguous experts); "
            f"use a world size that divides {num_experts}"
        )
    return num_experts // world_size


def validate_dispatch_inputs(
    x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor
) -> None:
    """x [T, H], topk_ids int32/int64 [T, K], topk_weights [T, K], all on x's device."""
    if x_TH.dim() != 2:
        raise ValueError(f"x must be 2-D [tokens, hidden], got shape {tuple(x_TH.shape)}")
    if topk_ids_TK.dim() != 2 or topk_ids_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(
            f"topk_ids must be [tokens={x_TH.shape[0]}, top_k], got shape {tuple(topk_ids_TK.shape)}"
        )
    if topk_ids_TK.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids_TK.dtype}")
    if topk_weights_TK.shape != topk_ids_TK.shape:
        raise ValueError(
            f"topk_weights shape {tuple(topk_weights_TK.shape)} must equal topk_ids shape "
            f"{tuple(topk_ids_TK.shape)}"
        )
    for name, tensor in (("topk_ids", topk_ids_TK), ("topk_weights", topk_weights_TK)):
        if tensor.device != x_TH.device:
            raise ValueError(f"{name} is on {tensor.device} but x is on {x_TH.device}")


def check_top_k(topk_ids_TK: torch.Tensor, top_k: int) -> None:
    """For dispatchers whose buffers are sized by top_k."""
    if topk_ids_TK.shape[1] != top_k:
        raise ValueError(
            f"topk_ids has top_k {topk_ids_TK.shape[1]}; the dispatcher was built for top_k={top_k}"
        )


def check_token_count(tokens: int, max_tokens_per_rank: int, *, sized: str) -> None:
    """For dispatchers whose buffers (`sized` names them) hold max_tokens_per_rank tokens."""
    if tokens > max_tokens_per_rank:
        raise ValueError(
            f"{tokens} tokens exceed max_tokens_per_rank={max_tokens_per_rank}, which sizes "
            f"{sized}: send at most that many per call (split the batch), or build the "
            f"dispatcher with a larger max_tokens_per_rank"
        )


def check_expert_ids(topk_ids_TK: torch.Tensor, num_experts: int) -> None:
    """Raises on an id outside [0, num_experts). Reads the data: a host sync."""
    if topk_ids_TK.numel() == 0:
        return
    low, high = int(topk_ids_TK.min()), int(topk_ids_TK.max())
    if low < 0 or high >= num_experts:
        raise ValueError(
            f"topk_ids must lie in [0, {num_experts}); found values in [{low}, {high}]"
        )
