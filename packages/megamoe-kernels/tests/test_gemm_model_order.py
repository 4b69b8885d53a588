"""The gate-up GEMMs on w13 as the model holds it ([E, 2I, H], read through the view whose TMA
boxes write the interleaved order into shared memory) give interleave_gate_up's copy's bits, on an
sm_90 GPU: bf16 and FP8, decode (swap-AB) and prefill tiles, split K, pingpong, 2-CTA clusters,
gathered rows, masked batches, a bias with gpt-oss's activation, a last tile past I's blocks
(gpt-oss's I, 192-column tiles), tails and empty experts; the untouched rows past the valid
count stay as poisoned."""

from __future__ import annotations

import pytest
import torch
from gemm_cases import (
    DEVICE,
    expert_offsets,
    has_sm90,
    make_problem,
    poisoned,
    random_counts,
)
from megamoe_kernels import (
    FP8_DTYPE,
    GemmKnobs,
    SwiGLU,
    gate_up_fp8_launcher,
    gate_up_swiglu,
    gate_up_swiglu_fp8,
    interleave_gate_up,
    interleave_gate_up_bias,
    quantize_rows,
    quantize_weight_blocks,
    row_scales_buffer,
)

pytestmark = pytest.mark.gpu

if not has_sm90():
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

# (E, H, I): qwen3-30b-a3b's dims, dsv3's, mixtral-8x7b's (fewer experts), gpt-oss-120b's (360
# blocks: its last 256-row tile takes 8 of 16), and a small I of one 256-row tile
DIMS = {
    "qwen3": (16, 2048, 768),
    "dsv3": (8, 7168, 2048),
    "mixtral": (2, 4096, 14336),
    "gpt-oss": (4, 2880, 2880),
    "small": (8, 256, 128),
}
KNOBS = [
    None,  # the default profile's launches for the capacity
    GemmKnobs(tile_rows=16, tile_cols=64, stages=8, swap_ab=True),
    GemmKnobs(tile_rows=16, tile_cols=128, stages=6, swap_ab=True, split_k=2),
    GemmKnobs(tile_rows=64, tile_cols=256, stages=3, pingpong=True),
    GemmKnobs(tile_rows=128, tile_cols=128, stages=4, pingpong=True),
    GemmKnobs(tile_rows=128, tile_cols=256, stages=3, cluster=(2, 1)),
    # 12 blocks a tile: the last takes part of a tile but at I = 768
    GemmKnobs(tile_rows=128, tile_cols=192, stages=4),
]


def both_layouts(run, w13_E2IH):
    """(run's output on the model's w13, on interleave_gate_up's copy)."""
    return run(w13_E2IH), run(interleave_gate_up(w13_E2IH))


@pytest.mark.parametrize("dims", sorted(DIMS))
@pytest.mark.parametrize("rows_per_expert", [1, 5, 40, 300])
@pytest.mark.parametrize("knobs", KNOBS, ids=str)
def test_the_models_w13_gives_the_interleaved_copys_bits(dims, rows_per_expert, knobs):
    experts, hidden, intermediate = DIMS[dims]
    counts = random_counts(experts, experts * rows_per_expert, seed=rows_per_expert)
    counts[0] = 0  # an empty expert
    rows_MH, offsets, w13, _, valid = make_problem(
        counts, hidden, intermediate, capacity=sum(counts) + 7, seed=rows_per_expert
    )

    def run(w13_stored):
        out = poisoned((rows_MH.shape[0], intermediate))
        gate_up_swiglu(rows_MH, offsets, w13_stored, out_MI=out, knobs=knobs)
        return out

    model, interleaved = both_layouts(run, w13)
    assert torch.equal(model[:valid], interleaved[:valid])
    assert torch.isnan(model[valid:].float()).all()


@pytest.mark.parametrize("dims", ["qwen3", "dsv3"])
@pytest.mark.parametrize("rows_per_expert", [1, 8, 300])
def test_gathered_and_masked_gate_ups_on_the_models_w13(dims, rows_per_expert):
    experts, hidden, intermediate = DIMS[dims]
    counts = random_counts(experts, experts * rows_per_expert, seed=7)
    _, offsets, w13, _, valid = make_problem(counts, hidden, intermediate, seed=7)
    tokens = max(1, valid // 3)
    generator = torch.Generator(device=DEVICE).manual_seed(8)
    tokens_TH = torch.randn(tokens, hidden, device=DEVICE, generator=generator).bfloat16()
    source_M = torch.randint(tokens, (valid,), device=DEVICE, generator=generator).int()
    gathered = both_layouts(
        lambda w: gate_up_swiglu(tokens_TH, offsets, w, row_source_M=source_M), w13
    )
    assert torch.equal(*gathered)
    # a masked batch: a stride per expert, its first counts[e] rows valid
    stride = max(counts) + 3
    masked_offsets = expert_offsets([stride] * experts, DEVICE)
    counts_E = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    rows = torch.randn(stride * experts, hidden, device=DEVICE, generator=generator).bfloat16()
    masked = both_layouts(
        lambda w: gate_up_swiglu(rows, masked_offsets, w, expert_counts=counts_E), w13
    )
    for expert, count in enumerate(counts):
        first = expert * stride
        assert torch.equal(masked[0][first : first + count], masked[1][first : first + count])


@pytest.mark.parametrize("dims", ["qwen3", "gpt-oss", "small"])
@pytest.mark.parametrize("rows_per_expert", [1, 40, 300])
def test_a_biased_gate_up_on_the_models_w13_gives_the_interleaved_copys_bits(dims, rows_per_expert):
    # gpt-oss's epilogue: the bias stays interleaved (the kernel's order of N) for both layouts
    experts, hidden, intermediate = DIMS[dims]
    counts = random_counts(experts, experts * rows_per_expert, seed=11)
    rows_MH, offsets, w13, _, valid = make_problem(counts, hidden, intermediate, seed=11)
    generator = torch.Generator(device=DEVICE).manual_seed(12)
    bias = torch.randn(experts, 2 * intermediate, device=DEVICE, generator=generator)
    bias_EB2G = interleave_gate_up_bias(bias)
    swiglu = SwiGLU(limit=7.0, alpha=1.702, up_offset=1.0)

    def run(w13_stored):
        out = poisoned((rows_MH.shape[0], intermediate))
        gate_up_swiglu(
            rows_MH, offsets, w13_stored, out_MI=out, w13_bias_EB2G=bias_EB2G, swiglu=swiglu
        )
        return out

    model, interleaved = both_layouts(run, w13)
    assert torch.equal(model[:valid], interleaved[:valid])
    assert torch.isnan(model[valid:].float()).all()


@pytest.mark.parametrize("dims", ["qwen3", "dsv3", "mixtral"])
@pytest.mark.parametrize("rows_per_expert", [1, 5, 16, 300])
def test_the_fp8_gate_up_on_the_models_w13_gives_the_interleaved_copys_bits(dims, rows_per_expert):
    experts, hidden, intermediate = DIMS[dims]
    counts = random_counts(experts, experts * rows_per_expert, seed=rows_per_expert)
    rows_MH, offsets, w13, _, valid = make_problem(counts, hidden, intermediate, seed=3)
    w13_e4m3, w13_scales = quantize_weight_blocks(w13.float())
    rows, rows_scales = quantize_rows(rows_MH, 128)

    def run(w13_stored):
        group = gate_up_fp8_launcher(rows, offsets, w13_stored).out_group
        out = poisoned((rows.shape[0], intermediate), FP8_DTYPE)
        out_scales = row_scales_buffer(intermediate // group, rows.shape[0], device=DEVICE)
        gate_up_swiglu_fp8(
            rows, rows_scales, offsets, w13_stored, w13_scales, out_MI=out, out_scales=out_scales
        )
        return out.view(torch.uint8), out_scales

    model, interleaved = both_layouts(run, w13_e4m3)
    assert torch.equal(model[0][:valid], interleaved[0][:valid])
    assert torch.equal(model[1][:, :valid], interleaved[1][:, :valid])
