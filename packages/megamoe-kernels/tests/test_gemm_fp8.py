"""The FP8 grouped GEMMs on an sm_90 GPU against fp32 oracles on the dequantized operands.

Every case: fresh random rows and weights quantized with the host recipe (shim/fp8.py), rows
past the valid count NaN (they must never reach an output), outputs and output scales poisoned
with NaN (valid rows must be overwritten, the rest left untouched).
- down_fp8: bf16 out against the fp32 product of its dequantized operands, rel-L2 <= 1e-2;
- gate_up_swiglu_fp8: its e4m3 output dequantized against the fp32 SwiGLU of the dequantized
  operands (the output's own e4m3 rounding included), rel-L2 <= 5e-2, and each scale within
  2% of the oracle row group's amax / 448, in the groups its launcher writes (out_group: 128
  columns with 256-column prefill tiles, else 64); down_fp8 on rows of either group.
"""

from __future__ import annotations

import pytest
import torch
from gemm_cases import (
    DEVICE,
    assert_valid_rows_match,
    expert_offsets,
    has_sm90,
    poisoned,
    random_counts,
    random_rows,
    random_weights,
)
from megamoe_kernels import (
    FP8_DTYPE,
    GEGLU,
    GemmKnobs,
    SwiGLU,
    candidate_knobs,
    default_launches,
    dequantize_rows,
    dequantize_weight_blocks,
    down_fp8,
    down_fp8_launcher,
    gate_up_fp8_launcher,
    gate_up_swiglu_fp8,
    interleave_gate_up,
    quantize_rows,
    quantize_weight_blocks,
    row_scales_buffer,
)
from megamoe_kernels.reference import (
    down_reference,
    expert_mlp_reference,
    fp8_difference,
    gate_up_swiglu_reference,
    relative_l2_error,
)

pytestmark = pytest.mark.gpu

if not has_sm90():
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

DOWN_TOLERANCE = 1e-2
GATE_UP_TOLERANCE = 5e-2
GEOMETRY_DIMS = {
    "qwen3-30b-a3b": (16, 2048, 768),
    "dsv3": (16, 7168, 2048),
    "mixtral-8x7b": (4, 4096, 14336),
    "partial-k": (8, 2112, 1408),
    "tiny": (16, 256, 128),
}


def poisoned_scales(groups, rows):
    return row_scales_buffer(groups, rows, device=DEVICE).fill_(float("nan"))


class Problem:
    """A random FP8 expert batch: bf16 sources, their quantized forms and offsets."""

    def __init__(self, counts, hidden, intermediate, *, capacity=None, seed=0):
        generator = torch.Generator(device=DEVICE).manual_seed(seed)
        experts = len(counts)
        self.valid = sum(counts)
        capacity = self.valid if capacity is None else capacity
        self.rows_MH = random_rows(generator, capacity, hidden, valid=self.valid)
        self.offsets = expert_offsets(counts, DEVICE)
        w13 = random_weights(generator, experts, 2 * intermediate, hidden, dtype=torch.float32)
        w2 = random_weights(generator, experts, hidden, intermediate, dtype=torch.float32)
        self.w13, self.w13_scales = quantize_weight_blocks(w13)
        self.w2, self.w2_scales = quantize_weight_blocks(w2)
        self.w13_interleaved = interleave_gate_up(self.w13)
        self.rows, self.rows_scales = quantize_rows(self.rows_MH, 128)
        self.hidden_MI = torch.randn(
            capacity, intermediate, device=DEVICE, generator=generator
        ).bfloat16()
        # the down GEMM's rows in both of the gate-up's scale groups
        self.hidden_by_group = {group: quantize_rows(self.hidden_MI, group) for group in (64, 128)}
        self.hidden, self.hidden_scales = self.hidden_by_group[64]

    @property
    def gate_up_operands(self) -> tuple[torch.Tensor, ...]:
        """gate_up_swiglu_fp8's positional operands for this batch."""
        return (self.rows, self.rows_scales, self.offsets, self.w13_interleaved, self.w13_scales)

    def down_operands(self, group: int = 64) -> tuple[torch.Tensor, ...]:
        """down_fp8's positional operands for this batch, its rows in `group`-column groups."""
        hidden, hidden_scales = self.hidden_by_group[group]
        return (hidden, hidden_scales, self.offsets, self.w2, self.w2_scales)


def check_gate_up(problem, knobs=None, swiglu=None):
    """The gate-up output and its scales, in the groups the launcher writes (returned too);
    `swiglu`: the SwiGLU variant (the plain one by default)."""
    capacity, intermediate = problem.rows.shape[0], problem.w13.shape[1] // 2
    group = gate_up_fp8_launcher(
        problem.rows, problem.offsets, problem.w13_interleaved, knobs=knobs, swiglu=swiglu
    ).out_group
    out = poisoned((capacity, intermediate), FP8_DTYPE)
    out_scales = poisoned_scales(intermediate // group, capacity)
    gate_up_swiglu_fp8(
        *problem.gate_up_operands, out_MI=out, out_scales=out_scales, knobs=knobs, swiglu=swiglu
    )
    valid = problem.valid
    expected = gate_up_swiglu_reference(
        dequantize_rows(problem.rows, problem.rows_scales, 128),
        problem.offsets,
        dequantize_weight_blocks(problem.w13, problem.w13_scales),
        **({} if swiglu is None else swiglu.constants()),
    )
    actual = dequantize_rows(out[:valid], out_scales[:, :valid], group)
    error = relative_l2_error(actual, expected[:valid])
    assert error <= GATE_UP_TOLERANCE, f"gate_up_fp8 rel-L2 {error} with {knobs}"
    oracle_amax = expected[:valid].view(valid, intermediate // group, group).abs().amax(dim=2)
    torch.testing.assert_close(out_scales[:, :valid], oracle_amax.t() / 448, rtol=2e-2, atol=1e-9)
    assert torch.isnan(out[valid:].float()).all(), "gate_up_fp8 wrote rows past the valid count"
    assert torch.isnan(out_scales[:, valid:]).all(), "gate_up_fp8 wrote scales past the valid count"
    return out, out_scales, group


def check_down(problem, knobs=None, row_scale_M=None, group=64):
    capacity, hidden = problem.hidden.shape[0], problem.w2.shape[1]
    out = poisoned((capacity, hidden), torch.bfloat16)
    operands = problem.down_operands(group)
    down_fp8(*operands, row_scale_M=row_scale_M, out_MH=out, knobs=knobs)
    valid = problem.valid
    expected = down_reference(
        dequantize_rows(operands[0], operands[1], group),
        problem.offsets,
        dequantize_weight_blocks(problem.w2, problem.w2_scales),
        row_scale_M,
    )
    assert_valid_rows_match(
        out,
        expected,
        valid,
        what=f"down_fp8 with {knobs} on {group}-column groups",
        tolerance=DOWN_TOLERANCE,
    )
    return out


@pytest.mark.parametrize("geometry", sorted(GEOMETRY_DIMS))
# the default profile's tiles at each: decode tiles of 16 rows (1, 3) and 32 (12), with the
# deep ring on a short K; 64x256 (24), 128x256 (40, 300)
@pytest.mark.parametrize("rows_per_expert", [1, 3, 12, 24, 40, 300])
def test_geometry_matches_oracle(geometry, rows_per_expert):
    experts, hidden, intermediate = GEOMETRY_DIMS[geometry]
    counts = random_counts(experts, rows_per_expert * experts, seed=rows_per_expert)
    problem = Problem(counts, hidden, intermediate, capacity=sum(counts) + 5)
    check_gate_up(problem)
    for group in (64, 128):
        check_down(problem, group=group)


@pytest.mark.parametrize(
    "swiglu",
    [
        SwiGLU(limit=7.0, alpha=1.702, up_offset=1.0),  # gpt-oss's clamp
        SwiGLU(limit=1.0),  # a clamp the values pass (DeepSeek-V4's kind)
        SwiGLU(gate_softcap=2.0, up_softcap=1.0),  # Inkling2's kind, tight
        GEGLU,  # Gemma 4's
    ],
    ids=str,
)
# decode tiles (3 rows per expert), 64x256 (24) and 128x256 (300) prefill tiles
@pytest.mark.parametrize("rows_per_expert", [3, 24, 300])
def test_each_swiglu_variant_matches_oracle(swiglu, rows_per_expert):
    experts, hidden, intermediate = GEOMETRY_DIMS["partial-k"]
    counts = random_counts(experts, rows_per_expert * experts, seed=rows_per_expert)
    check_gate_up(Problem(counts, hidden, intermediate, capacity=sum(counts) + 5), swiglu=swiglu)


def test_one_row_on_one_of_many_experts_matches_oracle():
    # one dsv3-ep8-local token: one row on one of 32 experts. On an H200 the gate-up splits
    # its K of 56 K tiles in 4 slices (96 KiB rings), and the down GEMM runs 112 tiles of 64
    # columns on a K of 16 K tiles (64 KiB rings)
    counts = [0] * 32
    counts[5] = 1
    problem = Problem(counts, 7168, 2048, capacity=1)
    check_gate_up(problem)
    check_down(problem)


def test_one_token_of_many_experts_matches_oracle_with_the_down_weights_prefetched(
    down_l2_prefetch,
):
    # one qwen3-30b-a3b token: 8 rows on 8 of 128 experts. The gate-up's 96 tiles leave SMs
    # idle, so the down GEMM's CTAs there prefetch the other CTAs' weights into L2 before the
    # wait (Launch.l2_prefetch_ctas), reading the schedule ahead of their own tile
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    (launch,) = default_launches("down_fp8", 8, 128, weight_dims=(2048, 768), sms=sms)
    assert launch.l2_prefetch_ctas > 0, launch
    counts = [0] * 128
    for expert in torch.randperm(128, generator=torch.Generator().manual_seed(3))[:8].tolist():
        counts[expert] = 1
    problem = Problem(counts, 2048, 768, capacity=8)
    check_gate_up(problem)
    check_down(problem)


@pytest.mark.parametrize(
    "counts",
    [
        [0, 0, 0, 0],  # zero tokens
        [0, 517, 0, 0],  # one expert takes everything
        [3, 0, 0, 130, 0, 1, 0, 64],  # empty experts between full ones
        [129, 1, 127, 255],  # tails of every tile size
    ],
)
def test_edge_cases(counts):
    problem = Problem(counts, 256, 256, capacity=sum(counts) + 3)
    check_gate_up(problem)
    row_scale = torch.rand(problem.hidden.shape[0], device=DEVICE)
    for group in (64, 128):
        check_down(problem, row_scale_M=row_scale, group=group)


@pytest.mark.parametrize(
    "op, knobs",
    [
        (op, knobs)
        for op in ("gate_up_fp8", "down_fp8")
        for knobs in candidate_knobs(op, stage_choices=("max",))
    ],
    ids=str,
)
def test_every_fp8_candidate_matches_oracle(op, knobs):
    counts = random_counts(8, 8 * 48, seed=3)
    # K = 1024 for both GEMMs: every split-K candidate has a K tile per slice
    problem = Problem(counts, 1024, 1024, capacity=sum(counts))
    if op == "gate_up_fp8":
        check_gate_up(problem, knobs)
    else:
        # tuned down knobs may follow a gate-up of either group
        for group in (64, 128):
            check_down(problem, knobs, group=group)


@pytest.mark.parametrize("tile_rows", [64, 128])
@pytest.mark.parametrize("geometry", ["partial-k", "qwen3-30b-a3b"])
def test_tiles_of_two_weight_blocks_are_bitwise_equal_to_tiles_of_one(geometry, tile_rows):
    # a 256-column tile runs the 128-column tile's MMAs and promotions a weight block at a time:
    # the same sums in the same order; partial-k's down GEMM ends in a half tile (N = 2112)
    experts, hidden, intermediate = GEOMETRY_DIMS[geometry]
    counts = random_counts(experts, 150 * experts, seed=6)
    counts[1], counts[-1] = 0, 1
    problem = Problem(counts, hidden, intermediate, capacity=sum(counts) + 7)
    narrow = GemmKnobs(tile_rows=tile_rows, tile_cols=128, stages=3)
    wide = GemmKnobs(tile_rows=tile_rows, tile_cols=256, stages=3)
    out, out_scales, group = check_gate_up(problem, wide)
    narrow_out, narrow_scales, narrow_group = check_gate_up(problem, narrow)
    assert (group, narrow_group) == (128, 64)
    # the same SwiGLU values, quantized per 128 and per 64 columns: a 128-column group's scale
    # is the larger of its two halves' (amax / 448 is monotonic), and the half that holds the
    # amax quantizes to the same bytes
    valid = problem.valid
    halves = narrow_scales[:, :valid].view(-1, 2, valid)
    assert torch.equal(out_scales[:, :valid], halves.amax(dim=1))
    same_scale = (halves == out_scales[:, None, :valid]).permute(2, 0, 1).reshape(valid, -1)
    same_scale = same_scale.repeat_interleave(64, dim=1)
    wide_bytes, narrow_bytes = (o[:valid].view(torch.uint8) for o in (out, narrow_out))
    assert torch.equal(wide_bytes[same_scale], narrow_bytes[same_scale])
    for down_group in (64, 128):
        outs = [check_down(problem, knobs, group=down_group) for knobs in (wide, narrow)]
        assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


def test_repeated_runs_are_bitwise_equal():
    counts = random_counts(16, 16 * 200, seed=4)
    problem = Problem(counts, 2048, 768)
    weights = problem.down_operands()[2:]
    first, first_scales = gate_up_swiglu_fp8(*problem.gate_up_operands)
    first_out = down_fp8(first, first_scales, *weights)
    for _ in range(3):
        again, again_scales = gate_up_swiglu_fp8(*problem.gate_up_operands)
        assert torch.equal(again.view(torch.uint8), first.view(torch.uint8))
        assert torch.equal(again_scales, first_scales)
        assert torch.equal(down_fp8(again, again_scales, *weights), first_out)


def test_the_fp8_mlp_in_a_cuda_graph_follows_changing_counts_and_meets_the_accuracy_target():
    experts, hidden, intermediate = 16, 2048, 768
    capacity = 16 * 64
    problem = Problem(random_counts(experts, capacity, seed=5), hidden, intermediate)
    gate_up = gate_up_fp8_launcher(
        problem.rows, problem.offsets, problem.w13_interleaved, valid_rows=capacity
    )
    down = down_fp8_launcher(
        problem.hidden,
        problem.offsets,
        problem.w2,
        valid_rows=capacity,
        x_group=gate_up.out_group,  # 128: the 64 rows per expert run 256-column tiles
    )
    out = torch.empty(capacity, hidden, dtype=torch.bfloat16, device=DEVICE)

    def mlp():
        hidden_q, hidden_scales = gate_up(
            problem.rows,
            problem.offsets,
            problem.w13_interleaved,
            x_scales=problem.rows_scales,
            w_scales=problem.w13_scales,
        )
        down(
            hidden_q,
            problem.offsets,
            problem.w2,
            x_scales=hidden_scales,
            w_scales=problem.w2_scales,
            out=out,
        )

    mlp()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mlp()
    w13 = dequantize_weight_blocks(problem.w13, problem.w13_scales)
    w2 = dequantize_weight_blocks(problem.w2, problem.w2_scales)
    for seed in (6, 7):
        problem.offsets.copy_(expert_offsets(random_counts(experts, capacity, seed=seed)))
        graph.replay()
        torch.cuda.synchronize()
        # against the fp32 oracle on the bf16 rows and the dequantized weights
        expected = expert_mlp_reference(problem.rows_MH, problem.offsets, w13, w2)
        assert fp8_difference(out, expected) <= 1e-3
        assert relative_l2_error(out, expected) <= 6e-2


def test_bf16_ops_refuse_scales_and_fp8_ops_refuse_bf16_rows():
    # hidden 512: the rows' scales [4, M] are not the intermediate's [2, M]
    problem = Problem([4, 4], 512, 128)
    with pytest.raises(TypeError, match="rows must be torch.float8_e4m3fn"):
        gate_up_swiglu_fp8(
            problem.rows_MH,
            problem.rows_scales,
            problem.offsets,
            problem.w13_interleaved,
            problem.w13_scales,
        )
    with pytest.raises(
        ValueError, match=r"x_scales must be float32 \[2, 8\] \(a scale per row and 64"
    ):
        down_fp8(
            problem.hidden, problem.rows_scales, problem.offsets, problem.w2, problem.w2_scales
        )
    with pytest.raises(ValueError, match="x_group must be 64 or 128"):
        down_fp8_launcher(problem.hidden, problem.offsets, problem.w2, x_group=32)
    with pytest.raises(ValueError, match="w_scales must be float32"):
        down_fp8(
            problem.hidden, problem.hidden_scales, problem.offsets, problem.w2, problem.w13_scales
        )
    knobs = GemmKnobs(tile_rows=128, tile_cols=128, pingpong=True)
    with pytest.raises(ValueError, match="products of a scale group per thread"):
        down_fp8(*problem.down_operands(), knobs=knobs)
