"""The CuTe DSL grouped GEMMs on an sm_90 GPU against the fp32 oracles.

Every case: fresh random rows and weights (rows past the valid count are NaN: they must never
reach an output), an output buffer poisoned with NaN (valid rows must be overwritten, the rest
must stay untouched), rel-L2 <= 1e-2 against the fp32 oracle.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gemm_cases import (
    DEVICE,
    EDGE_CASES,
    TAIL_COUNTS,
    assert_valid_rows_match,
    check_down,
    check_gate_up,
    has_sm90,
    make_problem,
    poisoned,
    random_counts,
    replay_with_counts,
    with_max_stages,
)
from megamoe_kernels import (
    GemmKnobs,
    candidate_knobs,
    down,
    down_launcher,
    gate_up_launcher,
    gate_up_swiglu,
    interleave_gate_up,
)
from megamoe_kernels.reference import expert_mlp_reference
from megamoe_kernels.shim.knobs import CLUSTERS, default_knobs

pytestmark = pytest.mark.gpu

if not has_sm90():
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

# (E, H, I) per geometry of megamoe_runtime.geometries, with E capped: the tile math depends on
# H and I; the expert count only lengthens the schedule
GEOMETRY_DIMS = {
    "qwen3-30b-a3b": (16, 2048, 768),
    "mixtral-8x7b": (4, 4096, 14336),
    "dsv3": (16, 7168, 2048),
    "dsv3-ep8-local": (8, 7168, 2048),
    "gpt-oss-120b": (8, 2880, 2880),
    "tiny-qwen3": (16, 256, 128),
}


@pytest.mark.parametrize("geometry", sorted(GEOMETRY_DIMS))
@pytest.mark.parametrize("rows_per_expert", [3, 40, 300])
def test_geometry_matches_oracle(geometry, rows_per_expert):
    experts, hidden, intermediate = GEOMETRY_DIMS[geometry]
    counts = random_counts(experts, experts * rows_per_expert, seed=rows_per_expert)
    rows_MH, offsets, w13, w2, valid = make_problem(
        counts, hidden, intermediate, capacity=experts * rows_per_expert + 5
    )
    hidden_MI = check_gate_up(rows_MH, offsets, w13, valid)
    hidden_MI[valid:] = float("nan")
    scale_M = torch.rand(rows_MH.shape[0], device=DEVICE)
    check_down(hidden_MI, offsets, w2, valid, row_scale_M=scale_M)


SMALL = (256, 192)  # H, I: I = 192 leaves a partial 128-wide output tile


def every_valid_knob(op):
    """Every tile shape the tuner may pick (candidate_knobs) with a ring of at most 4 stages. K is
    256 here (4 K tiles): split-K up to 4 slices, one K tile each at 4."""
    for candidate in candidate_knobs(op, stage_choices=("max",)):
        if candidate.split_k <= 4:
            yield replace(candidate, stages=min(4, candidate.stages))


@pytest.mark.parametrize("knobs", list(every_valid_knob("gate_up")), ids=str)
def test_every_gate_up_variant_with_tails(knobs):
    counts = TAIL_COUNTS
    rows_MH, offsets, w13, _, valid = make_problem(counts, *SMALL, capacity=sum(counts) + 9)
    check_gate_up(rows_MH, offsets, w13, valid, knobs=knobs)


@pytest.mark.parametrize("knobs", list(every_valid_knob("down")), ids=str)
def test_every_down_variant_with_tails(knobs):
    counts = TAIL_COUNTS
    hidden, intermediate = SMALL[1] + 8, SMALL[0]  # N = 200: a partial column tile
    hidden_MI, offsets, _, w2, valid = make_problem(
        counts, intermediate, hidden, capacity=sum(counts) + 9
    )
    w2 = w2.transpose(1, 2).contiguous()  # [E, H=200, I=256]
    check_down(hidden_MI, offsets, w2, valid, knobs=knobs)
    scale_M = torch.rand(hidden_MI.shape[0], device=DEVICE)
    check_down(hidden_MI, offsets, w2, valid, row_scale_M=scale_M, knobs=knobs)


@pytest.mark.parametrize("counts, capacity", list(EDGE_CASES.values()))
@pytest.mark.parametrize(
    "knobs",
    [
        GemmKnobs(tile_rows=128, tile_cols=128, stages=4),
        GemmKnobs(tile_rows=32, tile_cols=128, stages=4, swap_ab=True),
        GemmKnobs(tile_rows=64, tile_cols=128, stages=4, cluster=(2, 1)),
        # down's K = 192 is 3 K tiles: slices of 1 and 2
        GemmKnobs(tile_rows=16, tile_cols=128, stages=4, swap_ab=True, split_k=2),
        GemmKnobs(tile_rows=128, tile_cols=256, stages=3, tail_rows=16),
    ],
    ids=str,
)
def test_edge_cases(counts, capacity, knobs):
    rows_MH, offsets, w13, w2, valid = make_problem(counts, *SMALL, capacity=capacity)
    hidden_MI = check_gate_up(rows_MH, offsets, w13, valid, knobs=knobs)
    hidden_MI[valid:] = float("nan")
    check_down(hidden_MI, offsets, w2, valid, knobs=knobs)


# experts whose last row tile holds 1 to 32 rows past a tile (and one past that), exactly a
# tile and its tail, one short of them, and empty or tiny ones
TAIL_ROW_COUNTS = [130, 144, 145, 128, 5, 0, 300, 272, 143, 1, 160, 161, 64, 79, 80, 81, 296]


@pytest.mark.parametrize(
    "knobs",
    [
        GemmKnobs(tile_rows=128, tile_cols=256, stages=3, tail_rows=16),
        GemmKnobs(tile_rows=128, tile_cols=128, stages=3, tail_rows=32, rows_fastest=False),
        GemmKnobs(tile_rows=64, tile_cols=128, stages=4, tail_rows=16),
        GemmKnobs(tile_rows=64, tile_cols=256, stages=3, tail_rows=32),
    ],
    ids=str,
)
def test_tail_rows_match_the_oracle_and_the_tiles_without_them_bitwise(knobs):
    """An expert's last row tile with its tail rows (swap-AB MMAs beside the tile's own) against
    the oracle, and bit for bit against the same tiles giving the tail rows a tile of their own
    (the same products summed in the same K order)."""
    counts = TAIL_ROW_COUNTS
    rows_MH, offsets, w13, w2, valid = make_problem(counts, *SMALL, capacity=sum(counts) + 7)
    hidden_MI = check_gate_up(rows_MH, offsets, w13, valid, knobs=knobs)
    plain = replace(knobs, tail_rows=0)
    untailed_MI = gate_up_swiglu(rows_MH, offsets, interleave_gate_up(w13), knobs=plain)
    assert torch.equal(hidden_MI[:valid], untailed_MI[:valid])
    hidden_MI[valid:] = float("nan")
    scale_M = torch.rand(rows_MH.shape[0], device=DEVICE)
    out_MH = check_down(hidden_MI, offsets, w2, valid, row_scale_M=scale_M, knobs=knobs)
    untailed_MH = down(hidden_MI, offsets, w2, row_scale_M=scale_M, knobs=plain)
    assert torch.equal(out_MH[:valid], untailed_MH[:valid])


@pytest.mark.parametrize(
    "knobs",
    [
        GemmKnobs(tile_rows=64, tile_cols=128, stages=4),
        GemmKnobs(tile_rows=32, tile_cols=128, stages=4, swap_ab=True),
        GemmKnobs(tile_rows=64, tile_cols=128, stages=4, cluster=(2, 1)),
        GemmKnobs(tile_rows=64, tile_cols=128, stages=4, tail_rows=16),
    ],
    ids=str,
)
def test_more_experts_than_one_walk_trip(knobs):
    # the expert walk reads 128 experts per trip: 300 experts (most empty, some past the second
    # trip's end) make every CTA walk several trips
    counts = [0] * 300
    for expert, rows in [(0, 5), (127, 70), (128, 1), (255, 33), (256, 129), (299, 17)]:
        counts[expert] = rows
    rows_MH, offsets, w13, w2, valid = make_problem(counts, *SMALL, capacity=sum(counts) + 3)
    hidden_MI = check_gate_up(rows_MH, offsets, w13, valid, knobs=knobs)
    hidden_MI[valid:] = float("nan")
    check_down(hidden_MI, offsets, w2, valid, knobs=knobs)


@pytest.mark.parametrize("shape", [(64, 256), (128, 128)], ids=str)
def test_pingpong_with_several_tiles_per_warpgroup(shape):
    # over 4 x 132 tiles per GEMM (564 of 64x256, 576 of 128x128): each pingpong warpgroup of
    # every CTA gets two or more tiles, so the turn barriers and the ring skipping run many
    # times; the result equals the cooperative kernel's bit for bit
    counts = random_counts(16, 16 * 1100, seed=5)
    rows_MH, offsets, w13, w2, valid = make_problem(counts, 512, 256, capacity=16 * 1100 + 7)
    tile_rows, tile_cols = shape
    results = {}
    for pingpong in (False, True):
        base = GemmKnobs(tile_rows=tile_rows, tile_cols=tile_cols, pingpong=pingpong)
        gate_up_knobs = with_max_stages(base, "gate_up", at_most=4)
        down_knobs = with_max_stages(base, "down", at_most=4)
        hidden_MI = check_gate_up(rows_MH, offsets, w13, valid, knobs=gate_up_knobs)
        hidden_MI[valid:] = float("nan")
        results[pingpong] = (hidden_MI, check_down(hidden_MI, offsets, w2, valid, knobs=down_knobs))
    for cooperative, pingpong in zip(results[False], results[True], strict=True):
        assert torch.equal(cooperative[:valid], pingpong[:valid])


def test_repeated_runs_are_bitwise_equal():
    counts = random_counts(16, 2000, seed=3)
    rows_MH, offsets, w13, w2, _ = make_problem(counts, 512, 256)
    w13_interleaved = interleave_gate_up(w13)
    first = down(gate_up_swiglu(rows_MH, offsets, w13_interleaved), offsets, w2)
    for _ in range(3):
        again = down(gate_up_swiglu(rows_MH, offsets, w13_interleaved), offsets, w2)
        assert torch.equal(first, again)


def test_the_dynamic_schedule_repeats_bitwise_and_leaves_its_counter_zero():
    # 288 tiles of 128x256 per GEMM on 132 CTAs: most tiles are taken from the counter, so
    # which CTA works which tile changes from run to run; what each tile computes does not
    from megamoe_kernels.shim.expert_gemm import _unit_counter

    counts = random_counts(16, 16 * 1100, seed=11)
    rows_MH, offsets, w13, w2, valid = make_problem(counts, 512, 256)
    gate_up_knobs, down_knobs = (default_knobs(op, 1100) for op in ("gate_up", "down"))
    assert not gate_up_knobs.swap_ab and not down_knobs.swap_ab
    first = None
    for _ in range(4):
        hidden_MI = check_gate_up(rows_MH, offsets, w13, valid, knobs=gate_up_knobs)
        assert _unit_counter(rows_MH).tolist() == [0, 0]
        out_MH = check_down(hidden_MI, offsets, w2, valid, knobs=down_knobs)
        assert _unit_counter(rows_MH).tolist() == [0, 0]
        first = (hidden_MI, out_MH) if first is None else first
        assert torch.equal(first[0][:valid], hidden_MI[:valid])
        assert torch.equal(first[1][:valid], out_MH[:valid])


def test_a_graph_replayed_before_one_captured_earlier_on_its_stream_fills_its_own_counter():
    # two captures on one stream into one pool whose small blocks hold -1 (a poisoned pool, as
    # memory another graph left behind); the second replays first, the first never before it:
    # each must zero the dynamic schedule's counter it reads
    from megamoe_kernels.shim.expert_gemm import _capture_id, _dynamic_schedule

    counts = random_counts(16, 16 * 1100, seed=5)
    rows_MH, offsets, w13, w2, valid = make_problem(counts, 512, 256)
    w13_interleaved = interleave_gate_up(w13)
    gate_up_knobs, down_knobs = (default_knobs(op, 1100) for op in ("gate_up", "down"))
    assert _dynamic_schedule(gate_up_knobs) and _dynamic_schedule(down_knobs)

    def layer():
        hidden_MI = gate_up_swiglu(rows_MH, offsets, w13_interleaved, knobs=gate_up_knobs)
        return down(hidden_MI, offsets, w2, knobs=down_knobs)

    expected = expert_mlp_reference(rows_MH, offsets, w13, w2, round_intermediate_to=torch.bfloat16)
    layer()  # compile outside the captures
    pool = torch.cuda.graph_pool_handle()
    poison = torch.cuda.CUDAGraph()
    with torch.cuda.graph(poison, pool=pool):
        # two 1 MiB blocks: one whole 2 MiB segment of the pool's small blocks
        dirty = [torch.full((1 << 18,), -1, dtype=torch.int32, device=DEVICE) for _ in range(2)]
    poison.replay()
    del dirty
    ids = []
    first, second = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(first, pool=pool):
        ids.append(_capture_id(torch.cuda.current_stream().cuda_stream))
        first_out_MH = layer()
    with torch.cuda.graph(second, pool=pool):
        ids.append(_capture_id(torch.cuda.current_stream().cuda_stream))
        second_out_MH = layer()
    assert None not in ids and ids[0] != ids[1]
    for graph, out_MH, which in ((second, second_out_MH, "second"), (first, first_out_MH, "first")):
        out_MH.fill_(float("nan"))
        graph.replay()
        assert_valid_rows_match(out_MH, expected, valid, what=f"the {which} capture's replay")


def test_untransformed_or_malformed_weights_are_refused_before_launch():
    rows_MH, offsets, w13, w2, _ = make_problem([3, 4], 256, 128)
    with pytest.raises(ValueError, match="interleave_gate_up"):
        # [E, 2I, H] with I = 124: not the model's order the kernels read (I a multiple of 128)
        gate_up_swiglu(rows_MH, offsets, w13[:, :248])
    with pytest.raises(ValueError, match="contiguous"):
        strided = interleave_gate_up(w13).transpose(1, 2).contiguous().transpose(1, 2)
        gate_up_swiglu(rows_MH, offsets, strided)
    with pytest.raises(ValueError, match="experts"):
        gate_up_swiglu(rows_MH, offsets[:2], interleave_gate_up(w13))
    with pytest.raises(ValueError, match="stages"):
        down(rows_MH[:, :128].contiguous(), offsets, w2, knobs=GemmKnobs(stages=40))


def test_a_cached_kernel_refuses_bad_tensors_naming_the_argument():
    """After a compile, launches skip the Python checks: the compiled signature refuses a bad
    tensor, and the error names the argument."""
    rows_MH, offsets, w13, w2, _ = make_problem([3, 4], 256, 128)
    w13_interleaved = interleave_gate_up(w13)
    hidden_MI = gate_up_swiglu(rows_MH, offsets, w13_interleaved)  # compiled and cached
    down(hidden_MI, offsets, w2)
    misaligned = torch.empty(rows_MH.numel() + 1, device=DEVICE, dtype=rows_MH.dtype)[1:]
    misaligned = misaligned.view_as(rows_MH).copy_(rows_MH)
    with pytest.raises(ValueError, match="16-byte aligned"):
        gate_up_swiglu(misaligned, offsets, w13_interleaved)
    with pytest.raises(ValueError, match="out_MI must be"):
        gate_up_swiglu(rows_MH, offsets, w13_interleaved, out_MI=hidden_MI[:-1])
    with pytest.raises(TypeError, match="expert_offsets must be a 1-D int32"):
        gate_up_swiglu(rows_MH, offsets.long(), w13_interleaved)
    with pytest.raises(ValueError, match="row_scale_M must be float32"):
        down(hidden_MI, offsets, w2, row_scale_M=torch.rand(hidden_MI.shape[0] - 1, device=DEVICE))
    with pytest.raises(ValueError, match="is on cpu"):
        down(hidden_MI, offsets, w2.cpu())
    # and a good call still runs after the refusals
    assert torch.equal(gate_up_swiglu(rows_MH, offsets, w13_interleaved), hidden_MI)


def test_a_kept_launcher_equals_the_plain_call_and_explains_a_refusal():
    counts = random_counts(8, 300, seed=5)
    rows_MH, offsets, w13, w2, valid = make_problem(counts, 512, 256)
    w13_interleaved = interleave_gate_up(w13)
    scale_M = torch.rand(rows_MH.shape[0], device=DEVICE)
    expected = down(
        gate_up_swiglu(rows_MH, offsets, w13_interleaved), offsets, w2, row_scale_M=scale_M
    )
    gate_up = gate_up_launcher(rows_MH, offsets, w13_interleaved)
    hidden_MI = gate_up(rows_MH, offsets, w13_interleaved)
    down_ = down_launcher(hidden_MI, offsets, w2, row_scale_M=scale_M)
    for _ in range(2):
        out_MH = torch.full_like(expected, float("nan"))
        down_(
            gate_up(rows_MH, offsets, w13_interleaved), offsets, w2, row_scale_M=scale_M, out=out_MH
        )
        assert torch.equal(out_MH[:valid], expected[:valid])
    with pytest.raises(ValueError, match="out_MH must be"):
        down_(hidden_MI, offsets, w2, row_scale_M=scale_M, out=out_MH[:, :-8])
    with pytest.raises(ValueError, match="row_scale_M must be float32"):
        down_(hidden_MI, offsets, w2, row_scale_M=scale_M.double())


@pytest.mark.parametrize(
    "shape",
    [(128, 256, False), (64, 128, False), (128, 128, True), (64, 256, True)],
    ids=str,
)
def test_clusters_equal_the_single_cta_kernel(shape):
    # 2-CTA clusters share each weight tile (TMA multicast) over pairs of row tiles; experts with
    # an odd number of row tiles leave the second CTA of their last pair an empty tile, and
    # ~40 experts x several pairs give every cluster many units: the result equals the
    # single-CTA kernel's bit for bit
    counts = random_counts(40, 40 * 700, seed=11)
    counts[3], counts[7], counts[8] = 0, 1, 129
    rows_MH, offsets, w13, w2, valid = make_problem(counts, 512, 320, capacity=sum(counts) + 5)
    tile_rows, tile_cols, pingpong = shape
    results = {}
    for cluster in CLUSTERS:
        base = GemmKnobs(
            tile_rows=tile_rows, tile_cols=tile_cols, pingpong=pingpong, cluster=cluster
        )
        gate_up_knobs = with_max_stages(base, "gate_up")
        down_knobs = with_max_stages(base, "down")
        hidden_MI = check_gate_up(rows_MH, offsets, w13, valid, knobs=gate_up_knobs)
        hidden_MI[valid:] = float("nan")
        scale_M = torch.linspace(0.5, 1.5, rows_MH.shape[0], device=DEVICE)
        results[cluster] = (
            hidden_MI,
            check_down(hidden_MI, offsets, w2, valid, row_scale_M=scale_M, knobs=down_knobs),
        )
    for single, paired in zip(results[(1, 1)], results[(2, 1)], strict=True):
        assert torch.equal(single[:valid], paired[:valid])


@pytest.mark.parametrize(
    "geometry, counts",
    [
        ("dsv3-ep8-local", [0, 0, 0, 1, 0, 0, 0, 0]),  # one token, one local expert
        ("dsv3-ep8-local", [2, 0, 1, 0, 0, 5, 0, 9]),
        ("gpt-oss-120b", [1, 1, 0, 3, 0, 0, 1, 0]),  # K = 2880: 45 K tiles, uneven slices
    ],
)
def test_split_k_at_decode_matches_the_oracle_and_repeats_bitwise(geometry, counts):
    # split-K adds the slices in a fixed order: each split is within the oracle's tolerance and
    # bitwise equal to itself on every launch (each launch must also leave its arrival counters
    # at zero, or the next one would store nothing over the NaN-poisoned output)
    _, hidden, intermediate = GEOMETRY_DIMS[geometry]
    rows_MH, offsets, w13, w2, valid = make_problem(counts, hidden, intermediate, capacity=20)
    scale_M = torch.rand(rows_MH.shape[0], device=DEVICE)
    for split_k in (1, 2, 4, 8):
        gate_up_knobs = replace(default_knobs("gate_up", 1), split_k=split_k)
        down_knobs = replace(default_knobs("down", 1), split_k=split_k)
        first = None
        for _ in range(3):
            hidden_MI = check_gate_up(rows_MH, offsets, w13, valid, knobs=gate_up_knobs)
            hidden_MI[valid:] = float("nan")
            out_MH = check_down(
                hidden_MI, offsets, w2, valid, row_scale_M=scale_M, knobs=down_knobs
            )
            if first is None:
                first = (hidden_MI, out_MH)
            assert torch.equal(first[0][:valid], hidden_MI[:valid])
            assert torch.equal(first[1][:valid], out_MH[:valid])


def test_split_k_replays_in_a_cuda_graph_with_new_routing():
    _, hidden, intermediate = GEOMETRY_DIMS["dsv3-ep8-local"]
    rows_MH, offsets, w13, w2, _ = make_problem([1] * 8, hidden, intermediate)
    w13_interleaved = interleave_gate_up(w13)
    gate_up_knobs = replace(default_knobs("gate_up", 1), split_k=4)
    down_knobs = replace(default_knobs("down", 1), split_k=2)

    def layer():
        hidden_MI = gate_up_swiglu(rows_MH, offsets, w13_interleaved, knobs=gate_up_knobs)
        return down(hidden_MI, offsets, w2, knobs=down_knobs)

    def oracle():
        return expert_mlp_reference(rows_MH, offsets, w13, w2, round_intermediate_to=torch.bfloat16)

    layer()  # compile outside the capture (the capture makes a workspace of its own)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_MH = layer()
    for counts in ([1] * 8, [0, 0, 8, 0, 0, 0, 0, 0], [3, 0, 0, 0, 0, 0, 0, 5], [0] * 8):
        replay_with_counts(graph, out_MH, offsets, counts, oracle)


def test_split_k_refuses_a_prefill_sized_workspace_and_a_short_k():
    rows_MH, offsets, w13, _, _ = make_problem([100_000, 100_000], 256, 128)
    knobs = GemmKnobs(tile_rows=16, tile_cols=64, stages=4, swap_ab=True, split_k=4)
    with pytest.raises(ValueError, match="workspace"):
        gate_up_swiglu(rows_MH, offsets, interleave_gate_up(w13), knobs=knobs)
    with pytest.raises(ValueError, match="split_k=8 needs K >= 449"):
        gate_up_swiglu(rows_MH, offsets, interleave_gate_up(w13), knobs=replace(knobs, split_k=8))


@pytest.mark.parametrize("rows_per_expert", [0, 1, 32, 33, 400])
def test_the_default_launches_follow_the_valid_rows(rows_per_expert):
    # a capacity for 512 rows per expert asks for prefill tiles; batches of at most 32 valid
    # rows per expert (a sum of 256 here) run the decode launch instead: exactly one of the two
    # stores each row, on either side of the boundary
    experts = 8
    counts = [rows_per_expert] * experts
    counts[0], counts[1] = 2 * rows_per_expert, 0  # the same sum, with an empty expert
    rows_MH, offsets, w13, w2, valid = make_problem(counts, *SMALL, capacity=512 * experts)
    hidden_MI = check_gate_up(rows_MH, offsets, w13, valid)
    hidden_MI[valid:] = float("nan")
    check_down(hidden_MI, offsets, w2, valid, row_scale_M=torch.rand(512 * experts, device=DEVICE))


@pytest.mark.parametrize("rows_per_expert", [1, 32, 33, 400])
def test_tuned_prefill_knobs_leave_small_batches_to_the_decode_tiles(rows_per_expert):
    # a knob-cache entry for a prefill class at a capacity of 512 rows per expert: its tiles
    # take batches of more than 32 valid rows per expert, the decode tiles the others
    experts = 8
    counts = [rows_per_expert] * experts
    rows_MH, offsets, w13, w2, valid = make_problem(counts, *SMALL, capacity=512 * experts)
    tuned = GemmKnobs(tile_rows=128, tile_cols=128, pingpong=True)
    hidden_MI = check_gate_up(
        rows_MH,
        offsets,
        w13,
        valid,
        tuned_knobs=with_max_stages(tuned, "gate_up"),
    )
    hidden_MI[valid:] = float("nan")
    check_down(hidden_MI, offsets, w2, valid, tuned_knobs=with_max_stages(tuned, "down"))


@pytest.mark.parametrize("valid_rows_hint", [0, 256, 257, 4096])
def test_a_wrong_valid_row_hint_still_computes_every_row(valid_rows_hint):
    # the hint picks the one launch (decode tiles up to 32 rows per expert = 256 here, prefill
    # tiles above) and that launch takes any row count: 100 and 3000 valid rows, whatever it says
    experts, capacity = 8, 512 * 8
    for valid in (100, 3000):
        counts = random_counts(experts, valid, seed=valid)
        rows_MH, offsets, w13, w2, _ = make_problem(counts, *SMALL, capacity=capacity)
        hidden_MI = poisoned((capacity, w13.shape[1] // 2))
        gate_up_swiglu(
            rows_MH, offsets, interleave_gate_up(w13), out_MI=hidden_MI, valid_rows=valid_rows_hint
        )
        out_MH = poisoned((capacity, w2.shape[1]))
        down(hidden_MI, offsets, w2, out_MH=out_MH, valid_rows=valid_rows_hint)
        expected = expert_mlp_reference(
            rows_MH, offsets, w13, w2, round_intermediate_to=torch.bfloat16
        )
        assert_valid_rows_match(
            out_MH, expected, valid, what=f"{valid} rows, hint {valid_rows_hint}"
        )


def test_the_default_launches_replay_in_a_graph_across_the_boundary():
    experts, capacity = 8, 512 * 8
    rows_MH, offsets, w13, w2, _ = make_problem([capacity // experts] * experts, *SMALL)
    w13_interleaved = interleave_gate_up(w13)

    def layer():
        return down(gate_up_swiglu(rows_MH, offsets, w13_interleaved), offsets, w2)

    def oracle():
        return expert_mlp_reference(rows_MH, offsets, w13, w2, round_intermediate_to=torch.bfloat16)

    layer()  # compile both launches of each GEMM outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_MH = layer()
    for valid in (0, 100, 32 * experts, 32 * experts + 1, 3000, capacity):
        replay_with_counts(
            graph, out_MH, offsets, random_counts(experts, valid, seed=valid), oracle
        )
