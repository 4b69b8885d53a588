"""Compiling the drop's grouped GEMM for CuTe DSL's TVM-FFI launch path.

The compiled function takes torch tensors as they are: TVM-FFI reads each tensor's DLPack view
in C (no per-call conversion in Python), checks it against the compiled signature (dtype, shape,
strides, 16-byte alignment, one device for all) and launches on torch's current stream of that
device (the environment stream, so CUDA-graph capture records the launch). Measured on the H200:
a few microseconds per launch, against ~70 us for the pointer wrappers this replaces.

The signature: x [rows, K], w as stored ([E, ...], contiguous, E * N * K elements, each expert's
N x K block row-major), out [rows, N_out], offsets [E + 1] int32, row scale [rows] float32 or
None, for split-K variants the workspace: partials [words] float32 and arrivals [slots]
int32 (else None, None), and for variants with a dynamic schedule the unit counter [2] int32
(else None). `rows` is one symbol shared by x, out and the row scale (so a row
count that differs between them is refused before launch); the workspace sizes are runtime
dims too. The jit wrapper views w as the
(N, K, E) K-major tensor the kernel takes, so callers pass weights without a per-call permute.

Imported on first compile only: it imports CuTe DSL.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

TENSOR_ALIGN_BYTES = 16  # TMA and the 16-byte vector stores; the shim's checks say the same


class StoredWeightLaunch:
    """The drop's kernels of one call (one variant, or one per range of valid rows), launched
    one after the other from one host call, taking the weight in its stored layout."""

    def __init__(self, kernels, *, n: int, k: int, experts: int):
        self.kernels = kernels
        self.n, self.k, self.experts = n, k, experts

    @cute.jit
    def __call__(
        self, mX, mWStored, mOut, mOffsets, mRowScale, mPartials, mArrivals, mUnitCounter, stream
    ):
        n, k, experts = self.n, self.k, self.experts
        mW = cute.make_tensor(
            mWStored.iterator, cute.make_layout((n, k, experts), stride=(k, 1, n * k))
        )
        for kernel in self.kernels:
            kernel(mX, mW, mOut, mOffsets, mRowScale, mPartials, mArrivals, mUnitCounter, stream)


def row_major(dtype, shape):
    """A fake row-major tensor of `shape` (symbolic dims allowed), 16-byte aligned: a compiled
    signature's argument."""
    order = tuple(reversed(range(len(shape))))
    return make_fake_compact_tensor(
        dtype, shape, stride_order=order, assumed_align=TENSOR_ALIGN_BYTES
    )


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
):
    """cute.compile of `kernels` behind StoredWeightLaunch, for the TVM-FFI calling convention:
    the result is called as f(x, w, out, offsets, row_scale_or_None, partials_or_None,
    arrivals_or_None, unit_counter_or_None) with torch tensors (the workspace when split_k > 1:
    at most one of the kernels splits K; the counter when one has a dynamic schedule)."""
    experts = weight_shape[0]
    rows = cute.sym_int32(symbol="rows")
    x = row_major(cutlass.BFloat16, (rows, k))
    w = row_major(cutlass.BFloat16, tuple(weight_shape))
    out = row_major(cutlass.BFloat16, (rows, n_out))
    offsets = row_major(cutlass.Int32, (experts + 1,))
    row_scale = row_major(cutlass.Float32, (rows,)) if has_row_scale else None
    partials = arrivals = None
    if split_k > 1:
        partials = row_major(cutlass.Float32, (cute.sym_int32(symbol="partial_words"),))
        arrivals = row_major(cutlass.Int32, (cute.sym_int32(symbol="slots"),))
    unit_counter = row_major(cutlass.Int32, (2,)) if dynamic_schedule else None
    launch = StoredWeightLaunch(kernels, n=n, k=k, experts=experts)
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
        make_fake_stream(use_tvm_ffi_env_stream=True),
        options="--enable-tvm-ffi",
    )
