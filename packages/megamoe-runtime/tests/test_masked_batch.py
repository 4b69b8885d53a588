"""The masked expert batch (a receive buffer read in place: per-expert counts at a fixed stride)
against the tight batch of the same rows, on every backend that takes it, and its refusals.

The rows past each expert's count are NaN: a backend that lets one reach a valid output fails.
"""

from __future__ import annotations

import pytest
import torch
from megamoe_kernels.reference import expert_mlp_reference, relative_l2_error
from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.experts import make_backend
from megamoe_runtime.weights import Unquantized, quantize

E, STRIDE, H, INTER = 4, 24, 128, 64


def random_weights(dtype: torch.dtype, seed: int = 0) -> Unquantized:
    generator = torch.Generator().manual_seed(seed)
    return Unquantized(
        w13_E2IH=(torch.randn(E, 2 * INTER, H, generator=generator) / H**0.5).to(dtype),
        w2_EHI=(torch.randn(E, H, INTER, generator=generator) / INTER**0.5).to(dtype),
    )


def masked_and_tight(counts: list[int], dtype: torch.dtype, seed: int = 1):
    """A masked batch whose unspecified rows are NaN, and the tight batch of its valid rows."""
    generator = torch.Generator().manual_seed(seed)
    rows_ESH = torch.full((E, STRIDE, H), float("nan"), dtype=dtype)
    for expert, count in enumerate(counts):
        rows_ESH[expert, :count] = torch.randn(count, H, generator=generator).to(dtype)
    expert_counts = torch.tensor(counts, dtype=torch.int32)
    masked = ExpertBatch.masked(rows_ESH, expert_counts)
    tight_rows = torch.cat([rows_ESH[expert, :count] for expert, count in enumerate(counts)])
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    return masked, ExpertBatch(rows_MH=tight_rows, expert_offsets=offsets)


def valid_rows_of(out_MH: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out_ESH = out_MH.view(E, STRIDE, -1)
    return torch.cat([out_ESH[expert, :count] for expert, count in enumerate(counts)])


# skewed: one expert fills its stride, one gets nothing, one a single row
COUNTS = [[STRIDE, 0, 1, 13], [0, 0, 0, 0], [5, 7, STRIDE, 2]]


def test_masked_layout_describes_starts_stride_and_counts():
    masked, _ = masked_and_tight([3, 0, STRIDE, 9], torch.float32)
    assert masked.is_masked and masked.expert_stride == STRIDE
    assert masked.capacity == E * STRIDE and masked.num_experts == E
    assert masked.expert_offsets.tolist() == [e * STRIDE for e in range(E + 1)]
    assert int(masked.num_valid_rows) == 3 + STRIDE + 9
    # the rows are the buffer, not a copy
    assert masked.rows_MH.data_ptr() == masked.rows_MH.view(E, STRIDE, H).data_ptr()


@pytest.mark.parametrize("counts", COUNTS)
def test_reference_backend_computes_masked_rows_as_the_tight_batch_does(counts):
    weights = random_weights(torch.float32)
    masked, tight = masked_and_tight(counts, torch.float32)
    backend = make_backend("reference")
    prepared = backend.prepare(weights)
    out_masked = backend(masked, prepared)
    out_tight = backend(tight, prepared)
    torch.testing.assert_close(valid_rows_of(out_masked, counts), out_tight)
    # rows past each count are never read (the NaNs there reach nothing) and come back zero
    valid = torch.arange(STRIDE)[None, :] < torch.tensor(counts)[:, None]
    assert (out_masked.view(E, STRIDE, H)[~valid] == 0).all()


def test_reference_backend_applies_row_scales_to_masked_rows():
    counts = [STRIDE, 3, 0, 11]
    weights = random_weights(torch.float32)
    masked, tight = masked_and_tight(counts, torch.float32)
    scale_M = torch.rand(E * STRIDE, generator=torch.Generator().manual_seed(4))
    backend = make_backend("reference")
    prepared = backend.prepare(weights)
    out = backend(masked, prepared, row_scale_M=scale_M)
    expected = backend(tight, prepared, row_scale_M=valid_rows_of(scale_M[:, None], counts)[:, 0])
    torch.testing.assert_close(valid_rows_of(out, counts), expected)


def test_reference_backend_computes_fp8_masked_rows_on_their_dequantized_values():
    from megamoe_kernels import quantize_rows

    counts = [2, STRIDE, 0, 7]
    masked, _ = masked_and_tight(counts, torch.float32)
    finite_rows = torch.nan_to_num(masked.rows_MH, nan=0.0)
    rows_q, scales_GM = quantize_rows(finite_rows)
    fp8 = ExpertBatch.masked(
        rows_q.view(E, STRIDE, H), masked.expert_counts, row_scales_GM=scales_GM
    )
    backend = make_backend("reference")
    pack = quantize(random_weights(torch.float32, seed=3))
    out = backend(fp8, backend.prepare(pack))
    assert out.dtype == torch.bfloat16
    from megamoe_kernels import dequantize_rows
    from megamoe_runtime.weights import dequantize

    exact = dequantize(pack)
    expected = expert_mlp_reference(
        dequantize_rows(rows_q, scales_GM),
        fp8.expert_offsets,
        exact.w13_E2IH,
        exact.w2_EHI,
        expert_counts=fp8.expert_counts,
    )
    assert relative_l2_error(valid_rows_of(out, counts), valid_rows_of(expected, counts)) < 1e-2


def grouped_mm_runs_on_cpu() -> bool:
    try:
        torch._grouped_mm(
            torch.zeros(2, 8, 16, dtype=torch.bfloat16),
            torch.zeros(2, 16, 16, dtype=torch.bfloat16),
        )
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


@pytest.mark.skipif(not grouped_mm_runs_on_cpu(), reason="this torch has no CPU torch._grouped_mm")
@pytest.mark.parametrize("counts", COUNTS)
def test_grouped_mm_backend_computes_masked_rows_as_the_tight_batch_does(counts):
    # the backend itself (its device check is the layer's business): the CPU fallback of
    # torch._grouped_mm runs the same 3-D and offsets forms the GPU does
    weights = random_weights(torch.bfloat16)
    masked, tight = masked_and_tight(counts, torch.bfloat16)
    backend = make_backend("grouped_mm")
    prepared = backend.prepare(weights)
    out_masked = valid_rows_of(backend(masked, prepared), counts)
    out_tight = backend(tight, prepared)
    assert torch.isfinite(out_masked).all()  # no NaN from the unspecified rows
    oracle = expert_mlp_reference(tight.rows_MH, tight.expert_offsets, *weights_fp32(weights))
    assert relative_l2_error(out_masked, oracle) < 1e-2
    assert relative_l2_error(out_tight, oracle) < 1e-2


def weights_fp32(weights: Unquantized) -> tuple[torch.Tensor, torch.Tensor]:
    return weights.w13_E2IH.float(), weights.w2_EHI.float()


@pytest.mark.gpu
@pytest.mark.parametrize("counts", COUNTS)
def test_cutedsl_computes_masked_rows_as_the_tight_batch_does(counts):
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("needs an sm_90 GPU")
    weights = random_weights(torch.bfloat16)
    masked, tight = masked_and_tight(counts, torch.bfloat16)
    to_gpu = {"device": "cuda"}
    masked = ExpertBatch.masked(
        masked.rows_MH.view(E, STRIDE, H).to(**to_gpu), masked.expert_counts.to(**to_gpu)
    )
    tight = ExpertBatch(
        rows_MH=tight.rows_MH.to(**to_gpu), expert_offsets=tight.expert_offsets.to(**to_gpu)
    )
    backend = make_backend("cutedsl")
    prepared = backend.prepare(
        Unquantized(weights.w13_E2IH.to(**to_gpu), weights.w2_EHI.to(**to_gpu))
    )
    out_masked = valid_rows_of(backend(masked, prepared), counts)
    out_tight = backend(tight, prepared)
    assert torch.isfinite(out_masked).all()  # no NaN from the unspecified rows
    oracle = expert_mlp_reference(
        tight.rows_MH.float().cpu(), tight.expert_offsets.cpu(), *weights_fp32(weights)
    )
    assert relative_l2_error(out_masked.float().cpu(), oracle) < 1e-2
    assert relative_l2_error(out_tight.float().cpu(), oracle) < 1e-2


def test_bad_masked_batches_are_refused_naming_the_argument():
    rows_ESH = torch.randn(E, STRIDE, H)
    with pytest.raises(ValueError, match=r"expert_counts must be int32 \[4\]"):
        ExpertBatch.masked(rows_ESH, torch.zeros(E, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"expert_counts must be int32 \[4\]"):
        ExpertBatch.masked(rows_ESH, torch.zeros(E + 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="rows_ESH must be a contiguous"):
        ExpertBatch.masked(rows_ESH.transpose(0, 1), torch.zeros(STRIDE, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple of its 4 experts"):
        ExpertBatch(
            rows_MH=torch.randn(E * STRIDE + 1, H),
            expert_offsets=torch.arange(E + 1, dtype=torch.int32) * STRIDE,
            expert_counts=torch.zeros(E, dtype=torch.int32),
        )
    # a count beyond the stride is refused by the oracle, which reads the counts
    masked = ExpertBatch.masked(rows_ESH, torch.tensor([1, STRIDE + 1, 0, 0], dtype=torch.int32))
    backend = make_backend("reference")
    with pytest.raises(ValueError, match=r"expert_counts\[1\] = 25 must lie in \[0, 24\]"):
        backend(masked, backend.prepare(random_weights(torch.float32)))


def test_backend_choice_for_masked_batches_keeps_every_backend():
    from megamoe_runtime.experts import backend_status

    # the masked layout runs on every backend: only the device decides
    for name in ("cutedsl", "grouped_mm", "reference"):
        assert backend_status(name, torch.device("cpu"), masked_batches=True) == backend_status(
            name, torch.device("cpu")
        )


def test_backend_choice_for_fp8_rows_keeps_every_backend():
    from megamoe_runtime.experts import _batch_refusal, select_backend

    # FP8 rows run on every backend (bf16 experts dequantize them): they refuse none that the
    # weights and the expert math alone would not
    for name in ("cutedsl", "grouped_mm", "reference"):
        for fp8_weights in (False, True):
            for expert_math in ((), ("expert biases",)):
                choice = {"masked_batches": False, "fp8_weights": fp8_weights}
                choice["expert_math"] = expert_math
                assert _batch_refusal(name, fp8_rows=True, **choice) == _batch_refusal(
                    name, fp8_rows=False, **choice
                )
    assert select_backend("auto", torch.device("cpu"), fp8_rows=True) == select_backend(
        "auto", torch.device("cpu")
    )
