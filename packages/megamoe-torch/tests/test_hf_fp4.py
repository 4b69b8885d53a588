"""DeepSeek-V4's checkpoints: FP4 experts (packed e2m1, a ue8m0 scale per row and 32 columns)
and FP8 weights with ue8m0 block scales, read as megamoe's FP8 format with the same values.

The values are checked against transformers' own FP4 decoding where it has one, the requantized
e4m3 experts against the FP4 values bit for bit, and a converted block against DeepSeek-V4's
block holding the dequantized weights."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from megamoe_kernels import dequantize_weight_blocks
from megamoe_kernels.reference import fp8_difference, relative_l2_error
from megamoe_torch import (
    UnsupportedBlockError,
    from_hf_state_dict,
    register_experts_implementation,
    swap_moe_blocks,
    unswap_moe_blocks,
)
from megamoe_torch.hf.fp4 import (
    E2M1_MAGNITUDES,
    E2M1_VALUES,
    as_fp8_checkpoint,
    fp4_as_fp8,
    fp4_values,
    fp8_as_fp4,
    with_scales_inv_names,
)

E8M0 = torch.float8_e8m0fnu
E4M3 = torch.float8_e4m3fn


def fp4_quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed int8 [..., N, K/2], ue8m0 scales [..., N, K/32], the values they hold) of a
    float32 weight: each 32 columns of a row scaled by the power of two that puts their largest
    magnitude at or under 6, each value rounded to the nearest e2m1."""
    groups = weight.unflatten(-1, (-1, 32))
    amax = groups.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), 0.0).to(torch.int32)
    scaled = torch.ldexp(groups, -exponent[..., None])
    magnitudes = torch.tensor(E2M1_MAGNITUDES)
    code = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)
    code = torch.where((scaled < 0) & (code > 0), code + 8, code).flatten(-2)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8).view(torch.int8)
    scales = (exponent + 127).to(torch.uint8).view(E8M0)
    values = torch.ldexp(
        torch.tensor(E2M1_VALUES)[code].unflatten(-1, (-1, 32)), exponent[..., None]
    )
    return packed, scales, values.flatten(-2)


def fp8_ue8m0_quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], ue8m0 scales [ceil(N/128), ceil(K/128)], the values they hold) of a float32
    weight: each 128 x 128 block scaled by a power of two."""
    rows, cols = weight.shape
    padded = weight.new_zeros(-(-rows // 128) * 128, -(-cols // 128) * 128)
    padded[:rows, :cols] = weight
    amax = padded.unflatten(0, (-1, 128)).unflatten(2, (-1, 128)).abs().amax(dim=(1, 3))
    exponent = torch.where(amax > 0, torch.ceil(torch.log2(amax / 448.0)), 0.0).to(torch.int32)
    expanded = exponent.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
    quantized = torch.ldexp(weight, -expanded).to(E4M3)
    scales = (exponent + 127).to(torch.uint8).view(E8M0)
    return quantized, scales, torch.ldexp(quantized.float(), expanded)


def random_fp4(shape, *, exponents=(-6, 3), seed=0):
    generator = torch.Generator().manual_seed(seed)
    packed = torch.randint(-128, 128, shape, dtype=torch.int8, generator=generator)
    scale_shape = (*shape[:-1], 2 * shape[-1] // 32)
    exponent = torch.randint(*exponents, scale_shape, generator=generator)
    return packed, (exponent + 127).to(torch.uint8).view(E8M0)


def test_fp4_values_are_transformers_decoding():
    finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
    dequantize = getattr(finegrained, "Fp8Dequantize", None)
    if dequantize is None or not hasattr(dequantize, "_unpack_fp4"):
        pytest.skip("this transformers decodes no FP4 experts")
    packed, scales = random_fp4((3, 40, 48))
    expected = dequantize(None)._dequantize_one(packed, scales, output_dtype=torch.float32)
    assert torch.equal(fp4_values(packed, scales, where="w"), expected)


@pytest.mark.parametrize(
    "shape", [(2, 256, 64), (3, 200, 160), (130, 48)], ids=["fused", "tails", "2d"]
)
def test_fp4_weights_requantize_to_e4m3_holding_the_same_values(shape):
    """Scales 2^-20 to 2^-7 apart by up to 2^13 within a block; zero blocks scaled by 1."""
    packed, scales = random_fp4(shape, exponents=(-20, -6))
    packed[..., :16] = 0  # zero values in every row: a block's smaller values stay exact
    values = fp4_values(packed, scales, where="w")
    quantized, block_scales = fp4_as_fp8(packed, scales, where="w")
    stacked = len(shape) == 3
    assert quantized.dtype == E4M3 and block_scales.dtype == torch.float32
    assert quantized.shape == values.shape
    rows, cols = shape[-2], 2 * shape[-1]
    assert block_scales.shape == (*shape[:-2], -(-rows // 128), -(-cols // 128))
    assert (torch.frexp(block_scales).mantissa == 0.5).all()  # powers of two
    dequantized = dequantize_weight_blocks(
        quantized if stacked else quantized[None], block_scales if stacked else block_scales[None]
    )
    assert torch.equal(dequantized if stacked else dequantized[0], values)


def test_a_block_e4m3_cannot_hold_is_refused_naming_it_and_converts_dequantized():
    packed, scales = random_fp4((2, 64, 64), exponents=(0, 1))
    spread = scales.view(torch.uint8).clone()
    spread[1, 3, 0] = 127 + 20
    packed[1, 3, :16] = 0x11  # 0.5 x 2^20 beside 6 x 2^0 of another row: 2^22 apart
    with pytest.raises(
        UnsupportedBlockError, match=r"experts.down_proj \(expert 1\): .* row 0, column 0 .* 2\^14"
    ):
        fp4_as_fp8(packed, spread.view(E8M0), where="experts.down_proj")
    tensors = {"experts.down_proj": packed, "experts.down_proj_scale_inv": spread.view(E8M0)}
    values = as_fp8_checkpoint(tensors, dequantize_fp4_to=torch.float32)
    assert list(values) == ["experts.down_proj"]
    assert torch.equal(
        values["experts.down_proj"], fp4_values(packed, spread.view(E8M0), where="w")
    )


def test_ue8m0_block_scales_read_as_their_float32_values():
    weight = torch.randn(200, 130).to(E4M3)
    exponent_bytes = torch.tensor([[120, 127], [130, 0]], dtype=torch.uint8)
    for scales in (exponent_bytes.view(E8M0), exponent_bytes):
        out = as_fp8_checkpoint({"w": weight, "w_scale_inv": scales})
        assert out["w"] is weight and out["w_scale_inv"].dtype == torch.float32
        assert torch.equal(
            out["w_scale_inv"], torch.ldexp(torch.ones(2, 2), exponent_bytes.int() - 127)
        )
    nan = exponent_bytes.clone()
    nan[1, 1] = 255
    with pytest.raises(ValueError, match="w_scale_inv holds the ue8m0 NaN"):
        as_fp8_checkpoint({"w": weight, "w_scale_inv": nan.view(E8M0)})


def disk_names(block_tensors: dict, *, prefix: str) -> dict:
    """A DeepSeek-V4 block's tensors under its checkpoint's names on disk: experts per expert
    (w1 gate, w3 up, w2 down), shared experts' w1/w3/w2, the correction bias at gate.bias,
    scales at `.scale` beside their `.weight`."""
    out = {}
    for key, tensor in block_tensors.items():
        scale = key.endswith("_scale_inv")
        name = key.removesuffix("_scale_inv")
        if name.startswith("experts."):
            _, projection = name.split(".")
            for expert in range(tensor.shape[0]):
                parts = tensor[expert]
                if projection == "gate_up_proj":
                    gate, up = parts.chunk(2, dim=0)
                    pairs = (("w1", gate), ("w3", up))
                else:
                    pairs = (("w2", parts),)
                for disk_name, part in pairs:
                    stem = f"{prefix}experts.{expert}.{disk_name}"
                    out[f"{stem}.scale" if scale else f"{stem}.weight"] = part.contiguous()
            continue
        for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
            name = name.replace(f"shared_experts.{ours}.", f"shared_experts.{theirs}.")
        name = name.replace("gate.e_score_correction_bias", "gate.bias")
        out[prefix + (name.removesuffix(".weight") + ".scale" if scale else name)] = tensor
    return out


@pytest.fixture(scope="module")
def deepseek_v4():
    """A tiny random DeepSeek-V4 model with experts of intermediate size 128 (FP8 shared experts
    stack their gate and up scales on the 128 grid)."""
    pytest.importorskip("transformers.models.deepseek_v4")
    from hf_family_walk import tiny_model

    small = tiny_model("deepseek_v4")
    config = copy.deepcopy(small.config)
    config.moe_intermediate_size = 128
    torch.manual_seed(0)
    model = type(small)(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.3 if "gate.weight" in name else 0.08)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.2)
    return model


def quantized_block(block) -> tuple[dict, dict]:
    """(a DeepSeek-V4 block's tensors as transformers holds them loaded from its checkpoint:
    FP4 routed experts, FP8 shared experts with ue8m0 block scales, under block-relative names;
    the values they hold, as the block's state_dict)."""
    quantized, values = {}, {}
    for key, tensor in block.state_dict().items():
        if key.startswith("experts."):
            packed, scales, values[key] = fp4_quantized(tensor)
        elif key.startswith("shared_experts."):
            packed, scales, values[key] = fp8_ue8m0_quantized(tensor)
        else:
            quantized[key] = values[key] = tensor
            continue
        quantized[key], quantized[key + "_scale_inv"] = packed, scales
    return quantized, values


@pytest.mark.parametrize("on_disk", [False, True], ids=["transformers-names", "disk-names"])
def test_a_deepseek_v4_fp4_checkpoint_converts_with_its_values(deepseek_v4, on_disk):
    """Layer 1 (a top-k layer) as a DeepSeek-V4 checkpoint holds it: FP4 routed experts, FP8
    shared experts with ue8m0 block scales, under transformers' names or as on disk (per expert
    w1/w3/w2, `ffn`, scales at `.scale`); converted as FP8 (the same values in e4m3) and in the
    activations' dtype, against the block holding the dequantized weights."""
    block = deepseek_v4.get_submodule("model.layers.1.mlp")
    assert not block.is_hash
    quantized, oracle_state = quantized_block(block)
    if on_disk:
        checkpoint = disk_names(quantized, prefix="layers.1.ffn.")
    else:
        checkpoint = {f"model.layers.1.mlp.{key}": value for key, value in quantized.items()}
    oracle = copy.deepcopy(block)
    oracle.load_state_dict(oracle_state)
    config = deepseek_v4.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
        "scale_fmt": "ue8m0",
        "expert_dtype": "fp4",
    }
    fp8 = from_hf_state_dict(checkpoint, config, layer=1, backend="reference")
    assert fp8.config.weight_dtype == "fp8" and fp8.config.shared_weight_dtype == "fp8"
    assert torch.equal(
        dequantize_weight_blocks(fp8.w13, fp8.w13_scale_inv), oracle_state["experts.gate_up_proj"]
    )
    assert torch.equal(
        dequantize_weight_blocks(fp8.w2, fp8.w2_scale_inv), oracle_state["experts.down_proj"]
    )
    exact = from_hf_state_dict(checkpoint, config, layer=1, backend="reference", weight_dtype=None)
    assert exact.w13.dtype == torch.float32 and exact.w13_scale_inv is None
    assert torch.equal(exact.w13, oracle_state["experts.gate_up_proj"])
    x = torch.randn(2, 7, deepseek_v4.config.hidden_size)
    with torch.no_grad():
        expected = oracle(x)
        assert relative_l2_error(exact(x), expected) < 1e-5
        actual = fp8(x)  # e4m3 activations too
    assert fp8_difference(actual, expected) <= 2e-3
    # another expert format is refused, naming it
    config["quantization_config"] = {**config["quantization_config"], "expert_dtype": "fp6"}
    with pytest.raises(UnsupportedBlockError, match="expert_dtype 'fp6'"):
        from_hf_state_dict(checkpoint, config, layer=1, backend="reference")


def with_fp4_experts(model, layer: int, *, fp8_shared: bool = True) -> tuple[torch.nn.Module, dict]:
    """`model` (a copy) whose block at `layer` holds its experts as transformers holds a
    DeepSeek-V4 checkpoint's on a GPU (FP8Experts of FP4 experts, FP8Linear shared experts,
    ue8m0 scales; `fp8_shared=False`: the shared experts as they are), and the block's state
    holding the values they stand for."""
    finegrained = pytest.importorskip("transformers.integrations.finegrained_fp8")
    if "expert_dtype" not in inspect.signature(finegrained.FP8Experts).parameters:
        pytest.skip("this transformers holds no FP4 experts")
    model = copy.deepcopy(model)
    block = model.get_submodule(f"model.layers.{layer}.mlp")
    values = block.state_dict()
    # as transformers' FP8 loading builds them, looking their implementation up by name
    experts_class = finegrained.use_experts_implementation(
        experts_class=finegrained.FP8Experts,
        experts_interface=finegrained.ALL_FP8_EXPERTS_FUNCTIONS,
        has_bias=False,
        has_gate=True,
    )
    experts = experts_class(
        config=model.config,
        block_size=(128, 128),
        scale_fmt="ue8m0",
        expert_dtype="fp4",
        swiglu_limit=getattr(block.experts, "limit", None),
    )
    quantized = {}
    for name in ("gate_up_proj", "down_proj"):
        packed, scales, values[f"experts.{name}"] = fp4_quantized(getattr(block.experts, name))
        quantized[name], quantized[f"{name}_scale_inv"] = packed, scales
    experts.load_state_dict(quantized)
    block.experts = experts
    for name in ("gate_proj", "up_proj", "down_proj") if fp8_shared else ():
        linear = getattr(block.shared_experts, name)
        fp8_linear = finegrained.FP8Linear(
            linear.in_features, linear.out_features, block_size=(128, 128), scale_fmt="ue8m0"
        )
        weight, scales, values[f"shared_experts.{name}.weight"] = fp8_ue8m0_quantized(
            linear.weight.detach()
        )
        fp8_linear.load_state_dict({"weight": weight, "weight_scale_inv": scales})
        setattr(block.shared_experts, name, fp8_linear)
    return model, values


def assert_same_fp4(actual: dict, expected: dict) -> None:
    """The same tensors, FP4 weights holding the same values in the same formats (a group of
    32 values may have two encodings: 3 x 2^s is 6 x 2^(s-1)), others the same bytes."""
    assert sorted(actual) == sorted(expected)
    fp4 = {key for key, t in expected.items() if t.dtype == torch.int8}
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype, key
        if key in fp4:
            scales = (actual[key + "_scale_inv"], expected[key + "_scale_inv"])
            assert torch.equal(
                fp4_values(actual[key], scales[0], where=key),
                fp4_values(tensor, scales[1], where=key),
            ), key
        elif key.removesuffix("_scale_inv") not in fp4:
            assert torch.equal(actual[key].view(torch.uint8), tensor.view(torch.uint8)), key


def test_a_live_deepseek_v4_block_with_fp4_experts_swaps_and_saves_its_values(deepseek_v4):
    """The block transformers builds from a DeepSeek-V4 checkpoint: swapped into an FP8 layer
    with the FP4 values, saved back as FP4 experts and ue8m0 scales holding those values,
    loaded from them, and unswapped to them."""
    model, values = with_fp4_experts(deepseek_v4, layer=1)
    name = "model.layers.1.mlp"
    block = model.get_submodule(name)
    held = {k: t.clone() for k, t in block.state_dict().items()}
    oracle = copy.deepcopy(deepseek_v4.get_submodule(name))
    oracle.load_state_dict(values)

    report = swap_moe_blocks(model, backend="reference")

    assert name in [entry.name for entry in report.swapped]
    layer = model.get_submodule(name)
    assert layer.config.weight_dtype == "fp8"
    x = torch.randn(2, 7, deepseek_v4.config.hidden_size)
    with torch.no_grad():
        assert relative_l2_error(layer(x), oracle(x)) < 1e-5
    saved = layer.state_dict()
    assert_same_fp4(saved, held)
    layer.load_state_dict(saved)
    with torch.no_grad():
        assert relative_l2_error(layer(x), oracle(x)) < 1e-5
    unswap_moe_blocks(model)
    restored = model.get_submodule(name)
    assert type(restored.experts).__name__ == "FP8Experts"
    assert_same_fp4(restored.state_dict(), held)


def test_fp4_experts_run_on_megamoes_experts_implementation(deepseek_v4):
    # FP8Linear shared experts would run transformers' GPU kernels: the block's own code
    model, values = with_fp4_experts(deepseek_v4, layer=1, fp8_shared=False)
    register_experts_implementation(backend="reference")
    model.set_experts_implementation("megamoe")
    block = model.get_submodule("model.layers.1.mlp")
    oracle = copy.deepcopy(deepseek_v4.get_submodule("model.layers.1.mlp"))
    oracle.load_state_dict(values)
    x = torch.randn(2, 7, deepseek_v4.config.hidden_size)
    with torch.no_grad():
        assert relative_l2_error(block(x), oracle(x)) < 1e-5


def test_scales_on_disk_are_named_as_transformers_names_them():
    """`X.scale` beside a one-byte `X.weight` is its block scales; a norm's `.scale` (beside no
    weight, or a full-precision one) stays."""
    packed, scales = random_fp4((4, 32))
    tensors = {
        "experts.0.w1.weight": packed,
        "experts.0.w1.scale": scales,
        "q_norm.scale": torch.ones(4),
        "proj.weight": torch.ones(4, 4),
        "proj.scale": torch.ones(4),
    }
    renamed = with_scales_inv_names(tensors)
    assert sorted(renamed) == [
        "experts.0.w1.weight",
        "experts.0.w1.weight_scale_inv",
        "proj.scale",
        "proj.weight",
        "q_norm.scale",
    ]
    assert renamed["experts.0.w1.weight_scale_inv"] is scales


def test_ue8m0_scales_as_uint8_bytes_read_as_e8m0_ones():
    packed, scales = random_fp4((2, 130, 64))
    expected = fp4_as_fp8(packed, scales, where="w")
    for actual, wanted in zip(
        fp4_as_fp8(packed, scales.view(torch.uint8), where="w"), expected, strict=True
    ):
        assert torch.equal(actual.view(torch.uint8), wanted.view(torch.uint8))


@pytest.mark.gpu
def test_the_conversions_on_a_gpu_give_the_cpus_bytes():
    """transformers loads a DeepSeek-V4 model onto the GPU with its FP4 experts and ue8m0 scales
    there, and megamoe converts them where they lie: each conversion on CUDA tensors gives the
    CPU's bytes (values, e4m3 weights and block scales, ue8m0 block scales, the way back to FP4,
    the refusals)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    packed, scales = random_fp4((3, 200, 160), exponents=(-20, -6))
    packed[..., :16] = 0
    on_gpu = packed.cuda(), scales.cuda()
    assert torch.equal(fp4_values(*on_gpu, where="w").cpu(), fp4_values(packed, scales, where="w"))
    quantized, block_scales = fp4_as_fp8(packed, scales, where="w")
    gpu_quantized, gpu_block_scales = fp4_as_fp8(*on_gpu, where="w")
    assert gpu_quantized.is_cuda and gpu_block_scales.is_cuda
    assert torch.equal(gpu_quantized.cpu().view(torch.uint8), quantized.view(torch.uint8))
    assert torch.equal(gpu_block_scales.cpu(), block_scales)
    like = (packed.dtype, scales.dtype)
    back = fp8_as_fp4(gpu_quantized, gpu_block_scales, like=like, where="w")
    expected = fp8_as_fp4(quantized, block_scales, like=like, where="w")
    for actual, wanted in zip(back, expected, strict=True):
        assert actual.is_cuda and torch.equal(
            actual.cpu().view(torch.uint8), wanted.view(torch.uint8)
        )
    assert torch.equal(fp4_values(*back, where="w").cpu(), fp4_values(packed, scales, where="w"))

    weight, ue8m0, _ = fp8_ue8m0_quantized(torch.randn(200, 130))
    tensors = {"w": weight, "w_scale_inv": ue8m0, "e": packed, "e_scale_inv": scales}
    on_cpu = as_fp8_checkpoint(tensors)
    converted = as_fp8_checkpoint({key: tensor.cuda() for key, tensor in tensors.items()})
    assert list(converted) == list(on_cpu)
    for key, tensor in converted.items():
        assert tensor.is_cuda and tensor.dtype == on_cpu[key].dtype
        assert torch.equal(tensor.cpu().view(torch.uint8), on_cpu[key].view(torch.uint8))

    spread = scales.view(torch.uint8).clone()
    spread[1, 3, 0] = 127 + 20
    packed[1, 3, :16] = 0x11  # 0.5 x 2^20 beside values near 2^-6: more binades than e4m3 holds
    with pytest.raises(UnsupportedBlockError, match=r"w \(expert 1\): .* row 0, column 0"):
        fp4_as_fp8(packed.cuda(), spread.view(E8M0).cuda(), where="w")
    nan = ue8m0.view(torch.uint8).clone()
    nan[0, 0] = 255
    with pytest.raises(ValueError, match="w_scale_inv holds the ue8m0 NaN"):
        as_fp8_checkpoint({"w": weight.cuda(), "w_scale_inv": nan.view(E8M0).cuda()})
