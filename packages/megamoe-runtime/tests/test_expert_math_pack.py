"""A weight pack with the experts' biases and the clamped SwiGLU (gpt-oss) on a CPU: its checks,
the reference backend computing the whole math, grouped_mm refusing it, the cutedsl backend
laying the biases out for its kernels, and the backend choice."""

from __future__ import annotations

import pytest
import torch
from megamoe_kernels import SwiGLU, interleave_gate_up, interleave_gate_up_bias
from megamoe_kernels.reference import expert_mlp_reference
from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.experts import backend_status, make_backend, select_backend
from megamoe_runtime.experts.cutedsl import CuteDSLExperts
from megamoe_runtime.weights import Unquantized, quantize

E, H, INTER = 4, 64, 48
GPT_OSS_SWIGLU = SwiGLU(limit=7.0, alpha=1.702, up_offset=1.0)


def gpt_oss_pack(seed: int = 0, dtype=torch.float32) -> Unquantized:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    return Unquantized(
        w13_E2IH=randn(E, 2 * INTER, H, scale=4 / H**0.5),
        w2_EHI=randn(E, H, INTER, scale=1 / INTER**0.5),
        w13_bias_E2I=randn(E, 2 * INTER, scale=2.0),
        w2_bias_EH=randn(E, H, scale=1.0),
        swiglu=GPT_OSS_SWIGLU,
    )


def test_the_reference_backend_computes_the_biases_and_the_clamped_swiglu():
    pack = gpt_oss_pack()
    counts = torch.tensor([3, 0, 5, 2])
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = counts.cumsum(0)
    rows = torch.randn(int(counts.sum()), H)
    scale_M = torch.rand(rows.shape[0])
    backend = make_backend("reference")
    out = backend(
        ExpertBatch(rows_MH=rows, expert_offsets=offsets),
        backend.prepare(pack),
        row_scale_M=scale_M,
    )
    expected = expert_mlp_reference(
        rows,
        offsets,
        pack.w13_E2IH,
        pack.w2_EHI,
        scale_M,
        w13_bias_E2I=pack.w13_bias_E2I,
        w2_bias_EH=pack.w2_bias_EH,
        limit=7.0,
        alpha=1.702,
        up_offset=1.0,
    )
    assert torch.equal(out, expected)
    plain = Unquantized(w13_E2IH=pack.w13_E2IH, w2_EHI=pack.w2_EHI)
    assert not torch.equal(out, backend(ExpertBatch(rows, offsets), plain, row_scale_M=scale_M))


def test_the_pack_names_its_expert_math_and_checks_the_biases():
    pack = gpt_oss_pack()
    assert pack.expert_math == ("per-expert biases", f"a clamped/scaled SwiGLU ({GPT_OSS_SWIGLU})")
    assert Unquantized(w13_E2IH=pack.w13_E2IH, w2_EHI=pack.w2_EHI).expert_math == ()
    with pytest.raises(ValueError, match=r"w13_bias_E2I must have shape \(4, 96\)"):
        Unquantized(w13_E2IH=pack.w13_E2IH, w2_EHI=pack.w2_EHI, w13_bias_E2I=pack.w2_bias_EH)
    with pytest.raises(ValueError, match="w2_bias_EH must be a float tensor"):
        Unquantized(w13_E2IH=pack.w13_E2IH, w2_EHI=pack.w2_EHI, w2_bias_EH=pack.w2_bias_EH.int())
    with pytest.raises(TypeError, match="swiglu must be a megamoe_kernels.SwiGLU"):
        Unquantized(w13_E2IH=pack.w13_E2IH, w2_EHI=pack.w2_EHI, swiglu=7.0)
    with pytest.raises(ValueError, match="FP8 kernels are not built for"):
        quantize(pack)


def test_grouped_mm_refuses_the_expert_math_naming_it():
    with pytest.raises(ValueError, match="grouped_mm computes bias-free.*per-expert biases"):
        make_backend("grouped_mm").prepare(gpt_oss_pack(dtype=torch.bfloat16))
    available, reason = backend_status(
        "grouped_mm", torch.device("cuda"), expert_math=("per-expert biases",)
    )
    assert not available and "per-expert biases" in reason
    name, reason = select_backend("auto", torch.device("cpu"), expert_math=("per-expert biases",))
    assert name == "reference"


def test_the_cutedsl_backend_interleaves_the_w13_bias_like_w13_and_keeps_both_in_float32():
    pack = gpt_oss_pack(dtype=torch.bfloat16)
    prepared = CuteDSLExperts().prepare(pack)
    assert prepared.swiglu == GPT_OSS_SWIGLU
    assert prepared.w13_bias_EB2G.dtype == prepared.w2_bias_EH.dtype == torch.float32
    assert torch.equal(prepared.w13_bias_EB2G, interleave_gate_up_bias(pack.w13_bias_E2I))
    # row r of the interleaved w13 and entry r of the interleaved bias are the same source row
    marked = pack.w13_E2IH.clone()
    marked[..., 0] = pack.w13_bias_E2I
    assert torch.equal(interleave_gate_up(marked)[..., 0].float(), prepared.w13_bias_EB2G)
    assert torch.equal(prepared.w2_bias_EH, pack.w2_bias_EH.float())
    plain = CuteDSLExperts().prepare(Unquantized(w13_E2IH=pack.w13_E2IH, w2_EHI=pack.w2_EHI))
    assert plain.w13_bias_EB2G is None and plain.w2_bias_EH is None and plain.swiglu.is_plain
