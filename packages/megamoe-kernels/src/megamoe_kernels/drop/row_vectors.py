"""16-byte vectors of a row (sm_90a): bf16 loads and stores, their scaling by a weight per
destination row (scale_to_rows), and their FP8 (e4m3) quantization and dequantization with
fp8_scaling's recipe, for every kernel that writes or reads FP8 rows.

A warp covers a row 32 vectors at a time, lane l taking vector base + l (8 values): a
quantization group's ACTIVATION_GROUP // CHUNK = GROUP_VECTORS vectors sit on neighbouring
lanes, which join their amax by shuffles, so a trip of 32 vectors (base a multiple of 32) holds
two whole groups. Every lane runs every trip: a lane past the row's (or the slice's) end reloads
the last vector, counts no amax and stores nothing, as a partial group's zero padding counts
none. A group's scale is amax / E4M3_MAX (amax floored at AMAX_FLOOR) and its values
value / scale rounded to nearest even and saturated: the values shim/fp8.quantize_rows gives.

Vector v of a bf16 row (bytes 16 v ..) is bytes 8 v .. of its e4m3 row, in group v //
GROUP_VECTORS. Scales are float32 at `scales + group x group_stride + row x row_stride`: the
batch's [groups, capacity] (group-major, what the FP8 GEMM reads) or a wire buffer's
[rows, groups] (token-major: a token's scales are contiguous where they cross NVLink).
"""

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm

from .ep_sync import global_ptr
from .fp8_scaling import ACTIVATION_GROUP
from .scale_division import divided_by_scale, group_scale

CHUNK = 8  # bf16 elements per 16-byte vector
GROUP_VECTORS = ACTIVATION_GROUP // CHUNK
GROUP_SHUFFLE_STEPS = GROUP_VECTORS.bit_length() - 1


def scale_groups(row_vectors):
    """Scales per FP8 row of a bf16 row of `row_vectors` 16-byte vectors: one per
    ACTIVATION_GROUP columns, the last may be partial (a host int or a device value)."""
    return (row_vectors + GROUP_VECTORS - 1) // GROUP_VECTORS


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
def quantize_lane(values, counted):
    """The lane's 8 fp32 `values` (a register tensor) as e4m3 with their group's scale: the
    amax over the group's counted lanes (`counted`: the lane's vector is in the row), then the
    divisions by the scale (scale_division). Every lane of the warp calls it (the amax crosses
    lanes); returns (e4m3 register tensor, scale)."""
    amax = cutlass.Float32(0.0)
    if counted:
        for j in cutlass.range_constexpr(CHUNK):
            amax = cute.arch.fmax(amax, cute.arch.fmax(values[j], -values[j]))
    for shift in cutlass.range_constexpr(GROUP_SHUFFLE_STEPS):
        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << shift))
    scale = group_scale(amax)
    # held in registers: each store reads them afresh (a value staged at one store cannot be
    # reused under another branch)
    quantized = cute.make_rmem_tensor(CHUNK, cutlass.Float8E4M3FN)
    quantized.store(divided_by_scale(values, scale).load().to(cutlass.Float8E4M3FN))
    return quantized, scale


@cute.jit
def store_e4m3(address, quantized):
    """Stores a lane's 8 e4m3 values (a register tensor; 8 bytes, 8-byte aligned) at
    `address`."""
    destination = cute.make_tensor(
        global_ptr(cutlass.Float8E4M3FN, address, CHUNK), cute.make_layout(CHUNK)
    )
    destination.store(quantized.load())


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


@cute.jit
def load_e4m3(values, address, scale):
    """values (8 fp32, a register tensor) = the 8 e4m3 values at `address` times `scale`, each
    product rounded on its own (mul.rn): the values a quantized vector stands for, as
    shim/fp8.dequantize_rows gives them."""
    quantized = cute.make_tensor(
        global_ptr(cutlass.Float8E4M3FN, address, CHUNK), cute.make_layout(CHUNK)
    ).load()
    values.store(quantized.to(cutlass.Float32))
    for i in cutlass.range_constexpr(CHUNK):
        values[i] = multiply_rounded(values[i], scale)


@cute.jit
def load_bf16_lane(source_row, vector, end):
    """The lane's bf16 vector `vector` of the row at `source_row` as 8 fp32 in a register
    tensor (vector `end - 1` for a lane at or past `end`, which counts none of them)."""
    values = cute.make_rmem_tensor(CHUNK, cutlass.Float32)
    loaded = cutlass.min(vector, end - 1)
    values.store(load_chunk(source_row + cutlass.Int64(loaded) * (CHUNK * 2)).to(cutlass.Float32))
    return values


@cute.jit
def bf16_weight(weight):
    """`weight` (fp32) rounded to bf16 (to nearest even) and back to fp32: the factor
    `w.to(torch.bfloat16)` multiplies a bf16 row by."""
    return cutlass.Float32(cutlass.BFloat16(weight))


@cute.jit
def scale_to_rows(
    source_row,
    rows_base,
    rows,
    weights,
    row_bytes,
    row_vectors,
    lane,
    top_k: cutlass.Constexpr,
):
    """A warp writes the bf16 row at `source_row` times weights[k] into each bf16 row rows[k]
    at `rows_base` (row_bytes each; a row of -1 is skipped): each value the fp32 product of the
    token's bf16 and weights[k] (a bf16 value, bf16_weight), rounded once to bf16, which is
    what `x * w.to(torch.bfloat16)` gives in bf16 (the product of two bf16 values is exact in
    fp32, so no contraction can change it). Each 16-byte vector is loaded once."""
    for vector in range(lane, row_vectors, 32):
        values = load_bf16_lane(source_row, vector, row_vectors)
        scaled = cute.make_rmem_tensor(CHUNK, cutlass.Float32)
        for k in cutlass.range_constexpr(top_k):
            if rows[k] >= 0:
                scaled.store(values.load() * weights[k])
                store_chunk(
                    rows_base + cutlass.Int64(rows[k]) * row_bytes + cutlass.Int64(vector) * 16,
                    scaled,
                )


@cute.jit
def quantize_to_rows(
    source_row,
    rows_base,
    rows,
    scales,
    group_stride,
    row_stride,
    hidden,
    first,
    end,
    lane,
    top_k: cutlass.Constexpr,
    in_flight: cutlass.Constexpr = 1,
):
    """A warp quantizes bf16 vectors [first, end) (first a multiple of 32) of the row of `hidden`
    values at `source_row` into the e4m3 rows rows[k] at `rows_base` (hidden bytes each; a
    row of -1 is skipped), the scale of group g of row r stored at scales + g x group_stride +
    r x row_stride (see the module docstring). `in_flight` trips' loads are issued before the
    first of them is quantized (a lane keeps that many vectors in flight; trips past `end`
    count and store nothing)."""
    for base in range(first, end, 32 * in_flight):
        loaded = []
        for trip in cutlass.range_constexpr(in_flight):
            loaded.append(load_bf16_lane(source_row, base + 32 * trip + lane, end))
        for trip in cutlass.range_constexpr(in_flight):
            _quantize_trip(
                loaded[trip],
                base + 32 * trip + lane,
                end,
                rows_base,
                rows,
                scales,
                group_stride,
                row_stride,
                hidden,
                top_k,
            )


@cute.jit
def _quantize_trip(
    values,
    vector,
    end,
    rows_base,
    rows,
    scales,
    group_stride,
    row_stride,
    hidden,
    top_k: cutlass.Constexpr,
):
    """One trip of quantize_to_rows: the lane's loaded vector `vector` (8 fp32 `values`)
    quantized with its group's scale and stored in each row rows[k] (every lane calls it)."""
    counted = vector < end
    quantized, scale = quantize_lane(values, counted)
    if counted:
        for k in cutlass.range_constexpr(top_k):
            if rows[k] >= 0:
                store_e4m3(
                    rows_base + cutlass.Int64(rows[k]) * hidden + cutlass.Int64(vector) * CHUNK,
                    quantized,
                )
        if vector % GROUP_VECTORS == 0:
            group_scales = scales + cutlass.Int64(vector // GROUP_VECTORS) * group_stride
            for k in cutlass.range_constexpr(top_k):
                if rows[k] >= 0:
                    cute.arch.store(group_scales + cutlass.Int64(rows[k]) * row_stride, scale)


@cute.jit
def copy_scales(
    source_scales,
    scales,
    group_stride,
    rows,
    first_group,
    end_group,
    lane,
    top_k: cutlass.Constexpr,
):
    """A warp copies groups [first_group, end_group) of one row's token-major scales (float32,
    contiguous at `source_scales`) to each row rows[k] (-1: skipped) of `scales`, whose group g
    of row r is at scales + g x group_stride + r."""
    for group in range(first_group + lane, end_group, 32):
        scale = cute.arch.load(source_scales + group, cutlass.Float32)
        group_scales = scales + cutlass.Int64(group) * group_stride
        for k in cutlass.range_constexpr(top_k):
            if rows[k] >= 0:
                cute.arch.store(group_scales + rows[k], scale)
