"""Up to how many tokens the router-logits kernel computes a router's logits (CPU: the rule
alone; the GPU tests check the kernel at those sizes)."""

from __future__ import annotations

from megamoe_kernels import ROUTER_LOGITS_MAX_TOKENS, router_logits_faster_tokens
from megamoe_kernels.shim.router_logits import ROUTER_LOGITS_WEIGHT_READ_BYTES, TOKEN_BLOCKS


def test_the_kernel_takes_tokens_while_its_blocks_read_a_few_megabytes_of_weight():
    assert router_logits_faster_tokens(128, 2048) == 64  # qwen3-30b-a3b: 0.5 MB, 8 blocks
    assert router_logits_faster_tokens(128, 2880) == 40  # gpt-oss-120b: 0.7 MB, 5 blocks
    assert router_logits_faster_tokens(8, 4096) == ROUTER_LOGITS_MAX_TOKENS  # mixtral-8x7b
    assert router_logits_faster_tokens(1, 3584) == ROUTER_LOGITS_MAX_TOKENS  # a shared gate


def test_a_router_past_the_bytes_still_takes_one_block():
    block = TOKEN_BLOCKS[-1]
    assert router_logits_faster_tokens(256, 7168) == block  # dsv3: 3.7 MB
    assert router_logits_faster_tokens(1024, 16384) == block  # 32 MB: a GEMM reads it once too
    # the bound in blocks: a weight of exactly half the bytes takes two
    half = ROUTER_LOGITS_WEIGHT_READ_BYTES // 2 // 2  # bf16 elements
    assert router_logits_faster_tokens(1, half) == 2 * block
    assert router_logits_faster_tokens(1, half + 8) == block
