"""Knob validity, fail-closed overrides and the default profile (no GPU, no CuTe DSL)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from megamoe_kernels import (
    GemmKnobs,
    Launch,
    check_knobs,
    default_knobs,
    default_launches,
    knob_problems,
    resolve_knobs,
)
from megamoe_kernels.shim.knobs import (
    OPS,
    PROFILE_ROWS_PER_EXPERT,
    SMALL_BATCH_ROWS_PER_EXPERT,
    epilogue_smem_bytes,
    max_stages,
)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("rows_per_expert", [0, 0.5, *PROFILE_ROWS_PER_EXPERT, 10_000])
def test_default_profile_is_always_valid(op, rows_per_expert):
    knobs = default_knobs(op, rows_per_expert)
    assert knob_problems(knobs, op) == []
    assert knobs.swap_ab == (rows_per_expert <= 64)


@pytest.mark.parametrize(
    "knobs, reason",
    [
        (GemmKnobs(tile_rows=96), "tile_rows=96"),
        (GemmKnobs(tile_rows=16), "tile_rows=16 without swap_ab"),
        (GemmKnobs(tile_cols=256, swap_ab=True, tile_rows=16), "tile_cols=256 with swap_ab"),
        (GemmKnobs(stages=1), "stages=1"),
        (GemmKnobs(stages=9), "stages=9"),
        (GemmKnobs(cluster=(1, 2)), "cluster=(1, 2): accepted"),
        (
            GemmKnobs(cluster=(2, 1), swap_ab=True, tile_rows=32, tile_cols=128),
            "cluster=(2, 1) with swap_ab",
        ),
        (GemmKnobs(pingpong=True), "pingpong with a 128x256 tile"),
        (
            GemmKnobs(pingpong=True, swap_ab=True, tile_rows=32, tile_cols=128),
            "pingpong with swap_ab",
        ),
        (GemmKnobs(split_k=3, swap_ab=True, tile_rows=16, tile_cols=128), "split_k=3: accepted"),
        (GemmKnobs(split_k=2), "split_k=2 without swap_ab"),
    ],
)
def test_invalid_combination_says_why_and_fails_closed(knobs, reason):
    assert any(reason in problem for problem in knob_problems(knobs, "gate_up"))
    with pytest.raises(ValueError, match=reason.split("=")[0]):
        check_knobs(knobs, "gate_up")
    with pytest.raises(ValueError):
        resolve_knobs("gate_up", 1000, knobs)


def test_unknown_op_is_refused():
    assert knob_problems(GemmKnobs(), "up") == ["op must be one of ('gate_up', 'down'), got 'up'"]


def test_override_wins_when_valid():
    knobs = GemmKnobs(tile_rows=64, tile_cols=128, stages=3)
    assert resolve_knobs("down", 1, knobs) is knobs


def test_pingpong_stages_count_both_epilogue_buffers():
    cooperative = GemmKnobs(tile_rows=128, tile_cols=128, stages=2)
    pingpong = GemmKnobs(tile_rows=128, tile_cols=128, stages=2, pingpong=True)
    assert epilogue_smem_bytes(pingpong, "down") == 2 * epilogue_smem_bytes(cooperative, "down")
    assert max_stages(pingpong, "down") < max_stages(cooperative, "down")
    assert knob_problems(replace(pingpong, stages=max_stages(pingpong, "down")), "down") == []
    assert knob_problems(replace(pingpong, stages=max_stages(cooperative, "down")), "down")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("capacity, experts", [(1, 32), (64 * 128, 128), (500, 8)])
def test_a_decode_capacity_launches_one_kernel_for_every_batch(op, capacity, experts):
    assert default_launches(op, capacity, experts) == (
        Launch(default_knobs(op, capacity / experts), 0, None),
    )


@pytest.mark.parametrize("op", OPS)
def test_a_prefill_capacity_adds_decode_tiles_for_batches_of_few_rows(op):
    # qwen3 at 8192 tokens: a capacity of 512 rows per expert; a batch of at most 32 rows per
    # expert runs the decode tiles, a larger one the prefill tiles: the ranges tile [0, inf)
    experts = 128
    small, large = default_launches(op, 512 * experts, experts)
    boundary = SMALL_BATCH_ROWS_PER_EXPERT * experts + 1
    assert small == Launch(default_knobs(op, SMALL_BATCH_ROWS_PER_EXPERT), 0, boundary)
    assert large == Launch(default_knobs(op, 512), boundary, None)
    assert small.knobs.swap_ab and not large.knobs.swap_ab
