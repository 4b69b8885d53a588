"""Expert-parallel dispatch of a small batch in one kernel (sm_90a): each source sends its expert
ids and its token rows at once, and every owner places its own rows from every source's ids.

The two-kernel dispatch (ep_place.py, then ep_dispatch.dispatch_tokens) moves no row before the
per-expert counts have crossed NVLink and been scanned on every rank; at 128 tokens per rank
that placement takes ~11 us, and the rows' transfer (~12 us) only starts after it. Here the rows
go out as soon as the ids are on their way, and each owner ranks every source's pairs for its
own experts itself, in shared memory, while the rows cross.

dispatch_small (one CTA per SM, SMALL_WARPS warps; every argument a device address, a scalar or
the dispatcher's EpParams):
1. CTA 0 loads this rank's expert ids (every load of a thread in flight at once) and writes
   them, with the pair count, into row `rank` of this epoch's half of every rank's ids buffer
   (this rank's too), each word tagged with the epoch (`ids_tag`): the tag tells the owner that
   the word arrived, so there is no fence and no signal to wait for on the ids' path. It adds 1
   to PHASE_COUNTS on every rank (the two-kernel dispatch's count signal: the counters stay in
   step), sets the local "ids sent" word to the epoch, and adds `grid` to every rank's
   PHASE_ROWS once, as the two-kernel dispatch's CTAs do one each.
2. The first SMALL_SEND_WARPS warps of CTAs 1.. wait for that word (so the ids cross NVLink ahead of
   the rows), then a warp per token of this rank copies its row into its staged row (rank,
   token) on each other owner (with `pair_weights`, the token's routing weights into each
   owner's pair-weights table, this rank's too), fences, and releases arrived[rank, token] there
   to 2 x epoch + (1 if the token has rows on that rank), as dispatch_tokens does.
3. CTA 0 reads every source's ids as their tags show them arriving, clearing each word it read,
   and copies them into shared memory (each source's pairs padded to whole groups of 32), then
   places this rank's rows: the groups in (source, pair)
   order, contiguous per warp (so warp order is pair order); each pair of a local expert is
   ranked among its warp's pairs of that expert (`match.any`, per-warp counters); per expert the
   warps' exclusive prefixes and the expert's first row (expert-major, then source, then pair
   order: the single-GPU order) give each pair's row. It writes the pair table [source, token,
   k] (the row here or -1), the batch rows' (source, pair) and expert_offsets (clamped to
   capacity), fences and sets the local "placed" word to the epoch; once every CTA has read the
   old epoch (each counts itself in once all its threads have read it) it stores the new one.
4. The other warps (and CTA 0's, once it has placed) wait for "placed", then a warp per (source,
   token, row slice) copies the token's row (from x for this rank's tokens, from the staged
   rows once its flag arrived for the others') into each of its batch rows here.

The FP8 wire (params.fp8_rows): step 2 quantizes each token once into the e4m3 staged rows and
their scales (ep_dispatch.send_quantized_token), and step 4 quantizes this rank's tokens from x
and copies the other sources' e4m3 staged rows and scales into the batch (a slice of whole
rounds of e4m3 vectors holds whole quantization groups).

One CTA ranks every source's pairs: at most SMALL_MAX_PAIRS (world x max_tokens x top_k, the
shared-memory copy of the ids) and SMALL_MAX_LOCAL_EXPERTS experts per rank (the counters); at
most 32 ranks (a lane per rank).

Scratch (int32, zeroed once): SMALL_SCRATCH_WORDS words: the epoch whose ids are sent, the epoch
whose rows are placed, the CTAs started (back to 0 after each launch), a pad word.
Ids buffer (symmetric, int32 [IDS_HALVES x world, ids_words]): a half per epoch parity, so that
a source's next ids land where no owner can still be reading (the combine between two dispatches
orders them as well; the ids path does not rely on it), a row per source: its tagged pair count
(IDS_COUNT), the count as placed (IDS_COUNT_READ, for the expanders), then from word IDS_FIRST
its tagged expert ids in pair order. A tagged word is the tag (`ids_tag`: a set top bit and the
epoch's low 15 bits) over a 16-bit value; the owner clears every word it reads, so a word left
from an epoch 32768 back never passes for this one's. 32-bit words: a 64-bit tagged variant hit
"Warp Illegal Address" on its reads of words a peer had written, a fault never explained.
"""

import cutlass
import cutlass.cute as cute
from cutlass.memory import SmemAllocator

from .ep_dispatch import (
    copy_rounds,
    copy_to_rows,
    load_vectors,
    release_token_flags,
    row_slices,
    scales_of,
    send_quantized_token,
    slice_vectors,
    store_vectors,
    token_owners,
)
from .ep_sync import (
    BUFFER_ARRIVED,
    BUFFER_IDS,
    BUFFER_PAIR_ROWS,
    BUFFER_PAIR_WEIGHTS,
    BUFFER_ROW_SCALES,
    BUFFER_ROW_SOURCES,
    BUFFER_ROWS,
    BUFFER_SIGNALS,
    BUFFER_STAGED,
    BUFFER_STAGED_SCALES,
    PHASE_COUNTS,
    PHASE_ROWS,
    EpParams,
    count_on_peer,
    global_ptr,
    peer_address,
    record_timeout,
    thread_position,
    wait_flag,
)
from .row_vectors import CHUNK, copy_scales, quantize_to_rows, scale_groups
from .warp import lanes_with_same_value, warp_inclusive_sum

SMALL_WARPS = 16
SMALL_THREADS = SMALL_WARPS * 32
SMALL_SEND_WARPS = 8  # of each CTA after the first: the rest expand
SMALL_MAX_LOCAL_EXPERTS = 512
SMALL_MAX_PAIRS = 8192  # world x max_tokens x top_k, at most
SMALL_MAX_RANKS = 32
# shared-memory slots for every source's pairs, each source's padded to whole groups of 32
SMALL_PAIR_SLOTS = SMALL_MAX_PAIRS + 32 * SMALL_MAX_RANKS
SMALL_SCRATCH_WORDS = 4
IDS_SENT, PLACED, STARTED = 0, 1, 2  # scratch words
IDS_FIRST = 4  # word of a source's ids row where its ids start
IDS_COUNT = 0  # word of a source's row: its tagged pair count, as the source sent it
IDS_COUNT_READ = 1  # word of a source's row: its pair count as placed, for the expanders
IDS_HALVES = 2  # the ids buffer's halves, by epoch parity
IDS_VALUE_BITS = 16  # of a tagged word: the value (an expert id, a pair count) below the tag
IDS_TAG_EPOCH_BITS = 15  # of a tag: the epoch's low bits (its top bit marks a written word)


# an expert id (below SMALL_MAX_RANKS x SMALL_MAX_LOCAL_EXPERTS) and a pair count (at most
# SMALL_MAX_PAIRS) fit a tagged word's value
assert SMALL_MAX_RANKS * SMALL_MAX_LOCAL_EXPERTS <= 1 << IDS_VALUE_BITS
assert SMALL_MAX_PAIRS < 1 << IDS_VALUE_BITS


def ids_words(max_tokens: int, top_k: int) -> int:
    """int32 words of one source's row of the ids buffer: its tagged pair count, the count as
    placed, two pad words, then its tagged ids."""
    return IDS_FIRST + max_tokens * top_k


def ids_rows(world: int) -> int:
    """Rows of the ids buffer: one per source in each half."""
    return IDS_HALVES * world


@cute.jit
def ids_tag(epoch):
    """The high half of every ids word sent in `epoch`: the top bit set (a cleared word, 0,
    never matches) and the epoch's low IDS_TAG_EPOCH_BITS bits; as a signed int32, so that
    `word >> IDS_VALUE_BITS` of a tagged word equals it."""
    return cutlass.Int32(epoch & ((1 << IDS_TAG_EPOCH_BITS) - 1)) - (1 << IDS_TAG_EPOCH_BITS)


@cute.jit
def tagged_value(word_ptr, epoch, status_address, source, timeout_ns):
    """The value of the int32 ids word at `word_ptr` once it carries the epoch's tag (relaxed
    system-scope loads; on timeout the source is recorded and 0 returned)."""
    tag = ids_tag(epoch)
    start = cute.arch.globaltimer()
    word = cute.arch.load(word_ptr, cutlass.Int32, sem="relaxed", scope="sys")
    while word >> IDS_VALUE_BITS != tag:
        if cute.arch.globaltimer() - start > timeout_ns:
            record_timeout(status_address, PHASE_COUNTS, source, epoch, cutlass.Int64(word))
            word = tag << IDS_VALUE_BITS
        else:
            word = cute.arch.load(word_ptr, cutlass.Int32, sem="relaxed", scope="sys")
    return word & ((1 << IDS_VALUE_BITS) - 1)


@cute.jit
def wait_local(word, value, epoch, status_address, rank, lane, timeout_ns):
    """Lane 0 spins until the int32 scratch `word` holds `value` (gpu-scope acquire), with the
    timeout (recorded for this epoch); then the warp meets."""
    if lane == 0:
        start = cute.arch.globaltimer()
        waiting = cutlass.Int32(1)
        while waiting == 1:
            seen = cute.arch.load(word, cutlass.Int32, sem="acquire", scope="gpu")
            if seen == value:
                waiting = cutlass.Int32(0)
            elif cute.arch.globaltimer() - start > timeout_ns:
                record_timeout(status_address, PHASE_COUNTS, rank, epoch, cutlass.Int64(seen))
                waiting = cutlass.Int32(0)
    cute.arch.sync_warp()


@cute.kernel
def dispatch_small_kernel(
    x_address: cutlass.Int64,
    expert_of_pair_address: cutlass.Int64,
    weights_address: cutlass.Int64,
    expert_offsets_address: cutlass.Int64,
    tokens: cutlass.Int32,
    params: EpParams,
    unroll: cutlass.Constexpr,
):
    scratch_address = params.small_scratch_address
    peer_table_address, epoch_address = params.peer_table_address, params.epoch_address
    status_address, timeout_ns = params.status_address, params.timeout_ns
    local_experts, row_vectors, capacity = params.local_experts, params.row_vectors, params.capacity
    rank, world, max_tokens = params.rank, params.world, params.max_tokens
    pair_weights, top_k = params.pair_weights, params.top_k
    tidx, bidx, grid, warp, lane = thread_position()
    smem = SmemAllocator()
    # every source's pairs (their local expert, then packed with their rank in their warp), each
    # source's pair count and first group, per-warp counters then prefixes, each expert's first
    # row
    pair_slots = smem.allocate_tensor(cutlass.Int32, cute.make_layout(SMALL_PAIR_SLOTS), 16)
    source_pairs = smem.allocate_tensor(cutlass.Int32, cute.make_layout(SMALL_MAX_RANKS), 16)
    source_groups = smem.allocate_tensor(cutlass.Int32, cute.make_layout(SMALL_MAX_RANKS + 1), 16)
    warp_counts = smem.allocate_tensor(
        cutlass.Int32, cute.make_layout(SMALL_WARPS * SMALL_MAX_LOCAL_EXPERTS), 16
    )
    first_row = smem.allocate_tensor(cutlass.Int32, cute.make_layout(SMALL_MAX_LOCAL_EXPERTS), 16)

    peer_table = global_ptr(cutlass.Int64, peer_table_address, 8)
    epoch_ptr = global_ptr(cutlass.Int64, epoch_address, 8)
    epoch = cute.arch.load(epoch_ptr, cutlass.Int64) + 1
    scratch = global_ptr(cutlass.Int32, scratch_address, 4)
    # every thread of this CTA has read the old epoch (not thread 0 alone: a warp scheduled late
    # could otherwise read the new one) before it counts itself in; CTA 0 stores the new epoch
    # once every CTA has
    cute.arch.sync_threads()
    if tidx == 0:
        cute.arch.atomic_add(scratch + STARTED, cutlass.Int32(1), sem="release", scope="gpu")
    expert_of_pair = global_ptr(cutlass.Int32, expert_of_pair_address, 4)
    weights = global_ptr(cutlass.Float32, weights_address, 4)
    row_bytes = cutlass.Int64(row_vectors) * 16
    ids_row = IDS_FIRST + max_tokens * top_k
    # this epoch's half of the ids here (a source's next ids go to the other half)
    ids_here = global_ptr(cutlass.Int32, peer_address(peer_table, BUFFER_IDS, world, rank), 4)
    ids_here = ids_here + (epoch % IDS_HALVES) * world * ids_row
    pair_rows = global_ptr(
        cutlass.Int32, peer_address(peer_table, BUFFER_PAIR_ROWS, world, rank), 4
    )

    if bidx == 0:
        send_ids(expert_of_pair, peer_table, scratch, epoch, tokens * top_k, rank, world, ids_row)
        # the two-kernel dispatch adds one PHASE_ROWS per CTA (the direct dispatch waits for
        # grid adds per epoch): the same total, at once, keeps the counters in step
        if tidx < world:
            count_on_peer(peer_table, BUFFER_SIGNALS, world, tidx, PHASE_ROWS, rank, grid)
        # 3. every source's ids here (as their tags show them arriving): place this rank's rows
        place_rows(
            ids_here,
            pair_rows,
            global_ptr(cutlass.Int32, peer_address(peer_table, BUFFER_ROW_SOURCES, world, rank), 8),
            expert_offsets_address,
            pair_slots,
            source_pairs,
            source_groups,
            warp_counts,
            first_row,
            status_address,
            epoch,
            rank,
            world,
            local_experts,
            capacity,
            ids_row,
            max_tokens * top_k,
            timeout_ns,
        )
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if tidx == 0:
            cute.arch.store(scratch + PLACED, cutlass.Int32(epoch), sem="release", scope="gpu")
        if warp == 0:
            # every CTA counted itself in after reading the old epoch (long before, in practice)
            wait_local(scratch + STARTED, grid, epoch, status_address, rank, lane, timeout_ns)
            if lane == 0:
                cute.arch.store(scratch + STARTED, cutlass.Int32(0))
                cute.arch.store(epoch_ptr, epoch)
    else:
        if warp < SMALL_SEND_WARPS:
            # 2. a warp per token of this rank: its row into its staged row on each other owner,
            #    then the token's flag there
            wait_local(
                scratch + IDS_SENT,
                cutlass.Int32(epoch),
                epoch,
                status_address,
                rank,
                lane,
                timeout_ns,
            )
            senders = (grid - 1) * SMALL_SEND_WARPS
            for token in range(warp * (grid - 1) + bidx - 1, tokens, senders):
                owner_mask = token_owners(expert_of_pair, token, local_experts, lane, top_k)
                token_row = x_address + cutlass.Int64(token) * row_bytes
                if cutlass.const_expr(params.fp8_rows):
                    # quantized once, into the staged rows only (this rank's rows are expanded
                    # from x once placed)
                    no_rows = [cutlass.Int32(-1)] * top_k
                    send_quantized_token(
                        token_row,
                        no_rows,
                        0,
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
                    for vector in range(lane, row_vectors, 32 * unroll):
                        values = load_vectors(token_row, vector, unroll)
                        for peer in range(world):
                            if peer != rank:
                                if (owner_mask >> peer) & 1 == 1:
                                    staged = peer_address(peer_table, BUFFER_STAGED, world, peer)
                                    store_vectors(staged + staged_offset, vector, values)
                if pair_weights != 0:
                    # each owner's weights of this token (this rank's too) for its partial sums,
                    # released with the token's flag
                    if lane < top_k:
                        weight = cute.arch.load(weights + (token * top_k + lane), cutlass.Float32)
                        entry = (rank * max_tokens + token) * top_k + lane
                        for peer in range(world):
                            if (owner_mask >> peer) & 1 == 1:
                                weights_there = global_ptr(
                                    cutlass.Float32,
                                    peer_address(peer_table, BUFFER_PAIR_WEIGHTS, world, peer),
                                    4,
                                )
                                cute.arch.store(weights_there + entry, weight)
                release_token_flags(
                    peer_table, token, owner_mask, epoch, rank, world, max_tokens, lane
                )

    # 4. the batch rows here, once placed: a warp per (source, token, slice), this rank's
    #    tokens from x, the others' from their staged rows once their flags arrived
    if bidx == 0 or warp >= SMALL_SEND_WARPS:
        if bidx != 0:
            wait_local(
                scratch + PLACED,
                cutlass.Int32(epoch),
                epoch,
                status_address,
                rank,
                lane,
                timeout_ns,
            )
        expand_rows(
            x_address,
            peer_table,
            ids_here,
            pair_rows,
            status_address,
            epoch,
            rank,
            world,
            max_tokens,
            capacity,
            row_vectors,
            row_bytes,
            ids_row,
            timeout_ns,
            top_k,
            unroll,
            params.fp8_rows,
        )


@cute.jit
def send_ids(expert_of_pair, peer_table, scratch, epoch, pairs, rank, world, ids_row):
    """Step 1 on CTA 0: this rank's pair count and ids, each word tagged with the epoch (the tag
    tells the owner it arrived: no fence, no signal to wait for), into row `rank` of this
    epoch's half on every rank; then the local word the row senders wait for."""
    tidx, _, _ = cute.arch.thread_idx()
    # a thread's pairs, every load in flight before the first store
    ids = []
    for j in cutlass.range_constexpr(SMALL_MAX_PAIRS // SMALL_THREADS):
        pair = tidx + j * SMALL_THREADS
        expert = cutlass.Int32(0)
        if pair < pairs:
            expert = cute.arch.load(expert_of_pair + pair, cutlass.Int32)
        ids.append(expert)
    tag = ids_tag(epoch) << IDS_VALUE_BITS
    half = epoch % IDS_HALVES
    for peer in range(world):
        ids_there = global_ptr(cutlass.Int32, peer_address(peer_table, BUFFER_IDS, world, peer), 4)
        ids_there = ids_there + (half * world + rank) * ids_row
        for j in cutlass.range_constexpr(SMALL_MAX_PAIRS // SMALL_THREADS):
            pair = tidx + j * SMALL_THREADS
            if pair < pairs:
                cute.arch.store(ids_there + (IDS_FIRST + pair), tag | ids[j])
        if tidx == 0:
            cute.arch.store(ids_there + IDS_COUNT, tag | pairs)
    # PHASE_COUNTS: one add per epoch on every rank, as the two-kernel dispatch's count signal
    # (the counters stay in step); nothing here waits for it
    if tidx < world:
        count_on_peer(peer_table, BUFFER_SIGNALS, world, tidx, PHASE_COUNTS, rank, 1)
    cute.arch.sync_threads()
    if tidx == 0:
        cute.arch.store(scratch + IDS_SENT, cutlass.Int32(epoch), sem="release", scope="gpu")


@cute.jit
def place_rows(
    ids_here,
    pair_rows,
    sources_here,
    expert_offsets_address,
    pair_slots,
    source_pairs,
    source_groups,
    warp_counts,
    first_row,
    status_address,
    epoch,
    rank,
    world,
    local_experts,
    capacity,
    ids_row,
    table_row,
    timeout_ns,
):
    """Step 3 on CTA 0: the row of every source's pair of a local expert, from the ids. Every
    ids word read is cleared (a stale word never carries a tag), and each source's count kept
    for the expanders."""
    tidx, _, _ = cute.arch.thread_idx()
    warp, lane = tidx // 32, tidx % 32
    # each source's pair count and first group of 32 pairs, the counters zeroed
    if tidx < world:
        count = ids_here + tidx * ids_row
        pairs = tagged_value(count + IDS_COUNT, epoch, status_address, tidx, timeout_ns)
        source_pairs[tidx] = pairs
        cute.arch.store(count + IDS_COUNT, cutlass.Int32(0))
        cute.arch.store(count + IDS_COUNT_READ, pairs)
    for i in range(tidx, SMALL_WARPS * local_experts, SMALL_THREADS):
        warp_counts[i] = cutlass.Int32(0)
    cute.arch.sync_threads()
    if tidx == 0:
        groups = cutlass.Int32(0)
        for source in range(world):
            source_groups[source] = groups
            groups = groups + (source_pairs[source] + 31) // 32
        source_groups[world] = groups
    cute.arch.sync_threads()
    # every source's pairs into shared memory: the local expert, or -1 - slot (matching no
    # other lane) for another rank's expert or a group's padding; every load of a thread in
    # flight at once, then any word whose tag is not this epoch's yet waited for
    tag = ids_tag(epoch)
    for source in range(world):
        ids = ids_here + source * ids_row
        pairs = source_pairs[source]
        padded = (source_groups[source + 1] - source_groups[source]) * 32
        words = []
        for j in cutlass.range_constexpr(SMALL_MAX_PAIRS // SMALL_THREADS):
            pair = tidx + j * SMALL_THREADS
            word = tag << IDS_VALUE_BITS
            if pair < pairs:
                word = cute.arch.load(
                    ids + (IDS_FIRST + pair), cutlass.Int32, sem="relaxed", scope="sys"
                )
            words.append(word)
        for j in cutlass.range_constexpr(SMALL_MAX_PAIRS // SMALL_THREADS):
            pair = tidx + j * SMALL_THREADS
            if pair < padded:
                slot = source_groups[source] * 32 + pair
                local = cutlass.Int32(-1) - slot
                if pair < pairs:
                    expert = words[j] & ((1 << IDS_VALUE_BITS) - 1)
                    if words[j] >> IDS_VALUE_BITS != tag:
                        expert = tagged_value(
                            ids + (IDS_FIRST + pair), epoch, status_address, source, timeout_ns
                        )
                    cute.arch.store(ids + (IDS_FIRST + pair), cutlass.Int32(0))
                    if expert // local_experts == rank:
                        local = expert - rank * local_experts
                pair_slots[slot] = local
    cute.arch.sync_threads()

    # each local pair's rank among its warp's pairs of its expert (groups contiguous per warp:
    # warp order is (source, pair) order), packed with its expert into its slot
    groups = source_groups[world]
    per_warp = (groups + SMALL_WARPS - 1) // SMALL_WARPS
    warp_begin = warp * per_warp
    warp_end = warp_begin + per_warp
    if warp_end > groups:
        warp_end = groups
    for group in range(warp_begin, warp_end):
        slot = group * 32 + lane
        local = pair_slots[slot]
        same = lanes_with_same_value(local)
        before = cute.arch.popc(same & ((cutlass.Int32(1) << lane) - 1))
        base = cutlass.Int32(0)
        if local >= 0:
            base = warp_counts[warp * local_experts + local]
            pair_slots[slot] = (local << 16) | (base + before)
        cute.arch.sync_warp()
        if local >= 0:
            if cute.arch.popc(same) == before + 1:  # the highest lane of its expert carries on
                warp_counts[warp * local_experts + local] = base + before + 1
        cute.arch.sync_warp()
    cute.arch.sync_threads()

    # per local expert: the warps' exclusive prefixes (in place) and its rows in all
    for local in range(tidx, local_experts, SMALL_THREADS):
        running = cutlass.Int32(0)
        for w in cutlass.range_constexpr(SMALL_WARPS):
            count = warp_counts[w * local_experts + local]
            warp_counts[w * local_experts + local] = running
            running = running + count
        first_row[local] = running
    cute.arch.sync_threads()
    # each local expert's first row (expert-major), and expert_offsets clamped to capacity
    offsets = global_ptr(cutlass.Int32, expert_offsets_address, 4)
    if warp == 0:
        if lane == 0:
            cute.arch.store(offsets, cutlass.Int32(0))
        carry = cutlass.Int32(0)
        for chunk in range(0, local_experts, 32):
            local = chunk + lane
            rows = cutlass.Int32(0)
            if local < local_experts:
                rows = first_row[local]
            inclusive = warp_inclusive_sum(rows, lane)
            if local < local_experts:
                first_row[local] = carry + inclusive - rows
                end_row = carry + inclusive
                if end_row > capacity:
                    end_row = capacity
                cute.arch.store(offsets + (local + 1), end_row)
            carry = carry + cute.arch.shuffle_sync(inclusive, 31)
    cute.arch.sync_threads()

    # each pair's row (its expert's first row + its warp's prefix + its rank in the warp) into
    # the pair table (-1: not here) and the row's (source, pair)
    source = cutlass.Int32(0)
    for group in range(warp_begin, warp_end):
        while group >= source_groups[source + 1]:
            source = source + 1
        pair = (group - source_groups[source]) * 32 + lane
        packed = pair_slots[group * 32 + lane]
        if pair < source_pairs[source]:
            row = cutlass.Int32(-1)
            if packed >= 0:
                local = packed >> 16
                row = first_row[local] + warp_counts[warp * local_experts + local]
                row = row + (packed & 0xFFFF)
                if row < capacity:
                    cute.arch.store(sources_here + row * 2, source)
                    cute.arch.store(sources_here + (row * 2 + 1), pair)
            cute.arch.store(pair_rows + (source * table_row + pair), row)


@cute.jit
def expand_rows(
    x_address,
    peer_table,
    ids_here,
    pair_rows,
    status_address,
    epoch,
    rank,
    world,
    max_tokens,
    capacity,
    row_vectors,
    row_bytes,
    ids_row,
    timeout_ns,
    top_k: cutlass.Constexpr,
    unroll: cutlass.Constexpr,
    fp8_rows: cutlass.Constexpr,
):
    """Step 4 for the calling warp (every warp of CTA 0, the last SMALL_WARPS - SMALL_SEND_WARPS
    of the others). With `fp8_rows` the batch rows are e4m3 with their scales: this rank's
    tokens are quantized from x, the others' staged e4m3 rows and scales copied (a slice of
    whole rounds of e4m3 vectors covers whole quantization groups)."""
    tidx, bidx, grid, warp, lane = thread_position()
    # the other CTAs' expanders first (spread over the SMs), then CTA 0's
    role_warp = warp + (SMALL_WARPS - SMALL_SEND_WARPS) * (grid - 1)
    if bidx != 0:
        role_warp = (warp - SMALL_SEND_WARPS) * (grid - 1) + bidx - 1
    warps = SMALL_WARPS + (SMALL_WARPS - SMALL_SEND_WARPS) * (grid - 1)
    rows_here = peer_address(peer_table, BUFFER_ROWS, world, rank)
    staged_here = peer_address(peer_table, BUFFER_STAGED, world, rank)
    arrived_here = global_ptr(
        cutlass.Int64, peer_address(peer_table, BUFFER_ARRIVED, world, rank), 8
    )
    # the rows as they crossed NVLink: bf16, or e4m3 (hidden bytes) with their scales
    wire_vectors = row_vectors
    if cutlass.const_expr(fp8_rows):
        wire_vectors = row_vectors // 2
    wire_row_bytes = cutlass.Int64(wire_vectors) * 16
    groups = scale_groups(row_vectors)
    row_scales_here = scales_of(peer_table, BUFFER_ROW_SCALES, world, rank)
    staged_scales_here = scales_of(peer_table, BUFFER_STAGED_SCALES, world, rank)
    rounds = copy_rounds(wire_vectors, unroll)
    wait_ns = timeout_ns
    for step in range(world):
        source = (rank + step) % world
        source_tokens = cute.arch.load(
            ids_here + (source * ids_row + IDS_COUNT_READ), cutlass.Int32, cop="cg"
        )
        source_tokens = source_tokens // top_k
        if source_tokens > max_tokens:
            source_tokens = max_tokens
        slices = row_slices(source_tokens, rounds, warps)
        for item in range(role_warp, source_tokens * slices, warps):
            token = item // slices
            slot = cutlass.Int64(source) * max_tokens + token
            has_rows = cutlass.Int32(1)
            if source != rank:
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
                if seen != epoch * 2 + 1:
                    has_rows = cutlass.Int32(0)
            lane_row = cutlass.Int32(-1)
            if has_rows == 1:
                if lane < top_k:
                    lane_row = cute.arch.load(
                        pair_rows + (slot * top_k + lane), cutlass.Int32, cop="cg"
                    )
                    if lane_row >= capacity:
                        lane_row = cutlass.Int32(-1)
            # this rank's tokens with no expert here have nothing to copy
            if cute.arch.vote_ballot_sync(lane_row >= 0) != 0:
                rows = []
                for k in cutlass.range_constexpr(top_k):
                    rows.append(cute.arch.shuffle_sync(lane_row, k))
                first, end = slice_vectors(
                    item - token * slices, slices, rounds, wire_vectors, unroll
                )
                if cutlass.const_expr(fp8_rows):
                    if source == rank:
                        # e4m3 vector i holds bf16 vectors 2i and 2i + 1
                        quantize_to_rows(
                            x_address + cutlass.Int64(token) * row_bytes,
                            rows_here,
                            rows,
                            row_scales_here,
                            capacity,
                            1,
                            row_vectors * CHUNK,
                            first * 2,
                            cutlass.min(end * 2, row_vectors),
                            lane,
                            top_k,
                        )
                    else:
                        copy_to_rows(
                            staged_here + slot * wire_row_bytes,
                            rows_here,
                            rows,
                            wire_row_bytes,
                            first,
                            end,
                            lane,
                            unroll,
                            top_k,
                        )
                        # a group's 128 e4m3 values are 8 vectors
                        copy_scales(
                            staged_scales_here + slot * groups,
                            row_scales_here,
                            capacity,
                            rows,
                            first // 8,
                            cutlass.min((end + 7) // 8, groups),
                            lane,
                            top_k,
                        )
                else:
                    from_row = staged_here + slot * row_bytes
                    if source == rank:
                        from_row = x_address + cutlass.Int64(token) * row_bytes
                    copy_to_rows(
                        from_row, rows_here, rows, row_bytes, first, end, lane, unroll, top_k
                    )


@cute.jit
def dispatch_small(
    x_address: cutlass.Int64,
    expert_of_pair_address: cutlass.Int64,
    weights_address: cutlass.Int64,
    expert_offsets_address: cutlass.Int64,
    tokens: cutlass.Int32,
    params: EpParams,
    unroll: cutlass.Constexpr,
    stream,
):
    dispatch_small_kernel(
        x_address,
        expert_of_pair_address,
        weights_address,
        expert_offsets_address,
        tokens,
        params,
        unroll,
    ).launch(grid=[params.grid, 1, 1], block=[SMALL_THREADS, 1, 1], stream=stream)
