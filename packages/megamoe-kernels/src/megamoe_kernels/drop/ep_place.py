"""Expert-parallel dispatch, step 1 (sm_90a): exchange the per-expert counts and place every
(token, expert) pair in its owner's batch.

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

It also leaves each source's pair count of this epoch in the scratch (after the first rows), for
dispatch_tokens.

Layouts: expert_of_pair, dest_row int32 [tokens x top_k] in (token, k) order.
"""

import cutlass
import cutlass.cute as cute

from .ep_sync import (
    BUFFER_COUNTS,
    BUFFER_SIGNALS,
    PHASE_COUNTS,
    global_ptr,
    peer_address,
    signal_peer,
    wait_for_every_source,
)
from .warp import lanes_with_same_value, warp_inclusive_sum

PLACE_WARPS = 32
PLACE_THREADS = PLACE_WARPS * 32
PLACE_BATCH = 4


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
    # scratch: [PLACE_WARPS, E] per-warp counts, then [E] first rows, then [world] pairs per source
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
        # every warp's count loaded before the first store: one L2 round trip, not PLACE_WARPS
        warp_counts = []
        for w in cutlass.range_constexpr(PLACE_WARPS):
            slot = histogram + (w * num_experts + expert)
            warp_counts.append(cute.arch.load(slot, cutlass.Int32, cop="cg"))  # L2: the atomics
        running = cutlass.Int32(0)
        for w in cutlass.range_constexpr(PLACE_WARPS):
            cute.arch.store(histogram + (w * num_experts + expert), running)
            running = running + warp_counts[w]
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
        # lanes holding the same expert (one match instruction): their count below this lane
        # ranks it; the highest of them carries the count on
        same = lanes_with_same_value(expert)
        before = cute.arch.popc(same & ((cutlass.Int32(1) << lane) - 1))
        last = cutlass.Int32(0)
        if cute.arch.popc(same) == before + 1:
            last = cutlass.Int32(1)
        base = cutlass.Int32(0)
        if pair < end:
            base = cute.arch.load(histogram + (warp * num_experts + expert), cutlass.Int32)
            cute.arch.store(dest_row + pair, base + before)
        cute.arch.sync_warp()
        if pair < end:
            if last == 1:
                cute.arch.store(histogram + (warp * num_experts + expert), base + before + 1)
        cute.arch.sync_warp()

    wait_for_every_source(own_signals, status_address, world, PHASE_COUNTS, epoch, 1, timeout_ns)

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
    # pairs from each source this epoch (its tokens x top_k): the staged dispatch's receivers
    # walk that many of each source's token slots
    pairs_of_source = first_row + num_experts
    for source in range(warp, world, PLACE_WARPS):
        pairs = cutlass.Int32(0)
        for expert in range(lane, num_experts, 32):
            pairs = pairs + cute.arch.load(
                gathered + (source * num_experts + expert), cutlass.Int32, cop="cg"
            )
        pairs = warp_inclusive_sum(pairs, lane)
        if lane == 31:
            cute.arch.store(pairs_of_source + source, pairs)
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
    #    (PLACE_BATCH pairs per thread and step, every load issued before the stores)
    last_pair = num_pairs - 1
    for group in range(tidx, num_pairs, PLACE_THREADS * PLACE_BATCH):
        pairs = []
        for j in cutlass.range_constexpr(PLACE_BATCH):
            pair = group + j * PLACE_THREADS
            if pair > last_pair:
                pair = last_pair  # past the end: loads of the last pair, never stored
            pairs.append(pair)
        experts = [cute.arch.load(expert_of_pair + pair, cutlass.Int32) for pair in pairs]
        positions = [cute.arch.load(dest_row + pair, cutlass.Int32) for pair in pairs]
        starts = [cute.arch.load(first_row + expert, cutlass.Int32) for expert in experts]
        for j in cutlass.range_constexpr(PLACE_BATCH):
            if group + j * PLACE_THREADS < num_pairs:
                cute.arch.store(dest_row + pairs[j], positions[j] + starts[j])
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
