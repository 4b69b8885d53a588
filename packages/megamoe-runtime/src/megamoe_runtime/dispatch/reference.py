"""Pure-torch references of the expert-parallel kernels' arithmetic (dispatch/symmetric.py),
for the tests: exchange_and_place's placement (the kernel does both steps on the device in one
launch; tests/test_distributed_placement.py checks the placement rule with them), the exact and
the partial-sum combine's arithmetic, each over a bf16 or an FP8 wire
(tests/test_multirank_dispatch.py compares the kernels with them bit for bit).

The FP8 wire: what crosses NVLink is e4m3 with one float32 scale per row and 128 columns,
quantized by megamoe_kernels.quantize_rows' recipe (the dispatch's batch rows are exactly
quantize_rows of the bf16 batch rows); `wire_values` gives the fp32 values such rows stand for
where they land.

Shape legend: T tokens, K experts per token, H hidden size, E experts, W world size, P = T x K
pairs.
"""

from __future__ import annotations

import torch


def count_pairs(expert_of_pair_P: torch.Tensor, num_experts: int):
    """(int32 [E] pairs per expert, int64 [P] each pair's position inside its expert in pair
    order)."""
    device = expert_of_pair_P.device
    num_pairs = expert_of_pair_P.numel()
    expert_long_P = expert_of_pair_P.long()
    counts_E = torch.zeros(num_experts, dtype=torch.int32, device=device)
    counts_E.scatter_add_(0, expert_long_P, torch.ones_like(expert_of_pair_P))
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    pair_of_sorted_P = torch.argsort(expert_of_pair_P, stable=True)
    position_P = torch.empty(num_pairs, dtype=torch.int64, device=device)
    position_P[pair_of_sorted_P] = (
        torch.arange(num_pairs, device=device) - starts_E[expert_long_P[pair_of_sorted_P]]
    )
    return counts_E, position_P


def place_pairs(
    expert_of_pair_P: torch.Tensor,
    position_P: torch.Tensor,
    gathered_counts_WE: torch.Tensor,
    *,
    rank: int,
    world: int,
    local_experts: int,
):
    """Where each of this rank's pairs lands in its owner's batch, and this rank's expert_offsets.

    The owner's batch is expert-major, then source rank, then the source's pair order: with every
    rank's counts (gathered_counts_WE [source, expert]), a pair of expert e = (owner, j) from
    `rank` lands at (rows of the owner's experts before j) + (rows of expert e from sources before
    `rank`) + (its position among this rank's pairs of e).
    """
    counts_SDL = gathered_counts_WE.view(world, world, local_experts).long()  # [source, owner, j]
    rows_DL = counts_SDL.sum(0)
    expert_start_DL = torch.cumsum(rows_DL, 1) - rows_DL
    before_source_DL = (torch.cumsum(counts_SDL, 0) - counts_SDL)[rank]
    first_row_E = (expert_start_DL + before_source_DL).reshape(-1)
    dest_row_P = (first_row_E[expert_of_pair_P.long()] + position_P).to(torch.int32)
    expert_offsets = torch.zeros(local_experts + 1, dtype=torch.int32, device=rows_DL.device)
    torch.cumsum(rows_DL[rank], 0, out=expert_offsets[1:])
    return dest_row_P, expert_offsets


def wire_values(rows_NH: torch.Tensor, *, wire: str, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 values rows (any float dtype) stand for once they crossed the wire: rounded to
    `dtype` (the bf16 wire), or (wire 'fp8') quantized to e4m3 with one scale per row and 128
    columns and dequantized (e4m3 x scale, rounded in fp32)."""
    from megamoe_kernels.shim.fp8 import dequantize_rows, quantize_rows

    if wire == "bf16":
        return rows_NH.to(dtype).float()
    if wire != "fp8":
        raise ValueError(f"wire must be 'bf16' or 'fp8', got {wire!r}")
    shape = rows_NH.shape
    flat_NH = rows_NH.reshape(-1, shape[-1])
    return dequantize_rows(*quantize_rows(flat_NH)).view(shape)


def exact_combine(
    out_TKH: torch.Tensor, weights_TK: torch.Tensor, *, dtype: torch.dtype, wire: str = "bf16"
) -> torch.Tensor:
    """What the exact combine computes for a source's tokens, given each (token, k)'s expert
    output (in `dtype`) and weight: each output as it crossed the wire (`wire_values`), then
    sum over k in k order of weight x value in fp32 (each product rounded on its own), rounded
    to `dtype`. Over the bf16 wire, the single-GPU combine's arithmetic."""
    values_TKH = wire_values(out_TKH, wire=wire, dtype=dtype)
    products_TKH = weights_TK.float().unsqueeze(-1) * values_TKH  # rounded per element
    y_TH = torch.zeros(out_TKH.shape[0], out_TKH.shape[2], device=out_TKH.device)
    for k in range(out_TKH.shape[1]):  # k order, one add at a time (no tree reduction)
        y_TH = y_TH + products_TKH[:, k]
    return y_TH.to(dtype)


def owner_partials_combine(
    out_TKH: torch.Tensor,
    weights_TK: torch.Tensor,
    owner_TK: torch.Tensor,
    *,
    world: int,
    dtype: torch.dtype,
    wire: str = "bf16",
) -> torch.Tensor:
    """What the partial-sum combine computes for a source's tokens, given each (token, k)'s
    expert output, weight and owner rank: per owner, sum over its k in k order of
    weight x output in fp32 (each product rounded on its own), then the partial as it crosses
    NVLink (`wire_values`: rounded to `dtype`, or e4m3 with its scales); then the partials of
    the owners a token touched, added in rank order in fp32, rounded to `dtype`."""
    products_TKH = weights_TK.float().unsqueeze(-1) * out_TKH.float()  # rounded per element
    y_TH = torch.zeros(out_TKH.shape[0], out_TKH.shape[2], device=out_TKH.device)
    for owner in range(world):
        mine_TK = owner_TK == owner
        partial_TH = torch.zeros_like(y_TH)
        for k in range(out_TKH.shape[1]):  # k order, one add at a time (no tree reduction)
            partial_TH = partial_TH + torch.where(mine_TK[:, k, None], products_TKH[:, k], 0.0)
        touched_T1 = mine_TK.any(dim=1, keepdim=True)
        sent_TH = wire_values(partial_TH, wire=wire, dtype=dtype)
        y_TH = y_TH + torch.where(touched_T1, sent_TH, 0.0)
    return y_TH.to(dtype)
