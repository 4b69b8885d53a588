"""A swapped block's checkpoint under the names and layout of the Hugging Face block it replaced.

`swap_moe_blocks` calls `keep_hf_checkpoint_format` on every block it swaps. From then on:

- `state_dict()` answers with the replaced block's keys and layout (its BlockNaming): the fused
  experts of transformers >= 5 in the block's own layout (which `save_pretrained` turns into the
  names on disk, as for the unswapped model), or the per-expert modules of 4.x, and the block's
  router, biases, correction bias and shared expert names, and the tensors it holds unused;
- `load_state_dict()` takes those keys, in either layout, or megamoe's own (`w13`, `w2`, ...);
  an FP8 layer (weight_dtype="fp8") gives and takes e4m3 experts with their block scales
  (`experts.gate_up_proj_scale_inv`, `experts.{e}.gate_proj.weight_scale_inv`, ...: hf/fp8.py),
  quantizes full-precision ones as they load, and a full-precision layer dequantizes e4m3 ones;
- `restored_hf_block` rebuilds the replaced block around the layer's current weights, from a
  weightless copy of it kept aside (meta tensors: no memory);
- the weightless copy's children the layer lacks (`experts`, `router`, ...) are plain attributes
  of the layer, not submodules: transformers' save-time conversions find the in-memory
  parameters' shapes by module path, and nothing walks, moves or saves them.

Expert-parallel layers hold only their rank's experts: loading keeps that slice of the full
block, and `state_dict()` raises, since a Hugging Face block holds every expert. Setting
`hf_checkpoint_format = False` on a layer turns both hooks off (megamoe's names, local experts).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from megamoe_torch.fp8_linear import quantize_loaded_weights
from megamoe_torch.hf.convert import expected_hf_shapes, keys_to_dequantize
from megamoe_torch.hf.families import Layout
from megamoe_torch.hf.fp4 import as_fp8_checkpoint, in_block_formats, with_scales_inv_names
from megamoe_torch.hf.fp8 import dequantized, is_fp8
from megamoe_torch.hf.naming import BlockNaming
from megamoe_torch.hf.state_dict import (
    check_shapes,
    hf_state_dict_from_megamoe,
    layout_of,
    megamoe_state_dict_from_hf,
)
from megamoe_torch.layer import MegaMoE

_FORWARD_HOOK_REGISTRIES = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
)


def keep_hf_checkpoint_format(
    layer: MegaMoE, block: nn.Module, *, naming: BlockNaming, layout: Layout, router_name: str
) -> None:
    """Makes `layer` save and load as `block` (the block it replaces) does; see the module doc.

    The forward hooks of the block and its router are not kept in the copy: they move to the
    swapped layer, and back from it on restore.
    """
    layer.hf_naming = naming
    layer.hf_layout = layout
    layer.hf_checkpoint_format = True
    block_tensors = block.state_dict()
    layer.__dict__["_hf_ignored_tensors"] = {key: block_tensors[key] for key in naming.ignored}
    weightless_block = _weightless_copy(block)
    for module in (weightless_block, getattr(weightless_block, router_name)):
        for registry in _FORWARD_HOOK_REGISTRIES:
            getattr(module, registry).clear()
    # kept out of _modules: not a submodule the model would walk, move or save
    layer.__dict__["_weightless_hf_block"] = weightless_block
    # the block's other children, as plain attributes: transformers' save-time conversions look
    # up the in-memory parameters by their module path (model.get_parameter) for their shapes
    for name, child in weightless_block.named_children():
        if not hasattr(layer, name):
            layer.__dict__[name] = child
    layer.register_state_dict_post_hook(_hf_state_dict_hook)
    layer.register_load_state_dict_pre_hook(_hf_load_state_dict_pre_hook)


def restored_hf_block(layer: MegaMoE) -> nn.Module:
    """The Hugging Face block `layer` replaced, holding the layer's current weights (shared).

    Raises RuntimeError for an expert-parallel layer: it holds only its rank's experts.
    """
    _require_every_expert(layer, where="the layer")
    megamoe_state = {
        name: tensor.detach()
        for name, tensor in (*layer.named_parameters(), *layer.named_buffers())
    }
    block = _weightless_copy(layer.__dict__["_weightless_hf_block"])
    hf_state = {
        **_in_replaced_formats(
            layer,
            hf_state_dict_from_megamoe(
                megamoe_state, family=layer.hf_naming, layout=layer.hf_layout
            ),
        ),
        **layer.__dict__["_hf_ignored_tensors"],
    }
    block_fp8 = {key for key, tensor in block.state_dict().items() if is_fp8(tensor)}
    if block_fp8 != {key for key, tensor in hf_state.items() if is_fp8(tensor)}:
        held = "e4m3" if block_fp8 else "full-precision"
        raise RuntimeError(
            f"the layer holds {layer.w13.dtype} experts where the replaced {layer.hf_naming.family} "
            f"block held {held} ones, which the block's modules cannot take back: unswap a "
            "model swapped with weight_dtype='auto', or save the layer's weights "
            "(state_dict, save_pretrained)"
        )
    block.load_state_dict(hf_state, assign=True)
    block.train(layer.training)
    if not any(parameter.requires_grad for parameter in layer.parameters()):
        block.requires_grad_(False)
    return block


def _hf_state_dict_hook(
    layer: MegaMoE, state_dict: dict[str, Any], prefix: str, local_metadata: dict
) -> None:
    if not layer.hf_checkpoint_format:
        return
    _require_every_expert(layer, where=prefix or "the layer")
    own_keys = [key for key in state_dict if key.startswith(prefix)]
    megamoe_state = {key[len(prefix) :]: state_dict.pop(key) for key in own_keys}
    hf_state = _in_replaced_formats(
        layer,
        hf_state_dict_from_megamoe(megamoe_state, family=layer.hf_naming, layout=layer.hf_layout),
    )
    hf_state.update(layer.__dict__["_hf_ignored_tensors"])
    for key, tensor in hf_state.items():
        state_dict[prefix + key] = tensor


def _in_replaced_formats(layer: MegaMoE, hf_state: dict[str, Any]) -> dict[str, Any]:
    """`hf_state` in the formats the replaced block held (DeepSeek-V4's FP4 experts and ue8m0
    scales, hf/fp4.py): the checkpoint the model was loaded from."""
    return in_block_formats(hf_state, layer.__dict__["_weightless_hf_block"].state_dict())


def _require_every_expert(layer: MegaMoE, *, where: str) -> None:
    if layer.expert_parallel:
        experts = layer.local_experts
        raise RuntimeError(
            f"{where}: this expert-parallel MegaMoE holds experts {experts.start}.."
            f"{experts.stop - 1} of {layer.config.num_experts} only, and a Hugging Face "
            f"{layer.hf_naming.family} block holds all of them. Save or unswap a model swapped "
            "without process_group, or set hf_checkpoint_format = False on the layer for "
            "megamoe's names with this rank's experts"
        )


def _hf_load_state_dict_pre_hook(
    layer: MegaMoE,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    if not layer.hf_checkpoint_format:
        return
    own_keys = [key for key in state_dict if key.startswith(prefix)]
    megamoe_names = {name for name, _ in layer.named_parameters()}
    megamoe_names |= {name for name, _ in layer.named_buffers()}
    if all(key[len(prefix) :] in megamoe_names for key in own_keys):
        return  # megamoe's own names (or none of the block's): nothing to convert
    # DeepSeek-V4's FP4 experts and ue8m0 scales: megamoe's FP8 format (hf/fp4.py)
    hf_state = as_fp8_checkpoint(
        with_scales_inv_names({key[len(prefix) :]: state_dict.pop(key) for key in own_keys})
    )
    naming = layer.hf_naming
    check_shapes(
        hf_state,
        expected_hf_shapes(layer.config, family=naming, layout=layout_of(hf_state, naming)),
        reference=f"this {naming.family} layer",
        prefix=prefix,
    )
    ignored = layer.__dict__["_hf_ignored_tensors"]
    for key in naming.ignored:
        if key in hf_state:
            ignored[key] = hf_state[key]
    # e4m3 tensors for full-precision weights of the layer: their values
    to_dequantize = keys_to_dequantize(
        hf_state,
        naming=naming,
        weight_dtype=layer.config.weight_dtype,
        shared_weight_dtype=layer.config.shared_weight_dtype,
    )
    try:
        hf_state = dequantized(hf_state, dtype=layer.activation_dtype, keys=to_dequantize)
        megamoe_state = megamoe_state_dict_from_hf(hf_state, family=naming)
    except ValueError as error:
        raise ValueError(
            f"the tensors under {prefix!r} are not a Hugging Face {naming.family} block: {error}"
        ) from error
    experts = layer.local_experts
    # an expert-parallel layer: its experts
    for name in ("w13", "w2", "w13_bias", "w2_bias", "w13_scale_inv", "w2_scale_inv"):
        if name in megamoe_state:
            megamoe_state[name] = megamoe_state[name][experts.start : experts.stop]
    if layer.config.weight_dtype == "fp8":  # the layer's own pre-hook saw the Hugging Face names
        quantize_loaded_weights(megamoe_state, ("w13", "w2"))
    for key, tensor in megamoe_state.items():
        state_dict[prefix + key] = tensor


def _weightless_copy(module: nn.Module) -> nn.Module:
    """A copy of `module` and its submodules whose parameters and saved buffers are on meta.

    Attributes are shared with `module` except the tensor, submodule and hook registries;
    `module` itself is left as it is.
    """
    twin = copy.copy(module)
    twin._parameters = {
        name: None
        if parameter is None
        else nn.Parameter(
            torch.empty_like(parameter, device="meta"), requires_grad=parameter.requires_grad
        )
        for name, parameter in module._parameters.items()
    }
    twin._buffers = {
        name: buffer
        if buffer is None or name in module._non_persistent_buffers_set
        else torch.empty_like(buffer, device="meta")
        for name, buffer in module._buffers.items()
    }
    twin._non_persistent_buffers_set = set(module._non_persistent_buffers_set)
    twin._modules = {
        name: None if child is None else _weightless_copy(child)
        for name, child in module._modules.items()
    }
    for name, value in vars(module).items():
        if name.startswith("_") and "hooks" in name and isinstance(value, dict):
            twin.__dict__[name] = copy.copy(value)
    return twin
