"""A gpt-oss layer (router bias, expert biases, SwiGLU clamped at 7 with alpha 1.702 and up + 1)
on an sm_90 GPU: backend 'auto' picks cutedsl, and its forwards and grouped_mm's (the fused
path, eager graph replays, the torch layer path) match the reference backend within the bf16
tolerance; a forward that records gradients runs on grouped_mm, its gradients as close to the
fp32 layer's as the reference backend's."""

import pytest
import torch
from layer_gradients import bf16_and_fp32_gradients
from megamoe_kernels.reference import relative_l2_error
from megamoe_torch import MegaMoE, MegaMoEConfig

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

TOLERANCE = 1e-2
GPT_OSS_MATH = dict(
    router_bias=True,
    expert_bias=True,
    swiglu_limit=7.0,
    swiglu_alpha=1.702,
    swiglu_up_offset=1.0,
)
# (hidden, intermediate, experts, top_k): gpt-oss-120b's H = I = 2880 with fewer experts, and
# tiny dims
DIMS = {"gpt-oss": (2880, 2880, 16, 4), "tiny": (64, 40, 8, 2)}


def make_layer(dims, **overrides):
    hidden, intermediate, experts, top_k = DIMS[dims]
    config = MegaMoEConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_experts=experts,
        top_k=top_k,
        **GPT_OSS_MATH,
        **overrides,
    )
    torch.manual_seed(0)
    layer = MegaMoE(config, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.w13.mul_(4.0)  # gate and up values past the SwiGLU limit: the clamp matters
        layer.w13_bias.normal_(0, 1.0)
        layer.w2_bias.normal_(0, 0.5)
        layer.gate.bias.normal_(0, 0.5)
    return layer


@torch.no_grad()
@pytest.mark.parametrize("backend", ["auto", "grouped_mm"])
@pytest.mark.parametrize("dims", sorted(DIMS))
@pytest.mark.parametrize("tokens", [1, 5, 77, 600])
@pytest.mark.parametrize("layer_path", ["auto", "torch"])
def test_a_gpt_oss_layer_matches_the_reference_backend(backend, dims, tokens, layer_path):
    layer = make_layer(dims, layer_path=layer_path, backend=backend)
    expected_backend = "cutedsl" if backend == "auto" else backend
    assert layer.backend == expected_backend, layer.backend_reason
    x = torch.randn(tokens, layer.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    # twice: the second forward of a small batch on the fused path replays a captured graph
    outputs = [layer(x) for _ in range(2)]
    layer.use_backend("reference")
    expected = layer(x)
    for actual in outputs:
        assert torch.isfinite(actual).all()
        error = relative_l2_error(actual, expected)
        assert error < TOLERANCE, (backend, dims, tokens, layer_path, error)


@pytest.mark.parametrize("dims", sorted(DIMS))
def test_a_gpt_oss_layer_trains_through_grouped_mm_with_the_reference_gradients(dims):
    # backend 'auto' runs cutedsl, which has no backward: a forward that autograd records runs
    # on grouped_mm, which computes the biases and the clamped SwiGLU. Its bf16 gradients are
    # within 2% of the fp32 layer's, as the reference backend's bf16 ones are: bf16 roundings
    # through grouped_mm's backward GEMMs and the clamp's derivative (measured on the H200: up
    # to 1.04% for grouped_mm, 0.29-0.42% for the reference backend); a wrong term is off by
    # tens of percent
    layer = make_layer(dims)
    assert layer.backend == "cutedsl"
    triples = bf16_and_fp32_gradients(layer, ("w13", "w2", "w13_bias", "w2_bias", "gate.bias"))
    assert layer._autograd_backend().name == "grouped_mm"
    for actual, bf16_reference, expected in triples:
        assert torch.isfinite(actual).all()
        error = relative_l2_error(actual, expected)
        reference_error = relative_l2_error(bf16_reference, expected)
        assert max(error, reference_error) <= 2e-2, (error, reference_error)


@torch.no_grad()
def test_the_clamp_and_the_biases_change_the_output():
    # the test inputs reach the clamp, and a layer without the math differs from one with it
    layer = make_layer("tiny")
    x = torch.randn(50, 64, device="cuda", dtype=torch.bfloat16)
    with_math = layer(x)
    plain = MegaMoE(
        MegaMoEConfig(
            hidden_size=64, intermediate_size=40, num_experts=8, top_k=2, router_bias=True
        ),
        device="cuda",
        dtype=torch.bfloat16,
    )
    plain.load_state_dict(
        {k: v for k, v in layer.state_dict().items() if k not in ("w13_bias", "w2_bias")}
    )
    assert plain.backend == "cutedsl"
    assert relative_l2_error(plain(x), with_math) > 0.1
