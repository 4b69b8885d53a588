"""The weight-packet layout on the CPU (shim/weight_packets.py): tile order, the scale words and
the padding of each FP8 packet, the round trip to row-major, what packing refuses; and, compiled
for sm_90a, the GEMMs on packed weights, with the arguments they refuse.

Packed and row-major weights giving the same output bits on a GPU: test_gemm_packed.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from megamoe_kernels import (
    FP8_DTYPE,
    GemmKnobs,
    interleave_gate_up,
    pack_weight_tiles,
    quantize_weight_blocks,
    stored_weight_dims,
    unpack_weight_tiles,
)
from megamoe_kernels.shim.weight_packets import SCALED_PACKET_BYTES, TILE_BYTES

EXPERTS, HIDDEN, INTERMEDIATE = 3, 512, 256


def bf16_weights(seed=0):
    generator = torch.Generator().manual_seed(seed)
    w13 = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator).bfloat16()
    w2 = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator).bfloat16()
    return interleave_gate_up(w13), w2


def fp8_weights(seed=0):
    generator = torch.Generator().manual_seed(seed)
    w13, w13_scales = quantize_weight_blocks(
        torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator)
    )
    w2, w2_scales = quantize_weight_blocks(
        torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator)
    )
    return interleave_gate_up(w13), w13_scales, w2, w2_scales


def test_bf16_tiles_lie_whole_in_the_order_the_kernels_read_them():
    w13, w2 = bf16_weights()
    for weight, gate_up in ((w13, True), (w2, False)):
        packed, words = pack_weight_tiles(weight, gate_up=gate_up)
        assert words is None
        experts, n, k = stored_weight_dims(weight)
        assert stored_weight_dims(packed) == (experts, n, k)
        rows = weight.reshape(experts, n, k)
        flat = packed.view(torch.uint8).as_strided((packed.numel() * 2,), (1,))
        # packet (e, t, j): rows 128 t.. of K tile j (64 values), one contiguous 16 KB run
        for e, t, j in ((0, 0, 0), (1, 2, 3), (experts - 1, n // 128 - 1, k // 64 - 1)):
            start = ((e * (n // 128) + t) * (k // 64) + j) * TILE_BYTES
            tile = rows[e, 128 * t : 128 * (t + 1), 64 * j : 64 * (j + 1)].contiguous()
            assert torch.equal(flat[start : start + TILE_BYTES], tile.view(torch.uint8).flatten())
        assert torch.equal(unpack_weight_tiles(packed), rows)


def test_fp8_packets_hold_their_tile_then_its_scale_words_then_zeros():
    w13, w13_scales, w2, w2_scales = fp8_weights()
    gate_blocks = INTERMEDIATE // 128
    for weight, scales, gate_up in ((w13, w13_scales, True), (w2, w2_scales, False)):
        packed, words = pack_weight_tiles(weight, scales, gate_up=gate_up)
        experts, n, k = stored_weight_dims(weight)
        n_tiles, k_tiles = n // 128, k // 128
        assert packed.stride(2) == SCALED_PACKET_BYTES  # a packet: 128 x 128 bytes + 128
        storage = torch.frombuffer(bytearray(packed.untyped_storage()), dtype=torch.uint8).view(
            experts, n_tiles, k_tiles, SCALED_PACKET_BYTES
        )
        rows = weight.reshape(experts, n, k).view(torch.uint8)
        for e, t, j in ((0, 0, 0), (2, n_tiles - 1, 1), (1, 1, k_tiles - 1)):
            tile = rows[e, 128 * t : 128 * (t + 1), 128 * j : 128 * (j + 1)]
            assert torch.equal(storage[e, t, j, :TILE_BYTES], tile.flatten())
            scale_words = storage[e, t, j, TILE_BYTES : TILE_BYTES + 8].view(torch.float32)
            # gate-up: its 64 gate rows' block, then its 64 up rows' block; down: its block twice
            if gate_up:
                expected = scales[e, [t // 2, gate_blocks + t // 2], j]
            else:
                expected = scales[e, [t, t], j]
            assert torch.equal(scale_words, expected)
            assert torch.equal(words[e, t, j], expected)
            assert not storage[e, t, j, TILE_BYTES + 8 :].any()
        assert torch.equal(unpack_weight_tiles(packed).view(torch.uint8), rows)


def test_packing_is_deterministic_and_leaves_its_source_alone():
    w13, w13_scales, _, _ = fp8_weights(seed=3)
    before = w13.view(torch.uint8).clone()
    first, _ = pack_weight_tiles(w13, w13_scales, gate_up=True)
    second, _ = pack_weight_tiles(w13, w13_scales, gate_up=True)
    assert torch.equal(first.view(torch.uint8), second.view(torch.uint8))
    assert torch.equal(w13.view(torch.uint8), before)


@pytest.mark.parametrize(
    "weight, scales, gate_up, message",
    [
        (torch.zeros(2, 2880, 2880, dtype=torch.bfloat16), None, False, "N=2880 weight rows"),
        (torch.zeros(2, 256, 200, dtype=torch.bfloat16), None, False, "K=200 is not a multiple"),
        (torch.zeros(2, 256, 256), None, False, "dtype torch.float32"),
        (torch.zeros(2, 256, 256, dtype=torch.bfloat16), torch.ones(2, 2, 2), False, "no scales"),
        (torch.zeros(2, 256, 256).to(FP8_DTYPE), None, False, "block scales"),
        # FP8 gate-up: I = 192 would put a packet's gate rows in two scale blocks
        (torch.zeros(2, 24, 16, 256).to(FP8_DTYPE), torch.ones(2, 3, 2), True, "N=384"),
        (torch.zeros(2, 256, 256, dtype=torch.bfloat16), None, True, "interleave_gate_up"),
    ],
)
def test_what_cannot_be_packed_is_refused_with_the_reason(weight, scales, gate_up, message):
    with pytest.raises(ValueError, match=message):
        pack_weight_tiles(weight, scales, gate_up=gate_up)


compile_only = pytest.mark.compile


@compile_only
def test_the_gemms_compile_on_packed_weights_and_refuse_what_they_cannot_read():
    if not torch.cuda.is_available():
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    pytest.importorskip("cutlass")
    from megamoe_kernels import (
        down,
        down_fp8,
        gate_up_fp8_launcher,
        gate_up_launcher,
        row_scales_buffer,
    )

    offsets = torch.zeros(EXPERTS + 1, dtype=torch.int32)
    w13, w2 = bf16_weights()
    packed_w13, _ = pack_weight_tiles(w13, gate_up=True)
    packed_w2, _ = pack_weight_tiles(w2, gate_up=False)
    rows = 64 * EXPERTS
    # the default launches of a prefill capacity: 128 x 256 tiles (two packets) and decode tiles
    gate_up_launcher(
        torch.empty(rows, HIDDEN, dtype=torch.bfloat16), offsets, packed_w13, compile_only=True
    )
    hidden = torch.empty(rows, INTERMEDIATE, dtype=torch.bfloat16)
    down(hidden, offsets, packed_w2, compile_only=True)
    with pytest.raises(ValueError, match="tile_cols=192 with packed weights"):
        down(
            hidden,
            offsets,
            packed_w2,
            knobs=GemmKnobs(tile_rows=128, tile_cols=192, stages=3),
            compile_only=True,
        )
    with pytest.raises(ValueError, match="not built with a bias"):
        down(hidden, offsets, packed_w2, w2_bias_EH=torch.zeros(EXPERTS, HIDDEN), compile_only=True)

    q13, s13, q2, s2 = fp8_weights()
    packed_q13, _ = pack_weight_tiles(q13, s13, gate_up=True)
    packed_q2, words2 = pack_weight_tiles(q2, s2, gate_up=False)
    gate_up_fp8_launcher(
        torch.empty(rows, HIDDEN, dtype=FP8_DTYPE), offsets, packed_q13, compile_only=True
    )
    hidden_q = torch.empty(rows, INTERMEDIATE, dtype=FP8_DTYPE)
    hidden_scales = row_scales_buffer(INTERMEDIATE // 64, rows)
    down_fp8(hidden_q, hidden_scales, offsets, packed_q2, words2, compile_only=True)
    # an FP8 packet's strides are its layout (tile and scale words): a contiguous copy of the
    # tiles is refused
    with pytest.raises(ValueError, match="strides"):
        down_fp8(
            hidden_q, hidden_scales, offsets, packed_q2.contiguous(), words2, compile_only=True
        )
    # the scale words of another allocation, or the row-major scales, are refused
    for scales in (words2.clone(), s2):
        with pytest.raises(ValueError, match="scale words pack_weight_tiles returned"):
            down_fp8(hidden_q, hidden_scales, offsets, packed_q2, scales, compile_only=True)
