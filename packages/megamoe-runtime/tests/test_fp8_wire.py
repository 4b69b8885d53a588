"""The FP8 wire's arithmetic on a CPU: the pure-torch references the nvshmem kernels are compared
with bit for bit on GPUs (tests/test_multirank_dispatch.py), the knob's checks, the symmetric
buffers an FP8 wire declares, and the dequantized batch bf16 experts take."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from megamoe_kernels.shim.fp8 import dequantize_rows, quantize_rows
from megamoe_runtime import expert_batch
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.dispatch.checks import check_wire_dtypes
from megamoe_runtime.dispatch.reference import exact_combine, owner_partials_combine, wire_values
from megamoe_runtime.expert_batch import ExpertBatch

needs_cutlass = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="CuTe DSL not installed"
)


def relative_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def random_rows(tokens: int, hidden: int, *, seed: int) -> torch.Tensor:
    """Gaussian bf16 rows with an outlier column per row and an all-zero row (its groups take
    the amax floor)."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(tokens, hidden, generator=generator)
    rows[torch.arange(tokens), torch.randint(0, hidden, (tokens,), generator=generator)] *= 40
    rows[tokens // 2] = 0
    return rows.to(torch.bfloat16)


@pytest.mark.parametrize("hidden", [448, 1024])  # 3.5 groups of 128 (a partial one), 8 groups
def test_the_fp8_wire_rounds_each_value_within_e4m3_half_spacing(hidden):
    rows = random_rows(33, hidden, seed=hidden)
    values = wire_values(rows, wire="fp8", dtype=torch.bfloat16)
    _, scales_GT = quantize_rows(rows)
    scale_TH = scales_GT.t().repeat_interleave(128, 1)[:, :hidden]
    exact = rows.float()
    # e4m3 keeps 3 mantissa bits (half a spacing: 2^-4 of the value) down to its subnormals
    # (spacing 2^-9 of the scale); a sliver of slack for the fp32 division and product
    bound = torch.maximum(exact.abs() * 2.0**-4, scale_TH * 2.0**-10) * (1 + 2.0**-20)
    assert ((values - exact).abs() <= bound).all()
    assert (values[rows.shape[0] // 2] == 0).all()
    # and the values are the e4m3 rows times their scales, as quantize_rows leaves them
    assert torch.equal(values, dequantize_rows(*quantize_rows(rows)))


def test_the_bf16_wire_is_the_row_in_bf16():
    rows = torch.randn(5, 64, dtype=torch.float32)
    assert torch.equal(
        wire_values(rows, wire="bf16", dtype=torch.bfloat16), rows.bfloat16().float()
    )
    with pytest.raises(ValueError, match="wire must be 'bf16' or 'fp8', got 'fp16'"):
        wire_values(rows, wire="fp16", dtype=torch.bfloat16)


def stand_in_outputs(x_TH: torch.Tensor, top_k: int) -> torch.Tensor:
    """A different output per (token, k): what K experts could give back."""
    scales = torch.arange(1, top_k + 1, dtype=torch.float32).view(1, top_k, 1)
    return (x_TH.float().unsqueeze(1) * scales + scales).to(x_TH.dtype)


def test_exact_combine_over_the_bf16_wire_is_the_single_gpu_combine():
    tokens, top_k, experts, hidden = 40, 4, 8, 256
    generator = torch.Generator().manual_seed(3)
    x_TH = random_rows(tokens, hidden, seed=3)
    ids_TK = torch.rand(tokens, experts, generator=generator).argsort(1)[:, :top_k].int()
    weights_TK = torch.rand(tokens, top_k, generator=generator)
    local = LocalDispatcher(experts)
    batch, handle = local.dispatch(x_TH, ids_TK, weights_TK)
    # each batch row's output: the stand-in of its (token, k)
    out_TKH = stand_in_outputs(x_TH, top_k)
    row_of_pair = torch.empty(tokens * top_k, dtype=torch.long)
    order = torch.argsort(ids_TK.reshape(-1), stable=True)
    row_of_pair[order] = torch.arange(tokens * top_k)
    out_MH = torch.empty(batch.rows_MH.shape, dtype=torch.bfloat16)
    out_MH[row_of_pair] = out_TKH.reshape(-1, hidden)
    expected = local.combine(out_MH, handle)
    assert torch.equal(exact_combine(out_TKH, weights_TK, dtype=torch.bfloat16), expected)


@pytest.mark.parametrize("hidden", [448, 7168])
def test_the_fp8_combine_changes_the_numbers_within_e4m3_rounding(hidden):
    tokens, top_k, world = 48, 8, 2
    generator = torch.Generator().manual_seed(hidden)
    out_TKH = stand_in_outputs(random_rows(tokens, hidden, seed=hidden + 1), top_k)
    weights_TK = torch.rand(tokens, top_k, generator=generator)
    owner_TK = torch.randint(0, world, (tokens, top_k), generator=generator)
    bf16, fp8 = (
        exact_combine(out_TKH, weights_TK, dtype=torch.bfloat16, wire=wire)
        for wire in ("bf16", "fp8")
    )
    partials_bf16, partials_fp8 = (
        owner_partials_combine(
            out_TKH, weights_TK, owner_TK, world=world, dtype=torch.bfloat16, wire=wire
        )
        for wire in ("bf16", "fp8")
    )
    # a value's e4m3 rounding is at most 2^-4 of it: the sums' relative L2 error stays below
    for fp8_sum, bf16_sum in ((fp8, bf16), (partials_fp8, partials_bf16)):
        error = relative_l2(fp8_sum, bf16_sum)
        assert 0 < error < 2.0**-4, error


def test_owner_partials_over_the_fp8_wire_quantize_each_owners_fp32_sum():
    # one owner, one k: the partial is weight x output in fp32, quantized once, summed alone
    out_TKH = random_rows(6, 256, seed=9).unsqueeze(1)
    weights_TK = torch.rand(6, 1)
    owner_TK = torch.zeros(6, 1, dtype=torch.long)
    y_TH = owner_partials_combine(
        out_TKH, weights_TK, owner_TK, world=2, dtype=torch.bfloat16, wire="fp8"
    )
    partial_TH = weights_TK * out_TKH[:, 0].float()
    assert torch.equal(y_TH, dequantize_rows(*quantize_rows(partial_TH)).bfloat16())


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"dispatch_dtype": "e4m3"},
            r"dispatch_dtype must be one of \('bf16', 'fp8'\), got 'e4m3'",
        ),
        ({"combine_dtype": None}, r"combine_dtype must be one of \('bf16', 'fp8'\), got None"),
        (
            {"combine_dtype": "fp8", "hidden_size": 72},
            "combine_dtype='fp8' needs .* hidden_size=72",
        ),
        ({"dispatch_dtype": "fp8", "hidden_size": 200}, "dispatch_dtype='fp8' needs .*=200"),
    ],
)
def test_wire_dtypes_are_checked(options, message):
    arguments = {"dispatch_dtype": "bf16", "combine_dtype": "bf16", "hidden_size": 7168, **options}
    with pytest.raises(ValueError, match=message):
        check_wire_dtypes(**arguments)


def test_the_torch_dispatcher_factory_checks_the_wire_too():
    from megamoe_runtime.distributed import make_expert_parallel_dispatcher

    with pytest.raises(ValueError, match="dispatch_dtype must be one of"):
        make_expert_parallel_dispatcher(
            "torch",
            num_experts=8,
            top_k=2,
            hidden_size=64,
            dtype=torch.bfloat16,
            device=torch.device("cpu"),
            process_group=None,
            capacity=None,
            max_tokens_per_rank=16,
            dispatch_dtype="int8",
        )


@needs_cutlass
def test_an_fp8_wire_declares_e4m3_rows_with_token_major_scales():
    from megamoe_kernels.shim import ep as ep_kernels
    from megamoe_runtime.dispatch.symmetric_algorithms import (
        PartialSumCombine,
        SmallBatchDispatch,
        StagedDispatch,
        SymmetricSizes,
    )

    world, max_tokens, top_k, hidden = 2, 128, 8, 2880  # 22.5 groups of 128
    group = SymmetricSizes(
        world=world,
        num_experts=64,
        top_k=top_k,
        hidden_size=hidden,
        dtype=torch.bfloat16,
        max_tokens_per_rank=max_tokens,
        capacity=world * max_tokens * top_k,
        fp8_rows=True,
        fp8_combine=True,
    )
    slots, fp8 = world * max_tokens, torch.float8_e4m3fn
    staged = StagedDispatch().buffer_shapes(group)
    assert staged["staged"] == ((slots, hidden), fp8)
    assert staged["staged_scales"] == ((slots, 23), torch.float32)
    partial = PartialSumCombine().buffer_shapes(group)
    assert partial["partials"] == ((slots, hidden), fp8)
    assert partial["partial_scales"] == ((slots, 23), torch.float32)
    # every buffer declared has a row of the kernels' peer table
    layout = ep_kernels.layout()
    declared = {**staged, **partial, **SmallBatchDispatch().buffer_shapes(group)}
    assert set(declared) <= set(layout)
    assert {"row_scales", "returned_scales"} <= set(layout)
    bf16 = StagedDispatch().buffer_shapes(
        SymmetricSizes(**{**group.__dict__, "fp8_rows": False, "fp8_combine": False})
    )
    assert "staged_scales" not in bf16 and bf16["staged"][1] == torch.bfloat16


def fp8_batch(capacity: int, hidden: int, *, seed: int) -> ExpertBatch:
    rows_q, scales_GM = quantize_rows(random_rows(capacity, hidden, seed=seed))
    offsets = torch.tensor([0, 3, capacity - 2, capacity], dtype=torch.int32)
    return ExpertBatch(rows_MH=rows_q, expert_offsets=offsets, row_scales_GM=scales_GM)


def test_a_dequantized_batch_holds_the_bf16_values_of_its_fp8_rows(monkeypatch):
    monkeypatch.setattr(expert_batch, "DEQUANTIZE_CHUNK_ROWS", 3)  # chunks, and a partial last
    batch = fp8_batch(11, 448, seed=4)
    dequantized = batch.dequantized()
    expected = dequantize_rows(batch.rows_MH, batch.row_scales_GM).bfloat16()
    assert dequantized.row_scales_GM is None
    assert torch.equal(dequantized.rows_MH, expected)
    assert dequantized.expert_offsets is batch.expert_offsets
    plain = ExpertBatch(rows_MH=expected, expert_offsets=batch.expert_offsets)
    assert plain.dequantized() is plain


def test_a_dequantized_masked_batch_keeps_its_layout():
    rows_q, scales_GM = quantize_rows(random_rows(12, 256, seed=6))
    counts = torch.tensor([2, 0, 4], dtype=torch.int32)
    masked = ExpertBatch.masked(rows_q.view(3, 4, 256), counts, row_scales_GM=scales_GM)
    dequantized = masked.dequantized()
    assert dequantized.is_masked and dequantized.expert_counts is counts
    assert torch.equal(dequantized.rows_MH, dequantize_rows(rows_q, scales_GM).bfloat16())


def test_bf16_experts_compute_an_fp8_batch_on_its_dequantized_rows():
    from megamoe_runtime.experts.reference import ReferenceExperts
    from megamoe_runtime.weights import Unquantized

    experts, hidden, intermediate = 3, 256, 64
    generator = torch.Generator().manual_seed(8)
    weights = Unquantized(
        w13_E2IH=torch.randn(experts, 2 * intermediate, hidden, generator=generator) * 0.05,
        w2_EHI=torch.randn(experts, hidden, intermediate, generator=generator) * 0.05,
    )
    batch = fp8_batch(16, hidden, seed=5)
    backend = ReferenceExperts()
    prepared = backend.prepare(weights)
    from_fp8 = backend(batch, prepared)
    from_bf16 = backend(batch.dequantized(), prepared)
    # the reference takes the fp32 values; the dequantized batch rounds them to bf16 once
    assert relative_l2(from_bf16, from_fp8) < 2.0**-8
