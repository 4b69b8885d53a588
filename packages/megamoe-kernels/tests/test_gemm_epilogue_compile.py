"""Compile-only: the bias and clamped-SwiGLU epilogue variants compile for sm_90a on a CPU, for
every tile family, at gpt-oss's dims (H = I = 2880: partial column tiles)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # before CuTe DSL is first imported: without a GPU it would guess another architecture
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass")

from megamoe_kernels import (
    GEGLU,
    GemmKnobs,
    SwiGLU,
    down,
    gate_up_swiglu,
    interleave_gate_up,
    interleave_gate_up_bias,
)

pytestmark = pytest.mark.compile

EXPERTS, HIDDEN, INTERMEDIATE = 8, 2880, 2880
GPT_OSS_SWIGLU = SwiGLU(limit=7.0, alpha=1.702, up_offset=1.0)
META = {"device": "meta", "dtype": torch.bfloat16}


def meta_operands(capacity):
    return (
        torch.empty(capacity, HIDDEN, **META),
        torch.empty(EXPERTS + 1, dtype=torch.int32, device="meta"),
        interleave_gate_up(torch.empty(EXPERTS, 2 * INTERMEDIATE, HIDDEN, **META)),
        interleave_gate_up_bias(torch.empty(EXPERTS, 2 * INTERMEDIATE, **META)),
        torch.empty(EXPERTS, HIDDEN, INTERMEDIATE, **META),
        torch.empty(EXPERTS, HIDDEN, device="meta"),
    )


@pytest.mark.parametrize(
    "knobs",
    [
        None,  # the default launches of a prefill capacity: prefill and decode tiles
        GemmKnobs(tile_rows=128, tile_cols=256, stages=3),
        GemmKnobs(tile_rows=64, tile_cols=256, stages=3, pingpong=True),
        GemmKnobs(tile_rows=128, tile_cols=128, stages=4, cluster=(2, 1)),
        GemmKnobs(tile_rows=32, tile_cols=128, stages=4, swap_ab=True),
        GemmKnobs(tile_rows=16, tile_cols=128, stages=8, swap_ab=True, split_k=4),
    ],
    ids=str,
)
def test_the_biased_clamped_pair_compiles(knobs):
    rows_MH, offsets, w13, w13_bias, w2, w2_bias = meta_operands(512)
    hidden_MI = gate_up_swiglu(
        rows_MH,
        offsets,
        w13,
        knobs=knobs,
        w13_bias_EB2G=w13_bias,
        swiglu=GPT_OSS_SWIGLU,
        compile_only=True,
    )
    scale_M = torch.empty(512, device="meta")
    down(
        hidden_MI,
        offsets,
        w2,
        row_scale_M=scale_M,
        w2_bias_EH=w2_bias,
        knobs=knobs,
        compile_only=True,
    )


def test_the_clamped_swiglu_without_bias_and_a_gathering_biased_gate_up_compile():
    rows_MH, offsets, w13, w13_bias, _, _ = meta_operands(64)
    knobs = GemmKnobs(tile_rows=32, tile_cols=128, stages=4, swap_ab=True)
    gate_up_swiglu(rows_MH, offsets, w13, knobs=knobs, swiglu=GPT_OSS_SWIGLU, compile_only=True)
    softcapped = SwiGLU(gate_softcap=4.0, up_softcap=25.0)  # Inkling2's
    gate_up_swiglu(rows_MH, offsets, w13, swiglu=softcapped, compile_only=True)
    gate_up_swiglu(rows_MH, offsets, w13, knobs=knobs, swiglu=GEGLU, compile_only=True)
    tokens_TH = torch.empty(20, 2944, **META)  # gathered rows: H a multiple of 64
    w13_gather = interleave_gate_up(torch.empty(EXPERTS, 2 * INTERMEDIATE, 2944, **META))
    row_source_M = torch.empty(64, dtype=torch.int32, device="meta")
    gate_up_swiglu(
        tokens_TH,
        offsets,
        w13_gather,
        knobs=knobs,
        row_source_M=row_source_M,
        w13_bias_EB2G=w13_bias,
        swiglu=GPT_OSS_SWIGLU,
        compile_only=True,
    )
