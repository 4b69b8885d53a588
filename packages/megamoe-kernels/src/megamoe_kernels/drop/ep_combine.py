"""Expert-parallel combine over NVLink (sm_90a): expert outputs go home, then a fixed-order
weighted top-k sum.

combine_push (persistent grid, on the expert owner): one warp per valid batch row (per slice
of it when rows are fewer than warps; the count is read on the device from
expert_offsets[local_experts], clamped to capacity) copies the row of expert_out to slot `pair`
of its source rank's returned buffer, using the (source, pair) that dispatch recorded. Each CTA
then signals PHASE_RETURNED on every peer once.

combine_reduce (persistent grid, on the source): every CTA first waits until each owner's
PHASE_RETURNED adds of this epoch arrived; then one thread per (token, 8-element chunk of the
hidden dimension) sums weight[t, k] x returned[t x top_k + k] over k = 0 .. top_k - 1 in that
order in fp32, and stores the bf16 result: the order of the single-GPU combine, so the result
does not depend on the expert-parallel degree or on timing.

The partial-sum combine (fewer NVLink bytes, not the single-GPU order):
combine_partial (on the owner): a warp per valid batch row (per slice of it when the leaders
are fewer than the warps); only a token's leader row (its lowest k with a row here, from the
table dispatch wrote) has work: it loads the token's up-to-top_k rows here (top_k x `unroll`
16-byte vectors per lane in flight), sums weight x output in k order in fp32 (products rounded
on their own), and writes one bf16 row into its source's partials [world x max_tokens, hidden]
at (rank, token) with 16-byte stores: one row per (token, owner) crosses NVLink.
combine_partial_sum (on the source): waits, then a warp per token (per slice of it when tokens
are fewer than warps) adds the partials of the owners the token touched, in rank order, in
fp32. Deterministic; the bf16 partials round once more than the exact combine.

The FP8 wire back (params.fp8_combine, compile time): what crosses NVLink is e4m3 with one
float32 scale per row and ACTIVATION_GROUP columns (row_vectors.py, fp8_scaling's recipe),
token-major: combine_push quantizes each output row into returned [max_tokens x top_k, hidden]
bytes and BUFFER_RETURNED_SCALES, and combine_reduce dequantizes each k's value (e4m3 x scale,
rounded in fp32) before weight x value; combine_partial quantizes each fp32 partial sum (instead
of rounding it to bf16) into the source's e4m3 partials and BUFFER_PARTIAL_SCALES, and
combine_partial_sum adds the dequantized partials in rank order in fp32. Half the combine's
NVLink bytes, at the cost of e4m3's 3-bit mantissa on what crosses.

Row slices (ep_dispatch.row_slices): a warp that copies or sums a whole row issues its loads
round after round, each waiting for the last (a 7168-wide bf16 row: 7 rounds of 4 16-byte
vectors per lane in combine_push, 14 of 2 in the partial-sum kernels). With fewer rows than
warps (a small batch), each row is split into up to MAX_ROW_SLICES slices of whole rounds, one
warp each, so every warp has work and a row takes one or two rounds.

Every argument is a device address, a scalar or the dispatcher's EpParams (ep_sync.py); the
kernels find this rank's symmetric buffers (returned, partials, pair tables, row sources,
signals) in its peer table.

Layouts: expert_out [capacity, hidden] and returned [max_pairs, hidden] bf16 row-major, weights
float32 [tokens, top_k], y bf16 [tokens, hidden]; hidden a multiple of 8, rows 16-byte aligned.
"""

import cutlass
import cutlass.cute as cute

from .ep_dispatch import (
    copy_rounds,
    copy_row,
    row_slices,
    scales_of,
    slice_vectors,
    token_owners,
)
from .ep_sync import (
    BUFFER_PAIR_ROWS,
    BUFFER_PAIR_WEIGHTS,
    BUFFER_PARTIAL_SCALES,
    BUFFER_PARTIALS,
    BUFFER_RETURNED,
    BUFFER_RETURNED_SCALES,
    BUFFER_ROW_SOURCES,
    BUFFER_SIGNALS,
    PHASE_RETURNED,
    EpParams,
    global_ptr,
    own_address,
    peer_address,
    signal_peer,
    thread_position,
    wait_for_every_source,
)
from .row_vectors import (
    CHUNK,
    GROUP_VECTORS,
    load_chunk,
    load_e4m3,
    multiply_rounded,
    quantize_lane,
    quantize_to_rows,
    scale_groups,
    store_chunk,
    store_e4m3,
)

PUSH_WARPS = 16
REDUCE_WARPS = 8
# combine_partial_sum: its warps' loads are latency-bound (a few tokens each, the owners' rows
# one after another), so twice the exact reduce's warps keep twice the loads in flight
PARTIAL_SUM_WARPS = 16


@cute.kernel
def combine_push_kernel(
    expert_out_address: cutlass.Int64,
    expert_offsets_address: cutlass.Int64,
    params: EpParams,
    unroll: cutlass.Constexpr,
):
    peer_table_address, local_experts = params.peer_table_address, params.local_experts
    row_vectors, capacity, rank, world = (
        params.row_vectors,
        params.capacity,
        params.rank,
        params.world,
    )
    row_sources_address = own_address(params, BUFFER_ROW_SOURCES)
    tidx, bidx, grid, warp, lane = thread_position()
    peer_table = global_ptr(cutlass.Int64, peer_table_address, 8)
    offsets = global_ptr(cutlass.Int32, expert_offsets_address, 4)
    valid_rows = cute.arch.load(offsets + local_experts, cutlass.Int32)
    if valid_rows > capacity:
        valid_rows = capacity
    row_sources = global_ptr(cutlass.Int32, row_sources_address, 8)
    row_bytes = cutlass.Int64(row_vectors) * 16
    # a warp per slice of a row (fewer rows than warps: each split over several warps); warp w
    # of CTA b takes item w x grid + b: a few rows spread over every SM
    rounds = copy_rounds(row_vectors, unroll)
    slices = row_slices(valid_rows, rounds, grid * PUSH_WARPS)
    for item in range(warp * grid + bidx, valid_rows * slices, grid * PUSH_WARPS):
        row = item // slices
        first, end = slice_vectors(item - row * slices, slices, rounds, row_vectors, unroll)
        source = cute.arch.load(row_sources + row * 2, cutlass.Int32)
        pair = cute.arch.load(row_sources + (row * 2 + 1), cutlass.Int32)
        returned_base = peer_address(peer_table, BUFFER_RETURNED, world, source)
        if cutlass.const_expr(params.fp8_combine):
            # e4m3 with token-major scales: a slice of whole rounds covers whole groups
            quantize_to_rows(
                expert_out_address + cutlass.Int64(row) * row_bytes,
                returned_base,
                [pair],
                scales_of(peer_table, BUFFER_RETURNED_SCALES, world, source),
                1,
                scale_groups(row_vectors),
                row_vectors * CHUNK,
                first,
                end,
                lane,
                1,
            )
        else:
            copy_row(
                expert_out_address + cutlass.Int64(row) * row_bytes,
                returned_base + cutlass.Int64(pair) * row_bytes,
                first,
                end,
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
    params: EpParams,
    unroll: cutlass.Constexpr,
    stream,
):
    combine_push_kernel(expert_out_address, expert_offsets_address, params, unroll).launch(
        grid=[params.grid, 1, 1], block=[PUSH_WARPS * 32, 1, 1], stream=stream
    )


@cute.kernel
def combine_reduce_kernel(
    weights_address: cutlass.Int64,
    y_address: cutlass.Int64,
    tokens: cutlass.Int32,
    params: EpParams,
):
    returned_address = own_address(params, BUFFER_RETURNED)
    signals_address = own_address(params, BUFFER_SIGNALS)
    epoch_address, status_address = params.epoch_address, params.status_address
    hidden, world, timeout_ns = params.row_vectors * CHUNK, params.world, params.timeout_ns
    adds_per_epoch, top_k = params.grid, params.top_k  # every owner's CTAs add once each
    tidx, bidx, grid, warp, lane = thread_position()
    epoch = cute.arch.load(global_ptr(cutlass.Int64, epoch_address, 8), cutlass.Int64)
    wait_for_every_source(
        signals_address, status_address, world, PHASE_RETURNED, epoch, adds_per_epoch, timeout_ns
    )
    weights = global_ptr(cutlass.Float32, weights_address, 4)
    row_bytes = cutlass.Int64(hidden) * 2
    groups = scale_groups(params.row_vectors)
    returned_scales = global_ptr(cutlass.Float32, own_address(params, BUFFER_RETURNED_SCALES), 4)
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
            if cutlass.const_expr(params.fp8_combine):
                # e4m3 rows of hidden bytes, the chunk's group scale token-major
                scale = cute.arch.load(
                    returned_scales + (pair * groups + chunk // GROUP_VECTORS), cutlass.Float32
                )
                load_e4m3(contribution, returned_address + pair * hidden + chunk * CHUNK, scale)
            else:
                source = cute.make_tensor(
                    global_ptr(
                        cutlass.BFloat16, returned_address + pair * row_bytes + chunk_bytes, 16
                    ),
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
    weights_address: cutlass.Int64,
    y_address: cutlass.Int64,
    tokens: cutlass.Int32,
    params: EpParams,
    stream,
):
    combine_reduce_kernel(weights_address, y_address, tokens, params).launch(
        grid=[params.grid, 1, 1], block=[REDUCE_WARPS * 32, 1, 1], stream=stream
    )


@cute.jit
def add_weighted(total, contribution, values, weight):
    """total += weight x values (8 bf16 of a 16-byte vector) in fp32, each product rounded on
    its own (mul.rn)."""
    contribution.store(values.to(cutlass.Float32))
    for i in cutlass.range_constexpr(CHUNK):
        total[i] = total[i] + multiply_rounded(contribution[i], weight)


@cute.jit
def weighted_sum(
    total, contribution, values, rows, weights, unroll: cutlass.Constexpr, top_k: cutlass.Constexpr
):
    """total (8 x unroll fp32) = sum over k in k order of weights[k] x values[k x unroll + u]
    for the rows[k] here (not -1), in fp32 with each product rounded on its own."""
    total.fill(0.0)
    for k in cutlass.range_constexpr(top_k):
        if rows[k] >= 0:
            for u in cutlass.range_constexpr(unroll):
                add_weighted(
                    cute.make_tensor(total.iterator + u * CHUNK, cute.make_layout(CHUNK)),
                    contribution,
                    values[k * unroll + u],
                    weights[k],
                )


@cute.kernel
def combine_partial_kernel(
    expert_out_address: cutlass.Int64,
    expert_offsets_address: cutlass.Int64,
    params: EpParams,
    unroll: cutlass.Constexpr,
):
    row_sources_address = own_address(params, BUFFER_ROW_SOURCES)
    pair_rows_address = own_address(params, BUFFER_PAIR_ROWS)
    pair_weights_address = own_address(params, BUFFER_PAIR_WEIGHTS)
    peer_table_address, local_experts = params.peer_table_address, params.local_experts
    hidden, capacity, max_tokens = params.row_vectors * CHUNK, params.capacity, params.max_tokens
    rank, world, top_k = params.rank, params.world, params.top_k
    tidx, bidx, grid, warp, lane = thread_position()
    peer_table = global_ptr(cutlass.Int64, peer_table_address, 8)
    valid_rows = cute.arch.load(
        global_ptr(cutlass.Int32, expert_offsets_address, 4) + local_experts, cutlass.Int32
    )
    if valid_rows > capacity:
        valid_rows = capacity
    row_sources = global_ptr(cutlass.Int32, row_sources_address, 8)
    pair_rows = global_ptr(cutlass.Int32, pair_rows_address, 4)
    pair_weights = global_ptr(cutlass.Float32, pair_weights_address, 4)
    row_bytes = cutlass.Int64(hidden) * 2
    row_vectors = hidden // CHUNK
    total = cute.make_rmem_tensor(CHUNK * unroll, cutlass.Float32)
    contribution = cute.make_rmem_tensor(CHUNK, cutlass.Float32)
    # a warp per slice of a batch row; only the row of a token's lowest k here (its leader) has
    # work: it sums all of the token's rows here, so the work follows (source, token) entries.
    # Fewer leaders than warps (about valid_rows / (top_k / world) of them): each split over
    # several warps. Warp w of CTA b takes item b x PUSH_WARPS + w (spreading items over the SMs
    # instead, as the dispatch does, measured 12% slower here at 4096 tokens and no faster at 128)
    rounds = copy_rounds(row_vectors, unroll)
    rows_per_leader = top_k // world
    if rows_per_leader < 1:
        rows_per_leader = 1
    slices = row_slices(valid_rows // rows_per_leader, rounds, grid * PUSH_WARPS)
    for item in range(bidx * PUSH_WARPS + warp, valid_rows * slices, grid * PUSH_WARPS):
        row = item // slices
        first, end = slice_vectors(item - row * slices, slices, rounds, row_vectors, unroll)
        source = cute.arch.load(row_sources + row * 2, cutlass.Int32)
        pair = cute.arch.load(row_sources + (row * 2 + 1), cutlass.Int32)
        token = pair // top_k
        k_here = pair - token * top_k
        table = (source * max_tokens + token) * top_k
        lane_row = cutlass.Int32(-1)
        lane_weight = cutlass.Float32(0.0)
        if lane < top_k:
            lane_row = cute.arch.load(pair_rows + (table + lane), cutlass.Int32)
            lane_weight = cute.arch.load(pair_weights + (table + lane), cutlass.Float32)
            if lane_row >= capacity:
                lane_row = cutlass.Int32(-1)  # dropped past capacity: not in this batch
        earlier_here = cutlass.Int32(0)
        if lane < k_here:
            if lane_row >= 0:
                earlier_here = cutlass.Int32(1)
        if cute.arch.vote_ballot_sync(earlier_here == 1) == 0:
            rows = []
            weights = []
            for k in cutlass.range_constexpr(top_k):
                rows.append(cute.arch.shuffle_sync(lane_row, k))
                weights.append(cute.arch.shuffle_sync(lane_weight, k))
            # rows not here are read from this row's address (a cache hit) and never added
            addresses = []
            for k in cutlass.range_constexpr(top_k):
                safe_row = rows[k]
                if safe_row < 0:
                    safe_row = row
                addresses.append(expert_out_address + cutlass.Int64(safe_row) * row_bytes)
            partials = peer_address(peer_table, BUFFER_PARTIALS, world, source)
            slot = cutlass.Int64(rank) * max_tokens + token
            if cutlass.const_expr(params.fp8_combine):
                # the sum quantized (e4m3, token-major scales): every lane runs every trip, as
                # the group amax crosses lanes; a lane past the slice adds a clamped vector and
                # stores nothing
                partial_row = partials + slot * hidden
                partial_scales = scales_of(peer_table, BUFFER_PARTIAL_SCALES, world, source)
                partial_scales = partial_scales + slot * scale_groups(row_vectors)
                for base in range(first, end, 32 * unroll):
                    values = []  # every load of the group in flight before the first add
                    for k in cutlass.range_constexpr(top_k):
                        for u in cutlass.range_constexpr(unroll):
                            vector = cutlass.min(base + lane + 32 * u, end - 1)
                            values.append(load_chunk(addresses[k] + cutlass.Int64(vector) * 16))
                    weighted_sum(total, contribution, values, rows, weights, unroll, top_k)
                    for u in cutlass.range_constexpr(unroll):
                        vector = base + lane + 32 * u
                        counted = vector < end
                        quantized, scale = quantize_lane(
                            cute.make_tensor(total.iterator + u * CHUNK, cute.make_layout(CHUNK)),
                            counted,
                        )
                        if counted:
                            store_e4m3(partial_row + cutlass.Int64(vector) * CHUNK, quantized)
                            if vector % GROUP_VECTORS == 0:
                                cute.arch.store(partial_scales + vector // GROUP_VECTORS, scale)
            else:
                partial_row = partials + slot * row_bytes
                for vector in range(first + lane, end, 32 * unroll):
                    values = []  # every load of the group in flight before the first add
                    for k in cutlass.range_constexpr(top_k):
                        for u in cutlass.range_constexpr(unroll):
                            values.append(
                                load_chunk(addresses[k] + cutlass.Int64(vector + 32 * u) * 16)
                            )
                    weighted_sum(total, contribution, values, rows, weights, unroll, top_k)
                    for u in cutlass.range_constexpr(unroll):
                        store_chunk(
                            partial_row + cutlass.Int64(vector + 32 * u) * 16,
                            cute.make_tensor(total.iterator + u * CHUNK, cute.make_layout(CHUNK)),
                        )
    cute.arch.fence_acq_rel_sys()  # every writer releases its stores
    cute.arch.sync_threads()
    if tidx < world:
        signal_peer(peer_table, BUFFER_SIGNALS, world, tidx, PHASE_RETURNED, rank)


@cute.jit
def combine_partial(
    expert_out_address: cutlass.Int64,
    expert_offsets_address: cutlass.Int64,
    params: EpParams,
    unroll: cutlass.Constexpr,
    stream,
):
    combine_partial_kernel(expert_out_address, expert_offsets_address, params, unroll).launch(
        grid=[params.grid, 1, 1], block=[PUSH_WARPS * 32, 1, 1], stream=stream
    )


@cute.kernel
def combine_partial_sum_kernel(
    expert_of_pair_address: cutlass.Int64,
    y_address: cutlass.Int64,
    tokens: cutlass.Int32,
    params: EpParams,
    unroll: cutlass.Constexpr,
):
    partials_address = own_address(params, BUFFER_PARTIALS)
    signals_address = own_address(params, BUFFER_SIGNALS)
    epoch_address, status_address = params.epoch_address, params.status_address
    hidden, world, local_experts = params.row_vectors * CHUNK, params.world, params.local_experts
    max_tokens, timeout_ns, top_k = params.max_tokens, params.timeout_ns, params.top_k
    adds_per_epoch = params.grid  # every owner's CTAs add once each
    tidx, bidx, grid, warp, lane = thread_position()
    epoch = cute.arch.load(global_ptr(cutlass.Int64, epoch_address, 8), cutlass.Int64)
    wait_for_every_source(
        signals_address, status_address, world, PHASE_RETURNED, epoch, adds_per_epoch, timeout_ns
    )
    expert_of_pair = global_ptr(cutlass.Int32, expert_of_pair_address, 4)
    row_bytes = cutlass.Int64(hidden) * 2
    row_vectors = hidden // CHUNK
    groups = scale_groups(row_vectors)
    partial_scales = global_ptr(cutlass.Float32, own_address(params, BUFFER_PARTIAL_SCALES), 4)
    total = cute.make_rmem_tensor(CHUNK * unroll, cutlass.Float32)
    contribution = cute.make_rmem_tensor(CHUNK, cutlass.Float32)
    # a warp per slice of a token (fewer tokens than warps: each split over several warps): the
    # owners it touched (a bit mask), then per group of 16-byte vectors the owners' partials
    # added in rank order in fp32 (items in block-contiguous runs; fewer items than warps are
    # spread over every SM)
    rounds = copy_rounds(row_vectors, unroll)
    slices = row_slices(tokens, rounds, grid * PARTIAL_SUM_WARPS)
    items = tokens * slices
    first_item = bidx * PARTIAL_SUM_WARPS + warp
    if items < grid * PARTIAL_SUM_WARPS:
        first_item = warp * grid + bidx
    for item in range(first_item, items, grid * PARTIAL_SUM_WARPS):
        token = item // slices
        first, end = slice_vectors(item - token * slices, slices, rounds, row_vectors, unroll)
        owner_mask = token_owners(expert_of_pair, token, local_experts, lane, top_k)
        y_row = y_address + cutlass.Int64(token) * row_bytes
        for vector in range(first + lane, end, 32 * unroll):
            total.fill(0.0)
            for owner in range(world):  # owners in rank order: a fixed summation order
                if (owner_mask >> owner) & 1 == 1:
                    slot = cutlass.Int64(owner) * max_tokens + token
                    if cutlass.const_expr(params.fp8_combine):
                        # e4m3 partials with token-major scales, dequantized in fp32
                        for u in cutlass.range_constexpr(unroll):
                            scale = cute.arch.load(
                                partial_scales
                                + (slot * groups + (vector + 32 * u) // GROUP_VECTORS),
                                cutlass.Float32,
                            )
                            load_e4m3(
                                contribution,
                                partials_address
                                + slot * hidden
                                + cutlass.Int64(vector + 32 * u) * CHUNK,
                                scale,
                            )
                            for i in cutlass.range_constexpr(CHUNK):
                                total[u * CHUNK + i] = total[u * CHUNK + i] + contribution[i]
                    else:
                        partial_row = partials_address + slot * row_bytes
                        values = []
                        for u in cutlass.range_constexpr(unroll):
                            values.append(
                                load_chunk(partial_row + cutlass.Int64(vector + 32 * u) * 16)
                            )
                        for u in cutlass.range_constexpr(unroll):
                            contribution.store(values[u].to(cutlass.Float32))
                            for i in cutlass.range_constexpr(CHUNK):
                                total[u * CHUNK + i] = total[u * CHUNK + i] + contribution[i]
            for u in cutlass.range_constexpr(unroll):
                store_chunk(
                    y_row + cutlass.Int64(vector + 32 * u) * 16,
                    cute.make_tensor(total.iterator + u * CHUNK, cute.make_layout(CHUNK)),
                )


@cute.jit
def combine_partial_sum(
    expert_of_pair_address: cutlass.Int64,
    y_address: cutlass.Int64,
    tokens: cutlass.Int32,
    params: EpParams,
    unroll: cutlass.Constexpr,
    stream,
):
    combine_partial_sum_kernel(expert_of_pair_address, y_address, tokens, params, unroll).launch(
        grid=[params.grid, 1, 1], block=[PARTIAL_SUM_WARPS * 32, 1, 1], stream=stream
    )
