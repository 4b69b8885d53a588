"""MegaMoE with FP8 experts (weight_dtype="fp8"): e4m3 weights with 128 x 128 block scales,
loaded as they are or quantized as they load, against the fp32 oracle on the dequantized
weights; on an sm_90 GPU the FP8 kernels against that oracle."""

from __future__ import annotations

import pytest
import torch
from megamoe_kernels import GEGLU, dequantize_weight_blocks, quantize_weight_blocks
from megamoe_kernels.reference import fp8_difference, relative_l2_error
from megamoe_torch import MegaMoE, MegaMoEConfig

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 256, 256, 8, 2


def fp8_config(**overrides) -> MegaMoEConfig:
    fields = dict(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_experts=EXPERTS,
        top_k=TOP_K,
        weight_dtype="fp8",
    )
    return MegaMoEConfig(**{**fields, **overrides})


def random_bf16_state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "gate.weight": torch.randn(EXPERTS, HIDDEN, generator=generator) / HIDDEN**0.5,
        "w13": torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) / HIDDEN**0.5,
        "w2": torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) / INTERMEDIATE**0.5,
    }


def test_a_full_precision_state_dict_is_quantized_per_block_as_it_loads():
    state = random_bf16_state(0)
    layer = MegaMoE(fp8_config(), dtype=torch.float32)
    layer.load_state_dict(state)
    expected_w13, expected_scales = quantize_weight_blocks(state["w13"])
    assert layer.w13.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.w13.view(torch.uint8), expected_w13.view(torch.uint8))
    assert torch.equal(layer.w13_scale_inv, expected_scales)
    # each block's scale is its amax / 448
    block = state["w2"][3, 128:256, 0:128]
    torch.testing.assert_close(layer.w2_scale_inv[3, 1, 0], block.abs().max() / 448)


def test_the_fp8_state_dict_round_trips_bitwise_and_holds_e4m3_with_its_scales():
    first = MegaMoE(fp8_config(), dtype=torch.float32)
    first.load_state_dict(random_bf16_state(1))
    saved = first.state_dict()
    assert saved["w13"].dtype == torch.float8_e4m3fn and saved["w13_scale_inv"].shape == (8, 4, 2)
    second = MegaMoE(fp8_config(), dtype=torch.float32)
    second.load_state_dict(saved)
    x = torch.randn(7, HIDDEN)
    assert torch.equal(first(x), second(x))


def test_the_fp8_layer_computes_with_its_dequantized_weights():
    # the reference backend is the FP8 oracle: fp32 math on the values the e4m3 weights stand for
    fp8 = MegaMoE(fp8_config(), dtype=torch.float32)
    fp8.load_state_dict(random_bf16_state(2))
    exact = MegaMoE(fp8_config(weight_dtype=None), dtype=torch.float32)
    exact.load_state_dict(
        {
            "gate.weight": fp8.gate.weight.detach(),
            "w13": dequantize_weight_blocks(fp8.w13, fp8.w13_scale_inv),
            "w2": dequantize_weight_blocks(fp8.w2, fp8.w2_scale_inv),
        }
    )
    x = torch.randn(2, 9, HIDDEN)
    assert torch.equal(fp8(x), exact(x))
    # and stays near the unquantized layer (e4m3 keeps about 2 significant digits)
    full = MegaMoE(fp8_config(weight_dtype=None), dtype=torch.float32)
    full.load_state_dict(random_bf16_state(2))
    assert relative_l2_error(fp8(x), full(x)) < 0.08


def test_the_fp8_layer_trains_its_router_and_passes_gradients_to_its_input():
    layer = MegaMoE(fp8_config(), dtype=torch.float32)
    x = torch.randn(6, HIDDEN, requires_grad=True)
    layer(x).square().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert layer.gate.weight.grad is not None
    assert not layer.w13.requires_grad and layer.w13.grad is None


def test_an_expert_parallel_slice_takes_the_scales_of_its_experts():
    full = MegaMoE(fp8_config(), dtype=torch.float32)
    full.load_state_dict(random_bf16_state(3))
    layer = MegaMoE(fp8_config(), dtype=torch.float32)
    layer.load_full_state_dict(full.state_dict())
    assert torch.equal(layer.w2_scale_inv, full.w2_scale_inv)


def test_bad_fp8_configs_and_state_dicts_are_refused_naming_the_problem():
    with pytest.raises(ValueError, match="weight_dtype must be one of"):
        fp8_config(weight_dtype="int4")
    with pytest.raises(ValueError, match="does not combine with expert_bias"):
        fp8_config(expert_bias=True)
    layer = MegaMoE(fp8_config(), dtype=torch.float32)
    state = random_bf16_state(4)
    state["w13_scale_inv"] = layer.w13_scale_inv.clone()
    with pytest.raises(ValueError, match="comes with w13_scale_inv"):
        layer.load_state_dict(state)
    with pytest.raises(ValueError, match="w2 must have shape"):
        layer.load_expert_weights(w2=torch.randn(EXPERTS, HIDDEN, INTERMEDIATE + 1))
    with pytest.raises(TypeError, match="weights are torch.float32"):
        layer(torch.randn(3, HIDDEN, dtype=torch.bfloat16))


def test_fp8_shared_experts_load_quantize_and_compute_with_their_dequantized_weights():
    config = fp8_config(num_shared_experts=1, shared_intermediate_size=192)
    state = random_bf16_state(5)
    generator = torch.Generator().manual_seed(6)
    for name, shape in (("gate_proj", (192, HIDDEN)), ("up_proj", (192, HIDDEN))):
        state[f"shared_experts.{name}.weight"] = torch.randn(*shape, generator=generator) / 16
    state["shared_experts.down_proj.weight"] = torch.randn(HIDDEN, 192, generator=generator) / 14
    fp8 = MegaMoE(replace_config(config, shared_weight_dtype="fp8"), dtype=torch.float32)
    fp8.load_state_dict(state)  # full precision: quantized per block as it loads
    saved = fp8.state_dict()
    down, down_scales = quantize_weight_blocks(state["shared_experts.down_proj.weight"][None])
    assert saved["shared_experts.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(
        saved["shared_experts.down_proj.weight"].view(torch.uint8), down[0].view(torch.uint8)
    )
    assert torch.equal(saved["shared_experts.down_proj.weight_scale_inv"], down_scales[0])
    assert saved["shared_experts.gate_proj.weight_scale_inv"].shape == (2, 2)  # 192 rows: 2 blocks

    again = MegaMoE(replace_config(config, shared_weight_dtype="fp8"), dtype=torch.float32)
    again.load_state_dict(saved)  # e4m3 with its scales: as it is
    for key, tensor in saved.items():
        assert torch.equal(again.state_dict()[key].view(torch.uint8), tensor.view(torch.uint8)), key
    exact = MegaMoE(config, dtype=torch.float32)  # FP8 routed experts, full-precision shared
    exact.load_state_dict(
        {
            **{k: v for k, v in saved.items() if not k.startswith("shared_experts.")},
            **{
                f"shared_experts.{name}.weight": getattr(
                    fp8.shared_experts, name
                ).dequantized_weight()
                for name in ("gate_proj", "up_proj", "down_proj")
            },
        }
    )
    x = torch.randn(11, HIDDEN)
    with torch.no_grad():
        assert torch.equal(fp8(x), exact(x))
        assert torch.equal(again(x), fp8(x))
    with pytest.raises(ValueError, match="needs num_shared_experts >= 1"):
        fp8_config(shared_weight_dtype="fp8")
    with pytest.raises(ValueError, match="shared_weight_dtype must be one of"):
        fp8_config(num_shared_experts=1, shared_weight_dtype="e5m2")


def test_the_demos_oracle_of_an_fp8_layer_holds_its_dequantized_weights():
    from megamoe_torch.cli import fp32_oracle_of

    config = fp8_config(num_shared_experts=1, shared_weight_dtype="fp8")
    layer = MegaMoE(config, dtype=torch.bfloat16)
    oracle = fp32_oracle_of(layer)
    assert oracle.config.weight_dtype is None and oracle.w13.dtype == torch.float32
    assert torch.equal(oracle.w13, dequantize_weight_blocks(layer.w13, layer.w13_scale_inv))
    shared = layer.shared_experts.down_proj
    assert torch.equal(oracle.shared_experts.down_proj.weight, shared.dequantized_weight())
    x = torch.randn(10, HIDDEN, dtype=torch.bfloat16)
    with torch.no_grad():
        assert relative_l2_error(layer(x), oracle(x.float())) < 1e-2


def replace_config(config: MegaMoEConfig, **fields) -> MegaMoEConfig:
    from dataclasses import replace

    return replace(config, **fields)


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# the SwiGLU's variants FP8 experts compute: DeepSeek-V4's clamp, Inkling2's softcaps (tight
# enough that the test's values pass them), Gemma 4's GeGLU
SWIGLU_VARIANTS = {
    "silu": {},
    "clamped": dict(swiglu_limit=1.0),
    "softcapped": dict(swiglu_gate_softcap=1.0, swiglu_up_softcap=0.5),
    "geglu": dict(swiglu_alpha=GEGLU.alpha, swiglu_gate_cubic=GEGLU.gate_cubic),
}


def test_an_fp8_layer_computes_each_swiglu_variant_with_its_dequantized_weights():
    for name, fields in SWIGLU_VARIANTS.items():
        fp8 = MegaMoE(fp8_config(**fields), dtype=torch.float32)
        fp8.load_state_dict(random_bf16_state(5))
        exact = MegaMoE(fp8_config(weight_dtype=None, **fields), dtype=torch.float32)
        exact.load_state_dict(
            {
                "gate.weight": fp8.gate.weight.detach(),
                "w13": dequantize_weight_blocks(fp8.w13, fp8.w13_scale_inv),
                "w2": dequantize_weight_blocks(fp8.w2, fp8.w2_scale_inv),
            }
        )
        x = torch.randn(9, HIDDEN) * 4
        assert torch.equal(fp8(x), exact(x)), name
        plain = MegaMoE(fp8_config(), dtype=torch.float32)
        plain.load_state_dict(fp8.state_dict())
        assert name == "silu" or relative_l2_error(plain(x), fp8(x)) > 1e-3, name


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("tokens", [0, 1, 5, 300, 2048])
@pytest.mark.parametrize("layer_path", ["fused", "torch"])
@pytest.mark.parametrize("swiglu", sorted(SWIGLU_VARIANTS))
def test_the_fp8_kernels_meet_the_fp8_oracle(tokens, layer_path, swiglu):
    hidden, intermediate, experts = 2048, 768, 32
    config = MegaMoEConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_experts=experts,
        top_k=4,
        weight_dtype="fp8",
        backend="cutedsl",
        layer_path=layer_path,
        **SWIGLU_VARIANTS[swiglu],
    )
    torch.manual_seed(tokens)
    layer = MegaMoE(config, device="cuda", dtype=torch.bfloat16)
    oracle = MegaMoE(replace_backend(config, "reference"), device="cuda", dtype=torch.bfloat16)
    oracle.load_state_dict(layer.state_dict())
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y, expected = layer(x), oracle(x)
        again = layer(x)
    assert torch.equal(y, again), "the FP8 layer is not bitwise repeatable"
    if tokens:
        assert fp8_difference(y.float(), expected.float()) <= 2e-3
        assert relative_l2_error(y, expected) <= 6e-2


def replace_backend(config: MegaMoEConfig, backend: str) -> MegaMoEConfig:
    from dataclasses import replace

    return replace(config, backend=backend, layer_path="torch")


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
def test_the_fp8_layer_replays_in_a_cuda_graph_with_new_tokens():
    hidden, tokens = 2048, 48
    config = MegaMoEConfig(
        hidden_size=hidden,
        intermediate_size=768,
        num_experts=32,
        top_k=4,
        weight_dtype="fp8",
        backend="cutedsl",
        capacity=tokens * 4,
    )
    layer = MegaMoE(config, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        layer(x)  # compiles and prepares outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        y = layer(x)
    for seed in (1, 2):
        torch.manual_seed(seed)
        x.copy_(torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        with torch.no_grad():
            assert torch.equal(y, layer(x))


def test_a_cast_that_would_drop_the_block_scales_is_refused():
    config = MegaMoEConfig(
        hidden_size=256, intermediate_size=128, num_experts=4, top_k=2, weight_dtype="fp8"
    )
    layer = MegaMoE(config, dtype=torch.bfloat16)
    before = layer.w13.clone()
    for convert in (layer.half, layer.float, lambda: layer.to(torch.bfloat16)):
        with pytest.raises(TypeError, match="e4m3 weights .* without their block scales"):
            convert()
    assert layer.w13.dtype == torch.float8_e4m3fn
    assert torch.equal(layer.w13.view(torch.uint8), before.view(torch.uint8))
    layer.to("cpu")  # a move keeps the bytes
    assert layer.activation_dtype == torch.bfloat16


def test_fp8_shared_experts_join_the_fp8_batch_as_their_e4m3_blocks():
    """Routed and shared experts both FP8 (DeepSeek-V3's checkpoints): the shared MLP can be
    experts of the routed batch, its e4m3 weights and block scales appended as they are; the
    batch with them computes the layer's forward. Mixed precisions, or a routed size that would
    split the shared MLP's scale blocks, keep it out with the reason."""
    from megamoe_runtime.dispatch import LocalDispatcher
    from megamoe_runtime.experts import make_backend
    from megamoe_runtime.geometries import Geometry
    from megamoe_torch import bench

    geometry = Geometry(
        "test-fp8-shared", EXPERTS, TOP_K, HIDDEN, INTERMEDIATE, num_shared_experts=2
    )
    layer = bench.build_layer(
        geometry, device=torch.device("cpu"), dtype=torch.bfloat16, weight_dtype="fp8"
    )
    assert layer.config.shared_weight_dtype == "fp8"
    assert layer.config.shared_experts_in_batch_problems == ()
    pack = layer.shared_in_batch_weight_pack()
    assert pack.num_experts == EXPERTS + 2
    assert torch.equal(pack.w2_scales[:EXPERTS], layer.w2_scale_inv)
    x_TH, batch, handle, pack = bench.shared_in_batch(layer, 6)
    backend = make_backend("reference")
    expert_rows = backend(batch, backend.prepare(pack))
    combined = LocalDispatcher(EXPERTS + 2).combine(expert_rows, handle)
    layer.use_backend("reference")
    with torch.no_grad():
        expected = layer(x_TH)  # the shared MLP beside the routed experts
    assert relative_l2_error(combined.float(), expected.float()) < 1e-2

    mixed = fp8_config(num_shared_experts=1)  # FP8 routed experts, bf16 shared ones
    assert "differ (a batch holds one precision)" in mixed.shared_experts_in_batch_problems[0]
    narrow = fp8_config(intermediate_size=192, num_shared_experts=1, shared_weight_dtype="fp8")
    assert "multiple of 128" in narrow.shared_experts_in_batch_problems[0]


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("tokens", [0, 1, 16, 300])
@pytest.mark.parametrize("shared_intermediate", [256, 512])
def test_fp8_shared_experts_in_the_fp8_batch_meet_the_oracle(tokens, shared_intermediate):
    """DeepSeek-V3's FP8 layer on the fused path: its FP8 shared experts as experts of the
    batch ("batch": their e4m3 blocks) and as their own MLP ("side_stream"), against the
    oracle (the torch path on the reference backend), bitwise repeatable."""
    hidden = 1024
    config = MegaMoEConfig(
        hidden_size=hidden,
        intermediate_size=256,
        num_experts=32,
        top_k=4,
        scoring="sigmoid",
        num_groups=8,
        top_groups=4,
        use_correction_bias=True,
        routed_scaling_factor=2.5,
        num_shared_experts=1,
        shared_intermediate_size=shared_intermediate,
        weight_dtype="fp8",
        shared_weight_dtype="fp8",
        backend="cutedsl",
    )
    assert config.shared_experts_in_batch_problems == ()
    torch.manual_seed(tokens + shared_intermediate)
    layers = {
        path: MegaMoE(
            replace_config(config, shared_experts_path=path), device="cuda", dtype=torch.bfloat16
        )
        for path in ("batch", "side_stream")
    }
    layers["side_stream"].load_state_dict(layers["batch"].state_dict())
    oracle = MegaMoE(replace_backend(config, "reference"), device="cuda", dtype=torch.bfloat16)
    oracle.load_state_dict(layers["batch"].state_dict())
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        expected = oracle(x)
        for path, layer in layers.items():
            y = layer(x)
            assert torch.equal(y, layer(x)), f"{path}: not bitwise repeatable"
            if tokens:
                assert fp8_difference(y.float(), expected.float()) <= 2e-3, path
                assert relative_l2_error(y, expected) <= 6e-2, path
