"""What the grouped-GEMM tests on an sm_90 GPU share: random expert batches, NaN-poisoned outputs,
the oracle checks of the bf16 GEMMs, and the cases more than one of them sweeps.

Imported by test_gemm_sm90.py, test_gemm_epilogue_sm90.py, test_gemm_fp8.py, test_gemm_gather.py
and test_gemm_masked.py before their sm_90 skip: nothing here touches a GPU until called.

The conventions every case keeps: rows past the valid count are NaN (they must never reach an
output), outputs start NaN (valid rows must be overwritten, the rest left untouched), and the
valid rows are within rel-L2 TOLERANCE of the fp32 oracle unless a test says otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from megamoe_kernels import (
    FP8_DTYPE,
    GemmKnobs,
    SwiGLU,
    down,
    gate_up_swiglu,
    interleave_gate_up,
    interleave_gate_up_bias,
)
from megamoe_kernels.reference import down_reference, gate_up_swiglu_reference, relative_l2_error
from megamoe_kernels.shim.knobs import default_knobs, max_stages

DEVICE = torch.device("cuda")
TOLERANCE = 1e-2
E4M3_NAN = 0x7F
# counts around every tile size: tails of 1, tile - 1, tile + 1 rows
TAIL_COUNTS = [1, 0, 15, 17, 33, 63, 65, 127, 129, 0, 255, 7]
# (counts, capacity) a GEMM must get right at its edges; a test parametrizes over the values
EDGE_CASES = {
    "no valid rows": ([0, 0, 0, 0], 64),
    "one expert takes all": ([0, 300, 0, 0], 300),
    "most experts empty, capacity past valid": ([0, 0, 5, 0, 0, 0, 0, 1], 32),
    "one expert": ([77], 77),
    "one expert, capacity 13x valid": ([77], 1000),
    "decode: one row per expert": ([1, 1, 1, 1, 1, 1, 1, 1], 8),
    "capacity of one row": ([0, 1, 0, 0], 1),
}


def has_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def with_max_stages(knobs: GemmKnobs, op: str = "gate_up", *, at_most: int | None = None):
    """knobs with the deepest ring that fits op's shared memory (at most `at_most` stages)."""
    stages = max_stages(knobs, op)
    return replace(knobs, stages=stages if at_most is None else min(at_most, stages))


# the gate-up tile families the gathered and the masked batches are swept over
GATE_UP_FAMILIES = {
    "prefill": default_knobs("gate_up", 512),
    "pingpong": with_max_stages(GemmKnobs(tile_rows=64, tile_cols=256, pingpong=True)),
    "cluster": with_max_stages(GemmKnobs(tile_rows=128, tile_cols=256, cluster=(2, 1))),
    "decode split-K": with_max_stages(
        GemmKnobs(tile_rows=16, tile_cols=64, swap_ab=True, split_k=4)
    ),
}


def random_counts(experts: int, rows: int, seed: int) -> list[int]:
    """Rows per expert when each of `rows` rows picks an expert uniformly at random."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, experts, (rows,), generator=generator)
    return torch.bincount(ids, minlength=experts).tolist()


def expert_offsets(counts: list[int], device: torch.device | None = None) -> torch.Tensor:
    """int32 [E + 1]: where each expert's rows start in a tight batch of `counts` rows."""
    offsets = torch.zeros(len(counts) + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.tensor(counts), 0)
    return offsets if device is None else offsets.to(device)


def random_weights(
    generator: torch.Generator,
    experts: int,
    rows: int,
    depth: int,
    *,
    gain: float = 1.0,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """[experts, rows, depth] of N(0, gain^2 / depth): outputs of about gain for unit inputs."""
    weights = torch.randn(experts, rows, depth, device=DEVICE, generator=generator)
    return (weights * gain / depth**0.5).to(dtype)


def random_rows(generator: torch.Generator, capacity: int, hidden: int, *, valid: int):
    """bf16 [capacity, hidden] of N(0, 1), NaN past the first `valid` rows."""
    rows_MH = torch.randn(capacity, hidden, device=DEVICE, generator=generator).bfloat16()
    rows_MH[valid:] = float("nan")
    return rows_MH


def make_problem(
    counts: list[int],
    hidden: int,
    intermediate: int,
    *,
    capacity: int | None = None,
    seed: int = 0,
    gate_up_gain: float = 1.0,
    generator: torch.Generator | None = None,
):
    """A tight bf16 expert batch: (rows [capacity, H], offsets [E + 1], w13 [E, 2I, H] before the
    interleave, w2 [E, H, I], valid rows). Drawn from `generator` where one is given (a caller
    drawing more after it), else from a fresh one seeded with `seed`."""
    if generator is None:
        generator = torch.Generator(device=DEVICE).manual_seed(seed)
    valid = sum(counts)
    capacity = valid if capacity is None else capacity
    rows_MH = random_rows(generator, capacity, hidden, valid=valid)
    w13_E2IH = random_weights(generator, len(counts), 2 * intermediate, hidden, gain=gate_up_gain)
    w2_EHI = random_weights(generator, len(counts), hidden, intermediate)
    return rows_MH, expert_offsets(counts, DEVICE), w13_E2IH, w2_EHI, valid


def poisoned(shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An output buffer of NaN (e4m3's NaN bits for FP8)."""
    if dtype == FP8_DTYPE:
        return torch.full(shape, E4M3_NAN, dtype=torch.uint8, device=DEVICE).view(FP8_DTYPE)
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def assert_valid_rows_match(
    out_MX: torch.Tensor,
    expected_MX: torch.Tensor,
    valid: int,
    *,
    what: str,
    tolerance: float = TOLERANCE,
) -> None:
    """The first `valid` rows within rel-L2 `tolerance` of the oracle's, the rest still NaN."""
    error = relative_l2_error(out_MX[:valid], expected_MX[:valid])
    assert error <= tolerance, f"{what}: rel-L2 {error}"
    assert torch.isnan(out_MX[valid:].float()).all(), f"{what} wrote rows past the valid count"


def check_gate_up(
    rows_MH,
    offsets,
    w13_E2IH,
    valid,
    *,
    knobs=None,
    tuned_knobs=None,
    w13_bias_E2I=None,
    swiglu=None,
):
    """gate_up_swiglu into a poisoned output against gate_up_swiglu_reference; the output."""
    capacity, intermediate = rows_MH.shape[0], w13_E2IH.shape[1] // 2
    out_MI = poisoned((capacity, intermediate))
    gate_up_swiglu(
        rows_MH,
        offsets,
        interleave_gate_up(w13_E2IH),
        out_MI=out_MI,
        knobs=knobs,
        tuned_knobs=tuned_knobs,
        w13_bias_EB2G=None if w13_bias_E2I is None else interleave_gate_up_bias(w13_bias_E2I),
        swiglu=swiglu,
    )
    activation = SwiGLU() if swiglu is None else swiglu
    expected = gate_up_swiglu_reference(
        rows_MH,
        offsets,
        w13_E2IH,
        w13_bias_E2I=w13_bias_E2I,
        **activation.constants(),
    )
    assert_valid_rows_match(out_MI, expected, valid, what=f"gate_up with {knobs}, {activation}")
    return out_MI


def check_down(
    hidden_MI,
    offsets,
    w2_EHI,
    valid,
    *,
    row_scale_M=None,
    knobs=None,
    tuned_knobs=None,
    w2_bias_EH=None,
):
    """down into a poisoned output against down_reference; the output. w2_bias_EH is bf16 as a
    layer holds it: the kernel takes it as float32."""
    capacity, hidden = hidden_MI.shape[0], w2_EHI.shape[1]
    out_MH = poisoned((capacity, hidden))
    down(
        hidden_MI,
        offsets,
        w2_EHI,
        row_scale_M=row_scale_M,
        out_MH=out_MH,
        knobs=knobs,
        tuned_knobs=tuned_knobs,
        w2_bias_EH=None if w2_bias_EH is None else w2_bias_EH.float(),
    )
    expected = down_reference(hidden_MI, offsets, w2_EHI, row_scale_M, w2_bias_EH=w2_bias_EH)
    assert_valid_rows_match(out_MH, expected, valid, what=f"down with {knobs}")
    return out_MH


def replay_with_counts(
    graph: torch.cuda.CUDAGraph,
    out_MH: torch.Tensor,
    offsets: torch.Tensor,
    counts: list[int],
    oracle: Callable[[], torch.Tensor],
) -> None:
    """Routes `counts` into the captured offsets, replays `graph` over a poisoned out_MH, and
    checks it against oracle() (computed after the replay, on the new offsets)."""
    offsets.copy_(expert_offsets(counts))
    out_MH.fill_(float("nan"))
    graph.replay()
    assert_valid_rows_match(out_MH, oracle(), sum(counts), what=f"replay with counts {counts}")
