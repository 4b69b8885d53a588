"""`atomic_combine=True`: the fused layer's down GEMM adds each expert output row, weighted, into
its token's row (no combine kernel). Against the same layer's ordered combine and the fp32
oracle, bf16 and FP8 experts, shared experts in the batch and beside it, launched, replayed
from the layer's graphs and captured by a caller; the adds land in no fixed order, so repeated
forwards agree within bf16 roundings, not bit for bit."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from megamoe_kernels.reference import relative_l2_error
from megamoe_torch.cli import fp32_oracle_of
from megamoe_torch.config import MegaMoEConfig
from megamoe_torch.layer import MegaMoE
from test_fused_layer import FAMILIES as FUSED_FAMILIES
from test_fused_layer import check_a_callers_capture

pytestmark = pytest.mark.gpu

FAMILIES = {
    "qwen3": dict(num_experts=32, top_k=8),
    "mixtral": dict(num_experts=8, top_k=2),
    "dsv3_shared_beside": dict(FUSED_FAMILIES["dsv3"], shared_experts_path="side_stream"),
    "qwen2_gated_shared_in_batch": dict(
        FUSED_FAMILIES["qwen2_gated_shared"], shared_experts_path="batch"
    ),
}
# the ordered combine rounds each token's sum once; the adds round after each of its pairs
AGAINST_ORDERED = 1.5e-2


def _layers(family: str, weight_dtype) -> tuple[MegaMoE, MegaMoE]:
    config = MegaMoEConfig(
        hidden_size=512,
        intermediate_size=256,
        backend="cutedsl",
        layer_path="fused",
        weight_dtype=weight_dtype,
        # shared experts in an FP8 batch are FP8 too
        shared_weight_dtype=weight_dtype if FAMILIES[family].get("num_shared_experts") else None,
        atomic_combine=True,
        **FAMILIES[family],
    )
    torch.manual_seed(0)
    atomic = MegaMoE(config, device="cuda", dtype=torch.bfloat16)
    if atomic.e_score_correction_bias is not None:
        atomic.e_score_correction_bias.normal_(0, 0.05)
    ordered = MegaMoE(replace(config, atomic_combine=False), device="cuda", dtype=torch.bfloat16)
    ordered.load_state_dict(atomic.state_dict())
    return atomic, ordered


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("weight_dtype", [None, "fp8"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("tokens", [0, 1, 33, 200, 1500])
@torch.no_grad()
def test_atomic_combine_matches_the_ordered_one(family, weight_dtype, tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    try:
        atomic, ordered = _layers(family, weight_dtype)
    except ValueError as refused:  # a family this precision does not serve
        pytest.skip(str(refused))
    ok, why = atomic.fused_path_status()
    if not ok or atomic.backend != "cutedsl":
        pytest.skip(why)
    assert atomic._combines_atomically() and not ordered._combines_atomically()
    for _ in range(3):  # launched, then (up to 128 tokens) replayed from the layer's graphs
        x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
        y = atomic(x)
        expected = ordered(x)
        assert y.shape == expected.shape
        if tokens:
            assert relative_l2_error(y.float(), expected.float()) < AGAINST_ORDERED
    if not tokens or weight_dtype == "fp8":
        return  # the FP8 layer against its oracle: test_layer_fp8.py
    oracle = fp32_oracle_of(ordered)
    assert relative_l2_error(y.float(), oracle(x.float())) < 2e-2


@pytest.mark.parametrize("tokens", [1, 300])
@torch.no_grad()
def test_a_callers_capture_replays_new_tokens(tokens):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    atomic, ordered = _layers("qwen3", None)
    ok, why = atomic.fused_path_status()
    if not ok or atomic.backend != "cutedsl":
        pytest.skip(why)
    x = torch.randn(tokens, 512, device="cuda", dtype=torch.bfloat16)
    check_a_callers_capture(
        atomic,
        x,
        expected=ordered,
        matches=lambda y, e: relative_l2_error(y.float(), e.float()) < AGAINST_ORDERED,
        replays=2,
    )
