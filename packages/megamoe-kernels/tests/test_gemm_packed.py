"""Packed weights (shim/weight_packets.py) on an sm_90 GPU: every GEMM gives the bits it gives
on the row-major weights they were packed from.

Each case runs one op twice on one random batch (rows past the valid count NaN, outputs
poisoned): on the row-major weights and on their packed form, and compares every output bit
(the poisoned rows included, so a packed run writes no more than a row-major one), for the
default profiles at decode and prefill batches and for tile families of every kind (decode
column tiles of 64 and 128 rows, 128 x 256 and 2-CTA clusters reading two packets per tile,
pingpong, split-K), bf16 and FP8.
"""

from __future__ import annotations

import pytest
import torch
from gemm_cases import (
    DEVICE,
    expert_offsets,
    has_sm90,
    poisoned,
    random_counts,
    random_rows,
    random_weights,
)
from megamoe_kernels import (
    FP8_DTYPE,
    candidate_knobs,
    down,
    down_fp8,
    gate_up_fp8_launcher,
    gate_up_swiglu,
    gate_up_swiglu_fp8,
    interleave_gate_up,
    pack_weight_tiles,
    quantize_rows,
    quantize_weight_blocks,
)
from megamoe_kernels.shim.weight_packets import PACKED_TILE_COLS

pytestmark = pytest.mark.gpu

if not has_sm90():
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8)


class Problem:
    """One random batch and both layouts of its weights, bf16 or FP8."""

    def __init__(self, counts, hidden, intermediate, *, fp8, capacity=None, seed=0):
        generator = torch.Generator(device=DEVICE).manual_seed(seed)
        experts, self.valid = len(counts), sum(counts)
        self.capacity = self.valid if capacity is None else capacity
        self.fp8 = fp8
        self.offsets = expert_offsets(counts, DEVICE)
        rows = random_rows(generator, self.capacity, hidden, valid=self.valid)
        hidden_rows = random_rows(generator, self.capacity, intermediate, valid=self.valid)
        dtype = torch.float32 if fp8 else torch.bfloat16
        w13 = random_weights(generator, experts, 2 * intermediate, hidden, dtype=dtype)
        w2 = random_weights(generator, experts, hidden, intermediate, dtype=dtype)
        self.w13_scales = self.w2_scales = None
        if fp8:
            w13, self.w13_scales = quantize_weight_blocks(w13)
            w2, self.w2_scales = quantize_weight_blocks(w2)
            self.rows, self.rows_scales = quantize_rows(rows, 128)
            self.hidden, self.hidden_scales = quantize_rows(hidden_rows, 64)
        else:
            self.rows, self.hidden = rows, hidden_rows
        self.w13, self.w2 = interleave_gate_up(w13), w2
        self.w13_packed, self.w13_words = pack_weight_tiles(self.w13, self.w13_scales, gate_up=True)
        self.w2_packed, self.w2_words = pack_weight_tiles(self.w2, self.w2_scales, gate_up=False)

    def gate_up(self, *, packed, knobs=None):
        intermediate = self.hidden.shape[1]
        w13 = self.w13_packed if packed else self.w13
        if self.fp8:
            out = poisoned((self.capacity, intermediate), FP8_DTYPE)
            # the output's scale groups are the launches' (64 or 128 columns)
            group = gate_up_fp8_launcher(self.rows, self.offsets, w13, knobs=knobs).out_group
            scales = poisoned((intermediate // group, self.capacity), torch.float32)
            gate_up_swiglu_fp8(
                self.rows,
                self.rows_scales,
                self.offsets,
                w13,
                self.w13_words if packed else self.w13_scales,
                out_MI=out,
                out_scales=scales,
                knobs=knobs,
            )
            return bits(out), bits(scales)
        out = poisoned((self.capacity, intermediate))
        gate_up_swiglu(self.rows, self.offsets, w13, out_MI=out, knobs=knobs)
        return (bits(out),)

    def down(self, *, packed, knobs=None):
        out = poisoned((self.capacity, self.w2.shape[1]))
        w2 = self.w2_packed if packed else self.w2
        if self.fp8:
            down_fp8(
                self.hidden,
                self.hidden_scales,
                self.offsets,
                w2,
                self.w2_words if packed else self.w2_scales,
                out_MH=out,
                knobs=knobs,
            )
        else:
            down(self.hidden, self.offsets, w2, out_MH=out, knobs=knobs)
        return (bits(out),)


def assert_same_bits(problem, op, knobs=None):
    run = problem.gate_up if op.startswith("gate_up") else problem.down
    row_major = run(packed=False, knobs=knobs)
    packed = run(packed=True, knobs=knobs)
    for a, b in zip(row_major, packed, strict=True):
        assert torch.equal(a, b), f"{op} with {knobs}: packed weights changed the output bits"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("rows_per_expert", [1, 3, 40, 300])
def test_default_profiles_give_the_bits_of_row_major_weights(fp8, rows_per_expert):
    # qwen3-30b-a3b's expert shape: gate-up 1536 x 2048, down 2048 x 768
    counts = random_counts(16, rows_per_expert * 16, seed=rows_per_expert)
    problem = Problem(counts, 2048, 768, fp8=fp8, capacity=sum(counts) + 5)
    assert_same_bits(problem, "gate_up")
    assert_same_bits(problem, "down")


@pytest.mark.parametrize(
    "counts",
    [
        [0, 0, 0, 0],  # zero tokens
        [0, 517, 0, 0],  # one expert takes everything
        [3, 0, 0, 130, 0, 1, 0, 64],  # empty experts between full ones
        [129, 1, 127, 255],  # tails of every tile size
    ],
)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_edge_cases(counts, fp8):
    problem = Problem(counts, 512, 256, fp8=fp8, capacity=sum(counts) + 3)
    assert_same_bits(problem, "gate_up")
    assert_same_bits(problem, "down")


def _sampled_candidates(op: str, every: int) -> list:
    """Every `every`-th candidate of op whose tiles packed weights serve, the deepest ring."""
    knobs = [
        k for k in candidate_knobs(op, stage_choices=("max",)) if k.tile_cols in PACKED_TILE_COLS
    ]
    return knobs[::every]


@pytest.mark.parametrize(
    "op, knobs",
    [(op, knobs) for op in ("gate_up", "down") for knobs in _sampled_candidates(op, 4)]
    + [(op, knobs) for op in ("gate_up_fp8", "down_fp8") for knobs in _sampled_candidates(op, 3)],
    ids=str,
)
def test_tile_families_give_the_bits_of_row_major_weights(op, knobs):
    counts = random_counts(8, 8 * 48, seed=5)
    # K = 1024 for both GEMMs: every split-K candidate has a K tile per slice
    problem = Problem(counts, 1024, 1024, fp8=op.endswith("fp8"), capacity=sum(counts) + 7)
    assert_same_bits(problem, op, knobs)
