"""The gate-up GEMM reading its batch rows from the tokens (row_source_M) on an sm_90 GPU: the
same bits as the GEMM on the rows copied out, for every tile family, tails, empty experts, one
expert taking every row, a capacity past the valid rows, and graph replay with new routing
(decode and prefill tiles).

Every case: fresh random tokens and weights, a random token for each row (tokens repeat, as
top-k routing repeats them), sources past the valid rows out of range (never read), and an
output buffer poisoned with NaN (valid rows overwritten, the rest untouched).
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
from megamoe_kernels import GemmKnobs, gate_up_swiglu, interleave_gate_up
from megamoe_kernels.shim.knobs import default_knobs

pytestmark = pytest.mark.gpu

if not has_sm90():
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)


def make_problem(counts, hidden, intermediate, *, tokens, capacity=None, seed=0):
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    experts, valid = len(counts), sum(counts)
    capacity = valid if capacity is None else capacity
    x_TH = torch.randn(tokens, hidden, device=DEVICE, generator=generator).bfloat16()
    source_M = torch.randint(0, tokens, (capacity,), device=DEVICE, generator=generator)
    source_M[valid:] = 1 << 30  # never read: out of range on purpose
    source_M = source_M.to(torch.int32)
    w13_E2IH = random_weights(generator, experts, 2 * intermediate, hidden)
    return x_TH, source_M, expert_offsets(counts, DEVICE), interleave_gate_up(w13_E2IH), valid


def check_gathered_equals_copied(counts, hidden, intermediate, *, tokens, knobs, capacity=None):
    x_TH, source_M, offsets, w13, valid = make_problem(
        counts, hidden, intermediate, tokens=tokens, capacity=capacity
    )
    rows_MH = poisoned((source_M.shape[0], hidden))
    rows_MH[:valid] = x_TH[source_M[:valid].long()]
    expected = gate_up_swiglu(rows_MH, offsets, w13, knobs=knobs)
    out = torch.full_like(expected, float("nan"))
    gathered = gate_up_swiglu(x_TH, offsets, w13, knobs=knobs, row_source_M=source_M, out_MI=out)
    torch.cuda.synchronize()
    assert gathered is out
    assert torch.equal(gathered[:valid], expected[:valid])
    assert gathered[valid:].isnan().all()


KNOBS = {
    "prefill": GATE_UP_FAMILIES["prefill"],
    "prefill 64 rows": with_max_stages(GemmKnobs(tile_rows=64, tile_cols=256)),
    "pingpong": GATE_UP_FAMILIES["pingpong"],
    "cluster": GATE_UP_FAMILIES["cluster"],
    "decode 16": default_knobs("gate_up", 2),
    "decode 64": default_knobs("gate_up", 32),
    "decode split-K": GATE_UP_FAMILIES["decode split-K"],
}


@pytest.mark.parametrize("name", list(KNOBS))
@pytest.mark.parametrize(
    "counts",
    [[300, 0, 129, 1, 77], [0, 0, 500, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]],
    ids=["tails", "one expert takes all", "one row each", "no rows"],
)
def test_gathered_rows_give_the_bits_of_copied_rows(name, counts):
    check_gathered_equals_copied(counts, 2048, 768, tokens=97, knobs=KNOBS[name], capacity=600)


@pytest.mark.parametrize("hidden, intermediate", [(7168, 2048), (2880, 2880), (256, 128)])
def test_gathered_rows_at_other_shapes(hidden, intermediate):
    for knobs in (default_knobs("gate_up", 512), default_knobs("gate_up", 4)):
        check_gathered_equals_copied([200, 3, 0, 64], hidden, intermediate, tokens=70, knobs=knobs)


@pytest.mark.parametrize("rows", [39, 600], ids=["decode tiles", "prefill tiles"])
def test_gathered_rows_replay_in_a_graph_with_new_routing(rows):
    counts = [rows // 2, rows // 4, 0, rows - rows // 2 - rows // 4]
    x_TH, source_M, offsets, w13, _ = make_problem(counts, 2048, 768, tokens=40)
    knobs = default_knobs("gate_up", rows)
    arguments = {"knobs": knobs, "row_source_M": source_M}
    out = gate_up_swiglu(x_TH, offsets, w13, **arguments)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gate_up_swiglu(x_TH, offsets, w13, **arguments)
    for seed in (1, 2):
        generator = torch.Generator(device=DEVICE).manual_seed(seed)
        x_TH.copy_(torch.randn(x_TH.shape, device=DEVICE, generator=generator).bfloat16())
        source_M.copy_(torch.randint(0, 40, source_M.shape, device=DEVICE, generator=generator))
        cut = [0, rows * seed // 10, rows // 2, rows // 2 + rows // 5, rows]
        offsets.copy_(torch.tensor(cut, dtype=torch.int32))
        graph.replay()
        expected = gate_up_swiglu(x_TH[source_M.long()], offsets, w13, knobs=knobs)
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


def test_gathered_rows_are_refused_where_not_built():
    x_TH, source_M, offsets, w13, _ = make_problem([4, 4], 2048, 768, tokens=8)
    with pytest.raises(TypeError, match="row_source_M"):
        gate_up_swiglu(x_TH, offsets, w13, row_source_M=source_M.long())
    with pytest.raises(ValueError, match="multiple of 64"):
        bad = make_problem([4, 4], 2056, 768, tokens=8)
        gate_up_swiglu(bad[0], bad[2], bad[3], row_source_M=bad[1])
