"""Expert-parallel dispatch over NVLink (sm_90a): after the count exchange and placement
(ep_place.py), rows straight into the receiver's tight expert-major batch.

Every argument is a device address, a scalar or the dispatcher's EpParams (ep_sync.py): no
tensor conversion per call. Experts are
owned in contiguous blocks: expert e lives on rank e // local_experts.

dispatch_tokens (the staged dispatch, persistent grid, one launch after exchange_and_place;
each CTA's first SEND_WARPS warps do step 1, the others step 2, so the two run at once):
1. a warp per token of this rank reads its row once (16-byte vectors, `unroll` loads in flight
   per lane) and writes it into each of its batch rows on this rank and once into each other
   owner's staged rows [world x max_tokens, hidden] at (rank, token), with that owner's table
   entries for the token (per k: its batch row there or -1, and with `pair_weights` the routing
   weight; int32 / float32 [world, max_tokens, top_k]); then every lane fences at system scope
   and one lane per other rank releases the flag arrived[rank, token] there = 2 x epoch + (1 if
   the token has rows on that rank);
2. a warp per token slot of every other source (its pair count / top_k slots) spins on the
   slot's flag (acquire, system scope, with the timeout) and copies the staged row, read once
   from local HBM, into each of the token's batch rows here, recording (source, pair) per row.
The owner's expansion starts as soon as a token lands, overlapping the NVLink traffic; a token
crosses NVLink once per owner. The kernel returns with this rank's batch complete (it still adds
PHASE_ROWS per CTA, so the counter stays in step with the direct dispatch's). Rows at or past
`capacity` are skipped. Sender (receiver) warp w of CTA b takes item w x grid + b, so a few
tokens spread over every SM. At most 32 ranks (a lane per rank).

dispatch_rows (the direct dispatch, persistent grid): one warp per (token, expert) pair records
(rank, pair) at `dest_row[pair]` of the owner's batch for the combine and moves the token's row
straight into the owner's batch row, so every pair's row crosses NVLink on its own. Each CTA then
signals PHASE_ROWS on every peer once (a receiver waits for grid x epoch adds per source, in
wait_phase). With params.pair_weights (for the partial-sum combine), a token's first pair for
an owner also writes the owner's table entries as dispatch_tokens does.

The FP8 wire (params.fp8_rows, compile time): the token rows are quantized where they are read,
once per token (row_vectors.py: fp8_scaling's recipe, one scale per row and ACTIVATION_GROUP
columns), and e4m3 rows cross NVLink: dispatch_rows quantizes each pair's row into its owner's
e4m3 batch row and its scales (BUFFER_ROW_SCALES [groups, capacity], the FP8 GEMM's layout);
dispatch_tokens' senders quantize each token once into this rank's batch rows and each other
owner's e4m3 staged row with its scales (BUFFER_STAGED_SCALES [world x max_tokens, groups]), and
the receivers copy the e4m3 rows (`unroll` then counts 16-byte e4m3 vectors) and their scales
into the batch. A batch row holds exactly what quantizing its token row on the host gives.

Layouts: x [tokens, hidden] row-major; expert_of_pair, dest_row int32 [tokens x top_k] in
(token, k) order; row bytes (hidden x element size) a multiple of 16 and 16-byte aligned rows
(with the FP8 wire, hidden a multiple of 16).
"""

import cutlass
import cutlass.cute as cute
from cutlass._mlir import ir

from .ep_place import pairs_of_source_offset
from .ep_sync import (
    BUFFER_ARRIVED,
    BUFFER_PAIR_ROWS,
    BUFFER_PAIR_WEIGHTS,
    BUFFER_ROW_SCALES,
    BUFFER_ROW_SOURCES,
    BUFFER_ROWS,
    BUFFER_SIGNALS,
    BUFFER_STAGED,
    BUFFER_STAGED_SCALES,
    PHASE_ROWS,
    EpParams,
    global_ptr,
    peer_address,
    signal_peer,
    thread_position,
    wait_flag,
)
from .row_vectors import (
    CHUNK,
    GROUP_VECTORS,
    copy_scales,
    load_bf16_lane,
    quantize_lane,
    quantize_to_rows,
    scale_groups,
    store_e4m3,
)

ROWS_WARPS = 16
TOKENS_WARPS = 16
SEND_WARPS = 8  # of TOKENS_WARPS: the rest expand arrived tokens
MAX_ROW_SLICES = 8  # warps sharing one row, at most (row_slices)


@cute.jit
def copy_rounds(row_vectors, unroll: cutlass.Constexpr):
    """Rounds of loads a warp needs for a whole row: 32 x `unroll` 16-byte vectors each."""
    return (row_vectors + 32 * unroll - 1) // (32 * unroll)


@cute.jit
def row_slices(rows, rounds, warps):
    """Warps that share each of `rows` rows so that about `warps` warps have work: between 1
    and min(rounds, MAX_ROW_SLICES); 1 when rows are many."""
    slices = cutlass.Int32(1)
    if rows > 0:
        slices = warps // rows
    if slices > rounds:
        slices = rounds
    if slices > MAX_ROW_SLICES:
        slices = MAX_ROW_SLICES
    if slices < 1:
        slices = cutlass.Int32(1)
    return slices


@cute.jit
def slice_vectors(part, slices, rounds, row_vectors, unroll: cutlass.Constexpr):
    """[first, end) 16-byte vectors of slice `part` of `slices` of a row: whole rounds."""
    first = (part * rounds // slices) * (32 * unroll)
    end = ((part + 1) * rounds // slices) * (32 * unroll)
    if end > row_vectors:
        end = row_vectors
    return first, end


@cute.jit
def copy_row(source_address, destination_address, first, end, lane, unroll: cutlass.Constexpr):
    """A warp copies 16-byte vectors [first, end) of a row; each lane issues `unroll` loads
    before their stores, so several are in flight (end - first: a multiple of 32 x unroll, or
    unroll 1)."""
    vector_type = ir.VectorType.get([4], cutlass.Int32.mlir_type)
    for vector in range(first + lane, end, 32 * unroll):
        values = []
        for j in cutlass.range_constexpr(unroll):
            offset = cutlass.Int64(vector + 32 * j) * 16
            source = global_ptr(cutlass.Int32, source_address + offset, 16)
            values.append(cute.arch.load(source, vector_type))
        for j in cutlass.range_constexpr(unroll):
            offset = cutlass.Int64(vector + 32 * j) * 16
            cute.arch.store(global_ptr(cutlass.Int32, destination_address + offset, 16), values[j])


@cute.kernel
def dispatch_rows_kernel(
    x_address: cutlass.Int64,
    expert_of_pair_address: cutlass.Int64,
    dest_row_address: cutlass.Int64,
    weights_address: cutlass.Int64,
    num_pairs: cutlass.Int32,
    params: EpParams,
    unroll: cutlass.Constexpr,
):
    peer_table_address, top_k, local_experts = (
        params.peer_table_address,
        params.top_k,
        params.local_experts,
    )
    row_vectors, capacity, max_tokens = params.row_vectors, params.capacity, params.max_tokens
    rank, world, pair_tables = params.rank, params.world, params.pair_weights
    tidx, bidx, grid, warp, lane = thread_position()
    peer_table = global_ptr(cutlass.Int64, peer_table_address, 8)
    expert_of_pair = global_ptr(cutlass.Int32, expert_of_pair_address, 4)
    dest_row = global_ptr(cutlass.Int32, dest_row_address, 4)
    weights = global_ptr(cutlass.Float32, weights_address, 4)
    row_bytes = cutlass.Int64(row_vectors) * 16
    # warp w of CTA b takes item w x grid + b: a few items spread over every SM, not a few CTAs
    for pair in range(warp * grid + bidx, num_pairs, grid * ROWS_WARPS):
        owner = cute.arch.load(expert_of_pair + pair, cutlass.Int32) // local_experts
        row = cute.arch.load(dest_row + pair, cutlass.Int32)
        token = pair // top_k
        token_row = x_address + cutlass.Int64(token) * row_bytes
        first_for_owner = cutlass.Int32(1)
        for earlier in range(token * top_k, pair):
            if cute.arch.load(expert_of_pair + earlier, cutlass.Int32) // local_experts == owner:
                first_for_owner = cutlass.Int32(0)
        if row < capacity:
            rows_base = peer_address(peer_table, BUFFER_ROWS, world, owner)
            if cutlass.const_expr(params.fp8_rows):
                scales = global_ptr(
                    cutlass.Float32, peer_address(peer_table, BUFFER_ROW_SCALES, world, owner), 4
                )
                hidden = row_vectors * CHUNK
                quantize_to_rows(
                    token_row,
                    rows_base,
                    [row],
                    scales,
                    capacity,
                    1,
                    hidden,
                    0,
                    row_vectors,
                    lane,
                    1,
                )
            else:
                copy_row(
                    token_row,
                    rows_base + cutlass.Int64(row) * row_bytes,
                    0,
                    row_vectors,
                    lane,
                    unroll,
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
    weights_address: cutlass.Int64,
    num_pairs: cutlass.Int32,
    params: EpParams,
    unroll: cutlass.Constexpr,
    stream,
):
    dispatch_rows_kernel(
        x_address,
        expert_of_pair_address,
        dest_row_address,
        weights_address,
        num_pairs,
        params,
        unroll,
    ).launch(grid=[params.grid, 1, 1], block=[ROWS_WARPS * 32, 1, 1], stream=stream)


@cute.jit
def store_vectors(destination_address, first, values):
    """Stores a lane's 16-byte `values` at vectors first, first + 32, ... of a row."""
    for j in cutlass.range_constexpr(len(values)):
        offset = cutlass.Int64(first + 32 * j) * 16
        cute.arch.store(global_ptr(cutlass.Int32, destination_address + offset, 16), values[j])


@cute.jit
def load_vectors(source_address, first, unroll: cutlass.Constexpr):
    """A lane's 16-byte vectors first, first + 32, ... (unroll of them) of a row, all issued
    before any is used."""
    vector_type = ir.VectorType.get([4], cutlass.Int32.mlir_type)
    values = []
    for j in cutlass.range_constexpr(unroll):
        offset = cutlass.Int64(first + 32 * j) * 16
        values.append(
            cute.arch.load(global_ptr(cutlass.Int32, source_address + offset, 16), vector_type)
        )
    return values


@cute.jit
def copy_to_rows(
    source_row,
    rows_here,
    rows,
    row_bytes,
    first,
    end,
    lane,
    unroll: cutlass.Constexpr,
    top_k: cutlass.Constexpr,
):
    """A warp copies 16-byte vectors [first, end) of the row at `source_row` into each batch
    row rows[k] here that is not -1 (each vector loaded once, stored top_k times at most)."""
    for vector in range(first + lane, end, 32 * unroll):
        values = load_vectors(source_row, vector, unroll)
        for k in cutlass.range_constexpr(top_k):
            if rows[k] >= 0:
                store_vectors(rows_here + cutlass.Int64(rows[k]) * row_bytes, vector, values)


@cute.jit
def token_owners(expert_of_pair, token, local_experts, lane, top_k: cutlass.Constexpr):
    """Bit mask of the ranks that own one of the token's top_k experts (on every lane)."""
    lane_owner = cutlass.Int32(0)
    if lane < top_k:
        lane_owner = cute.arch.load(expert_of_pair + (token * top_k + lane), cutlass.Int32)
        lane_owner = lane_owner // local_experts
    owner_mask = cutlass.Int32(0)
    for k in cutlass.range_constexpr(top_k):
        owner_mask = owner_mask | (cutlass.Int32(1) << cute.arch.shuffle_sync(lane_owner, k))
    return owner_mask


@cute.jit
def release_token_flags(peer_table, token, owner_mask, epoch, rank, world, max_tokens, lane):
    """After a sender warp's stores of this rank's `token`: every lane fences at system scope,
    then lane r (for each other rank r) releases arrived[rank, token] on rank r to 2 x epoch +
    (1 if the token has rows there, bit r of owner_mask)."""
    cute.arch.fence_acq_rel_sys()  # every lane releases its stores
    cute.arch.sync_warp()
    if lane < world:
        if lane != rank:
            arrived = global_ptr(
                cutlass.Int64, peer_address(peer_table, BUFFER_ARRIVED, world, lane), 8
            )
            cute.arch.store(
                arrived + (cutlass.Int64(rank) * max_tokens + token),
                epoch * 2 + cutlass.Int64((owner_mask >> lane) & 1),
                sem="release",
                scope="sys",
            )


@cute.jit
def scales_of(peer_table, buffer, world, peer):
    """Float32 scales buffer `buffer` as `peer` holds it (a pointer)."""
    return global_ptr(cutlass.Float32, peer_address(peer_table, buffer, world, peer), 4)


@cute.jit
def send_quantized_token(
    token_row,
    here_rows,
    rows_here,
    row_scales_here,
    capacity,
    peer_table,
    owner_mask,
    slot,
    rank,
    world,
    row_vectors,
    lane,
    top_k: cutlass.Constexpr,
):
    """The FP8 wire's sender: a warp quantizes this rank's bf16 token row once (row_vectors.py)
    and writes it into its batch rows here (here_rows[k]; -1: none) with their scales
    (group-major [groups, capacity]), and into staged row `slot` of each other rank in
    owner_mask with the token's scales (token-major [slots, groups])."""
    hidden = row_vectors * CHUNK
    groups = scale_groups(row_vectors)
    for base in range(0, row_vectors, 32):
        vector = base + lane
        counted = vector < row_vectors
        quantized, scale = quantize_lane(load_bf16_lane(token_row, vector, row_vectors), counted)
        if counted:
            offset = cutlass.Int64(vector) * CHUNK
            for k in cutlass.range_constexpr(top_k):
                if here_rows[k] >= 0:
                    store_e4m3(rows_here + cutlass.Int64(here_rows[k]) * hidden + offset, quantized)
            for peer in range(world):
                if peer != rank:
                    if (owner_mask >> peer) & 1 == 1:
                        staged = peer_address(peer_table, BUFFER_STAGED, world, peer)
                        store_e4m3(staged + slot * hidden + offset, quantized)
            if vector % GROUP_VECTORS == 0:
                group = vector // GROUP_VECTORS
                for k in cutlass.range_constexpr(top_k):
                    if here_rows[k] >= 0:
                        cute.arch.store(
                            row_scales_here + (cutlass.Int64(group) * capacity + here_rows[k]),
                            scale,
                        )
                for peer in range(world):
                    if peer != rank:
                        if (owner_mask >> peer) & 1 == 1:
                            staged_scales = scales_of(peer_table, BUFFER_STAGED_SCALES, world, peer)
                            cute.arch.store(staged_scales + (slot * groups + group), scale)


@cute.kernel
def dispatch_tokens_kernel(
    x_address: cutlass.Int64,
    expert_of_pair_address: cutlass.Int64,
    dest_row_address: cutlass.Int64,
    weights_address: cutlass.Int64,
    tokens: cutlass.Int32,
    params: EpParams,
    unroll: cutlass.Constexpr,
):
    peer_table_address, epoch_address = params.peer_table_address, params.epoch_address
    status_address, timeout_ns = params.status_address, params.timeout_ns
    local_experts, row_vectors, capacity = params.local_experts, params.row_vectors, params.capacity
    rank, world, max_tokens = params.rank, params.world, params.max_tokens
    pair_weights, top_k = params.pair_weights, params.top_k
    # the placement's per-source pair counts of this epoch
    pairs_of_source_address = (
        params.placement_scratch_address
        + cutlass.Int64(pairs_of_source_offset(params.num_experts)) * 4
    )
    tidx, bidx, grid, warp, lane = thread_position()
    # the first SEND_WARPS warps of each CTA send this rank's tokens, the others expand the
    # tokens that land here, so the local expansion overlaps the NVLink traffic; sender (or
    # receiver) warp w of CTA b takes item w x grid + b: a few items spread over every SM
    sender = warp < SEND_WARPS
    role_warp = warp
    role_warps = SEND_WARPS
    if not sender:
        role_warp = warp - SEND_WARPS
        role_warps = TOKENS_WARPS - SEND_WARPS
    first_warp = role_warp * grid + bidx
    warps = grid * role_warps
    peer_table = global_ptr(cutlass.Int64, peer_table_address, 8)
    expert_of_pair = global_ptr(cutlass.Int32, expert_of_pair_address, 4)
    dest_row = global_ptr(cutlass.Int32, dest_row_address, 4)
    weights = global_ptr(cutlass.Float32, weights_address, 4)
    epoch = cute.arch.load(global_ptr(cutlass.Int64, epoch_address, 8), cutlass.Int64)
    row_bytes = cutlass.Int64(row_vectors) * 16
    rows_here = peer_address(peer_table, BUFFER_ROWS, world, rank)
    sources_here = global_ptr(
        cutlass.Int32, peer_address(peer_table, BUFFER_ROW_SOURCES, world, rank), 8
    )

    if sender:
        # 1. a warp per token of this rank: read the row once; write it into this rank's batch rows
        #    and once into each other owner's staged rows, with the owners' table entries; then
        #    release a per-(source, token) flag on every other rank
        for token in range(first_warp, tokens, warps):
            lane_owner = cutlass.Int32(-1)
            lane_row = cutlass.Int32(-1)
            lane_weight = cutlass.Float32(0.0)
            if lane < top_k:
                pair = token * top_k + lane
                lane_owner = cute.arch.load(expert_of_pair + pair, cutlass.Int32) // local_experts
                lane_row = cute.arch.load(dest_row + pair, cutlass.Int32)
                lane_weight = cute.arch.load(weights + pair, cutlass.Float32)
            owner_mask = cutlass.Int32(0)
            rows = []
            here = []
            for k in cutlass.range_constexpr(top_k):
                owner = cute.arch.shuffle_sync(lane_owner, k)
                row = cute.arch.shuffle_sync(lane_row, k)
                owner_mask = owner_mask | (cutlass.Int32(1) << owner)
                is_here = cutlass.Int32(0)
                if owner == rank:
                    if row < capacity:
                        is_here = cutlass.Int32(1)
                rows.append(row)
                here.append(is_here)
            token_row = x_address + cutlass.Int64(token) * row_bytes
            if cutlass.const_expr(params.fp8_rows):
                here_rows = []
                for k in cutlass.range_constexpr(top_k):
                    here_row = cutlass.Int32(-1)
                    if here[k] == 1:
                        here_row = rows[k]
                    here_rows.append(here_row)
                send_quantized_token(
                    token_row,
                    here_rows,
                    rows_here,
                    scales_of(peer_table, BUFFER_ROW_SCALES, world, rank),
                    capacity,
                    peer_table,
                    owner_mask,
                    cutlass.Int64(rank) * max_tokens + token,
                    rank,
                    world,
                    row_vectors,
                    lane,
                    top_k,
                )
            else:
                staged_offset = (cutlass.Int64(rank) * max_tokens + token) * row_bytes
                for first in range(lane, row_vectors, 32 * unroll):
                    values = load_vectors(token_row, first, unroll)
                    for k in cutlass.range_constexpr(top_k):
                        if here[k] == 1:
                            store_vectors(
                                rows_here + cutlass.Int64(rows[k]) * row_bytes, first, values
                            )
                    for peer in range(world):
                        if peer != rank:
                            if (owner_mask >> peer) & 1 == 1:
                                staged = peer_address(peer_table, BUFFER_STAGED, world, peer)
                                store_vectors(staged + staged_offset, first, values)
            if lane < top_k:
                if lane_owner == rank:
                    if lane_row < capacity:
                        cute.arch.store(sources_here + lane_row * 2, rank)
                        cute.arch.store(sources_here + (lane_row * 2 + 1), token * top_k + lane)
                # each owner's table of this token: for each k, its batch row there (or -1), weight
                entry = (rank * max_tokens + token) * top_k + lane
                for peer in range(world):
                    if (owner_mask >> peer) & 1 == 1:
                        table_row = cutlass.Int32(-1)
                        table_weight = cutlass.Float32(0.0)
                        if lane_owner == peer:
                            table_row = lane_row
                            table_weight = lane_weight
                        table_rows = global_ptr(
                            cutlass.Int32,
                            peer_address(peer_table, BUFFER_PAIR_ROWS, world, peer),
                            4,
                        )
                        cute.arch.store(table_rows + entry, table_row)
                        if pair_weights != 0:
                            table_weights = global_ptr(
                                cutlass.Float32,
                                peer_address(peer_table, BUFFER_PAIR_WEIGHTS, world, peer),
                                4,
                            )
                            cute.arch.store(table_weights + entry, table_weight)
            release_token_flags(peer_table, token, owner_mask, epoch, rank, world, max_tokens, lane)
    else:
        # 2. a warp per token slot of every other source: wait for its flag, then copy the staged
        #    row (local HBM, read once) into each of the token's batch rows here
        arrived_here = global_ptr(
            cutlass.Int64, peer_address(peer_table, BUFFER_ARRIVED, world, rank), 8
        )
        staged_here = peer_address(peer_table, BUFFER_STAGED, world, rank)
        table_here = global_ptr(
            cutlass.Int32, peer_address(peer_table, BUFFER_PAIR_ROWS, world, rank), 4
        )
        pairs_of_source = global_ptr(cutlass.Int32, pairs_of_source_address, 4)
        # the staged rows as they crossed NVLink: bf16, or e4m3 (hidden bytes) with their scales
        wire_vectors = row_vectors
        if cutlass.const_expr(params.fp8_rows):
            wire_vectors = row_vectors // 2
        wire_row_bytes = cutlass.Int64(wire_vectors) * 16
        groups = scale_groups(row_vectors)
        wait_ns = timeout_ns
        for step in range(1, world):
            source = (rank + step) % world
            source_tokens = cute.arch.load(pairs_of_source + source, cutlass.Int32) // top_k
            if source_tokens > max_tokens:
                source_tokens = max_tokens
            for token in range(first_warp, source_tokens, warps):
                slot = cutlass.Int64(source) * max_tokens + token
                seen = wait_flag(
                    arrived_here + slot,
                    status_address,
                    PHASE_ROWS,
                    source,
                    epoch * 2,
                    epoch,
                    wait_ns,
                )
                if seen < epoch * 2:
                    wait_ns = cutlass.Int64(0)  # timed out: give up on later slots at once
                if seen == epoch * 2 + 1:
                    lane_row = cutlass.Int32(-1)
                    if lane < top_k:
                        lane_row = cute.arch.load(table_here + (slot * top_k + lane), cutlass.Int32)
                        if lane_row >= capacity:
                            lane_row = cutlass.Int32(-1)
                        if lane_row >= 0:
                            cute.arch.store(sources_here + lane_row * 2, source)
                            cute.arch.store(sources_here + (lane_row * 2 + 1), token * top_k + lane)
                    rows = []
                    for k in cutlass.range_constexpr(top_k):
                        rows.append(cute.arch.shuffle_sync(lane_row, k))
                    copy_to_rows(
                        staged_here + slot * wire_row_bytes,
                        rows_here,
                        rows,
                        wire_row_bytes,
                        0,
                        wire_vectors,
                        lane,
                        unroll,
                        top_k,
                    )
                    if cutlass.const_expr(params.fp8_rows):
                        copy_scales(
                            scales_of(peer_table, BUFFER_STAGED_SCALES, world, rank)
                            + slot * groups,
                            scales_of(peer_table, BUFFER_ROW_SCALES, world, rank),
                            capacity,
                            rows,
                            0,
                            groups,
                            lane,
                            top_k,
                        )
    # PHASE_ROWS stays at grid adds per epoch on every rank, as the direct dispatch (which waits
    # on it) counts, whichever dispatch of a shared workspace ran before
    cute.arch.sync_threads()
    if tidx < world:
        signal_peer(peer_table, BUFFER_SIGNALS, world, tidx, PHASE_ROWS, rank)


@cute.jit
def dispatch_tokens(
    x_address: cutlass.Int64,
    expert_of_pair_address: cutlass.Int64,
    dest_row_address: cutlass.Int64,
    weights_address: cutlass.Int64,
    tokens: cutlass.Int32,
    params: EpParams,
    unroll: cutlass.Constexpr,
    stream,
):
    dispatch_tokens_kernel(
        x_address, expert_of_pair_address, dest_row_address, weights_address, tokens, params, unroll
    ).launch(grid=[params.grid, 1, 1], block=[TOKENS_WARPS * 32, 1, 1], stream=stream)
