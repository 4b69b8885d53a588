"""The grouped GEMM's epilogue (expert_gemm_sm90): what becomes of a tile's fp32 accumulators
after its mainloop, as parts the kernel composes.

  accumulators -> SplitKSum (split_k > 1: the CTA that completes the tile's sum goes on)
               -> Bias (bias[expert, weight row], before the activation)
               -> SwiGLUOutput | RowScaledOutput: the values, into the team's staging buffer
               -> StoreWarps | InlineStore: a PlainCopyOut | QuantizedCopyOut to the rows,
                  or a ReducedCopyOut into the rows' tokens

The staging buffer is a padded tile in shared memory (row pitch + EPILOGUE_ROW_PAD elements: no
bank conflicts, 16-byte aligned rows), and the copy-out writes it to global memory in 16-byte
vectors, only the rows [row0, row0 + rows) of the tile's expert and the columns below N_out:
CTAs write neighbouring rows of different experts, so a full-tile store would race.
StoreWarps (prefill tiles) hands the buffer to the producer warpgroup's three idle warps, which
copy it out while the consumers go on to the next tile's MMAs; InlineStore (swap-AB decode
tiles: a tile or two per CTA, nothing to overlap) has the consumer team copy it out itself.

A thread's wgmma accumulator fragment is ((2 adjacent columns, 2 rows 8 apart, column blocks of
8), MMA atoms along M, along N), values in that order (fragment_position). The weight's rows
lie on the MMA's N side, or with swap_ab on its M side; the batch rows on the other.

The methods are traced inline into the kernel, as tile_schedule's are: they take the kernel's
values and return new ones, and the objects hold only compile-time constants.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass._mlir.dialects import llvm

from .gate_up_layout import interleaved_output_column
from .scale_division import divided_by_scale, group_scale
from .tiling import THREADS_PER_WARPGROUP

# the producer warpgroup's warps after the TMA warp copy staged tiles out
STORE_THREADS = THREADS_PER_WARPGROUP - 32
# the copy-out's vectors of 8 values
OUT_VECTOR = 8


def fragment_position(i, fragment_shape):
    """Where accumulator value i of a thread's fragment lies (plain Python): (column within its
    pair, row half, column block, MMA atom along M, MMA atom along N)."""
    (_, _, blocks), m_atoms, _ = fragment_shape
    column, row_half, block = i % 2, (i // 2) % 2, (i // 4) % blocks
    m_atom, n_atom = (i // (4 * blocks)) % m_atoms, i // (4 * blocks * m_atoms)
    return column, row_half, block, m_atom, n_atom


def m_side_slot(i, fragment_shape):
    """Which of a thread's MMA-M rows value i lies in (plain Python): 2 rows 8 apart per atom."""
    _, row_half, _, m_atom, _ = fragment_position(i, fragment_shape)
    return row_half + 2 * m_atom


def n_side_slot(i, fragment_shape):
    """Which of a thread's MMA-N columns value i lies in (plain Python): 2 per block of 8, per
    atom."""
    (_, _, blocks), _, _ = fragment_shape
    column, _, block, _, n_atom = fragment_position(i, fragment_shape)
    return column + 2 * block + 2 * blocks * n_atom


def up_partner_offset(swap_ab):
    """How many values after a gate value its up partner sits in a thread's fragment (plain
    Python): the gate/up blocks of 8 step the third mode (prefill), or the second (swap_ab)."""
    return 2 if swap_ab else 4


@cute.jit
def swiglu(
    gate,
    up,
    *,
    limit=None,
    alpha=1.0,
    up_offset=0.0,
    gate_softcap=None,
    up_softcap=None,
    gate_cubic=0.0,
):
    """The pointwise SwiGLU in fp32: gate * sigmoid(alpha * (gate + gate_cubic * gate^3)) *
    (up + up_offset), with gate clamped to at most `limit` and up to [-limit, limit] first when
    `limit` is set, and the linear gate factor and up softcapped, c * tanh(v / c), when
    `gate_softcap` / `up_softcap` c is set (the sigmoid sees the gate uncapped). With alpha
    2 sqrt(2 / pi) and gate_cubic 0.044715 the gate factor is the tanh GELU, 0.5 gate (1 +
    tanh(sqrt(2 / pi) (gate + 0.044715 gate^3))): GeGLU. Every constant is a compile-time one
    (a plain Python number), and the defaults are silu(gate) * up (no instruction for the
    constants they leave out). A softcap's tanh is the approximate one (one MUFU.TANH, relative error about
    2^-11, below the bf16 rounding of the output). The reciprocal is the
    approximate one (one MUFU.RCP; a far gate's 1 + exp(-alpha gate) = inf still gives 0): an
    IEEE division is a refinement, a check and a slow-path call per value, and the gate-up
    epilogue runs 64 of them per thread and tile while the tensor cores wait."""
    if cutlass.const_expr(limit is not None):
        gate = cute.arch.fmin(gate, cutlass.Float32(limit))
        up = cute.arch.fmax(cute.arch.fmin(up, cutlass.Float32(limit)), cutlass.Float32(-limit))
    linear_gate = gate
    if cutlass.const_expr(gate_softcap is not None):
        linear_gate = softcap(gate, gate_softcap)
    if cutlass.const_expr(up_softcap is not None):
        up = softcap(up, up_softcap)
    if cutlass.const_expr(up_offset != 0.0):
        up = up + cutlass.Float32(up_offset)
    scaled_gate = gate
    if cutlass.const_expr(gate_cubic != 0.0):
        scaled_gate = gate + cutlass.Float32(gate_cubic) * gate * gate * gate
    if cutlass.const_expr(alpha != 1.0):
        scaled_gate = scaled_gate * cutlass.Float32(alpha)
    return (
        linear_gate
        * up
        * cute.arch.rcp_approx(cutlass.Float32(1.0) + cute.math.exp(-scaled_gate, fastmath=True))
    )


@cute.jit
def softcap(value, cap):
    """cap * tanh(value / cap) in fp32, `cap` a compile-time constant."""
    return cutlass.Float32(cap) * cute.math.tanh(value * cutlass.Float32(1.0 / cap), approx=True)


class EpilogueTensors:
    """A launch's global tensors of the epilogue, held together for the kernel's calls: out
    [capacity, N_out], out_scales (a quantized output's [rows, N_out groups], else None),
    row_scale [capacity] (or None), bias [E, N] (or None), and split-K's workspace, partials
    and arrivals (or None)."""

    def __init__(self, *, mOut, mOutScales, mRowScale, mBias, mPartials, mArrivals):
        self.mOut = mOut
        self.mOutScales = mOutScales
        self.mRowScale = mRowScale
        self.mBias = mBias
        self.mPartials = mPartials
        self.mArrivals = mArrivals


class SplitKSum:
    """split_k = S > 1: the S CTAs that work one tile's K slices add them up. Each writes its
    fp32 accumulators to the tile's slot of a global workspace, fences and counts itself in on
    the tile's arrival counter; the CTA that arrives last resets the counter for the next
    launch, adds the S slices in slice order (its own from registers) and runs the rest of the
    epilogue. The sum's order is fixed, so results are deterministic."""

    def __init__(self, *, split_k, tile_threads):
        self.split_k = split_k
        self.tile_threads = tile_threads

    @cute.jit
    def sum_slices(
        self, accumulators, mPartials, mArrivals, sLastArrival, *, tile, split, team_tidx, barrier
    ):
        """Puts this CTA's slice of the tile in the workspace and counts it in; the CTA that
        arrives last gets the sum of every slice, in slice order, in `accumulators` and returns
        True. The workspace holds each thread's fragment as it is in registers (every slice has
        the same layout), value-major so a warp's stores are coalesced."""
        values = cute.size(accumulators)
        arrived_last = cutlass.Boolean(False)
        if tile < cute.size(mArrivals):
            partials = mPartials.iterator + tile * self.split_k * values * self.tile_threads
            mine = partials + split * values * self.tile_threads
            for v in cutlass.range_constexpr(values):
                cute.arch.store(
                    mine + (v * self.tile_threads + team_tidx), accumulators[v], cop="cg"
                )
            # every thread's slice is visible at GPU scope before the team counts itself in
            cute.arch.fence_acq_rel_gpu()
            barrier.arrive_and_wait()
            if team_tidx == 0:
                arrival = mArrivals.iterator + tile
                before = cute.arch.atomic_add(arrival, cutlass.Int32(1), sem="acq_rel", scope="gpu")
                last = before == self.split_k - 1
                if last:
                    # every slice has arrived: ready for the next launch
                    cute.arch.store(arrival, cutlass.Int32(0))
                sLastArrival[0] = cutlass.Int32(last)
            barrier.arrive_and_wait()
            arrived_last = sLastArrival[0] != 0
            if arrived_last:
                cute.arch.fence_acq_rel_gpu()
                for v in cutlass.range_constexpr(values):
                    total = cutlass.Float32(0.0)
                    for s in cutlass.range_constexpr(self.split_k):
                        value = accumulators[v]
                        if s != split:
                            value = cute.arch.load(
                                partials + ((s * values + v) * self.tile_threads + team_tidx),
                                cutlass.Float32,
                                cop="cg",
                            )
                        total = total + value
                    accumulators[v] = total
        return arrived_last


class Bias:
    """Each accumulator gets its weight row's bias, bias[expert, n] in fp32 (mBias [E, N]),
    after split-K's sum and before the activation (before SwiGLU and its clamp, before the row
    scale). A thread loads the biases of the weight rows its fragment holds once per tile (2
    with swap_ab, tile_cols / 4 otherwise); the index is clamped to N - 1, so a tail tile's
    columns past N read a bias that is never stored."""

    def __init__(self, *, swap_ab, tile_cols):
        self.swap_ab = swap_ab
        self.tile_cols = tile_cols

    def weight_row_slot(self, i, fragment_shape):
        """Which of a thread's weight rows accumulator value i belongs to (plain Python)."""
        if self.swap_ab:
            return m_side_slot(i, fragment_shape)
        return n_side_slot(i, fragment_shape)

    @cute.jit
    def add(self, accumulators, tCcC, mBias, *, expert, col_tile, n_cols):
        """accumulators += the bias of each value's weight row, each of the thread's weight
        rows loaded once."""
        values, shape = cute.size(accumulators), accumulators.shape
        slots = sorted({self.weight_row_slot(i, shape) for i in range(values)})
        firsts = [
            min(i for i in range(values) if self.weight_row_slot(i, shape) == slot)
            for slot in slots
        ]
        col0 = col_tile * self.tile_cols
        weight_rows = [tCcC[first][0] if self.swap_ab else tCcC[first][1] for first in firsts]
        biases = [mBias[(expert, cutlass.min(col0 + row, n_cols - 1))] for row in weight_rows]
        for i in cutlass.range_constexpr(values):
            accumulators[i] = accumulators[i] + biases[slots.index(self.weight_row_slot(i, shape))]


class TileOutput:
    """Writes a tile's output values into the team's staging buffer: one implementation of the
    walk over the fragment, for the activations below (pair_values, output_column). With the
    weight on the N side accumulator values i, i + 1 are adjacent columns of one row, staged as
    one 32-bit word of two bf16; with swap_ab they are adjacent rows, staged one by one."""

    def __init__(self, *, swap_ab):
        self.swap_ab = swap_ab
        self.pair = 1 if swap_ab else 2

    def stages(self, i):
        """Whether accumulator value i starts a staged pair (plain Python)."""
        return True

    def output_column(self, column):
        """The staged column of a pair's accumulator column."""
        return column

    @cute.jit
    def stage(self, accumulators, tCcC, sOut, mRowScale, *, row0):
        """The tile's values, into sOut (the tile's rows from batch row row0 on)."""
        out_dtype = sOut.element_type
        pair = self.pair
        sOut_pairs = cute.zipped_divide(sOut, (1, pair))
        pair_atom = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), out_dtype, num_bits_per_copy=out_dtype.width * pair
        )
        for j in cutlass.range_constexpr(cute.size(accumulators) // pair):
            i = j * pair
            m, n = tCcC[i]
            row, col = (n, m) if self.swap_ab else (m, n)
            values = cute.make_rmem_tensor((pair,), out_dtype)
            if cutlass.const_expr(self.stages(i)):
                self.pair_values(values, accumulators, i, mRowScale, row0=row0, row=row)
                out_col = self.output_column(col)
                cute.copy(pair_atom, values, sOut_pairs[(None, (row, out_col // pair))])


class SwiGLUOutput(TileOutput):
    """The gate-up GEMM's output: swiglu of each gate value and its up partner (gate_up_layout:
    the partner sits up_partner_offset values later), the clamped variant's constants fixed at
    compile time. Half of the values are gates: a tile of tile_cols weight rows stages
    tile_cols / 2 output columns."""

    def __init__(
        self,
        *,
        swap_ab,
        limit=None,
        alpha=1.0,
        up_offset=0.0,
        gate_softcap=None,
        up_softcap=None,
        gate_cubic=0.0,
    ):
        super().__init__(swap_ab=swap_ab)
        self.partner_offset = up_partner_offset(swap_ab)
        self.constants = {
            "limit": limit,
            "alpha": float(alpha),
            "up_offset": float(up_offset),
            "gate_softcap": gate_softcap,
            "up_softcap": up_softcap,
            "gate_cubic": float(gate_cubic),
        }

    def stages(self, i):
        return (i // self.partner_offset) % 2 == 0

    def output_column(self, column):
        return interleaved_output_column(column)

    @cute.jit
    def pair_values(self, values, accumulators, i, mRowScale, *, row0, row):
        for p in cutlass.range_constexpr(self.pair):
            gate = accumulators[i + p]
            up = accumulators[i + p + self.partner_offset]
            values[p] = swiglu(gate, up, **self.constants).to(values.element_type)


class RowScaledOutput(TileOutput):
    """The down GEMM's output: the accumulators, times row_scale[row] with row_scale (loaded
    unmasked, the index clamped to the batch: rows past the expert's are never stored, and the
    values of one row share one load)."""

    def __init__(self, *, swap_ab, row_scale):
        super().__init__(swap_ab=swap_ab)
        self.row_scale = row_scale

    @cute.jit
    def pair_values(self, values, accumulators, i, mRowScale, *, row0, row):
        scale = cutlass.Float32(1.0)
        if cutlass.const_expr(self.row_scale):
            scale = mRowScale[cutlass.min(row0 + row, cute.size(mRowScale) - 1)]
        for p in cutlass.range_constexpr(self.pair):
            values[p] = (accumulators[i + p] * scale).to(values.element_type)


class PlainCopyOut:
    """Copies a staged tile out as it is staged, in 16-byte vectors."""

    def __init__(self, *, tile_rows, out_tile_cols):
        self.tile_rows = tile_rows
        self.out_tile_cols = out_tile_cols

    @cute.jit
    def copy(self, sOut, mOut, mOutScales, *, row0, rows, col_tile, tidx, threads):
        """The staged tile to the batch rows [row0, row0 + rows), the columns below N_out;
        `threads` threads share it, this one is `tidx`."""
        out_dtype = mOut.element_type
        vector = OUT_VECTOR
        vectors_per_row = self.out_tile_cols // vector
        n_out = cute.size(mOut, mode=[1])
        col0 = col_tile * self.out_tile_cols
        sOut_vectors = cute.zipped_divide(sOut, (1, vector))
        mOut_vectors = cute.zipped_divide(mOut, (1, vector))
        copy_atom = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), out_dtype, num_bits_per_copy=128
        )
        for v in cutlass.range(tidx, rows * vectors_per_row, threads):
            row = v // vectors_per_row
            col = (v % vectors_per_row) * vector
            if col0 + col < n_out:
                cute.copy(
                    copy_atom,
                    sOut_vectors[(None, (row, col // vector))],
                    mOut_vectors[(None, (row0 + row, (col0 + col) // vector))],
                )


class ReducedCopyOut(PlainCopyOut):
    """The down GEMM's tile added into its tokens' output rows (the atomic combine): each staged
    row (weighted by RowScaledOutput's row scale) is added, in 16-byte vectors, into
    out[token], token = row_token[row] (mRowToken [capacity] int32, each valid row's token),
    by reductions at the L2 (red.global.add.noftz.v4.bf16x2): the expert-major output rows are
    never written, and no combine kernel reads them back. Each add rounds to bf16, and the adds
    of a token's pairs land in the order the tiles reach them: the sum is not deterministic.
    out [T, N_out] bf16 row-major holds what the rows add to (zeros) before the launch; a row
    whose token lies outside [0, T) adds nothing (nothing is written outside out)."""

    @cute.jit
    def copy(self, sOut, mOut, mRowToken, *, row0, rows, col_tile, tidx, threads):
        """Adds the staged tile's rows [row0, row0 + rows) (batch rows), the columns below
        N_out, into their tokens' rows of mOut; `threads` threads share it, this one is
        `tidx`."""
        vector = OUT_VECTOR
        vectors_per_row = self.out_tile_cols // vector
        tokens, n_out = cute.size(mOut, mode=[0]), cute.size(mOut, mode=[1])
        col0 = col_tile * self.out_tile_cols
        sOut_vectors = cute.zipped_divide(sOut, (1, vector))
        out_address = mOut.iterator.toint()
        row_bytes = cutlass.Int64(n_out) * (mOut.element_type.width // 8)
        column_bytes = mOut.element_type.width // 8
        for v in cutlass.range(tidx, rows * vectors_per_row, threads):
            row = v // vectors_per_row
            col = (v % vectors_per_row) * vector
            token = mRowToken[row0 + row]
            if col0 + col < n_out and token >= 0 and token < tokens:
                staged = cute.make_rmem_tensor((vector,), mOut.element_type)
                staged.store(sOut_vectors[(None, (row, col // vector))].load())
                reduce_add_bf16x8(
                    out_address
                    + cutlass.Int64(token) * row_bytes
                    + cutlass.Int64(col0 + col) * column_bytes,
                    cute.recast_tensor(staged, cutlass.Int32),
                )


@cute.jit
def reduce_add_bf16x8(address, words):
    """Adds 8 bf16 (`words`: 4 Int32 of two bf16 each, a register tensor) into the 16-byte
    aligned global vector at `address`, at the L2 (red.global.add.noftz.v4.bf16x2: relaxed, GPU
    scope; each value's sum rounded to bf16), the line kept in the L2 before others
    (evict_last)."""
    policy = llvm.inline_asm(
        cutlass.Int64.mlir_type,
        [],
        "createpolicy.fractional.L2::evict_last.b64 $0, 1.0;",
        "=l",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    llvm.inline_asm(
        None,
        [
            cutlass.Int64(address).ir_value(),
            cutlass.Int32(words[0]).ir_value(),
            cutlass.Int32(words[1]).ir_value(),
            cutlass.Int32(words[2]).ir_value(),
            cutlass.Int32(words[3]).ir_value(),
            policy,
        ],
        "red.global.add.L2::cache_hint.noftz.v4.bf16x2 [$0], {$1, $2, $3, $4}, $5;",
        "l,r,r,r,r,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


class QuantizedCopyOut(PlainCopyOut):
    """FP8 gate-up: copies a tile staged in bf16 out as e4m3, each row's groups of `group`
    columns (64 or 128, whole groups of the tile's output columns) with the scale amax /
    E4M3_MAX (fp8_scaling), stored in mOutScales (rows, groups). The 8-value vectors of a
    group sit on neighbouring lanes (8 or 16), which share its amax by shuffles; every lane
    runs the same trips (a lane past the tile's vectors works on a clamped row whose group is
    wholly outside, and stores nothing)."""

    def __init__(self, *, tile_rows, out_tile_cols, group):
        super().__init__(tile_rows=tile_rows, out_tile_cols=out_tile_cols)
        if out_tile_cols % group or group // OUT_VECTOR not in (8, 16):
            raise ValueError(
                f"group={group}: 64 or 128 columns, whole groups of the tile's "
                f"{out_tile_cols} output columns"
            )
        self.group = group

    @cute.jit
    def copy(self, sOut, mOut, mOutScales, *, row0, rows, col_tile, tidx, threads):
        vector = OUT_VECTOR
        vectors_per_group = self.group // OUT_VECTOR
        shuffle_steps = vectors_per_group.bit_length() - 1
        vectors_per_row = self.out_tile_cols // vector
        n_out = cute.size(mOut, mode=[1])
        col0 = col_tile * self.out_tile_cols
        sOut_vectors = cute.zipped_divide(sOut, (1, vector))
        mOut_vectors = cute.zipped_divide(mOut, (1, vector))
        store_atom = cute.make_copy_atom(
            cute.nvgpu.CopyUniversalOp(), mOut.element_type, num_bits_per_copy=8 * vector
        )
        total = rows * vectors_per_row
        for first in cutlass.range(0, total, threads):
            v = first + tidx
            row = cutlass.min(v // vectors_per_row, self.tile_rows - 1)
            col = (v % vectors_per_row) * vector
            staged = cute.make_rmem_tensor((vector,), cutlass.Float32)
            staged.store(sOut_vectors[(None, (row, col // vector))].load().to(cutlass.Float32))
            amax = cutlass.Float32(0.0)
            for j in cutlass.range_constexpr(vector):
                amax = cute.arch.fmax(amax, cute.arch.fmax(staged[j], -staged[j]))
            for shift in cutlass.range_constexpr(shuffle_steps):
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << shift))
            if v < total and col0 + col < n_out:
                scale = group_scale(amax)
                quantized = cute.make_rmem_tensor((vector,), mOut.element_type)
                quantized.store(divided_by_scale(staged, scale).load().to(mOut.element_type))
                cute.copy(
                    store_atom,
                    quantized,
                    mOut_vectors[(None, (row0 + row, (col0 + col) // vector))],
                )
                if (v % vectors_per_group) == 0:
                    mOutScales[(row0 + row, (col0 + col) // self.group)] = scale


class StoreWarps:
    """Prefill tiles: the producer warpgroup's three idle warps copy staged tiles out. A
    consumer team waits for its buffer to be drained (acquire), stages the tile, and hands it
    over with the tile's (row0, rows, column tile) in a shared-memory slot (hand_over); the
    store warps copy it out and give the buffer back (run), in the CTA's tile order (with
    pingpong the two teams' buffers are the two stages of the queue), until a team says its
    schedule ended (end: rows = -1)."""

    def __init__(self, *, copy_out, buffers, tile_threads):
        self.copy_out = copy_out
        self.buffers = buffers
        self.tile_threads = tile_threads

    def make_queue(self, barrier_storage):
        """The staging buffers' full/empty mbarriers: the consumer team fills buffer b, the
        store warps drain it (plain Python, run while tracing)."""
        return pipeline.PipelineAsync.create(
            barrier_storage=barrier_storage,
            num_stages=self.buffers,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.tile_threads),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, STORE_THREADS),
            defer_sync=True,
        )

    @cute.jit
    def acquire(self, store_queue, store_state):
        store_queue.producer_acquire(store_state)

    @cute.jit
    def hand_over(
        self,
        sOut,
        sStagedTile,
        mOut,
        mOutScales,
        store_queue,
        store_state,
        *,
        row0,
        rows,
        col_tile,
        team_tidx,
        barrier,
    ):
        if team_tidx == 0:
            sStagedTile[0] = row0
            sStagedTile[1] = rows
            sStagedTile[2] = col_tile
        store_queue.producer_commit(store_state)

    @cute.jit
    def end(self, sStagedTile, store_queue, store_state, *, team_tidx):
        """Consumer team: tells the store warps its schedule ended."""
        store_queue.producer_acquire(store_state)
        if team_tidx == 0:
            sStagedTile[1] = cutlass.Int32(-1)
        store_queue.producer_commit(store_state)

    @cute.jit
    def run(self, sOut, sStagedTiles, mOut, mOutScales, store_queue, store_tidx):
        """Store warps: copy each staged tile out and give its buffer back, in the CTA's tile
        order, until a team's end."""
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.buffers)
        running = cutlass.Boolean(True)
        while running:
            store_queue.consumer_wait(state)
            buffer = state.index
            rows = sStagedTiles[(1, buffer)]
            running = rows >= 0
            self.copy_out.copy(
                sOut[(None, None, buffer)],
                mOut,
                mOutScales,
                row0=sStagedTiles[(0, buffer)],
                rows=rows,
                col_tile=sStagedTiles[(2, buffer)],
                tidx=store_tidx,
                threads=STORE_THREADS,
            )
            store_queue.consumer_release(state)
            state.advance()


class InlineStore:
    """Swap-AB decode tiles: the consumer team copies its staged tile out itself, between two
    named barriers (a tile or two per CTA leaves nothing to overlap, and the store warps'
    wake-up would only lengthen the kernel's tail)."""

    def __init__(self, *, copy_out, tile_threads):
        self.copy_out = copy_out
        self.tile_threads = tile_threads

    def make_queue(self, barrier_storage):
        return None

    @cute.jit
    def acquire(self, store_queue, store_state):
        pass

    @cute.jit
    def hand_over(
        self,
        sOut,
        sStagedTile,
        mOut,
        mOutScales,
        store_queue,
        store_state,
        *,
        row0,
        rows,
        col_tile,
        team_tidx,
        barrier,
    ):
        barrier.arrive_and_wait()
        self.copy_out.copy(
            sOut,
            mOut,
            mOutScales,
            row0=row0,
            rows=rows,
            col_tile=col_tile,
            tidx=team_tidx,
            threads=self.tile_threads,
        )
        barrier.arrive_and_wait()

    @cute.jit
    def end(self, sStagedTile, store_queue, store_state, *, team_tidx):
        pass
