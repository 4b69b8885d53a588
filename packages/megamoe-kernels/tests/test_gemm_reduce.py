"""The down GEMM adding its rows into their tokens' rows (row_source_M: the atomic combine) on an
sm_90 GPU, bf16 and FP8, against the fp32 oracle: out[t] = out0[t] + sum over the batch rows r
of token t of row_scale[r] x (x_r W2^T). The rows' tokens are a random top-k routing of T tokens
(each token's rows in different experts); out0 is random, so the rows must be added into what
the output holds, not stored over it. Rows past the valid count are NaN and name a token past
T: they must never be read or added anywhere."""

from __future__ import annotations

import pytest
import torch
from gemm_cases import DEVICE, EDGE_CASES, expert_offsets, has_sm90, random_counts
from megamoe_kernels import (
    GemmKnobs,
    dequantize_rows,
    dequantize_weight_blocks,
    down,
    down_fp8,
    quantize_rows,
    quantize_weight_blocks,
)
from megamoe_kernels.reference import down_reference, relative_l2_error

pytestmark = pytest.mark.gpu

if not has_sm90():
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

# each token's rows add top-k bf16 roundings: looser than a stored row's 1e-2
TOLERANCE = 2e-2


def routed_problem(counts: list[int], hidden: int, intermediate: int, *, capacity: int, seed: int):
    """A tight batch of `counts` rows whose rows belong to tokens routed to distinct experts:
    (hidden_MI [capacity, I] bf16, offsets, w2 [E, H, I] fp32, row_tokens [capacity] int32,
    row_scale [capacity] fp32, tokens T)."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    experts, valid = len(counts), sum(counts)
    # token of each valid row: expert e's rows are tokens in increasing order, no token twice
    # in one expert (as a top-k routing places them); a token has at most `experts` rows
    tokens = max([*counts, 1])
    row_tokens = torch.full((capacity,), 1 << 20, dtype=torch.int32)  # past T: never used
    start = 0
    for count in counts:
        chosen = torch.randperm(tokens, generator=torch.Generator().manual_seed(seed + start))
        row_tokens[start : start + count] = chosen[:count].sort().values.to(torch.int32)
        start += count
    hidden_MI = torch.randn(capacity, intermediate, device=DEVICE, generator=generator).bfloat16()
    hidden_MI[valid:] = float("nan")
    w2 = torch.randn(experts, hidden, intermediate, device=DEVICE, generator=generator)
    w2 /= intermediate**0.5
    row_scale = torch.rand(capacity, device=DEVICE, generator=generator)
    return hidden_MI, expert_offsets(counts, DEVICE), w2, row_tokens.to(DEVICE), row_scale, tokens


def expected_sum(out0_TH, rows_MH, row_tokens, valid):
    """out0 + each valid row added into its token's row, in fp32."""
    expected = out0_TH.float().clone()
    expected.index_add_(0, row_tokens[:valid].long(), rows_MH[:valid].float())
    return expected


def check_reduced(counts, hidden, intermediate, *, capacity=None, fp8=False, knobs=None, seed=0):
    valid = sum(counts)
    capacity = valid if capacity is None else capacity
    hidden_MI, offsets, w2, row_tokens, row_scale, tokens = routed_problem(
        counts, hidden, intermediate, capacity=capacity, seed=seed
    )
    out0 = torch.randn(tokens, hidden, device=DEVICE).bfloat16()
    out = out0.clone()
    if fp8:
        rows_q, rows_scales = quantize_rows(hidden_MI, 64)
        w2_q, w2_scales = quantize_weight_blocks(w2)
        down_fp8(
            rows_q,
            rows_scales,
            offsets,
            w2_q,
            w2_scales,
            row_scale_M=row_scale,
            out_MH=out,
            row_source_M=row_tokens,
            knobs=knobs,
        )
        rows = down_reference(
            dequantize_rows(rows_q, rows_scales, 64),
            offsets,
            dequantize_weight_blocks(w2_q, w2_scales),
            row_scale,
        )
    else:
        w2_b = w2.bfloat16()
        down(
            hidden_MI,
            offsets,
            w2_b,
            row_scale_M=row_scale,
            out_MH=out,
            row_source_M=row_tokens,
            knobs=knobs,
        )
        rows = down_reference(hidden_MI, offsets, w2_b, row_scale)
    expected = expected_sum(out0, rows, row_tokens, valid)
    error = relative_l2_error(out.float(), expected)
    assert error <= TOLERANCE, f"{counts}, {knobs}: rel-L2 {error}"
    untouched = torch.ones(tokens, dtype=torch.bool, device=DEVICE)
    untouched[row_tokens[:valid].long()] = False
    assert torch.equal(out[untouched], out0[untouched]), "a token with no row changed"
    return out


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("rows_per_expert", [1, 3, 40, 300])
def test_rows_are_added_into_their_tokens_rows(fp8, rows_per_expert):
    # H of 2880: a column tile past N; I of 768: whole K tiles of both dtypes
    counts = random_counts(8, 8 * rows_per_expert, seed=rows_per_expert)
    check_reduced(counts, 2880, 768, fp8=fp8, seed=rows_per_expert)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("counts, capacity", list(EDGE_CASES.values()), ids=list(EDGE_CASES))
def test_edge_cases(fp8, counts, capacity):
    check_reduced(counts, 512, 256, capacity=capacity, fp8=fp8)


@pytest.mark.parametrize(
    "knobs",
    [
        GemmKnobs(tile_rows=128, tile_cols=256, stages=3),
        GemmKnobs(tile_rows=64, tile_cols=256, stages=3, pingpong=True),
        GemmKnobs(tile_rows=16, tile_cols=64, stages=8, swap_ab=True, split_k=2),
    ],
    ids=str,
)
def test_tile_families(knobs):
    check_reduced(random_counts(8, 600, seed=3), 1024, 512, knobs=knobs)


def test_a_graph_replays_the_adds_with_new_rows():
    counts = random_counts(8, 400, seed=4)
    hidden_MI, offsets, w2, row_tokens, row_scale, tokens = routed_problem(
        counts, 1024, 512, capacity=400, seed=4
    )
    w2 = w2.bfloat16()
    out = torch.zeros(tokens, 1024, device=DEVICE, dtype=torch.bfloat16)

    def adds():
        out.zero_()
        down(hidden_MI, offsets, w2, row_scale_M=row_scale, out_MH=out, row_source_M=row_tokens)

    adds()  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        adds()
    hidden_MI.normal_()
    graph.replay()
    rows = down_reference(hidden_MI, offsets, w2, row_scale)
    expected = expected_sum(torch.zeros_like(out), rows, row_tokens, sum(counts))
    assert relative_l2_error(out.float(), expected) <= TOLERANCE


def test_rows_naming_a_token_outside_the_output_add_nothing():
    counts = random_counts(8, 300, seed=6)
    hidden_MI, offsets, w2, row_tokens, row_scale, tokens = routed_problem(
        counts, 512, 256, capacity=300, seed=6
    )
    w2 = w2.bfloat16()
    row_tokens[::7] = -1
    row_tokens[3::7] = tokens + 5
    out = torch.zeros(tokens, 512, device=DEVICE, dtype=torch.bfloat16)
    down(hidden_MI, offsets, w2, row_scale_M=row_scale, out_MH=out, row_source_M=row_tokens)
    kept = (row_tokens >= 0) & (row_tokens < tokens)
    rows = down_reference(hidden_MI, offsets, w2, row_scale)
    expected = torch.zeros(tokens, 512, device=DEVICE)
    expected.index_add_(0, row_tokens[kept].long(), rows[kept])
    assert relative_l2_error(out.float(), expected) <= TOLERANCE


def test_the_output_is_required_and_checked():
    counts = [3, 5]
    hidden_MI, offsets, w2, row_tokens, row_scale, tokens = routed_problem(
        counts, 256, 128, capacity=8, seed=5
    )
    w2 = w2.bfloat16()
    with pytest.raises(ValueError, match="out is required"):
        down(hidden_MI, offsets, w2, row_scale_M=row_scale, row_source_M=row_tokens)
    wrong = torch.zeros(tokens, 128, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out_MH must be torch.bfloat16 \[5, 256\]"):
        down(hidden_MI, offsets, w2, out_MH=wrong, row_source_M=row_tokens)
    with pytest.raises(TypeError, match=r"row_source_M must be int32 \[8\]"):
        down(
            hidden_MI,
            offsets,
            w2,
            out_MH=torch.zeros(tokens, 256, device=DEVICE, dtype=torch.bfloat16),
            row_source_M=row_tokens.long(),
        )
