"""Expert-parallel dispatch over NVLink (sm_90a): count exchange, then rows straight into the
receiver's tight expert-major batch.

Every argument is a device address or a scalar (no tensor conversion per call). Experts are
owned in contiguous blocks: expert e lives on rank e // local_experts.

exchange_and_place (one CTA of 32 warps): bumps the epoch; counts this rank's pairs per expert
(each warp a contiguous slice, atomics into per-warp counters in a global scratch of
[32 + 1, E] int32); writes the counts into row `rank` of every peer's counts buffer
(int32 [world, E]) and signals PHASE_COUNTS; while they travel, ranks each pair inside its
expert in pair order (per-warp prefix + lane shuffles: stable); waits for every peer's counts;
then computes where each pair lands in its owner's batch (expert-major, then source rank, then
the source's pair order: the single-GPU order) into dest_row, and this rank's expert_offsets
(int32 [local_experts + 1], clamped to capacity).

dispatch_rows (persistent grid): one warp per (token, expert) pair records (rank, pair) at
`dest_row[pair]` of the owner's batch for the combine and moves the token's row in 16-byte
vectors: a pair of this rank's own experts straight into its batch row; a remote pair, with
`stage_remote`, only if it is the token's first pair for that owner, into the owner's staged
rows [world, max_tokens, hidden] at (rank, token), so a token crosses NVLink once per owner
(without `stage_remote`, straight into the owner's batch row). Rows at or past `capacity` are
skipped. Each CTA then signals PHASE_ROWS on every peer once, so a receiver expects grid x epoch
adds per source.

With `pair_tables` (for the partial-sum combine), a token's first pair for an owner also writes
the owner's table entries (source, token, k) for all k: the batch row there (or -1) and the
routing weight, in int32 / float32 [world, max_tokens, top_k].

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
    BUFFER_PAIR_ROWS,
    BUFFER_PAIR_WEIGHTS,
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

PLACE_WARPS = 32
PLACE_THREADS = PLACE_WARPS * 32
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


@cute.jit
def warp_inclusive_sum(value, lane):
    """Inclusive prefix sum of an Int32 over the lanes of a warp (shuffles, 5 steps)."""
    total = value
    for step in cutlass.range_constexpr(5):
        distance = 1 << step
        below = cute.arch.shuffle_sync_up(total, distance)
        if lane >= distance:
            total = total + below
    return total


@cute.kernel
def exchange_and_place_kernel(
    expert_of_pair_address: cutlass.Int64,
    dest_row_address: cutlass.Int64,
    expert_offsets_address: cutlass.Int64,
    scratch_address: cutlass.Int64,
    peer_table_address: cutlass.Int64,
    epoch_address: cutlass.Int64,
    status_address: cutlass.Int64,
    num_pairs: cutlass.Int32,
    rank: cutlass.Int32,
    world: cutlass.Int32,
    num_experts: cutlass.Int32,
    local_experts: cutlass.Int32,
    capacity: cutlass.Int32,
    timeout_ns: cutlass.Int64,
):
    tidx, _, _ = cute.arch.thread_idx()
    warp, lane = tidx // 32, tidx % 32
    peer_table = global_ptr(cutlass.Int64, peer_table_address, 8)
    epoch_ptr = global_ptr(cutlass.Int64, epoch_address, 8)
    epoch = cute.arch.load(epoch_ptr, cutlass.Int64) + 1
    expert_of_pair = global_ptr(cutlass.Int32, expert_of_pair_address, 4)
    dest_row = global_ptr(cutlass.Int32, dest_row_address, 4)
    # scratch: [PLACE_WARPS, E] per-warp counts, then [E] first rows
    histogram = global_ptr(cutlass.Int32, scratch_address, 4)
    first_row = histogram + PLACE_WARPS * num_experts
    own_signals = peer_address(peer_table, BUFFER_SIGNALS, world, rank)
    gathered = global_ptr(cutlass.Int32, peer_address(peer_table, BUFFER_COUNTS, world, rank), 4)

    # 1. per-warp counts over contiguous slices of the pairs (warp w: pairs [w*chunk, ...))
    for i in range(tidx, PLACE_WARPS * num_experts, PLACE_THREADS):
        cute.arch.store(histogram + i, cutlass.Int32(0))
    cute.arch.sync_threads()
    chunk = (num_pairs + PLACE_WARPS - 1) // PLACE_WARPS
    begin = warp * chunk
    end = begin + chunk
    if end > num_pairs:
        end = num_pairs
    for pair in range(begin + lane, end, 32):
        expert = cute.arch.load(expert_of_pair + pair, cutlass.Int32)
        cute.arch.atomic_add(histogram + (warp * num_experts + expert), cutlass.Int32(1))
    cute.arch.sync_threads()

    # 2. per expert: exclusive prefix over warps (each warp's first position), and the total,
    #    which goes into row `rank` of every peer's counts
    for expert in range(tidx, num_experts, PLACE_THREADS):
        running = cutlass.Int32(0)
        for w in range(PLACE_WARPS):
            slot = histogram + (w * num_experts + expert)
            count = cute.arch.load(slot, cutlass.Int32, cop="cg")  # L2: where the atomics landed
            cute.arch.store(slot, running)
            running = running + count
        for peer in range(world):
            counts = global_ptr(
                cutlass.Int32, peer_address(peer_table, BUFFER_COUNTS, world, peer), 4
            )
            cute.arch.store(counts + (rank * num_experts + expert), running)
    cute.arch.fence_acq_rel_sys()  # every writer releases its stores
    cute.arch.sync_threads()
    if tidx < world:
        signal_peer(peer_table, BUFFER_SIGNALS, world, tidx, PHASE_COUNTS, rank)

    # 3. while the counts travel: each pair's position inside its expert, in pair order
    #    (a warp walks its slice 32 pairs at a time; equal experts are ranked by lane)
    for group in range(begin, end, 32):
        pair = group + lane
        expert = cutlass.Int32(-1) - lane  # no match for lanes past the slice
        if pair < end:
            expert = cute.arch.load(expert_of_pair + pair, cutlass.Int32)
        before = cutlass.Int32(0)
        last = cutlass.Int32(1)
        for other_lane in range(32):
            other = cute.arch.shuffle_sync(expert, other_lane)
            if other == expert:
                if other_lane < lane:
                    before = before + 1
                if other_lane > lane:
                    last = cutlass.Int32(0)
        base = cutlass.Int32(0)
        if pair < end:
            base = cute.arch.load(histogram + (warp * num_experts + expert), cutlass.Int32)
            cute.arch.store(dest_row + pair, base + before)
        cute.arch.sync_warp()
        if pair < end:
            if last == 1:
                cute.arch.store(histogram + (warp * num_experts + expert), base + before + 1)
        cute.arch.sync_warp()

    if tidx < world:
        wait_signal(
            own_signals, status_address, world, PHASE_COUNTS, tidx, epoch, epoch, timeout_ns
        )
    cute.arch.sync_threads()
    cute.arch.fence_acq_rel_sys()

    # 4. from every rank's counts: rows of expert e from sources before `rank` (first_row),
    #    rows per expert in all (scratch), then a warp per owner scans its experts' rows
    for expert in range(tidx, num_experts, PLACE_THREADS):
        total = cutlass.Int32(0)
        earlier = cutlass.Int32(0)
        for source in range(world):
            count = cute.arch.load(
                gathered + (source * num_experts + expert), cutlass.Int32, cop="cg"
            )
            if source < rank:
                earlier = earlier + count
            total = total + count
        cute.arch.store(histogram + expert, total)
        cute.arch.store(first_row + expert, earlier)
    cute.arch.sync_threads()
    offsets = global_ptr(cutlass.Int32, expert_offsets_address, 4)
    if tidx == 0:
        cute.arch.store(offsets, cutlass.Int32(0))
    for owner in range(warp, world, PLACE_WARPS):
        carry = cutlass.Int32(0)
        for group in range(0, local_experts, 32):
            local = group + lane
            rows = cutlass.Int32(0)
            if local < local_experts:
                rows = cute.arch.load(histogram + (owner * local_experts + local), cutlass.Int32)
            inclusive = warp_inclusive_sum(rows, lane)
            if local < local_experts:
                expert = owner * local_experts + local
                start = cute.arch.load(first_row + expert, cutlass.Int32)
                cute.arch.store(first_row + expert, start + carry + inclusive - rows)
                if owner == rank:
                    end_row = carry + inclusive
                    if end_row > capacity:
                        end_row = capacity
                    cute.arch.store(offsets + (local + 1), end_row)
            carry = carry + cute.arch.shuffle_sync(inclusive, 31)
    cute.arch.sync_threads()

    # 5. destination row = first row of the pair's expert from this rank + its position
    for pair in range(tidx, num_pairs, PLACE_THREADS):
        expert = cute.arch.load(expert_of_pair + pair, cutlass.Int32)
        position = cute.arch.load(dest_row + pair, cutlass.Int32)
        cute.arch.store(
            dest_row + pair, position + cute.arch.load(first_row + expert, cutlass.Int32)
        )
    if tidx == 0:
        cute.arch.store(epoch_ptr, epoch)


@cute.jit
def exchange_and_place(
    expert_of_pair_address: cutlass.Int64,
    dest_row_address: cutlass.Int64,
    expert_offsets_address: cutlass.Int64,
    scratch_address: cutlass.Int64,
    peer_table_address: cutlass.Int64,
    epoch_address: cutlass.Int64,
    status_address: cutlass.Int64,
    num_pairs: cutlass.Int32,
    rank: cutlass.Int32,
    world: cutlass.Int32,
    num_experts: cutlass.Int32,
    local_experts: cutlass.Int32,
    capacity: cutlass.Int32,
    timeout_ns: cutlass.Int64,
    stream,
):
    exchange_and_place_kernel(
        expert_of_pair_address,
        dest_row_address,
        expert_offsets_address,
        scratch_address,
        peer_table_address,
        epoch_address,
        status_address,
        num_pairs,
        rank,
        world,
        num_experts,
        local_experts,
        capacity,
        timeout_ns,
    ).launch(grid=[1, 1, 1], block=[PLACE_THREADS, 1, 1], stream=stream)


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
    weights_address: cutlass.Int64,
    pair_tables: cutlass.Int32,
    unroll: cutlass.Constexpr,
):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    warp, lane = tidx // 32, tidx % 32
    peer_table = global_ptr(cutlass.Int64, peer_table_address, 8)
    expert_of_pair = global_ptr(cutlass.Int32, expert_of_pair_address, 4)
    dest_row = global_ptr(cutlass.Int32, dest_row_address, 4)
    weights = global_ptr(cutlass.Float32, weights_address, 4)
    row_bytes = cutlass.Int64(row_vectors) * 16
    for pair in range(bidx * ROWS_WARPS + warp, num_pairs, grid * ROWS_WARPS):
        owner = cute.arch.load(expert_of_pair + pair, cutlass.Int32) // local_experts
        row = cute.arch.load(dest_row + pair, cutlass.Int32)
        token = pair // top_k
        token_row = x_address + cutlass.Int64(token) * row_bytes
        first_for_owner = cutlass.Int32(1)
        for earlier in range(token * top_k, pair):
            if cute.arch.load(expert_of_pair + earlier, cutlass.Int32) // local_experts == owner:
                first_for_owner = cutlass.Int32(0)
        if owner != rank and stage_remote != 0:
            # the token crosses NVLink once per owner: its first pair for that owner stages it
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
        if pair_tables != 0 and first_for_owner == 1:
            # the owner's table of this token: for each k, its batch row there (or -1) and weight
            if lane < top_k:
                other = token * top_k + lane
                other_row = cutlass.Int32(-1)
                other_weight = cutlass.Float32(0.0)
                if cute.arch.load(expert_of_pair + other, cutlass.Int32) // local_experts == owner:
                    other_row = cute.arch.load(dest_row + other, cutlass.Int32)
                    other_weight = cute.arch.load(weights + other, cutlass.Float32)
                entry = (rank * max_tokens + token) * top_k + lane
                table_rows = global_ptr(
                    cutlass.Int32, peer_address(peer_table, BUFFER_PAIR_ROWS, world, owner), 4
                )
                table_weights = global_ptr(
                    cutlass.Float32, peer_address(peer_table, BUFFER_PAIR_WEIGHTS, world, owner), 4
                )
                cute.arch.store(table_rows + entry, other_row)
                cute.arch.store(table_weights + entry, other_weight)
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
    weights_address: cutlass.Int64,
    pair_tables: cutlass.Int32,
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
        weights_address,
        pair_tables,
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
