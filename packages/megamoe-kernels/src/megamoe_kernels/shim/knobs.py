"""Knobs of the expert grouped GEMMs, the rule that says why a combination is invalid, and the
default profile keyed on rows per expert.

Four ops share one kernel: "gate_up" (SwiGLU epilogue on the gate/up interleaved w13) and
"down" (optional row-scale epilogue) in bf16, and their FP8 forms "gate_up_fp8" (e4m3 rows and
weights with block scales, the output quantized per 64 columns) and "down_fp8". No CuTe DSL
import here: knobs are checked on any machine.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from functools import lru_cache

from megamoe_kernels.drop.fp8_scaling import (
    INTERMEDIATE_GROUP,
    WEIGHT_BLOCK,
    WIDE_INTERMEDIATE_GROUP,
)
from megamoe_kernels.drop.tiling import (
    EPILOGUE_ROW_PAD,
    SMEM_CAPACITY_BYTES,
    SMEM_RESERVED_BYTES,
    TILE_K_BYTES,
    fp8_column_slices,
)

OPS = ("gate_up", "down", "gate_up_fp8", "down_fp8")
FP8_OPS = ("gate_up_fp8", "down_fp8")
# FP8 keeps a scale group's products beside the running sum: at most 64 fp32 products per
# consumer thread (with the running sum's 128 at most, as bf16's); a prefill tile wider than a
# weight block runs its MMAs and promotions a block's columns at a time, so its products are
# those of one such slice
FP8_MAX_PRODUCTS_PER_THREAD = 64
ROW_TILES = (64, 128)
COL_TILES = (64, 128, 192, 256)
SWAP_ROW_TILES = (16, 32, 64, 128)
SWAP_COL_TILES = (64, 128)
MAX_STAGES = 12
# (CTAs along the batch rows, along the weight rows): (2, 1) pairs two row tiles of one expert
# and column tile, which share the weight tile by TMA multicast
CLUSTERS = ((1, 1), (2, 1))
# fp32 accumulators of one warpgroup's tile with pingpong: 128 registers per thread
PINGPONG_MAX_ACCUMULATORS = 64 * 256
# CTAs that may share one tile's K (split-K, swap_ab only)
SPLIT_K = (1, 2, 4, 8)
# rows past tile_rows an expert's last prefill tile may hold (bf16 prefill tiles), and the
# tail the tuner's candidates take
TAIL_ROWS = (0, 16, 32)
TUNED_TAIL_ROWS = 16


@dataclass(frozen=True)
class GemmKnobs:
    """tile_rows: batch rows per tile; tile_cols: weight rows (accumulator columns) per tile;
    stages: TMA ring depth; swap_ab: weight on the MMA's M side (decode); cluster: CTAs per cluster
    along (batch rows, weight rows), one of CLUSTERS: (2, 1) runs pairs of CTAs on two row tiles of
    one weight tile, each loading half of it for both (TMA multicast; not with swap_ab, whose decode
    tiles hold an expert's rows in one tile); rows_fastest: schedule order inside an expert (row
    tiles vary fastest, so each weight tile streams once); pingpong: two consumer warpgroups on
    alternate tiles, so one's epilogue overlaps the other's MMAs (not with swap_ab; a tile of at
    most PINGPONG_MAX_ACCUMULATORS, each warpgroup holding a whole one); split_k: CTAs that share
    each tile's K, one of SPLIT_K (swap_ab only: decode batches have fewer weight tiles than SMs;
    the CTA that finishes a tile last adds the slices in a fixed order, so results stay
    deterministic); tail_rows: rows past tile_rows an expert's last row tile may hold, one of
    TAIL_ROWS (bf16 prefill tiles without pingpong or clusters: the tile's warpgroups run them
    as swap-AB MMAs beside their own, on the weight tile they stream anyway, where a tile of
    their own would cost a 64-row slab's MMAs and a second read of the weight tile)."""

    tile_rows: int = 128
    tile_cols: int = 256
    stages: int = 4
    swap_ab: bool = False
    cluster: tuple[int, int] = (1, 1)
    rows_fastest: bool = True
    pingpong: bool = False
    split_k: int = 1
    tail_rows: int = 0


def is_gate_up(op: str) -> bool:
    return op.startswith("gate_up")


def is_fp8(op: str) -> bool:
    return op in FP8_OPS


def epilogue_smem_bytes(knobs: GemmKnobs, op: str) -> int:
    out_cols = knobs.tile_cols // 2 if is_gate_up(op) else knobs.tile_cols
    buffers = 2 if knobs.pingpong else 1  # one staging tile per pingpong warpgroup
    # staged in bf16 (a quantized output is quantized on its way out), the tail below the rows
    return buffers * (knobs.tile_rows + knobs.tail_rows) * (out_cols + EPILOGUE_ROW_PAD) * 2


def stage_smem_bytes(knobs: GemmKnobs) -> int:
    """A ring stage: a K tile of 128 bytes per row of x and w (64 bf16 or 128 e4m3 values; the
    FP8 kernels' consumers load the row scales from global memory), and of each tail row."""
    return (knobs.tile_rows + knobs.tail_rows + knobs.tile_cols) * TILE_K_BYTES


def ring_smem_bytes(knobs: GemmKnobs, op: str) -> int:
    """The shared memory a tile's ring may take: the capacity less the reserved bytes (barriers,
    queues) and the epilogue's staging."""
    return SMEM_CAPACITY_BYTES - SMEM_RESERVED_BYTES - epilogue_smem_bytes(knobs, op)


def max_stages(knobs: GemmKnobs, op: str) -> int:
    return min(MAX_STAGES, ring_smem_bytes(knobs, op) // stage_smem_bytes(knobs))


# The FP8 decode (swap-AB) tiles' ring holds this many bytes of weight tiles (4 stages of a
# 128-column tile, 8 of a 64-column one) where more would fit, where the weight's K is not
# known (default_knobs) or where K is short (FP8_DECODE_DEEP_RING_MAX_K_TILES) and the launch
# has between FP8_DECODE_FEW_TILES_PER_SM and one tile per SM.
FP8_DECODE_RING_WEIGHT_BYTES = 64 * 1024
# K tiles (of 128) up to which an FP8 decode GEMM whose tiles outnumber the SMs takes the
# deepest ring. Measured on the H200 (FP8 layer, graph replays, alternating runs, decode tiles
# staging their scales): the deepest ring against the 64 KiB one, qwen3-30b-a3b (K of 16 and
# 6 K tiles) at 2 / 4 / 16 / 64 tokens 33.3 -> 31.8, 51.0 -> 49.8, 116.6 -> 112.6, 175.8 ->
# 168.5 us; the dsv3-ep8-local down GEMM (16) 0-1% faster; mixtral-8x7b's GEMMs (32 and 112)
# 1.5-2.5% slower, and the dsv3-ep8-local gate-up (56) from 0.6% faster to 2.1% slower. Where
# the tiles fit on the SMs at once (one qwen3-30b-a3b token: 96 and 128 tiles) a CTA has no
# next tile to fetch ahead: the layer took the same time, the expert MLP alone 8% more (13.9
# -> 15.0 us). docs/benchmarks.md, "FP8 decode tiles up to 16 rows per expert, and rings by
# K".
FP8_DECODE_DEEP_RING_MAX_K_TILES = 16
# The ring's bytes of weight tiles where K is longer (6 stages of a 128-column tile, 12 of a
# 64-column one), and where K is short but the launch has at most FP8_DECODE_FEW_TILES_PER_SM
# tiles per SM (each of its few CTAs streams a larger share of the bandwidth). Measured on the
# H200, FP8 layer, graph replays, two alternating rounds against 64 KiB: mixtral-8x7b (K of 32
# and 112 K tiles) at 1 / 2 / 4 / 16 / 64 tokens 95.9 -> 94.2, 142.8 -> 138.1, 232.4 ->
# 223.3, 343.2 -> 338.2, 362.2 -> 356.4 us; dsv3-ep8-local (its gate-up's K of 56) 0.9-1.7%
# less time at 4 to 128 tokens, and at one token (the down's 56 tiles of K = 16 on 132 SMs)
# 24.4 -> 24.1 (that GEMM now runs 112 tiles of 64 columns, _down_knobs_beside_gate_up, which
# 96 KiB made slower: 23.3 -> 23.7 us). One qwen3-30b-a3b token (K of 16 and 6 K tiles, 96 and
# 128 tiles) took 21.8 -> 22.0 us in the layer and 13.9 -> 14.9 in the expert MLP alone with 96
# KiB rings, so it keeps 64 KiB. 128 KiB: no faster than 96 anywhere. docs/benchmarks.md, "FP8
# decode rings on long K".
FP8_DECODE_LONG_K_RING_WEIGHT_BYTES = 96 * 1024
# tiles per SM (a launch's tiles times its K slices, over the SMs) up to which a short-K FP8
# decode launch takes the ring of FP8_DECODE_LONG_K_RING_WEIGHT_BYTES
FP8_DECODE_FEW_TILES_PER_SM = 0.5


def default_stages(
    knobs: GemmKnobs, op: str, *, k: int | None = None, tiles_per_sm: float = 1.0
) -> int:
    """The default profile's ring depth for `knobs` on a weight of K = `k` (None: not known,
    as in default_knobs), in a launch of `tiles_per_sm` tiles (times K slices) per SM
    (default_launches): the deepest that fits, but for the FP8 decode tiles:
    - K not known: FP8_DECODE_RING_WEIGHT_BYTES of weights;
    - K of at most FP8_DECODE_DEEP_RING_MAX_K_TILES K tiles: the deepest ring where the tiles
      outnumber the SMs, FP8_DECODE_LONG_K_RING_WEIGHT_BYTES where they are few
      (FP8_DECODE_FEW_TILES_PER_SM), else FP8_DECODE_RING_WEIGHT_BYTES;
    - longer K: FP8_DECODE_LONG_K_RING_WEIGHT_BYTES;
    where K is known, no deeper than leaves the tile's scales room to stage in shared memory
    (staged_scale_k_tiles, at the finest x group).

    Each FP8 decode GEMM alone with cold weights, its scales loaded from global memory at
    each K step, 3, 4, 6 and 12 stages, at 1, 4 and 16 tokens of qwen3-30b-a3b,
    dsv3-ep8-local and mixtral-8x7b: the 128-column tiles ran fastest with 4 or 6 at every
    point, 0.4-15% faster than with 12; the 64-column down tiles with 6 or 12. Since the decode
    tiles stage their scales in shared memory the deep ring wins where K is short and a CTA
    streams several tiles, and 96 KiB beats 64 where K is long. bf16 decode tiles of the same
    bytes per stage ran fastest with 6-12."""
    deepest = max_stages(knobs, op)
    if not (knobs.swap_ab and is_fp8(op)):
        return deepest
    ring = min(deepest, _stages_holding(knobs, FP8_DECODE_RING_WEIGHT_BYTES))
    if k is None:
        return ring
    long_ring = min(deepest, _stages_holding(knobs, FP8_DECODE_LONG_K_RING_WEIGHT_BYTES))
    if -(-k // WEIGHT_BLOCK) > FP8_DECODE_DEEP_RING_MAX_K_TILES:
        ring = long_ring
    elif tiles_per_sm > 1:
        ring = deepest
    elif tiles_per_sm <= FP8_DECODE_FEW_TILES_PER_SM:
        ring = long_ring
    staging = (
        stages
        for stages in range(2, ring + 1)
        if staged_scale_k_tiles(replace(knobs, stages=stages), op, k=k, x_group=INTERMEDIATE_GROUP)
    )
    return max(staging, default=ring)


def _stages_holding(knobs: GemmKnobs, weight_bytes: int) -> int:
    """Ring stages that hold `weight_bytes` of `knobs`' weight tiles."""
    return -(-weight_bytes // (knobs.tile_cols * TILE_K_BYTES))


def staged_scale_k_tiles(knobs: GemmKnobs, op: str, *, k: int, x_group: int) -> int:
    """The K tiles whose scales an FP8 decode (swap-AB) tile stages in shared memory at its
    start (the kernel's staged_scale_k_tiles): all of a weight's K tiles (ceil(k / 128)) where
    they fit beside the ring and the epilogue, else 0 (each K step loads its own scales from
    global memory). A step's loads from global memory wait behind the ring's weight stream:
    staged, the FP8 decode GEMMs alone took 0.4-4% less time at the profile's 4 stages (7 of 8
    points) and 2-29% less at 12, with the same bits (docs/benchmarks.md, "FP8 decode scales
    in shared memory")."""
    if not (is_fp8(op) and knobs.swap_ab):
        return 0
    k_tiles = -(-k // WEIGHT_BLOCK)
    words = k_tiles * ((WEIGHT_BLOCK // x_group) * knobs.tile_rows + 2)
    free = ring_smem_bytes(knobs, op) - knobs.stages * stage_smem_bytes(knobs)
    # the buffer is aligned to 128 bytes after the epilogue's
    return k_tiles if 4 * words + 128 <= free else 0


def knob_problems(knobs: GemmKnobs, op: str) -> list[str]:
    """Why `knobs` cannot run `op` (empty when they can)."""
    if op not in OPS:
        return [f"op must be one of {OPS}, got {op!r}"]
    problems = []
    row_tiles, col_tiles = (
        (SWAP_ROW_TILES, SWAP_COL_TILES) if knobs.swap_ab else (ROW_TILES, COL_TILES)
    )
    mode = "with swap_ab" if knobs.swap_ab else "without swap_ab"
    if knobs.tile_rows not in row_tiles:
        problems.append(f"tile_rows={knobs.tile_rows} {mode}: accepted {row_tiles}")
    if knobs.tile_cols not in col_tiles:
        problems.append(f"tile_cols={knobs.tile_cols} {mode}: accepted {col_tiles}")
    if tuple(knobs.cluster) not in CLUSTERS:
        problems.append(f"cluster={knobs.cluster}: accepted {CLUSTERS}")
    elif tuple(knobs.cluster) != (1, 1) and knobs.swap_ab:
        problems.append(
            f"cluster={knobs.cluster} with swap_ab: not built (a decode tile holds an expert's "
            "rows, so there is no second row tile to share the weight with)"
        )
    if knobs.split_k not in SPLIT_K:
        problems.append(f"split_k={knobs.split_k}: accepted {SPLIT_K}")
    elif knobs.split_k > 1 and not knobs.swap_ab:
        problems.append(
            f"split_k={knobs.split_k} without swap_ab: not built (prefill batches have a tile per "
            "SM or more already)"
        )
    if knobs.pingpong and knobs.swap_ab:
        problems.append("pingpong with swap_ab: not built (decode tiles have no epilogue to hide)")
    if knobs.pingpong and knobs.tile_rows * knobs.tile_cols > PINGPONG_MAX_ACCUMULATORS:
        problems.append(
            f"pingpong with a {knobs.tile_rows}x{knobs.tile_cols} tile: one warpgroup holds at "
            f"most {PINGPONG_MAX_ACCUMULATORS} accumulators (64x256, 128x128)"
        )
    if knobs.tail_rows not in TAIL_ROWS:
        problems.append(f"tail_rows={knobs.tail_rows}: accepted {TAIL_ROWS}")
    elif knobs.tail_rows and (
        knobs.swap_ab or knobs.pingpong or tuple(knobs.cluster) != (1, 1) or is_fp8(op)
    ):
        problems.append(
            f"tail_rows={knobs.tail_rows}: bf16 prefill tiles only (no swap_ab, pingpong, "
            "cluster or FP8)"
        )
    elif knobs.tail_rows and knobs.tile_cols % (knobs.tile_rows // 64 * 64):
        problems.append(
            f"tail_rows={knobs.tail_rows} with a {knobs.tile_rows}x{knobs.tile_cols} tile: each "
            f"of its {knobs.tile_rows // 64} warpgroups runs whole 64-row MMA atoms of the weight "
            "rows"
        )
    if is_fp8(op):
        problems += _fp8_problems(knobs, op)
    # every accepted tile keeps the accumulator at <= 128 fp32 registers per consumer thread
    if not problems:
        limit = max_stages(knobs, op)
        if not 2 <= knobs.stages <= limit:
            problems.append(
                f"stages={knobs.stages}: accepted 2..{limit} for a {knobs.tile_rows}x"
                f"{knobs.tile_cols} tile ({stage_smem_bytes(knobs)} B per stage, "
                f"{epilogue_smem_bytes(knobs, op)} B epilogue, {SMEM_CAPACITY_BYTES} B shared memory)"
            )
    return problems


def _fp8_problems(knobs: GemmKnobs, op: str) -> list[str]:
    problems = []
    # a consumer thread's share of one tile: a warpgroup holds 64 rows of the MMA's M side
    mma_m = knobs.tile_cols if knobs.swap_ab else knobs.tile_rows
    mma_n = knobs.tile_rows if knobs.swap_ab else knobs.tile_cols
    threads = 128 if knobs.pingpong else mma_m // 64 * 128
    try:
        slice_cols = mma_n // fp8_column_slices(mma_n, swap_ab=knobs.swap_ab)
    except ValueError as error:
        problems.append(f"tile_cols={knobs.tile_cols} for {op}: {error}")
        slice_cols = WEIGHT_BLOCK  # the slices it would run
    products = mma_m * slice_cols // threads
    if products > FP8_MAX_PRODUCTS_PER_THREAD:
        problems.append(
            f"a {knobs.tile_rows}x{knobs.tile_cols} FP8 tile{' with pingpong' if knobs.pingpong else ''}"
            f" holds {products} products of a scale group per thread beside its running sum: at "
            f"most {FP8_MAX_PRODUCTS_PER_THREAD}"
        )
    if is_gate_up(op) and knobs.tile_cols % (2 * INTERMEDIATE_GROUP):
        problems.append(
            f"tile_cols={knobs.tile_cols} for {op}: a multiple of {2 * INTERMEDIATE_GROUP} (the "
            f"tile's output columns are whole {INTERMEDIATE_GROUP}-column quantization groups)"
        )
    elif not is_gate_up(op) and knobs.tile_cols not in (64, 128, 2 * WEIGHT_BLOCK):
        problems.append(
            f"tile_cols={knobs.tile_cols} for {op}: accepted (64, 128, {2 * WEIGHT_BLOCK}) (each "
            "tile's columns lie in one 128-row weight block, or in two whole ones)"
        )
    return problems


def check_knobs(knobs: GemmKnobs, op: str) -> GemmKnobs:
    """Returns `knobs` or raises ValueError with every reason they cannot run (fails closed)."""
    problems = knob_problems(knobs, op)
    if problems:
        raise ValueError(f"invalid {op} knobs {knobs}: " + "; ".join(problems))
    return knobs


# rows per expert up to which the bf16 default profile runs decode (swap-AB) tiles (the expert
# GEMMs on the H200 at 64 rows per expert: 128x256 prefill tiles 1.10-1.13x faster than the
# 128-row decode tile at dsv3-ep8-local, qwen3, gpt-oss-120b and mixtral; equal at 32)
DECODE_MAX_ROWS_PER_EXPERT = 32
# the FP8 ops': up to 16 rows per expert (a 32-row decode tile), decode tiles staging their
# scales in shared memory beat the 64x256 prefill tiles in the FP8 layer on the H200 (graph
# replays, alternating runs): at 2 rows per expert 4-9% less time (qwen3-30b-a3b 32 tokens
# 163.6 -> 156.9 us, dsv3-ep8-local 64 tokens 332.9 -> 303.7, mixtral-8x7b 8 tokens 242.7 ->
# 231.9), at 4 rows 2-7%, at 8 rows 2-11%, at 16 rows 1.4-6%; in alternating runs mixtral-8x7b
# (its ring the same either way) 0.88-0.93x at 4-16 rows per expert (docs/benchmarks.md, "FP8
# decode tiles up to 16 rows per expert, and rings by K"). With the scales loaded from global
# memory at each K step, one per batch row a thread holds, the prefill tiles had won from 2
# rows per expert.
FP8_DECODE_MAX_ROWS_PER_EXPERT = 16
# rows per expert up to which the FP8 prefill tile is 64 rows (one consumer warpgroup), not 128
FP8_NARROW_PREFILL_MAX_ROWS_PER_EXPERT = 32


def default_knobs(op: str, rows_per_expert: float) -> GemmKnobs:
    """The default profile, keyed on the expected rows per expert.

    bf16, up to DECODE_MAX_ROWS_PER_EXPERT rows per expert: swap-AB, with a row tile that
    holds nearly every expert's rows (1.5x the mean + 8), so each expert's weights stream from
    memory once; 64 weight rows per tile with the 16-row tile, 128 above. Above: 128x256
    tiles. Both take the deepest ring that fits (FP8 decode tiles: default_stages; as K is
    not known here, their 64 KiB ring, which default_launches deepens by K).

    Why 64 columns with 16 rows (up to ~5 rows per expert): so thin an MMA leaves the tile bound
    by its weight stream, and halving the tile doubles the CTAs that stream (whole expert MLP on
    the H200: 1-16% faster at 1-4 rows per expert; from 8 rows per expert, where the row tile is
    32, equal or 1-5% slower: docs/benchmarks.md, "Decode column tiles").

    FP8: swap-AB up to FP8_DECODE_MAX_ROWS_PER_EXPERT (16 rows per expert) with a row tile of
    1.5x the mean (no margin: with the row scales loaded at each K step, one per batch row, the
    16-row tile beat the 32-row one at 8 rows per expert by 5-10%), 128 columns
    for gate-up (whole quantization groups); above, prefill tiles of 64x256 up to
    FP8_NARROW_PREFILL_MAX_ROWS_PER_EXPERT, 128x256 beyond (their MMAs and promotions run a
    weight block's columns at a time; against the same row tiles with 128 columns, 4-20% less
    time from 4 to 2048 rows per expert). Measured on the H200: docs/benchmarks.md, "Tiles by
    rows per expert" and "FP8 tiles of two weight blocks"."""
    if is_fp8(op):
        knobs = _fp8_tile(op, rows_per_expert)
    elif rows_per_expert <= DECODE_MAX_ROWS_PER_EXPERT:
        knobs = _decode_knobs(1.5 * rows_per_expert + 8)
    else:
        knobs = GemmKnobs(tile_rows=128, tile_cols=256, swap_ab=False)
    return replace(knobs, stages=default_stages(knobs, op))


def _fp8_tile(op: str, rows_per_expert: float) -> GemmKnobs:
    """The FP8 profile's tile for `rows_per_expert` (default_knobs sets the stages)."""
    if rows_per_expert <= FP8_DECODE_MAX_ROWS_PER_EXPERT:
        knobs = _decode_knobs(1.5 * rows_per_expert)
        if is_gate_up(op):
            knobs = replace(knobs, tile_cols=SWAP_COL_TILES[1])
        return knobs
    narrow = rows_per_expert <= FP8_NARROW_PREFILL_MAX_ROWS_PER_EXPERT
    return GemmKnobs(tile_rows=64 if narrow else 128, tile_cols=2 * WEIGHT_BLOCK, swap_ab=False)


def _decode_knobs(wanted_rows: float) -> GemmKnobs:
    """Swap-AB knobs with the smallest decode row tile of at least `wanted_rows` rows (the
    largest if none), 64 columns with the 16-row tile and 128 above (stages left to set)."""
    tile_rows = next((size for size in SWAP_ROW_TILES if size >= wanted_rows), SWAP_ROW_TILES[-1])
    tile_cols = SWAP_COL_TILES[0] if tile_rows == SWAP_ROW_TILES[0] else SWAP_COL_TILES[1]
    return GemmKnobs(tile_rows=tile_rows, tile_cols=tile_cols, swap_ab=True)


# rows per expert up to which the profile's tiles for that many rows (bf16: decode tiles; FP8:
# 64x256) beat the prefill ones when the capacity asks for prefill tiles but the batch holds
# fewer rows (measured on the H200: bf16 swap-AB won by 5-15% at 32 rows per expert, prefill
# tiles matched or won at 64)
SMALL_BATCH_ROWS_PER_EXPERT = 32
# the widest decode row tile whose gate-up GEMM gathers its rows by default
GATHER_MAX_TILE_ROWS = 64
# whether a decode down GEMM's CTAs beside its gate-up prefetch the others' weights into L2
# (_down_l2_prefetch_ctas): off; measured on the H200, the FP8 MLP unchanged at 1-4 qwen3-30b-a3b
# tokens and 1.5-1.7x slower at 1-4 dsv3-ep8-local tokens (docs/kernels-design.md, "Measured and
# not adopted")
DOWN_L2_PREFETCH = False
# the most tokens of a call whose routing launch publishes the batch's offsets before it ends,
# so that a decode gate-up GEMM after it starts loading its weights then (Launch.polls_offsets;
# -1: none). Measured on the H200, the same bits: 0.1-0.9 us faster at one token, bf16 and FP8;
# up to 1.2 us slower at 4 and 16 bf16 tokens and at 16 FP8 qwen3-30b-a3b tokens, where the
# launch's row copy shares HBM with the gate-up's weight stream (docs/benchmarks.md, "The
# decode gate-up polling for published offsets")
GATE_UP_POLLS_OFFSETS_MAX_TOKENS = 1


@dataclass(frozen=True)
class Launch:
    """One kernel launch of the default profile: its knobs and the range of valid rows
    [min_valid_rows, max_valid_rows) it works on (None: unbounded); outside, it does nothing.
    l2_prefetch_ctas: a decode down GEMM's CTAs that start on the SMs its gate-up leaves idle
    and prefetch into L2 the weights of the CTAs that start after it (0: none;
    _down_l2_prefetch_ctas). polls_offsets: a decode gate-up GEMM whose batch offsets the
    routing kernel publishes before it ends starts loading its weights then (polling_launches)."""

    knobs: GemmKnobs
    min_valid_rows: int = 0
    max_valid_rows: int | None = None
    l2_prefetch_ctas: int = 0
    polls_offsets: bool = False


def intermediate_group(launches: tuple[Launch, ...], intermediate: int) -> int:
    """Columns per scale of the FP8 gate-up's output (the down GEMM's rows) for a gate-up call
    of these launches over I = `intermediate`: WIDE_INTERMEDIATE_GROUP (128) where every launch
    runs 256-column prefill tiles (128 output columns a tile, whole groups) and I is a multiple
    of 128, else INTERMEDIATE_GROUP (64: a decode tile or a 128-column tile holds 64 output
    columns). Whichever launch the device picks then writes the same groups. On 128-column
    groups the down GEMM promotes once per K tile instead of twice: 8-12% less time at 2048
    and 8192 tokens (docs/benchmarks.md, "The down GEMM on 128-column groups")."""
    wide = all(
        not launch.knobs.swap_ab and launch.knobs.tile_cols % (2 * WIDE_INTERMEDIATE_GROUP) == 0
        for launch in launches
    )
    if wide and intermediate % WIDE_INTERMEDIATE_GROUP == 0:
        return WIDE_INTERMEDIATE_GROUP
    return INTERMEDIATE_GROUP


def max_row_tiles(capacity: int, experts: int, tile_rows: int) -> int:
    """A bound on the row tiles of a batch of `capacity` rows over `experts`: at most
    min(E, capacity) experts have rows, each in at most rows // tile_rows + 1 row tiles."""
    return capacity // tile_rows + min(experts, capacity)


def max_tiles(knobs: GemmKnobs, *, capacity: int, experts: int, columns: int) -> int:
    """A bound on the output tiles of `knobs` on a batch of `capacity` rows over `experts` and
    a weight of `columns` output columns: max_row_tiles row tiles of each column tile."""
    return max_row_tiles(capacity, experts, knobs.tile_rows) * -(-columns // knobs.tile_cols)


def _down_knobs_beside_gate_up(
    op: str,
    knobs: GemmKnobs,
    *,
    capacity: int,
    experts: int,
    weight_dims: tuple[int, int],
    sms: int,
) -> GemmKnobs:
    """The decode down GEMM's tile when it follows the default gate-up GEMM of its batch (its
    ring is default_launches' to set).

    With programmatic dependent launch the down grid's CTAs wait on the SMs the gate-up grid
    leaves free and start the moment it ends; CTAs that find no free SM start later. So where
    128-column down tiles let both grids fit on the GPU at once and `knobs`' narrower ones do
    not, the wider tiles win (dsv3 on an 8-way expert-parallel rank, one token: the whole MLP
    35.5 -> 28.2 us). Counts are bounds (max_tiles), the gate-up's times its K slices: an FP8
    decode gate-up splits K over the SMs its tiles leave idle (_fp8_gate_up_split_k), and its
    slices take those SMs too. So at one dsv3-ep8-local token (one expert: 32 tiles in 4
    slices, 128 CTAs) nothing fits beside it and the FP8 down keeps its 112 tiles of 64
    columns, where counting the tiles alone gave it 56 of 128: the FP8 layer 24.0-24.1 -> 23.3
    us, the MLP alone 18.1 -> 17.3 (graph replays, two alternating rounds; docs/benchmarks.md,
    "The FP8 decode down beside a split gate-up").

    The FP8 down GEMM takes the wider tiles wherever its narrow grid needs more than one wave:
    each K step of an FP8 tile also promotes its accumulators with their block scales, which a
    128-column tile does once for twice the columns (whole FP8 MLP, scripts/fp8_down_tiles_ab.py:
    1.003-1.128x at 1-16 tokens of qwen3-30b-a3b, dsv3-ep8-local, dsv3 and mixtral-8x7b; the
    one loss, 0.95x, is mixtral at one token, whose 128 narrow CTAs fit in one wave)."""
    hidden, _ = weight_dims
    wide = replace(knobs, tile_cols=SWAP_COL_TILES[-1])
    if knobs == wide:
        return knobs

    def ctas(tile: GemmKnobs, columns: int) -> int:
        return max_tiles(tile, capacity=capacity, experts=experts, columns=columns)

    if is_fp8(op) and ctas(knobs, hidden) > sms:
        return wide
    gate_up_ctas = _gate_up_ctas(
        op, capacity=capacity, experts=experts, weight_dims=weight_dims, sms=sms
    )
    if gate_up_ctas + ctas(knobs, hidden) <= sms:
        return knobs
    if gate_up_ctas + ctas(wide, hidden) > sms:
        return knobs
    return wide


def _gate_up_ctas(
    op: str, *, capacity: int, experts: int, weight_dims: tuple[int, int], sms: int
) -> int:
    """A bound on the CTAs with work of the default gate-up GEMM before the down GEMM `op` of
    (N, K) = weight_dims = (hidden, intermediate): its tiles (max_tiles) times its K slices."""
    hidden, intermediate = weight_dims
    gate_up = _gate_up_tile(
        "gate_up_fp8" if is_fp8(op) else "gate_up",
        capacity=capacity,
        experts=experts,
        weight_dims=(2 * intermediate, hidden),
        sms=sms,
    )
    tiles = max_tiles(gate_up, capacity=capacity, experts=experts, columns=2 * intermediate)
    return tiles * gate_up.split_k


def _down_l2_prefetch_ctas(
    op: str,
    knobs: GemmKnobs,
    *,
    capacity: int,
    experts: int,
    weight_dims: tuple[int, int],
    sms: int,
) -> int:
    """How many of the decode down GEMM's CTAs prefetch into L2 the weights of the others
    (Launch.l2_prefetch_ctas): the SMs its gate-up leaves idle, where its tiles outnumber them.

    With programmatic dependent launch the GPU places the down grid's first CTAs on the SMs
    the gate-up grid leaves idle while that grid still runs; they load their first weights
    before waiting for it (weights_before_wait), and the others start only as the gate-up's
    CTAs end. The first ones also prefetch the others' weights into L2, so that those stream
    from HBM beside the gate-up's weights rather than after them. 0 unless DOWN_L2_PREFETCH."""
    if not DOWN_L2_PREFETCH:
        return 0
    hidden, _ = weight_dims
    idle = sms - _gate_up_ctas(
        op, capacity=capacity, experts=experts, weight_dims=weight_dims, sms=sms
    )
    tiles = max_tiles(knobs, capacity=capacity, experts=experts, columns=hidden)
    return idle if 0 < idle < tiles else 0


def _gate_up_tile(
    op: str, *, capacity: int, experts: int, weight_dims: tuple[int, int], sms: int
) -> GemmKnobs:
    """The default profile's gate-up tile (`op` one of the gate-up ops) for `capacity` rows over
    `experts`, an FP8 decode one with its K split (_fp8_gate_up_split_k); stages left to
    set. default_launches launches it, and the decode down GEMM counts its CTAs."""
    knobs = default_knobs(op, capacity / max(1, experts))
    if knobs.swap_ab and is_fp8(op):
        knobs = _fp8_gate_up_split_k(
            knobs, capacity=capacity, experts=experts, weight_dims=weight_dims, sms=sms
        )
    return knobs


def _fp8_gate_up_split_k(
    knobs: GemmKnobs, *, capacity: int, experts: int, weight_dims: tuple[int, int], sms: int
) -> GemmKnobs:
    """The FP8 decode gate-up GEMM's knobs with K split S ways, S the largest of SPLIT_K whose
    S x tiles (a bound: max_row_tiles row tiles of each 128-column tile) fit on the SMs at
    once, so a batch of few experts streams its weights from most of the SMs. Measured on the
    H200 (FP8 layer, graph replays, two alternating rounds): one dsv3-ep8-local token (32
    tiles) 30.5 us whole, 26.2 in 2 slices, 24.6 in 4; one qwen3-30b-a3b token (96 tiles:
    none fits) 22.1 us whole, 27.5 in 2 (docs/benchmarks.md, "FP8 decode rings and split
    K"). bf16 keeps K whole: its gate-up's 64-column tiles put twice the CTAs on an expert,
    and split-K won nothing in its MLP ("Split-K at decode")."""
    columns, depth = weight_dims
    tiles = max_tiles(knobs, capacity=capacity, experts=experts, columns=columns)
    k_tiles = -(-depth // WEIGHT_BLOCK)
    split = max(s for s in SPLIT_K if s == 1 or (s * tiles <= sms and s <= k_tiles))
    return replace(knobs, split_k=split)


def _launch_stages(
    knobs: GemmKnobs,
    op: str,
    *,
    capacity: int,
    experts: int,
    weight_dims: tuple[int, int],
    sms: int,
) -> int:
    """The ring depth of a default launch (default_stages), told the weight's K and its tiles
    (a bound: max_tiles, times the K slices) per SM."""
    columns, depth = weight_dims
    tiles = max_tiles(knobs, capacity=capacity, experts=experts, columns=columns)
    return default_stages(knobs, op, k=depth, tiles_per_sm=tiles * knobs.split_k / sms)


@lru_cache(maxsize=1024)
def default_launches(
    op: str,
    capacity: int,
    experts: int,
    *,
    weight_dims: tuple[int, int],
    sms: int,
    tuned: GemmKnobs | None = None,
    valid_rows: int | None = None,
) -> tuple[Launch, ...]:
    """The default profile's launches for `capacity` rows over `experts`, for a weight of
    (N, K) = weight_dims per expert on a GPU of `sms` SMs: exactly one of them works on any
    batch, chosen on the device by the batch's valid rows (offsets[E]).

    The profile is keyed on rows per expert, and the capacity only bounds them: when capacity / E
    asks for its widest tiles, a second launch with the tiles of SMALL_BATCH_ROWS_PER_EXPERT
    takes batches of at most that many valid rows per expert, so a capacity sized for the worst
    case (an expert-parallel receiver, a fixed serving capacity) costs the tiles of what the
    batch holds. The launch with nothing to do reads offsets[E] and exits. A decode down GEMM
    may take wider tiles than the profile's, to fit beside its gate-up
    (_down_knobs_beside_gate_up), and (with DOWN_L2_PREFETCH, off by default) its CTAs that
    start beside the gate-up prefetch the others' weights into L2 (_down_l2_prefetch_ctas).

    `tuned`: knobs tuned for the batch's class (a knob-cache entry; checked: invalid ones
    raise) in place of the profile's. Prefill ones still leave batches of few valid rows to the
    decode tiles, when the capacity holds more than those.

    `valid_rows`: the batch's valid rows when the host knows them (a local batch holds tokens x
    top-k): only the launch for that many runs, with no range, so a wrong count costs speed,
    never rows (each launch costs several us of host time)."""
    prefetchers = 0
    if tuned is not None:
        knobs = check_knobs(tuned, op)
    else:
        if is_gate_up(op):
            knobs = _gate_up_tile(
                op, capacity=capacity, experts=experts, weight_dims=weight_dims, sms=sms
            )
        else:
            knobs = default_knobs(op, capacity / max(1, experts))
            if knobs.swap_ab:
                knobs = _down_knobs_beside_gate_up(
                    op, knobs, capacity=capacity, experts=experts, weight_dims=weight_dims, sms=sms
                )
                prefetchers = _down_l2_prefetch_ctas(
                    op, knobs, capacity=capacity, experts=experts, weight_dims=weight_dims, sms=sms
                )
        stages = _launch_stages(
            knobs, op, capacity=capacity, experts=experts, weight_dims=weight_dims, sms=sms
        )
        knobs = replace(knobs, stages=stages)
    boundary = SMALL_BATCH_ROWS_PER_EXPERT * experts + 1
    if knobs.swap_ab or capacity < boundary:
        return (Launch(knobs, l2_prefetch_ctas=prefetchers),)
    small = default_knobs(op, SMALL_BATCH_ROWS_PER_EXPERT)
    if valid_rows is not None:
        return (Launch(small if valid_rows < boundary else knobs),)
    return (Launch(small, 0, boundary), Launch(knobs, boundary, None))


def routing_publishes_offsets(tokens: int) -> bool:
    """Whether the routing launch of a call of `tokens` tokens publishes the batch's offsets for
    the gate-up GEMM after it to poll for (GATE_UP_POLLS_OFFSETS_MAX_TOKENS)."""
    return tokens <= GATE_UP_POLLS_OFFSETS_MAX_TOKENS


def polling_launches(op: str, launches: tuple[Launch, ...]) -> tuple[Launch, ...]:
    """`launches` of a batch whose offsets the routing kernel publishes before it ends (its
    publish_offsets): the gate-up's decode ones poll for them (Launch.polls_offsets) and start
    loading their first tile's weights while that kernel still copies the rows. Prefill tiles
    (and every down launch) wait for the kernel before them to end: a down GEMM's weights
    loaded before its wait cost prefill tiles 0.2-1.2% (docs/benchmarks.md, "Down weights before
    the wait")."""
    if not is_gate_up(op):
        return launches
    return tuple(
        replace(launch, polls_offsets=True)
        if launch.knobs.swap_ab and launch.knobs.cluster == (1, 1)
        else launch
        for launch in launches
    )


def gate_up_decode_knobs(*, valid_rows: int, capacity: int, num_experts: int) -> GemmKnobs | None:
    """The decode (swap-AB) tiles the default profile's gate-up GEMM runs on `valid_rows` of a
    batch of `capacity` rows over `num_experts` (as default_launches picks them), or None where
    it runs prefill tiles."""
    experts = max(1, num_experts)
    knobs = default_knobs("gate_up", capacity / experts)
    if knobs.swap_ab:
        return knobs
    if valid_rows < SMALL_BATCH_ROWS_PER_EXPERT * experts + 1:
        return default_knobs("gate_up", SMALL_BATCH_ROWS_PER_EXPERT)
    return None


@lru_cache(maxsize=1024)
def gathers_rows_by_default(
    *, tokens: int, valid_rows: int, capacity: int, num_experts: int
) -> bool:
    """Whether a local layer's gate-up GEMM reads its rows from the tokens (gate_up_swiglu's
    row_source_M) rather than from rows the dispatch copied out, unless told: where the default
    profile runs decode (swap-AB) tiles of at most GATHER_MAX_TILE_ROWS rows on `valid_rows`
    of a batch of `capacity` rows (gate_up_decode_knobs: up to about 32 rows per expert), from
    two tokens on. Measured on the H200 (whole layer, graph replays; docs/benchmarks.md,
    "Gathered rows"): with such tiles equal or up to 3% faster from 16 tokens, 1-4% slower at
    one token (the row's token is one more load before its copy); with 128-row decode tiles
    (measured at 64 rows per expert, gpt-oss-120b and dsv3 at 2048 tokens) 0-25% slower; with
    prefill tiles the gate-up GEMM 24-43% slower (its producer warp's 16-byte copies against
    one TMA load per stage: gathering the copied rows in order is as slow), more than the
    copy it saves."""
    decode = gate_up_decode_knobs(valid_rows=valid_rows, capacity=capacity, num_experts=num_experts)
    return tokens >= 2 and decode is not None and decode.tile_rows <= GATHER_MAX_TILE_ROWS


@lru_cache(maxsize=1024)
def shared_experts_in_batch_by_default(
    *, tokens: int, valid_rows: int, capacity: int, num_experts: int, fp8: bool = False
) -> bool:
    """Whether a local layer's shared experts (a shared MLP cut into experts of the routed
    size, every token a row in each) join the routed experts' batch on the cutedsl backend,
    unless told: where the gate-up GEMM runs decode tiles (gate_up_decode_knobs, on the batch
    with the shared rows) whose row tile holds every token, so each shared expert's weights
    stream once, beside the routed experts'. Above, the shared rows would take several row
    tiles, each streaming their weights again, where their own dense GEMMs on a side stream
    read them once. Measured at dsv3 on the H200 (whole layer, graph replays;
    docs/benchmarks.md, "Shared experts in the batch or beside it"): in the batch 8% faster
    at 1 token, equal at 16, 1.8% slower at 128 tokens (16-row tiles for 128 shared rows),
    equal or up to 1% slower at 2048 and 8192.

    FP8 experts (`fp8`) join at the prefill tiles too: beside the batch the shared MLP runs
    bf16 GEMMs on its dequantized weights, without FP8's tensor rate. Measured at dsv3 FP8 on
    an H100 (same document): in the batch 18% faster at 1 token, 1.5% at 16, 0.8% slower at
    128, 1.4% faster at 2048 and 4% at 8192."""
    decode = gate_up_decode_knobs(valid_rows=valid_rows, capacity=capacity, num_experts=num_experts)
    if decode is None:
        return fp8
    return tokens <= decode.tile_rows


@lru_cache(maxsize=1024)
def resolve_knobs(op: str, rows_per_expert: float, override: GemmKnobs | None) -> GemmKnobs:
    """An explicit override is checked like any combination: invalid ones raise, never run.

    Cached (knobs are frozen): the launch path resolves on every call."""
    return check_knobs(override if override is not None else default_knobs(op, rows_per_expert), op)


PROFILE_ROWS_PER_EXPERT = (1, 16, 32, 64, 128, 512)


def _ring_depth(choice: str, knobs: GemmKnobs, op: str) -> int:
    """A ring depth of candidate_knobs' `stage_choices`: "max", "profile" or a number."""
    if choice == "max":
        return max_stages(knobs, op)
    if choice == "profile":
        return default_stages(knobs, op)
    return int(choice)


def candidate_knobs(
    op: str, *, stage_choices: tuple[str, ...] = ("3", "4", "max", "profile")
) -> list[GemmKnobs]:
    """Every valid tile shape in both orientations (the prefill ones also in 2-CTA clusters and
    with TUNED_TAIL_ROWS tail rows, the swap-AB ones also with split-K), each with the ring
    depths in `stage_choices` ("max": the deepest that fits; "profile": the default profile's,
    default_stages, which is the deepest but for the FP8 decode tiles): what a tuner times."""
    shapes = [
        (rows, cols, False, pingpong, cluster, 1, 0)
        for rows, cols in itertools.product(ROW_TILES, COL_TILES)
        for pingpong in (False, True)
        for cluster in CLUSTERS
    ]
    shapes += [
        (rows, cols, False, False, (1, 1), 1, TUNED_TAIL_ROWS)
        for rows, cols in itertools.product(ROW_TILES, COL_TILES)
    ]
    shapes += [
        (rows, cols, True, False, (1, 1), split, 0)
        for rows, cols in itertools.product(SWAP_ROW_TILES, SWAP_COL_TILES)
        for split in SPLIT_K
    ]
    candidates = []
    for tile_rows, tile_cols, swap_ab, pingpong, cluster, split_k, tail_rows in shapes:
        base = GemmKnobs(
            tile_rows=tile_rows,
            tile_cols=tile_cols,
            swap_ab=swap_ab,
            pingpong=pingpong,
            cluster=cluster,
            split_k=split_k,
            tail_rows=tail_rows,
        )
        depths = {_ring_depth(choice, base, op) for choice in stage_choices}
        for stages in sorted(depths):
            knobs = replace(base, stages=stages)
            if not knob_problems(knobs, op):
                candidates.append(knobs)
    return candidates
