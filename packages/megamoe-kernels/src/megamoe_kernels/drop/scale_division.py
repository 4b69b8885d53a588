"""fp8_scaling's divisions on the device (sm_90a): a group's scale, amax / E4M3_MAX, and each
value over it, with the e4m3 bits an IEEE division (`div.rn.f32`, torch's `x / s`) gives, at
three FMA-pipe instructions and a sign merge a value, and one reciprocal a scale.

A compiled `x / s` is, for each value, a reciprocal (MUFU.RCP), a range check (FCHK) and a branch
to a slow-path call around the fast path's FMAs, in a reconvergence region of its own: the
eight divisions of a 16-byte vector run one after another. Here the reciprocal is taken once
per scale and each quotient is the fast path alone, the same instructions: r = the reciprocal
refined by one Newton step, q0 = x r rounded, the exact residual e = x - q0 s (one FMA), and
q = q0 + e r rounded, which is the correctly rounded x / s wherever no step leaves fp32's
normal range. A scale lies between AMAX_FLOOR / E4M3_MAX > 2^-43 and 2^120, so its reciprocal
and the Newton step are normal; q0 and the residual leave the normal range only where the
quotient is below 2^-59 (x below 2^-102, or a quotient below 2^-126), and there both quotients
round to a zero of x's sign in e4m3 (the quotient takes x's sign bit, as division's has it).
So every finite x gets division's e4m3 value, and every finite amax division's scale (a
group's scale is the same sequence from E4M3_MAX's reciprocal rounded to fp32 on the host,
no refinement: test_scale_division.py checks both on the CPU). A group holding an inf gets a
NaN scale and NaN values, where division gives an inf scale and zeros (NaN for the inf):
dequantized, both are NaN.

The FP8 gate-up's store warps quantize each staged tile while the consumers run the next
tile's MMAs and promotions on the same SM sub-partitions. With these divisions the FP8 gate-up
at qwen3-30b-a3b 8192 tokens took 500.1-511.0 us against 541.9-543.1, and the whole FP8 expert
MLP there 820.8-825.1 against 889.1-899.5 (H100; docs/benchmarks.md, "Divisions in the
quantized copy-out").
"""

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm

from .fp8_scaling import AMAX_FLOOR, E4M3_MAX, E4M3_MAX_RECIPROCAL


def _float32_asm(text, *operands):
    return cutlass.Float32(
        llvm.inline_asm(
            cutlass.Float32.mlir_type,
            [cutlass.Float32(operand).ir_value() for operand in operands],
            text,
            "=f" + ",f" * len(operands),
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


def reciprocal(divisor):
    """1 / divisor as div.rn.f32's fast path refines it: rcp.approx, then r + r (1 - d r)."""
    return _float32_asm(
        "{ .reg .f32 r, t; rcp.approx.ftz.f32 r, $1; neg.f32 t, $1; "
        "fma.rn.f32 t, t, r, 0f3F800000; fma.rn.f32 $0, r, t, r; }",
        divisor,
    )


def quotient(dividend, divisor, divisor_reciprocal):
    """dividend / divisor by div.rn.f32's fast path (the module docstring says where that is
    the rounded quotient), its sign bit or-ed with the dividend's."""
    return _float32_asm(
        "{ .reg .f32 q, e; .reg .b32 sign; mul.rn.f32 q, $1, $3; neg.f32 e, q; "
        "fma.rn.f32 e, e, $2, $1; fma.rn.f32 q, e, $3, q; and.b32 sign, $1, 0x80000000; "
        "or.b32 $0, q, sign; }",
        dividend,
        divisor,
        divisor_reciprocal,
    )


@cute.jit
def group_scale(amax):
    """A quantization group's scale: max(amax, AMAX_FLOOR) / E4M3_MAX, as fp8_scaling rounds it
    (the quotient from E4M3_MAX_RECIPROCAL, the host's rounding of the reciprocal)."""
    floored = cutlass.max(amax, cutlass.Float32(AMAX_FLOOR))
    return quotient(floored, cutlass.Float32(E4M3_MAX), cutlass.Float32(E4M3_MAX_RECIPROCAL))


@cute.jit
def divided_by_scale(values, scale):
    """A register tensor of the fp32 `values` (a register tensor) over `scale`, each as
    fp8_scaling divides."""
    scale_reciprocal = reciprocal(scale)
    quotients = cute.make_rmem_tensor(cute.size(values), cutlass.Float32)
    for i in cutlass.range_constexpr(cute.size(values)):
        quotients[i] = quotient(values[i], scale, scale_reciprocal)
    return quotients
