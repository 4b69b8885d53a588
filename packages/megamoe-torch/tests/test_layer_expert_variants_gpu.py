"""The expert MLPs besides the gated SwiGLU on an sm_90 GPU, against the reference backend within
the bf16 tolerance, on fresh tokens over a poisoned allocator: Nemotron-H's ungated relu^2 experts
(backend 'auto' picks grouped_mm, the cutedsl kernels computing gated experts; the fused path
around it) and its latent MoE (the torch layer path); LongCat-Flash's identity experts (the torch
layer path, the routed rows on cutedsl); MiniMax-M3's shared experts with the routed experts'
clamped SwiGLU (cutedsl, the fused path); Inkling2's softcapped SwiGLU and A.X-K1's output
RMSNorm (cutedsl, the fused path); Gemma 4's GeGLU experts and DeepSeek-V4's sqrt(softplus)
routing with clamped experts (cutedsl, the fused path) and its hash layers' routing table (the
torch layer path, cutedsl experts). A Nemotron-H layer trains through grouped_mm with the
reference backend's gradients."""

import pytest
import test_layer_expert_math as expert_math
import torch
from gpu_inputs import fresh_tokens, poison_allocator
from layer_gradients import bf16_and_fp32_gradients
from megamoe_kernels.reference import relative_l2_error
from megamoe_torch import MegaMoE, MegaMoEConfig

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

TOLERANCE = 1e-2
# Nemotron-3-Nano-30B-A3B's sizes: 128 experts of I = 1856 at H = 2688, top-6, a shared MLP of
# 3712, sigmoid scores with a correction bias, scaled by 2.5
NEMOTRON_H = dict(
    hidden_size=2688,
    intermediate_size=1856,
    num_experts=128,
    top_k=6,
    scoring="sigmoid",
    use_correction_bias=True,
    routed_scaling_factor=2.5,
    activation="relu2",
    num_shared_experts=1,
    shared_intermediate_size=3712,
)
# the families of test_layer_expert_math (their routing and expert math) at sizes the kernels take
WIDER = dict(hidden_size=1024, intermediate_size=512)
# LongCat-Flash's routing: 64 routed and 32 identity experts, top-12
LONGCAT = dict(
    expert_math.LONGCAT,
    **WIDER,
    num_experts=64,
    num_identity_experts=32,
    top_k=12,
    routed_scaling_factor=6.0,
)
# MiniMax-M3's kind: clamped routed experts and a shared MLP clamped alike
MINIMAX_M3 = dict(
    expert_math.MINIMAX_M3, **WIDER, num_experts=32, top_k=4, shared_intermediate_size=1024
)
# Inkling2's kind: the SwiGLU's gate and up softcapped (caps small enough that the scaled
# weights' values pass them)
INKLING2 = dict(
    expert_math.INKLING2,
    **WIDER,
    num_experts=32,
    top_k=4,
    swiglu_gate_softcap=4.0,
    swiglu_up_softcap=2.0,
)
# A.X-K1's kind: DeepSeek-V3's grouped routing and shared expert, the output RMSNorm-ed (the fused
# path and its replayed graphs apply the norm after the combine)
AXK1 = dict(expert_math.AXK1, **WIDER, num_experts=64, top_k=6, num_groups=8, top_groups=4)
# Gemma 4's kind: GeGLU experts (the tanh GELU of the gate)
GEMMA4 = dict(expert_math.GEMMA4, **WIDER, num_experts=32, top_k=4)
# DeepSeek-V4's kind: sqrt(softplus) scores with a bias, experts and shared MLP clamped; its hash
# layers take the experts from a table of token ids
DEEPSEEK_V4 = dict(expert_math.DEEPSEEK_V4, **WIDER, num_experts=64, top_k=6)
DEEPSEEK_V4_HASH = dict(expert_math.DEEPSEEK_V4_HASH, **WIDER, num_experts=64, top_k=6)
CASES = {
    "nemotron-h": (NEMOTRON_H, "grouped_mm", True),
    "nemotron-h-latent": (dict(NEMOTRON_H, latent_size=1024), "grouped_mm", False),
    "longcat": (LONGCAT, "cutedsl", False),
    "minimax-m3": (MINIMAX_M3, "cutedsl", True),
    "inkling2": (INKLING2, "cutedsl", True),
    "axk1": (AXK1, "cutedsl", True),
    "gemma4": (GEMMA4, "cutedsl", True),
    "deepseek-v4": (DEEPSEEK_V4, "cutedsl", True),
    "deepseek-v4-hash": (DEEPSEEK_V4_HASH, "cutedsl", True),
}


def make_layer(fields: dict) -> MegaMoE:
    torch.manual_seed(0)
    layer = MegaMoE(MegaMoEConfig(**fields), device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        layer.gate.weight.mul_(8.0)  # decisive routing
        if layer.e_score_correction_bias is not None:
            layer.e_score_correction_bias.normal_(0.0, 0.05)
        if layer.output_norm is not None:
            layer.output_norm.weight.normal_(1.0, 0.5)
        layer.w13.mul_(4.0)  # gate and up values past the SwiGLU limit
    return layer


@torch.no_grad()
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("tokens", [1, 5, 77, 600])
def test_the_layer_matches_the_reference_backend(case, tokens):
    fields, backend, fused = CASES[case]
    layer = make_layer(fields)
    assert layer.backend == backend, layer.backend_reason
    assert layer.fused_path_status()[0] == fused, layer.fused_path_status()[1]
    hidden = layer.config.hidden_size
    # two forwards of one shape on fresh tokens: the second of a small batch on the fused path
    # replays the graph the first captured
    inputs = [fresh_tokens(tokens, hidden, seed=tokens * 10 + i) for i in range(2)]
    # the token ids a layer routing by token id takes (others ignore them)
    vocab = max(layer.config.routing_table_vocab_size, 1)
    ids = torch.randint(vocab, (tokens,), generator=torch.Generator().manual_seed(tokens))
    ids = ids.cuda()
    outputs = []
    for x in inputs:
        poison_allocator()
        outputs.append(layer(x, input_ids=ids).clone())
    assert torch.equal(layer(inputs[-1], input_ids=ids), outputs[-1])  # bitwise repeatable
    layer.use_backend("reference")
    for x, actual in zip(inputs, outputs, strict=True):
        expected = layer(x, input_ids=ids)
        assert torch.isfinite(actual).all()
        error = relative_l2_error(actual, expected)
        assert error < TOLERANCE, (case, tokens, error)


def test_a_nemotron_h_layer_trains_through_grouped_mm_with_the_reference_gradients():
    layer = make_layer(dict(NEMOTRON_H, hidden_size=256, intermediate_size=128, num_experts=16))
    triples = bf16_and_fp32_gradients(layer, ("w13", "w2", "gate.weight"))
    assert layer._autograd_backend().name == "grouped_mm"
    for actual, bf16_reference, expected in triples:
        assert torch.isfinite(actual).all()
        error = relative_l2_error(actual, expected)
        reference_error = relative_l2_error(bf16_reference, expected)
        assert error <= 1.5 * reference_error + 1e-3, (error, reference_error)
