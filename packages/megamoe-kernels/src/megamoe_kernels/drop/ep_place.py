"""Expert-parallel dispatch, step 1 (sm_90a): exchange the per-expert counts and place every
(token, expert) pair in its owner's batch.

Every argument is a device address, a scalar or the dispatcher's EpParams (ep_sync.py): no
tensor conversion per call. Experts are
owned in contiguous blocks: expert e lives on rank e // local_experts.

exchange_and_place (a grid of up to PLACE_MAX_CTAS CTAs of PLACE_WARPS warps, one warp per
group of 32 pairs and at least one per expert, so ranking and the scan are spread over the GPU
instead of one CTA walking every pair):
1. each warp ranks the pairs of its contiguous slice inside their experts, in pair order (one
   `match.any` per 32 pairs, per-warp counters in shared memory): stable;
2. each CTA turns its warps' counts into per-warp prefixes (shared memory) and writes its count
   per expert into the scratch [E, PLACE_MAX_CTAS];
3. grid-wide barrier; then a warp per expert scans the CTAs' counts (each CTA's exclusive
   prefix, in place) and writes the expert's total into row `rank` of every peer's counts
   (int32 [world, E]);
4. the last CTA to finish its experts signals PHASE_COUNTS on every peer, this rank included:
   so every CTA's wait for every source's counts is also the second grid-wide barrier;
5. every CTA computes, from every rank's counts, where each expert's rows from this rank start
   in its owner's batch (expert-major, then source rank, then the source's pair order: the
   single-GPU order) and writes dest_row = that start + the CTA's prefix + the warp's prefix +
   the pair's rank in its warp; CTA 0 writes this rank's expert_offsets (int32
   [local_experts + 1], clamped to capacity) and each source's pair count of this epoch (in the
   scratch at `pairs_of_source_offset`, for dispatch_tokens).

The grid (ceil(pairs / 32 / PLACE_WARPS), at least ceil(E / PLACE_WARPS), at most
PLACE_MAX_CTAS) is small enough to be resident at once on any Hopper GPU, which the grid-wide
barrier needs; its wait has the timeout too.
Scratch (int32, zeroed once when allocated): [E, PLACE_MAX_CTAS] CTA counts, PLACE_BARRIER_WORDS
barrier words (never reset by the host: they return to their start state), [world] pairs per
source. At most PLACE_MAX_EXPERTS experts (shared-memory counters).

Layouts: expert_of_pair, dest_row int32 [tokens x top_k] in (token, k) order.
"""

import cutlass
import cutlass.cute as cute
from cutlass.memory import SmemAllocator

from .ep_sync import (
    BUFFER_COUNTS,
    BUFFER_SIGNALS,
    PHASE_COUNTS,
    EpParams,
    global_ptr,
    peer_address,
    record_timeout,
    signal_peer,
    thread_position,
    wait_for_every_source,
)
from .warp import lanes_with_same_value, warp_inclusive_sum

PLACE_WARPS = 8
PLACE_THREADS = PLACE_WARPS * 32
PLACE_MAX_CTAS = 128
PLACE_MAX_EXPERTS = 1024
PLACE_BARRIER_WORDS = 4  # grid barrier arrivals, its generation, count-exchange arrivals, pad


def pairs_of_source_offset(num_experts: int) -> int:
    """int32 word of the scratch where the per-source pair counts start."""
    return PLACE_MAX_CTAS * num_experts + PLACE_BARRIER_WORDS


def scratch_words(num_experts: int, world: int) -> int:
    """int32 words of scratch exchange_and_place needs."""
    return pairs_of_source_offset(num_experts) + world


@cute.jit
def grid_barrier(arrivals, generation, grid, status_address, rank, epoch, timeout_ns):
    """Every CTA of the grid meets here (all must be resident). Thread 0 releases its CTA's
    writes, arrives, and the last CTA to arrive resets the count and bumps the generation the
    others spin on; the count returns to 0, so the next launch starts from the same state."""
    tidx, _, _ = cute.arch.thread_idx()
    cute.arch.sync_threads()
    if tidx == 0:
        cute.arch.fence_acq_rel_gpu()
        # read before arriving: it cannot move on until this CTA has arrived
        seen = cute.arch.load(generation, cutlass.Int32, sem="acquire", scope="gpu")
        arrived = cute.arch.atomic_add(arrivals, cutlass.Int32(1), sem="acq_rel", scope="gpu")
        if arrived == grid - 1:
            cute.arch.store(arrivals, cutlass.Int32(0))
            cute.arch.store(generation, seen + 1, sem="release", scope="gpu")
        else:
            start = cute.arch.globaltimer()
            waiting = cutlass.Int32(1)
            while waiting == 1:
                now = cute.arch.load(generation, cutlass.Int32, sem="acquire", scope="gpu")
                if now != seen:
                    waiting = cutlass.Int32(0)
                elif cute.arch.globaltimer() - start > timeout_ns:
                    record_timeout(status_address, PHASE_COUNTS, rank, epoch, cutlass.Int64(now))
                    waiting = cutlass.Int32(0)
        cute.arch.fence_acq_rel_gpu()
    cute.arch.sync_threads()


@cute.jit
def scan_cta_counts(counts, grid, lane):
    """A warp turns the `grid` CTAs' counts at `counts` (int32, written by other CTAs before a
    grid barrier) into each CTA's exclusive prefix, in place, and returns their total."""
    carry = cutlass.Int32(0)
    for first in range(0, grid, 32):
        cta = first + lane
        count = cutlass.Int32(0)
        if cta < grid:
            count = cute.arch.load(counts + cta, cutlass.Int32, cop="cg")  # other CTAs wrote it
        inclusive = warp_inclusive_sum(count, lane)
        if cta < grid:
            cute.arch.store(counts + cta, carry + inclusive - count)
        carry = carry + cute.arch.shuffle_sync(inclusive, 31)
    return carry


@cute.kernel
def exchange_and_place_kernel(
    expert_of_pair_address: cutlass.Int64,
    dest_row_address: cutlass.Int64,
    expert_offsets_address: cutlass.Int64,
    num_pairs: cutlass.Int32,
    params: EpParams,
):
    scratch_address = params.placement_scratch_address
    peer_table_address, epoch_address = params.peer_table_address, params.epoch_address
    status_address, timeout_ns = params.status_address, params.timeout_ns
    rank, world, capacity = params.rank, params.world, params.capacity
    num_experts, local_experts = params.num_experts, params.local_experts
    tidx, bidx, grid, warp, lane = thread_position()
    smem = SmemAllocator()
    # per-warp counters, then prefixes, per expert; each expert's total and first row
    warp_counts = smem.allocate_tensor(
        cutlass.Int32, cute.make_layout(PLACE_WARPS * PLACE_MAX_EXPERTS), 16
    )
    expert_rows = smem.allocate_tensor(cutlass.Int32, cute.make_layout(PLACE_MAX_EXPERTS), 16)
    first_row = smem.allocate_tensor(cutlass.Int32, cute.make_layout(PLACE_MAX_EXPERTS), 16)
    last_flag = smem.allocate_tensor(cutlass.Int32, cute.make_layout(1), 4)

    peer_table = global_ptr(cutlass.Int64, peer_table_address, 8)
    epoch_ptr = global_ptr(cutlass.Int64, epoch_address, 8)
    epoch = cute.arch.load(epoch_ptr, cutlass.Int64) + 1
    expert_of_pair = global_ptr(cutlass.Int32, expert_of_pair_address, 4)
    dest_row = global_ptr(cutlass.Int32, dest_row_address, 4)
    cta_counts = global_ptr(cutlass.Int32, scratch_address, 4)  # [E, PLACE_MAX_CTAS]
    barrier = cta_counts + PLACE_MAX_CTAS * num_experts
    pairs_of_source = barrier + PLACE_BARRIER_WORDS
    own_signals = peer_address(peer_table, BUFFER_SIGNALS, world, rank)
    gathered = global_ptr(cutlass.Int32, peer_address(peer_table, BUFFER_COUNTS, world, rank), 4)

    # this warp's contiguous groups of 32 pairs (CTA b: groups [b x per_cta, ...))
    groups = (num_pairs + 31) // 32
    per_cta = (groups + grid - 1) // grid
    per_warp = (per_cta + PLACE_WARPS - 1) // PLACE_WARPS
    cta_end = (bidx + 1) * per_cta
    if cta_end > groups:
        cta_end = groups
    warp_begin = bidx * per_cta + warp * per_warp
    warp_end = warp_begin + per_warp
    if warp_end > cta_end:
        warp_end = cta_end

    # 1. each pair's rank inside its expert among the warp's pairs (equal experts ranked by lane)
    for i in range(tidx, PLACE_WARPS * num_experts, PLACE_THREADS):
        warp_counts[i] = cutlass.Int32(0)
    cute.arch.sync_threads()
    for group in range(warp_begin, warp_end):
        pair = group * 32 + lane
        expert = cutlass.Int32(-1) - lane  # no match for lanes past the end
        if pair < num_pairs:
            expert = cute.arch.load(expert_of_pair + pair, cutlass.Int32)
        same = lanes_with_same_value(expert)
        before = cute.arch.popc(same & ((cutlass.Int32(1) << lane) - 1))
        base = cutlass.Int32(0)
        if pair < num_pairs:
            base = warp_counts[warp * num_experts + expert]
            cute.arch.store(dest_row + pair, base + before)  # finished in step 5
        cute.arch.sync_warp()
        if pair < num_pairs:
            if cute.arch.popc(same) == before + 1:  # the highest lane of its expert carries on
                warp_counts[warp * num_experts + expert] = base + before + 1
        cute.arch.sync_warp()
    cute.arch.sync_threads()

    # 2. per expert: each warp's exclusive prefix inside the CTA, the CTA's count to the scratch
    for expert in range(tidx, num_experts, PLACE_THREADS):
        counts = []
        for w in cutlass.range_constexpr(PLACE_WARPS):
            counts.append(warp_counts[w * num_experts + expert])
        running = cutlass.Int32(0)
        for w in cutlass.range_constexpr(PLACE_WARPS):
            warp_counts[w * num_experts + expert] = running
            running = running + counts[w]
        cute.arch.store(cta_counts + (expert * PLACE_MAX_CTAS + bidx), running)
    grid_barrier(barrier, barrier + 1, grid, status_address, rank, epoch, timeout_ns)

    # 3. a warp per expert: each CTA's exclusive prefix (in place) and the total, which goes
    #    into row `rank` of every peer's counts
    for expert in range(bidx * PLACE_WARPS + warp, num_experts, grid * PLACE_WARPS):
        carry = scan_cta_counts(cta_counts + expert * PLACE_MAX_CTAS, grid, lane)
        if lane < world:
            counts = global_ptr(
                cutlass.Int32, peer_address(peer_table, BUFFER_COUNTS, world, lane), 4
            )
            cute.arch.store(counts + (rank * num_experts + expert), carry)

    # 4. the last CTA done signals every peer (this rank too: so the wait below is also the
    #    barrier after the scan); every writer released its stores at system scope first
    cute.arch.fence_acq_rel_sys()
    cute.arch.sync_threads()
    if tidx == 0:
        last_flag[0] = cutlass.Int32(0)
        arrived = cute.arch.atomic_add(barrier + 2, cutlass.Int32(1), sem="acq_rel", scope="gpu")
        if arrived == grid - 1:
            cute.arch.store(barrier + 2, cutlass.Int32(0))
            last_flag[0] = cutlass.Int32(1)
    cute.arch.sync_threads()
    if last_flag[0] == 1:
        if tidx < world:
            signal_peer(peer_table, BUFFER_SIGNALS, world, tidx, PHASE_COUNTS, rank)

    wait_for_every_source(own_signals, status_address, world, PHASE_COUNTS, epoch, 1, timeout_ns)

    # 5. from every rank's counts: rows of each expert in all, and from sources before `rank`;
    #    then a warp per owner scans its experts' rows into each expert's first row from `rank`
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
        expert_rows[expert] = total
        first_row[expert] = earlier
    cute.arch.sync_threads()
    offsets = global_ptr(cutlass.Int32, expert_offsets_address, 4)
    if bidx == 0:
        if tidx == 0:
            cute.arch.store(offsets, cutlass.Int32(0))
        # pairs from each source this epoch (its tokens x top_k): the staged dispatch's
        # receivers walk that many of each source's token slots
        for source in range(warp, world, PLACE_WARPS):
            pairs = cutlass.Int32(0)
            for expert in range(lane, num_experts, 32):
                pairs = pairs + cute.arch.load(
                    gathered + (source * num_experts + expert), cutlass.Int32, cop="cg"
                )
            pairs = warp_inclusive_sum(pairs, lane)
            if lane == 31:
                cute.arch.store(pairs_of_source + source, pairs)
    for owner in range(warp, world, PLACE_WARPS):
        carry = cutlass.Int32(0)
        for group in range(0, local_experts, 32):
            local = group + lane
            expert = owner * local_experts + local
            rows = cutlass.Int32(0)
            if local < local_experts:
                rows = expert_rows[expert]
            inclusive = warp_inclusive_sum(rows, lane)
            if local < local_experts:
                first_row[expert] = first_row[expert] + carry + inclusive - rows
                if owner == rank:
                    if bidx == 0:
                        end_row = carry + inclusive
                        if end_row > capacity:
                            end_row = capacity
                        cute.arch.store(offsets + (local + 1), end_row)
            carry = carry + cute.arch.shuffle_sync(inclusive, 31)
    cute.arch.sync_threads()

    # 6. destination row = the expert's first row from this rank + the CTA's prefix + the
    #    warp's prefix + the pair's rank in its warp (same thread as step 1: its own store)
    for group in range(warp_begin, warp_end):
        pair = group * 32 + lane
        if pair < num_pairs:
            expert = cute.arch.load(expert_of_pair + pair, cutlass.Int32)
            in_warp = cute.arch.load(dest_row + pair, cutlass.Int32)
            cta_prefix = cute.arch.load(
                cta_counts + (expert * PLACE_MAX_CTAS + bidx), cutlass.Int32, cop="cg"
            )
            row = first_row[expert] + cta_prefix + warp_counts[warp * num_experts + expert]
            cute.arch.store(dest_row + pair, row + in_warp)
    if bidx == 0:
        if tidx == 0:
            # every CTA read the old epoch before the signal this CTA waited for
            cute.arch.store(epoch_ptr, epoch)


@cute.jit
def exchange_and_place(
    expert_of_pair_address: cutlass.Int64,
    dest_row_address: cutlass.Int64,
    expert_offsets_address: cutlass.Int64,
    num_pairs: cutlass.Int32,
    params: EpParams,
    stream,
):
    # a warp per group of 32 pairs, as many CTAs as that fills; at least a warp per expert, so
    # the scan of step 3 takes one expert per warp, not several one after another
    grid = (num_pairs + PLACE_THREADS - 1) // PLACE_THREADS
    expert_ctas = (params.num_experts + PLACE_WARPS - 1) // PLACE_WARPS
    if grid < expert_ctas:
        grid = expert_ctas
    if grid > PLACE_MAX_CTAS:
        grid = PLACE_MAX_CTAS
    if grid < 1:
        grid = 1
    exchange_and_place_kernel(
        expert_of_pair_address, dest_row_address, expert_offsets_address, num_pairs, params
    ).launch(grid=[grid, 1, 1], block=[PLACE_THREADS, 1, 1], stream=stream)
