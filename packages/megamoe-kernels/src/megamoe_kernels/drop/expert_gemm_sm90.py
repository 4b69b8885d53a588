"""Grouped GEMM over a tight expert-major batch for Hopper (sm_90a), with fused epilogues.

out[r, :] = epilogue(x[r, :] @ w[e]^T) for every row r of expert e, where expert e owns rows
[offsets[e], offsets[e + 1]) of x. `offsets` (int32, E + 1) is read on the device. Masked
batches (expert_counts given, int32 [E] on the device): expert e owns rows [offsets[e],
offsets[e] + counts[e]) instead (each count clamped to offsets[e + 1] - offsets[e]): a receive
buffer with a fixed stride per expert read in place; the rest of each stride is never stored.

Layouts (row-major, contiguous last dim):
  x    [capacity, K]  the batch rows (MMA A, or MMA B with swap_ab)
  w    (N, K, E)      each expert's weight, K-major (a [E, N, K] tensor seen as (N, K, E))
  out  [capacity, N_out]; N_out = N / 2 for the SwiGLU epilogue, else N
  row_scale [capacity] float32, optional (multiplies each output row; plain epilogue only)
  bias [E, N] float32, optional: a per-expert bias over the weight's rows (with SwiGLU in the
            interleaved order of w's rows), added to the fp32 accumulators before the epilogue
  partials  [slots x split_k x tile_rows x tile_cols] float32, split_k > 1 only: a tile's slices
  arrivals  [slots] int32, split_k > 1 only: zero before the first launch; each launch leaves
            it zero (slot t is the t-th tile of the schedule; tiles past the slots are skipped,
            which only bad offsets can produce)
  unit_counter [2] int32, dynamic_schedule only: zero before the first launch; each launch
            leaves it zero

Structure: persistent CTAs; warpgroup 0 is the producer (`produce`: one warp issues TMA loads
into a `stages`-deep shared-memory ring), warpgroups 1..W consume (`consume`: for each tile, the
mainloop, `mma_tile` or FP8's `mma_tile_fp8`, then `finish_tile`, the epilogue). Producer and
consumers walk the same device-side schedule (tile_schedule.TileSchedule: the expert walk, the
unit counter, split-K slices): the tiles of expert e are ceil(rows_e / tile_rows) x
ceil(N / tile_cols), visited in order of e, so the schedule's length follows the valid rows,
not the capacity. A tile's rows start at offsets[e] + m * tile_rows; the rows past
offsets[e + 1] that a tile loads belong to another expert or are not data: they only feed output
rows that the epilogue never stores. The epilogue (tile_epilogue: split-K's sum, the bias,
SwiGLU or the row scale, the copy-out) writes the tile's output values to a shared-memory
staging buffer, which is copied out in 16-byte vectors, only the expert's rows and the columns
below N_out. Without swap_ab the producer warpgroup's other three warps (the store warps) do
the copy-out while the consumers go on to the next tile's MMAs, so it runs beside the tensor
cores; with swap_ab (a tile or two per CTA: nothing to overlap) the consumers copy out
themselves.
Launched with programmatic dependent launch: a kernel that follows (the down GEMM after the
gate-up one) sets up while this one drains. With polls_offsets (a decode gate-up GEMM after
local_route's route_and_place with publish_offsets) the producer warp does not wait for the
routing kernel to end before reading the offsets: it spins on the word after them until the
routing kernel publishes them, then starts loading its first tile's weights (weights_before_wait)
while that kernel still copies the rows.

pingpong gives each of two consumer warpgroups whole tiles of its own (the CTA's tiles alternate
between them): while one runs its epilogue, the other's MMAs keep the tensor cores busy. The
mainloops take turns (two named barriers), which also keeps each warpgroup's waits on the shared
ring within one phase of the producer. Each warpgroup stages its epilogue in its own buffer;
the store warps drain the buffers in the CTA's tile order (the warpgroups' tiles alternate).

swap_ab puts the weight's N on the MMA's M side (tile_cols = MMA M, tile_rows = MMA N): the
decode shape, where a few rows per expert would waste a 64-row MMA and the weight stream is
what costs. Each weight tile is read once there: its loads are evict-first in the L2.

cluster_rows = 2 runs the CTAs in clusters of two that share each weight tile: the schedule's
unit is a pair of row tiles of one (expert, column tile); CTA r of the cluster takes row tile
2p + r, loads its own rows and half of the weight tile, and the TMA multicasts that half into
both CTAs' rings, so each SM pulls half the weight bytes from L2. A consumer releases a stage
on both CTAs' rings (the peer's TMA writes into it too). When an expert's row tiles are odd,
the second CTA's tile of the last pair is empty: it still loads (its partner's rows, unused)
and drains the ring like a tile whose slab has no rows, and stores nothing.

split_k = S > 1 (swap_ab only) splits each tile's K into S slices worked by S different CTAs:
the decode shape has fewer weight tiles than SMs (one expert of 4096 weight rows is 32 tiles of
128), so the weight stream would run on a quarter of the GPU. The schedule's unit is one slice of
one tile (the S slices of a tile run at once on neighbouring CTAs). Each CTA writes its fp32
accumulators to the tile's slot of a global workspace, fences, and counts itself in on the
tile's arrival counter; the CTA that arrives last adds the S slices in slice
order (its own from registers), resets the counter for the next launch and runs the epilogue.
The sum's order is fixed, so results are deterministic (not bitwise those of split_k = 1).

dynamic_schedule: a CTA's tiles after its first are the next untaken ones, taken from a global
counter when its producer is ready for them (instead of every num_ctas-th tile of the schedule),
so the row tiles that share a weight tile run, and read it, together (tile_schedule says why).
The producer hands each tile's unit to the consumers through a small shared-memory queue.

tail_rows = T (16 or 32; bf16 prefill tiles: no swap_ab, pingpong, clusters, split_k, gathered
rows or FP8) lets an expert's last row tile hold up to T rows past its tile_rows (tile_schedule):
rows that would otherwise take a row tile of their own, whose MMAs cost a 64-row slab each. The
producer loads them into a T-row buffer beside each stage (their bytes added to the stage's
barrier only for such a tile), and each consumer warpgroup runs them in the swap-AB
orientation in the same wgmma batches as the tile's own MMAs: its share of the weight tile on
the MMA's M side (read from the stage the tile's MMAs read) and the T rows on N, so the weight
tile streams once for all of the expert's rows and the extra MMAs are T / 64 of a slab's. The
epilogue stages their outputs below the tile's rows (the decode tiles' fragment walk), and the
copy-out stores up to tile_rows + T rows. The same products in the same K order as without the
tail: the same bits.

min_valid_rows / max_valid_rows make a variant for a range of valid rows (offsets[E], read on
the device): outside [min_valid_rows, max_valid_rows) its schedule is empty and it exits at once.
Launching one variant per range, each with the tiles its rows want, lets a batch whose capacity
is sized for the worst case pay for the tiles of the rows it holds, with no host sync.

SwiGLU: w is the gate/up interleaved weight (gate_up_layout); out = silu(gate) * up in fp32.
swiglu_limit / swiglu_alpha / swiglu_up_offset (compile-time constants) make it the clamped
variant: gate = min(gate, limit), up = clamp(up, -limit, limit), out = gate * sigmoid(alpha *
gate) * (up + up_offset) (gpt-oss: 7.0, 1.702, 1.0); the defaults give silu(gate) * up with the
same instructions as a kernel built without them. swiglu_gate_softcap / swiglu_up_softcap c
(compile-time constants) softcap the linear gate factor and up, c * tanh(v / c), the sigmoid
seeing the gate uncapped (Inkling2). swiglu_gate_cubic b (a compile-time constant) adds b gate^3
to the sigmoid's gate: with alpha 2 sqrt(2 / pi) and b 0.044715, gate * sigmoid(...) is the tanh
GELU of the gate, GeGLU (Gemma 4's experts).

bias: each accumulator gets its weight row's bias (bias[expert, n], fp32) after the mainloop
(after split_k's sum) and before the epilogue: before SwiGLU and its clamp, before the row
scale. A thread loads the biases of the weight rows its fragment holds once per tile (2 with
swap_ab, tile_cols / 4 otherwise; the index is clamped to N - 1, so a tail tile's columns past
N read a bias that is never stored). Without it the kernel holds no bias code.

gather_rows: x is the tokens [T, K], not the batch, and row_source [capacity] int32 names the
token of each batch row, so the dispatch writes no expert-major copy of the tokens. The
producer warp's lanes gather a tile's rows themselves (cp.async, 16 bytes each, lane l its own
rows l, l + 32, ...) into the swizzled stage the TMA would have written, and count themselves
in on the stage's full barrier (cp.async.mbarrier.arrive.noinc; the weights still come by
TMA). The consumers fence the async proxy after each wait (the MMAs read what generic-proxy
copies wrote) and before each release. Rows past the expert's are not loaded (they feed output
rows that are never stored). BF16 only; K a multiple of the K tile. The 16-byte copies are
slower than a stage's TMA box with prefill tiles (the layer gathers with decode tiles only).

FP8 (scale_group set): x and w are e4m3 with float32 block scales (fp8_scaling): x_scales
[K / scale_group, rows] (a row's scale for each group of scale_group columns, group-major so a
tile's scales for one group are contiguous) and w_scales [E, ceil(N_source / 128), ceil(K / 128)]
(the checkpoint's 128 x 128 blocks, over the weight rows before the gate/up interleave). A K
tile is 128 values (one weight block); the MMAs of each scale group accumulate into a second
set of registers, which is then added to the running sum times the row's and the block's
scales in fp32: the promotion DeepGEMM does, since Hopper's FP8 MMAs accumulate with fewer
bits than fp32. With decode tiles a group's products, once its MMAs are done, are copied aside
and promoted while the next group's MMAs run (the same sums in the same K order). The
consumers load the scales they need from global memory before each stage's wait (their
latency hides behind it): the x scales of the few batch rows each thread accumulates and
the tile's two weight scales (gate and up blocks with SwiGLU, the two halves of a 256-column
tile). With staged_scale_k_tiles (decode tiles) they instead load every K step's scales of
the tile into shared memory together at the tile's start, and each step reads its own there:
a step's loads from global memory otherwise wait behind the ring's weight stream. A prefill
tile wider than a weight block (256 columns) runs its MMAs a 128-column slice at a time, each
slice's products promoted as its MMAs end: the running sum of the whole tile and the products
of one slice fit the consumers' registers where two sets of the whole tile would not. In a
tile of two warpgroups that promote a weight block's K at a time, the warpgroups issue each
batch of MMAs in turns (mma_turns: two named barriers), so one's MMAs run while the other
promotes. Only staged decode scales take shared memory (after the epilogue's buffer), so FP8
and BF16 tiles of the same shape hold the same stages. out_scale_group: the gate-up output is
e4m3 with one scale per row and out_scale_group columns (out_scales [N_out / out_scale_group,
rows]; 64, or 128 where the tile holds 128 output columns): the tile is staged in bf16 and
each group quantized as it is copied out (8 or 16 lanes share a group's amax by shuffles).

reduce_out (the down GEMM: no SwiGLU, a bf16 out): out is the tokens' output [T, N] and
row_source [capacity] int32 the token of each batch row; each output row, times its row scale
(the pair's routing weight), is added into out[token] by reductions at the L2
(tile_epilogue.ReducedCopyOut): the combine done by the down GEMM, in no fixed order (not
deterministic), each add rounded to bf16. out holds zeros (or what the rows add to) before the
launch.
"""

import enum

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from .fp8_scaling import WEIGHT_BLOCK
from .tile_epilogue import (
    Bias,
    EpilogueTensors,
    InlineStore,
    PlainCopyOut,
    QuantizedCopyOut,
    ReducedCopyOut,
    RowScaledOutput,
    SplitKSum,
    StoreWarps,
    SwiGLUOutput,
    m_side_slot,
    n_side_slot,
    up_partner_offset,
)
from .tile_schedule import UNIT_QUEUE_SLOTS, TileSchedule
from .tiling import EPILOGUE_ROW_PAD, THREADS_PER_WARPGROUP, fp8_column_slices, tile_k

# the L2 cache policy of an evict-first TMA load (the 64-bit createpolicy encoding CUTLASS
# names CacheHintSm90::EVICT_FIRST)
EVICT_FIRST_POLICY = 0x12F0000000000000
# polls_offsets: how long the producer warp spins on the offsets' ready word before it waits
# for the routing kernel to end instead (a routing launch publishes its offsets within about
# 20 us at 8192 tokens; past this the offsets are read after that kernel's end, as without
# polls_offsets)
OFFSETS_POLL_TIMEOUT_NS = 200_000
PRODUCER_REGISTERS = 40
CONSUMER_REGISTERS = 232
# FP8: the most registers a consumer thread's running sum, two sets of a scale group's products
# and two groups' x scales may take for the promotions to overlap the MMAs (the rest of the 232
# hold addresses, the other scales and the epilogue's values; above it the kernel spilled)
OVERLAPPED_PROMOTION_REGISTERS = 200
# tail_rows: the rows past tile_rows a tile may hold, whole 16-row blocks of the tail MMAs' N
# (the epilogue's fragment walk takes two or more 8-column blocks) up to 32 (a warpgroup's tail
# accumulators: its weight rows times the tail over its 128 threads, 32 registers at 128 x 32)
TAIL_ROWS = (16, 32)


class BarrierId(enum.IntEnum):
    """The kernel's named barrier ids (0 is the CTA-wide barrier). Each member spans one id per
    consumer team: team w's barrier is the member's value + w (teams 0 and 1 with pingpong)."""

    # the threads of team w meet around its staging buffer in the epilogue
    EPILOGUE = 1
    # where consumer w hands the tensor cores to the other: with pingpong team w between
    # tiles, in an FP8 tile of two warpgroups warpgroup w between MMA batches (mma_turns)
    MMA_TURN = 3


class TailOperands:
    """tail_rows: the kernel's handles on the tail rows, held together for its calls: their TMA
    atom and tensor, their shared-memory buffer (tail_rows x K tile per stage) and the tiled
    MMA of one warpgroup's tail (64-row atoms of weight rows by the tail)."""

    def __init__(self, *, tma, mX, sX, mma):
        self.tma = tma
        self.mX = mX
        self.sX = sX
        self.mma = mma


class ScheduleArgs:
    """One launch's values of the tile schedule's calls, read once at the kernel's start and
    never changed: the offsets (and counts) the walk reads, the experts it walks (none outside
    the variant's range of valid rows), the weight rows N, the column tiles and units, the K
    tiles, the row limit (the capacity), and this CTA's place among the clusters."""

    def __init__(
        self,
        *,
        mOffsets,
        mExpertCounts,
        experts,
        n_cols,
        col_tiles,
        col_units,
        k_tiles,
        capacity,
        cluster_rank,
        cluster_idx,
        num_clusters,
    ):
        self.mOffsets = mOffsets
        self.mExpertCounts = mExpertCounts
        self.experts = experts
        self.n_cols = n_cols
        self.col_tiles = col_tiles
        self.col_units = col_units
        self.k_tiles = k_tiles
        self.capacity = capacity
        self.cluster_rank = cluster_rank
        self.cluster_idx = cluster_idx
        self.num_clusters = num_clusters


class ExpertGroupedGemmSm90:
    """One grouped GEMM variant; the knobs are fixed at construction (see knob rules in the shim).

    tile_rows: rows of x per tile (64/128; with swap_ab 16/32/64/128)
    tile_cols: weight rows (accumulator columns) per tile (64..256 step 64; with swap_ab 64/128)
    stages:    depth of the TMA ring
    swap_ab:   weight on the MMA's M side (decode)
    swiglu:    gate/up interleaved weight, out = silu(gate) * up
    swiglu_limit, swiglu_alpha, swiglu_up_offset, swiglu_gate_softcap, swiglu_up_softcap,
    swiglu_gate_cubic: the clamped, softcapped and GELU SwiGLU's constants (swiglu only; None,
               1.0, 0.0, None, None, 0.0: the plain one)
    bias:      add bias[expert, weight row] (fp32) to each accumulator before the epilogue
    row_scale: multiply each output row by row_scale[row]
    rows_fastest: schedule order inside an expert (m-tiles vary fastest: weights stream once)
    num_ctas:  persistent CTAs launched (a multiple of cluster_rows)
    cluster_rows: CTAs per cluster sharing each weight tile by TMA multicast (1 or 2; not with
               swap_ab)
    pingpong:  two consumer warpgroups on alternate tiles (epilogue overlaps the other's MMAs);
               without swap_ab, at most 64 x 256 accumulators per tile
    split_k:   CTAs that share each tile's K (swap_ab only; at most the K tiles of 64)
    min_valid_rows, max_valid_rows: the range of offsets[E] this variant works on (None: no
               upper bound); outside it the kernel does nothing
    weights_before_wait: the producer reads the offsets and starts loading the weights of its
               first tile (up to a ring's worth) before waiting for the previous kernel on the
               stream: only when neither the offsets nor the weights are written by that
               kernel (the down GEMM after its gate-up); the rows load after the wait.
               Ignored with cluster_rows > 1
    polls_offsets: the offsets come from the routing kernel just before (local_route's
               route_and_place with publish_offsets), and the int32 word after them turns 1
               once they are final: the producer warp spins on it (at most
               OFFSETS_POLL_TIMEOUT_NS, then it waits for that kernel to end) and then starts
               loading its first tile's weights, as with weights_before_wait, which it implies;
               the rows and everything else load after the wait. Not with cluster_rows > 1
    l2_prefetch_ctas: with weights_before_wait, P > 0: the CTAs [0, P) (the first the GPU
               places, on the SMs the kernel before leaves idle) also issue, before the wait,
               L2 prefetches of the weights of the first-wave tiles whose CTAs start only as
               that kernel frees their SMs: CTA b those of units b + P, b + 2P, ... below
               the grid's CTAs. 0: none
    dynamic_schedule: CTAs take their tiles after the first from a global counter (takes
               unit_counter); not with cluster_rows > 1 or split_k > 1
    scale_group: FP8: K columns per scale of x (128, or the gate-up's out_scale_group for
               the down GEMM it feeds); None: bf16, no scales
    out_scale_group: FP8 gate-up: the output is e4m3 with a scale per row and this many
               columns (fp8_scaling: INTERMEDIATE_GROUP, or WIDE_INTERMEDIATE_GROUP with
               256-column prefill tiles); None: bf16 out
    gather_rows: x holds the tokens and row_source the token of each batch row (bf16 only)
    reduce_out: out holds the tokens' rows and row_source the token of each batch row, into
               whose row the batch row's output is added (the down GEMM; module docstring)
    prefetch_weight_scales: FP8: before a tile's mainloop its consumers prefetch into L2 the
               weight scales of each of its K tiles (a thread a K tile): for scales that lie
               a cache line or more apart (a packed weight's, after each of its tiles), whose
               loads would otherwise each wait on HBM inside the mainloop
    tail_rows: rows past tile_rows an expert's last row tile may hold, one of TAIL_ROWS (0:
               none); bf16 prefill tiles without pingpong, clusters or gathered rows, whose
               warpgroups' shares of the tile's weight rows are whole 64-row MMA atoms
    staged_scale_k_tiles: FP8 with swap_ab: 0, or at least the weight's K tiles (ceil(K /
               128)): the consumers of a tile load the x and weight scales of all its K tiles
               into shared memory at the tile's start (stage_scales; staged_scale_k_tiles x
               (K tile's scale groups x tile_rows + 2) floats), and each K step reads its own
               there rather than from global memory
    """

    def __init__(
        self,
        *,
        tile_rows,
        tile_cols,
        stages,
        swap_ab,
        swiglu,
        row_scale,
        rows_fastest,
        num_ctas,
        pingpong=False,
        cluster_rows=1,
        split_k=1,
        min_valid_rows=0,
        max_valid_rows=None,
        weights_before_wait=False,
        polls_offsets=False,
        l2_prefetch_ctas=0,
        dynamic_schedule=False,
        scale_group=None,
        out_scale_group=None,
        gather_rows=False,
        reduce_out=False,
        bias=False,
        swiglu_limit=None,
        swiglu_alpha=1.0,
        swiglu_up_offset=0.0,
        swiglu_gate_softcap=None,
        swiglu_up_softcap=None,
        swiglu_gate_cubic=0.0,
        prefetch_weight_scales=False,
        staged_scale_k_tiles=0,
        tail_rows=0,
    ):
        swiglu_constants = dict(
            limit=swiglu_limit,
            alpha=swiglu_alpha,
            up_offset=swiglu_up_offset,
            gate_softcap=swiglu_gate_softcap,
            up_softcap=swiglu_up_softcap,
            gate_cubic=swiglu_gate_cubic,
        )
        if not swiglu and swiglu_constants != dict(
            limit=None, alpha=1.0, up_offset=0.0, gate_softcap=None, up_softcap=None, gate_cubic=0.0
        ):
            raise ValueError(
                "swiglu_limit / swiglu_alpha / swiglu_up_offset / swiglu_gate_softcap / "
                "swiglu_up_softcap / swiglu_gate_cubic: the SwiGLU epilogue's constants "
                "(swiglu=True only)"
            )
        if gather_rows and scale_group is not None:
            raise ValueError(
                "gather_rows: bf16 only (FP8 rows carry scales the consumers would have to gather)"
            )
        if reduce_out and (swiglu or out_scale_group is not None or gather_rows):
            raise ValueError(
                "reduce_out: the down GEMM's bf16 output (no SwiGLU, no quantized output, no "
                "gathered rows: row_source names the tokens the rows are added into)"
            )
        if staged_scale_k_tiles and (scale_group is None or not swap_ab):
            raise ValueError(
                "staged_scale_k_tiles: FP8 decode tiles only (scale_group set and swap_ab); the "
                "prefill tiles load each K tile's scales a step ahead"
            )
        if polls_offsets and cluster_rows > 1:
            raise ValueError(
                "polls_offsets: not with cluster_rows > 1 (its early weight loads would multicast "
                "into the partner CTA's ring)"
            )
        if dynamic_schedule and (cluster_rows > 1 or split_k > 1):
            raise ValueError(
                "dynamic_schedule: not with cluster_rows > 1 (both CTAs of a cluster work one "
                "unit) or split_k > 1 (a tile's slices count on slots of the static schedule)"
            )
        self.tile_rows = tile_rows
        self.tile_cols = tile_cols
        self.stages = stages
        self.swap_ab = swap_ab
        self.swiglu = swiglu
        self.num_ctas = num_ctas
        self.pingpong = pingpong
        self.cluster_rows = cluster_rows
        self.split_k = split_k
        # multicast loads write into the peer CTA's ring too: not before the wait
        self.polls_offsets = polls_offsets
        self.weights_before_wait = (weights_before_wait or polls_offsets) and cluster_rows == 1
        self.l2_prefetch_ctas = l2_prefetch_ctas if self.weights_before_wait else 0
        self.dynamic_schedule = dynamic_schedule
        self.block_scaled = scale_group is not None
        self.scale_group = scale_group
        self.quantize_out = out_scale_group is not None
        self.gather_rows = gather_rows
        self.reduce_out = reduce_out
        self.prefetch_weight_scales = prefetch_weight_scales and self.block_scaled
        self.staged_scale_k_tiles = staged_scale_k_tiles
        self.schedule = TileSchedule(
            tile_rows=tile_rows,
            cluster_rows=cluster_rows,
            split_k=split_k,
            rows_fastest=rows_fastest,
            dynamic_schedule=dynamic_schedule,
            min_valid_rows=min_valid_rows,
            max_valid_rows=max_valid_rows,
            tail_rows=tail_rows,
        )
        self.mma_m, self.mma_n = (tile_cols, tile_rows) if swap_ab else (tile_rows, tile_cols)
        # FP8 prefill tiles wider than a weight block: the MMAs' column slices, each promoted as
        # its MMAs end (mma_tile_fp8)
        self.mma_slices = 1
        if self.block_scaled:
            self.mma_slices = fp8_column_slices(self.mma_n, swap_ab=swap_ab)
        # FP8 prefill tiles load each K tile's scales a K step ahead (mma_tile_fp8): loaded
        # just before the stage's wait, they were still in flight when a full ring let the
        # MMAs start at once and the promotions wait on them (the down GEMM took 4-10% more
        # time). The decode tiles promote a step later anyway (overlaps_promotion).
        self.scales_ahead = self.block_scaled and not swap_ab
        # FP8 tiles of two warpgroups that promote each batch of MMAs as it ends, a weight
        # block's K at a time: the warpgroups issue their batches in turns, so that one's MMAs
        # run while the other promotes (take_mma_turn). Left to themselves both issue each
        # batch at once and both promote with the tensor cores idle: the gate-up took 7-8% more
        # time at dsv3-ep8-local 2048 and 8192 tokens, 1% at mixtral-8x7b, the same at
        # qwen3-30b-a3b (K = 2048). Not with 64-column scale groups (the down GEMM after a
        # gate-up of decode or 128-column tiles): its batches of half the MMAs took 3-5% more
        # time in turns. (The down GEMM on 128-column groups: within 1.5% either way.)
        self.mma_turns = (
            self.block_scaled
            and scale_group == WEIGHT_BLOCK
            and not pingpong
            and self.mma_m == 2 * 64
        )
        # decode (swap-AB) tiles read each weight tile once: their weight loads are evict-first,
        # so the L2 keeps what is read again (the scales, the rows, the gate-up's output for
        # the down GEMM). With the weights cold, each FP8 GEMM alone took 0-9% less time at 1
        # and 16 tokens (qwen3-30b-a3b 16 tokens: the down 40.0 -> 36.4 us).
        self.evict_first_weights = swap_ab
        # warpgroups that share one tile's MMAs, and the consumer warpgroups of the CTA
        self.tile_warpgroups = 1 if pingpong else self.mma_m // 64
        self.num_consumer_warpgroups = 2 if pingpong else self.tile_warpgroups
        self.tile_threads = self.tile_warpgroups * THREADS_PER_WARPGROUP
        # the weight rows of each warpgroup's tail MMAs (the MMA's M side)
        self.tail_cols = tile_cols // self.tile_warpgroups
        if tail_rows and (
            swap_ab
            or pingpong
            or cluster_rows > 1
            or gather_rows
            or scale_group is not None
            or tail_rows not in TAIL_ROWS
            or self.tail_cols % 64
        ):
            raise ValueError(
                f"tail_rows={tail_rows}: one of {TAIL_ROWS}, for bf16 "
                "prefill tiles (no swap_ab, pingpong, clusters, gathered rows or FP8) whose "
                f"warpgroups share the {tile_cols} weight rows in whole 64-row MMA atoms"
            )
        self.tail_rows = tail_rows
        # rows a tile stages and stores: its own and its tail
        self.staged_rows = tile_rows + tail_rows
        self.num_consumer_threads = self.num_consumer_warpgroups * THREADS_PER_WARPGROUP
        self.epilogue_buffers = 2 if pingpong else 1
        self.store_warps = not swap_ab
        self.threads_per_cta = THREADS_PER_WARPGROUP + self.num_consumer_threads
        self.out_tile_cols = tile_cols // 2 if swiglu else tile_cols
        self.out_row_stride = self.out_tile_cols + EPILOGUE_ROW_PAD
        self.partner_offset = up_partner_offset(swap_ab)
        # the epilogue's parts (tile_epilogue), in the order a tile goes through them
        self.split_k_sum = (
            SplitKSum(split_k=split_k, tile_threads=self.tile_threads) if split_k > 1 else None
        )
        self.bias = Bias(swap_ab=swap_ab, tile_cols=tile_cols) if bias else None
        self.output = (
            SwiGLUOutput(swap_ab=swap_ab, **swiglu_constants)
            if swiglu
            else RowScaledOutput(swap_ab=swap_ab, row_scale=row_scale)
        )
        # the tail's accumulators hold the weight on the MMA's M side, as a decode tile's do
        self.tail_bias = self.tail_output = None
        if tail_rows:
            self.tail_bias = Bias(swap_ab=True, tile_cols=tile_cols) if bias else None
            self.tail_output = (
                SwiGLUOutput(swap_ab=True, **swiglu_constants)
                if swiglu
                else RowScaledOutput(swap_ab=True, row_scale=row_scale)
            )
        copy_out = (
            QuantizedCopyOut(
                tile_rows=tile_rows, out_tile_cols=self.out_tile_cols, group=out_scale_group
            )
            if self.quantize_out
            else (ReducedCopyOut if reduce_out else PlainCopyOut)(
                tile_rows=self.staged_rows, out_tile_cols=self.out_tile_cols
            )
        )
        self.tile_store = (
            StoreWarps(
                copy_out=copy_out, buffers=self.epilogue_buffers, tile_threads=self.tile_threads
            )
            if self.store_warps
            else InlineStore(copy_out=copy_out, tile_threads=self.tile_threads)
        )

    @cute.jit
    def __call__(
        self,
        mX,
        mW,
        mOut,
        mOffsets,
        mRowScale,
        mPartials,
        mArrivals,
        mUnitCounter,
        mXScales,
        mWScales,
        mOutScales,
        mRowSource,
        mExpertCounts,
        mBias,
        stream,
    ):
        if cutlass.const_expr(
            mExpertCounts is not None
            and (self.schedule.min_valid_rows > 0 or self.schedule.max_valid_rows is not None)
        ):
            raise ValueError(
                "a masked batch's valid rows are its counts' sum, not offsets[E]: launch it "
                "without a valid-row range"
            )
        ab_dtype = mX.element_type
        self.ab_dtype = ab_dtype
        self.tile_k = tile_k(ab_dtype.width // 8)
        self.tiled_mma = self.tiled_mma_of(ab_dtype, self.mma_n)
        # the MMAs of one column slice (the whole tile's unless mma_slices > 1); tiled_mma
        # lays out the accumulators and the epilogue
        self.slice_mma = self.tiled_mma
        if cutlass.const_expr(self.mma_slices > 1):
            self.slice_mma = self.tiled_mma_of(ab_dtype, self.mma_n // self.mma_slices)
        a_layout = sm90_utils.make_smem_layout_a(
            cutlass.tensor_utils.LayoutEnum.ROW_MAJOR,
            (self.mma_m, self.mma_n, self.tile_k),
            ab_dtype,
            self.stages,
        )
        b_layout = sm90_utils.make_smem_layout_b(
            cutlass.tensor_utils.LayoutEnum.ROW_MAJOR,
            (self.mma_m, self.mma_n, self.tile_k),
            ab_dtype,
            self.stages,
        )
        x_layout, w_layout = (b_layout, a_layout) if self.swap_ab else (a_layout, b_layout)
        # gathered rows are copied by the producer warp's lanes, not by TMA
        tma_x, tma_mX = None, mX
        if cutlass.const_expr(not self.gather_rows):
            tma_x, tma_mX = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(),
                mX,
                cute.slice_(x_layout, (None, None, 0)),
                (self.tile_rows, self.tile_k),
            )
        # tail_rows: the tail's rows, the N side of the tail MMAs (K-major, as a decode tile's
        # rows), a buffer per stage; the tail MMAs of one warpgroup: its weight rows by the tail
        tail_layout = tma_x_tail = tma_mX_tail = None
        self.tail_mma = None
        if cutlass.const_expr(self.tail_rows > 0):
            tail_layout = sm90_utils.make_smem_layout_b(
                cutlass.tensor_utils.LayoutEnum.ROW_MAJOR,
                (64, self.tail_rows, self.tile_k),
                ab_dtype,
                self.stages,
            )
            self.tail_bytes = cute.size_in_bytes(
                ab_dtype, cute.slice_(tail_layout, (None, None, 0))
            )
            tma_x_tail, tma_mX_tail = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(),
                mX,
                cute.slice_(tail_layout, (None, None, 0)),
                (self.tail_rows, self.tile_k),
            )
            k_major = cute.nvgpu.OperandMajorMode.K
            self.tail_mma = sm90_utils.make_trivial_tiled_mma(
                ab_dtype,
                ab_dtype,
                k_major,
                k_major,
                cutlass.Float32,
                (1, 1, 1),
                tiler_mn=(64, self.tail_rows),
            )
        tma_w, tma_mW = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SMulticastOp()
            if cutlass.const_expr(self.cluster_rows > 1)
            else cpasync.CopyBulkTensorTileG2SOp(),
            mW,
            cute.slice_(w_layout, (None, None, 0)),
            (self.tile_cols, self.tile_k),
            num_multicast=self.cluster_rows,
        )
        # FP8: the scale groups of one K tile (the consumers load their rows' scales)
        self.groups_per_tile = 1
        if cutlass.const_expr(self.block_scaled):
            self.groups_per_tile = self.tile_k // self.scale_group
        # staged decode scales: a K tile's x scales (group-major, then the tile's rows), for
        # every K tile, then the two weight scales of every K tile
        self.staged_x_words = self.groups_per_tile * self.tile_rows
        self.staged_scale_words = self.staged_scale_k_tiles * (self.staged_x_words + 2)
        if cutlass.const_expr(self.reduce_out):
            # the copy-out's tensor beside the output: the token of each batch row
            mOutScales = mRowSource
        if cutlass.const_expr(self.quantize_out):
            mOutScales = cute.make_tensor(
                mOutScales.iterator,
                cute.make_layout(
                    (cute.size(mOutScales, mode=[1]), cute.size(mOutScales, mode=[0])),
                    stride=(1, mOutScales.stride[0]),
                ),
            )
        # one staging buffer per warpgroup that runs epilogues on its own; a quantized output
        # is staged in bf16
        staged_dtype = cutlass.BFloat16 if self.quantize_out else mOut.element_type
        out_layout = cute.make_layout(
            (self.staged_rows, self.out_tile_cols, self.epilogue_buffers),
            stride=(self.out_row_stride, 1, self.staged_rows * self.out_row_stride),
        )

        self.shared_storage = self.shared_storage_type(
            ab_dtype, x_layout, w_layout, staged_dtype, out_layout, tail_layout
        )
        self.kernel(
            tma_x,
            tma_mX,
            tma_w,
            tma_mW,
            mXScales,
            mWScales,
            mOut,
            mOutScales,
            mOffsets,
            mRowScale,
            mPartials,
            mArrivals,
            mUnitCounter,
            mRowSource,
            mExpertCounts,
            mBias,
            self.tiled_mma,
            self.slice_mma,
            x_layout,
            w_layout,
            out_layout,
            tma_x_tail,
            tma_mX_tail,
            self.tail_mma,
            tail_layout,
        ).launch(
            grid=[self.num_ctas, 1, 1],
            block=[self.threads_per_cta, 1, 1],
            cluster=(self.cluster_rows, 1, 1),
            min_blocks_per_mp=1,
            stream=stream,
            # programmatic dependent launch: the CTAs may start (shared memory, barriers, TMA
            # descriptors) while the previous kernel on the stream finishes; the kernel waits for
            # it before its first global memory access
            use_pdl=True,
        )

    def tiled_mma_of(self, ab_dtype, columns):
        """The tile's warpgroups side by side along the MMA's M, each 64 rows by `columns` of
        its N (plain Python, run while tracing)."""
        k_major = cute.nvgpu.OperandMajorMode.K
        return sm90_utils.make_trivial_tiled_mma(
            ab_dtype,
            ab_dtype,
            k_major,
            k_major,
            cutlass.Float32,
            (self.tile_warpgroups, 1, 1),
            tiler_mn=(64, columns),
        )

    @cute.jit
    def tile_tokens(self, mRowSource, row0, rows):
        """gather_rows, producer warp: lane l's tokens of the tile's rows l, l + 32, ... (0 for
        rows past the `rows` of the expert the tile holds)."""
        lane = cute.arch.lane_idx()
        tokens = []
        for j in cutlass.range_constexpr((self.tile_rows + 31) // 32):
            token = cutlass.Int32(0)
            if lane + 32 * j < rows:
                token = mRowSource[row0 + lane + 32 * j]
            tokens.append(token)
        return tokens

    @cute.jit
    def gather_stage(self, mX, sX_stage, tile_tokens, *, rows, k_tile):
        """gather_rows, producer warp: copies K tile `k_tile` of the tile's first `rows` rows
        from their tokens into a stage. Lane l copies its own rows l, l + 32, ... (the tokens
        tile_tokens holds), each row's K tile in 16-byte chunks: no value passes between lanes,
        and every copy's address is the row's plus a constant, so the copies issue back to back.
        The copies go through L1 (a warp's copy reads 16 bytes of 32 rows; the next chunk of
        each row is the other half of the 32-byte sector it fetched)."""
        lane = cute.arch.lane_idx()
        element_bytes = self.ab_dtype.width // 8
        chunk_elements = 16 // element_bytes
        chunks = self.tile_k // chunk_elements
        hidden = cute.size(mX, mode=[1])
        x_address = mX.iterator.toint()
        copy_atom = cute.make_copy_atom(
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS),
            self.ab_dtype,
            num_bits_per_copy=128,
        )
        for j in cutlass.range_constexpr((self.tile_rows + 31) // 32):
            row = lane + 32 * j
            if row < cutlass.min(rows, self.tile_rows):
                row_address = (
                    x_address
                    + (cutlass.Int64(tile_tokens[j]) * hidden + k_tile * self.tile_k)
                    * element_bytes
                )
                for chunk in cutlass.range_constexpr(chunks):
                    source = cute.make_tensor(
                        cute.make_ptr(
                            self.ab_dtype,
                            row_address + chunk * 16,
                            cute.AddressSpace.gmem,
                            assumed_align=16,
                        ),
                        cute.make_layout(chunk_elements),
                    )
                    # one 16-byte vector: the swizzle moves whole chunks
                    destination = cute.local_tile(sX_stage, (1, chunk_elements), (row, chunk))
                    cute.copy(copy_atom, source, destination[(0, None)])

    @cute.jit
    def release_stage(self, ring, release_state):
        """A consumer warp is done reading a stage; with gathered rows the next copies into it
        (generic proxy) are ordered after the MMAs that read it (async proxy) first."""
        if cutlass.const_expr(self.gather_rows):
            cute.arch.fence_proxy("async.shared", space="cta")
        ring.consumer_release(release_state)

    def shared_storage_type(
        self, ab_dtype, x_layout, w_layout, staged_dtype, out_layout, tail_layout
    ):
        """The kernel's shared memory as a cute.struct (plain Python, run while tracing)."""
        fields = {
            "ring_barriers": cute.struct.MemRange[cutlass.Int64, self.stages * 2],
            "unit_barriers": cute.struct.MemRange[cutlass.Int64, UNIT_QUEUE_SLOTS * 2],
            "units": cute.struct.MemRange[cutlass.Int32, UNIT_QUEUE_SLOTS],
            # split_k: whether this CTA arrived last at the tile, told to the whole team
            "last_arrival": cute.struct.MemRange[cutlass.Int32, 1],
            # staging buffer b: full/empty mbarriers and the staged tile's (row0, rows, col tile)
            "store_barriers": cute.struct.MemRange[cutlass.Int64, self.epilogue_buffers * 2],
            "staged_tiles": cute.struct.MemRange[cutlass.Int32, 3 * self.epilogue_buffers],
            "sX": cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(x_layout)], 1024],
            "sW": cute.struct.Align[cute.struct.MemRange[ab_dtype, cute.cosize(w_layout)], 1024],
        }
        if tail_layout is not None:
            fields["sXTail"] = cute.struct.Align[
                cute.struct.MemRange[ab_dtype, cute.cosize(tail_layout)], 1024
            ]
        fields["sOut"] = cute.struct.Align[
            cute.struct.MemRange[staged_dtype, cute.cosize(out_layout)], 128
        ]
        if self.staged_scale_words:
            fields["step_scales"] = cute.struct.Align[
                cute.struct.MemRange[cutlass.Float32, self.staged_scale_words], 128
            ]
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    @cute.kernel
    def kernel(
        self,
        tma_x,
        mX: cute.Tensor,
        tma_w: cute.CopyAtom,
        mW: cute.Tensor,
        mXScales,
        mWScales,
        mOut: cute.Tensor,
        mOutScales,
        mOffsets: cute.Tensor,
        mRowScale,
        mPartials,
        mArrivals,
        mUnitCounter,
        mRowSource,
        mExpertCounts,
        mBias,
        tiled_mma: cute.TiledMma,
        slice_mma: cute.TiledMma,
        x_layout: cute.ComposedLayout,
        w_layout: cute.ComposedLayout,
        out_layout: cute.Layout,
        tma_x_tail,
        mXTail,
        tail_mma,
        tail_layout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        block_idx, _, _ = cute.arch.block_idx()
        if warp_idx == 0:
            if cutlass.const_expr(not self.gather_rows):
                cpasync.prefetch_descriptor(tma_x)
            if cutlass.const_expr(self.tail_rows > 0):
                cpasync.prefetch_descriptor(tma_x_tail)
            cpasync.prefetch_descriptor(tma_w)

        storage = SmemAllocator().allocate(self.shared_storage)
        # dynamic_schedule: the producer tells the consumers each tile's schedule unit (lane 0
        # writes it; every thread of the team working that tile reads it); the ring's creation
        # syncs both. A static schedule's units are known to all: consumers compute their own
        unit_queue = None
        if cutlass.const_expr(self.dynamic_schedule):
            unit_queue = pipeline.PipelineAsync.create(
                barrier_storage=storage.unit_barriers.data_ptr(),
                num_stages=UNIT_QUEUE_SLOTS,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.tile_threads),
                defer_sync=True,
            )
        sUnits = storage.units.get_tensor(cute.make_layout(UNIT_QUEUE_SLOTS))
        # staging buffer b holds the b-th of every epilogue_buffers tiles of the CTA (with
        # pingpong, buffer b is team b's): the consumer team fills it, the store warps drain it
        store_queue = None
        if cutlass.const_expr(self.store_warps):
            store_queue = self.tile_store.make_queue(storage.store_barriers.data_ptr())
        sStagedTiles = storage.staged_tiles.get_tensor(cute.make_layout((3, self.epilogue_buffers)))
        ring = self.make_ring(storage, x_layout, w_layout)
        sX = storage.sX.get_tensor(x_layout.outer, swizzle=x_layout.inner)
        sW = storage.sW.get_tensor(w_layout.outer, swizzle=w_layout.inner)
        sOut = storage.sOut.get_tensor(out_layout)
        tail = None
        if cutlass.const_expr(self.tail_rows > 0):
            tail = TailOperands(
                tma=tma_x_tail,
                mX=mXTail,
                sX=storage.sXTail.get_tensor(tail_layout.outer, swizzle=tail_layout.inner),
                mma=tail_mma,
            )
        sStepScales = None
        if cutlass.const_expr(self.staged_scale_words > 0):
            sStepScales = storage.step_scales.get_tensor(cute.make_layout(self.staged_scale_words))
        # nothing above touched global memory: from here on, the previous kernel's writes are
        # visible (and it no longer reads what this one writes); a kernel launched after this one
        # may already set up on SMs this grid leaves. With weights_before_wait the producer warp
        # waits later, after its first weight loads
        if cutlass.const_expr(self.weights_before_wait):
            if warp_idx != 0:
                cute.arch.griddepcontrol_wait()
                cute.arch.griddepcontrol_launch_dependents()
            elif cutlass.const_expr(self.polls_offsets):
                self.await_offsets(mOffsets)
        else:
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()

        walk = self.schedule_args(mOffsets, mExpertCounts, mX, mW, mOut, block_idx=block_idx)
        # (tile_cols, TILE_K, col tiles, k tiles, E); this CTA loads its slice of each weight
        # tile and multicasts it to the cluster
        gW = cute.local_tile(mW, (self.tile_cols, self.tile_k), (None, None, None))
        tWsW, tWgW = cpasync.tma_partition(
            tma_w,
            walk.cluster_rank,
            cute.make_layout(self.cluster_rows),
            cute.group_modes(sW, 0, 2),
            cute.group_modes(gW, 0, 2),
        )
        cluster_mask = cutlass.Int16((1 << self.cluster_rows) - 1)
        warpgroup_idx = cute.arch.make_warp_uniform(tidx // THREADS_PER_WARPGROUP)

        if warpgroup_idx == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGISTERS)
            if warp_idx == 0:
                self.produce(
                    ring,
                    unit_queue,
                    sUnits,
                    walk,
                    tma_x,
                    mX,
                    sX,
                    tma_w,
                    tWsW,
                    tWgW,
                    mRowSource,
                    mUnitCounter,
                    tail,
                    cluster_mask=cluster_mask,
                )
            elif cutlass.const_expr(self.store_warps):
                self.tile_store.run(sOut, sStagedTiles, mOut, mOutScales, store_queue, tidx - 32)
        else:
            cute.arch.setmaxregister_increase(CONSUMER_REGISTERS)
            self.consume(
                ring,
                unit_queue,
                sUnits,
                store_queue,
                sStagedTiles,
                storage.last_arrival.get_tensor(cute.make_layout(1)),
                sX,
                sW,
                sOut,
                tiled_mma,
                slice_mma,
                walk,
                mXScales,
                mWScales,
                sStepScales,
                EpilogueTensors(
                    mOut=mOut,
                    mOutScales=mOutScales,
                    mRowScale=mRowScale,
                    mBias=mBias,
                    mPartials=mPartials,
                    mArrivals=mArrivals,
                ),
                tail,
                tidx=tidx,
                warpgroup_idx=warpgroup_idx,
            )

    def make_ring(self, storage, x_layout, w_layout):
        """The TMA ring's pipeline (plain Python, run while tracing). A stage is full once its
        TMA bytes landed and (gathered rows) every lane of the producer warp counted its copies
        in; it is read by the warps of one tile's warpgroups, in every CTA of the cluster (each
        CTA's TMA writes into all of them): every warp releases it everywhere."""
        tx_bytes = cute.size_in_bytes(self.ab_dtype, cute.slice_(w_layout, (None, None, 0)))
        producer_arrivals = 1
        if cutlass.const_expr(self.gather_rows):
            producer_arrivals = 1 + 32
        else:
            tx_bytes = tx_bytes + cute.size_in_bytes(
                self.ab_dtype, cute.slice_(x_layout, (None, None, 0))
            )
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ring_barriers.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, producer_arrivals),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.tile_warpgroups * 4 * self.cluster_rows
            ),
            tx_count=tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_rows, 1, 1)),
        )

    @cute.jit
    def schedule_args(self, mOffsets, mExpertCounts, mX, mW, mOut, *, block_idx):
        """This launch's ScheduleArgs, read after the wait for the previous kernel."""
        num_experts = cute.size(mOffsets) - 1
        # the experts the walk visits: none when the valid rows are outside this variant's range
        walked_experts = self.schedule.experts_to_walk(mOffsets, num_experts)
        n_cols = cute.size(mW, mode=[0])
        col_tiles = (n_cols + self.tile_cols - 1) // self.tile_cols
        k_tiles = (cute.size(mX, mode=[1]) + self.tile_k - 1) // self.tile_k
        col_units = col_tiles * self.split_k
        # the batch's rows (reduce_out: out holds the tokens' rows, x the batch)
        capacity = cute.size(mX if self.reduce_out else mOut, mode=[0])
        # the cluster walks the schedule's units; this CTA takes row tile `cluster_rank` of each
        cluster_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_idx = block_idx // self.cluster_rows
        num_clusters = cute.arch.grid_dim()[0] // self.cluster_rows
        return ScheduleArgs(
            mOffsets=mOffsets,
            mExpertCounts=mExpertCounts,
            experts=walked_experts,
            n_cols=n_cols,
            col_tiles=col_tiles,
            col_units=col_units,
            k_tiles=k_tiles,
            capacity=capacity,
            cluster_rank=cluster_rank,
            cluster_idx=cluster_idx,
            num_clusters=num_clusters,
        )

    @cute.jit
    def find_tile(self, walk, unit, expert, first):
        """The schedule's walk from (expert, first) to the expert owning unit `unit`
        (TileSchedule.next_tile): (expert, its first unit, its row units, its first row, its
        row end, found)."""
        return self.schedule.next_tile(
            unit,
            expert,
            first,
            walk.mOffsets,
            walk.experts,
            walk.col_units,
            walk.capacity,
            walk.mExpertCounts,
        )

    @cute.jit
    def tile_at(self, walk, unit, first, row_units, expert_row0):
        """This CTA's tile of schedule unit `unit` of the expert whose units start at `first`:
        (its first batch row, its column tile, its K slice, the slice's K tiles [begin, end))."""
        row0, col_tile, split = self.schedule.tile_origin(
            unit - first, row_units, walk.col_tiles, expert_row0, walk.cluster_rank
        )
        k_begin, k_end = self.schedule.k_slice(split, walk.k_tiles)
        return row0, col_tile, split, k_begin, k_end

    @cute.jit
    def produce(
        self,
        ring,
        unit_queue,
        sUnits,
        walk,
        tma_x,
        mX,
        sX,
        tma_w,
        tWsW,
        tWgW,
        mRowSource,
        mUnitCounter,
        tail,
        *,
        cluster_mask,
    ):
        """Producer warp: walks the schedule and loads each tile's K tiles into the ring (with
        dynamic_schedule taking each unit after the first from the counter and telling it to
        the consumers)."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        unit = cutlass.Int32(walk.cluster_idx)
        expert, first, row_units, expert_row0, expert_row_end, found = self.find_tile(
            walk, unit, cutlass.Int32(0), cutlass.Int32(0)
        )
        # stages of the first tile whose weights are loading already (their full barriers armed
        # for the whole stage; only the rows are left to load)
        weights_loading = cutlass.Int32(0)
        if cutlass.const_expr(self.weights_before_wait):
            if found:
                _, col_tile, _, k_begin, k_end = self.tile_at(
                    walk, unit, first, row_units, expert_row0
                )
                weights_loading = self.load_weights_early(
                    ring,
                    tma_w,
                    tWsW,
                    tWgW,
                    expert=expert,
                    col_tile=col_tile,
                    k_begin=k_begin,
                    k_end=k_end,
                )
                if cutlass.const_expr(self.l2_prefetch_ctas > 0):
                    if walk.cluster_idx < self.l2_prefetch_ctas:
                        self.prefetch_later_weights(tma_w, tWgW, walk, expert, first)
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        unit_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Producer, UNIT_QUEUE_SLOTS
        )
        if cutlass.const_expr(self.dynamic_schedule):
            self.schedule.send_unit(unit_queue, sUnits, unit_state, unit)
            unit_state.advance()
        while found:
            row0, col_tile, _, k_begin, k_end = self.tile_at(
                walk, unit, first, row_units, expert_row0
            )
            state_after = self.load_tile(
                ring,
                state,
                tma_x,
                mX,
                sX,
                tma_w,
                tWsW,
                tWgW,
                mRowSource,
                tail,
                expert=expert,
                row0=row0,
                expert_row0=expert_row0,
                expert_row_end=expert_row_end,
                col_tile=col_tile,
                k_begin=k_begin,
                k_end=k_end,
                weights_loading=weights_loading,
                cluster_mask=cluster_mask,
            )
            weights_loading = cutlass.Int32(0)
            unit = self.schedule.following_unit(unit, walk.num_clusters, mUnitCounter)
            if cutlass.const_expr(self.dynamic_schedule):
                self.schedule.send_unit(unit_queue, sUnits, unit_state, unit)
                unit_state.advance()
            expert, first, row_units, expert_row0, expert_row_end, found = self.find_tile(
                walk, unit, expert, first
            )
            # assigned last (consume says why)
            state = state_after
        if cutlass.const_expr(self.dynamic_schedule):
            if cutlass.const_expr(self.pingpong):
                # the unit past the schedule's end, for the other team too
                self.schedule.send_unit(unit_queue, sUnits, unit_state, unit)
            self.schedule.retire(mUnitCounter, walk.num_clusters)
        ring.producer_tail(state)

    @cute.jit
    def await_offsets(self, mOffsets):
        """polls_offsets, producer warp, before it reads the offsets: each lane spins with
        acquire loads until the word after the offsets is 1 (the routing kernel before this one
        stored them: the lane's later loads see them), or past OFFSETS_POLL_TIMEOUT_NS waits for
        that kernel to end."""
        offsets_ready = mOffsets.iterator + cute.size(mOffsets)
        start = cute.arch.globaltimer()
        waiting = cutlass.Int32(1)
        while waiting == 1:
            if cute.arch.load(offsets_ready, cutlass.Int32, sem="acquire", scope="gpu") == 1:
                waiting = cutlass.Int32(0)
            elif cute.arch.globaltimer() - start > OFFSETS_POLL_TIMEOUT_NS:
                cute.arch.griddepcontrol_wait()
                waiting = cutlass.Int32(0)

    @cute.jit
    def load_weights_early(self, ring, tma_w, tWsW, tWgW, *, expert, col_tile, k_begin, k_end):
        """weights_before_wait, producer warp: issues the first tile's weight loads (up to a
        ring's worth) before the wait; returns how many. Its stages' full barriers are armed
        for the whole stage: load_tile adds only the rows."""
        weights_loading = cutlass.min(k_end - k_begin, self.stages)
        weight_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
        tWgW_tile = tWgW[(None, col_tile, None, expert)]
        for k_tile in range(k_begin, k_begin + weights_loading):
            ring.producer_acquire(weight_state)
            cute.copy(
                tma_w,
                tWgW_tile[(None, k_tile)],
                tWsW[(None, weight_state.index)],
                tma_bar_ptr=ring.producer_get_barrier(weight_state),
                cache_policy=self.weight_cache_policy(),
            )
            weight_state.advance()
        return weights_loading

    @cute.jit
    def prefetch_later_weights(self, tma_w, tWgW, walk, expert, first):
        """l2_prefetch_ctas, producer warp of CTA b < P: prefetches into L2 every K tile of the
        weights of units b + P, b + 2P, ... below the grid's CTAs (the first tiles of CTAs
        the GPU places only once the kernel before frees their SMs), walking the schedule on
        from this CTA's own (expert, first)."""
        unit = walk.cluster_idx + self.l2_prefetch_ctas
        row_units = cutlass.Int32(0)
        expert_row0 = cutlass.Int32(0)
        found = cutlass.Boolean(False)
        if unit < walk.num_clusters:
            expert, first, row_units, expert_row0, _, found = self.find_tile(
                walk, unit, expert, first
            )
        while found:
            _, col_tile, _, k_begin, k_end = self.tile_at(walk, unit, first, row_units, expert_row0)
            tWgW_tile = tWgW[(None, col_tile, None, expert)]
            for k_tile in range(k_begin, k_end):
                cute.prefetch(tma_w, tWgW_tile[(None, k_tile)])
            unit = unit + self.l2_prefetch_ctas
            found = cutlass.Boolean(False)
            if unit < walk.num_clusters:
                expert, first, row_units, expert_row0, _, found = self.find_tile(
                    walk, unit, expert, first
                )

    @cute.jit
    def has_tail(self, row0, row_end):
        """tail_rows: whether the tile from batch row row0 holds tail rows, its expert's rows
        ending past its tile_rows but within tail_rows more (only an expert's last row tile can:
        tile_schedule)."""
        extra = row_end - row0 - self.tile_rows
        tail = cutlass.Boolean(False)
        if extra > 0:
            if extra <= self.tail_rows:
                tail = cutlass.Boolean(True)
        return tail

    @cute.jit
    def tail_fragments(self, tail, sW, team_tidx):
        """tail_rows, consumer thread: its warpgroup's tail MMAs, the weight rows [w C, (w + 1)
        C) of each stage's weight tile (C = tail_cols, w the warpgroup in the tile) by the
        stage's tail rows: (their accumulators, the A and B fragments of every stage, the
        accumulators' (weight row, batch row) coordinates within the tile)."""
        warpgroup_in_tile = team_tidx // THREADS_PER_WARPGROUP
        thr_tail = tail.mma.get_slice(team_tidx % THREADS_PER_WARPGROUP)
        sW_share = cute.local_tile(sW, (self.tail_cols, self.tile_k), (warpgroup_in_tile, 0, None))
        tCcC = thr_tail.partition_C(
            cute.domain_offset(
                (warpgroup_in_tile * self.tail_cols, self.tile_rows),
                cute.make_identity_tensor((self.tail_cols, self.tail_rows)),
            )
        )
        return (
            cute.make_rmem_tensor(tCcC.shape, cutlass.Float32),
            tail.mma.make_fragment_A(thr_tail.partition_A(sW_share)),
            tail.mma.make_fragment_B(thr_tail.partition_B(tail.sX)),
            tCcC,
        )

    def weight_cache_policy(self):
        """The L2 cache policy of the weight loads (plain Python, run while tracing):
        evict-first for decode tiles (evict_first_weights), else None (the default)."""
        if self.evict_first_weights:
            return cutlass.Int64(EVICT_FIRST_POLICY)
        return None

    @cute.jit
    def load_tile(
        self,
        ring,
        state,
        tma_x,
        mX,
        sX,
        tma_w,
        tWsW,
        tWgW,
        mRowSource,
        tail,
        *,
        expert,
        row0,
        expert_row0,
        expert_row_end,
        col_tile,
        k_begin,
        k_end,
        weights_loading,
        cluster_mask,
    ):
        """Producer warp: loads K tiles [k_begin, k_end) of a tile into the ring, the rows by
        TMA (or gathered by the warp's lanes) and the weights by TMA (multicast to the cluster;
        the first `weights_loading` of them are loading already), and a tile with tail rows
        those rows into the stage's tail buffer; returns the ring's state."""
        tXsX = tXgX = tile_tokens = None
        tail_sX = tail_gX = None
        has_tail = cutlass.Boolean(False)
        if cutlass.const_expr(self.tail_rows > 0):
            has_tail = self.has_tail(row0, expert_row_end)
            gX_tail = cute.local_tile(
                cute.domain_offset((row0 + self.tile_rows, 0), tail.mX),
                (self.tail_rows, self.tile_k),
                (0, None),
            )
            tail_sX, tail_gX = cpasync.tma_partition(
                tail.tma,
                0,
                cute.make_layout(1),
                cute.group_modes(tail.sX, 0, 2),
                cute.group_modes(gX_tail, 0, 2),
            )
        if cutlass.const_expr(self.gather_rows):
            # the tile's rows of this expert (none for an empty tile)
            tile_tokens = self.tile_tokens(mRowSource, row0, expert_row_end - row0)
        else:
            if row0 >= expert_row_end:
                # an empty tile (the cluster's partner has the expert's last row tile): load
                # rows that exist; nothing reads them
                row0 = expert_row0
            gX = cute.local_tile(
                cute.domain_offset((row0, 0), mX),
                (self.tile_rows, self.tile_k),
                (0, None),
            )
            tXsX, tXgX = cpasync.tma_partition(
                tma_x,
                0,
                cute.make_layout(1),
                cute.group_modes(sX, 0, 2),
                cute.group_modes(gX, 0, 2),
            )
        tWgW_tile = tWgW[(None, col_tile, None, expert)]
        for k_tile in range(k_begin, k_end):
            weights_loaded = k_tile - k_begin < weights_loading
            if not weights_loaded:
                ring.producer_acquire(state)
            barrier = ring.producer_get_barrier(state)
            if cutlass.const_expr(self.tail_rows > 0):
                if has_tail:
                    # the tail's bytes join the stage's before any of its loads is issued (the
                    # stage's own rows are still to land, so its phase cannot end without them)
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_expect_tx(barrier, self.tail_bytes)
                    cute.copy(
                        tail.tma,
                        tail_gX[(None, k_tile)],
                        tail_sX[(None, state.index)],
                        tma_bar_ptr=barrier,
                    )
            if cutlass.const_expr(not self.gather_rows):
                cute.copy(
                    tma_x,
                    tXgX[(None, k_tile)],
                    tXsX[(None, state.index)],
                    tma_bar_ptr=barrier,
                )
            if cutlass.const_expr(self.cluster_rows > 1):
                cute.copy(
                    tma_w,
                    tWgW_tile[(None, k_tile)],
                    tWsW[(None, state.index)],
                    tma_bar_ptr=barrier,
                    mcast_mask=cluster_mask,
                )
            elif not weights_loaded:
                cute.copy(
                    tma_w,
                    tWgW_tile[(None, k_tile)],
                    tWsW[(None, state.index)],
                    tma_bar_ptr=barrier,
                    cache_policy=self.weight_cache_policy(),
                )
            if cutlass.const_expr(self.gather_rows):
                self.gather_stage(
                    mX,
                    sX[(None, None, state.index)],
                    tile_tokens,
                    rows=expert_row_end - row0,
                    k_tile=k_tile,
                )
                cute.arch.cp_async_mbarrier_arrive_noinc(barrier)
            ring.producer_commit(state)
            state.advance()
        return state

    @cute.jit
    def consume(
        self,
        ring,
        unit_queue,
        sUnits,
        store_queue,
        sStagedTiles,
        sLastArrival,
        sX,
        sW,
        sOut,
        tiled_mma,
        slice_mma,
        walk,
        mXScales,
        mWScales,
        sStepScales,
        tensors,
        tail,
        *,
        tidx,
        warpgroup_idx,
    ):
        """Consumer warpgroup: walks the schedule with its team, runs each tile's mainloop on
        the ring (with its tail's MMAs where it holds tail rows) and its epilogue.

        The mainloops return the ring's states (a helper's dynamic loop rebinds its own
        names: the caller's state objects do not advance in place). The tile loop assigns them
        last, after the schedule's values: the DSL carries a loop's values in the order their
        names are first assigned in it, then the names whose methods it calls, and the
        registers they get follow that order; assigned last, the states keep the place they
        have when the loop calls their advance() itself, and the kernel compiles to the same
        SASS as with the mainloops written inline."""
        consumer_tidx = tidx - THREADS_PER_WARPGROUP
        # the consumer warpgroups that work one tile together (all of them, or with pingpong
        # one warpgroup taking every other tile of the CTA): `teams` teams take turns
        team = 0
        teams = self.num_consumer_warpgroups // self.tile_warpgroups
        if cutlass.const_expr(self.pingpong):
            team = warpgroup_idx - 1
        team_tidx = consumer_tidx - team * self.tile_threads
        thr_mma = tiled_mma.get_slice(team_tidx)
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((self.mma_m, self.mma_n)))
        accumulators = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
        # the MMAs' operands, as one column slice's MMAs read them (the whole tile's but in FP8
        # tiles of two weight blocks)
        sA, sB = (sW, sX) if self.swap_ab else (sX, sW)
        thr_slice = slice_mma.get_slice(team_tidx)
        tCrA = slice_mma.make_fragment_A(thr_slice.partition_A(sA))
        tCrB_slices = [
            slice_mma.make_fragment_B(thr_slice.partition_B(sB_slice))
            for sB_slice in self.column_slices(sB)
        ]
        # the tail's MMAs (plain locals: the tile loop carries its values by name)
        tail_mma = tail_accumulators = tail_tCrA = tail_tCrB = tail_tCcC = None
        if cutlass.const_expr(self.tail_rows > 0):
            tail_mma = tail.mma
            tail_accumulators, tail_tCrA, tail_tCrB, tail_tCcC = self.tail_fragments(
                tail, sW, team_tidx
            )
        promotion = None
        if cutlass.const_expr(self.block_scaled):
            promotion = self.promotion_registers(
                tCcC, thr_slice.partition_C(cute.make_identity_tensor(self.slice_shape()))
            )
        read_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Consumer, self.stages
        )
        epilogue_barrier = pipeline.NamedBarrier(
            barrier_id=BarrierId.EPILOGUE + team, num_threads=self.tile_threads
        )
        sOut_team = sOut[(None, None, team)]
        # pingpong: wait for my turn at the tensor cores, then pass it on to the other team
        my_turn = pipeline.NamedBarrier(
            barrier_id=BarrierId.MMA_TURN + team, num_threads=self.num_consumer_threads
        )
        other_turn = pipeline.NamedBarrier(
            barrier_id=BarrierId.MMA_TURN + 1 - team, num_threads=self.num_consumer_threads
        )
        # mma_turns: warpgroup w of the tile waits on turns[w] before its batches of MMAs
        turns = None
        if cutlass.const_expr(self.mma_turns):
            turns = [
                pipeline.NamedBarrier(
                    barrier_id=BarrierId.MMA_TURN + w, num_threads=self.num_consumer_threads
                )
                for w in range(2)
            ]
        unit_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Consumer, UNIT_QUEUE_SLOTS
        )
        # this team's staging buffer (its index stays `team`; the phase follows its tiles)
        store_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Producer, self.epilogue_buffers
        )
        if cutlass.const_expr(self.pingpong):
            # the ring and the unit queue hold the tiles in CTA order: skip the other team's
            # first tile
            read_state.advance(team * walk.k_tiles)
            release_state.advance(team * walk.k_tiles)
            unit_state.advance(team)
            store_state.advance(team)

        # first batch row of this warpgroup's accumulator slab (the weight's side with swap_ab,
        # or a whole tile with pingpong: never skipped)
        slab_row0 = 0
        if cutlass.const_expr(not self.swap_ab and not self.pingpong):
            slab_row0 = (warpgroup_idx - 1) * 64
        unit = cutlass.Int32(walk.cluster_idx) + team * walk.num_clusters
        if cutlass.const_expr(self.dynamic_schedule):
            unit = self.schedule.receive_unit(unit_queue, sUnits, unit_state)
            unit_state.advance(teams)
        expert, first, row_units, expert_row0, row_end, found = self.find_tile(
            walk, unit, cutlass.Int32(0), cutlass.Int32(0)
        )
        while found:
            row0, col_tile, split, k_begin, k_end = self.tile_at(
                walk, unit, first, row_units, expert_row0
            )
            slice_tiles = k_end - k_begin
            # a plain False without tail_rows: the branch that runs a tail is a constant-false
            # one, which compiles away (the same SASS as a kernel without that branch)
            has_tail = False
            if cutlass.const_expr(self.tail_rows > 0):
                has_tail = self.has_tail(row0, row_end)
                tail_accumulators.fill(0.0)
                tail_mma.set(warpgroup.Field.ACCUMULATE, True)

            accumulators.fill(0.0)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
            if cutlass.const_expr(self.pingpong):
                # the CTA's first tile (team 0's) starts at once; every later one waits for the
                # other team's mainloop
                if unit > walk.cluster_idx:
                    my_turn.arrive_and_wait()
            # the ring's states after this tile's stages (unchanged until a mainloop's return)
            read_after, release_after = read_state, release_state
            if row0 + slab_row0 < row_end:
                if cutlass.const_expr(self.block_scaled):
                    # both warpgroups run MMAs (the second's slab holds rows): they take turns
                    paired = cutlass.Boolean(True)
                    if cutlass.const_expr(not self.swap_ab):
                        paired = row0 + 64 < row_end
                    read_after, release_after = self.mma_tile_fp8(
                        ring,
                        read_state,
                        release_state,
                        slice_mma,
                        accumulators,
                        tCrA,
                        tCrB_slices,
                        tCcC,
                        promotion,
                        mXScales,
                        mWScales,
                        sStepScales,
                        walk,
                        turns,
                        epilogue_barrier,
                        expert=expert,
                        col_tile=col_tile,
                        row0=row0,
                        k_begin=k_begin,
                        slice_tiles=slice_tiles,
                        paired=paired,
                        warpgroup_in_tile=team_tidx // THREADS_PER_WARPGROUP,
                        team_tidx=team_tidx,
                    )
                elif has_tail:
                    read_after, release_after = self.mma_tile(
                        ring,
                        read_state,
                        release_state,
                        tiled_mma,
                        accumulators,
                        tCrA,
                        tCrB_slices[0],
                        slice_tiles=slice_tiles,
                        tail_mma=tail_mma,
                        tail_accumulators=tail_accumulators,
                        tail_tCrA=tail_tCrA,
                        tail_tCrB=tail_tCrB,
                    )
                else:
                    read_after, release_after = self.mma_tile(
                        ring,
                        read_state,
                        release_state,
                        tiled_mma,
                        accumulators,
                        tCrA,
                        tCrB_slices[0],
                        slice_tiles=slice_tiles,
                    )
            else:
                # a warpgroup whose 64-row slab lies wholly past the expert's rows skips its
                # MMAs (it still drains the ring): tail tiles cost what their rows need
                read_after, release_after = self.skip_tile(
                    ring, read_state, release_state, slice_tiles=slice_tiles
                )
            if cutlass.const_expr(self.pingpong):
                other_turn.arrive()
                # the other team's next tile sits between this tile and my next one
                read_after.advance(walk.k_tiles)
                release_after.advance(walk.k_tiles)

            self.finish_tile(
                accumulators,
                tCcC,
                tail_accumulators,
                tail_tCcC,
                sOut_team,
                sStagedTiles[(None, team)],
                sLastArrival,
                store_queue,
                store_state,
                tensors,
                unit=unit,
                split=split,
                expert=expert,
                row0=row0,
                row_end=row_end,
                col_tile=col_tile,
                n_cols=walk.n_cols,
                team_tidx=team_tidx,
                barrier=epilogue_barrier,
                has_tail=has_tail,
            )
            store_state.advance(teams)
            if cutlass.const_expr(self.dynamic_schedule):
                unit = self.schedule.receive_unit(unit_queue, sUnits, unit_state)
                unit_state.advance(teams)
            else:
                unit = unit + walk.num_clusters * teams
            expert, first, row_units, expert_row0, row_end, found = self.find_tile(
                walk, unit, expert, first
            )
            # assigned last: see the docstring
            release_state, read_state = release_after, read_after
        # the team's schedule ended: the store warps stop at the first team that says so
        self.tile_store.end(
            sStagedTiles[(None, team)], store_queue, store_state, team_tidx=team_tidx
        )

    @cute.jit
    def mma_tile(
        self,
        ring,
        read_state,
        release_state,
        tiled_mma,
        accumulators,
        tCrA,
        tCrB,
        *,
        slice_tiles,
        tail_mma=None,
        tail_accumulators=None,
        tail_tCrA=None,
        tail_tCrB=None,
    ):
        """Consumer team, bf16: accumulators += the MMAs of `slice_tiles` K tiles from the
        ring, one wgmma batch kept in flight (a stage is released once the batch after the one
        that read it is issued), with tail_accumulators the tail's MMAs in the same batches;
        returns the ring's (read, release) states."""
        num_k_blocks = cute.size(tCrA, mode=[2])
        warpgroup.fence()
        for k_tile in range(slice_tiles):
            ring.consumer_wait(read_state)
            if cutlass.const_expr(self.gather_rows):
                # the MMAs (async proxy) read rows the copies (generic) wrote
                cute.arch.fence_proxy("async.shared", space="cta")
            for k_block in cutlass.range_constexpr(num_k_blocks):
                coord = (None, None, k_block, read_state.index)
                cute.gemm(tiled_mma, accumulators, tCrA[coord], tCrB[coord], accumulators)
            if cutlass.const_expr(tail_accumulators is not None):
                for k_block in cutlass.range_constexpr(num_k_blocks):
                    coord = (None, None, k_block, read_state.index)
                    cute.gemm(
                        tail_mma,
                        tail_accumulators,
                        tail_tCrA[coord],
                        tail_tCrB[coord],
                        tail_accumulators,
                    )
            warpgroup.commit_group()
            # keep one wgmma batch in flight; release the stage before it
            warpgroup.wait_group(1)
            if k_tile > 0:
                self.release_stage(ring, release_state)
                release_state.advance()
            read_state.advance()
        warpgroup.wait_group(0)
        self.release_stage(ring, release_state)
        release_state.advance()
        return read_state, release_state

    @cute.jit
    def skip_tile(self, ring, read_state, release_state, *, slice_tiles):
        """Consumer team whose slab has no rows: drains the tile's stages from the ring
        without MMAs; returns the ring's (read, release) states."""
        for k_tile in range(slice_tiles):
            ring.consumer_wait(read_state)
            ring.consumer_release(release_state)
            release_state.advance()
            read_state.advance()
        return read_state, release_state

    def slice_shape(self):
        """FP8: the (MMA M, MMA N) of one column slice's MMAs (plain Python)."""
        return (self.mma_m, self.mma_n // self.mma_slices)

    def column_slices(self, sB):
        """The MMA B operand's ring, one view per column slice (plain Python, run while
        tracing): mma_slices views of mma_n / mma_slices rows each (whole 8-row swizzle atoms,
        so each is a ring the MMAs read as they read the whole one)."""
        if self.mma_slices == 1:
            return [sB]
        rows = self.mma_n // self.mma_slices
        return [
            cute.local_tile(sB, (rows, self.tile_k), (s, 0, None)) for s in range(self.mma_slices)
        ]

    def promotion_registers(self, tCcC, tCcC_slice):
        """FP8: the registers of the promotions beside the running sum (plain Python, run while
        tracing): (group_products, finished_products, pending_scales, scales_ahead, overlapped).
        A scale group's MMAs (of one column slice) accumulate in group_products before they are
        scaled into the sum (overlapped: from finished_products, with the scales in
        pending_scales); scales_ahead holds the next K tile's scales (step_scales).
        Column slice s's value i is the running sum's value s * (a slice's values) + i: each
        fragment is one MMA atom's ((2, 2, column blocks of 8), 1, 1), the blocks outermost."""
        if self.mma_slices > 1:
            (_, _, blocks), m_atoms, n_atoms = tCcC.shape
            (_, _, slice_blocks), _, _ = tCcC_slice.shape
            if (m_atoms, n_atoms, blocks) != (1, 1, self.mma_slices * slice_blocks):
                raise ValueError(
                    f"the column slices' fragments {tCcC_slice.shape} do not tile the tile's "
                    f"{tCcC.shape}"
                )
        overlapped = self.overlaps_promotion(tCcC.shape)
        group_products = cute.make_rmem_tensor(tCcC_slice.shape, cutlass.Float32)
        finished_products = None
        if overlapped:
            finished_products = cute.make_rmem_tensor(tCcC.shape, cutlass.Float32)
        pending_scales = cute.make_rmem_tensor(self.x_scale_slots(tCcC.shape) + 2, cutlass.Float32)
        scales_ahead = None
        if self.scales_ahead:
            scales_ahead = cute.make_rmem_tensor(
                self.step_scale_values(tCcC.shape), cutlass.Float32
            )
        return group_products, finished_products, pending_scales, scales_ahead, overlapped

    @cute.jit
    def mma_tile_fp8(
        self,
        ring,
        read_state,
        release_state,
        slice_mma,
        accumulators,
        tCrA,
        tCrB_slices,
        tCcC,
        promotion,
        mXScales,
        mWScales,
        sStepScales,
        walk,
        turns,
        team_barrier,
        *,
        expert,
        col_tile,
        row0,
        k_begin,
        slice_tiles,
        paired,
        warpgroup_in_tile,
        team_tidx,
    ):
        """Consumer team, FP8: accumulators += the MMAs of `slice_tiles` K tiles from the ring,
        each scale group's products promoted with its scales. Overlapped, each group's
        products, once its MMAs are done, move to finished_products and are promoted while the
        next group's MMAs run (no MMA is left in flight across a wait on the ring; the first
        promotion adds zeros); otherwise each group's products of each column slice are
        promoted as soon as their MMAs are done (slice_mma: one slice's MMAs; tCrB_slices: the
        B operand of each), and with mma_turns, where both warpgroups have rows (`paired`),
        they issue each batch in turns (take_mma_turn). With staged_scale_k_tiles the tile's
        scales are staged in sStepScales first (stage_scales, the team meeting on
        `team_barrier`). Returns the ring's (read, release) states."""
        group_products, finished_products, pending_scales, scales_ahead, overlapped = promotion
        in_turns = self.mma_turns and not overlapped
        k_blocks_per_group = cute.size(tCrA, mode=[2]) // self.groups_per_tile
        slice_values = cute.size(group_products)
        if cutlass.const_expr(overlapped):
            finished_products.fill(0.0)
            pending_scales.fill(0.0)
        if cutlass.const_expr(self.prefetch_weight_scales):
            tidx, _, _ = cute.arch.thread_idx()
            for k_tile in range(tidx % self.tile_threads, slice_tiles, self.tile_threads):
                self.prefetch_scales(mWScales, expert, col_tile, k_begin + k_tile, walk.n_cols)
        scale_sources = (mXScales, mWScales, tCcC)
        # the tile whose scales step_scales loads
        where = dict(expert=expert, col_tile=col_tile, row0=row0, walk=walk)
        if cutlass.const_expr(self.scales_ahead):
            first = self.step_scales(*scale_sources, k_tile=k_begin, **where)
            self.hold_step_scales(scales_ahead, *first)
        if cutlass.const_expr(self.staged_scale_words > 0):
            self.stage_scales(
                sStepScales,
                mXScales,
                mWScales,
                team_barrier,
                team_tidx=team_tidx,
                k_begin=k_begin,
                slice_tiles=slice_tiles,
                **where,
            )
        for k_tile in range(slice_tiles):
            if cutlass.const_expr(self.scales_ahead):
                # this K tile's scales, loaded a step ago; the next one's loads are in flight
                # through this step's MMAs
                x_scales, weight_scales = self.held_step_scales(scales_ahead, tCcC)
                next_k_tile = k_begin + cutlass.min(k_tile + 1, slice_tiles - 1)
                ahead = self.step_scales(*scale_sources, k_tile=next_k_tile, **where)
                self.hold_step_scales(scales_ahead, *ahead)
            elif cutlass.const_expr(self.staged_scale_words > 0):
                x_scales, weight_scales = self.staged_step_scales(sStepScales, tCcC, k_tile=k_tile)
            else:
                # issued before the wait: the loads' latency hides behind it
                x_scales, weight_scales = self.step_scales(
                    *scale_sources, k_tile=k_begin + k_tile, **where
                )
            ring.consumer_wait(read_state)
            stage = read_state.index
            for group in cutlass.range_constexpr(self.groups_per_tile):
                for column_slice in cutlass.range_constexpr(self.mma_slices):
                    tCrB = tCrB_slices[column_slice]
                    if cutlass.const_expr(in_turns):
                        self.take_mma_turn(turns, paired, warpgroup_in_tile)
                    warpgroup.fence()
                    slice_mma.set(warpgroup.Field.ACCUMULATE, False)
                    for k_block in cutlass.range_constexpr(k_blocks_per_group):
                        coord = (None, None, group * k_blocks_per_group + k_block, stage)
                        cute.gemm(
                            slice_mma, group_products, tCrA[coord], tCrB[coord], group_products
                        )
                        slice_mma.set(warpgroup.Field.ACCUMULATE, True)
                    warpgroup.commit_group()
                    if cutlass.const_expr(overlapped):
                        self.promote(accumulators, finished_products, pending_scales)
                        warpgroup.wait_group(0)
                        finished_products.store(group_products.load())
                        self.keep_scales(pending_scales, x_scales[group], weight_scales)
                    else:
                        if cutlass.const_expr(in_turns):
                            self.pass_mma_turn(turns, paired, warpgroup_in_tile)
                        warpgroup.wait_group(0)
                        if cutlass.const_expr(column_slice == 0):
                            self.keep_scales(pending_scales, x_scales[group], weight_scales)
                        self.promote(
                            accumulators,
                            group_products,
                            pending_scales,
                            first=column_slice * slice_values,
                        )
                        if cutlass.const_expr(in_turns):
                            self.end_mma_turn(turns, paired, warpgroup_in_tile)
            ring.consumer_release(release_state)
            release_state.advance()
            read_state.advance()
        if cutlass.const_expr(overlapped):
            self.promote(accumulators, finished_products, pending_scales)
        return read_state, release_state

    @cute.jit
    def take_mma_turn(self, turns, paired, warpgroup_in_tile):
        """FP8, mma_turns: before a batch of MMAs. The tile's warpgroups issue each batch in
        turns, the first warpgroup first: the second waits until the first has issued it.
        Each warpgroup's batch then runs on the tensor cores while the other promotes its
        own (issued together, the two batches' MMAs interleave and end together, and both
        warpgroups promote with the tensor cores idle)."""
        if paired and warpgroup_in_tile == 1:
            turns[1].arrive_and_wait()

    @cute.jit
    def pass_mma_turn(self, turns, paired, warpgroup_in_tile):
        """FP8, mma_turns: once a batch of MMAs is issued, the turn passes to the other
        warpgroup."""
        if paired:
            if warpgroup_in_tile == 0:
                turns[1].arrive()
            else:
                turns[0].arrive()

    @cute.jit
    def end_mma_turn(self, turns, paired, warpgroup_in_tile):
        """FP8, mma_turns: once a batch is promoted, the first warpgroup waits until the second
        has issued the same batch (long done: it issued right behind it) before it issues
        its next one; each turn barrier sees one wait and one arrival per batch."""
        if paired and warpgroup_in_tile == 0:
            turns[0].arrive_and_wait()

    @cute.jit
    def finish_tile(
        self,
        accumulators,
        tCcC,
        tail_accumulators,
        tail_tCcC,
        sOut,
        sStagedTile,
        sLastArrival,
        store_queue,
        store_state,
        tensors,
        *,
        unit,
        split,
        expert,
        row0,
        row_end,
        col_tile,
        n_cols,
        team_tidx,
        barrier,
        has_tail,
    ):
        """Consumer team: the tile's epilogue (tile_epilogue), from its accumulators (and a
        tail's) to the batch rows [row0, row_end) of its expert: split-K's sum, the bias, the
        output values staged in the team's buffer once it is free, and their copy-out."""
        # an empty tile of a cluster's last pair stores nothing; with split_k only the CTA that
        # completes the tile's sum stores it
        stores = row0 < row_end
        if cutlass.const_expr(self.split_k_sum is not None):
            stores = self.split_k_sum.sum_slices(
                accumulators,
                tensors.mPartials,
                tensors.mArrivals,
                sLastArrival,
                tile=unit // self.split_k,
                split=split,
                team_tidx=team_tidx,
                barrier=barrier,
            )
        stored_rows = cutlass.Int32(0)
        if stores:
            stored_rows = cutlass.min(row_end - row0, self.tile_rows)
            if cutlass.const_expr(self.tail_rows > 0):
                if has_tail:
                    stored_rows = row_end - row0
        if cutlass.const_expr(self.bias is not None):
            if stored_rows > 0:
                self.bias.add(
                    accumulators,
                    tCcC,
                    tensors.mBias,
                    expert=expert,
                    col_tile=col_tile,
                    n_cols=n_cols,
                )
        if cutlass.const_expr(self.tail_bias is not None):
            if has_tail:
                self.tail_bias.add(
                    tail_accumulators,
                    tail_tCcC,
                    tensors.mBias,
                    expert=expert,
                    col_tile=col_tile,
                    n_cols=n_cols,
                )
        self.tile_store.acquire(store_queue, store_state)
        if stored_rows > 0:
            self.output.stage(accumulators, tCcC, sOut, tensors.mRowScale, row0=row0)
            if cutlass.const_expr(self.tail_rows > 0):
                if has_tail:
                    self.tail_output.stage(
                        tail_accumulators,
                        tail_tCcC,
                        sOut,
                        tensors.mRowScale,
                        row0=row0,
                    )
        self.tile_store.hand_over(
            sOut,
            sStagedTile,
            tensors.mOut,
            tensors.mOutScales,
            store_queue,
            store_state,
            row0=row0,
            rows=stored_rows,
            col_tile=col_tile,
            team_tidx=team_tidx,
            barrier=barrier,
        )

    def step_scale_values(self, fragment_shape):
        """FP8: how many scales one K tile's promotions take (plain Python): each scale
        group's x scale per x_scale_slot, then the two weight scales."""
        return self.groups_per_tile * self.x_scale_slots(fragment_shape) + 2

    @cute.jit
    def step_scales(self, mXScales, mWScales, tCcC, *, expert, col_tile, row0, walk, k_tile):
        """FP8: K tile `k_tile`'s (x_scales, weight_scales), loaded from global memory
        (row_scales, weight_scales)."""
        weight_scales = self.weight_scales(mWScales, expert, col_tile, k_tile, walk.n_cols)
        x_scales = self.row_scales(mXScales, tCcC, row0=row0, capacity=walk.capacity, k_tile=k_tile)
        return x_scales, weight_scales

    @cute.jit
    def hold_step_scales(self, scales, x_scales, weight_scales):
        """FP8, scales_ahead: keeps a K tile's step_scales in the registers `scales`
        (step_scale_values of them, the groups' x scales first)."""
        slots = len(x_scales[0])
        for group in cutlass.range_constexpr(self.groups_per_tile):
            for slot in cutlass.range_constexpr(slots):
                scales[group * slots + slot] = x_scales[group][slot]
        for j in cutlass.range_constexpr(2):
            scales[self.groups_per_tile * slots + j] = weight_scales[j]

    def held_step_scales(self, scales, tCcC):
        """FP8, scales_ahead: the (x_scales, weight_scales) hold_step_scales kept in `scales`."""
        slots = self.x_scale_slots(tCcC.shape)
        x_scales = [
            [scales[group * slots + slot] for slot in range(slots)]
            for group in range(self.groups_per_tile)
        ]
        first_weight = self.groups_per_tile * slots
        return x_scales, (scales[first_weight], scales[first_weight + 1])

    @cute.jit
    def stage_scales(
        self,
        sStepScales,
        mXScales,
        mWScales,
        team_barrier,
        *,
        team_tidx,
        expert,
        col_tile,
        row0,
        walk,
        k_begin,
        slice_tiles,
    ):
        """FP8, staged_scale_k_tiles: the x and weight scales of the tile's K tiles [k_begin,
        k_begin + slice_tiles) from global memory into sStepScales, the team's threads taking
        every tile_threads-th word, all their loads in flight before their stores (a word
        past the slice reloads the last one and stores nothing; a row past the capacity reads
        the last row's scale, as row_scales does). The team meets before (the previous tile's
        steps have read theirs) and after."""
        groups, rows, x_words = self.groups_per_tile, self.tile_rows, self.staged_x_words
        x_bound = self.staged_scale_k_tiles * x_words
        team_barrier.arrive_and_wait()
        x_count = slice_tiles * x_words
        x_loads = (x_bound + self.tile_threads - 1) // self.tile_threads
        x_values = cute.make_rmem_tensor(x_loads, cutlass.Float32)
        for i in cutlass.range_constexpr(x_loads):
            word = cutlass.min(team_tidx + i * self.tile_threads, x_count - 1)
            k_tile = word // x_words
            group = (word // rows) % groups
            row = cutlass.min(row0 + word % rows, walk.capacity - 1)
            x_values[i] = mXScales[((k_begin + k_tile) * groups + group, row)]
        first, second = self.weight_scale_blocks(mWScales, col_tile, walk.n_cols)
        w_count = slice_tiles * 2
        w_loads = (2 * self.staged_scale_k_tiles + self.tile_threads - 1) // self.tile_threads
        w_values = cute.make_rmem_tensor(w_loads, cutlass.Float32)
        for i in cutlass.range_constexpr(w_loads):
            word = cutlass.min(team_tidx + i * self.tile_threads, w_count - 1)
            block = first + (second - first) * (word % 2)
            w_values[i] = mWScales[(expert, block, k_begin + word // 2)]
        for i in cutlass.range_constexpr(x_loads):
            word = team_tidx + i * self.tile_threads
            if word < x_count:
                sStepScales[word] = x_values[i]
        for i in cutlass.range_constexpr(w_loads):
            word = team_tidx + i * self.tile_threads
            if word < w_count:
                sStepScales[x_bound + word] = w_values[i]
        team_barrier.arrive_and_wait()

    @cute.jit
    def staged_step_scales(self, sStepScales, tCcC, *, k_tile):
        """FP8, staged_scale_k_tiles: K tile `k_tile`'s (x_scales, weight_scales) of the slice
        (counted from its first), as step_scales gives them, from sStepScales (stage_scales)."""
        x_words, rows = self.staged_x_words, self.tile_rows
        first_word = k_tile * x_words
        x_scales = [
            [sStepScales[first_word + group * rows + row] for row in self.slot_rows(tCcC)]
            for group in range(self.groups_per_tile)
        ]
        weight_word = self.staged_scale_k_tiles * x_words + 2 * k_tile
        return x_scales, (sStepScales[weight_word], sStepScales[weight_word + 1])

    @cute.jit
    def weight_scales(self, mWScales, expert, col_tile, k_tile, n_cols):
        """FP8: the scales of K tile `k_tile` (one weight block along K) for the two weight
        blocks a tile's columns fall in: with SwiGLU its gate rows and its up rows (each in one
        128-row block of the source w13, since I is a multiple of 128), else the tile's two
        128-column halves (one block, twice, for tiles of at most 128 columns)."""
        first, second = self.weight_scale_blocks(mWScales, col_tile, n_cols)
        return mWScales[(expert, first, k_tile)], mWScales[(expert, second, k_tile)]

    @cute.jit
    def prefetch_scales(self, mWScales, expert, col_tile, k_tile, n_cols):
        """FP8: prefetches into L2 the line of the first of weight_scales' two scales (in a
        packed weight both lie in one packet's scale words)."""
        first, _ = self.weight_scale_blocks(mWScales, col_tile, n_cols)
        offset = cute.crd2idx((expert, first, k_tile), mWScales.layout)
        cute.arch.prefetch((mWScales.iterator + offset).llvm_ptr, cache_level="L2")

    @cute.jit
    def weight_scale_blocks(self, mWScales, col_tile, n_cols):
        """FP8: the two weight blocks along N whose scales weight_scales reads."""
        blocks = cute.size(mWScales, mode=[1])
        first = cutlass.Int32(0)
        second = cutlass.Int32(0)
        if cutlass.const_expr(self.swiglu):
            half = self.tile_cols // 2
            first = col_tile * half // WEIGHT_BLOCK
            second = (n_cols // 2 + col_tile * half) // WEIGHT_BLOCK
        elif cutlass.const_expr(self.tile_cols > WEIGHT_BLOCK):
            first = col_tile * (self.tile_cols // WEIGHT_BLOCK)
            second = cutlass.min(first + 1, blocks - 1)
        else:
            first = col_tile * self.tile_cols // WEIGHT_BLOCK
            second = first
        return first, second

    def x_scale_slot(self, i, fragment_shape):
        """Which of a thread's batch rows accumulator value i belongs to (plain Python): the
        MMA's M side (2 rows per atom: a pingpong warpgroup holds two 64-row atoms of its
        128-row tile) or, with swap_ab, its N side (2 columns per block of 8)."""
        if self.swap_ab:
            return n_side_slot(i, fragment_shape)
        return m_side_slot(i, fragment_shape)

    def weight_scale_slot(self, i):
        """Which of weight_scales' two values accumulator value i takes (plain Python)."""
        if self.swiglu:
            return (i // self.partner_offset) % 2
        if not self.swap_ab and self.tile_cols > WEIGHT_BLOCK:
            return (8 * (i // 4)) // WEIGHT_BLOCK
        return 0

    @cute.jit
    def row_scales(self, mXScales, tCcC, *, row0, capacity, k_tile):
        """FP8: the x scales of this thread's batch rows for each scale group of K tile
        `k_tile`, [group][x_scale_slot], loaded from global memory (each thread holds the
        accumulators of a few rows: 2, or 2 per 8 columns of the N side with swap_ab). A row
        past the batch's capacity reads the last row's scale: its outputs are never stored."""
        rows = [cutlass.min(row0 + row, capacity - 1) for row in self.slot_rows(tCcC)]
        return [
            [mXScales[(k_tile * self.groups_per_tile + group, row)] for row in rows]
            for group in range(self.groups_per_tile)
        ]

    def slot_rows(self, tCcC):
        """The tile row of each of this thread's x_scale_slots (run while tracing; the rows
        are the thread's coordinates in tCcC)."""
        values, shape = cute.size(tCcC), tCcC.shape
        slots = sorted({self.x_scale_slot(i, shape) for i in range(values)})
        firsts = [
            min(i for i in range(values) if self.x_scale_slot(i, shape) == slot) for slot in slots
        ]
        return [tCcC[first][1] if self.swap_ab else tCcC[first][0] for first in firsts]

    def overlaps_promotion(self, fragment_shape):
        """FP8: whether a scale group's products are promoted while the next group's MMAs run
        (plain Python). Decode (swap-AB) tiles only: measured on the H200 against promoting each
        group as its MMAs end, the whole FP8 expert MLP is 2-4% faster at 1 and 16 tokens and the
        prefill tiles' gate-up 6-9% slower at 2048 and 8192 (their two warpgroups take turns
        at the tensor cores instead: mma_turns). Not where the second set of products and two groups'
        x scales would not fit in the consumers' registers beside the running sum (the 128-row
        swap-AB tile, 32 row scales a group per thread, spilled)."""
        values = cute.size(fragment_shape)
        needed = 3 * values + 2 * self.x_scale_slots(fragment_shape)
        return self.swap_ab and needed <= OVERLAPPED_PROMOTION_REGISTERS

    def x_scale_slots(self, fragment_shape):
        """How many batch rows a thread's accumulators span: x_scale_slot's values (plain
        Python)."""
        values = cute.size(fragment_shape)
        return len({self.x_scale_slot(i, fragment_shape) for i in range(values)})

    @cute.jit
    def keep_scales(self, pending_scales, x_scales, weight_scales):
        """FP8: hold a scale group's x scales (one per x_scale_slot) and the tile's two weight
        scales until its products are promoted."""
        slots = len(x_scales)
        for slot in cutlass.range_constexpr(slots):
            pending_scales[slot] = x_scales[slot]
        for j in cutlass.range_constexpr(2):
            pending_scales[slots + j] = weight_scales[j]

    @cute.jit
    def promote(
        self, accumulators, group_products, pending_scales, *, first: cutlass.Constexpr = 0
    ):
        """FP8: accumulators[first:first + the products' values] += group_products x (the
        row's x scale) x (the block's weight scale), in fp32, with the scales keep_scales
        holds (`first`: a column slice's first value in the running sum)."""
        shape = accumulators.shape
        slots = self.x_scale_slots(shape)
        for i in cutlass.range_constexpr(cute.size(group_products)):
            j = first + i
            x_scale = pending_scales[self.x_scale_slot(j, shape)]
            scale = x_scale * pending_scales[slots + self.weight_scale_slot(j)]
            accumulators[j] = accumulators[j] + group_products[i] * scale
