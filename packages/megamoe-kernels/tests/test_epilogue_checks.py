"""The epilogue options' host side on a CPU: the SwiGLU's rules, the bias interleave, and the
GEMMs refusing bad biases and SwiGLUs naming the argument (before anything compiles)."""

from __future__ import annotations

import math

import pytest
import torch
from megamoe_kernels import (
    GEGLU,
    SwiGLU,
    down,
    down_launcher,
    gate_up_launcher,
    gate_up_swiglu,
    interleave_gate_up,
    interleave_gate_up_bias,
)
from megamoe_kernels.reference import swiglu as reference_swiglu

EXPERTS, HIDDEN, INTERMEDIATE, CAPACITY = 4, 256, 128, 10
META = {"device": "meta", "dtype": torch.bfloat16}


def meta_operands(capacity=CAPACITY):
    return (
        torch.empty(capacity, HIDDEN, **META),
        torch.empty(EXPERTS + 1, dtype=torch.int32, device="meta"),
        interleave_gate_up(torch.empty(EXPERTS, 2 * INTERMEDIATE, HIDDEN, **META)),
        torch.empty(EXPERTS, HIDDEN, INTERMEDIATE, **META),
        torch.empty(capacity, INTERMEDIATE, **META),
    )


def test_the_bias_interleave_follows_the_weight_rows():
    bias_E2I = torch.randn(3, 2 * 48, dtype=torch.bfloat16)
    # a weight whose every row holds its bias: interleaved the same way row by row
    rows_like_bias = bias_E2I.unsqueeze(-1).expand(-1, -1, 8).contiguous()
    interleaved = interleave_gate_up_bias(bias_E2I)
    assert interleaved.dtype == torch.float32 and interleaved.shape == (3, 6, 16)
    assert torch.equal(interleaved, interleave_gate_up(rows_like_bias)[..., 0].float())


@pytest.mark.parametrize(
    "bias",
    [torch.empty(3, 2 * 44), torch.empty(3, 2, 48), torch.empty(3, 96, dtype=torch.int32)],
    ids=["I not a multiple of 8", "3-D", "integer"],
)
def test_a_bias_interleave_of_a_bad_bias_is_refused(bias):
    with pytest.raises(ValueError, match=r"w13_bias must be a float \[E, 2I\]"):
        interleave_gate_up_bias(bias)


def test_the_swiglu_defaults_are_the_plain_one_and_the_constants_are_checked():
    assert SwiGLU().is_plain and not SwiGLU(limit=7).is_plain
    assert SwiGLU(limit=7, alpha=2, up_offset=1) == SwiGLU(limit=7.0, alpha=2.0, up_offset=1.0)
    for fields, error in [
        ({"limit": 0.0}, ValueError),
        ({"limit": math.inf}, ValueError),
        ({"alpha": math.nan}, ValueError),
        ({"up_offset": "1"}, TypeError),
        ({"limit": True}, TypeError),
        ({"gate_softcap": 0.0}, ValueError),
        ({"up_softcap": math.inf}, ValueError),
        ({"up_softcap": "25"}, TypeError),
        ({"gate_cubic": math.inf}, ValueError),
    ]:
        with pytest.raises(error, match=next(iter(fields))):
            SwiGLU(**fields)


def test_the_softcapped_swiglu_is_inkling2s_and_compiled_into_the_kernel():
    gate, up = torch.randn(1000) * 6, torch.randn(1000) * 40
    expected = 4.0 * torch.tanh(gate / 4.0) * torch.sigmoid(gate) * 25.0 * torch.tanh(up / 25.0)
    swiglu = SwiGLU(gate_softcap=4, up_softcap=25)
    assert swiglu.softcapped and not swiglu.is_plain and not SwiGLU(limit=7).softcapped
    torch.testing.assert_close(swiglu(gate, up), expected)
    # one cap alone
    torch.testing.assert_close(
        reference_swiglu(gate, up, up_softcap=25.0),
        torch.nn.functional.silu(gate) * 25.0 * torch.tanh(up / 25.0),
    )
    assert swiglu.kernel_constants() == {
        "swiglu_limit": None,
        "swiglu_alpha": 1.0,
        "swiglu_up_offset": 0.0,
        "swiglu_gate_softcap": 4.0,
        "swiglu_up_softcap": 25.0,
        "swiglu_gate_cubic": 0.0,
    }


def test_geglu_is_the_tanh_gelu_of_the_gate_times_up():
    gate, up = torch.randn(1000, dtype=torch.float64) * 6, torch.randn(1000, dtype=torch.float64)
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(GEGLU(gate, up).double(), expected, rtol=1e-6, atol=1e-6)
    assert GEGLU.clamped and not GEGLU.is_plain and not GEGLU.softcapped
    assert GEGLU.kernel_constants()["swiglu_gate_cubic"] == 0.044715


def test_the_swiglu_oracle_is_the_gpt_oss_activation():
    gate, up = torch.randn(1000) * 6, torch.randn(1000) * 6
    clamped_gate, clamped_up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    expected = clamped_gate * torch.sigmoid(1.702 * clamped_gate) * (clamped_up + 1.0)
    actual = reference_swiglu(gate, up, limit=7.0, alpha=1.702, up_offset=1.0)
    torch.testing.assert_close(actual, expected)


def test_bad_biases_and_swiglus_are_refused_naming_the_argument():
    rows_MH, offsets, w13, w2, hidden_MI = meta_operands()
    good_w13_bias = interleave_gate_up_bias(torch.empty(EXPERTS, 2 * INTERMEDIATE, **META))
    bad_gate_up = [
        (torch.empty(EXPERTS, 2 * INTERMEDIATE, device="meta"), "interleave_gate_up_bias"),
        (good_w13_bias.bfloat16(), r"w13_bias_EB2G must be float32 \[4, 16, 16\]"),
        (good_w13_bias[:3], r"w13_bias_EB2G must be float32 \[4, 16, 16\]"),
        ([0.0], "w13_bias_EB2G must be float32"),
    ]
    for bias, message in bad_gate_up:
        with pytest.raises(ValueError, match=message):
            gate_up_swiglu(rows_MH, offsets, w13, w13_bias_EB2G=bias, compile_only=True)
    with pytest.raises(ValueError, match="w13_bias_EB2G is on cpu"):
        gate_up_swiglu(
            rows_MH, offsets, w13, w13_bias_EB2G=torch.empty(4, 16, 16), compile_only=True
        )
    with pytest.raises(TypeError, match="swiglu must be a megamoe_kernels.SwiGLU"):
        gate_up_swiglu(rows_MH, offsets, w13, swiglu=(7.0, 1.702, 1.0), compile_only=True)
    bad_down = [
        (torch.empty(EXPERTS, HIDDEN, **META), r"w2_bias_EH must be float32 \[4, 256\]"),
        (torch.empty(EXPERTS, HIDDEN + 8, device="meta"), r"w2_bias_EH must be float32"),
        (torch.empty(EXPERTS + 1, HIDDEN, device="meta"), r"w2_bias_EH must be float32"),
    ]
    for bias, message in bad_down:
        with pytest.raises(ValueError, match=message):
            down(hidden_MI, offsets, w2, w2_bias_EH=bias, compile_only=True)


def test_a_launcher_takes_a_bias_exactly_when_bound_with_one():
    # an empty batch binds without compiling anything
    rows_MH, offsets, w13, w2, hidden_MI = meta_operands(capacity=0)
    w13_bias = interleave_gate_up_bias(torch.empty(EXPERTS, 2 * INTERMEDIATE, **META))
    w2_bias = torch.empty(EXPERTS, HIDDEN, device="meta")
    gate_up = gate_up_launcher(rows_MH, offsets, w13, w13_bias_EB2G=w13_bias, compile_only=True)
    assert gate_up(rows_MH, offsets, w13, bias=w13_bias).shape == (0, INTERMEDIATE)
    with pytest.raises(ValueError, match="bias is required by a launcher bound with one"):
        gate_up(rows_MH, offsets, w13)
    plain_down = down_launcher(hidden_MI, offsets, w2, compile_only=True)
    with pytest.raises(ValueError, match="bound without a bias"):
        plain_down(hidden_MI, offsets, w2, bias=w2_bias)


def test_the_fp8_gemms_are_not_built_with_biases():
    from megamoe_kernels.shim.expert_gemm import _launcher

    rows_MH, offsets, w13, _, _ = meta_operands()
    w13_bias = interleave_gate_up_bias(torch.empty(EXPERTS, 2 * INTERMEDIATE, **META))
    with pytest.raises(ValueError, match="gate_up_fp8 GEMM is not built with a bias"):
        _launcher(
            "gate_up_fp8",
            rows_MH,
            offsets,
            w13,
            row_scale_M=None,
            knobs=None,
            tuned_knobs=None,
            valid_rows=None,
            compile_only=True,
            bias=w13_bias,
        )
