"""Compile-only: the gate-up GEMMs reading w13 as the model holds it ([E, 2I, H], no interleaved
copy) compile for sm_90a on a CPU, bf16 and FP8, at every default profile and the knob variants
(decode tiles with split K, pingpong, 2-CTA clusters, gathered rows, masked batches, published
offsets), and where the last tile runs past I's blocks (gpt-oss's I, 192-column tiles); a w13
of no whole blocks is refused naming the layouts; the compiled signature takes a gate-up bias in
the kernel's (interleaved) order with either w13.

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
    GemmKnobs,
    SwiGLU,
    default_knobs,
    gate_up_fp8_launcher,
    gate_up_launcher,
    gate_up_swiglu,
)
from megamoe_kernels.shim.expert_gemm import _launches, published_offsets_buffer
from megamoe_kernels.shim.knobs import PROFILE_ROWS_PER_EXPERT

pytestmark = pytest.mark.compile

# qwen3-30b-a3b's expert dims (I = 6 x 128) over fewer experts
EXPERTS, HIDDEN, INTERMEDIATE = 8, 2048, 768


def operands(rows: int, dtype: torch.dtype = torch.bfloat16, intermediate: int = INTERMEDIATE):
    """(rows, offsets, w13 [E, 2I, H] as the model holds it) as meta tensors."""
    meta = {"device": "meta", "dtype": dtype}
    return (
        torch.empty(rows, HIDDEN, **meta),
        torch.empty(EXPERTS + 1, dtype=torch.int32, device="meta"),
        torch.empty(EXPERTS, 2 * intermediate, HIDDEN, **meta),
    )


@pytest.mark.parametrize("rows_per_expert", PROFILE_ROWS_PER_EXPERT)
def test_every_default_gate_up_profile_compiles_on_the_models_w13(rows_per_expert):
    rows = max(1, int(rows_per_expert * EXPERTS))
    rows_MH, offsets, w13 = operands(rows)
    out = gate_up_swiglu(rows_MH, offsets, w13, compile_only=True)
    assert out.shape == (rows, INTERMEDIATE)
    rows_MH, offsets, w13 = operands(rows, FP8_DTYPE)
    knobs = default_knobs("gate_up_fp8", rows_per_expert)
    gate_up_fp8_launcher(rows_MH, offsets, w13, knobs=knobs, compile_only=True)


@pytest.mark.parametrize(
    "knobs",
    [
        GemmKnobs(tile_rows=16, tile_cols=64, stages=8, swap_ab=True),
        GemmKnobs(tile_rows=16, tile_cols=128, stages=8, swap_ab=True, split_k=4),
        GemmKnobs(tile_rows=64, tile_cols=256, stages=3, pingpong=True),
        GemmKnobs(tile_rows=128, tile_cols=128, stages=5, pingpong=True),
        GemmKnobs(tile_rows=128, tile_cols=256, stages=3, cluster=(2, 1)),
    ],
    ids=str,
)
def test_the_knob_variants_compile_on_the_models_w13(knobs):
    rows_MH, offsets, w13 = operands(64 * EXPERTS)
    gate_up_swiglu(rows_MH, offsets, w13, knobs=knobs, compile_only=True)


def test_gathered_masked_and_polling_gate_ups_compile_on_the_models_w13():
    rows_MH, offsets, w13 = operands(16)
    counts = torch.empty(EXPERTS, dtype=torch.int32, device="meta")
    gate_up_swiglu(rows_MH, offsets, w13, expert_counts=counts, compile_only=True)
    source_M = torch.empty(16, dtype=torch.int32, device="meta")
    tokens_TH = torch.empty(4, HIDDEN, device="meta", dtype=torch.bfloat16)
    gate_up_swiglu(tokens_TH, offsets, w13, row_source_M=source_M, compile_only=True)
    published = published_offsets_buffer(EXPERTS + 1, device="meta")
    launcher = gate_up_launcher(
        rows_MH[:8], published, w13, valid_rows=8, offsets_published=True, compile_only=True
    )
    assert launcher.knobs.swap_ab


def test_tiles_past_the_last_block_compile_on_the_models_w13():
    # gpt-oss-120b's I = 2880 is 360 blocks of 8 gate and 8 up rows: a 256-row tile takes 16,
    # so its last prefill tile takes 8 and the TMA fills the rest with zeros; with its bias and
    # clamped SwiGLU, at decode and prefill
    swiglu = SwiGLU(limit=7.0, alpha=1.702, up_offset=1.0)
    for rows in (8, 512 * EXPERTS):
        rows_MH, offsets, w13 = operands(rows, intermediate=2880)
        bias = torch.empty(EXPERTS, 2880 // 8, 16, device="meta")
        out = gate_up_swiglu(
            rows_MH, offsets, w13, w13_bias_EB2G=bias, swiglu=swiglu, compile_only=True
        )
        assert out.shape == (rows, 2880)
    # 192 columns are 12 blocks: I = 2048 has 256, the last tile takes 4
    rows_MH, offsets, w13 = operands(512 * EXPERTS, intermediate=2048)
    wide = GemmKnobs(tile_rows=128, tile_cols=192, stages=4)
    gate_up_swiglu(rows_MH, offsets, w13, knobs=wide, compile_only=True)
    launches = _launches(
        "gate_up", None, wide, (512 * EXPERTS, HIDDEN), (EXPERTS, 4096, HIDDEN), None, -1
    )
    assert any(launch.knobs.tile_cols == 192 for launch in launches), launches


def test_a_w13_of_no_whole_blocks_is_refused_naming_the_layouts():
    rows_MH, offsets, w13 = operands(64, intermediate=12)  # 12 gate rows: a block and a half
    with pytest.raises(ValueError, match=r"I a multiple of 8.*interleave_gate_up"):
        gate_up_swiglu(rows_MH, offsets, w13, compile_only=True)


def test_a_gate_up_bias_is_signed_in_the_kernels_order_whichever_order_w13_is_in(monkeypatch):
    # the runtime passes interleave_gate_up_bias's [E, I/8, 16] with either w13: the compiled
    # signature must take that shape (a model-order one once took [E, 2I], and TVM-FFI refused
    # every biased call); the down GEMM's bias stays [E, H]
    from megamoe_kernels.shim import ffi_launch

    signed = {}
    monkeypatch.setattr(
        ffi_launch.cute, "compile", lambda launch, *args, **options: signed.update(args=args)
    )
    common = dict(has_row_scale=False, split_k=1, dynamic_schedule=False, has_bias=True)
    interleaved = (EXPERTS, INTERMEDIATE // 8, 16, HIDDEN)
    for weight_shape in ((EXPERTS, 2 * INTERMEDIATE, HIDDEN), interleaved):
        ffi_launch.compile_stored_weight_launch(
            [],
            weight_shape=weight_shape,
            n=2 * INTERMEDIATE,
            k=HIDDEN,
            n_out=INTERMEDIATE,
            **common,
        )
        assert tuple(signed["args"][13].shape) == (EXPERTS, INTERMEDIATE // 8, 16), weight_shape
    ffi_launch.compile_stored_weight_launch(
        [],
        weight_shape=(EXPERTS, HIDDEN, INTERMEDIATE),
        n=HIDDEN,
        k=INTERMEDIATE,
        n_out=HIDDEN,
        **common,
    )
    assert tuple(signed["args"][13].shape) == (EXPERTS, HIDDEN)
