"""Warp-level primitives shared by the drop's kernels (a whole warp calls each, converged)."""

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm


@cute.jit
def warp_inclusive_sum(value, lane):
    """Inclusive prefix sum of an Int32 over the lanes of a warp (shuffles, 5 steps)."""
    total = value
    for step in cutlass.range_constexpr(5):
        distance = 1 << step
        below = cute.arch.shuffle_sync_up(total, distance)
        if lane >= distance:
            total = total + below
    return total


def lanes_with_same_value(value):
    """Mask of the warp's lanes whose Int32 `value` equals this lane's (match.any.sync)."""
    return cutlass.Int32(
        llvm.inline_asm(
            cutlass.Int32.mlir_type,
            [cutlass.Int32(value).ir_value()],
            "match.any.sync.b32 $0, $1, -1;",
            "=r,r",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )
