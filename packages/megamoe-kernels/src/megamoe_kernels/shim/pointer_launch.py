"""Launching the drop's grouped GEMM from raw pointers.

A call passes data pointers and the row count, and the jit wrapper builds the kernel's tensors
from them. This replaces per-tensor DLPack conversion: a converted tensor holds a DLPack capsule
that keeps its torch tensor alive, so a cache of converted tensors keyed by pointer kept every
batch and weight it had seen alive (tens of GB at prefill sizes) and missed on every call anyway
(each call's fresh output could not reuse a block the cache held). Pointers cost nothing to make
and hold nothing.

Imported on first compile only: it imports CuTe DSL.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_ptr

_DTYPES = {"bfloat16": cutlass.BFloat16, "float32": cutlass.Float32, "int32": cutlass.Int32}


def pointer(dtype_name: str, address: int):
    """A global-memory pointer the launcher takes (16-byte aligned, as the shim checks)."""
    return make_ptr(_DTYPES[dtype_name], address, cute.AddressSpace.gmem, assumed_align=16)


class PointerLaunch:
    """Wraps one compiled variant of the drop's kernel: x [rows, K], w (N, K, E) K-major,
    out [rows, N_out], offsets [E + 1], optional row scale [rows]; rows is the only runtime dim."""

    def __init__(self, kernel, *, k: int, n: int, experts: int, n_out: int, has_row_scale: bool):
        self.kernel = kernel
        self.k, self.n, self.experts, self.n_out = k, n, experts, n_out
        self.has_row_scale = has_row_scale

    @cute.jit
    def __call__(self, x_ptr, w_ptr, out_ptr, offsets_ptr, scale_ptr, rows: cutlass.Int32, stream):
        k, n, experts, n_out = self.k, self.n, self.experts, self.n_out
        mX = cute.make_tensor(x_ptr, cute.make_layout((rows, k), stride=(k, 1)))
        mW = cute.make_tensor(w_ptr, cute.make_layout((n, k, experts), stride=(k, 1, n * k)))
        mOut = cute.make_tensor(out_ptr, cute.make_layout((rows, n_out), stride=(n_out, 1)))
        mOffsets = cute.make_tensor(offsets_ptr, cute.make_layout(experts + 1))
        mRowScale = None
        if cutlass.const_expr(self.has_row_scale):
            mRowScale = cute.make_tensor(scale_ptr, cute.make_layout(rows))
        self.kernel(mX, mW, mOut, mOffsets, mRowScale, stream)
