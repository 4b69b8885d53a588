"""The symmetric-memory dispatcher's algorithms: which kernels a dispatch and a combine run.

Shape legend: T tokens of this rank, K experts per token, H hidden size, L experts per rank,
W world size, P = T x K pairs, M batch capacity.

SymmetricDispatcher picks one dispatch and one combine algorithm when it is built (every rank of
the group picks the same: the choice depends only on static sizes) and calls them on every
dispatch and combine. Each declares the symmetric buffers it needs (`buffer_shapes`), so the
dispatcher allocates only those, and launches its kernels with the dispatcher's EpParams.

Dispatch:
- DirectDispatch: exchange_and_place, then dispatch_rows sends every (token, expert) pair's row
  over NVLink straight into its batch row, then wait_phase waits for every source. The simplest
  path: a token crosses NVLink once per pair.
- StagedDispatch: exchange_and_place, then dispatch_tokens: a token crosses NVLink once per owner
  rank, into the owner's staged rows, and the owner expands it into its batch rows in local HBM
  as it lands (the expansion overlaps the NVLink traffic).
- SmallBatchDispatch: dispatch_small, one kernel in which every rank sends its epoch-tagged
  expert ids and its token rows at once and each owner places its own rows from every source's
  ids, so the rows cross NVLink while the placement runs. Fits world x max_tokens x K <= 8192
  pairs and at most 512 experts per rank.
Combine:
- ExactCombine: combine_push sends each output row home, combine_reduce sums weight x output in
  k order in fp32: the single-GPU combine's arithmetic, so EP=W and EP=1 agree bitwise.
- PartialSumCombine: each owner sums its share of a token's top-k (weights applied, fp32, k
  order) and one bf16 row per (token, owner) crosses NVLink instead of one per pair; the source
  adds the owners' partials in rank order. Deterministic and up to K x fewer combine bytes, but
  one more bf16 rounding than the exact combine. Its dispatch writes the routing weights into the
  owners' pair tables (EpParams.pair_weights).
The wire (SymmetricSizes.fp8_rows, fp8_combine): with an FP8 dispatch every kernel above moves
e4m3 token rows with one float32 scale per row and 128 columns instead of bf16 rows, quantized
where the source reads the token (the batch is e4m3 with `row_scales` [groups, capacity], what the
FP8 experts take); with an FP8 combine the returned rows (or the partial sums) cross as e4m3 with
their scales and are summed in fp32 where they land. The staged, returned and partials buffers
then hold e4m3 rows with token-major scales beside them.
docs/benchmarks.md has the measured times of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from megamoe_kernels.shim import ep as ep_kernels
from megamoe_kernels.shim.fp8 import ACTIVATION_GROUP, FP8_DTYPE

BufferShapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class SymmetricSizes:
    """The static sizes the symmetric buffers are allocated for."""

    world: int
    num_experts: int
    top_k: int
    hidden_size: int
    dtype: torch.dtype
    max_tokens_per_rank: int
    capacity: int
    fp8_rows: bool = False  # the dispatch moves e4m3 rows with their scales
    fp8_combine: bool = False  # the combine sends e4m3 rows (or partial sums) back

    @property
    def token_slots(self) -> int:
        """Rows of the per-(source, token) buffers: W x max_tokens_per_rank."""
        return self.world * self.max_tokens_per_rank

    @property
    def scale_groups(self) -> int:
        """Scales per FP8 row: one per ACTIVATION_GROUP columns (the last may be partial)."""
        return -(-self.hidden_size // ACTIVATION_GROUP)

    def wire_rows(self, name: str, scales_name: str, rows: int, *, fp8: bool) -> BufferShapes:
        """Buffer `name` of `rows` token rows as they cross NVLink: bf16 rows, or with `fp8`
        e4m3 rows and buffer `scales_name`, float32 [rows, groups] (token-major), beside them."""
        if not fp8:
            return {name: ((rows, self.hidden_size), self.dtype)}
        return {
            name: ((rows, self.hidden_size), FP8_DTYPE),
            scales_name: ((rows, self.scale_groups), torch.float32),
        }


@dataclass(frozen=True)
class DispatchCall:
    """One dispatch's tensors, as the kernels take them (contiguous, on the device)."""

    x_TH: torch.Tensor
    expert_of_pair_P: torch.Tensor  # int32
    weights_TK: torch.Tensor  # float32
    expert_offsets: torch.Tensor  # int32 [L + 1], written by the dispatch

    @property
    def tokens(self) -> int:
        return self.x_TH.shape[0]


@dataclass(frozen=True)
class CombineCall:
    """One combine's tensors: the expert outputs and what the dispatch handed over."""

    expert_out_MH: torch.Tensor
    expert_offsets: torch.Tensor
    expert_of_pair_P: torch.Tensor
    weights_TK: torch.Tensor
    y_TH: torch.Tensor  # written by the combine


class DispatchAlgorithm(Protocol):
    name: str

    def buffer_shapes(self, sizes: SymmetricSizes) -> BufferShapes: ...

    def dispatch(self, params: ep_kernels.EpParams, call: DispatchCall) -> None: ...


class CombineAlgorithm(Protocol):
    name: str
    writes_pair_weights: bool  # its dispatch must fill the owners' pair-weight tables

    def buffer_shapes(self, sizes: SymmetricSizes) -> BufferShapes: ...

    def combine(self, params: ep_kernels.EpParams, call: CombineCall) -> None: ...


def _staged_buffers(sizes: SymmetricSizes) -> BufferShapes:
    return {
        **sizes.wire_rows("staged", "staged_scales", sizes.token_slots, fp8=sizes.fp8_rows),
        "arrived": ((sizes.token_slots,), torch.int64),
        "pair_rows": ((sizes.token_slots * sizes.top_k,), torch.int32),
    }


def _place(params: ep_kernels.EpParams, call: DispatchCall) -> torch.Tensor:
    """exchange_and_place: each pair's row in its owner's batch (int32 [P]), and this rank's
    expert_offsets."""
    dest_row_P = torch.empty_like(call.expert_of_pair_P)
    ep_kernels.exchange_and_place(
        params,
        expert_of_pair_address=call.expert_of_pair_P.data_ptr(),
        dest_row_address=dest_row_P.data_ptr(),
        expert_offsets_address=call.expert_offsets.data_ptr(),
        num_pairs=call.expert_of_pair_P.numel(),
    )
    return dest_row_P


class DirectDispatch:
    name = "direct"

    def buffer_shapes(self, sizes: SymmetricSizes) -> BufferShapes:
        return {}

    def dispatch(self, params, call: DispatchCall) -> None:
        dest_row_P = _place(params, call)
        ep_kernels.dispatch_rows(
            params,
            x_address=call.x_TH.data_ptr(),
            expert_of_pair_address=call.expert_of_pair_P.data_ptr(),
            dest_row_address=dest_row_P.data_ptr(),
            weights_address=call.weights_TK.data_ptr(),
            num_pairs=call.expert_of_pair_P.numel(),
        )
        ep_kernels.wait_phase(params, phase=ep_kernels.phases()["dispatch rows"])


class StagedDispatch:
    name = "staged"

    def buffer_shapes(self, sizes: SymmetricSizes) -> BufferShapes:
        return _staged_buffers(sizes)

    def dispatch(self, params, call: DispatchCall) -> None:
        dest_row_P = _place(params, call)
        ep_kernels.dispatch_tokens(
            params,
            x_address=call.x_TH.data_ptr(),
            expert_of_pair_address=call.expert_of_pair_P.data_ptr(),
            dest_row_address=dest_row_P.data_ptr(),
            weights_address=call.weights_TK.data_ptr(),
            tokens=call.tokens,
        )


class SmallBatchDispatch:
    name = "small batch"

    def buffer_shapes(self, sizes: SymmetricSizes) -> BufferShapes:
        ids_shape = ep_kernels.ids_shape(sizes.world, sizes.max_tokens_per_rank, sizes.top_k)
        return {**_staged_buffers(sizes), "ids": (ids_shape, torch.int32)}

    def dispatch(self, params, call: DispatchCall) -> None:
        ep_kernels.dispatch_small(
            params,
            x_address=call.x_TH.data_ptr(),
            expert_of_pair_address=call.expert_of_pair_P.data_ptr(),
            weights_address=call.weights_TK.data_ptr(),
            expert_offsets_address=call.expert_offsets.data_ptr(),
            tokens=call.tokens,
        )


class ExactCombine:
    name = "exact"
    writes_pair_weights = False

    def buffer_shapes(self, sizes: SymmetricSizes) -> BufferShapes:
        return {}

    def combine(self, params, call: CombineCall) -> None:
        ep_kernels.combine_push(
            params,
            expert_out_address=call.expert_out_MH.data_ptr(),
            expert_offsets_address=call.expert_offsets.data_ptr(),
        )
        ep_kernels.combine_reduce(
            params,
            weights_address=call.weights_TK.data_ptr(),
            y_address=call.y_TH.data_ptr(),
            tokens=call.y_TH.shape[0],
        )


class PartialSumCombine:
    name = "owner partials"
    writes_pair_weights = True

    def buffer_shapes(self, sizes: SymmetricSizes) -> BufferShapes:
        return {
            "pair_rows": ((sizes.token_slots * sizes.top_k,), torch.int32),
            "pair_weights": ((sizes.token_slots * sizes.top_k,), torch.float32),
            **sizes.wire_rows(
                "partials", "partial_scales", sizes.token_slots, fp8=sizes.fp8_combine
            ),
        }

    def combine(self, params, call: CombineCall) -> None:
        ep_kernels.combine_partial(
            params,
            expert_out_address=call.expert_out_MH.data_ptr(),
            expert_offsets_address=call.expert_offsets.data_ptr(),
        )
        ep_kernels.combine_partial_sum(
            params,
            expert_of_pair_address=call.expert_of_pair_P.data_ptr(),
            y_address=call.y_TH.data_ptr(),
            tokens=call.y_TH.shape[0],
        )


def choose_dispatch(
    sizes: SymmetricSizes, *, stage_remote_rows: bool, small_batch: bool | None, grid: int
) -> DispatchAlgorithm:
    """The dispatch algorithm for these sizes: DirectDispatch without `stage_remote_rows`, else
    SmallBatchDispatch where its kernel fits (`small_batch=None`) or when asked (`True`: raises
    where it does not fit), else StagedDispatch."""
    if not stage_remote_rows:
        if small_batch:
            raise ValueError("small_batch=True needs stage_remote_rows=True")
        return DirectDispatch()
    problems = ep_kernels.small_dispatch_problems(
        world=sizes.world,
        max_tokens=sizes.max_tokens_per_rank,
        top_k=sizes.top_k,
        local_experts=sizes.num_experts // sizes.world,
        grid=grid,
    )
    if small_batch and problems:
        raise ValueError(f"small_batch=True does not fit: {'; '.join(problems)}")
    if small_batch is None:
        small_batch = not problems
    return SmallBatchDispatch() if small_batch else StagedDispatch()


def choose_combine(*, partial_sums: bool) -> CombineAlgorithm:
    return PartialSumCombine() if partial_sums else ExactCombine()
