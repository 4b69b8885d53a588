"""A Llama 4 layer (sigmoid top-1 or top-2 routing, not renormalised, routing weights on the
expert input, an ungated shared expert) on an sm_90 GPU: backend 'auto' picks cutedsl and the
fused path, whose dispatch scales the rows; its forwards (the fused path, eager graph replays,
the torch layer path) and grouped_mm's match the reference backend within the bf16 tolerance; a
forward that records gradients runs on grouped_mm, its gradients as close to the fp32 layer's as
the reference backend's; a tiny transformers Llama 4 model swapped with backend='auto' runs its
blocks on cutedsl."""

import copy
from dataclasses import replace

import pytest
import torch
from gpu_inputs import fresh_tokens, poison_allocator
from layer_gradients import bf16_and_fp32_gradients
from megamoe_kernels.reference import relative_l2_error
from megamoe_torch import MegaMoE, MegaMoEConfig, swap_moe_blocks

pytestmark = pytest.mark.gpu

if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
    pytest.skip("needs an sm_90 GPU", allow_module_level=True)

TOLERANCE = 1e-2
LLAMA4_MATH = dict(
    scoring="sigmoid",
    renormalize=False,
    routing_weights_on_input=True,
    num_shared_experts=1,
    router_dtype="input",
)
# (hidden, intermediate, experts, top_k): Llama 4 Scout's H = 5120 and I = 8192 with its top-1
# of 16 experts; a top-2 of 128 experts at Maverick's H; tiny dims
DIMS = {
    "scout": (5120, 8192, 16, 1),
    "top2": (5120, 1024, 128, 2),
    "tiny": (64, 40, 8, 2),
}


def make_layer(dims, *, router_scale: float = 8.0, **overrides):
    hidden, intermediate, experts, top_k = DIMS[dims]
    config = MegaMoEConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_experts=experts,
        top_k=top_k,
        **{**LLAMA4_MATH, **overrides},
    )
    torch.manual_seed(0)
    layer = MegaMoE(config, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        # routing weights spread over (0, 1), not all near 0.5 (the chosen experts' near 1)
        layer.gate.weight.mul_(router_scale)
    return layer


@torch.no_grad()
@pytest.mark.parametrize("backend", ["auto", "grouped_mm"])
@pytest.mark.parametrize("dims", sorted(DIMS))
@pytest.mark.parametrize("tokens", [1, 5, 77, 600])
@pytest.mark.parametrize("layer_path", ["auto", "torch"])
def test_a_llama4_layer_matches_the_reference_backend(backend, dims, tokens, layer_path):
    layer = make_layer(dims, layer_path=layer_path, backend=backend)
    expected_backend = "cutedsl" if backend == "auto" else backend
    assert layer.backend == expected_backend, layer.backend_reason
    fused, why = layer.fused_path_status()
    assert fused == (layer_path == "auto"), why
    hidden = layer.config.hidden_size
    # two forwards of one shape on fresh tokens: the second of a small batch on the fused path
    # replays the graph the first captured
    inputs = [fresh_tokens(tokens, hidden, seed=tokens * 10 + i) for i in range(2)]
    outputs = []
    for x in inputs:
        poison_allocator()
        outputs.append(layer(x).clone())
    layer.use_backend("reference")
    for x, actual in zip(inputs, outputs, strict=True):
        expected = layer(x)
        assert torch.isfinite(actual).all()
        error = relative_l2_error(actual, expected)
        assert error < TOLERANCE, (backend, dims, tokens, layer_path, error)


@torch.no_grad()
@pytest.mark.parametrize("shared_experts_path", ["batch", "side_stream"])
@pytest.mark.parametrize("gather_rows", [None, False])
def test_the_fused_path_scales_the_rows_with_the_shared_expert_in_or_beside_the_batch(
    shared_experts_path, gather_rows
):
    # the shared expert's rows (weight 1) are the tokens as they are; the rows are copied
    # scaled whatever gather_rows says (None: the measured choice would gather them)
    layer = make_layer("top2", shared_experts_path=shared_experts_path, gather_rows=gather_rows)
    x = fresh_tokens(300, layer.config.hidden_size, seed=3)
    assert layer.backend == "cutedsl" and layer.fused_path_status()[0]
    assert not layer._gathers_rows(x)
    poison_allocator()
    actual = layer(x)
    layer.use_backend("reference")
    assert relative_l2_error(actual, layer(x)) < TOLERANCE


@torch.no_grad()
def test_the_weights_on_the_input_change_the_output():
    # the router as initialised: the chosen experts' weights are about 0.65 (the reference
    # backend on a CPU: 56% apart), away from 1, so f(w x) and w f(x) differ; no shared expert,
    # whose output (the same on both) would dilute the difference
    layer = make_layer("tiny", router_scale=1.0, num_shared_experts=0)
    weighted_output = MegaMoE(
        replace(layer.config, routing_weights_on_input=False), device="cuda", dtype=torch.bfloat16
    )
    weighted_output.load_state_dict(layer.state_dict())
    x = fresh_tokens(50, 64, seed=5)
    assert weighted_output.backend == layer.backend == "cutedsl"
    assert relative_l2_error(weighted_output(x), layer(x)) > 0.1


def test_a_llama4_layer_trains_through_grouped_mm_with_the_reference_gradients():
    # backend 'auto' runs cutedsl, which has no backward: a forward that autograd records runs
    # on grouped_mm, the scaling of the rows recorded before it (the router's weight learns
    # through the experts). Its bf16 gradients are as close to the fp32 layer's as the
    # reference backend's bf16 ones
    layer = make_layer("tiny")
    assert layer.backend == "cutedsl"
    triples = bf16_and_fp32_gradients(layer, ("w13", "w2", "gate.weight"))
    assert layer._autograd_backend().name == "grouped_mm"
    for actual, bf16_reference, expected in triples:
        assert torch.isfinite(actual).all()
        error = relative_l2_error(actual, expected)
        reference_error = relative_l2_error(bf16_reference, expected)
        assert error <= 1.5 * reference_error + 1e-3, (error, reference_error)


@torch.no_grad()
def test_a_tiny_llama4_model_swapped_with_backend_auto_runs_on_cutedsl():
    pytest.importorskip("transformers")
    from hf_family_walk import tiny_model

    model = tiny_model("llama4").to("cuda", torch.bfloat16)
    original = copy.deepcopy(model)
    report = swap_moe_blocks(model, backend="auto")
    swapped = [module for module in model.modules() if isinstance(module, MegaMoE)]
    assert len(swapped) == len(report.swapped) > 0
    for layer in swapped:
        assert layer.config.routing_weights_on_input
        assert layer.backend == "cutedsl", layer.backend_reason
        assert layer.fused_path_status()[0], layer.fused_path_status()[1]
    name = report.swapped[0].name
    block, original_block = model.get_submodule(name), original.get_submodule(name)
    hidden = block.config.hidden_size
    x = torch.randn(4, 33, hidden, device="cuda", dtype=torch.bfloat16)
    input_ids = torch.randint(0, model.config.vocab_size, (4, 33), device="cuda")
    # bf16 roundings differ between the two and grow through attention (the bounds of
    # test_hf_models' qwen3 check); a wrong layer is far off at either point
    # both blocks return transformers' (flattened output, router logits)
    expected_block = original_block(x)[0].view(x.shape)
    assert relative_l2_error(block(x)[0].view(x.shape), expected_block) < 2e-2
    expected_logits = original(input_ids).logits
    assert relative_l2_error(model(input_ids).logits, expected_logits) < 0.2
