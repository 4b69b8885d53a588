"""FP8 checkpoints through the Hugging Face path: e4m3 experts with one scale per 128 x 128 block
(DeepSeek-V3/R1, the Qwen3 FP8 releases) swapped, converted, saved and reloaded as they are.

The checkpoints are tiny random models written as the Hub holds FP8 releases: every weight
transformers' FP8 integration quantizes (its Linear layers but lm_head, the experts) in e4m3 per
expert on disk with its `weight_scale_inv`, and DeepSeek-V3's quantization_config. transformers
loads them into FP8Experts and FP8Linear modules where a GPU is; on a CPU it dequantizes them as
they load (and wants accelerate for it). `fp8_modules_on_cpu` turns that environment check off, so
a CPU builds the FP8 modules a GPU gets: their weights load (through transformers' own merge of the
per-expert tensors), their kernels do not run here, and the swapped layers compute on the
reference backend. The oracle is the unquantized model class holding the dequantized weights.
"""

from __future__ import annotations

import json
import re
import weakref

import pytest
import torch
from megamoe_kernels import dequantize_weight_blocks, quantize_weight_blocks
from megamoe_kernels.reference import fp8_difference, relative_l2_error

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

from megamoe_torch import (  # noqa: E402
    UnsupportedBlockError,
    from_hf,
    from_hf_state_dict,
    hf_state_dict_from_megamoe,
    register_experts_implementation,
    swap_moe_blocks,
    unswap_moe_blocks,
)
from megamoe_torch.hf import moe_layer_indices  # noqa: E402
from test_hf_models import (  # noqa: E402
    MODEL_CLASSES,
    moe_blocks,
    tiny_model,
    transformers_before,
)

E4M3 = torch.float8_e4m3fn
HIDDEN = 256
FAMILIES = ("qwen3_moe", "deepseek_v3")
# DeepSeek-V3's, as its config.json holds it
QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
PER_EXPERT_WEIGHT = re.compile(r".*\.experts\.\d+\.\w+\.weight")
# transformers before 5.23 saves FP8Experts' per-expert block scales without their size-1 dims
# (its SplitModulelist squeezes all of them: a [2, 1] grid is saved as [2]) and so reads its own
# save back with other scale shapes, whether megamoe swapped the model or not
SAVES_FP8_EXPERTS_AS_LOADED = not transformers_before("5.23.0")


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of an e4m3 tensor (torch.equal on e4m3 compares values: -0 == 0)."""
    return tensor.view(torch.uint8) if tensor.dtype == E4M3 else tensor


def assert_same_bytes(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype, key
        assert torch.equal(raw(actual[key]), raw(tensor)), key


@pytest.fixture
def fp8_modules_on_cpu(monkeypatch):
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    monkeypatch.setattr(FineGrainedFP8HfQuantizer, "validate_environment", lambda *a, **k: None)


def write_fp8_checkpoint(
    family: str,
    path,
    *,
    moe_intermediate_size: int = 128,
    scale_dtype: torch.dtype = torch.float32,
    quantization_config: dict | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[dict[str, torch.Tensor], dict]:
    """A tiny random `family` model saved at `path` as an FP8 checkpoint, its unquantized
    tensors in `dtype`: (its tensors, its config.json)."""
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    model = tiny_model(family, hidden_size=HIDDEN, moe_intermediate_size=moe_intermediate_size)
    model.to(dtype).save_pretrained(path)
    unquantized = safetensors.load_file(path / "model.safetensors")
    with torch.device("meta"):  # which Linear weights transformers' FP8 integration quantizes
        fp8_model = transformers.AutoModelForCausalLM.from_config(model.config)
    replace_with_fp8_linear(
        fp8_model,
        modules_to_not_convert=["lm_head"],
        quantization_config=transformers.FineGrainedFP8Config(weight_block_size=[128, 128]),
        pre_quantized=True,
    )
    linear = {
        key.removesuffix("_scale_inv")
        for key in fp8_model.state_dict()
        if key.endswith(".weight_scale_inv")
    }
    checkpoint = {}
    for key, tensor in unquantized.items():
        if key in linear or PER_EXPERT_WEIGHT.fullmatch(key):
            quantized, scales = quantize_weight_blocks(tensor.float()[None])
            checkpoint[key], checkpoint[f"{key}_scale_inv"] = (
                quantized[0],
                scales[0].to(scale_dtype),
            )
        else:
            checkpoint[key] = tensor
    safetensors.save_file(checkpoint, path / "model.safetensors", metadata={"format": "pt"})
    config_json = json.loads((path / "config.json").read_text())
    config_json["quantization_config"] = quantization_config or QUANTIZATION_CONFIG
    (path / "config.json").write_text(json.dumps(config_json))
    return checkpoint, config_json


def dequantized_model(family: str, checkpoint: dict, config_json: dict, path) -> torch.nn.Module:
    """The unquantized model class holding the values `checkpoint` stands for: the oracle."""
    values = {
        key: dequantize_weight_blocks(t[None], checkpoint[f"{key}_scale_inv"].float()[None])[0]
        if t.dtype == E4M3
        else t.float()
        for key, t in checkpoint.items()
        if not key.endswith("_scale_inv")
    }
    path.mkdir()
    config = {k: v for k, v in config_json.items() if k != "quantization_config"}
    config["dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(config))
    safetensors.save_file(values, path / "model.safetensors", metadata={"format": "pt"})
    model_class = getattr(transformers, MODEL_CLASSES[family])
    return model_class.from_pretrained(path, dtype=torch.float32).eval()


def load_fp8_model(family: str, path, **kwargs) -> torch.nn.Module:
    return getattr(transformers, MODEL_CLASSES[family]).from_pretrained(path, **kwargs).eval()


@pytest.mark.parametrize("family", FAMILIES)
def test_an_fp8_model_swaps_keeping_its_e4m3_experts_and_scales(
    family, tmp_path, fp8_modules_on_cpu
):
    checkpoint, config_json = write_fp8_checkpoint(family, tmp_path / "fp8")
    model = load_fp8_model(family, tmp_path / "fp8")
    name, block = moe_blocks(model)[-1]
    assert type(block.experts).__name__ == "FP8Experts"  # what transformers builds on a GPU

    report = swap_moe_blocks(model, backend="reference")

    assert not report.skipped and "fp8 experts" in str(report)
    layer = model.get_submodule(name)
    assert layer.config.weight_dtype == "fp8" and layer.w13.dtype == E4M3
    prefix = f"{name}.experts."
    intermediate = layer.config.intermediate_size
    for expert in (0, layer.config.num_experts - 1):  # the checkpoint's bytes, stacked
        gate, up, down = (
            f"{prefix}{expert}.{projection}.weight"
            for projection in ("gate_proj", "up_proj", "down_proj")
        )
        assert torch.equal(raw(layer.w13[expert, :intermediate]), raw(checkpoint[gate]))
        assert torch.equal(raw(layer.w13[expert, intermediate:]), raw(checkpoint[up]))
        assert torch.equal(raw(layer.w2[expert]), raw(checkpoint[down]))
        scales = torch.cat([checkpoint[f"{gate}_scale_inv"], checkpoint[f"{up}_scale_inv"]])
        assert torch.equal(layer.w13_scale_inv[expert], scales)
        assert torch.equal(layer.w2_scale_inv[expert], checkpoint[f"{down}_scale_inv"])
    if family == "deepseek_v3":  # its shared experts are FP8 too, and stay so
        assert layer.config.shared_weight_dtype == "fp8"
        shared = f"{name}.shared_experts.up_proj.weight"
        assert torch.equal(raw(layer.shared_experts.up_proj.weight), raw(checkpoint[shared]))
    oracle = dequantized_model(family, checkpoint, config_json, tmp_path / "oracle")
    x = torch.randn(2, 9, HIDDEN)
    with torch.no_grad():
        assert relative_l2_error(layer(x), oracle.get_submodule(name)(x)) < 1e-5


def test_an_fp8_model_in_bf16_takes_bf16_hidden_states(tmp_path, fp8_modules_on_cpu):
    # DeepSeek-V3's router in fp32 next to bf16 hidden states: the hidden states' dtype comes
    # from the model. transformers keeps it so from 5.24 on (the model class lists gate.weight
    # in _keep_in_fp32_modules_strict); older releases load it in bf16, and it is put in fp32 here
    checkpoint, config_json = write_fp8_checkpoint("deepseek_v3", tmp_path / "fp8")
    model = load_fp8_model("deepseek_v3", tmp_path / "fp8", dtype=torch.bfloat16)
    name, block = moe_blocks(model)[-1]
    kept_in_fp32 = "gate.weight" in model._keep_in_fp32_modules_strict
    assert block.gate.weight.dtype == (torch.float32 if kept_in_fp32 else torch.bfloat16)
    block.gate.float()

    layer = from_hf(block, backend="reference")

    assert layer.activation_dtype == torch.bfloat16 and layer.w13.dtype == E4M3
    oracle = dequantized_model("deepseek_v3", checkpoint, config_json, tmp_path / "oracle")
    x = torch.randn(3, 5, HIDDEN, dtype=torch.bfloat16)
    with torch.no_grad():
        y = layer(x)
        assert y.dtype == torch.bfloat16
        # the same tokens: the router computes in fp32 on both sides
        assert relative_l2_error(y, oracle.get_submodule(name)(x.float())) < 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_a_swapped_fp8_model_saves_the_checkpoint_it_loaded_bit_for_bit(
    family, tmp_path, fp8_modules_on_cpu
):
    checkpoint, _ = write_fp8_checkpoint(family, tmp_path / "fp8")
    model = load_fp8_model(family, tmp_path / "fp8")
    unswapped_state = {key: tensor.clone() for key, tensor in model.state_dict().items()}
    model.save_pretrained(tmp_path / "unswapped")
    swap_moe_blocks(model, backend="reference")

    # the FP8 model's own names in memory, on disk what transformers saves of the unswapped model
    assert_same_bytes(model.state_dict(), unswapped_state)
    model.save_pretrained(tmp_path / "saved")
    saved = safetensors.load_file(tmp_path / "saved" / "model.safetensors")
    assert_same_bytes(saved, safetensors.load_file(tmp_path / "unswapped" / "model.safetensors"))
    if not SAVES_FP8_EXPERTS_AS_LOADED:
        pytest.skip(
            f"transformers {transformers.__version__} saves FP8 experts' block scales squeezed "
            "(before 5.23): no checkpoint loaded as saved to compare with"
        )
    assert_same_bytes(saved, checkpoint)

    reloaded, loading_info = getattr(transformers, MODEL_CLASSES[family]).from_pretrained(
        tmp_path / "saved", output_loading_info=True
    )
    assert loading_info["missing_keys"] == loading_info["unexpected_keys"] == set()
    swap_moe_blocks(reloaded, backend="reference")
    assert_same_bytes(reloaded.state_dict(), unswapped_state)
    # and back to transformers' FP8 blocks, holding the same bytes
    unswap_moe_blocks(reloaded)
    _, block = moe_blocks(reloaded)[-1]
    assert type(block.experts).__name__ == "FP8Experts"
    assert_same_bytes(reloaded.state_dict(), unswapped_state)


@pytest.mark.parametrize(
    "family, scale_dtype", [("qwen3_moe", torch.bfloat16), ("deepseek_v3", torch.float32)]
)
def test_an_fp8_checkpoint_converts_without_the_model(family, scale_dtype, tmp_path):
    checkpoint, config_json = write_fp8_checkpoint(
        family, tmp_path / "fp8", scale_dtype=scale_dtype
    )
    layer_index = moe_layer_indices(config_json)[-1]
    prefix = f"model.layers.{layer_index}.mlp."

    layer = from_hf_state_dict(checkpoint, config_json, layer=layer_index, backend="reference")

    assert layer.config.weight_dtype == "fp8"
    on_disk = {k[len(prefix) :]: v for k, v in checkpoint.items() if k.startswith(prefix)}
    exported = hf_state_dict_from_megamoe(layer.state_dict(), family=family, layout="per_expert")
    # the same bytes; bfloat16 scales come back as the float32 values they are
    assert_same_bytes(
        exported,
        {k: v.float() if k.endswith("_scale_inv") else v for k, v in on_disk.items()},
    )
    oracle = dequantized_model(family, checkpoint, config_json, tmp_path / "oracle")
    _, oracle_block = moe_blocks(oracle)[-1]
    x = torch.randn(2, 7, HIDDEN)
    with torch.no_grad():
        assert relative_l2_error(layer(x), oracle_block(x)) < 1e-5

    # asked for the activations' dtype: the dequantized values
    dequantized = from_hf_state_dict(
        checkpoint, config_json, layer=layer_index, backend="reference", weight_dtype=None
    )
    assert dequantized.w13.dtype == torch.float32 and dequantized.w13_scale_inv is None
    assert torch.equal(dequantized.w2, dequantize_weight_blocks(layer.w2, layer.w2_scale_inv))
    with torch.no_grad():
        assert relative_l2_error(dequantized(x), oracle_block(x)) < 1e-5


def test_a_full_precision_model_stays_so_unless_fp8_is_asked():
    model = tiny_model("qwen3_moe", hidden_size=HIDDEN, moe_intermediate_size=128)
    _, block = moe_blocks(model)[0]
    assert from_hf(block, backend="reference").w13.dtype == torch.float32

    layer = from_hf(block, backend="reference", weight_dtype="fp8")

    expected_w13, expected_scales = quantize_weight_blocks(block.experts.gate_up_proj.detach())
    assert torch.equal(raw(layer.w13), raw(expected_w13))
    assert torch.equal(layer.w13_scale_inv, expected_scales)
    with pytest.raises(ValueError, match=r"weight_dtype must be one of .*got 'int8'"):
        from_hf(block, weight_dtype="int8")


def test_swapping_to_fp8_lets_each_blocks_bf16_experts_go_before_the_next_block(monkeypatch):
    """A bf16 model swapped with weight_dtype="fp8" holds one block's bf16 experts beside the
    FP8 ones at a time, not every block's until the swap ends (which ran Qwen3-30B-A3B's whole
    61 GB model out of an 80 GB GPU's memory)."""
    import megamoe_torch.hf.swap as swap_module

    model = tiny_model(
        "qwen3_moe", hidden_size=HIDDEN, moe_intermediate_size=128, num_hidden_layers=3
    )
    originals = [weakref.ref(block) for _, block in moe_blocks(model)]
    assert len(originals) == 3
    alive_at_each_conversion = []
    convert_block = swap_module.convert_block

    def convert_and_count(block, **kwargs):
        alive_at_each_conversion.append(
            sum(ref() is not None and ref() is not block for ref in originals)
        )
        return convert_block(block, **kwargs)

    monkeypatch.setattr(swap_module, "convert_block", convert_and_count)
    report = swap_moe_blocks(model, backend="reference", weight_dtype="fp8")

    assert [entry.experts for entry in report.swapped] == ["fp8"] * 3
    # the blocks not yet converted are alive (the model holds them); the converted ones are not
    assert alive_at_each_conversion == [2, 1, 0]
    assert all(ref() is None for ref in originals)


def test_swapped_layers_take_checkpoints_of_the_other_precision(tmp_path):
    checkpoint, config_json = write_fp8_checkpoint("qwen3_moe", tmp_path / "fp8")
    fp8_model = from_hf_state_dict(checkpoint, config_json, layer=1, backend="reference")

    # a full-precision model takes the FP8 checkpoint dequantized
    model = tiny_model("qwen3_moe", hidden_size=HIDDEN, moe_intermediate_size=128)
    swap_moe_blocks(model, backend="reference")
    moe_tensors = {key: tensor for key, tensor in checkpoint.items() if ".mlp." in key}
    result = model.load_state_dict(moe_tensors, strict=False)
    assert result.unexpected_keys == []
    layer = model.model.layers[1].mlp
    assert layer.w13.dtype == torch.float32
    expected = dequantize_weight_blocks(fp8_model.w13, fp8_model.w13_scale_inv)
    assert torch.equal(layer.w13, expected)

    # an FP8 model takes a full-precision checkpoint quantized
    source = tiny_model("qwen3_moe", hidden_size=HIDDEN, moe_intermediate_size=128)
    target = tiny_model("qwen3_moe", hidden_size=HIDDEN, moe_intermediate_size=128)
    swap_moe_blocks(target, backend="reference", weight_dtype="fp8")
    target.load_state_dict(source.state_dict())
    gate_up = source.model.layers[1].mlp.experts.gate_up_proj.detach()
    expected_w13, expected_scales = quantize_weight_blocks(gate_up)
    assert torch.equal(raw(target.model.layers[1].mlp.w13), raw(expected_w13))
    assert torch.equal(target.model.layers[1].mlp.w13_scale_inv, expected_scales)
    state = target.state_dict()  # under transformers' names, with the scales beside
    assert torch.equal(state["model.layers.1.mlp.experts.gate_up_proj_scale_inv"], expected_scales)


def test_an_expert_parallel_fp8_layer_loads_the_scales_of_its_experts(monkeypatch, tmp_path):
    # rank 1 of 2 without a process group: the layer asks only which experts are its own
    monkeypatch.setattr(
        "megamoe_torch.layer.local_expert_range",
        lambda num_experts, group: range(num_experts) if group is None else range(4, 8),
    )
    checkpoint, config_json = write_fp8_checkpoint("qwen3_moe", tmp_path / "fp8")
    full = from_hf_state_dict(checkpoint, config_json, layer=1, backend="reference")
    layer = from_hf_state_dict(
        checkpoint, config_json, layer=1, backend="reference", process_group=object()
    )
    assert layer.expert_parallel and layer.config.weight_dtype == "fp8"
    assert torch.equal(raw(layer.w13), raw(full.w13[4:8]))
    assert torch.equal(layer.w13_scale_inv, full.w13_scale_inv[4:8])


def test_an_fp8_models_experts_run_on_megamoes_experts_implementation(tmp_path, fp8_modules_on_cpu):
    """transformers' FP8Experts look their implementation up in an interface of their own:
    "megamoe" is registered there too, and computes the checkpoint's e4m3 experts and scales
    (the module's own tensors, shared) as the block holding the dequantized weights does."""
    checkpoint, config_json = write_fp8_checkpoint("qwen3_moe", tmp_path / "fp8")
    model = load_fp8_model("qwen3_moe", tmp_path / "fp8")
    oracle = dequantized_model("qwen3_moe", checkpoint, config_json, tmp_path / "oracle")
    register_experts_implementation(backend="reference")
    model.set_experts_implementation("megamoe")
    name, block = moe_blocks(model)[-1]
    assert type(block.experts).__name__ == "FP8Experts"
    x = torch.randn(2, 7, HIDDEN)
    with torch.no_grad():  # the block alone: FP8Linear layers elsewhere run GPU kernels
        actual, expected = block(x), oracle.get_submodule(name)(x)
    assert relative_l2_error(actual, expected) < 1e-5
    from megamoe_torch.hf.experts_implementation import _layer

    layer = _layer(block.experts, model.config.num_experts_per_tok, torch.float32)
    assert layer.config.weight_dtype == "fp8" and layer.w13 is block.experts.gate_up_proj
    assert layer.activation_dtype == torch.float32  # the model's, which e4m3 does not show


def test_fp8_recipes_megamoe_does_not_compute_are_refused_naming_them(tmp_path, fp8_modules_on_cpu):
    checkpoint, config_json = write_fp8_checkpoint("qwen3_moe", tmp_path / "fp8")
    for field, value, expected in (
        ("weight_block_size", [64, 64], r"weight_block_size \[64, 64\]"),
        ("activation_scheme", "static", "activation_scheme 'static'"),
        ("scale_fmt", "nvfp4", "scale_fmt 'nvfp4'"),
        ("quant_method", "gptq", "quant_method 'gptq'"),
    ):
        config = {**config_json, "quantization_config": {**QUANTIZATION_CONFIG, field: value}}
        with pytest.raises(UnsupportedBlockError, match=expected):
            from_hf_state_dict(checkpoint, config, layer=1)
    # a live FP8 block of another block size is left in place, with the reason
    model = load_fp8_model("qwen3_moe", tmp_path / "fp8")
    model.model.layers[1].mlp.experts.block_size = [64, 64]
    report = swap_moe_blocks(model, backend="reference")
    assert [entry.name for entry in report.skipped] == ["model.layers.1.mlp"]
    assert "weight_block_size [64, 64]" in report.skipped[0].reason


def test_an_intermediate_size_off_the_128_grid_fails_closed_unless_dequantized(tmp_path):
    checkpoint, config_json = write_fp8_checkpoint(
        "deepseek_v3", tmp_path / "fp8", moe_intermediate_size=96
    )
    with pytest.raises(ValueError, match="intermediate size 96 is not a multiple of 128"):
        from_hf_state_dict(checkpoint, config_json, layer=1)

    layer = from_hf_state_dict(checkpoint, config_json, layer=1, weight_dtype=None)

    oracle = dequantized_model("deepseek_v3", checkpoint, config_json, tmp_path / "oracle")
    x = torch.randn(9, HIDDEN)
    with torch.no_grad():
        assert relative_l2_error(layer(x), oracle.model.layers[1].mlp(x)) < 1e-5


def test_e4m3_weights_without_their_scales_are_refused_naming_them(tmp_path):
    checkpoint, config_json = write_fp8_checkpoint("deepseek_v3", tmp_path / "fp8")
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    without = {k: v for k, v in checkpoint.items() if k != f"{key}_scale_inv"}
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj\.weight is e4m3 without its block"):
        from_hf_state_dict(without, config_json, layer=1)
    shared = "model.layers.1.mlp.shared_experts.down_proj.weight_scale_inv"
    without = {k: v for k, v in checkpoint.items() if k != shared}
    with pytest.raises(ValueError, match=r"shared_experts\.down_proj\.weight is e4m3 without"):
        from_hf_state_dict(without, config_json, layer=1)
    # scales of 64 x 64 blocks
    wrong = dict(checkpoint, **{f"{key}_scale_inv": torch.rand(2, 4)})
    with pytest.raises(ValueError, match=r"up_proj\.weight_scale_inv is torch.float32 \[2, 4\]"):
        from_hf_state_dict(wrong, config_json, layer=1)


def test_unswapping_a_model_whose_experts_changed_precision_is_refused(
    tmp_path, fp8_modules_on_cpu
):
    write_fp8_checkpoint("qwen3_moe", tmp_path / "fp8")
    model = load_fp8_model("qwen3_moe", tmp_path / "fp8")
    swap_moe_blocks(model, backend="reference", weight_dtype=None)
    assert model.model.layers[1].mlp.w13.dtype == torch.float32
    with pytest.raises(RuntimeError, match="held e4m3 ones"):
        unswap_moe_blocks(model)
    model = tiny_model("qwen3_moe", hidden_size=HIDDEN, moe_intermediate_size=128)
    swap_moe_blocks(model, backend="reference", weight_dtype="fp8")
    with pytest.raises(RuntimeError, match="held full-precision ones"):
        unswap_moe_blocks(model)


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("family", FAMILIES)
def test_an_fp8_checkpoint_runs_on_the_fp8_kernels(family, tmp_path):
    # a bf16 model's FP8 checkpoint, as the Hub holds them: bf16 router (DeepSeek-V3's kept in
    # fp32 by transformers, not here), e4m3 experts, float32 scales
    checkpoint, config_json = write_fp8_checkpoint(family, tmp_path / "fp8", dtype=torch.bfloat16)
    layer_index = moe_layer_indices(config_json)[-1]
    layer, oracle = (
        from_hf_state_dict(
            checkpoint, config_json, layer=layer_index, device="cuda", backend=backend
        )
        for backend in ("cutedsl", "reference")  # the reference: the dequantized weights
    )
    assert layer.activation_dtype == torch.bfloat16 and layer.w13.dtype == E4M3
    x = torch.randn(300, HIDDEN, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y, expected = layer(x), oracle(x)
    assert layer.backend == "cutedsl"
    assert fp8_difference(y.float(), expected.float()) <= 2e-3
    assert relative_l2_error(y, expected) <= 6e-2
