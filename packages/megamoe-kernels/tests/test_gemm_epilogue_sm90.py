"""The grouped GEMMs' bias and clamped-SwiGLU epilogues on an sm_90 GPU against the fp32 oracles.

Every case: fresh random rows, weights and biases, the weights large enough that the gate and
up values pass the SwiGLU limit (so the clamp matters), rows past the valid count NaN (they must
never reach an output), an output buffer poisoned with NaN (valid rows overwritten, the rest
untouched), rel-L2 <= 1e-2 against megamoe_kernels.reference.
"""

from __future__ import annotations

import gemm_cases
import pytest
import torch
from gemm_cases import (
    DEVICE,
    EDGE_CASES,
    TAIL_COUNTS,
    check_down,
    check_gate_up,
    has_sm90,
    random_counts,
    replay_with_counts,
)
from megamoe_kernels import (
    GEGLU,
    GemmKnobs,
    SwiGLU,
    down,
    gate_up_swiglu,
    interleave_gate_up,
    interleave_gate_up_bias,
)
from megamoe_kernels.reference import expert_mlp_reference
from megamoe_kernels.shim.knobs import default_knobs

pytestmark = pytest.mark.gpu

if not has_sm90():
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

GPT_OSS_SWIGLU = SwiGLU(limit=7.0, alpha=1.702, up_offset=1.0)
# (E, H, I): gpt-oss's H = I = 2880 (not multiples of 128: partial column tiles), and tiny
# dims (a partial K tile, I = 72: one partial output tile)
DIMS = {"gpt-oss": (8, 2880, 2880), "tiny": (5, 136, 72)}
# the plain cooperative tiles and the swap-AB decode tiles
COOPERATIVE_AND_SWAP_AB = [
    GemmKnobs(tile_rows=128, tile_cols=128, stages=4),
    GemmKnobs(tile_rows=32, tile_cols=128, stages=4, swap_ab=True),
]


def make_problem(counts, hidden, intermediate, *, capacity=None, seed=0):
    """gemm_cases.make_problem with gate and up values of a few units (many past the limit of 7)
    and biases w13 [E, 2I], w2 [E, H] (bf16, as a layer holds them) drawn after it: rows,
    offsets, w13, w2, w13 bias, w2 bias, valid rows."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    rows_MH, offsets, w13_E2IH, w2_EHI, valid = gemm_cases.make_problem(
        counts, hidden, intermediate, capacity=capacity, gate_up_gain=4.0, generator=generator
    )
    experts = len(counts)
    w13_bias_E2I = (
        torch.randn(experts, 2 * intermediate, device=DEVICE, generator=generator) * 2.0
    ).bfloat16()
    w2_bias_EH = torch.randn(experts, hidden, device=DEVICE, generator=generator).bfloat16()
    return rows_MH, offsets, w13_E2IH, w2_EHI, w13_bias_E2I, w2_bias_EH, valid


@pytest.mark.parametrize("dims", sorted(DIMS))
@pytest.mark.parametrize("rows_per_expert", [1, 3, 40, 300])
def test_the_default_profiles_match_the_oracle(dims, rows_per_expert):
    experts, hidden, intermediate = DIMS[dims]
    counts = random_counts(experts, experts * rows_per_expert, seed=rows_per_expert)
    rows_MH, offsets, w13, w2, b13, b2, valid = make_problem(
        counts, hidden, intermediate, capacity=experts * rows_per_expert + 5
    )
    hidden_MI = check_gate_up(rows_MH, offsets, w13, valid, w13_bias_E2I=b13, swiglu=GPT_OSS_SWIGLU)
    hidden_MI[valid:] = float("nan")
    scale_M = torch.rand(rows_MH.shape[0], device=DEVICE)
    check_down(hidden_MI, offsets, w2, valid, w2_bias_EH=b2, row_scale_M=scale_M)
    check_down(hidden_MI, offsets, w2, valid, w2_bias_EH=b2)


KNOBS = [
    GemmKnobs(tile_rows=128, tile_cols=128, stages=4),
    GemmKnobs(tile_rows=64, tile_cols=256, stages=3, rows_fastest=False),
    GemmKnobs(tile_rows=128, tile_cols=192, stages=3),
    GemmKnobs(tile_rows=64, tile_cols=256, stages=3, pingpong=True),
    GemmKnobs(tile_rows=128, tile_cols=128, stages=3, cluster=(2, 1)),
    GemmKnobs(tile_rows=32, tile_cols=128, stages=4, swap_ab=True),
    GemmKnobs(tile_rows=16, tile_cols=64, stages=4, swap_ab=True, rows_fastest=False),
    GemmKnobs(tile_rows=16, tile_cols=128, stages=4, swap_ab=True, split_k=2),
    GemmKnobs(tile_rows=128, tile_cols=128, stages=3, tail_rows=16),
    GemmKnobs(tile_rows=64, tile_cols=192, stages=3, tail_rows=16, rows_fastest=False),
]


@pytest.mark.parametrize("knobs", KNOBS, ids=str)
@pytest.mark.parametrize("dims", sorted(DIMS))
def test_every_tile_family_with_tails(knobs, dims):
    experts, hidden, intermediate = DIMS[dims]
    counts = (TAIL_COUNTS * 2)[: max(experts, 8)]
    rows_MH, offsets, w13, w2, b13, b2, valid = make_problem(
        counts, hidden, intermediate, capacity=sum(counts) + 9
    )
    hidden_MI = check_gate_up(
        rows_MH, offsets, w13, valid, w13_bias_E2I=b13, swiglu=GPT_OSS_SWIGLU, knobs=knobs
    )
    hidden_MI[valid:] = float("nan")
    scale_M = torch.rand(rows_MH.shape[0], device=DEVICE)
    check_down(hidden_MI, offsets, w2, valid, w2_bias_EH=b2, row_scale_M=scale_M, knobs=knobs)


@pytest.mark.parametrize(
    "swiglu, biased",
    [
        (SwiGLU(), True),  # biases, plain SwiGLU
        (GPT_OSS_SWIGLU, False),  # the clamped SwiGLU, no bias
        (SwiGLU(limit=3.0), True),  # the clamp alone
        (SwiGLU(alpha=0.5, up_offset=-2.0), True),  # alpha and offset, no clamp
        (SwiGLU(gate_softcap=4.0, up_softcap=2.0), False),  # Inkling2's softcaps, tighter
        (SwiGLU(limit=7.0, up_softcap=3.0), True),  # a clamp and a softcap
        (GEGLU, True),  # the tanh GELU of the gate (Gemma 4)
    ],
    ids=str,
)
@pytest.mark.parametrize("knobs", COOPERATIVE_AND_SWAP_AB, ids=str)
def test_each_epilogue_option_alone(swiglu, biased, knobs):
    _, hidden, intermediate = DIMS["tiny"]
    rows_MH, offsets, w13, _, b13, _, valid = make_problem(
        TAIL_COUNTS, hidden, intermediate, capacity=sum(TAIL_COUNTS) + 3
    )
    bias = b13 if biased else None
    check_gate_up(rows_MH, offsets, w13, valid, w13_bias_E2I=bias, swiglu=swiglu, knobs=knobs)


@pytest.mark.parametrize(
    "counts, capacity",
    [
        EDGE_CASES[name]
        for name in (
            "no valid rows",
            "one expert takes all",
            "most experts empty, capacity past valid",
            "one expert, capacity 13x valid",
            "capacity of one row",
        )
    ],
)
@pytest.mark.parametrize("knobs", COOPERATIVE_AND_SWAP_AB, ids=str)
def test_edge_cases(counts, capacity, knobs):
    rows_MH, offsets, w13, w2, b13, b2, valid = make_problem(counts, 256, 192, capacity=capacity)
    hidden_MI = check_gate_up(
        rows_MH, offsets, w13, valid, w13_bias_E2I=b13, swiglu=GPT_OSS_SWIGLU, knobs=knobs
    )
    hidden_MI[valid:] = float("nan")
    check_down(hidden_MI, offsets, w2, valid, w2_bias_EH=b2, knobs=knobs)


def test_each_expert_gets_its_own_bias():
    # zero weights: the outputs are the biases' SwiGLU and the down biases alone, per expert
    counts = [3, 0, 5, 2]
    rows_MH, offsets, w13, w2, b13, b2, valid = make_problem(counts, 128, 64)
    w13.zero_()
    w2.zero_()
    hidden_MI = check_gate_up(rows_MH, offsets, w13, valid, w13_bias_E2I=b13, swiglu=GPT_OSS_SWIGLU)
    out_MH = check_down(hidden_MI, offsets, w2, valid, w2_bias_EH=b2)
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    assert torch.equal(out_MH, b2[expert_of_row.to(DEVICE)])


def test_gathered_rows_with_biases_equal_the_copied_rows():
    _, hidden, intermediate = DIMS["gpt-oss"]
    counts = random_counts(8, 8 * 20, seed=3)
    tokens = 61
    rows_MH, offsets, w13, _, b13, _, valid = make_problem(counts, hidden, intermediate)
    generator = torch.Generator(device=DEVICE).manual_seed(4)
    x_TH = torch.randn(tokens, hidden, device=DEVICE, generator=generator).bfloat16()
    source_M = torch.randint(0, tokens, (valid,), device=DEVICE, generator=generator)
    source_M = source_M.to(torch.int32)
    rows_MH = x_TH[source_M.long()]
    w13_EB2GH, b13_EB2G = interleave_gate_up(w13), interleave_gate_up_bias(b13)
    for knobs in (
        default_knobs("gate_up", 20),
        GemmKnobs(tile_rows=32, tile_cols=128, stages=4, swap_ab=True),
    ):
        arguments = {"knobs": knobs, "w13_bias_EB2G": b13_EB2G, "swiglu": GPT_OSS_SWIGLU}
        expected = gate_up_swiglu(rows_MH, offsets, w13_EB2GH, **arguments)
        gathered = gate_up_swiglu(x_TH, offsets, w13_EB2GH, row_source_M=source_M, **arguments)
        assert torch.equal(gathered, expected)


def test_the_biased_pair_replays_in_a_cuda_graph_with_new_routing():
    _, hidden, intermediate = DIMS["gpt-oss"]
    rows_MH, offsets, w13, w2, b13, b2, _ = make_problem([2] * 8, hidden, intermediate)
    w13_EB2GH, b13_EB2G, b2_float = (
        interleave_gate_up(w13),
        interleave_gate_up_bias(b13),
        b2.float(),
    )

    def layer():
        hidden_MI = gate_up_swiglu(
            rows_MH, offsets, w13_EB2GH, w13_bias_EB2G=b13_EB2G, swiglu=GPT_OSS_SWIGLU
        )
        return down(hidden_MI, offsets, w2, w2_bias_EH=b2_float)

    def oracle():
        return expert_mlp_reference(
            rows_MH,
            offsets,
            w13,
            w2,
            round_intermediate_to=torch.bfloat16,
            w13_bias_E2I=b13,
            w2_bias_EH=b2,
            limit=7.0,
            alpha=1.702,
            up_offset=1.0,
        )

    layer()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_MH = layer()
    for counts in ([2] * 8, [0, 0, 16, 0, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0, 0, 11], [0] * 8):
        replay_with_counts(graph, out_MH, offsets, counts, oracle)


def test_the_plain_kernel_is_unchanged_by_a_biased_one_beside_it():
    # the plain and the biased variants are separate kernels: compiling and running the biased
    # one leaves the plain one's bits as they were
    rows_MH, offsets, w13, _, b13, _, _ = make_problem([40, 7, 0, 90], 256, 192)
    w13_EB2GH = interleave_gate_up(w13)
    plain = gate_up_swiglu(rows_MH, offsets, w13_EB2GH)
    gate_up_swiglu(rows_MH, offsets, w13_EB2GH, w13_bias_EB2G=interleave_gate_up_bias(b13))
    assert torch.equal(gate_up_swiglu(rows_MH, offsets, w13_EB2GH), plain)
