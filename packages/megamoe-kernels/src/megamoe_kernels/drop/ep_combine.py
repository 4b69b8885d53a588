"""Expert-parallel combine over NVLink (sm_90a): expert outputs go home, then a fixed-order
weighted top-k sum.

combine_push (persistent grid, on the expert owner): one warp per valid batch row (the count is
read on the device from expert_offsets[local_experts], clamped to capacity) copies the row of
expert_out to slot `pair` of its source rank's returned buffer, using the (source, pair) that
dispatch recorded. Each CTA then signals PHASE_RETURNED on every peer once.

combine_reduce (persistent grid, on the source; launched as a programmatic dependent of
combine_push, so it is resident before the rows land): every CTA first waits until each owner's
PHASE_RETURNED adds of this epoch arrived; then one thread per (token, 8-element chunk of the
hidden dimension) sums weight[t, k] x returned[t x top_k + k] over k = 0 .. top_k - 1 in that
order in fp32, and stores the bf16 result: the order of the single-GPU combine, so the result
does not depend on the expert-parallel degree or on timing.

The partial-sum combine (fewer NVLink bytes, not the single-GPU order), one kernel,
combine_partials (persistent grid; each CTA's first PARTIAL_SEND_WARPS warps act as owner, the
others as source, so the two overlap):
- owner side: a warp per valid batch row from another source; only a token's leader row (its
  lowest k with a row here, from the table dispatch wrote) has work: it loads the token's up-to-
  top_k rows here (top_k x `unroll` 16-byte vectors per lane in flight), sums weight x output in
  k order in fp32 (products rounded on their own), writes one bf16 row into its source's
  partials [world x max_tokens, hidden] at (rank, token) with 16-byte stores (one row per
  (token, owner) crosses NVLink), fences at system scope and releases the flag
  partials_arrived[rank, token] there = epoch;
- source side: a warp per token of this rank computes the partial this rank owns the same way
  (rounded to bf16 as a sent one is; never written out), waits for the flags of the other
  owners the token touched, and adds the partials in rank order in fp32 into y.
Deterministic (fixed orders; `owner_partials_combine` in the runtime is its pure-torch
reference); the bf16 partials round once more than the exact combine. Each CTA still adds
PHASE_RETURNED once, so the counter stays in step with the exact combine's.

Layouts: expert_out [capacity, hidden] and returned [max_pairs, hidden] bf16 row-major, weights
float32 [tokens, top_k], y bf16 [tokens, hidden]; hidden a multiple of 8, rows 16-byte aligned.
"""

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm

from .ep_dispatch import copy_row
from .ep_sync import (
    BUFFER_PAIR_ROWS,
    BUFFER_PAIR_WEIGHTS,
    BUFFER_PARTIALS,
    BUFFER_PARTIALS_ARRIVED,
    BUFFER_RETURNED,
    BUFFER_SIGNALS,
    PHASE_RETURNED,
    global_ptr,
    peer_address,
    signal_peer,
    wait_flag,
    wait_for_every_source,
)

PUSH_WARPS = 16
REDUCE_WARPS = 8
PARTIAL_WARPS = 16  # combine_partials: the first PARTIAL_SEND_WARPS send, the others sum
PARTIAL_SEND_WARPS = 8
CHUNK = 8  # bf16 elements per 16-byte vector


def multiply_rounded(a, b):
    """a x b rounded to fp32 on its own (mul.rn): never contracted with the following add into
    an fma, so each product rounds as the single-GPU combine's does."""
    return cutlass.Float32(
        llvm.inline_asm(
            cutlass.Float32.mlir_type,
            [cutlass.Float32(a).ir_value(), cutlass.Float32(b).ir_value()],
            "mul.rn.f32 $0, $1, $2;",
            "=f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.kernel
def combine_push_kernel(
    expert_out_address: cutlass.Int64,
    expert_offsets_address: cutlass.Int64,
    row_sources_address: cutlass.Int64,
    peer_table_address: cutlass.Int64,
    local_experts: cutlass.Int32,
    row_vectors: cutlass.Int32,
    capacity: cutlass.Int32,
    rank: cutlass.Int32,
    world: cutlass.Int32,
    unroll: cutlass.Constexpr,
):
    # combine_reduce (a programmatic dependent) may start now: it waits for the owners' signals
    cute.arch.griddepcontrol_launch_dependents()
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    warp, lane = tidx // 32, tidx % 32
    peer_table = global_ptr(cutlass.Int64, peer_table_address, 8)
    offsets = global_ptr(cutlass.Int32, expert_offsets_address, 4)
    valid_rows = cute.arch.load(offsets + local_experts, cutlass.Int32)
    if valid_rows > capacity:
        valid_rows = capacity
    row_sources = global_ptr(cutlass.Int32, row_sources_address, 8)
    row_bytes = cutlass.Int64(row_vectors) * 16
    # warp w of CTA b takes row w x grid + b: a few rows spread over every SM
    for row in range(warp * grid + bidx, valid_rows, grid * PUSH_WARPS):
        source = cute.arch.load(row_sources + row * 2, cutlass.Int32)
        pair = cute.arch.load(row_sources + (row * 2 + 1), cutlass.Int32)
        returned_base = peer_address(peer_table, BUFFER_RETURNED, world, source)
        copy_row(
            expert_out_address + cutlass.Int64(row) * row_bytes,
            returned_base + cutlass.Int64(pair) * row_bytes,
            row_vectors,
            lane,
            unroll,
        )
    cute.arch.fence_acq_rel_sys()  # every writer releases its stores
    cute.arch.sync_threads()
    if tidx < world:
        signal_peer(peer_table, BUFFER_SIGNALS, world, tidx, PHASE_RETURNED, rank)


@cute.jit
def combine_push(
    expert_out_address: cutlass.Int64,
    expert_offsets_address: cutlass.Int64,
    row_sources_address: cutlass.Int64,
    peer_table_address: cutlass.Int64,
    local_experts: cutlass.Int32,
    row_vectors: cutlass.Int32,
    capacity: cutlass.Int32,
    rank: cutlass.Int32,
    world: cutlass.Int32,
    grid: cutlass.Constexpr,
    unroll: cutlass.Constexpr,
    stream,
):
    combine_push_kernel(
        expert_out_address,
        expert_offsets_address,
        row_sources_address,
        peer_table_address,
        local_experts,
        row_vectors,
        capacity,
        rank,
        world,
        unroll,
    ).launch(grid=[grid, 1, 1], block=[PUSH_WARPS * 32, 1, 1], stream=stream)


@cute.kernel
def combine_reduce_kernel(
    returned_address: cutlass.Int64,
    weights_address: cutlass.Int64,
    y_address: cutlass.Int64,
    signals_address: cutlass.Int64,
    epoch_address: cutlass.Int64,
    status_address: cutlass.Int64,
    tokens: cutlass.Int32,
    hidden: cutlass.Int32,
    world: cutlass.Int32,
    adds_per_epoch: cutlass.Int32,
    timeout_ns: cutlass.Int64,
    top_k: cutlass.Constexpr,
):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    warp, lane = tidx // 32, tidx % 32
    epoch = cute.arch.load(global_ptr(cutlass.Int64, epoch_address, 8), cutlass.Int64)
    wait_for_every_source(
        signals_address, status_address, world, PHASE_RETURNED, epoch, adds_per_epoch, timeout_ns
    )
    weights = global_ptr(cutlass.Float32, weights_address, 4)
    row_bytes = cutlass.Int64(hidden) * 2
    chunk_layout = cute.make_layout(CHUNK)
    chunks = hidden // CHUNK
    # one thread per (token, 16-byte chunk): every thread of the grid has work even for a
    # handful of tokens, and neighbouring threads read neighbouring bytes
    threads = REDUCE_WARPS * 32
    for item in range(bidx * threads + tidx, tokens * chunks, grid * threads):
        token = item // chunks
        chunk = item - token * chunks
        chunk_bytes = cutlass.Int64(chunk) * (CHUNK * 2)
        total = cute.make_rmem_tensor(CHUNK, cutlass.Float32)
        total.fill(0.0)
        contribution = cute.make_rmem_tensor(CHUNK, cutlass.Float32)
        for k in cutlass.range_constexpr(top_k):
            pair = cutlass.Int64(token) * top_k + k
            weight = cute.arch.load(weights + pair, cutlass.Float32)
            source = cute.make_tensor(
                global_ptr(cutlass.BFloat16, returned_address + pair * row_bytes + chunk_bytes, 16),
                chunk_layout,
            )
            contribution.store(source.load().to(cutlass.Float32))
            for i in cutlass.range_constexpr(CHUNK):
                total[i] = total[i] + multiply_rounded(contribution[i], weight)
        destination = cute.make_tensor(
            global_ptr(
                cutlass.BFloat16,
                y_address + cutlass.Int64(token) * row_bytes + chunk_bytes,
                16,
            ),
            chunk_layout,
        )
        destination.store(total.load().to(cutlass.BFloat16))


@cute.jit
def combine_reduce(
    returned_address: cutlass.Int64,
    weights_address: cutlass.Int64,
    y_address: cutlass.Int64,
    signals_address: cutlass.Int64,
    epoch_address: cutlass.Int64,
    status_address: cutlass.Int64,
    tokens: cutlass.Int32,
    hidden: cutlass.Int32,
    world: cutlass.Int32,
    adds_per_epoch: cutlass.Int32,
    timeout_ns: cutlass.Int64,
    top_k: cutlass.Constexpr,
    grid: cutlass.Constexpr,
    stream,
):
    combine_reduce_kernel(
        returned_address,
        weights_address,
        y_address,
        signals_address,
        epoch_address,
        status_address,
        tokens,
        hidden,
        world,
        adds_per_epoch,
        timeout_ns,
        top_k,
    ).launch(
        grid=[grid, 1, 1],
        block=[REDUCE_WARPS * 32, 1, 1],
        stream=stream,
        # a programmatic dependent of combine_push: it starts early and reads nothing of it
        # except through the PHASE_RETURNED signals it waits for (this rank's own included)
        use_pdl=True,
    )


@cute.jit
def add_weighted(total, contribution, values, weight):
    """total += weight x values (8 bf16 of a 16-byte vector) in fp32, each product rounded on
    its own (mul.rn)."""
    contribution.store(values.to(cutlass.Float32))
    for i in cutlass.range_constexpr(CHUNK):
        total[i] = total[i] + multiply_rounded(contribution[i], weight)


@cute.jit
def load_chunk(address):
    """The 8 bf16 of the 16-byte vector at `address`, as a register value."""
    return cute.make_tensor(
        global_ptr(cutlass.BFloat16, address, 16), cute.make_layout(CHUNK)
    ).load()


@cute.jit
def store_chunk(address, total):
    """Rounds 8 fp32 to bf16 and stores them as one 16-byte vector at `address`."""
    destination = cute.make_tensor(
        global_ptr(cutlass.BFloat16, address, 16), cute.make_layout(CHUNK)
    )
    destination.store(total.load().to(cutlass.BFloat16))


@cute.jit
def chunk_view(total, u):
    """The u-th group of CHUNK fp32 of a register tensor."""
    return cute.make_tensor(total.iterator + u * CHUNK, cute.make_layout(CHUNK))


@cute.jit
def weighted_row_sum(total, contribution, addresses, rows, weights, first, unroll):
    """A lane's `unroll` 16-byte vectors (first, first + 32, ...) of sum over k in order of
    weights[k] x row k (rows[k] >= 0 only), in fp32 with each product rounded on its own; every
    load is issued before the first add."""
    top_k = len(rows)
    values = []
    for k in cutlass.range_constexpr(top_k):
        for u in cutlass.range_constexpr(unroll):
            values.append(load_chunk(addresses[k] + cutlass.Int64(first + 32 * u) * 16))
    total.fill(0.0)
    for k in cutlass.range_constexpr(top_k):
        if rows[k] >= 0:
            for u in cutlass.range_constexpr(unroll):
                add_weighted(chunk_view(total, u), contribution, values[k * unroll + u], weights[k])


@cute.jit
def rows_and_weights(pair_rows, pair_weights, table, lane, capacity, valid, top_k):
    """The token's batch rows here (-1 where its k is elsewhere or dropped past capacity) and
    weights, from its pair-table entry, broadcast to every lane; all -1 unless `valid`."""
    lane_row = cutlass.Int32(-1)
    lane_weight = cutlass.Float32(0.0)
    if lane < top_k:
        if valid:
            lane_row = cute.arch.load(pair_rows + (table + lane), cutlass.Int32)
            lane_weight = cute.arch.load(pair_weights + (table + lane), cutlass.Float32)
            if lane_row >= capacity:
                lane_row = cutlass.Int32(-1)  # dropped past capacity: not in this batch
    rows = []
    weights = []
    for k in cutlass.range_constexpr(top_k):
        rows.append(cute.arch.shuffle_sync(lane_row, k))
        weights.append(cute.arch.shuffle_sync(lane_weight, k))
    return lane_row, rows, weights


@cute.jit
def row_addresses(expert_out_address, rows, fallback_row, row_bytes):
    """Each k's row address; rows not here read `fallback_row` (a cache hit, never added)."""
    addresses = []
    for k in cutlass.range_constexpr(len(rows)):
        safe_row = rows[k]
        if safe_row < 0:
            safe_row = fallback_row
        addresses.append(expert_out_address + cutlass.Int64(safe_row) * row_bytes)
    return addresses


@cute.kernel
def combine_partials_kernel(
    expert_out_address: cutlass.Int64,
    expert_offsets_address: cutlass.Int64,
    row_sources_address: cutlass.Int64,
    expert_of_pair_address: cutlass.Int64,
    y_address: cutlass.Int64,
    peer_table_address: cutlass.Int64,
    epoch_address: cutlass.Int64,
    status_address: cutlass.Int64,
    tokens: cutlass.Int32,
    local_experts: cutlass.Int32,
    hidden: cutlass.Int32,
    capacity: cutlass.Int32,
    max_tokens: cutlass.Int32,
    rank: cutlass.Int32,
    world: cutlass.Int32,
    timeout_ns: cutlass.Int64,
    top_k: cutlass.Constexpr,
    unroll: cutlass.Constexpr,
):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    grid, _, _ = cute.arch.grid_dim()
    warp, lane = tidx // 32, tidx % 32
    peer_table = global_ptr(cutlass.Int64, peer_table_address, 8)
    epoch = cute.arch.load(global_ptr(cutlass.Int64, epoch_address, 8), cutlass.Int64)
    pair_rows = global_ptr(
        cutlass.Int32, peer_address(peer_table, BUFFER_PAIR_ROWS, world, rank), 4
    )
    pair_weights = global_ptr(
        cutlass.Float32, peer_address(peer_table, BUFFER_PAIR_WEIGHTS, world, rank), 4
    )
    row_bytes = cutlass.Int64(hidden) * 2
    row_vectors = hidden // CHUNK
    total = cute.make_rmem_tensor(CHUNK * unroll, cutlass.Float32)
    contribution = cute.make_rmem_tensor(CHUNK, cutlass.Float32)
    if warp < PARTIAL_SEND_WARPS:
        # owner side, for every other source: a warp per batch row; only the row of a token's
        # lowest k here (its leader) has work: it sums the token's rows here and writes one
        # bf16 row into the source's partials at (rank, token), then releases the token's flag
        # there. Warp w of CTA b takes row b x PARTIAL_SEND_WARPS + w (spreading rows over the
        # SMs, as the dispatch does, measured 12% slower at 4096 tokens).
        valid_rows = cute.arch.load(
            global_ptr(cutlass.Int32, expert_offsets_address, 4) + local_experts, cutlass.Int32
        )
        if valid_rows > capacity:
            valid_rows = capacity
        row_sources = global_ptr(cutlass.Int32, row_sources_address, 8)
        for row in range(bidx * PARTIAL_SEND_WARPS + warp, valid_rows, grid * PARTIAL_SEND_WARPS):
            source = cute.arch.load(row_sources + row * 2, cutlass.Int32)
            pair = cute.arch.load(row_sources + (row * 2 + 1), cutlass.Int32)
            if source != rank:  # this rank's own tokens: the other warps, below
                token = pair // top_k
                k_here = pair - token * top_k
                table = (source * max_tokens + token) * top_k
                lane_row, rows, weights = rows_and_weights(
                    pair_rows, pair_weights, table, lane, capacity, True, top_k
                )
                earlier_here = cutlass.Int32(0)
                if lane < k_here:
                    if lane_row >= 0:
                        earlier_here = cutlass.Int32(1)
                if cute.arch.vote_ballot_sync(earlier_here == 1) == 0:
                    addresses = row_addresses(expert_out_address, rows, row, row_bytes)
                    slot = cutlass.Int64(rank) * max_tokens + token
                    partial_row = (
                        peer_address(peer_table, BUFFER_PARTIALS, world, source) + slot * row_bytes
                    )
                    for first in range(lane, row_vectors, 32 * unroll):
                        weighted_row_sum(
                            total, contribution, addresses, rows, weights, first, unroll
                        )
                        for u in cutlass.range_constexpr(unroll):
                            store_chunk(
                                partial_row + cutlass.Int64(first + 32 * u) * 16,
                                chunk_view(total, u),
                            )
                    cute.arch.fence_acq_rel_sys()  # every lane releases its stores
                    cute.arch.sync_warp()
                    if lane == 0:
                        arrived = global_ptr(
                            cutlass.Int64,
                            peer_address(peer_table, BUFFER_PARTIALS_ARRIVED, world, source),
                            8,
                        )
                        cute.arch.store(arrived + slot, epoch, sem="release", scope="sys")
    else:
        # source side: a warp per token of this rank sums its own rows here (the partial this
        # rank, as owner, contributes: rounded to bf16 as a sent partial is), waits for the
        # flags of the other owners its experts live on, and adds the owners' partials in rank
        # order in fp32
        expert_of_pair = global_ptr(cutlass.Int32, expert_of_pair_address, 4)
        partials_here = peer_address(peer_table, BUFFER_PARTIALS, world, rank)
        arrived_here = global_ptr(
            cutlass.Int64, peer_address(peer_table, BUFFER_PARTIALS_ARRIVED, world, rank), 8
        )
        own = cute.make_rmem_tensor(CHUNK * unroll, cutlass.Float32)
        receive_warp = warp - PARTIAL_SEND_WARPS
        receive_warps = PARTIAL_WARPS - PARTIAL_SEND_WARPS
        wait_ns = timeout_ns
        for token in range(bidx * receive_warps + receive_warp, tokens, grid * receive_warps):
            lane_owner = cutlass.Int32(0)
            if lane < top_k:
                lane_owner = cute.arch.load(expert_of_pair + (token * top_k + lane), cutlass.Int32)
                lane_owner = lane_owner // local_experts
            owner_mask = cutlass.Int32(0)
            for k in cutlass.range_constexpr(top_k):
                owner_mask = owner_mask | (
                    cutlass.Int32(1) << cute.arch.shuffle_sync(lane_owner, k)
                )
            has_rows_here = (owner_mask >> rank) & 1 == 1  # else its table entry is stale
            table = (rank * max_tokens + token) * top_k
            _, rows, weights = rows_and_weights(
                pair_rows, pair_weights, table, lane, capacity, has_rows_here, top_k
            )
            addresses = row_addresses(expert_out_address, rows, 0, row_bytes)
            for owner in range(world):
                if owner != rank:
                    if (owner_mask >> owner) & 1 == 1:
                        seen = wait_flag(
                            arrived_here + (cutlass.Int64(owner) * max_tokens + token),
                            status_address,
                            PHASE_RETURNED,
                            owner,
                            epoch,
                            epoch,
                            wait_ns,
                        )
                        if seen < epoch:
                            wait_ns = cutlass.Int64(0)  # timed out: give up on later ones at once
            y_row = y_address + cutlass.Int64(token) * row_bytes
            for first in range(lane, row_vectors, 32 * unroll):
                weighted_row_sum(own, contribution, addresses, rows, weights, first, unroll)
                total.fill(0.0)
                for owner in range(world):  # owners in rank order: a fixed summation order
                    if (owner_mask >> owner) & 1 == 1:
                        if owner == rank:
                            for u in cutlass.range_constexpr(unroll):
                                # rounded to bf16 and back, exactly as a sent partial is
                                contribution.store(
                                    chunk_view(own, u)
                                    .load()
                                    .to(cutlass.BFloat16)
                                    .to(cutlass.Float32)
                                )
                                for i in cutlass.range_constexpr(CHUNK):
                                    total[u * CHUNK + i] = total[u * CHUNK + i] + contribution[i]
                        else:
                            partial_row = (
                                partials_here
                                + (cutlass.Int64(owner) * max_tokens + token) * row_bytes
                            )
                            values = []
                            for u in cutlass.range_constexpr(unroll):
                                values.append(
                                    load_chunk(partial_row + cutlass.Int64(first + 32 * u) * 16)
                                )
                            for u in cutlass.range_constexpr(unroll):
                                contribution.store(values[u].to(cutlass.Float32))
                                for i in cutlass.range_constexpr(CHUNK):
                                    total[u * CHUNK + i] = total[u * CHUNK + i] + contribution[i]
                for u in cutlass.range_constexpr(unroll):
                    store_chunk(y_row + cutlass.Int64(first + 32 * u) * 16, chunk_view(total, u))
    # PHASE_RETURNED stays at grid adds per epoch on every rank, as the exact combine (which
    # waits on it) counts, whichever combine of a shared workspace ran before
    cute.arch.sync_threads()
    if tidx < world:
        signal_peer(peer_table, BUFFER_SIGNALS, world, tidx, PHASE_RETURNED, rank)


@cute.jit
def combine_partials(
    expert_out_address: cutlass.Int64,
    expert_offsets_address: cutlass.Int64,
    row_sources_address: cutlass.Int64,
    expert_of_pair_address: cutlass.Int64,
    y_address: cutlass.Int64,
    peer_table_address: cutlass.Int64,
    epoch_address: cutlass.Int64,
    status_address: cutlass.Int64,
    tokens: cutlass.Int32,
    local_experts: cutlass.Int32,
    hidden: cutlass.Int32,
    capacity: cutlass.Int32,
    max_tokens: cutlass.Int32,
    rank: cutlass.Int32,
    world: cutlass.Int32,
    timeout_ns: cutlass.Int64,
    top_k: cutlass.Constexpr,
    grid: cutlass.Constexpr,
    unroll: cutlass.Constexpr,
    stream,
):
    combine_partials_kernel(
        expert_out_address,
        expert_offsets_address,
        row_sources_address,
        expert_of_pair_address,
        y_address,
        peer_table_address,
        epoch_address,
        status_address,
        tokens,
        local_experts,
        hidden,
        capacity,
        max_tokens,
        rank,
        world,
        timeout_ns,
        top_k,
        unroll,
    ).launch(grid=[grid, 1, 1], block=[PARTIAL_WARPS * 32, 1, 1], stream=stream)
