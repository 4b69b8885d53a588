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
