"""Compile-only: the FP8 grouped GEMMs' default profiles compile for sm_90a on a CPU, and their
scale arguments are refused when they do not have the layout the kernels read.

Meta tensors carry the shapes; CuTe DSL compiles against fake tensors (CUTE_DSL_ARCH=sm_90a).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # before CuTe DSL is first imported: without a GPU it would guess another architecture
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass")

from megamoe_kernels import (
    FP8_DTYPE,
    GEGLU,
    GemmKnobs,
    SwiGLU,
    default_knobs,
    default_launches,
    down_fp8,
    down_fp8_launcher,
    gate_up_fp8_launcher,
    row_scales_buffer,
)
from megamoe_kernels.shim.expert_gemm import DEFAULT_SM_COUNT, published_offsets_buffer
from megamoe_kernels.shim.knobs import PROFILE_ROWS_PER_EXPERT

pytestmark = pytest.mark.compile

# I a multiple of the 128-row weight block; H = 16.5 K tiles (a partial last one)
EXPERTS, HIDDEN, INTERMEDIATE = 8, 2112, 1408
META = {"device": "meta", "dtype": FP8_DTYPE}


def meta_operands(rows: int):
    return (
        torch.empty(rows, HIDDEN, **META),
        torch.empty(EXPERTS + 1, dtype=torch.int32, device="meta"),
        # interleave_gate_up's layout: [E, 2I / 16, 16, H]
        torch.empty(EXPERTS, 2 * INTERMEDIATE // 16, 16, HIDDEN, **META),
        torch.empty(rows, INTERMEDIATE, **META),
        torch.empty(EXPERTS, HIDDEN, INTERMEDIATE, **META),
    )


def test_the_decode_down_that_prefetches_into_l2_compiles(down_l2_prefetch):
    # one qwen3-30b-a3b token: 8 rows over 128 experts, whose down GEMM's CTAs beside the
    # gate-up prefetch the others' weights (Launch.l2_prefetch_ctas)
    experts, hidden, intermediate = 128, 2048, 768
    (launch,) = default_launches(
        "down_fp8", 8, experts, weight_dims=(hidden, intermediate), sms=DEFAULT_SM_COUNT
    )
    assert launch.l2_prefetch_ctas > 0, launch
    down_fp8_launcher(
        torch.empty(8, intermediate, **META),
        torch.empty(experts + 1, dtype=torch.int32, device="meta"),
        torch.empty(experts, hidden, intermediate, **META),
        x_group=64,
        compile_only=True,
    )


def test_the_decode_fp8_gate_up_that_polls_for_published_offsets_compiles():
    # one qwen3-30b-a3b token, polling for the offsets the routing kernel publishes
    # (Launch.polls_offsets)
    experts, hidden, intermediate = 128, 2048, 768
    offsets = published_offsets_buffer(experts + 1, device="meta")
    launcher = gate_up_fp8_launcher(
        torch.empty(8, hidden, **META),
        offsets,
        torch.empty(experts, 2 * intermediate // 16, 16, hidden, **META),
        valid_rows=8,
        offsets_published=True,
        compile_only=True,
    )
    assert launcher.knobs.swap_ab, launcher.knobs


@pytest.mark.parametrize("rows_per_expert", PROFILE_ROWS_PER_EXPERT)
def test_every_default_fp8_profile_compiles(rows_per_expert):
    rows = max(1, int(rows_per_expert * EXPERTS))
    rows_MH, offsets, w13, hidden_MI, w2 = meta_operands(rows)
    for op, launcher, x, w in (
        ("gate_up_fp8", gate_up_fp8_launcher, rows_MH, w13),
        ("down_fp8", down_fp8_launcher, hidden_MI, w2),
    ):
        knobs = default_knobs(op, rows_per_expert)
        launcher(x, offsets, w, knobs=knobs, compile_only=True)


@pytest.mark.parametrize(
    "swiglu",
    [SwiGLU(limit=7.0, alpha=1.702, up_offset=1.0), SwiGLU(up_softcap=25.0), GEGLU],
    ids=str,
)
@pytest.mark.parametrize("rows_per_expert", [1, 300])  # a decode tile, a 128x256 prefill tile
def test_the_fp8_gate_up_compiles_each_swiglu_variant(swiglu, rows_per_expert):
    rows_MH, offsets, w13, _, _ = meta_operands(rows_per_expert * EXPERTS)
    knobs = default_knobs("gate_up_fp8", rows_per_expert)
    launcher = gate_up_fp8_launcher(
        rows_MH, offsets, w13, knobs=knobs, swiglu=swiglu, compile_only=True
    )
    assert launcher.swiglu == swiglu


@pytest.mark.parametrize(
    "knobs",
    [
        GemmKnobs(tile_rows=128, tile_cols=256, stages=3),
        GemmKnobs(tile_rows=64, tile_cols=256, stages=3, pingpong=True),
        GemmKnobs(tile_rows=128, tile_cols=256, stages=3, cluster=(2, 1)),
    ],
    ids=str,
)
def test_fp8_tiles_of_two_weight_blocks_compile(knobs):
    # their MMAs and promotions run one weight block's columns at a time
    rows_MH, offsets, w13, hidden_MI, w2 = meta_operands(512 * EXPERTS)
    gate_up_fp8_launcher(rows_MH, offsets, w13, knobs=knobs, compile_only=True)
    down_fp8_launcher(hidden_MI, offsets, w2, knobs=knobs, compile_only=True)


def test_the_default_fp8_launches_of_a_prefill_capacity_compile():
    # knobs=None: the prefill tiles and the tiles for batches of few valid rows; the down
    # GEMM on the scale groups the gate-up writes (128 columns: 256-column tiles both)
    rows_MH, offsets, w13, hidden_MI, w2 = meta_operands(512 * EXPERTS)
    gate_up = gate_up_fp8_launcher(rows_MH, offsets, w13, compile_only=True)
    assert gate_up.out_group == 128
    down_fp8_launcher(hidden_MI, offsets, w2, compile_only=True, x_group=gate_up.out_group)


@pytest.mark.parametrize("rows_per_expert", PROFILE_ROWS_PER_EXPERT)
def test_every_default_fp8_down_profile_compiles_on_128_column_groups(rows_per_expert):
    # tuned gate-up knobs may leave 128-column groups to any down profile
    rows = max(1, int(rows_per_expert * EXPERTS))
    _, offsets, _, hidden_MI, w2 = meta_operands(rows)
    knobs = default_knobs("down_fp8", rows_per_expert)
    down_fp8_launcher(hidden_MI, offsets, w2, knobs=knobs, x_group=128, compile_only=True)


@pytest.mark.parametrize(
    "make_scales, message",
    [
        # rows-major: the kernels read a group's rows contiguous
        (lambda groups, rows: torch.empty(rows, groups, device="meta").t(), "contiguous rows"),
        (lambda groups, rows: torch.empty(groups, rows + 1, device="meta"), "must be float32"),
        (lambda groups, rows: row_scales_buffer(groups, rows, device="meta").half(), "float32"),
    ],
)
def test_fp8_row_scales_in_another_layout_are_refused(make_scales, message):
    rows = 24
    _, offsets, _, hidden_MI, w2 = meta_operands(rows)
    w2_scales = torch.empty(EXPERTS, HIDDEN // 128 + 1, INTERMEDIATE // 128, device="meta")
    good = row_scales_buffer(INTERMEDIATE // 64, rows, device="meta")
    down_fp8(hidden_MI, good, offsets, w2, w2_scales, compile_only=True)
    # one scale per 128 columns: the group told from the shape
    wide = row_scales_buffer(INTERMEDIATE // 128, rows, device="meta")
    down_fp8(hidden_MI, wide, offsets, w2, w2_scales, compile_only=True)
    # a view of a wider buffer is taken as it is
    wider = row_scales_buffer(INTERMEDIATE // 64, rows + 8, device="meta")[:, :rows]
    down_fp8(hidden_MI, wider, offsets, w2, w2_scales, compile_only=True)
    with pytest.raises(ValueError, match=message):
        down_fp8(
            hidden_MI,
            make_scales(INTERMEDIATE // 64, rows),
            offsets,
            w2,
            w2_scales,
            compile_only=True,
        )
