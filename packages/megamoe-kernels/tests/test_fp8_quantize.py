"""FP8 block quantization on the host: round trips, the scale layouts, the recipe's edge cases
(no GPU)."""

from __future__ import annotations

import pytest
import torch
from megamoe_kernels import (
    FP8_DTYPE,
    dequantize_rows,
    dequantize_weight_blocks,
    quantize_rows,
    quantize_weight_blocks,
    row_scales_buffer,
)
from megamoe_kernels.reference import fp8_difference, relative_l2_error


@pytest.mark.parametrize("shape", [(2, 256, 384), (3, 200, 130), (1, 128, 128)])
def test_weight_blocks_round_trip_within_e4m3_precision(shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    quantized, scales = quantize_weight_blocks(w)
    assert quantized.dtype == FP8_DTYPE and quantized.shape == w.shape
    assert scales.shape == (shape[0], -(-shape[1] // 128), -(-shape[2] // 128))
    restored = dequantize_weight_blocks(quantized, scales)
    # e4m3 keeps 3 mantissa bits: at most 1/16 relative rounding per value
    assert relative_l2_error(restored, w) < 0.04
    assert fp8_difference(restored, w) < 1e-3
    # each block's largest value maps to 448 (the scale is its amax / 448)
    assert quantized.float().abs().amax() == 448


def test_weight_blocks_dequantize_to_a_narrower_dtype_as_float32_rounded_once():
    w = torch.randn(40, 200, 130, generator=torch.Generator().manual_seed(1))
    quantized, scales = quantize_weight_blocks(w)
    exact = dequantize_weight_blocks(quantized, scales)
    narrow = dequantize_weight_blocks(quantized, scales, torch.bfloat16)
    assert narrow.dtype == torch.bfloat16
    assert torch.equal(narrow, exact.to(torch.bfloat16))


def test_weight_scale_is_each_blocks_amax():
    w = torch.zeros(1, 256, 256)
    w[0, 5, 7] = 3.0
    w[0, 200, 130] = -0.5
    _, scales = quantize_weight_blocks(w)
    assert scales[0, 0, 0] == pytest.approx(3.0 / 448)
    assert scales[0, 1, 1] == pytest.approx(0.5 / 448)
    # an all-zero block gets the floor, never a zero scale (no 0/0)
    assert 0 < scales[0, 0, 1] < 1e-12
    quantized, _ = quantize_weight_blocks(w)
    assert torch.isfinite(quantized.float()).all()


@pytest.mark.parametrize("group", [128, 64])
@pytest.mark.parametrize("rows, k", [(5, 256), (1, 200), (7, 2112)])
def test_rows_round_trip_and_the_scale_layout(group, rows, k):
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    quantized, scales = quantize_rows(x, group)
    assert quantized.shape == x.shape
    assert scales.shape == (-(-k // group), rows)
    # group-major, rows contiguous
    assert scales.stride() == (rows, 1)
    restored = dequantize_rows(quantized, scales, group)
    assert relative_l2_error(restored, x) < 0.04
    expected = x.float()[:, :group].abs().amax(dim=1) / 448
    torch.testing.assert_close(scales[0], expected)


def test_quantization_is_deterministic_and_saturates_nothing():
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(2)) * 1e4
    first, scales = quantize_rows(x)
    second, _ = quantize_rows(x)
    assert torch.equal(first.view(torch.uint8), second.view(torch.uint8))
    assert first.float().abs().max() <= 448
    assert torch.isfinite(dequantize_rows(first, scales)).all()


def test_row_scale_buffers_are_group_major_with_contiguous_rows():
    scales = row_scales_buffer(3, 5)
    assert scales.shape == (3, 5) and scales.stride() == (5, 1)


def test_bad_inputs_are_refused_naming_the_problem():
    with pytest.raises(ValueError, match=r"\[E, N, K\]"):
        quantize_weight_blocks(torch.randn(4, 4))
    with pytest.raises(ValueError, match="group must be 128"):
        quantize_rows(torch.randn(2, 256), group=32)
    quantized, scales = quantize_weight_blocks(torch.randn(1, 256, 256))
    with pytest.raises(ValueError, match="weight scales must be"):
        dequantize_weight_blocks(quantized, scales[:, :1])
