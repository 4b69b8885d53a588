"""A weight pack with the experts' biases and the clamped SwiGLU (gpt-oss), or the softcapped
SwiGLU (Inkling2), on a CPU: its checks,
the reference backend computing the whole math, grouped_mm computing it as the reference does
(torch's CPU torch._grouped_mm, where this torch has one), the cutedsl backend laying the biases
out for its kernels, and the backend choice."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from megamoe_kernels import SwiGLU, interleave_gate_up, interleave_gate_up_bias
from megamoe_kernels.reference import expert_mlp_reference, relative_l2_error
from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.experts import _batch_refusal, make_backend, select_backend
from megamoe_runtime.experts.cutedsl import CuteDSLExperts
from megamoe_runtime.weights import SOFTCAPPED_SWIGLU, Unquantized, dequantize, quantize
from test_masked_batch import grouped_mm_runs_on_cpu

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


requires_cpu_grouped_mm = pytest.mark.skipif(
    not grouped_mm_runs_on_cpu(), reason="this torch has no CPU torch._grouped_mm"
)
# tail sizes with an empty expert, one expert taking every row, no rows at all
COUNTS = {"tails": [3, 0, 17, 1], "one expert": [0, 29, 0, 0], "no rows": [0, 0, 0, 0]}
# the pack's expert math, each feature alone and both
FEATURES = {
    "biases": dict(swiglu=SwiGLU()),
    "clamped swiglu": dict(w13_bias_E2I=None, w2_bias_EH=None),
    "both": {},
    "softcapped swiglu": dict(
        w13_bias_E2I=None, w2_bias_EH=None, swiglu=SwiGLU(gate_softcap=1.0, up_softcap=2.0)
    ),
}
PAST_THE_VALID_ROWS = 5


def tight_batch(counts: list[int], *, seed: int = 1) -> ExpertBatch:
    """bf16 rows of experts with `counts` rows each, and NaN rows past them up to the
    capacity: a backend that lets an unspecified row reach a valid one fails."""
    generator = torch.Generator().manual_seed(seed)
    valid = sum(counts)
    rows = torch.full((valid + PAST_THE_VALID_ROWS, H), float("nan"), dtype=torch.bfloat16)
    rows[:valid] = torch.randn(valid, H, generator=generator).to(torch.bfloat16)
    offsets = torch.zeros(E + 1, dtype=torch.int32)
    offsets[1:] = torch.tensor(counts).cumsum(0)
    return ExpertBatch(rows_MH=rows, expert_offsets=offsets, valid_rows=valid)


def reference_of(pack: Unquantized, batch: ExpertBatch, row_scale_M=None) -> torch.Tensor:
    """The fp32 oracle of the pack's whole expert math on the batch."""
    return expert_mlp_reference(
        batch.rows_MH,
        batch.expert_offsets,
        pack.w13_E2IH,
        pack.w2_EHI,
        row_scale_M,
        w13_bias_E2I=pack.w13_bias_E2I,
        w2_bias_EH=pack.w2_bias_EH,
        **pack.swiglu.constants(),
        expert_counts=batch.expert_counts,
    )


@requires_cpu_grouped_mm
@pytest.mark.parametrize("features", sorted(FEATURES))
@pytest.mark.parametrize("counts", COUNTS.values(), ids=COUNTS)
def test_grouped_mm_computes_the_expert_math_as_the_reference_does(counts, features):
    pack = replace(gpt_oss_pack(seed=2, dtype=torch.bfloat16), **FEATURES[features])
    batch = tight_batch(counts)
    scale_M = torch.rand(batch.capacity, generator=torch.Generator().manual_seed(3))
    backend = make_backend("grouped_mm")
    out = backend(batch, backend.prepare(pack), row_scale_M=scale_M)
    assert out.shape == (batch.capacity, H) and out.dtype == torch.bfloat16
    valid = sum(counts)
    assert torch.isfinite(out[:valid]).all()
    expected = reference_of(pack, batch, scale_M)[:valid]
    assert relative_l2_error(out[:valid], expected) < 1e-2
    if valid:  # the math is computed: without it the output is another
        plain = Unquantized(w13_E2IH=pack.w13_E2IH, w2_EHI=pack.w2_EHI)
        assert relative_l2_error(out[:valid], reference_of(plain, batch, scale_M)[:valid]) > 0.1


@requires_cpu_grouped_mm
def test_grouped_mm_computes_the_expert_math_on_a_masked_batch():
    stride, counts = 9, [9, 0, 1, 4]
    generator = torch.Generator().manual_seed(4)
    rows_ESH = torch.full((E, stride, H), float("nan"), dtype=torch.bfloat16)
    for expert, count in enumerate(counts):
        rows_ESH[expert, :count] = torch.randn(count, H, generator=generator).to(torch.bfloat16)
    batch = ExpertBatch.masked(rows_ESH, torch.tensor(counts, dtype=torch.int32))
    pack = gpt_oss_pack(seed=5, dtype=torch.bfloat16)
    backend = make_backend("grouped_mm")
    out_ESH = backend(batch, backend.prepare(pack)).view(E, stride, H)
    expected_ESH = reference_of(pack, batch).view(E, stride, H)
    valid_ES = torch.arange(stride)[None, :] < torch.tensor(counts)[:, None]
    assert torch.isfinite(out_ESH[valid_ES]).all()
    assert relative_l2_error(out_ESH[valid_ES], expected_ESH[valid_ES]) < 1e-2


@requires_cpu_grouped_mm
def test_grouped_mm_gradients_of_the_expert_math_match_the_reference():
    # rows past the valid ones (NaN in, unspecified out) reach no gradient: not the biases'
    counts = [3, 0, 17, 1]
    valid = sum(counts)
    batch = tight_batch(counts)
    pack = gpt_oss_pack(seed=6, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(7)
    scale_M = torch.rand(batch.capacity, generator=generator)
    probe = torch.randn(valid, H, generator=generator)
    tensors = {
        "rows": batch.rows_MH[:valid],
        "w13": pack.w13_E2IH,
        "w2": pack.w2_EHI,
        "w13_bias": pack.w13_bias_E2I,
        "w2_bias": pack.w2_bias_EH,
    }

    def gradients(dtype, compute):
        leaves = {name: t.to(dtype, copy=True).requires_grad_() for name, t in tensors.items()}
        rows = torch.cat((leaves["rows"], batch.rows_MH[valid:].to(dtype)))
        leaf_pack = Unquantized(
            w13_E2IH=leaves["w13"],
            w2_EHI=leaves["w2"],
            w13_bias_E2I=leaves["w13_bias"],
            w2_bias_EH=leaves["w2_bias"],
            swiglu=pack.swiglu,
        )
        out = compute(replace(batch, rows_MH=rows), leaf_pack)
        (out[:valid].float() * probe).sum().backward()
        return {name: leaf.grad for name, leaf in leaves.items()}

    backend = make_backend("grouped_mm")
    actual = gradients(torch.bfloat16, lambda b, p: backend(b, p, row_scale_M=scale_M))
    expected = gradients(torch.float32, lambda b, p: reference_of(p, b, scale_M))
    for name in tensors:
        assert torch.isfinite(actual[name]).all(), name
        # bf16 gradients (measured 3e-3 to 1.3e-2) against the fp32 oracle's
        assert relative_l2_error(actual[name], expected[name]) < 3e-2, name


def test_every_backend_takes_the_expert_math_of_its_pack():
    math = ("per-expert biases",)
    choice = dict(masked_batches=False, fp8_rows=False, expert_math=math)
    for name in ("cutedsl", "grouped_mm", "reference"):
        assert _batch_refusal(name, fp8_weights=False, **choice) is None
    # an FP8 pack holds no biases, and no FP8 pack is made of experts with them
    with pytest.raises(ValueError, match="per-expert biases, which the FP8 kernels are not"):
        quantize(gpt_oss_pack(dtype=torch.bfloat16))
    # a CPU: grouped_mm needs a CUDA device, whatever the experts compute
    name, reason = select_backend("auto", torch.device("cpu"), expert_math=math)
    assert name == "reference" and "needs a CUDA device" in reason


def test_a_softcapped_swiglu_is_named_and_kept_by_the_fp8_pack():
    base = gpt_oss_pack(dtype=torch.bfloat16)
    pack = Unquantized(
        w13_E2IH=base.w13_E2IH, w2_EHI=base.w2_EHI, swiglu=SwiGLU(gate_softcap=4, up_softcap=25)
    )
    assert pack.expert_math == (SOFTCAPPED_SWIGLU,)
    clamped_too = replace(pack, swiglu=replace(pack.swiglu, limit=7.0))
    assert clamped_too.expert_math == (
        SOFTCAPPED_SWIGLU,
        f"a clamped/scaled SwiGLU ({clamped_too.swiglu})",
    )
    choice = dict(masked_batches=False, fp8_rows=False, expert_math=pack.expert_math)
    for name in ("cutedsl", "grouped_mm", "reference"):
        for fp8_weights in (False, True):
            assert _batch_refusal(name, fp8_weights=fp8_weights, **choice) is None
    assert CuteDSLExperts().prepare(pack).swiglu == pack.swiglu
    fp8 = quantize(pack)
    assert fp8.swiglu == pack.swiglu and fp8.expert_math == pack.expert_math
    assert dequantize(fp8).swiglu == pack.swiglu
    wide = quantize(  # the FP8 kernels' intermediate size: whole 128-row weight blocks
        Unquantized(
            w13_E2IH=torch.randn(2, 256, 128, dtype=torch.bfloat16),
            w2_EHI=torch.randn(2, 128, 128, dtype=torch.bfloat16),
            swiglu=pack.swiglu,
        )
    )
    assert CuteDSLExperts().prepare(wide).swiglu == pack.swiglu


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


def test_the_cutedsl_backend_keeps_w13_as_the_model_holds_it():
    """No copy of w13, whatever I (a multiple of 8): the prepared weight is the pack's own
    tensor, bf16 and e4m3; weight packets (tile_pack) are packed from interleave_gate_up's
    copy."""
    from megamoe_kernels import pack_weight_tiles

    def pack_of(intermediate):
        return Unquantized(
            w13_E2IH=torch.randn(2, 2 * intermediate, 256, dtype=torch.bfloat16),
            w2_EHI=torch.randn(2, 256, intermediate, dtype=torch.bfloat16),
        )

    pack = pack_of(128)
    prepared = CuteDSLExperts().prepare(pack)
    assert prepared.w13 is pack.w13_E2IH
    fp8 = quantize(pack)
    assert CuteDSLExperts().prepare(fp8).w13 is fp8.w13_E2IH
    odd = pack_of(360)  # gpt-oss-style: I / 8 blocks are not whole 256-row tiles
    assert CuteDSLExperts().prepare(odd).w13 is odd.w13_E2IH
    packed = CuteDSLExperts(tile_pack=True).prepare(pack).w13
    expected, _ = pack_weight_tiles(interleave_gate_up(pack.w13_E2IH), None, gate_up=True)
    assert torch.equal(packed, expected)
