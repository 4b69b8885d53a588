"""Expert parallelism through torch.distributed all_to_all_single: the reference dispatcher.

Shape legend: T tokens of this rank, K experts per token, H hidden size, E experts in all,
L = E / world experts per rank, W world size, P = T x K (token, expert) pairs of this rank,
R rows this rank receives, M batch capacity.

Rank r owns the contiguous experts [r * L, (r + 1) * L). It works on any backend (gloo on CPU,
NCCL on GPUs) and is the oracle of the symmetric-memory kernels, the CPU path of the multirank
tests and the NCCL baseline of the benchmark.

Host sync: all_to_all_single takes its split sizes as host ints, so every dispatch copies the
exchanged per-expert counts to the host once. That is fine for a reference; the symmetric
dispatcher keeps counts and offsets on the device.

Row order (what makes EP=W equal EP=1): the batch holds local expert j's rows source rank by
source rank, each source's rows in its token order; so with the tokens of all ranks concatenated
in rank order, a single-GPU LocalDispatcher builds the same expert segments. Combine brings each
pair's output row home and sums the K contributions in k order with the same function the
single-GPU combine uses (`weighted_sum_over_topk`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megamoe_runtime.dispatch.checks import (
    check_expert_ids,
    experts_per_rank,
    validate_dispatch_inputs,
)
from megamoe_runtime.dispatch.local import weighted_sum_over_topk
from megamoe_runtime.expert_batch import ExpertBatch


@dataclass(frozen=True)
class TorchDistributedHandle:
    """What combine needs to bring expert outputs home."""

    # host split sizes of the dispatch all_to_all (rows per peer rank)
    sent_per_rank: list[int]
    received_per_rank: list[int]
    # batch row b holds received row received_of_batch_row_R[b]
    received_of_batch_row_R: torch.Tensor
    # pair (t, k) went out as sent row row_of_pair_TK[t, k]
    row_of_pair_TK: torch.Tensor
    topk_weights_TK: torch.Tensor
    output_dtype: torch.dtype


class TorchDistributedDispatcher:
    """Expert-parallel dispatch and combine over a torch.distributed process group.

    `capacity` fixes the batch's row count (None: exactly the rows received); a dispatch that
    receives more rows raises. `check_ids` validates expert ids (a host sync of its own).
    """

    def __init__(
        self,
        num_experts: int,
        *,
        process_group: dist.ProcessGroup | None = None,
        capacity: int | None = None,
        check_ids: bool = True,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchDistributedDispatcher needs torch.distributed initialised "
                "(torch.distributed.init_process_group) before it is built"
            )
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0 or None, got {capacity}")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.num_experts = num_experts
        self.num_local_experts = experts_per_rank(num_experts, self.world_size)
        self.capacity = capacity
        self.check_ids = check_ids

    @property
    def first_local_expert(self) -> int:
        return self.rank * self.num_local_experts

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[ExpertBatch, TorchDistributedHandle]:
        validate_dispatch_inputs(x_TH, topk_ids_TK, topk_weights_TK)
        if self.check_ids:
            check_expert_ids(topk_ids_TK, self.num_experts)
        world, local = self.world_size, self.num_local_experts
        tokens, top_k = topk_ids_TK.shape
        device = x_TH.device
        expert_of_pair_P = topk_ids_TK.reshape(-1).long()
        # experts are contiguous per rank: sorting by expert sorts by destination rank too, and
        # a stable sort keeps token order inside each expert
        pair_of_sent_P = torch.argsort(expert_of_pair_P, stable=True)
        row_of_pair_P = torch.empty_like(pair_of_sent_P)
        row_of_pair_P[pair_of_sent_P] = torch.arange(pair_of_sent_P.numel(), device=device)

        sent_counts_E = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        sent_counts_E.scatter_add_(0, expert_of_pair_P, torch.ones_like(expert_of_pair_P))
        received_counts_WL = torch.empty(world, local, dtype=torch.int64, device=device)
        dist.all_to_all_single(received_counts_WL, sent_counts_E, group=self.process_group)
        # the one host sync: all_to_all_single needs its split sizes on the host
        sizes_2W = torch.stack(
            [sent_counts_E.view(world, local).sum(1), received_counts_WL.sum(1)]
        ).tolist()
        sent_per_rank, received_per_rank = sizes_2W
        num_received = sum(received_per_rank)
        capacity = num_received if self.capacity is None else self.capacity
        if num_received > capacity:
            raise ValueError(
                f"rank {self.rank} received {num_received} rows, more than the dispatcher's "
                f"capacity {capacity}; raise capacity (at most world x tokens per rank x top_k)"
            )

        sent_rows_PH = x_TH[pair_of_sent_P // top_k]
        received_RH = x_TH.new_empty(num_received, x_TH.shape[1])
        dist.all_to_all_single(
            received_RH,
            sent_rows_PH,
            output_split_sizes=received_per_rank,
            input_split_sizes=sent_per_rank,
            group=self.process_group,
        )
        # received rows come source-major, then expert-major: regroup them expert-major, then
        # source-major, keeping each source's token order (a stable sort on (expert, source))
        segment_of_received_R = torch.repeat_interleave(
            torch.arange(world * local, device=device),
            received_counts_WL.reshape(-1),
            output_size=num_received,
        )
        source_R, expert_R = segment_of_received_R // local, segment_of_received_R % local
        received_of_batch_row_R = torch.argsort(expert_R * world + source_R, stable=True)
        rows_MH = x_TH.new_empty(capacity, x_TH.shape[1])
        rows_MH[:num_received] = received_RH[received_of_batch_row_R]
        expert_offsets = torch.zeros(local + 1, dtype=torch.int32, device=device)
        torch.cumsum(received_counts_WL.sum(0), dim=0, dtype=torch.int32, out=expert_offsets[1:])
        handle = TorchDistributedHandle(
            sent_per_rank=sent_per_rank,
            received_per_rank=received_per_rank,
            received_of_batch_row_R=received_of_batch_row_R,
            row_of_pair_TK=row_of_pair_P.view(tokens, top_k),
            topk_weights_TK=topk_weights_TK,
            output_dtype=x_TH.dtype,
        )
        batch = ExpertBatch(rows_MH=rows_MH, expert_offsets=expert_offsets, valid_rows=num_received)
        return batch, handle

    def combine(
        self,
        expert_out_MH: torch.Tensor,
        handle: TorchDistributedHandle,
    ) -> torch.Tensor:
        num_received = handle.received_of_batch_row_R.numel()
        if expert_out_MH.dim() != 2 or expert_out_MH.shape[0] < num_received:
            raise ValueError(
                f"expert_out must be [capacity >= {num_received}, hidden], "
                f"got {tuple(expert_out_MH.shape)}"
            )
        hidden = expert_out_MH.shape[1]
        outputs_RH = expert_out_MH.new_empty(num_received, hidden)
        outputs_RH[handle.received_of_batch_row_R] = expert_out_MH[:num_received]
        returned_PH = expert_out_MH.new_empty(sum(handle.sent_per_rank), hidden)
        dist.all_to_all_single(
            returned_PH,
            outputs_RH,
            output_split_sizes=handle.sent_per_rank,
            input_split_sizes=handle.received_per_rank,
            group=self.process_group,
        )
        return weighted_sum_over_topk(
            returned_PH,
            handle.row_of_pair_TK,
            handle.topk_weights_TK,
            output_dtype=handle.output_dtype,
        )
