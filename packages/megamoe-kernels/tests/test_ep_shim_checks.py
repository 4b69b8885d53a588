"""The expert-parallel launchers refuse, before anything compiles or launches, the sizes their
kernels' fixed buffers cannot hold (no GPU needed: the check comes first)."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="CuTe DSL not installed"
)

# a valid small-batch call: 2 ranks x 128 tokens x top-8 = 2048 pairs, 128 experts per rank
VALID = dict(
    peer_table_address=0,
    epoch_address=0,
    status_address=0,
    tokens=128,
    top_k=8,
    local_experts=128,
    row_bytes=7168 * 2,
    capacity=2048,
    rank=0,
    world=2,
    max_tokens=128,
    pair_weights=False,
    timeout_ns=10**9,
    grid=132,
)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"world": 33}, "up to 32 ranks"),
        ({"max_tokens": 1024, "tokens": 16}, r"2 x 1024 x 8 = 16384"),
        ({"local_experts": 513}, "local_experts=513"),
        ({"tokens": 129}, r"tokens must be in \[0, max_tokens=128\], got 129"),
        ({"tokens": -1}, "tokens must be in"),
        ({"grid": 1}, "at least 2 CTAs"),
    ],
)
def test_small_dispatch_refuses_what_its_kernel_cannot_hold(change, message):
    from megamoe_kernels.shim import ep

    with pytest.raises(ValueError, match=message):
        ep.dispatch_small(0, 0, 0, 0, 0, **{**VALID, **change})
