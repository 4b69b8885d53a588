"""Compile-only: the router-logits kernel compiles for sm_90a on a CPU for the routers it serves
(every token block, both logits dtypes, with and without a bias), and refuses what it cannot
serve with the reason."""

from __future__ import annotations

import pytest
import torch
from megamoe_kernels.shim import router_logits as router_logits_shim
from megamoe_kernels.shim.router_logits import (
    EXPERT_BLOCKS,
    ROUTER_LOGITS_MAX_TOKENS,
    TOKEN_BLOCKS,
    RouterLogitsLauncher,
    expert_block,
    max_expert_block,
    router_logits_problems,
    token_block,
)

pytestmark = pytest.mark.compile

ROUTERS = [
    dict(num_experts=128, hidden_size=2048),  # qwen3-30b-a3b: two vectors per thread
    dict(num_experts=256, hidden_size=7168),  # dsv3: seven
    dict(num_experts=8, hidden_size=4096, logits_dtype=torch.bfloat16),  # mixtral, bf16 logits
    # gpt-oss: a bf16 bias, 2880 = 2.8 CTA steps (a tail)
    dict(num_experts=128, hidden_size=2880, bias_dtype=torch.bfloat16),
    dict(num_experts=60, hidden_size=8, bias_dtype=torch.float32),  # one vector, most threads idle
]


@pytest.mark.parametrize(
    "constants", ROUTERS, ids=lambda c: f"E{c['num_experts']}-H{c['hidden_size']}"
)
@pytest.mark.parametrize("tokens", [1, 3, 8, ROUTER_LOGITS_MAX_TOKENS])
def test_router_logits_compiles_for_each_token_block(constants, tokens):
    launcher = RouterLogitsLauncher(**constants, compile_only=True)
    assert launcher.compile(tokens) is not None


@pytest.mark.parametrize("block", EXPERT_BLOCKS)
def test_router_logits_compiles_for_each_expert_block(block, monkeypatch):
    monkeypatch.setattr(router_logits_shim, "ROUTER_LOGITS_EXPERT_BLOCK", block)
    launcher = RouterLogitsLauncher(num_experts=60, hidden_size=1000, compile_only=True)
    assert launcher.grid_shape(16) == (8, block, False)  # a 1000-wide row: a vector an expert
    assert launcher.compile(16) is not None


def test_the_expert_block_is_what_the_registers_hold_while_the_grid_keeps_its_ctas():
    # a thread holds ROUTER_LOGITS_HELD_VECTORS weight vectors: ceil(H / 1024) per expert
    assert max_expert_block(128, 2048) == 8  # qwen3-30b-a3b: 2 vectors an expert
    assert max_expert_block(128, 2880) == 4  # gpt-oss-120b: 3
    assert max_expert_block(256, 7168) == 2  # dsv3: 7
    assert max_expert_block(8, 4096) == 4  # mixtral-8x7b: 4
    assert max_expert_block(60, 1000) == 8  # the largest of EXPERT_BLOCKS
    assert max_expert_block(2, 1024) == 2  # no more than E
    assert max_expert_block(1, 16384) == 1  # 16 vectors, one expert
    # as many as keep 128 CTAs (ROUTER_LOGITS_MIN_CTAS): 128 experts x 1, 2, 4, 8, 16 blocks
    tokens = (1, 8, 9, 16, 32, 64, 128)
    assert [expert_block(t, 128, 2048) for t in tokens] == [1, 1, 2, 2, 4, 8, 8]
    assert [expert_block(t, 128, 2880) for t in tokens] == [1, 1, 2, 2, 4, 4, 4]  # at most 4
    assert [expert_block(t, 256, 7168) for t in (1, 16)] == [2, 2]  # dsv3: 2 fit
    assert expert_block(128, 8, 4096) == 1  # mixtral: 8 experts x 16 blocks


def test_the_token_block_is_the_smallest_that_holds_the_tokens():
    tokens = (1, 2, 3, 4, 5, 8, 9, 128)
    assert [token_block(t) for t in tokens] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert TOKEN_BLOCKS[-1] == token_block(ROUTER_LOGITS_MAX_TOKENS)


def test_what_the_kernel_cannot_serve_is_refused_with_the_reason():
    assert router_logits_problems(num_experts=128, hidden_size=2048) == []
    assert "hidden_size=100" in router_logits_problems(num_experts=8, hidden_size=100)[0]
    assert "hidden_size=32768" in router_logits_problems(num_experts=8, hidden_size=32768)[0]
    assert "num_experts=0" in router_logits_problems(num_experts=0, hidden_size=2048)[0]
    with pytest.raises(ValueError, match="logits_dtype=torch.float16"):
        RouterLogitsLauncher(
            num_experts=8, hidden_size=64, logits_dtype=torch.float16, compile_only=True
        )
    with pytest.raises(ValueError, match="bias_dtype=torch.int32"):
        RouterLogitsLauncher(
            num_experts=8, hidden_size=64, bias_dtype=torch.int32, compile_only=True
        )


def test_calls_the_kernel_cannot_take_are_refused_before_a_launch():
    launcher = RouterLogitsLauncher(num_experts=8, hidden_size=64, compile_only=True)
    weight_EH = torch.randn(8, 64).bfloat16()
    too_many = torch.randn(ROUTER_LOGITS_MAX_TOKENS + 1, 64).bfloat16()
    with pytest.raises(ValueError, match=f"at most {ROUTER_LOGITS_MAX_TOKENS}"):
        launcher(too_many, weight_EH)
    with pytest.raises(ValueError, match="bias_E is given"):
        launcher(too_many[:1], weight_EH, bias_E=torch.randn(8))
    empty = launcher(too_many[:0], weight_EH)  # no tokens: no launch
    assert empty.shape == (0, 8) and empty.dtype == torch.float32
