"""The oracles against a per-row loop written independently of them."""

import torch
from megamoe_kernels.reference import (
    down_reference,
    expert_mlp_reference,
    gate_up_swiglu_reference,
    relative_l2_error,
)


def per_row_mlp(rows, expert_of_row, w13, w2, intermediate):
    out = []
    for row, expert in zip(rows.double(), expert_of_row, strict=True):
        gate_up = w13[expert].double() @ row
        hidden = torch.nn.functional.silu(gate_up[:intermediate]) * gate_up[intermediate:]
        out.append(w2[expert].double() @ hidden)
    return torch.stack(out)


def test_expert_mlp_reference_matches_per_row_loop_with_empty_experts_and_padding():
    experts, hidden, intermediate = 5, 24, 20
    counts = [3, 0, 7, 0, 1]
    offsets = torch.tensor([0, 3, 3, 10, 10, 11], dtype=torch.int32)
    capacity = 16  # five rows past the valid count
    rows = torch.randn(capacity, hidden)
    w13 = torch.randn(experts, 2 * intermediate, hidden)
    w2 = torch.randn(experts, hidden, intermediate)
    expert_of_row = [e for e, count in enumerate(counts) for _ in range(count)]
    expected = per_row_mlp(rows[:11], expert_of_row, w13, w2, intermediate)
    out = expert_mlp_reference(rows, offsets, w13, w2)
    assert relative_l2_error(out[:11], expected) < 1e-6
    assert (out[11:] == 0).all()

    scale = torch.rand(capacity)
    scaled = down_reference(gate_up_swiglu_reference(rows, offsets, w13), offsets, w2, scale)
    assert relative_l2_error(scaled[:11], expected * scale[:11, None].double()) < 1e-6


def test_relative_l2_error_flags_nan_and_scales():
    expected = torch.randn(10)
    assert relative_l2_error(expected, expected) == 0.0
    assert abs(relative_l2_error(expected.double() * 1.01, expected) - 0.01) < 1e-9
    poisoned = expected.clone()
    poisoned[3] = float("nan")
    assert not relative_l2_error(poisoned, expected) < 1.0
