"""Compiling the drop's grouped GEMM for CuTe DSL's TVM-FFI launch path.

The compiled function takes torch tensors as they are: TVM-FFI reads each tensor's DLPack view
in C (no per-call conversion in Python), checks it against the compiled signature (dtype, shape,
strides, 16-byte alignment, one device for all) and launches on torch's current stream of that
device (the environment stream, so CUDA-graph capture records the launch). Measured on the H200:
a few microseconds per launch, against ~70 us for the pointer wrappers this replaces.

The signature: x [rows, K], w as stored ([E, ...], contiguous, E * N * K elements, each expert's
N x K block row-major: a gate-up w13 of three dims is the model's [E, 2I, K], read in the
interleaved order through model_order_view; or packed, shim/weight_packets.py: a 5-D view with the
packets' strides, the FP8 w_scales then its scale words' view of the same allocation), out [rows,
N_out], offsets [E + 1] int32, row scale [rows] float32 or None, for split-K variants the workspace:
partials [words] float32 and arrivals [slots] int32 (else None, None), and for variants with a
dynamic schedule the unit counter [2] int32 (else None), and for FP8 variants the scales
(fp8_scaling): x_scales [K groups, rows], w_scales [E, N blocks, K blocks] and, with a quantized
output, out_scales [N_out groups, rows] (else None), and for variants that gather their rows the
token of each batch row, row_source [rows] int32, x then being the tokens [tokens, K] (else None),
for masked batches each expert's valid rows, expert_counts [E] int32 (else None), and for variants
with a bias the per-expert bias, float32 in the kernel's order of N ([E, I/8, 16] interleaved for
the gate-up GEMM, whichever order w13 is in; [E, H] for the down one; else None). `rows` is one
symbol shared by x (unless gathered), out, the row scale, the row source and the scales' rows (so a
row count that differs between them is refused before launch); the scales' row stride is a runtime
value (they may be views of a wider buffer); the workspace sizes are runtime dims too. The jit
wrapper views w as the (N, K, E) K-major tensor the kernel takes, so callers pass weights without a
per-call permute.

Imported on first compile only: it imports CuTe DSL.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import torch
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream, make_fake_tensor

from megamoe_kernels.drop.fp8_scaling import WEIGHT_BLOCK
from megamoe_kernels.drop.gate_up_layout import GATE_UP_BLOCK
from megamoe_kernels.shim.fp8 import FP8_DTYPE
from megamoe_kernels.shim.weight_packets import SCALE_WORDS, is_packed_shape, packet_strides

TENSOR_ALIGN_BYTES = 16  # TMA and the 16-byte vector stores; the shim's checks say the same


class StoredWeightLaunch:
    """The drop's kernels of one call (one variant, or one per range of valid rows), launched
    one after the other from one host call, taking the weight in its stored layout: row-major,
    or packed (shim/weight_packets.py: `packet` = (packet elements, packet rows, K tile
    values), the scale words in the same allocation, `gate_up` saying whose)."""

    def __init__(
        self,
        kernels,
        *,
        n: int,
        k: int,
        experts: int,
        packet: tuple[int, int, int] | None = None,
        gate_up: bool = False,
        model_order: bool = False,
    ):
        self.kernels = kernels
        self.n, self.k, self.experts = n, k, experts
        self.packet, self.gate_up = packet, gate_up
        self.model_order = model_order

    def model_order_view(self, mWStored):
        """The kernel's (N, K, E) gate-up weight over w13 as the model holds it, [E, 2I, K]
        (gate rows, then up rows): weight row n of the interleaved order (gate_up_layout: blocks
        of GATE_UP_BLOCK gate rows, each followed by its up rows) is source row half x I +
        block x GATE_UP_BLOCK + j for n = j + GATE_UP_BLOCK x (half + 2 x block), so the N mode
        is (GATE_UP_BLOCK, 2, I / GATE_UP_BLOCK) with strides (K, I x K, GATE_UP_BLOCK x K): a
        tile of whole blocks is one TMA box, written into shared memory in the interleaved
        order."""
        n, k = self.n, self.k
        half = n // 2
        return cute.make_tensor(
            mWStored.iterator,
            cute.make_layout(
                ((GATE_UP_BLOCK, 2, half // GATE_UP_BLOCK), k, self.experts),
                stride=((k, half * k, GATE_UP_BLOCK * k), 1, n * k),
            ),
        )

    def packed_views(self, mWStored, mWScalesStored):
        """The kernel's (N, K, E) weight and [E, N blocks, K blocks] scales over a packed
        allocation: the weight's modes are (rows within a packet, packets) and (values within
        a row, K tiles), so a tile of 64, 128 or 256 rows is one TMA box; a gate-up scale
        block b lies in packet 2 b's first word (gate blocks) or packet 2 (b - I/128)'s second
        (up blocks), a down block b in packet b's first word."""
        packet_elements, rows, row_values = self.packet
        n_tiles, k_tiles = self.n // rows, self.k // row_values
        expert_stride = n_tiles * k_tiles * packet_elements
        mW = cute.make_tensor(
            mWStored.iterator,
            cute.make_layout(
                ((rows, n_tiles), (row_values, k_tiles), self.experts),
                stride=(
                    (row_values, k_tiles * packet_elements),
                    (1, packet_elements),
                    expert_stride,
                ),
            ),
        )
        mWScales = None
        if mWScalesStored is not None:
            words = packet_elements * mWStored.element_type.width // 32
            block_layout = cute.make_layout(n_tiles, stride=k_tiles * words)
            if self.gate_up:
                block_layout = cute.make_layout((n_tiles // 2, 2), stride=(2 * k_tiles * words, 1))
            mWScales = cute.make_tensor(
                mWScalesStored.iterator,
                cute.make_layout(
                    (self.experts, block_layout.shape, k_tiles),
                    stride=(n_tiles * k_tiles * words, block_layout.stride, words),
                ),
            )
        return mW, mWScales

    @cute.jit
    def __call__(
        self,
        mX,
        mWStored,
        mOut,
        mOffsets,
        mRowScale,
        mPartials,
        mArrivals,
        mUnitCounter,
        mXScales,
        mWScalesStored,
        mOutScales,
        mRowSource,
        mExpertCounts,
        mBiasStored,
        stream,
    ):
        n, k, experts = self.n, self.k, self.experts
        mWScales = mWScalesStored
        if cutlass.const_expr(self.packet is not None):
            mW, mWScales = self.packed_views(mWStored, mWScalesStored)
        elif cutlass.const_expr(self.model_order):
            mW = self.model_order_view(mWStored)
        else:
            mW = cute.make_tensor(
                mWStored.iterator, cute.make_layout((n, k, experts), stride=(k, 1, n * k))
            )
        # the bias as the kernel indexes it: [E, N]
        mBias = None
        if cutlass.const_expr(mBiasStored is not None):
            mBias = cute.make_tensor(
                mBiasStored.iterator, cute.make_layout((experts, n), stride=(n, 1))
            )
        for kernel in self.kernels:
            kernel(
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
            )


def row_major(dtype, shape):
    """A fake row-major tensor of `shape` (symbolic dims allowed), 16-byte aligned: a compiled
    signature's argument."""
    order = tuple(reversed(range(len(shape))))
    return make_fake_compact_tensor(
        dtype, shape, stride_order=order, assumed_align=TENSOR_ALIGN_BYTES
    )


def rows_contiguous(dtype, groups, rows):
    """A fake [groups, rows] tensor with contiguous rows and a runtime row stride: the FP8 row
    scales' layout (fp8_scaling), which may be a view of a wider buffer."""
    stride = cute.sym_int32(symbol="scale_stride")
    return make_fake_tensor(dtype, (groups, rows), stride=(stride, 1), assumed_align=4)


def compile_stored_weight_launch(
    kernels,
    *,
    weight_shape: tuple[int, ...],
    n: int,
    k: int,
    n_out: int,
    has_row_scale: bool,
    split_k: int,
    dynamic_schedule: bool,
    scale_group: int | None = None,
    out_scale_group: int | None = None,
    gather_rows: bool = False,
    reduce_out: bool = False,
    masked: bool = False,
    has_bias: bool = False,
):
    """cute.compile of `kernels` behind StoredWeightLaunch, for the TVM-FFI calling convention:
    the result is called as f(x, w, out, offsets, row_scale_or_None, partials_or_None,
    arrivals_or_None, unit_counter_or_None, x_scales_or_None, w_scales_or_None,
    out_scales_or_None, row_source_or_None, expert_counts_or_None, bias_or_None) with torch
    tensors (the workspace when split_k > 1: at most one of the kernels splits K; the counter
    when one has a dynamic schedule; the scales for FP8 kernels, scale_group set: e4m3 x and w,
    and an e4m3 out with out_scale_group (its scales' columns per group); row_source with
    gather_rows, x then being the tokens, or with reduce_out, out then being the tokens' rows;
    expert_counts for a masked batch; the bias with
    has_bias, float32 in the kernel's order of N: [E, I/8, 16] or [E, H])."""
    experts = weight_shape[0]
    rows = cute.sym_int32(symbol="rows")
    ab_dtype = cutlass.BFloat16 if scale_group is None else cutlass.Float8E4M3FN
    out_dtype = cutlass.Float8E4M3FN if out_scale_group is not None else cutlass.BFloat16
    tokens = cute.sym_int32(symbol="tokens")
    x = row_major(ab_dtype, (tokens if gather_rows else rows, k))
    row_source = row_major(cutlass.Int32, (rows,)) if gather_rows or reduce_out else None
    expert_counts = row_major(cutlass.Int32, (experts,)) if masked else None
    packet = None
    if is_packed_shape(weight_shape):
        # the packet layout's strides (shim/weight_packets.py), which the signature checks
        torch_dtype = FP8_DTYPE if scale_group is not None else torch.bfloat16
        strides = packet_strides(torch_dtype, experts, n, k)
        w = make_fake_tensor(
            ab_dtype, tuple(weight_shape), stride=strides, assumed_align=TENSOR_ALIGN_BYTES
        )
        packet = (strides[2], weight_shape[3], weight_shape[4])
    else:
        w = row_major(ab_dtype, tuple(weight_shape))
    out = row_major(out_dtype, (tokens if reduce_out else rows, n_out))
    x_scales = w_scales = out_scales = None
    if scale_group is not None:
        x_scales = rows_contiguous(cutlass.Float32, -(-k // scale_group), rows)
        if packet is not None:
            words = packet[0] // 4
            n_tiles, k_tiles = weight_shape[1], weight_shape[2]
            w_scales = make_fake_tensor(
                cutlass.Float32,
                (experts, n_tiles, k_tiles, SCALE_WORDS),
                stride=(n_tiles * k_tiles * words, k_tiles * words, words, 1),
                assumed_align=TENSOR_ALIGN_BYTES,
            )
        else:
            w_scales = row_major(
                cutlass.Float32, (experts, -(-n // WEIGHT_BLOCK), -(-k // WEIGHT_BLOCK))
            )
    if out_scale_group is not None:
        out_scales = rows_contiguous(cutlass.Float32, -(-n_out // out_scale_group), rows)
    offsets = row_major(cutlass.Int32, (experts + 1,))
    row_scale = row_major(cutlass.Float32, (rows,)) if has_row_scale else None
    partials = arrivals = None
    if split_k > 1:
        partials = row_major(cutlass.Float32, (cute.sym_int32(symbol="partial_words"),))
        arrivals = row_major(cutlass.Int32, (cute.sym_int32(symbol="slots"),))
    unit_counter = row_major(cutlass.Int32, (2,)) if dynamic_schedule else None
    gate_up = n_out != n
    bias = None
    if has_bias:
        # in the kernel's order of N: a gate-up bias is interleaved whichever order w13 is in
        # (the model's w13 reaches shared memory interleaved)
        bias_shape = (
            (experts, n // (2 * GATE_UP_BLOCK), 2 * GATE_UP_BLOCK) if gate_up else (experts, n)
        )
        bias = row_major(cutlass.Float32, bias_shape)
    launch = StoredWeightLaunch(
        kernels,
        n=n,
        k=k,
        experts=experts,
        packet=packet,
        gate_up=gate_up,
        # a gate-up weight of three dims is w13 as the model holds it (interleaved: four)
        model_order=gate_up and packet is None and len(weight_shape) == 3,
    )
    return cute.compile(
        launch,
        x,
        w,
        out,
        offsets,
        row_scale,
        partials,
        arrivals,
        unit_counter,
        x_scales,
        w_scales,
        out_scales,
        row_source,
        expert_counts,
        bias,
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options="--enable-tvm-ffi",
    )
