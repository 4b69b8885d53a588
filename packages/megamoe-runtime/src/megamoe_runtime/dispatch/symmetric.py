"""Expert parallelism on one host over NVLink: megamoe's CuTe DSL kernels on NVSHMEM memory.

Shape legend: T tokens of this rank, K experts per token, H hidden size, E experts in all,
L = E / W experts per rank, W world size, P = T x K pairs, M batch capacity.

Every step runs on the current stream with no host sync, so a CUDA graph captures a dispatch and
a combine. The dispatcher picks its dispatch and combine algorithms once, when it is built
(dispatch/symmetric_algorithms.py says what each runs); the placement rule and the partial-sum
arithmetic have pure-torch references in dispatch/reference.py.

Buffers come from the process's pooled workspace (megamoe_runtime.workspace): layers share them
(one dispatch/combine pair in flight per group at a time, as in a forward pass). Signals are
monotonic counters checked against a device epoch, so nothing is reset between calls; hence
every dispatch is followed by its combine before the group's next dispatch (two dispatches with
no combine between them would leave the combine's counters an epoch behind, so its waits would
time out: a second dispatch before the combine is refused with an error, before any launch).

Waits give up after `timeout_s` (MEGAMOE_EP_TIMEOUT_S, default 60): the kernel records the phase,
peer and epoch in host-mapped memory and carries on; the next dispatch or combine (or
`raise_if_timed_out()`) raises an error that names this rank, the phase and the layer. After
a timeout the group's signals are out of step: rebuild the process group's workspace.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megamoe_kernels.shim import ep as ep_kernels
from megamoe_kernels.shim.fp8 import FP8_DTYPE

from megamoe_runtime.dispatch.checks import (
    check_token_count,
    check_top_k,
    check_wire_dtypes,
    experts_per_rank,
    validate_dispatch_inputs,
)
from megamoe_runtime.dispatch.symmetric_algorithms import (
    CombineCall,
    DispatchCall,
    SymmetricSizes,
    choose_combine,
    choose_dispatch,
)
from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.workspace import workspace_for

DEFAULT_TIMEOUT_S = 60.0


def _pool_name(name: str, dtype: torch.dtype) -> str:
    """The workspace name of symmetric buffer `name`: e4m3 buffers apart from bf16 ones."""
    return f"ep.{name}.e4m3" if dtype == FP8_DTYPE else f"ep.{name}"


@dataclass(frozen=True)
class SymmetricHandle:
    """What combine needs: this rank's pairs and weights, and the batch it dispatched."""

    tokens: int
    weights_TK: torch.Tensor  # float32, contiguous
    expert_of_pair_P: torch.Tensor  # int32
    expert_offsets: torch.Tensor
    output_dtype: torch.dtype


class SymmetricDispatcher:
    """Dispatch and combine through NVSHMEM symmetric memory and megamoe's kernels.

    Static sizes: at most `max_tokens_per_rank` tokens per call; the batch holds `capacity`
    rows (default W x max_tokens_per_rank x K, enough for any routing). Buffers are allocated
    collectively when the dispatcher is built: build the layers in the same order on every rank.

    The algorithms (dispatch/symmetric_algorithms.py), chosen here once: `stage_remote_rows`
    (default; off: every pair's row crosses NVLink on its own, the direct dispatch) and
    `small_batch` (None: the one-kernel small-batch dispatch wherever its kernel fits; True
    insists, False refuses it) pick the dispatch; `combine_partial_sums` (off by default;
    MegaMoEConfig(combine_order="owner_partials") selects it) the partial-sum combine instead
    of the exact one, which is not the single-GPU summation order (one more bf16 rounding).
    Every rank of the group makes the same choice: it depends only on the static sizes.

    The wire: `dispatch_dtype` 'bf16' (default) or 'fp8': the dispatch kernels quantize each
    token row once (e4m3, one float32 scale per row and 128 columns: the recipe of
    megamoe_kernels.quantize_rows, bit for bit) and e4m3 rows cross NVLink (half the bytes);
    the batch holds e4m3 rows and `row_scales_GM`, which FP8 experts read as they are (BF16
    experts dequantize the batch first: ExpertBatch.dequantized). `combine_dtype` 'bf16'
    (default) or 'fp8': the combine sends each output row (or owner partial sum) back as e4m3
    with its scales and sums the dequantized values in fp32 where they land. Both change the
    numbers (e4m3 keeps 3 mantissa bits), so both are opt-in; both need a hidden size that is
    a multiple of 16.
    """

    def __init__(
        self,
        num_experts: int,
        *,
        top_k: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        process_group: dist.ProcessGroup | None,
        max_tokens_per_rank: int,
        capacity: int | None = None,
        layer_name: str = "moe",
        timeout_s: float | None = None,
        pool: str = "default",
        stage_remote_rows: bool = True,
        combine_partial_sums: bool = False,
        small_batch: bool | None = None,
        dispatch_dtype: str = "bf16",
        combine_dtype: str = "bf16",
    ):
        device = torch.device(device)
        if dtype != torch.bfloat16:
            raise TypeError(f"the nvshmem dispatcher moves bf16 rows, got dtype {dtype}")
        if hidden_size % 8:
            raise ValueError(
                f"hidden_size must be a multiple of 8 (16-byte rows), got {hidden_size}"
            )
        check_wire_dtypes(
            dispatch_dtype=dispatch_dtype, combine_dtype=combine_dtype, hidden_size=hidden_size
        )
        self.dispatch_dtype, self.combine_dtype = dispatch_dtype, combine_dtype
        if max_tokens_per_rank < 1:
            raise ValueError(f"max_tokens_per_rank must be >= 1, got {max_tokens_per_rank}")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.num_experts = num_experts
        self.num_local_experts = experts_per_rank(num_experts, self.world_size)
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.max_tokens_per_rank = max_tokens_per_rank
        worst_case = self.world_size * max_tokens_per_rank * top_k
        self.capacity = worst_case if capacity is None else capacity
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.layer_name = layer_name
        if timeout_s is None:
            timeout_s = float(os.environ.get("MEGAMOE_EP_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        self.timeout_s = timeout_s
        self.grid = torch.cuda.get_device_properties(device).multi_processor_count
        self.sizes = SymmetricSizes(
            world=self.world_size,
            num_experts=num_experts,
            top_k=top_k,
            hidden_size=hidden_size,
            dtype=dtype,
            max_tokens_per_rank=max_tokens_per_rank,
            capacity=self.capacity,
            fp8_rows=dispatch_dtype == "fp8",
            fp8_combine=combine_dtype == "fp8",
        )
        self.dispatch_algorithm = choose_dispatch(
            self.sizes, stage_remote_rows=stage_remote_rows, small_batch=small_batch, grid=self.grid
        )
        self.combine_algorithm = choose_combine(partial_sums=combine_partial_sums)
        self.workspace = workspace_for(process_group, device, pool=pool)
        # written by the kernels through the host mapping: (phase + 1, peer, epoch, observed)
        self.status = torch.zeros(
            ep_kernels.layout()["status_words"], dtype=torch.int64, pin_memory=True
        )
        # zeroed once: the placement's grid-barrier words and the small dispatch's words hold
        # epochs and arrivals that return to their start state
        self.placement_scratch = torch.zeros(
            ep_kernels.placement_scratch_words(num_experts, self.world_size),
            dtype=torch.int32,
            device=device,
        )
        self.small_scratch = torch.zeros(
            ep_kernels.small_dispatch_limits()["scratch_words"], dtype=torch.int32, device=device
        )
        self._bind()

    def _bind(self) -> None:
        """(Re)fetches the pooled buffers and the peer table, and builds the kernels' EpParams;
        collective when the buffers grow."""
        layout, world, workspace, sizes = (
            ep_kernels.layout(),
            self.world_size,
            self.workspace,
            self.sizes,
        )
        shapes = {
            "counts": ((world, self.num_experts), torch.int32),
            "signals": ((layout["num_phases"], world), torch.int64),
            "rows": (
                (self.capacity, self.hidden_size),
                FP8_DTYPE if sizes.fp8_rows else self.dtype,
            ),
            "row_sources": ((self.capacity, 2), torch.int32),
            **sizes.wire_rows(
                "returned",
                "returned_scales",
                self.max_tokens_per_rank * self.top_k,
                fp8=sizes.fp8_combine,
            ),
            **self.dispatch_algorithm.buffer_shapes(sizes),
            **self.combine_algorithm.buffer_shapes(sizes),
        }
        if sizes.fp8_rows:  # the batch's scales, group-major: the FP8 GEMM's layout
            shapes["row_scales"] = ((sizes.scale_groups, self.capacity), torch.float32)
        # separate from the signals: each rank bumps its own epoch copy, nobody else writes it
        self.epoch = workspace.buffer("ep.epoch", (1,), torch.int64)
        # pooled by name and dtype: layers with a bf16 and an FP8 wire keep their own buffers
        # instead of reallocating one another's
        pooled = {name: _pool_name(name, dtype) for name, (_, dtype) in shapes.items()}
        self.buffers = {
            name: workspace.buffer(pooled[name], shape, dtype)
            for name, (shape, dtype) in shapes.items()
        }
        table_WW = torch.zeros(layout["num_buffers"], world, dtype=torch.int64, device=self.device)
        for name in shapes:
            table_WW[layout[name]] = workspace.peer_addresses(pooled[name])
        self.peer_table = table_WW
        self.kernel_params = ep_kernels.EpParams(
            peer_table_address=table_WW.data_ptr(),
            epoch_address=self.epoch.data_ptr(),
            status_address=self.status.data_ptr(),
            placement_scratch_address=self.placement_scratch.data_ptr(),
            small_scratch_address=self.small_scratch.data_ptr(),
            timeout_ns=int(self.timeout_s * 1e9),
            rank=self.rank,
            world=world,
            num_experts=self.num_experts,
            local_experts=self.num_local_experts,
            capacity=self.capacity,
            max_tokens=self.max_tokens_per_rank,
            row_vectors=self.hidden_size * self.dtype.itemsize // 16,
            pair_weights=self.combine_algorithm.writes_pair_weights,
            top_k=self.top_k,
            grid=self.grid,
            fp8_rows=sizes.fp8_rows,
            fp8_combine=sizes.fp8_combine,
        )
        self._generation = workspace.generation

    @property
    def fp8_batches(self) -> bool:
        """Whether dispatch hands the experts FP8 rows (dispatch_dtype='fp8')."""
        return self.dispatch_dtype == "fp8"

    def raise_if_timed_out(self) -> None:
        """Raises if a wait of this dispatcher's kernels timed out (reads host-mapped memory; it
        sees kernels that already ran: synchronize first to be sure)."""
        phase_plus_one, peer, epoch, observed = self.status.tolist()
        if phase_plus_one == 0:
            return
        phase = {number: name for name, number in ep_kernels.phases().items()}[phase_plus_one - 1]
        raise RuntimeError(
            f"expert-parallel {phase} timed out on rank {self.rank} of {self.world_size} "
            f"(layer {self.layer_name!r}): no signal from rank {peer} within {self.timeout_s} s "
            f"(epoch {epoch}, counter at {observed}); a peer crashed, hung, or skipped this "
            f"layer's forward. Raise MEGAMOE_EP_TIMEOUT_S if the peer is just slow."
        )

    def _check_ready(self) -> None:
        self.raise_if_timed_out()
        if self.workspace.generation != self._generation:
            self._bind()

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[ExpertBatch, SymmetricHandle]:
        validate_dispatch_inputs(x_TH, topk_ids_TK, topk_weights_TK)
        check_top_k(topk_ids_TK, self.top_k)
        check_token_count(x_TH.shape[0], self.max_tokens_per_rank, sized="the symmetric buffers")
        if x_TH.dtype != self.dtype or x_TH.shape[1] != self.hidden_size:
            raise ValueError(
                f"x must be {self.dtype} [tokens, {self.hidden_size}], got {x_TH.dtype} "
                f"{tuple(x_TH.shape)}"
            )
        if x_TH.device != self.device:
            raise ValueError(f"x is on {x_TH.device}, the dispatcher on {self.device}")
        self._check_ready()
        awaiting = self.workspace.dispatch_awaiting_combine
        if awaiting is not None:
            raise RuntimeError(
                f"layer {self.layer_name!r}: dispatch while layer {awaiting!r}'s dispatch on the "
                "same expert-parallel buffers has not been combined; every dispatch must be "
                "combined before the group's next one (the combine's waits count dispatches). "
                "If a forward failed between the two, its peers are out of step as well: release "
                "the workspace (megamoe_runtime.workspace.release_all_workspaces) and rebuild "
                "the layers"
            )
        call = DispatchCall(
            x_TH=x_TH.contiguous(),
            expert_of_pair_P=topk_ids_TK.reshape(-1).to(torch.int32).contiguous(),
            weights_TK=topk_weights_TK.float().contiguous(),
            expert_offsets=torch.empty(
                self.num_local_experts + 1, dtype=torch.int32, device=self.device
            ),
        )
        # rows past capacity are dropped (only a capacity below the default can overflow)
        self.dispatch_algorithm.dispatch(self.kernel_params, call)
        return self._dispatched(call)

    def _dispatched(self, call: DispatchCall) -> tuple[ExpertBatch, SymmetricHandle]:
        """The batch the kernels just filled, and what combine needs."""
        batch = ExpertBatch(
            rows_MH=self.buffers["rows"],
            expert_offsets=call.expert_offsets,
            typical_rows=min(self.capacity, self.max_tokens_per_rank * self.top_k),
            row_scales_GM=self.buffers.get("row_scales"),
        )
        handle = SymmetricHandle(
            tokens=call.tokens,
            weights_TK=call.weights_TK,
            expert_of_pair_P=call.expert_of_pair_P,
            expert_offsets=call.expert_offsets,
            output_dtype=call.x_TH.dtype,
        )
        self.workspace.dispatch_awaiting_combine = self.layer_name
        return batch, handle

    def combine(self, expert_out_MH: torch.Tensor, handle: SymmetricHandle) -> torch.Tensor:
        if (
            expert_out_MH.shape != (self.capacity, self.hidden_size)
            or expert_out_MH.dtype != self.dtype
        ):
            raise ValueError(
                f"expert_out must be {self.dtype} [{self.capacity}, {self.hidden_size}] (the "
                f"batch's shape), got {expert_out_MH.dtype} {tuple(expert_out_MH.shape)}"
            )
        self._check_ready()
        self.workspace.dispatch_awaiting_combine = None
        y_TH = torch.empty(handle.tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        call = CombineCall(
            expert_out_MH=expert_out_MH.contiguous(),
            expert_offsets=handle.expert_offsets,
            expert_of_pair_P=handle.expert_of_pair_P,
            weights_TK=handle.weights_TK,
            y_TH=y_TH,
        )
        self.combine_algorithm.combine(self.kernel_params, call)
        return y_TH.to(handle.output_dtype)
