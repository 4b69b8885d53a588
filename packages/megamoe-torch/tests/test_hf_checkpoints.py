"""Swapped transformers models save and load under the Hugging Face names, and unswap."""

from __future__ import annotations

import pytest
import torch
from megamoe_kernels.reference import relative_l2_error

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

from megamoe_torch import (  # noqa: E402
    from_hf_state_dict,
    megamoe_state_dict_from_hf,
    swap_moe_blocks,
    unswap_moe_blocks,
)
from megamoe_torch.hf import SwappedMoEBlock, moe_layer_indices  # noqa: E402
from test_hf_models import (  # noqa: E402
    FAMILIES,
    MODEL_CLASSES,
    VOCAB,
    moe_blocks,
    router_logits_pairs,
    tiny_model,
)


def _cloned_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: tensor.clone() for key, tensor in model.state_dict().items()}


# logits of two models with equal weights in other allocations may differ in the last bit (CPU
# matmul kernels depend on alignment): those compare with assert_close's fp32 tolerance, weights
# and one model's logits before and after with torch.equal


def _assert_same_tensors(actual: dict, expected: dict) -> None:
    assert sorted(actual) == sorted(expected)
    for key, tensor in expected.items():
        assert actual[key].dtype == tensor.dtype, key
        assert torch.equal(actual[key], tensor), key


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_swapped_model_loads_into_the_original_class(family, tmp_path):
    model = tiny_model(family)
    original_state = _cloned_state_dict(model)
    input_ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        expected_logits = model(input_ids).logits

    swap_moe_blocks(model, backend="reference")
    _assert_same_tensors(model.state_dict(), original_state)
    model.save_pretrained(tmp_path)

    model_class = getattr(transformers, MODEL_CLASSES[family])
    loaded, loading_info = model_class.from_pretrained(tmp_path, output_loading_info=True)
    assert loading_info["missing_keys"] == loading_info["unexpected_keys"] == set()
    assert loading_info["mismatched_keys"] == set()
    assert not any(isinstance(module, SwappedMoEBlock) for module in loaded.modules())
    _assert_same_tensors(loaded.state_dict(), original_state)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids).logits, expected_logits)
        swap_moe_blocks(loaded, backend="reference")
        torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_original_state_dict_loads_into_a_swapped_model(family):
    source = tiny_model(family)
    source_state = _cloned_state_dict(source)
    target = tiny_model(family)  # other random weights
    input_ids = torch.randint(0, VOCAB, (2, 9))
    swap_moe_blocks(source, backend="reference")
    swap_moe_blocks(target, backend="reference")

    result = target.load_state_dict(source_state)

    assert result.missing_keys == result.unexpected_keys == []
    _assert_same_tensors(target.state_dict(), source_state)
    with torch.no_grad():
        torch.testing.assert_close(target(input_ids).logits, source(input_ids).logits)


@pytest.mark.parametrize("family", ["qwen2_moe", "deepseek_v3"])
def test_per_expert_checkpoint_tensors_load_into_a_swapped_model(family, tmp_path):
    source = tiny_model(family)
    source.save_pretrained(tmp_path)
    on_disk = safetensors.load_file(tmp_path / "model.safetensors")
    assert any(".experts.0." in key for key in on_disk)  # per-expert names, as on the Hub
    target = tiny_model(family)
    swap_moe_blocks(target, backend="reference")

    result = target.load_state_dict(on_disk)

    assert result.missing_keys == result.unexpected_keys == []
    _assert_same_tensors(target.state_dict(), source.state_dict())


@pytest.mark.parametrize("family", FAMILIES)
def test_unswap_restores_the_blocks_with_the_current_weights_and_hooks(family):
    model = tiny_model(family)
    block_classes = [type(block) for _, block in moe_blocks(model)]
    other = tiny_model(family)
    input_ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        model(input_ids, output_router_logits=True)  # transformers installs its capture hooks
        expected = other(input_ids, output_router_logits=True)
    swap_moe_blocks(model, backend="reference")
    model.load_state_dict(other.state_dict())  # weights changed after the swap

    names = unswap_moe_blocks(model)

    assert names == [name for name, _ in moe_blocks(other)]
    assert [type(block) for _, block in moe_blocks(model)] == block_classes
    _assert_same_tensors(model.state_dict(), other.state_dict())
    with torch.no_grad():
        actual = model(input_ids, output_router_logits=True)
    torch.testing.assert_close(actual.logits, expected.logits)
    for got, want in router_logits_pairs(family, actual, expected):
        torch.testing.assert_close(got, want)


def test_swap_again_after_unswap_and_weights_are_shared_not_copied():
    model = tiny_model("qwen3_moe")
    input_ids = torch.randint(0, VOCAB, (1, 7))
    swap_moe_blocks(model, backend="reference")
    with torch.no_grad():
        swapped_logits = model(input_ids).logits
    layer = model.model.layers[0].mlp
    unswap_moe_blocks(model)
    assert model.model.layers[0].mlp.experts.gate_up_proj.data_ptr() == layer.w13.data_ptr()
    swap_moe_blocks(model, backend="reference")
    with torch.no_grad():
        assert torch.equal(model(input_ids).logits, swapped_logits)


def test_expert_parallel_layer_loads_its_slice_and_refuses_to_save(monkeypatch):
    # rank 1 of 2 without a process group: the layer asks only which experts are its own
    monkeypatch.setattr(
        "megamoe_torch.layer.local_expert_range",
        lambda num_experts, group: range(num_experts) if group is None else range(4, 8),
    )
    model = tiny_model("qwen3_moe")
    original_state = _cloned_state_dict(model)
    swap_moe_blocks(model, backend="reference", process_group=object())
    layer = model.model.layers[0].mlp
    assert layer.expert_parallel
    with torch.no_grad():
        layer.w13.zero_()

    model.load_state_dict(original_state)

    gate_up = original_state["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(layer.w13, gate_up[4:8])
    with pytest.raises(RuntimeError, match=r"expert-parallel .* experts 4\.\.7 of 8"):
        model.state_dict()
    with pytest.raises(RuntimeError, match="expert-parallel"):
        unswap_moe_blocks(model)
    layer.hf_checkpoint_format = False
    assert torch.equal(layer.state_dict()["w13"], gate_up[4:8])


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_mis_shaped_checkpoint_tensor_is_named_with_both_shapes(layout, tmp_path):
    model = tiny_model("mixtral")
    model.save_pretrained(tmp_path)
    layer_index = moe_layer_indices(model.config)[-1]
    if layout == "per_expert":
        state = safetensors.load_file(tmp_path / "model.safetensors")
        key = f"model.layers.{layer_index}.block_sparse_moe.experts.3.w1.weight"
    else:
        state = dict(model.state_dict())
        key = f"model.layers.{layer_index}.mlp.experts.down_proj"
    expected_shape = tuple(state[key].shape)
    state[key] = state[key][..., :-1]
    shape = tuple(state[key].shape)
    config_json = model.config.to_dict()

    with pytest.raises(ValueError) as error:
        from_hf_state_dict(state, config_json, layer=layer_index, backend="reference")

    message = str(error.value)
    assert key in message and str(shape) in message and str(expected_shape) in message
    assert "stack expects" not in message


def test_mis_shaped_expert_without_a_config_is_named_against_expert_zero():
    _, block = moe_blocks(tiny_model("qwen3_moe"))[0]
    gate_up_EIH, down_EHI = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    intermediate = gate_up_EIH.shape[1] // 2
    per_expert = {"gate.weight": block.gate.weight.detach()}
    for expert in range(gate_up_EIH.shape[0]):
        per_expert[f"experts.{expert}.gate_proj.weight"] = gate_up_EIH[expert, :intermediate]
        per_expert[f"experts.{expert}.up_proj.weight"] = gate_up_EIH[expert, intermediate:]
        per_expert[f"experts.{expert}.down_proj.weight"] = down_EHI[expert]
    per_expert["experts.5.up_proj.weight"] = per_expert["experts.5.up_proj.weight"][:-2]

    with pytest.raises(ValueError, match=r"'experts\.5\.up_proj\.weight' has shape \(30, 64\)"):
        megamoe_state_dict_from_hf(per_expert, family="qwen3_moe")


def test_swapped_model_still_matches_the_original_after_a_round_trip(tmp_path):
    model = tiny_model("deepseek_v3")
    input_ids = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        expected = model(input_ids).logits
    swap_moe_blocks(model, backend="reference")
    model.save_pretrained(tmp_path)
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path).eval()
    swap_moe_blocks(reloaded, backend="reference")
    with torch.no_grad():
        assert relative_l2_error(reloaded(input_ids).logits, expected) < 1e-5
