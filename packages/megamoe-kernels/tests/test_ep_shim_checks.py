"""The expert-parallel launchers refuse, before anything compiles or launches, the sizes their
kernels' fixed buffers cannot hold (no GPU needed: the check comes first); the EpParams they all
take refuses an inconsistent group."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="CuTe DSL not installed"
)

# a valid small-batch group: 2 ranks x 128 tokens x top-8 = 2048 pairs, 128 experts per rank
VALID = dict(
    peer_table_address=0,
    epoch_address=0,
    status_address=0,
    placement_scratch_address=0,
    small_scratch_address=0,
    timeout_ns=10**9,
    rank=0,
    world=2,
    num_experts=256,
    local_experts=128,
    capacity=2048,
    max_tokens=128,
    row_vectors=7168 * 2 // 16,
    pair_weights=False,
    top_k=8,
    grid=132,
)


def small_dispatch(params, tokens=128):
    from megamoe_kernels.shim import ep

    ep.dispatch_small(
        params,
        x_address=0,
        expert_of_pair_address=0,
        weights_address=0,
        expert_offsets_address=0,
        tokens=tokens,
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"world": 33, "num_experts": 33 * 128}, "up to 32 ranks"),
        ({"max_tokens": 1024}, r"2 x 1024 x 8 = 16384"),
        ({"local_experts": 513, "num_experts": 1026}, "local_experts=513"),
        ({"grid": 1}, "at least 2 CTAs"),
    ],
)
def test_small_dispatch_refuses_what_its_kernel_cannot_hold(change, message):
    from megamoe_kernels.shim import ep

    with pytest.raises(ValueError, match=message):
        small_dispatch(ep.EpParams(**{**VALID, **change}))


@pytest.mark.parametrize(
    ("tokens", "message"), [(129, r"\[0, max_tokens=128\], got 129"), (-1, "")]
)
def test_token_counts_outside_the_buffers_are_refused(tokens, message):
    from megamoe_kernels.shim import ep

    with pytest.raises(ValueError, match=f"tokens must be in {message}"):
        small_dispatch(ep.EpParams(**VALID), tokens=tokens)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rank": 2}, r"rank must be in \[0, world=2\), got 2"),
        ({"num_experts": 255}, "local_experts x world = 128 x 2, got 255"),
        ({"grid": 0}, "grid must be >= 1"),
        ({"fp8_rows": True, "row_vectors": 9}, r"fp8_rows needs .* got row_vectors=9"),
        ({"fp8_combine": True, "row_vectors": 9}, r"fp8_combine needs .* got row_vectors=9"),
    ],
)
def test_params_refuse_an_inconsistent_group(change, message):
    from megamoe_kernels.shim import ep

    with pytest.raises(ValueError, match=message):
        ep.EpParams(**{**VALID, **change})


def test_the_fp8_wire_is_compiled_in_and_unrolls_over_e4m3_rows():
    """The wire flags key the compiled kernels; the dispatch's copies count e4m3 vectors."""
    from megamoe_kernels.shim import ep

    bf16 = ep.EpParams(**VALID)
    fp8 = ep.EpParams(**{**VALID, "fp8_rows": True, "fp8_combine": True})
    assert bf16.compile_time != fp8.compile_time
    assert fp8.compile_time == {"top_k": 8, "grid": 132, "fp8_rows": 1, "fp8_combine": 1}
    assert fp8.dispatch_row_bytes == 7168 and bf16.dispatch_row_bytes == 7168 * 2
    # 896 bf16 vectors: 4 loads per lane in flight; 448 e4m3 ones: 2
    assert ep._dispatch_unroll(bf16) == 4 and ep._dispatch_unroll(fp8) == 2


def test_every_launcher_passes_what_its_drop_kernel_takes():
    """The audit entries derive from the launchers; the drop's EpParams has the shim's fields."""
    from megamoe_kernels.shim import ep
    from megamoe_kernels.shim.audit import AUDIT_TABLE, audit_drop

    entries = {(e.module, e.name): e.parameters for e in AUDIT_TABLE}
    for kernel in ep.KERNELS.values():
        assert entries[(kernel.module, kernel.function)] == kernel.drop_parameters
    assert entries[("ep_sync", "EpParams")] == tuple(
        f.name for f in dataclasses.fields(ep.EpParams)
    )
    assert audit_drop().passed
