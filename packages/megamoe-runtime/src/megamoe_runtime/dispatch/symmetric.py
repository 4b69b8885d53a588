"""Expert parallelism on one host over NVLink: megamoe's CuTe DSL kernels on NVSHMEM memory.

Shape legend: T tokens of this rank, K experts per token, H hidden size, E experts in all,
L = E / W experts per rank, W world size, P = T x K pairs, M batch capacity.

dispatch (no host sync; every step on the current stream, so a CUDA graph captures it):
  1-3. kernel exchange_and_place (a warp per 32 pairs, up to 128 CTAs meeting at a grid-wide
     barrier): per-expert counts of this rank's pairs, all-gathered into every rank's symmetric
     counts (int32 [W, E]) with system-scope release/acquire signals; each pair's position
     inside its expert in token order; then where each pair lands in its owner's batch
     (expert-major, then source rank, then token order: the single-GPU order) and this rank's
     expert_offsets over its L experts (dispatch/reference.py: count_pairs and place_pairs
     are its pure-torch reference);
  4. kernel dispatch_tokens (each CTA's warps split into senders and receivers, which run at
     once): a sender warp per token reads its row once and writes it into this rank's batch
     rows and once per other owner into that owner's staged rows (symmetric [W x max_tokens,
     H]) with the owner's table entries (the token's batch rows there), then releases a
     per-(source, token) flag there; each owner's receiver warps spin on those flags and copy
     each staged row, as it lands, into all of the token's batch rows (symmetric rows [M, H]) in
     local HBM, so the expansion overlaps the NVLink traffic. The kernel ends with the batch
     complete. (stage_remote_rows=False: kernel dispatch_rows sends every pair's row over NVLink
     straight into its batch row, then kernel wait_phase waits for every source.)
combine:
  5. kernel combine_push: every valid output row goes back to its source's returned buffer
     (symmetric [max_tokens x K, H]) at its pair's slot;
  6. kernel combine_reduce: waits for every owner, then y[t] = sum over k = 0..K-1 in that order
     of weight[t, k] x returned[t x K + k] in fp32, each product rounded on its own: the
     single-GPU combine's arithmetic, so EP=W and EP=1 agree bitwise on the same expert outputs.

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

from megamoe_runtime.dispatch.local import validate_dispatch_inputs
from megamoe_runtime.dispatch.torch_distributed import experts_per_rank
from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.workspace import workspace_for

DEFAULT_TIMEOUT_S = 60.0


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

    `stage_remote_rows` (default): a token crosses NVLink once per owner rank, into the owner's
    staged rows, and the owner expands it into its batch rows locally as it lands (HBM is ~10x
    NVLink); off, every (token, expert) pair's row crosses NVLink on its own, straight into the
    batch (about 2x slower at top-8; kept as the simpler reference path).

    `combine_partial_sums` (off by default): each owner sums its share of a token's top-k
    (weights applied, fp32, k order) and one bf16 row per (token, owner) crosses NVLink instead
    of one per pair; the source adds the owners' partials in rank order. Deterministic, up to K x
    fewer combine bytes over NVLink (3.4x faster at 4096 tokens on 2 H200s), but not the
    single-GPU summation order (one more bf16 rounding), so EP=W no longer equals EP=1 bitwise.
    MegaMoEConfig(combine_order="owner_partials") selects it from the layer.

    `small_batch` (staged only; by default on wherever its kernel fits: world x
    max_tokens_per_rank x K <= 8192 pairs, e.g. 512 tokens per rank at top-8 on 2 ranks, and at
    most 512 experts per rank): the dispatch is one kernel in which every rank sends its
    epoch-tagged expert ids and its token rows at once and each owner places its own rows from
    every source's ids, so the rows cross NVLink while the placement runs (on 2 H200s 22.3 us
    against the two kernels' 35.0 at 128 tokens per rank, 52.8 against 57.9 at 512:
    docs/expert-parallel.md). Every rank of the group must make the same choice: it depends
    only on the static sizes.
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
    ):
        device = torch.device(device)
        if dtype != torch.bfloat16:
            raise TypeError(f"the nvshmem dispatcher moves bf16 rows, got dtype {dtype}")
        if hidden_size % 8:
            raise ValueError(
                f"hidden_size must be a multiple of 8 (16-byte rows), got {hidden_size}"
            )
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
        self.stage_remote_rows = stage_remote_rows
        self.combine_partial_sums = combine_partial_sums
        if timeout_s is None:
            timeout_s = float(os.environ.get("MEGAMOE_EP_TIMEOUT_S", DEFAULT_TIMEOUT_S))
        self.timeout_s = timeout_s
        self.grid = torch.cuda.get_device_properties(device).multi_processor_count
        self.small_batch = self._choose_small_batch(small_batch)
        self.workspace = workspace_for(process_group, device, pool=pool)
        # written by the kernels through the host mapping: (phase + 1, peer, epoch, observed)
        self.status = torch.zeros(
            ep_kernels.layout()["status_words"], dtype=torch.int64, pin_memory=True
        )
        # zeroed once: the placement's grid-barrier words start at 0 and return there
        self.placement_scratch = torch.zeros(
            ep_kernels.placement_scratch_words(num_experts, self.world_size),
            dtype=torch.int32,
            device=device,
        )
        # zeroed once: the small dispatch's words hold epochs and arrivals that return to 0
        self.small_scratch = torch.zeros(
            ep_kernels.small_dispatch_limits()["scratch_words"], dtype=torch.int32, device=device
        )
        self._bind()

    def _choose_small_batch(self, requested: bool | None) -> bool:
        limits = ep_kernels.small_dispatch_limits()
        pairs = self.world_size * self.max_tokens_per_rank * self.top_k
        fits = (
            self.stage_remote_rows
            and self.num_local_experts <= limits["max_local_experts"]
            and pairs <= limits["max_pairs"]
            and self.grid >= 2
        )
        if requested is None:
            return fits
        if requested and not fits:
            raise ValueError(
                f"small_batch=True needs stage_remote_rows=True, at most "
                f"{limits['max_local_experts']} experts per rank and world x max_tokens_per_rank "
                f"x top_k <= {limits['max_pairs']}, got stage_remote_rows="
                f"{self.stage_remote_rows}, {self.num_local_experts} experts per rank and "
                f"{self.world_size} x {self.max_tokens_per_rank} x {self.top_k} = {pairs}"
            )
        return requested

    def _bind(self) -> None:
        """(Re)fetches the pooled buffers and the peer table; collective when they grow."""
        layout, world, workspace = ep_kernels.layout(), self.world_size, self.workspace
        shapes = {
            "counts": ((world, self.num_experts), torch.int32),
            "signals": ((layout["num_phases"], world), torch.int64),
            "rows": ((self.capacity, self.hidden_size), self.dtype),
            "row_sources": ((self.capacity, 2), torch.int32),
            "returned": ((self.max_tokens_per_rank * self.top_k, self.hidden_size), self.dtype),
        }
        slots = world * self.max_tokens_per_rank
        if self.stage_remote_rows:
            shapes["staged"] = ((slots, self.hidden_size), self.dtype)
            shapes["arrived"] = ((slots,), torch.int64)
        if self.stage_remote_rows or self.combine_partial_sums:
            shapes["pair_rows"] = ((slots * self.top_k,), torch.int32)
        if self.small_batch:
            ids_shape = ep_kernels.ids_shape(world, self.max_tokens_per_rank, self.top_k)
            shapes["ids"] = (ids_shape, torch.int32)
        if self.combine_partial_sums:
            shapes["pair_weights"] = ((slots * self.top_k,), torch.float32)
            shapes["partials"] = ((slots, self.hidden_size), self.dtype)
        # separate from the signals: each rank bumps its own epoch copy, nobody else writes it
        self.epoch = workspace.buffer("ep.epoch", (1,), torch.int64)
        self.buffers = {
            name: workspace.buffer(f"ep.{name}", shape, dtype)
            for name, (shape, dtype) in shapes.items()
        }
        table_WW = torch.zeros(layout["num_buffers"], world, dtype=torch.int64, device=self.device)
        for name in shapes:
            table_WW[layout[name]] = workspace.peer_addresses(f"ep.{name}")
        self.peer_table = table_WW
        self._generation = workspace.generation

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

    @property
    def _timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[ExpertBatch, SymmetricHandle]:
        validate_dispatch_inputs(x_TH, topk_ids_TK, topk_weights_TK)
        tokens, top_k = topk_ids_TK.shape
        if top_k != self.top_k:
            raise ValueError(
                f"topk_ids has top_k {top_k}; this dispatcher was built for {self.top_k}"
            )
        if tokens > self.max_tokens_per_rank:
            raise ValueError(
                f"{tokens} tokens exceed max_tokens_per_rank={self.max_tokens_per_rank}; raise it "
                f"in the config (the symmetric buffers are sized by it) or split the batch"
            )
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
        world, local = self.world_size, self.num_local_experts
        x_TH = x_TH.contiguous()
        expert_of_pair_P = topk_ids_TK.reshape(-1).to(torch.int32).contiguous()
        weights_TK = topk_weights_TK.float().contiguous()
        num_pairs = expert_of_pair_P.numel()

        expert_offsets = torch.empty(local + 1, dtype=torch.int32, device=self.device)
        row_bytes = self.hidden_size * x_TH.element_size()
        # rows past capacity are dropped (only a capacity below the default can overflow)
        if self.small_batch:
            ep_kernels.dispatch_small(
                x_TH.data_ptr(),
                expert_of_pair_P.data_ptr(),
                weights_TK.data_ptr(),
                expert_offsets.data_ptr(),
                self.small_scratch.data_ptr(),
                **self._token_rows_arguments(tokens, row_bytes),
            )
            return self._dispatched(x_TH, tokens, weights_TK, expert_of_pair_P, expert_offsets)
        dest_row_P = torch.empty(num_pairs, dtype=torch.int32, device=self.device)
        ep_kernels.exchange_and_place(
            expert_of_pair_P.data_ptr(),
            dest_row_P.data_ptr(),
            expert_offsets.data_ptr(),
            self.placement_scratch.data_ptr(),
            peer_table_address=self.peer_table.data_ptr(),
            epoch_address=self.epoch.data_ptr(),
            status_address=self.status.data_ptr(),
            num_pairs=num_pairs,
            rank=self.rank,
            world=world,
            num_experts=self.num_experts,
            local_experts=local,
            capacity=self.capacity,
            timeout_ns=self._timeout_ns,
        )
        if self.stage_remote_rows:
            ep_kernels.dispatch_tokens(
                x_TH.data_ptr(),
                expert_of_pair_P.data_ptr(),
                dest_row_P.data_ptr(),
                weights_TK.data_ptr(),
                pairs_of_source_address=self.placement_scratch.data_ptr()
                + 4 * ep_kernels.pairs_of_source_offset(self.num_experts),
                **self._token_rows_arguments(tokens, row_bytes),
            )
        else:
            ep_kernels.dispatch_rows(
                x_TH.data_ptr(),
                expert_of_pair_P.data_ptr(),
                dest_row_P.data_ptr(),
                peer_table_address=self.peer_table.data_ptr(),
                num_pairs=num_pairs,
                top_k=top_k,
                local_experts=local,
                row_bytes=row_bytes,
                capacity=self.capacity,
                rank=self.rank,
                world=world,
                max_tokens=self.max_tokens_per_rank,
                weights_address=weights_TK.data_ptr(),
                pair_tables=self.combine_partial_sums,
                grid=self.grid,
            )
            ep_kernels.wait_phase(
                signals_address=self.buffers["signals"].data_ptr(),
                epoch_address=self.epoch.data_ptr(),
                status_address=self.status.data_ptr(),
                world=world,
                phase=ep_kernels.phases()["dispatch rows"],
                adds_per_epoch=self.grid,
                timeout_ns=self._timeout_ns,
            )
        return self._dispatched(x_TH, tokens, weights_TK, expert_of_pair_P, expert_offsets)

    def _token_rows_arguments(self, tokens: int, row_bytes: int) -> dict:
        """The arguments that the two kernels sending whole token rows (dispatch_small and
        dispatch_tokens) take alike."""
        return {
            "peer_table_address": self.peer_table.data_ptr(),
            "epoch_address": self.epoch.data_ptr(),
            "status_address": self.status.data_ptr(),
            "tokens": tokens,
            "top_k": self.top_k,
            "local_experts": self.num_local_experts,
            "row_bytes": row_bytes,
            "capacity": self.capacity,
            "rank": self.rank,
            "world": self.world_size,
            "max_tokens": self.max_tokens_per_rank,
            "pair_weights": self.combine_partial_sums,
            "timeout_ns": self._timeout_ns,
            "grid": self.grid,
        }

    def _dispatched(self, x_TH, tokens, weights_TK, expert_of_pair_P, expert_offsets):
        """The batch the kernels just filled, and what combine needs."""
        batch = ExpertBatch(
            rows_MH=self.buffers["rows"],
            expert_offsets=expert_offsets,
            typical_rows=min(self.capacity, self.max_tokens_per_rank * self.top_k),
        )
        handle = SymmetricHandle(
            tokens=tokens,
            weights_TK=weights_TK,
            expert_of_pair_P=expert_of_pair_P,
            expert_offsets=expert_offsets,
            output_dtype=x_TH.dtype,
        )
        self.workspace.dispatch_awaiting_combine = self.layer_name
        return batch, handle

    def combine(
        self, expert_out_MH: torch.Tensor, handle: SymmetricHandle, *, weights_applied: bool = False
    ) -> torch.Tensor:
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
        expert_out_MH = expert_out_MH.contiguous()
        if self.combine_partial_sums:
            return self._combine_partial_sums(expert_out_MH, handle, weights_applied)
        ep_kernels.combine_push(
            expert_out_MH.data_ptr(),
            handle.expert_offsets.data_ptr(),
            self.buffers["row_sources"].data_ptr(),
            peer_table_address=self.peer_table.data_ptr(),
            local_experts=self.num_local_experts,
            row_bytes=self.hidden_size * expert_out_MH.element_size(),
            capacity=self.capacity,
            rank=self.rank,
            world=self.world_size,
            grid=self.grid,
        )
        weights_TK = handle.weights_TK
        if weights_applied:
            weights_TK = torch.ones_like(weights_TK)
        y_TH = torch.empty(handle.tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        ep_kernels.combine_reduce(
            self.buffers["returned"].data_ptr(),
            weights_TK.data_ptr(),
            y_TH.data_ptr(),
            signals_address=self.buffers["signals"].data_ptr(),
            epoch_address=self.epoch.data_ptr(),
            status_address=self.status.data_ptr(),
            tokens=handle.tokens,
            hidden=self.hidden_size,
            world=self.world_size,
            adds_per_epoch=self.grid,
            timeout_ns=self._timeout_ns,
            top_k=self.top_k,
            grid=self.grid,
        )
        return y_TH.to(handle.output_dtype)

    def _combine_partial_sums(
        self, expert_out_MH: torch.Tensor, handle: SymmetricHandle, weights_applied: bool
    ) -> torch.Tensor:
        if weights_applied:
            raise ValueError(
                "combine_partial_sums applies the routing weights itself (dispatch wrote them "
                "into the pair tables); combine with weights_applied=False"
            )
        ep_kernels.combine_partial(
            expert_out_MH.data_ptr(),
            handle.expert_offsets.data_ptr(),
            self.buffers["row_sources"].data_ptr(),
            self.buffers["pair_rows"].data_ptr(),
            self.buffers["pair_weights"].data_ptr(),
            peer_table_address=self.peer_table.data_ptr(),
            local_experts=self.num_local_experts,
            hidden=self.hidden_size,
            capacity=self.capacity,
            max_tokens=self.max_tokens_per_rank,
            rank=self.rank,
            world=self.world_size,
            top_k=self.top_k,
            grid=self.grid,
        )
        y_TH = torch.empty(handle.tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        ep_kernels.combine_partial_sum(
            self.buffers["partials"].data_ptr(),
            handle.expert_of_pair_P.data_ptr(),
            y_TH.data_ptr(),
            signals_address=self.buffers["signals"].data_ptr(),
            epoch_address=self.epoch.data_ptr(),
            status_address=self.status.data_ptr(),
            tokens=handle.tokens,
            hidden=self.hidden_size,
            world=self.world_size,
            local_experts=self.num_local_experts,
            max_tokens=self.max_tokens_per_rank,
            adds_per_epoch=self.grid,
            timeout_ns=self._timeout_ns,
            top_k=self.top_k,
            grid=self.grid,
        )
        return y_TH
