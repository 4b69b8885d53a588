"""Expert-parallel dispatch over NVLink (sm_90a): count exchange, then rows straight into the
receiver's tight expert-major batch.

Every argument is a device address or a scalar (no tensor conversion per call). Experts are
owned in contiguous blocks: expert e lives on rank e // local_experts.

exchange_counts (one CTA): bumps the epoch, writes this rank's per-expert counts (int32 [E]) into
row `rank` of every peer's counts buffer (int32 [world, E]), signals PHASE_COUNTS on each peer,
and waits for every peer's counts of this epoch. From the gathered counts every rank computes on
the device where each of its pairs lands in its receiver's batch (expert-major, then source rank,
then the source's pair order), which is the single-GPU order.

dispatch_rows (persistent grid): one warp per (token, expert) pair records (rank, pair) at
`dest_row[pair]` of the owner's batch for the combine and moves the token's row in 16-byte
vectors: a pair of this rank's own experts straight into its batch row; a remote pair, with
`stage_remote`, only if it is the token's first pair for that owner, into the owner's staged
rows [world, max_tokens, hidden] at (rank, token), so a token crosses NVLink once per owner
(without `stage_remote`, straight into the owner's batch row). Rows at or past `capacity` are
skipped. Each CTA then signals PHASE_ROWS on every peer once, so a receiver expects grid x epoch
adds per source.

expand_staged_rows (persistent grid, on the owner, after the PHASE_ROWS wait): one warp per valid
batch row from another rank copies its staged token row into the batch (local HBM).

Layouts: x [tokens, hidden] row-major; expert_of_pair, dest_row int32 [tokens x top_k] in
(token, k) order; row bytes (hidden x element size) a multiple of 16 and 16-byte aligned rows.
"""

import cutlass
import cutlass.cute as cute
from cutlass._mlir import ir

from .ep_sync import (
    BUFFER_COUNTS,
    BUFFER_ROW_SOURCES,
    BUFFER_ROWS,
    BUFFER_SIGNALS,
    BUFFER_STAGED,
    PHASE_COUNTS,
    PHASE_ROWS,
    global_ptr,
    peer_address,
    signal_peer,
    wait_signal,
)

COUNTS_THREADS = 256
ROWS_WARPS = 16


@cute.jit
def copy_row(source_address, destination_address, row_vectors, lane, unroll: cutlass.Constexpr):
    """A warp copies one row of `row_vectors` 16-byte vectors; each lane issues `unroll` loads
    before their stores, so several are in flight (row_vectors: a multiple of 32 x unroll)."""
    vector_type = ir.VectorType.get([4], cutlass.Int32.mlir_type)
    for first in range(lane, row_vectors, 32 * unroll):
        values = []
        for j in cutlass.range_constexpr(unroll):
            offset = cutlass.Int64(first + 32 * j) * 16
            source = global_ptr(cutlass.Int32, source_address + offset, 16)
            values.append(cute.arch.load(source, vector_type))
        for j in cutlass.range_constexpr(unroll):
            offset = cutlass.Int64(first + 32 * j) * 16
            cute.arch.store(global_ptr(cutlass.Int32, destination_address + offset, 16), values[j])


@cute.kernel
def exchange_counts_kernel(
    counts_address: cutlass.Int64,
    peer_table_address: cutlass.Int64,
    epoch_address: cutlass.Int64,
    status_address: cutlass.Int64,
    rank: cutlass.Int32,
    world: cutlass.Int32,
    num_experts: cutlass.Int32,
    timeout_ns: cutlass.Int64,
):
    tidx, _, _ = cute.arch.thread_idx()
    peer_table = global_ptr(cutlass.Int64, peer_table_address, 8)
    epoch_ptr = global_ptr(cutlass.Int64, epoch_address, 8)
    epoch = cute.arch.load(epoch_ptr, cutlass.Int64) + 1
    counts = global_ptr(cutlass.Int32, counts_address, 4)
    for peer in range(world):
        gathered = global_ptr(
            cutlass.Int32, peer_address(peer_table, BUFFER_COUNTS, world, peer), 4
        )
        for e in range(tidx, num_experts, COUNTS_THREADS):
            cute.arch.store(
                gathered + (rank * num_experts + e), cute.arch.load(counts + e, cutlass.Int32)
            )
    cute.arch.fence_acq_rel_sys()  # every writer releases its stores
    cute.arch.sync_threads()
    if tidx < world:
        signal_peer(peer_table, BUFFER_SIGNALS, world, tidx, PHASE_COUNTS, rank)
        own_signals = peer_address(peer_table, BUFFER_SIGNALS, world, rank)
        wait_signal(
            own_signals, status_address, world, PHASE_COUNTS, tidx, epoch, epoch, timeout_ns
        )
    cute.arch.sync_threads()
    cute.arch.fence_acq_rel_sys()
    if tidx == 0:
        cute.arch.store(epoch_ptr, epoch)


@cute.jit
def exchange_counts(
    counts_address: cutlass.Int64,
    peer_table_address: cutlass.Int64,
    epoch_address: cutlass.Int64,
    status_address: cutlass.Int64,
    rank: cutlass.Int32,
    world: cutlass.Int32,
    num_experts: cutlass.Int32,
    timeout_ns: cutlass.Int64,
    stream,
):
    exchange_counts_kernel(
        counts_address,
        peer_table_address,
        epoch_address,
        status_address,
        rank,
        world,
        num_experts,
        timeout_ns,
    ).launch(grid=[1, 1, 1], block=[COUNTS_THREADS, 1, 1], stream=stream)


@cute.kernel
def dispatch_rows_kernel(
    x_address: cutlass.Int64,
    expert_of_pair_address: cutlass.Int64,
    dest_row_address: cutlass.Int64,
    peer_table_address: cutlass.Int64,
    num_pairs: cutlass.Int32,
    top_k: cutlass.Int32,
    local_experts: cutlass.Int32,
    row_vectors: cutlass.Int32,
    capacity: cutlass.Int32,
    rank: cutlass.Int32,
    world: cutlass.Int32,
    max_tokens: cutlass.Int32,
    stage_remote: cutlass.Int32,
    unroll: cutlass.Constexpr,
):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    warp, lane = tidx // 32, tidx % 32
    peer_table = global_ptr(cutlass.Int64, peer_table_address, 8)
    expert_of_pair = global_ptr(cutlass.Int32, expert_of_pair_address, 4)
    dest_row = global_ptr(cutlass.Int32, dest_row_address, 4)
    row_bytes = cutlass.Int64(row_vectors) * 16
    for pair in range(bidx * ROWS_WARPS + warp, num_pairs, grid * ROWS_WARPS):
        owner = cute.arch.load(expert_of_pair + pair, cutlass.Int32) // local_experts
        row = cute.arch.load(dest_row + pair, cutlass.Int32)
        token = pair // top_k
        token_row = x_address + cutlass.Int64(token) * row_bytes
        if owner != rank and stage_remote != 0:
            # the token crosses NVLink once per owner: its first pair for that owner stages it
            first_for_owner = cutlass.Int32(1)
            for earlier in range(token * top_k, pair):
                if (
                    cute.arch.load(expert_of_pair + earlier, cutlass.Int32) // local_experts
                    == owner
                ):
                    first_for_owner = cutlass.Int32(0)
            if first_for_owner == 1:
                staged_base = peer_address(peer_table, BUFFER_STAGED, world, owner)
                staged_row = cutlass.Int64(rank) * max_tokens + token
                copy_row(token_row, staged_base + staged_row * row_bytes, row_vectors, lane, unroll)
        elif row < capacity:
            rows_base = peer_address(peer_table, BUFFER_ROWS, world, owner)
            copy_row(
                token_row, rows_base + cutlass.Int64(row) * row_bytes, row_vectors, lane, unroll
            )
        if row < capacity:
            if lane == 0:
                sources = global_ptr(
                    cutlass.Int32, peer_address(peer_table, BUFFER_ROW_SOURCES, world, owner), 8
                )
                cute.arch.store(sources + row * 2, rank)
                cute.arch.store(sources + (row * 2 + 1), pair)
    cute.arch.fence_acq_rel_sys()  # every writer releases its stores
    cute.arch.sync_threads()
    if tidx < world:
        signal_peer(peer_table, BUFFER_SIGNALS, world, tidx, PHASE_ROWS, rank)


@cute.jit
def dispatch_rows(
    x_address: cutlass.Int64,
    expert_of_pair_address: cutlass.Int64,
    dest_row_address: cutlass.Int64,
    peer_table_address: cutlass.Int64,
    num_pairs: cutlass.Int32,
    top_k: cutlass.Int32,
    local_experts: cutlass.Int32,
    row_vectors: cutlass.Int32,
    capacity: cutlass.Int32,
    rank: cutlass.Int32,
    world: cutlass.Int32,
    max_tokens: cutlass.Int32,
    stage_remote: cutlass.Int32,
    grid: cutlass.Constexpr,
    unroll: cutlass.Constexpr,
    stream,
):
    dispatch_rows_kernel(
        x_address,
        expert_of_pair_address,
        dest_row_address,
        peer_table_address,
        num_pairs,
        top_k,
        local_experts,
        row_vectors,
        capacity,
        rank,
        world,
        max_tokens,
        stage_remote,
        unroll,
    ).launch(grid=[grid, 1, 1], block=[ROWS_WARPS * 32, 1, 1], stream=stream)


@cute.kernel
def expand_staged_rows_kernel(
    rows_address: cutlass.Int64,
    row_sources_address: cutlass.Int64,
    staged_address: cutlass.Int64,
    expert_offsets_address: cutlass.Int64,
    local_experts: cutlass.Int32,
    top_k: cutlass.Int32,
    max_tokens: cutlass.Int32,
    row_vectors: cutlass.Int32,
    capacity: cutlass.Int32,
    rank: cutlass.Int32,
    unroll: cutlass.Constexpr,
):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    warp, lane = tidx // 32, tidx % 32
    valid_rows = cute.arch.load(
        global_ptr(cutlass.Int32, expert_offsets_address, 4) + local_experts, cutlass.Int32
    )
    if valid_rows > capacity:
        valid_rows = capacity
    row_sources = global_ptr(cutlass.Int32, row_sources_address, 8)
    row_bytes = cutlass.Int64(row_vectors) * 16
    for row in range(bidx * ROWS_WARPS + warp, valid_rows, grid * ROWS_WARPS):
        source = cute.arch.load(row_sources + row * 2, cutlass.Int32)
        if source != rank:
            token = cute.arch.load(row_sources + (row * 2 + 1), cutlass.Int32) // top_k
            staged_row = cutlass.Int64(source) * max_tokens + token
            copy_row(
                staged_address + staged_row * row_bytes,
                rows_address + cutlass.Int64(row) * row_bytes,
                row_vectors,
                lane,
                unroll,
            )


@cute.jit
def expand_staged_rows(
    rows_address: cutlass.Int64,
    row_sources_address: cutlass.Int64,
    staged_address: cutlass.Int64,
    expert_offsets_address: cutlass.Int64,
    local_experts: cutlass.Int32,
    top_k: cutlass.Int32,
    max_tokens: cutlass.Int32,
    row_vectors: cutlass.Int32,
    capacity: cutlass.Int32,
    rank: cutlass.Int32,
    grid: cutlass.Constexpr,
    unroll: cutlass.Constexpr,
    stream,
):
    expand_staged_rows_kernel(
        rows_address,
        row_sources_address,
        staged_address,
        expert_offsets_address,
        local_experts,
        top_k,
        max_tokens,
        row_vectors,
        capacity,
        rank,
        unroll,
    ).launch(grid=[grid, 1, 1], block=[ROWS_WARPS * 32, 1, 1], stream=stream)
