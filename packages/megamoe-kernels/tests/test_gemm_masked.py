"""The grouped GEMMs on a masked batch (expert_counts: each expert's rows at a fixed stride,
counted on the device) on an sm_90 GPU: the bits of the same GEMM on the tight batch of those
rows, for every tile family, BF16 and FP8, counts from none to a full stride, and graph replay
with changing counts.

Every case: fresh random rows and weights, the rows past each count NaN (never read as data),
an output poisoned with NaN (the counted rows overwritten, the rest of each stride untouched).
"""

from __future__ import annotations

import pytest
import torch
from gemm_cases import (
    DEVICE,
    GATE_UP_FAMILIES,
    expert_offsets,
    has_sm90,
    poisoned,
    random_weights,
    with_max_stages,
)
from megamoe_kernels import (
    down,
    down_fp8,
    gate_up_swiglu,
    gate_up_swiglu_fp8,
    interleave_gate_up,
    quantize_rows,
    quantize_weight_blocks,
)
from megamoe_kernels.shim.knobs import default_knobs

pytestmark = pytest.mark.gpu

if not has_sm90():
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

HIDDEN, INTERMEDIATE = 2048, 768


def masked_problem(counts, stride, *, seed=0):
    """(rows [E x stride, H] NaN past each count, starts [E + 1], counts [E], the tight rows
    and offsets of the counted rows, w13 [E, 2I, H] before the interleave, w2)."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    experts = len(counts)
    rows_ESH = torch.full((experts, stride, HIDDEN), float("nan"), device=DEVICE)
    for expert, count in enumerate(counts):
        rows_ESH[expert, :count] = torch.randn(count, HIDDEN, device=DEVICE, generator=generator)
    rows_MH = rows_ESH.bfloat16().view(experts * stride, HIDDEN)
    starts = torch.arange(experts + 1, dtype=torch.int32, device=DEVICE) * stride
    counts_E = torch.tensor(counts, dtype=torch.int32, device=DEVICE)
    tight_MH = counted(rows_MH, counts, stride)
    w13_E2IH = random_weights(generator, experts, 2 * INTERMEDIATE, HIDDEN)
    w2 = random_weights(generator, experts, HIDDEN, INTERMEDIATE)
    return rows_MH, starts, counts_E, tight_MH, expert_offsets(counts, DEVICE), w13_E2IH, w2


def counted(out_MX, counts, stride):
    return torch.cat([out_MX[e * stride : e * stride + c] for e, c in enumerate(counts)])


def uncounted_untouched(out_MX, counts, stride) -> bool:
    rest = [out_MX[e * stride + c : (e + 1) * stride] for e, c in enumerate(counts)]
    return all(part.float().isnan().all() for part in rest)


KNOBS = {
    "prefill": GATE_UP_FAMILIES["prefill"],
    "pingpong": GATE_UP_FAMILIES["pingpong"],
    "cluster": GATE_UP_FAMILIES["cluster"],
    "decode": default_knobs("gate_up", 8),
    "decode split-K": GATE_UP_FAMILIES["decode split-K"],
}
COUNTS = {
    "skewed": [200, 0, 1, 130],
    "full strides": [256, 256, 256, 256],
    "none": [0, 0, 0, 0],
}


@pytest.mark.parametrize("name", list(KNOBS))
@pytest.mark.parametrize("counts", list(COUNTS))
def test_masked_bf16_gemms_give_the_bits_of_the_tight_batch(name, counts):
    counts, stride, knobs = COUNTS[counts], 256, KNOBS[name]
    rows_MH, starts, counts_E, tight_MH, offsets, w13_E2IH, w2 = masked_problem(counts, stride)
    w13 = interleave_gate_up(w13_E2IH)
    out = poisoned((rows_MH.shape[0], INTERMEDIATE))
    hidden = gate_up_swiglu(rows_MH, starts, w13, knobs=knobs, expert_counts=counts_E, out_MI=out)
    expected = gate_up_swiglu(tight_MH, offsets, w13, knobs=knobs)
    torch.cuda.synchronize()
    assert torch.equal(counted(hidden, counts, stride), expected)
    assert uncounted_untouched(hidden, counts, stride)
    down_knobs = with_max_stages(knobs, "down")
    out_MH = down(hidden, starts, w2, knobs=down_knobs, expert_counts=counts_E)
    expected_MH = down(expected, offsets, w2, knobs=down_knobs)
    torch.cuda.synchronize()
    assert torch.equal(counted(out_MH, counts, stride), expected_MH)


def test_masked_fp8_gemms_give_the_bits_of_the_tight_batch():
    counts, stride = [100, 0, 3, 256], 256
    rows_MH, starts, counts_E, tight_MH, offsets, w13_E2IH, w2 = masked_problem(counts, stride)
    w13_q, w13_scales = quantize_weight_blocks(w13_E2IH)  # per block before the interleave
    w13_q = interleave_gate_up(w13_q)
    w2_q, w2_scales = quantize_weight_blocks(w2)
    rows_q, rows_scales = quantize_rows(torch.nan_to_num(rows_MH))
    tight_q, tight_scales = quantize_rows(tight_MH)
    hidden_q, hidden_scales = gate_up_swiglu_fp8(
        rows_q, rows_scales, starts, w13_q, w13_scales, expert_counts=counts_E
    )
    expected_q, expected_scales = gate_up_swiglu_fp8(
        tight_q, tight_scales, offsets, w13_q, w13_scales
    )
    out_MH = down_fp8(hidden_q, hidden_scales, starts, w2_q, w2_scales, expert_counts=counts_E)
    expected_MH = down_fp8(expected_q, expected_scales, offsets, w2_q, w2_scales)
    torch.cuda.synchronize()
    assert torch.equal(counted(out_MH, counts, stride), expected_MH)


def test_masked_gemms_replay_in_a_graph_with_new_counts():
    counts, stride = [64, 10, 0, 100], 128
    rows_MH, starts, counts_E, _, _, w13_E2IH, w2 = masked_problem(counts, stride)
    rows_MH, w13 = torch.nan_to_num(rows_MH), interleave_gate_up(w13_E2IH)
    knobs = default_knobs("gate_up", 16)

    def mlp():
        hidden = gate_up_swiglu(rows_MH, starts, w13, knobs=knobs, expert_counts=counts_E)
        return down(hidden, starts, w2, expert_counts=counts_E, valid_rows=rows_MH.shape[0])

    out = mlp()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mlp()
    for new_counts in ([1, 128, 7, 0], [128, 128, 128, 128]):
        counts_E.copy_(torch.tensor(new_counts, dtype=torch.int32))
        graph.replay()
        expected = mlp()
        torch.cuda.synchronize()
        assert torch.equal(counted(out, new_counts, stride), counted(expected, new_counts, stride))
