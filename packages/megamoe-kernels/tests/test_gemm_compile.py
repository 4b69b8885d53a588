"""Compile-only: every kernel variant and every default profile compiles for sm_90a on a CPU.

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
    GemmKnobs,
    default_knobs,
    down,
    down_launcher,
    gate_up_launcher,
    gate_up_swiglu,
    interleave_gate_up,
)
from megamoe_kernels.shim.expert_gemm import published_offsets_buffer
from megamoe_kernels.shim.knobs import PROFILE_ROWS_PER_EXPERT

pytestmark = pytest.mark.compile

# gpt-oss-like dims: 2880 is not a multiple of 128, so masked column tiles are compiled too
EXPERTS, HIDDEN, INTERMEDIATE = 8, 2880, 2880


def compile_pair(rows_per_expert, *, gate_up_knobs, down_knobs, row_scale, tuned=False):
    """Compiles both GEMMs with these knobs (run exactly), or with tuned=True as tuned knobs in
    place of the default profile's."""
    capacity = max(1, int(rows_per_expert * EXPERTS))
    meta = {"device": "meta", "dtype": torch.bfloat16}
    rows_MH = torch.empty(capacity, HIDDEN, **meta)
    offsets = torch.empty(EXPERTS + 1, dtype=torch.int32, device="meta")
    w13 = interleave_gate_up(torch.empty(EXPERTS, 2 * INTERMEDIATE, HIDDEN, **meta))
    w2 = torch.empty(EXPERTS, HIDDEN, INTERMEDIATE, **meta)
    knob_argument = "tuned_knobs" if tuned else "knobs"
    hidden_MI = gate_up_swiglu(
        rows_MH, offsets, w13, compile_only=True, **{knob_argument: gate_up_knobs}
    )
    scale_M = torch.empty(capacity, device="meta") if row_scale else None
    down(
        hidden_MI,
        offsets,
        w2,
        row_scale_M=scale_M,
        compile_only=True,
        **{knob_argument: down_knobs},
    )


@pytest.mark.parametrize("rows_per_expert", PROFILE_ROWS_PER_EXPERT)
def test_every_default_profile_compiles(rows_per_expert):
    compile_pair(
        rows_per_expert,
        gate_up_knobs=default_knobs("gate_up", rows_per_expert),
        down_knobs=default_knobs("down", rows_per_expert),
        row_scale=True,
    )


def test_the_default_launches_of_a_prefill_capacity_compile():
    # knobs=None: the prefill tiles and the decode tiles for batches of few valid rows
    compile_pair(512, gate_up_knobs=None, down_knobs=None, row_scale=True)


def test_tuned_knobs_at_a_prefill_capacity_compile_beside_the_decode_tiles():
    tuned = GemmKnobs(tile_rows=128, tile_cols=128, stages=4, pingpong=True)
    compile_pair(512, gate_up_knobs=tuned, down_knobs=tuned, row_scale=True, tuned=True)


def meta_down_operands():
    """(hidden_MI, offsets, w2) of a 64-row down GEMM, as meta tensors."""
    meta = {"device": "meta", "dtype": torch.bfloat16}
    return (
        torch.empty(64, INTERMEDIATE, **meta),
        torch.empty(EXPERTS + 1, dtype=torch.int32, device="meta"),
        torch.empty(EXPERTS, HIDDEN, INTERMEDIATE, **meta),
    )


def test_knobs_and_tuned_knobs_together_are_refused():
    hidden_MI, offsets, w2 = meta_down_operands()
    knobs = default_knobs("down", 8)
    with pytest.raises(ValueError, match="not both"):
        down(hidden_MI, offsets, w2, knobs=knobs, tuned_knobs=knobs, compile_only=True)


@pytest.mark.parametrize("valid_rows", [-1, 65, 2.0])
def test_a_valid_row_count_outside_the_capacity_is_refused(valid_rows):
    hidden_MI, offsets, w2 = meta_down_operands()
    with pytest.raises(
        ValueError, match=r"valid_rows must be None or an int in \[0, capacity=64\]"
    ):
        down(hidden_MI, offsets, w2, valid_rows=valid_rows, compile_only=True)


@pytest.mark.parametrize(
    "knobs",
    [
        GemmKnobs(tile_rows=64, tile_cols=128, stages=3),
        GemmKnobs(tile_rows=128, tile_cols=192, stages=3, rows_fastest=False),
        GemmKnobs(tile_rows=128, tile_cols=64, stages=2, swap_ab=True),
        GemmKnobs(tile_rows=32, tile_cols=64, stages=5, swap_ab=True, rows_fastest=False),
        GemmKnobs(tile_rows=64, tile_cols=256, stages=3, pingpong=True),
        GemmKnobs(tile_rows=128, tile_cols=128, stages=3, pingpong=True, rows_fastest=False),
        GemmKnobs(tile_rows=128, tile_cols=256, stages=3, cluster=(2, 1)),
        GemmKnobs(tile_rows=64, tile_cols=192, stages=3, cluster=(2, 1), rows_fastest=False),
        GemmKnobs(tile_rows=128, tile_cols=128, stages=4, cluster=(2, 1), pingpong=True),
        GemmKnobs(tile_rows=16, tile_cols=128, stages=8, swap_ab=True, split_k=4),
        GemmKnobs(
            tile_rows=32, tile_cols=64, stages=4, swap_ab=True, split_k=2, rows_fastest=False
        ),
        GemmKnobs(tile_rows=128, tile_cols=256, stages=3, tail_rows=16),
        GemmKnobs(tile_rows=64, tile_cols=192, stages=3, tail_rows=32, rows_fastest=False),
    ],
    ids=str,
)
def test_kernel_variants_compile(knobs):
    compile_pair(64, gate_up_knobs=knobs, down_knobs=knobs, row_scale=False)


def test_bad_arguments_are_refused_naming_the_argument_on_every_call():
    """Compile-only calls run the argument checks every time, a cached variant included."""
    experts, hidden, intermediate, capacity = 4, 256, 128, 10
    meta = {"device": "meta", "dtype": torch.bfloat16}
    rows_MH = torch.empty(capacity, hidden, **meta)
    offsets = torch.empty(experts + 1, dtype=torch.int32, device="meta")
    w13_E2IH = torch.empty(experts, 2 * intermediate, hidden, **meta)
    w13 = interleave_gate_up(w13_E2IH)
    w2 = torch.empty(experts, hidden, intermediate, **meta)
    hidden_MI = torch.empty(capacity, intermediate, **meta)
    for _ in range(2):  # the second round hits the compile cache
        gate_up_swiglu(rows_MH, offsets, w13, compile_only=True)
        down(hidden_MI, offsets, w2, compile_only=True)
        with pytest.raises(ValueError, match="interleave_gate_up"):
            # I = 124 gate and up rows: neither the model's order (whole tiles of 128) nor
            # interleave_gate_up's layout
            gate_up_swiglu(rows_MH, offsets, w13_E2IH[:, :248], compile_only=True)
        with pytest.raises(ValueError, match="expert_offsets has 3 entries"):
            gate_up_swiglu(rows_MH, offsets[:3], w13, compile_only=True)
        with pytest.raises(TypeError, match="rows must be torch.bfloat16"):
            gate_up_swiglu(rows_MH.half(), offsets, w13, compile_only=True)
        with pytest.raises(TypeError, match="rows must be a torch.Tensor"):
            gate_up_swiglu([[0.0]], offsets, w13, compile_only=True)
        with pytest.raises(ValueError, match="out_MI must be"):
            wrong_out = torch.empty(capacity, intermediate + 8, **meta)
            gate_up_swiglu(rows_MH, offsets, w13, out_MI=wrong_out, compile_only=True)
        with pytest.raises(ValueError, match="row_scale_M must be float32"):
            short_scale = torch.empty(capacity - 1, device="meta")
            down(hidden_MI, offsets, w2, row_scale_M=short_scale, compile_only=True)
        with pytest.raises(ValueError, match="w2 .* does not match rows"):
            down(rows_MH, offsets, w2, compile_only=True)


def test_launchers_take_the_calls_they_were_bound_for_and_check_every_call_that_runs_nothing():
    experts, hidden, intermediate, capacity = 4, 256, 128, 10
    meta = {"device": "meta", "dtype": torch.bfloat16}
    rows_MH = torch.empty(capacity, hidden, **meta)
    offsets = torch.empty(experts + 1, dtype=torch.int32, device="meta")
    w13 = interleave_gate_up(torch.empty(experts, 2 * intermediate, hidden, **meta))
    w2 = torch.empty(experts, hidden, intermediate, **meta)
    gate_up = gate_up_launcher(rows_MH, offsets, w13, compile_only=True)
    hidden_MI = gate_up(rows_MH, offsets, w13)
    assert hidden_MI.shape == (capacity, intermediate)
    scale_M = torch.empty(capacity, device="meta")
    down_ = down_launcher(hidden_MI, offsets, w2, row_scale_M=scale_M, compile_only=True)
    assert down_(hidden_MI, offsets, w2, row_scale_M=scale_M).shape == (capacity, hidden)
    with pytest.raises(ValueError, match="out_MI must be"):
        gate_up(rows_MH, offsets, w13, out=torch.empty(capacity, intermediate + 8, **meta))
    with pytest.raises(ValueError, match="row_scale_M is the down GEMM's"):
        gate_up(rows_MH, offsets, w13, row_scale_M=scale_M)
    with pytest.raises(ValueError, match="w2 .* does not match rows"):
        down_(rows_MH, offsets, w2)


def test_batch_rows_off_the_gpu_are_refused_unless_compiling_only():
    experts, hidden, intermediate = 2, 256, 128
    rows_MH = torch.randn(6, hidden, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 2, 6], dtype=torch.int32)
    w13 = interleave_gate_up(torch.randn(experts, 2 * intermediate, hidden, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="the batch rows are on cpu: the kernels run on a CUDA"):
        gate_up_swiglu(rows_MH, offsets, w13)
    gate_up_swiglu(rows_MH, offsets, w13, compile_only=True)


def test_the_masked_and_the_gathered_variants_compile():
    # a masked batch (each expert's rows counted at a fixed stride) for both GEMMs, prefill and
    # decode tiles; gathered rows (the tokens and each batch row's token) for the gate-up GEMM
    meta = {"device": "meta", "dtype": torch.bfloat16}
    offsets = torch.empty(EXPERTS + 1, dtype=torch.int32, device="meta")
    counts = torch.empty(EXPERTS, dtype=torch.int32, device="meta")
    hidden = 2048  # gathered rows take whole K tiles
    w13 = interleave_gate_up(torch.empty(EXPERTS, 2 * INTERMEDIATE, hidden, **meta))
    w2 = torch.empty(EXPERTS, hidden, INTERMEDIATE, **meta)
    for rows_per_expert in (2, 512):
        capacity = rows_per_expert * EXPERTS
        rows_MH = torch.empty(capacity, hidden, **meta)
        hidden_MI = gate_up_swiglu(rows_MH, offsets, w13, expert_counts=counts, compile_only=True)
        down(hidden_MI, offsets, w2, expert_counts=counts, compile_only=True)
        source_M = torch.empty(capacity, dtype=torch.int32, device="meta")
        tokens_TH = torch.empty(max(1, capacity // 4), hidden, **meta)
        gate_up_swiglu(tokens_TH, offsets, w13, row_source_M=source_M, compile_only=True)


def test_the_decode_gate_up_that_polls_for_published_offsets_compiles():
    # one qwen3-30b-a3b token (8 rows over 128 experts), copied and gathered rows, and a
    # prefill capacity, whose decode launch polls beside a prefill one that waits
    meta = {"device": "meta", "dtype": torch.bfloat16}
    experts, hidden, intermediate = 128, 2048, 768
    offsets = published_offsets_buffer(experts + 1, device="meta")
    w13 = interleave_gate_up(torch.empty(experts, 2 * intermediate, hidden, **meta))
    for capacity, valid_rows in ((8, 8), (16384, None)):
        rows_MH = torch.empty(capacity, hidden, **meta)
        launcher = gate_up_launcher(
            rows_MH, offsets, w13, valid_rows=valid_rows, offsets_published=True, compile_only=True
        )
        assert launcher.knobs.swap_ab
    source_M = torch.empty(16, dtype=torch.int32, device="meta")
    tokens_TH = torch.empty(2, hidden, **meta)
    gate_up_swiglu(
        tokens_TH, offsets, w13, row_source_M=source_M, offsets_published=True, compile_only=True
    )


def test_published_offsets_need_the_word_after_them():
    meta = {"device": "meta", "dtype": torch.bfloat16}
    w13 = interleave_gate_up(torch.empty(EXPERTS, 2 * INTERMEDIATE, HIDDEN, **meta))
    rows_MH = torch.empty(16, HIDDEN, **meta)
    offsets = torch.empty(EXPERTS + 1, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="followed in its storage by the int32 word"):
        gate_up_swiglu(rows_MH, offsets, w13, offsets_published=True, compile_only=True)


@pytest.mark.parametrize("rows_per_expert", [1, 16, 512])
def test_the_down_gemms_adding_rows_into_tokens_compile(rows_per_expert):
    """row_source_M on the down GEMMs (bf16 and FP8): the default launches of decode and
    prefill capacities, their rows added into the tokens' rows."""
    from megamoe_kernels import down_fp8

    capacity = rows_per_expert * EXPERTS
    meta = {"device": "meta"}
    offsets = torch.empty(EXPERTS + 1, dtype=torch.int32, **meta)
    y_TH = torch.empty(capacity // 2 + 1, HIDDEN, dtype=torch.bfloat16, **meta)
    row_tokens = torch.empty(capacity, dtype=torch.int32, **meta)
    row_scale = torch.empty(capacity, dtype=torch.float32, **meta)
    down(
        torch.empty(capacity, INTERMEDIATE, dtype=torch.bfloat16, **meta),
        offsets,
        torch.empty(EXPERTS, HIDDEN, INTERMEDIATE, dtype=torch.bfloat16, **meta),
        row_scale_M=row_scale,
        out_MH=y_TH,
        row_source_M=row_tokens,
        compile_only=True,
    )
    down_fp8(
        torch.empty(capacity, INTERMEDIATE, dtype=torch.float8_e4m3fn, **meta),
        torch.empty(INTERMEDIATE // 64, capacity, dtype=torch.float32, **meta),
        offsets,
        torch.empty(EXPERTS, HIDDEN, INTERMEDIATE, dtype=torch.float8_e4m3fn, **meta),
        torch.empty(EXPERTS, -(-HIDDEN // 128), -(-INTERMEDIATE // 128), **meta),
        row_scale_M=row_scale,
        out_MH=y_TH,
        row_source_M=row_tokens,
        compile_only=True,
    )


def test_rows_added_into_tokens_need_int32_tokens_and_the_tokens_rows():
    hidden_MI, offsets, w2 = meta_down_operands()
    tokens = torch.empty(64, dtype=torch.int32, device="meta")
    with pytest.raises(TypeError, match=r"row_source_M must be int32 \[64\]"):
        down(hidden_MI, offsets, w2, row_source_M=tokens.long(), compile_only=True)
    with pytest.raises(ValueError, match=r"out_MH must be torch.bfloat16 \[9, 2880\]"):
        down(
            hidden_MI,
            offsets,
            w2,
            out_MH=torch.empty(9, 128, dtype=torch.bfloat16, device="meta"),
            row_source_M=tokens,
            compile_only=True,
        )
