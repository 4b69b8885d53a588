"""The expert-parallel dispatch/combine kernels compile for sm_90a without a GPU."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.compile


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="CuTe DSL not installed")
@pytest.mark.parametrize("top_k", [1, 8])
def test_ep_kernels_compile(top_k):
    from megamoe_kernels.shim import ep

    before = ep.cached_kernel_count()
    ep.compile_all(top_k=top_k, grid=132)
    assert ep.cached_kernel_count() >= before
    assert set(ep.phases()) == {"dispatch counts", "dispatch rows", "combine"}


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="CuTe DSL not installed")
@pytest.mark.parametrize(
    ("top_k", "hidden"),
    [
        (8, 7168),  # DeepSeek-V3: 56 whole groups of 128, e4m3 rows of 448 16-byte vectors
        (1, 2880),  # gpt-oss: 22.5 groups (a partial last one), rows not a multiple of 32 vectors
    ],
)
def test_ep_kernels_compile_with_the_fp8_wire(top_k, hidden):
    """Every kernel with an FP8 dispatch and an FP8 combine (the quantizing and dequantizing
    variants of the dispatch and combine kernels; the others compile unchanged)."""
    from megamoe_kernels.shim import ep

    before = ep.cached_kernel_count()
    after = ep.compile_all(
        top_k=top_k, grid=132, row_bytes=hidden * 2, fp8_rows=True, fp8_combine=True
    )
    assert after == before + len(ep.KERNELS)  # a variant of its own for every kernel
