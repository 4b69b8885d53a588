"""The layer's router logits from the router-logits kernel (up to ROUTER_KERNEL_MAX_TOKENS
tokens, as many as the router's size lets it win) against the GEMM library's (ROUTER_KERNEL_MAX_TOKENS = 0): the same logits up to fp32
summation order, the same experts, the same output within the routing weights' ulps; launched
forwards and replayed graphs alike; the torch path and a compiled forward take the same kernel
(the same bits as the fused path); the op megamoe::router_logits passes torch's opcheck."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from megamoe_kernels import ROUTER_LOGITS_MAX_TOKENS
from megamoe_torch import layer as layer_module
from megamoe_torch.config import MegaMoEConfig
from megamoe_torch.layer import MegaMoE
from megamoe_torch.ops import router_logits as router_logits_op

pytestmark = pytest.mark.gpu

HIDDEN = 2880  # gpt-oss: not a whole number of the kernel's 1024-element CTA steps
ROUTERS = {
    "softmax_fp32": dict(num_experts=60, top_k=4),
    "bf16_logits": dict(num_experts=8, top_k=2, router_dtype="input"),
    "router_bias": dict(num_experts=32, top_k=4, router_bias=True),
    "dsv3_like": dict(
        num_experts=64,
        top_k=6,
        scoring="sigmoid",
        num_groups=8,
        top_groups=3,
        routed_scaling_factor=2.5,
        use_correction_bias=True,
    ),
}


def _layer(router: str, *, eager_graph_tokens: int = 0) -> MegaMoE:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    config = MegaMoEConfig(
        hidden_size=HIDDEN,
        intermediate_size=256,
        backend="cutedsl",
        eager_graph_tokens=eager_graph_tokens,
        **ROUTERS[router],
    )
    torch.manual_seed(0)
    try:
        layer = MegaMoE(config, device="cuda", dtype=torch.bfloat16)
    except ValueError as refused:
        pytest.skip(str(refused))
    ok, why = layer.fused_path_status()
    if not ok:
        pytest.skip(why)
    with torch.no_grad():
        if layer.gate.bias is not None:
            layer.gate.bias.normal_(0, 0.5)
        if layer.e_score_correction_bias is not None:
            layer.e_score_correction_bias.normal_(0, 0.05)
    return layer


def _tokens(tokens: int, seed: int) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(tokens, HIDDEN, device="cuda", generator=generator).bfloat16()


def _assert_same_logits(kernel_TE, library_TE, x_TH, layer):
    assert kernel_TE.dtype == library_TE.dtype
    abs_sum = x_TH.float().abs() @ layer.gate.weight.float().abs().t()
    allowed = 1e-5 * abs_sum + 1e-30
    if kernel_TE.dtype == torch.bfloat16:  # each rounded once, maybe to neighbouring values
        allowed = allowed + library_TE.float().abs() * 2.0**-7
    error = (kernel_TE.float() - library_TE.float()).abs()
    assert (error <= allowed).all(), f"worst error / allowed {(error / allowed).max().item()}"


def _count_kernel_lookups(monkeypatch) -> list[int]:
    """The token counts of the forwards that take the router-logits kernel from now on."""
    calls = []
    router_kernel = layer_module.router_kernel

    def counted(*key):
        launcher = router_kernel(*key)
        assert launcher is not None, f"the kernel cannot run {key}"
        return lambda x_TH, *args, **kwargs: (
            calls.append(x_TH.shape[0]) or launcher(x_TH, *args, **kwargs)
        )

    monkeypatch.setattr(layer_module, "router_kernel", counted)
    return calls


@pytest.mark.parametrize("router", sorted(ROUTERS))
@pytest.mark.parametrize("tokens", [1, 3, 16, 40, ROUTER_LOGITS_MAX_TOKENS])
@torch.no_grad()
def test_the_kernel_gives_the_libraries_logits_and_experts(router, tokens, monkeypatch):
    layer = _layer(router)
    x_TH = _tokens(tokens, seed=tokens)
    monkeypatch.setattr(layer_module, "ROUTER_KERNEL_MAX_TOKENS", 0)
    library_y, library_TE = layer(x_TH, return_router_logits=True)
    assert torch.equal(library_TE, layer.router_logits(x_TH))
    monkeypatch.setattr(layer_module, "ROUTER_KERNEL_MAX_TOKENS", ROUTER_LOGITS_MAX_TOKENS)
    kernels = _count_kernel_lookups(monkeypatch)
    kernel_y, kernel_TE = layer(x_TH, return_router_logits=True)
    assert kernels == [tokens]  # the kernel computed the logits
    _assert_same_logits(kernel_TE, library_TE, x_TH, layer)
    # random logits have no near-ties: the same experts, so the output differs only by the
    # routing weights' last bits
    torch.testing.assert_close(kernel_y, library_y, rtol=2e-2, atol=2e-2)
    again_y, again_TE = layer(x_TH, return_router_logits=True)
    assert torch.equal(again_TE, kernel_TE) and torch.equal(again_y, kernel_y)


@pytest.mark.parametrize("router", ["softmax_fp32", "router_bias"])
@torch.no_grad()
def test_replayed_graphs_compute_the_logits_with_the_kernel(router):
    layer = _layer(router, eager_graph_tokens=16)
    launching = _layer(router)
    launching.load_state_dict(layer.state_dict())
    for call in range(4):  # launched, captured, replayed twice: new tokens each time
        x_TH = _tokens(5, seed=100 + call)
        y, logits_TE = layer(x_TH, return_router_logits=True)
        expected_y, expected_TE = launching(x_TH, return_router_logits=True)
        assert torch.equal(logits_TE, expected_TE), f"call {call}"
        assert torch.equal(y, expected_y), f"call {call}"
    assert len(layer._forward_graphs) == 1


@torch.no_grad()
def test_more_tokens_than_the_bound_use_the_library(monkeypatch):
    layer = _layer("softmax_fp32")
    monkeypatch.setattr(layer_module, "ROUTER_KERNEL_MAX_TOKENS", 4)
    kernels = _count_kernel_lookups(monkeypatch)
    layer(_tokens(4, seed=1))
    layer(_tokens(5, seed=2))
    assert kernels == [4]
    # the router's own bound (router_logits_faster_tokens) holds too
    monkeypatch.setattr(layer_module, "ROUTER_KERNEL_MAX_TOKENS", ROUTER_LOGITS_MAX_TOKENS)
    monkeypatch.setattr(layer_module, "router_logits_faster_tokens", lambda experts, hidden: 8)
    layer(_tokens(8, seed=3))
    layer(_tokens(9, seed=4))
    assert kernels == [4, 8]


@pytest.mark.parametrize("router", ["softmax_fp32", "bf16_logits"])
@torch.no_grad()
def test_the_torch_path_and_a_compiled_forward_take_the_kernel_too(router):
    layer = _layer(router)
    torch_path = MegaMoE(
        replace(layer.config, layer_path="torch"), device="cuda", dtype=torch.bfloat16
    )
    torch_path.load_state_dict(layer.state_dict())
    compiled = torch.compile(layer, fullgraph=True)
    for seed in range(2):
        x_TH = _tokens(7, seed=seed)
        _, logits_TE = layer(x_TH, return_router_logits=True)
        assert torch.equal(torch_path(x_TH, return_router_logits=True)[1], logits_TE)
        assert torch.equal(compiled(x_TH, return_router_logits=True)[1], logits_TE)


@torch.no_grad()
def test_the_router_op_passes_opcheck():
    layer = _layer("router_bias")
    # no autograd formula: inputs that need no gradient
    weight, bias = layer.gate.weight.detach(), layer.gate.bias.detach()
    for tokens in (1, 9):
        x_TH = _tokens(tokens, seed=tokens)
        torch.library.opcheck(router_logits_op, (x_TH, weight, bias, torch.float32))
        torch.library.opcheck(router_logits_op, (x_TH, weight, None, torch.bfloat16))
