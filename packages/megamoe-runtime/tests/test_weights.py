"""Weight packs: the FP8 pack's checks, quantize/dequantize, and the backends that take it on a
CPU (the reference oracle on the dequantized values)."""

from __future__ import annotations

import pytest
import torch
from megamoe_kernels.reference import expert_mlp_reference, relative_l2_error
from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.experts import make_backend
from megamoe_runtime.weights import Prequantized, Unquantized, dequantize, quantize

E, H, INTER = 4, 256, 384


def random_pack(seed: int = 0) -> Unquantized:
    generator = torch.Generator().manual_seed(seed)
    return Unquantized(
        w13_E2IH=torch.randn(E, 2 * INTER, H, generator=generator) / H**0.5,
        w2_EHI=torch.randn(E, H, INTER, generator=generator) / INTER**0.5,
    )


def test_quantize_gives_e4m3_blocks_whose_dequantized_values_are_near_the_source():
    source = random_pack()
    pack = quantize(source)
    assert pack.w13_E2IH.dtype == torch.float8_e4m3fn
    assert pack.w13_scales.shape == (E, 6, 2) and pack.w2_scales.shape == (E, 2, 3)
    restored = dequantize(pack)
    assert restored.w13_E2IH.dtype == torch.float32
    assert relative_l2_error(restored.w13_E2IH, source.w13_E2IH) < 0.05
    assert relative_l2_error(restored.w2_EHI, source.w2_EHI) < 0.05
    # deterministic
    again = quantize(source)
    assert torch.equal(again.w2_EHI.view(torch.uint8), pack.w2_EHI.view(torch.uint8))


def test_the_reference_backend_computes_an_fp8_pack_on_its_dequantized_values():
    pack = quantize(random_pack(1))
    counts = torch.tensor([3, 0, 5, 2])
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = counts.cumsum(0)
    rows = torch.randn(int(counts.sum()), H)
    batch = ExpertBatch(rows_MH=rows, expert_offsets=offsets)
    backend = make_backend("reference")
    out = backend(batch, backend.prepare(pack))
    exact = dequantize(pack)
    assert torch.equal(out, expert_mlp_reference(rows, offsets, exact.w13_E2IH, exact.w2_EHI))


def test_an_fp8_pack_refuses_other_dtypes_and_misshaped_scales():
    pack = quantize(random_pack(2))
    with pytest.raises(TypeError, match="w13_E2IH must be torch.float8_e4m3fn"):
        Prequantized(
            w13_E2IH=pack.w13_E2IH.float(),
            w13_scales=pack.w13_scales,
            w2_EHI=pack.w2_EHI,
            w2_scales=pack.w2_scales,
        )
    with pytest.raises(ValueError, match=r"w2_scales must be float32 \[4, 2, 3\]"):
        Prequantized(
            w13_E2IH=pack.w13_E2IH,
            w13_scales=pack.w13_scales,
            w2_EHI=pack.w2_EHI,
            w2_scales=pack.w2_scales[:, :, :2],
        )
    with pytest.raises(ValueError, match="w2 must have shape"):
        Prequantized(
            w13_E2IH=pack.w13_E2IH,
            w13_scales=pack.w13_scales,
            w2_EHI=pack.w2_EHI[:, :, :128],
            w2_scales=pack.w2_scales,
        )
