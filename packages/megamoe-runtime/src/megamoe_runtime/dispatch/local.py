"""Dispatch and combine on one GPU: sort the (token, expert) pairs expert-major.

Shape legend: T tokens, K experts per token, H hidden size, E experts, M batch capacity.
Everything stays on the device: counts by scatter-add, offsets by cumsum, a stable sort for a
deterministic row order. The only host-side checks read shapes, never data, unless `check_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megamoe_runtime.dispatch.checks import check_expert_ids, validate_dispatch_inputs
from megamoe_runtime.expert_batch import ExpertBatch


@dataclass(frozen=True)
class LocalHandle:
    """What combine needs: where each (token, k) pair's row went, and its routing weight."""

    row_of_pair_TK: torch.Tensor
    topk_weights_TK: torch.Tensor
    output_dtype: torch.dtype
    # DeviceRoutedDispatcher's token_count: int32 [1] on the device, the first tokens routed
    # (and so combined) of the T rows; None: all T
    token_count: torch.Tensor | None = None
    # DeviceRoutedDispatcher's row_tokens: each batch row's token (int32 [capacity]) and its
    # pair's weight (float32 [capacity]), for a down GEMM that adds its rows into their tokens'
    # rows in place of the combine; None: not written
    row_tokens_M: torch.Tensor | None = None
    row_weights_M: torch.Tensor | None = None


class LocalDispatcher:
    """Dispatcher for one GPU holding all `num_experts` experts.

    `capacity` fixes the batch's row count (>= tokens x top_k) so shapes never change between
    calls, which CUDA-graph replay needs; None sizes each batch to exactly tokens x top_k.
    `check_ids` validates expert ids on every call, which costs a host sync; callers whose ids come
    from the router (always in range) turn it off.
    """

    def __init__(self, num_experts: int, *, capacity: int | None = None, check_ids: bool = True):
        for name, value in (("num_experts", num_experts), ("capacity", capacity)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0 or None, got {capacity}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts
        self.capacity = capacity
        self.check_ids = check_ids
        # small index tensors reused across calls (no per-call allocation or launch)
        self._row_indices_cache: tuple = (None, None)
        self._boundaries_cache: tuple = (None, None)

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[ExpertBatch, LocalHandle]:
        validate_dispatch_inputs(x_TH, topk_ids_TK, topk_weights_TK)
        tokens, top_k = topk_ids_TK.shape
        num_pairs = tokens * top_k
        capacity = num_pairs if self.capacity is None else self.capacity
        if num_pairs > capacity:
            raise ValueError(
                f"{tokens} tokens x top_k {top_k} = {num_pairs} rows exceed the dispatcher's "
                f"capacity {capacity}; raise capacity or send fewer tokens per call"
            )
        if self.check_ids:
            check_expert_ids(topk_ids_TK, self.num_experts)
        expert_of_pair = topk_ids_TK.reshape(-1)
        pair_of_row, row_of_pair, expert_offsets = expert_major_order(
            expert_of_pair,
            expert_boundaries=self._expert_boundaries(expert_of_pair),
            pair_indices=self._row_indices(num_pairs, x_TH.device),
        )
        token_of_row = pair_of_row // top_k
        if capacity == num_pairs:
            rows_MH = x_TH.index_select(0, token_of_row)
        else:  # rows past the valid count stay unspecified
            rows_MH = x_TH.new_empty(capacity, x_TH.shape[1])
            rows_MH[:num_pairs] = x_TH.index_select(0, token_of_row)
        batch = ExpertBatch(rows_MH=rows_MH, expert_offsets=expert_offsets, valid_rows=num_pairs)
        handle = LocalHandle(
            row_of_pair_TK=row_of_pair.view(tokens, top_k),
            topk_weights_TK=topk_weights_TK,
            output_dtype=x_TH.dtype,
        )
        return batch, handle

    def _row_indices(self, count: int, device: torch.device) -> torch.Tensor:
        if torch.compiler.is_compiling():
            # inside a compiled graph a kept tensor would be one of its outputs, which CUDA-graph
            # trees overwrite at the next replay: made in the graph (inductor folds it)
            return torch.arange(count, device=device)
        key = (count, device)
        if self._row_indices_cache[0] != key:
            self._row_indices_cache = (key, torch.arange(count, device=device))
        return self._row_indices_cache[1]

    def _expert_boundaries(self, like: torch.Tensor) -> torch.Tensor:
        # offsets[e] = number of pairs whose expert < e, found by binary search in the sorted ids
        if torch.compiler.is_compiling():  # as in _row_indices
            return torch.arange(self.num_experts + 1, dtype=like.dtype, device=like.device)
        key = (like.dtype, like.device)
        if self._boundaries_cache[0] != key:
            boundaries = torch.arange(self.num_experts + 1, dtype=like.dtype, device=like.device)
            self._boundaries_cache = (key, boundaries)
        return self._boundaries_cache[1]

    def row_weights(self, batch: ExpertBatch, handle: LocalHandle) -> torch.Tensor:
        """Routing weight of every batch row (RowWeightsDispatcher)."""
        return row_weights_of(batch, handle)

    def combine(
        self, expert_out_MH: torch.Tensor, handle: LocalHandle, *, weights_applied: bool = False
    ) -> torch.Tensor:
        return weighted_sum_over_topk(
            expert_out_MH,
            handle.row_of_pair_TK,
            None if weights_applied else handle.topk_weights_TK,
            output_dtype=handle.output_dtype,
        )


def row_weights_of(batch: ExpertBatch, handle: LocalHandle) -> torch.Tensor:
    """float32 [capacity]: the routing weight of every batch row of a one-GPU dispatch, 0 past
    the valid rows. Refused for a routing of counted tokens (its pair rows past the count are
    stale: which are is known on the device alone)."""
    if handle.token_count is not None:
        raise ValueError(
            "row weights of a routing with a token_count: the pairs past the count are stale, "
            "and the count is on the device (route without token_count)"
        )
    weights_M = torch.zeros(batch.capacity, dtype=torch.float32, device=batch.rows_MH.device)
    weights_M[handle.row_of_pair_TK.reshape(-1)] = handle.topk_weights_TK.reshape(-1).float()
    return weights_M


def weighted_sum_over_topk(
    expert_out_MH: torch.Tensor,
    row_of_pair_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor | None,
    *,
    output_dtype: torch.dtype,
    pair_present_TK: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[t] = sum over k = 0..K-1, in that order, of weight[t, k] * out[row[t, k]], in fp32.

    Each contribution is rounded to fp32 before it is added (a multiply, then an add: no fused
    multiply-add), the arithmetic the expert-parallel combine kernels do too, so both give the same
    bits. One gather and one multiply per chunk of tokens, then one add per k: the order of
    additions never depends on the token count, so results are bitwise reproducible.

    `pair_present_TK` (bool): only the pairs it marks contribute (a rank's share of a token's
    experts); an absent pair's row must still index `expert_out_MH`, but what it holds never
    reaches y (it adds +0.0, which leaves every fp32 sum as it is).
    """
    tokens, top_k = row_of_pair_TK.shape
    hidden = expert_out_MH.shape[1]
    # bound the fp32 temporary [chunk, K, H] to about 256 MiB
    chunk = max(1, (1 << 26) // max(1, top_k * hidden))

    def rows(start: int, end: int) -> tuple:
        return (
            row_of_pair_TK[start:end],
            None if topk_weights_TK is None else topk_weights_TK[start:end],
            None if pair_present_TK is None else pair_present_TK[start:end],
        )

    if tokens <= chunk and top_k > 0:  # decode and most prefill: one chunk
        contributions_TKH = _contributions(expert_out_MH, *rows(0, tokens))
        return _sum_over_k(contributions_TKH).to(output_dtype)
    y_TH = torch.zeros(tokens, hidden, dtype=torch.float32, device=expert_out_MH.device)
    for start in range(0, tokens, chunk):
        contributions_TKH = _contributions(expert_out_MH, *rows(start, start + chunk))
        _sum_over_k(contributions_TKH, into_TH=y_TH[start : start + chunk])
    return y_TH.to(output_dtype)


def _contributions(
    expert_out_MH: torch.Tensor,
    row_of_pair_TK: torch.Tensor,
    topk_weights_TK: torch.Tensor | None,
    pair_present_TK: torch.Tensor | None,
) -> torch.Tensor:
    """fp32 [T, K, H]: each pair's expert row times its weight, rounded to fp32 (0 where absent)."""
    top_k, hidden = row_of_pair_TK.shape[1], expert_out_MH.shape[1]
    gathered_TKH = expert_out_MH.index_select(0, row_of_pair_TK.reshape(-1)).view(-1, top_k, hidden)
    if topk_weights_TK is None:
        contributions_TKH = gathered_TKH.float()
    else:
        contributions_TKH = gathered_TKH * topk_weights_TK.float().unsqueeze(-1)
    if pair_present_TK is None:
        return contributions_TKH
    return torch.where(pair_present_TK.unsqueeze(-1), contributions_TKH, 0.0)


def _sum_over_k(
    contributions_TKH: torch.Tensor, *, into_TH: torch.Tensor | None = None
) -> torch.Tensor:
    """0 + c_0 + c_1 + ... + c_{K-1} in fp32, in that order; added to `into_TH` (zero-filled)
    when given, else into a new tensor that starts as c_0 + 0.0: the bits of 0.0 + c_0 (-0.0
    becomes +0.0) without a zero-fill launch."""
    if into_TH is None:
        into_TH, first = contributions_TKH[:, 0] + 0.0, 1
    else:
        first = 0
    for k in range(first, contributions_TKH.shape[1]):
        into_TH += contributions_TKH[:, k]
    return into_TH


def expert_major_order(
    expert_of_pair_P: torch.Tensor, *, expert_boundaries: torch.Tensor, pair_indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pair_of_row, row_of_pair, expert_offsets) of the pairs sorted by expert, on the device.

    The sort is stable: equal experts keep pair order, so the batch (and everything after) is
    deterministic. `expert_boundaries` is arange(E + 1) in the ids' dtype, `pair_indices`
    arange(P); offsets[e] counts the pairs whose expert is below e (a binary search in the
    sorted ids, no sync), so a pair whose id is E or more (an absent pair's sentinel) sorts
    after every expert's rows, past offsets[E].
    """
    sorted_experts, pair_of_row = torch.sort(expert_of_pair_P, stable=True)
    row_of_pair = torch.empty_like(pair_of_row)
    row_of_pair.scatter_(0, pair_of_row, pair_indices)
    expert_offsets = torch.searchsorted(sorted_experts, expert_boundaries, out_int32=True)
    return pair_of_row, row_of_pair, expert_offsets


def expert_offsets_from_ids(expert_of_pair: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int32 [E + 1] prefix sums of rows per expert, computed on the device (no sync)."""
    counts_E = torch.zeros(num_experts, dtype=torch.int32, device=expert_of_pair.device)
    counts_E.scatter_add_(
        0, expert_of_pair.long(), torch.ones_like(expert_of_pair, dtype=torch.int32)
    )
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32, device=expert_of_pair.device)
    torch.cumsum(counts_E, dim=0, dtype=torch.int32, out=offsets[1:])
    return offsets
