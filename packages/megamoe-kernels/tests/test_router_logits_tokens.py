"""Up to how many tokens the router-logits kernel computes a router's logits, and with what
grid (CPU: the rules alone; the GPU tests check the kernel at those sizes)."""

from __future__ import annotations

from megamoe_kernels import ROUTER_LOGITS_MAX_TOKENS, router_logits_faster_tokens
from megamoe_kernels.shim.router_logits import (
    ROUTER_LOGITS_READ_BYTES,
    TOKEN_BLOCKS,
    grid_shape,
    router_logits_read_bytes,
)

BLOCK = TOKEN_BLOCKS[-1]


def test_the_kernel_takes_tokens_while_a_launch_reads_a_few_tens_of_megabytes():
    assert router_logits_faster_tokens(128, 2048) == ROUTER_LOGITS_MAX_TOKENS  # qwen3-30b-a3b
    assert router_logits_faster_tokens(128, 2880) == ROUTER_LOGITS_MAX_TOKENS  # gpt-oss-120b
    assert router_logits_faster_tokens(8, 4096) == ROUTER_LOGITS_MAX_TOKENS  # mixtral-8x7b
    assert router_logits_faster_tokens(1, 3584) == ROUTER_LOGITS_MAX_TOKENS  # a shared gate
    assert router_logits_faster_tokens(256, 7168) == 2 * BLOCK  # dsv3: 35 MiB at 16 tokens


def test_a_router_past_the_bytes_still_takes_one_block():
    assert router_logits_read_bytes(BLOCK, 1024, 16384) > ROUTER_LOGITS_READ_BYTES
    assert router_logits_faster_tokens(1024, 16384) == BLOCK  # 32 MB: a GEMM reads it once too


def test_a_launch_reads_the_weight_per_token_block_and_the_tokens_per_cta():
    weight_row, token_row = 2048 * 2, 2048 * 2
    # 8 tokens: 128 CTAs of one expert, each reading 8 token rows
    assert router_logits_read_bytes(8, 128, 2048) == 128 * weight_row + 128 * 8 * token_row
    # 128 tokens: 16 token blocks; 16 CTAs of 8 experts a block, each reading 8 token rows
    assert router_logits_read_bytes(128, 128, 2048) == 16 * 128 * weight_row + 16 * 128 * token_row


def test_decode_grids_schedule_the_routing_kernel_at_their_top():
    for tokens, block in ((1, 1), (2, 2), (3, 4), (8, 8)):
        assert grid_shape(tokens, 128, 2048) == (block, 1, True)
    for tokens, experts_block in ((9, 2), (64, 8), (ROUTER_LOGITS_MAX_TOKENS, 8)):
        assert grid_shape(tokens, 128, 2048) == (BLOCK, experts_block, False)


def test_the_bound_is_the_last_token_block_up_to_which_every_launch_reads_within_the_bytes():
    for experts, hidden in ((256, 7168), (160, 5120), (64, 7168), (384, 7168), (128, 4096)):
        bound = router_logits_faster_tokens(experts, hidden)
        assert bound % BLOCK == 0 and BLOCK <= bound <= ROUTER_LOGITS_MAX_TOKENS
        if bound > BLOCK:
            for tokens in range(1, bound + 1):
                read = router_logits_read_bytes(tokens, experts, hidden)
                assert read <= ROUTER_LOGITS_READ_BYTES, (experts, hidden, tokens)
        if bound < ROUTER_LOGITS_MAX_TOKENS:
            beyond = bound + BLOCK
            assert router_logits_read_bytes(beyond, experts, hidden) > ROUTER_LOGITS_READ_BYTES
