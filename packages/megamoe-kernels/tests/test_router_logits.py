"""The router-logits kernel against the float64 oracle x @ W^T (+ bias): fp32 summation-order
differences only, bit-identical on every launch, in a CUDA graph with new tokens between
replays, and chained to the routing kernel by programmatic dependent launch."""

from __future__ import annotations

import pytest
import torch
from gemm_cases import has_sm90
from megamoe_kernels import ROUTER_LOGITS_MAX_TOKENS, RouterLogitsLauncher
from megamoe_kernels.shim import router_logits as router_logits_shim
from megamoe_kernels.shim.local_layer import RouteLauncher
from megamoe_kernels.shim.router_logits import EXPERT_BLOCKS, max_expert_block

pytestmark = pytest.mark.gpu

if not has_sm90():
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

# an fp32 sum of n products is within n x 2^-24 x sum |products| of the exact one; the kernel's
# longest chain (a thread's 8 x ceil(H / 1024) products, 5 shuffle levels, 4 warps) is under 150
# terms up to H = 16384
RELATIVE_TO_ABS_SUM = 1e-5

# (E, H): qwen3-30b-a3b, dsv3, mixtral-8x7b, gpt-oss-120b (2880: a tail of 0.8 CTA steps), odd
ROUTERS = {
    "qwen3": (128, 2048),
    "dsv3": (256, 7168),
    "mixtral": (8, 4096),
    "gpt-oss": (128, 2880),
    "odd": (60, 1000),
    "one-vector": (8, 8),
}


def _random(shape, *, seed, dtype=torch.bfloat16):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, generator=generator, device="cuda").to(dtype)


def _assert_matches_oracle(logits_TE, x_TH, weight_EH, bias_E=None):
    exact = x_TH.double() @ weight_EH.double().t()
    abs_sum = x_TH.double().abs() @ weight_EH.double().abs().t()
    if bias_E is not None:
        exact = exact.float().double() + bias_E.double()  # the kernel adds the bias in fp32
        abs_sum = abs_sum + bias_E.double().abs()
    allowed = RELATIVE_TO_ABS_SUM * abs_sum + 1e-30
    if logits_TE.dtype == torch.bfloat16:
        allowed = allowed + exact.abs() * 2.0**-8  # half a bf16 ulp
    error = (logits_TE.double() - exact).abs()
    assert torch.isfinite(logits_TE).all()
    assert (error <= allowed).all(), f"worst error / allowed {(error / allowed).max().item()}"


@pytest.mark.parametrize("router", sorted(ROUTERS))
@pytest.mark.parametrize("tokens", [1, 3, 8, 13, ROUTER_LOGITS_MAX_TOKENS])
@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_match_the_oracle(router, tokens, logits_dtype):
    experts, hidden = ROUTERS[router]
    launcher = RouterLogitsLauncher(
        num_experts=experts, hidden_size=hidden, logits_dtype=logits_dtype, device="cuda"
    )
    x_TH = _random((tokens, hidden), seed=tokens)
    weight_EH = _random((experts, hidden), seed=experts + hidden) * 0.05
    logits_TE = launcher(x_TH, weight_EH)
    assert logits_TE.shape == (tokens, experts) and logits_TE.dtype == logits_dtype
    _assert_matches_oracle(logits_TE, x_TH, weight_EH)


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_the_bias_is_added_after_the_sum(bias_dtype, tokens):
    experts, hidden = ROUTERS["gpt-oss"]
    launcher = RouterLogitsLauncher(
        num_experts=experts, hidden_size=hidden, bias_dtype=bias_dtype, device="cuda"
    )
    x_TH = _random((tokens, hidden), seed=3)
    weight_EH = _random((experts, hidden), seed=4) * 0.05
    bias_E = _random((experts,), seed=5, dtype=bias_dtype)
    _assert_matches_oracle(launcher(x_TH, weight_EH, bias_E=bias_E), x_TH, weight_EH, bias_E)


def test_every_logit_is_written_and_nothing_else():
    experts, hidden = ROUTERS["odd"]
    launcher = RouterLogitsLauncher(num_experts=experts, hidden_size=hidden, device="cuda")
    x_TH = _random((ROUTER_LOGITS_MAX_TOKENS, hidden), seed=7)
    weight_EH = _random((experts, hidden), seed=8)
    for tokens in (1, 2, 3, 9, ROUTER_LOGITS_MAX_TOKENS):
        # poison what the caching allocator hands out next: the kernel must overwrite all of it
        torch.full((tokens, experts), float("nan"), device="cuda")
        logits_TE = launcher(x_TH[:tokens], weight_EH)
        _assert_matches_oracle(logits_TE, x_TH[:tokens], weight_EH)
    empty = launcher(x_TH[:0], weight_EH)
    assert empty.shape == (0, experts)


@pytest.mark.parametrize("router", sorted(ROUTERS))
@pytest.mark.parametrize("tokens", [1, 13, ROUTER_LOGITS_MAX_TOKENS])
def test_every_expert_block_gives_the_same_bits(router, tokens, monkeypatch):
    """A CTA of several experts sums each logit in the order a CTA of one does: the same bits
    (and the oracle's logits) whatever experts per CTA the rule or a tuner picks."""
    experts, hidden = ROUTERS[router]
    launcher = RouterLogitsLauncher(
        num_experts=experts, hidden_size=hidden, bias_dtype=torch.float32, device="cuda"
    )
    x_TH = _random((tokens, hidden), seed=41)
    weight_EH = _random((experts, hidden), seed=42) * 0.05
    bias_E = _random((experts,), seed=43, dtype=torch.float32)
    by_block = {}
    for block in EXPERT_BLOCKS:
        monkeypatch.setattr(router_logits_shim, "ROUTER_LOGITS_EXPERT_BLOCK", block)
        taken = launcher.grid_shape(tokens)[1]
        if taken not in by_block:
            torch.full((tokens, experts), float("nan"), device="cuda")  # poison the next output
            by_block[taken] = launcher(x_TH, weight_EH, bias_E=bias_E)
    assert max(by_block) == max_expert_block(experts, hidden)
    first = by_block[1]
    _assert_matches_oracle(first, x_TH, weight_EH, bias_E)
    for block, logits_TE in by_block.items():
        assert torch.equal(logits_TE, first), f"{block} experts a CTA"


def test_repeated_launches_give_the_same_bits():
    experts, hidden = ROUTERS["dsv3"]
    launcher = RouterLogitsLauncher(num_experts=experts, hidden_size=hidden, device="cuda")
    x_TH = _random((16, hidden), seed=11)
    weight_EH = _random((experts, hidden), seed=12)
    first = launcher(x_TH, weight_EH)
    for _ in range(5):
        assert torch.equal(launcher(x_TH, weight_EH), first)
    # a token's logits do not depend on the tokens beside it (a block of 1 or of 8)
    assert torch.equal(launcher(x_TH[:1], weight_EH), first[:1])
    assert torch.equal(launcher(x_TH[5:8], weight_EH), first[5:8])


def test_a_graph_replays_with_new_tokens_written_by_the_kernel_before():
    experts, hidden = ROUTERS["qwen3"]
    launcher = RouterLogitsLauncher(num_experts=experts, hidden_size=hidden, device="cuda")
    weight_EH = _random((experts, hidden), seed=21)
    source_TH = _random((4, hidden), seed=22)
    launcher(source_TH * 1.0, weight_EH)  # compiled outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        x_TH = source_TH * 1.0  # a kernel in the graph writes x just before the router's
        logits_TE = launcher(x_TH, weight_EH)
    for seed in range(3):
        source_TH.copy_(_random((4, hidden), seed=100 + seed))
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches_oracle(logits_TE, source_TH, weight_EH)
        assert torch.equal(logits_TE, launcher(source_TH, weight_EH))


@pytest.mark.parametrize("tokens", [1, 4, 16])
def test_the_routing_kernel_chained_by_pdl_reads_the_logits_written(tokens):
    """router logits -> route_and_place (it waits on the logits kernel, which lets it start
    early): the same routing as route_and_place on those logits launched on their own."""
    experts, hidden = ROUTERS["qwen3"]
    logits = RouterLogitsLauncher(num_experts=experts, hidden_size=hidden, device="cuda")
    route = RouteLauncher(num_experts=experts, top_k=8, hidden_size=hidden, device="cuda")
    weight_EH = _random((experts, hidden), seed=31) * 0.05
    source_TH = _random((tokens, hidden), seed=32)
    capacity = tokens * 8
    route(logits(source_TH, weight_EH), source_TH, capacity=capacity)  # compile outside
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        x_TH = source_TH * 1.0
        logits_TE = logits(x_TH, weight_EH)
        chained = route(logits_TE, x_TH, capacity=capacity)
    for seed in range(4):
        source_TH.copy_(_random((tokens, hidden), seed=200 + seed))
        graph.replay()
        torch.cuda.synchronize()
        alone = route(logits_TE.clone(), source_TH.clone(), capacity=capacity)
        torch.cuda.synchronize()
        ids_TK, weights_TK, row_of_pair_TK, offsets, rows_MH = chained[:5]
        assert torch.equal(ids_TK, alone[0])
        assert torch.equal(weights_TK, alone[1])
        assert torch.equal(row_of_pair_TK, alone[2])
        assert torch.equal(offsets, alone[3])
        assert torch.equal(rows_MH, alone[4])
        _assert_matches_oracle(logits_TE, source_TH, weight_EH)
