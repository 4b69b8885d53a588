"""MegaMoE layers from Hugging Face MoE blocks and from checkpoint state dicts.

The routing semantics come from the source, never from options: options only choose how the
layer runs (backend, capacity, input checks, expert parallelism) and, with `weight_dtype`, in
which precision it holds its experts:

- "auto" (the default): as the source holds them. e4m3 experts with 128 x 128 block scales (an
  FP8 checkpoint, or transformers' FP8Experts) make a weight_dtype="fp8" layer holding the same
  bytes and scales, with FP8 shared experts where the source's are FP8
  (shared_weight_dtype="fp8"); DeepSeek-V4's FP4 experts make one holding their values exactly
  in e4m3 (fp4.py); full-precision experts stay so;
- "fp8": FP8 experts; full-precision ones are quantized per 128 x 128 block as they load;
- None: the experts in the activations' dtype; e4m3 ones (and FP8 shared experts) are
  dequantized into it, e4m3 x scale rounded once (FP4 ones, e2m1 x 2^s, exactly).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from megamoe_torch.config import MegaMoEConfig
from megamoe_torch.hf.families import (
    DEEPSEEK_V3,
    FAMILY_OF_MODEL_TYPE,
    BlockReading,
    Family,
    Layout,
    UnsupportedBlockError,
    correction_bias_of,
    read_hf_config,
)
from megamoe_torch.hf.fp4 import (
    as_fp8_checkpoint,
    fp8_reading_view,
    reads_through_fp8_view,
    with_scales_inv_names,
)
from megamoe_torch.hf.fp8 import (
    activation_dtype_of,
    check_quantization_config,
    dequantized,
    holds_fp8,
    is_fp8,
    model_config_of,
)
from megamoe_torch.hf.naming import BlockNaming
from megamoe_torch.hf.reader import read_block
from megamoe_torch.hf.skeleton import block_prefix_in, checkpoint_block
from megamoe_torch.hf.state_dict import (
    block_state_dict,
    check_shapes,
    hf_state_dict_from_megamoe,
    layout_of,
    megamoe_state_dict_from_hf,
)
from megamoe_torch.layer import MegaMoE

# MegaMoEConfig fields that change how a layer runs, not what it computes ("dispatcher" also
# takes a dispatcher object the caller built, e.g. a DeepEPDispatcher: see MegaMoE)
RUN_OPTIONS = (
    "atomic_combine",
    "backend",
    "capacity",
    "check_inputs",
    "dispatcher",
    "layer_path",
    "max_tokens_per_rank",
    "tile_pack",
)
# the experts' precision: as the source holds them, FP8, or the activations' dtype
WEIGHT_DTYPE_CHOICES = ("auto", "fp8", None)


def from_hf(block: nn.Module, *, weight_dtype: str | None = "auto", **options: Any) -> MegaMoE:
    """A MegaMoE computing what a transformers MoE block computes, with the block's weights.

    Any transformers >= 5 block of a structure megamoe reads (reader.py: a router with softmax or
    sigmoid scores, renormalised or not, grouped top-k, correction bias, router bias, scaling, or
    PhiMoE's sparsemixer; experts in any fused layout, with biases and clamped SwiGLU; shared
    experts with or without a gate; routing weights on the expert input), and the per-expert blocks
    of the transformers 4.x Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3. transformers' FP8 blocks
    (FP8Experts, FP8Linear shared experts: a model loaded from an FP8 checkpoint on a GPU) are taken
    as they are. The layer shares the block's tensors where the layouts agree (no copy).
    `weight_dtype`: "auto", "fp8" or None, see the module doc (None from an FP8 block gives the
    dequantized weights). `options`: any of RUN_OPTIONS, and `process_group` for expert parallelism;
    `dispatcher` is a name (MegaMoEConfig.dispatcher) or a dispatcher the caller built
    (`DeepEPDispatcher`), whose group the layer then spans (it keeps its rank's experts). Raises
    UnsupportedBlockError (a ValueError) saying why a block cannot be reproduced exactly. The layer
    is in the block's training mode.
    """
    layer, _ = convert_block(block, layer_class=MegaMoE, options=options, weight_dtype=weight_dtype)
    return layer.train(block.training)


def from_hf_state_dict(
    state_dict: dict[str, torch.Tensor],
    hf_config: Any,
    *,
    layer: int | None = None,
    prefix: str | None = None,
    device: torch.device | str | None = None,
    weight_dtype: str | None = "auto",
    **options: Any,
) -> MegaMoE:
    """A MegaMoE from a checkpoint's tensors (Hugging Face key names), without the model's weights.

    `hf_config`: the model's transformers config or its config.json as a dict. The block's tensors
    are those under `prefix`, or, given `layer`, those of that layer's MoE block; `state_dict` may
    also hold just the block's tensors (no prefix, no layer). The tensors may have the per-expert
    names checkpoints use on disk or the fused layout transformers >= 5 holds in memory.

    Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 are read from the config's fields (no
    transformers needed; DeepSeek-V3 groups not kept are masked with -inf, as DeepSeek's
    reference does). Any other family is read from its block, which transformers builds from the
    config on the meta device (no memory) and reader.py reads by structure; the block's module
    path gives the prefix. A tensor of another shape than the config implies raises ValueError
    naming its key and both shapes.

    FP8 checkpoints (DeepSeek-V3/R1, the Qwen3 FP8 releases: e4m3 weights with a
    `weight_scale_inv` per 128 x 128 block, `quantization_config` quant_method "fp8") load as
    they are with `weight_dtype` "auto" or "fp8", dequantized with None (see the module doc);
    DeepSeek-V4's (FP4 experts with a power-of-two scale per row and 32 columns, ue8m0 block
    scales, `expert_dtype` "fp4") load with the same values in e4m3 (fp4.py). A recipe megamoe
    does not compute (another block size, static activation scales) raises
    UnsupportedBlockError naming it, and stacking gate and up scales needs an intermediate size
    that is a multiple of 128 (ValueError otherwise; None still converts).
    The layer is in eval mode, as a model that from_pretrained loads is (`.train()` to train).
    """
    if _model_type(hf_config) in FAMILY_OF_MODEL_TYPE:
        family, fields = read_hf_config(hf_config)
        naming = family.naming
        if prefix is None and layer is not None:
            candidates = [
                f"model.layers.{layer}.{name}." for name in (family.checkpoint_block_name, "mlp")
            ]
            prefix = next((p for p in candidates if f"{p}gate.weight" in state_dict), candidates[0])
    else:
        reading, model_path, rename = checkpoint_block(hf_config, layer=layer, prefix=prefix)
        fields, naming = dict(reading.config_fields), reading.naming
        state_dict = {rename(key): tensor for key, tensor in state_dict.items()}
        if prefix is None and layer is not None:
            prefix = block_prefix_in(
                state_dict, model_path=model_path, router_weight=naming.router_weight, layer=layer
            )
    block_tensors = block_state_dict(state_dict, prefix=prefix) if prefix else dict(state_dict)
    if not block_tensors:
        raise ValueError(f"state_dict holds no tensors under prefix {prefix!r}")
    block_tensors = with_scales_inv_names(block_tensors)  # DeepSeek-V4's `.scale` on disk
    # a routed expert's weight (either layout) says the dtypes; tensors that are no block of
    # this family are refused when they map, below
    expert_weight = next(
        (
            tensor
            for key, tensor in block_tensors.items()
            if key.startswith("experts.") and not key.endswith("_scale_inv")
        ),
        next(iter(block_tensors.values())),
    )
    router_weight = block_tensors.get(naming.router_weight, expert_weight)
    activation_dtype = activation_dtype_of(
        expert_dtype=expert_weight.dtype, model_config=hf_config, router_dtype=router_weight.dtype
    )
    # before the shape check, which takes the unpacked shapes (layer_from_hf_tensors then
    # finds nothing left to convert)
    block_tensors = _fp4_converted(
        block_tensors, weight_dtype=weight_dtype, activation_dtype=activation_dtype
    )
    if holds_fp8(block_tensors):
        check_quantization_config(hf_config)
    config = semantic_config(fields)
    check_shapes(
        block_tensors,
        expected_hf_shapes(config, family=naming, layout=layout_of(block_tensors, naming)),
        reference=(
            f"the config: hidden_size={config.hidden_size}, intermediate_size="
            f"{config.intermediate_size}, num_experts={config.num_experts}"
        ),
        prefix=prefix or "",
    )
    layer = layer_from_hf_tensors(
        block_tensors,
        fields=fields,
        naming=naming,
        options=options,
        weight_dtype=weight_dtype,
        layer_class=MegaMoE,
        device=device if device is not None else expert_weight.device,
        activation_dtype=activation_dtype,
    )
    return layer.eval()


def _model_type(hf_config: Any) -> str | None:
    if isinstance(hf_config, dict):
        return hf_config.get("model_type")
    return getattr(hf_config, "model_type", None)


def convert_block(
    block: nn.Module,
    *,
    layer_class: type[MegaMoE],
    options: dict[str, Any],
    weight_dtype: str | None = "auto",
) -> tuple[MegaMoE, BlockReading]:
    """(layer of `layer_class`, what was read of the block): the one conversion path."""
    if reads_through_fp8_view(block):  # FP4 experts, ue8m0 scales: read as the FP8 they become
        reading = replace(
            read_block(fp8_reading_view(block), structure_only=True),
            device=next(block.experts.parameters()).device,  # the view's are on meta
        )
    else:
        reading = read_block(block)
    fields = dict(reading.config_fields)
    if reading.layout == "per_expert" and reading.family == DEEPSEEK_V3.name:
        fields["dropped_group_score"] = _dropped_group_score_of(block, fields)
    hf_tensors = block.state_dict()
    layer = layer_from_hf_tensors(
        hf_tensors,
        fields=fields,
        naming=reading.naming,
        options=options,
        weight_dtype=weight_dtype,
        layer_class=layer_class,
        device=reading.device,
        activation_dtype=activation_dtype_of(
            expert_dtype=reading.expert_dtype,
            model_config=model_config_of(block),
            router_dtype=hf_tensors[reading.naming.router_weight].dtype,
        ),
    )
    return layer, reading


def _fp4_converted(
    hf_tensors: dict[str, torch.Tensor], *, weight_dtype: str | None, activation_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """DeepSeek-V4's FP4 experts and ue8m0 scales in megamoe's FP8 format (fp4.py), or, with
    weight_dtype=None, the FP4 experts' values in the activations' dtype; other tensors as they
    are."""
    return as_fp8_checkpoint(
        hf_tensors, dequantize_fp4_to=activation_dtype if weight_dtype is None else None
    )


def layer_from_hf_tensors(
    hf_tensors: dict[str, torch.Tensor],
    *,
    fields: dict[str, Any],
    naming: BlockNaming,
    options: dict[str, Any],
    weight_dtype: str | None,
    layer_class: type[MegaMoE],
    device: torch.device | str,
    activation_dtype: torch.dtype,
) -> MegaMoE:
    """A layer from one block's tensors (block-relative Hugging Face keys) in the precision
    `weight_dtype` chooses (the module doc)."""
    hf_tensors = _fp4_converted(
        hf_tensors, weight_dtype=weight_dtype, activation_dtype=activation_dtype
    )
    routed, shared = weight_dtypes(hf_tensors, naming=naming, weight_dtype=weight_dtype)
    to_dequantize = keys_to_dequantize(
        hf_tensors, naming=naming, weight_dtype=routed, shared_weight_dtype=shared
    )
    hf_tensors = dequantized(hf_tensors, dtype=activation_dtype, keys=to_dequantize)
    megamoe_state = megamoe_state_dict_from_hf(hf_tensors, family=naming)
    return build_layer(
        {**fields, "weight_dtype": routed, "shared_weight_dtype": shared},
        megamoe_state,
        options,
        layer_class=layer_class,
        device=device,
        dtype=activation_dtype,
    )


def weight_dtypes(
    hf_tensors: dict[str, torch.Tensor], *, naming: BlockNaming, weight_dtype: str | None
) -> tuple[str | None, str | None]:
    """(the layer's weight_dtype, its shared_weight_dtype) for a block's tensors and the
    caller's `weight_dtype`: FP8 shared experts stay FP8 next to FP8 routed experts."""
    if weight_dtype not in WEIGHT_DTYPE_CHOICES:
        raise ValueError(
            f"weight_dtype must be one of {WEIGHT_DTYPE_CHOICES} (as the source holds the "
            f"experts, FP8, or the activations' dtype), got {weight_dtype!r}"
        )
    routed_fp8, shared_fp8 = _fp8_keys(hf_tensors, naming=naming)
    routed = ("fp8" if routed_fp8 else None) if weight_dtype == "auto" else weight_dtype
    return routed, "fp8" if shared_fp8 and routed == "fp8" else None


def keys_to_dequantize(
    hf_tensors: dict[str, torch.Tensor],
    *,
    naming: BlockNaming,
    weight_dtype: str | None,
    shared_weight_dtype: str | None,
) -> set[str]:
    """The keys of a block's e4m3 weights that go into full-precision weights of a layer of
    these weight dtypes."""
    routed_fp8, shared_fp8 = _fp8_keys(hf_tensors, naming=naming)
    return (routed_fp8 if weight_dtype is None else set()) | (
        shared_fp8 if shared_weight_dtype is None else set()
    )


def _fp8_keys(
    hf_tensors: dict[str, torch.Tensor], *, naming: BlockNaming
) -> tuple[set[str], set[str]]:
    """The keys of a block's e4m3 tensors: (the routed experts', the shared experts')."""
    fp8 = {key for key, tensor in hf_tensors.items() if is_fp8(tensor)}
    if naming.shared_prefix is None:
        return fp8, set()
    shared = {key for key in fp8 if key.startswith(f"{naming.shared_prefix}.")}
    return fp8 - shared, shared


def build_layer(
    fields: dict[str, Any],
    megamoe_state: dict[str, torch.Tensor],
    options: dict[str, Any],
    *,
    layer_class: type[MegaMoE],
    device: torch.device | str,
    dtype: torch.dtype,
) -> MegaMoE:
    options = dict(options)
    process_group = options.pop("process_group", None)
    dispatcher = None
    if options.get("dispatcher") is not None and not isinstance(options["dispatcher"], str):
        dispatcher = options.pop("dispatcher")
    unknown = sorted(set(options) - set(RUN_OPTIONS))
    if unknown:
        raise TypeError(
            f"unexpected options {unknown}: accepted are "
            f"{[*RUN_OPTIONS, 'process_group', 'weight_dtype']} (routing semantics come from the "
            "source and cannot be overridden)"
        )
    semantic_config(fields)
    config = MegaMoEConfig(**fields, **options)  # a bad run option is the caller's ValueError
    gate_dtype = megamoe_state["gate.weight"].dtype
    if process_group is not None or dispatcher is not None:
        layer = layer_class(
            config, process_group=process_group, dispatcher=dispatcher, device=device, dtype=dtype
        )
        # DeepSeek-V3 keeps its router weight in fp32 next to bf16 experts
        layer.gate.to(dtype=gate_dtype)
        layer.load_full_state_dict(megamoe_state)
        return layer
    # built on the meta device and given the source tensors: no second copy of the weights
    layer = layer_class(config, device="meta", dtype=dtype)
    layer.load_state_dict(
        {name: tensor.to(device) for name, tensor in megamoe_state.items()}, assign=True
    )
    return layer


def semantic_config(fields: dict[str, Any]) -> MegaMoEConfig:
    """The MegaMoEConfig of what a source computes (run options at their defaults)."""
    try:
        return MegaMoEConfig(**fields)
    except ValueError as error:
        raise UnsupportedBlockError(f"megamoe cannot express this block: {error}") from error


def expected_hf_shapes(
    config: MegaMoEConfig, *, family: Family | BlockNaming, layout: Layout
) -> dict[str, tuple[int, ...]]:
    """Shapes of a Hugging Face block's tensors (block-relative keys, all experts) for `config`."""
    # the layer's own parameter shapes, no memory; FP8 scales are checked with their weights
    # (fp8.take_scales)
    config = replace(config, weight_dtype=None, shared_weight_dtype=None)
    all_experts = MegaMoE(config, device="meta")
    hf_tensors = hf_state_dict_from_megamoe(all_experts.state_dict(), family=family, layout=layout)
    return {key: tuple(tensor.shape) for key, tensor in hf_tensors.items()}


def _dropped_group_score_of(block: nn.Module, fields: dict[str, Any]) -> float:
    """How the block's transformers version scores experts of dropped groups: -inf or 0.0.

    transformers masked them with 0.0 until 2026, -inf since. The two differ only when a kept
    expert's biased score is negative, so the block's router is run on a crafted input where all
    biased scores are negative and the experts it picks tell which.
    """
    num_groups, top_groups = fields["num_groups"], fields["top_groups"]
    if top_groups == num_groups:
        return float("-inf")  # no group is ever dropped: the two agree
    observed = _observe_dropped_group_score(block, fields)
    if observed is not None:
        return observed
    bias = correction_bias_of(block)
    if bias is None or bool((bias >= 0).all()):
        # sigmoid scores are positive, so with a non-negative bias both masks pick the same
        return float("-inf")
    raise UnsupportedBlockError(
        "could not tell whether this transformers version masks dropped expert groups with -inf "
        "or 0.0, and the correction bias has negative entries, where the two differ"
    )


def _observe_dropped_group_score(block: nn.Module, fields: dict[str, Any]) -> float | None:
    num_experts, hidden_size = fields["num_experts"], fields["hidden_size"]
    experts_per_group = num_experts // fields["num_groups"]
    kept_experts = fields["top_groups"] * experts_per_group
    top_k = fields["top_k"]
    # strictly decreasing logits: group g outranks group g + 1, no ties anywhere
    logits_E = torch.linspace(4.0, -4.0, num_experts)
    negative_bias_E = torch.full((num_experts,), -1.0)
    router = block.gate
    try:
        with torch.no_grad():
            if hasattr(block, "route_tokens_to_experts"):  # transformers 5.0 to 5.x
                router_twin = _twin(router, e_score_correction_bias=negative_bias_E)
                block_twin = _twin(block, gate=router_twin, e_score_correction_bias=negative_bias_E)
                outputs = block_twin.route_tokens_to_experts(logits_E.unsqueeze(0))
            else:  # the router computes logits, scores and choice (4.x, and 5.x after 2026)
                weight_EH = torch.zeros(num_experts, hidden_size)
                weight_EH[:, 0] = logits_E
                router_twin = _twin(
                    router, weight=weight_EH, e_score_correction_bias=negative_bias_E
                )
                one_hot_H = torch.zeros(1, hidden_size)
                one_hot_H[0, 0] = 1.0
                outputs = type(router).forward(router_twin, one_hot_H)
    except Exception:  # an unknown router structure: the caller decides from the bias
        return None
    id_tensors = [t for t in outputs if isinstance(t, torch.Tensor) and not t.is_floating_point()]
    if len(id_tensors) != 1:
        return None
    chosen = set(id_tensors[0].reshape(-1).tolist())
    if chosen == set(range(top_k)):
        return float("-inf")
    if any(expert >= kept_experts for expert in chosen):
        return 0.0
    return None


def _twin(module: nn.Module, **replacements: Any) -> nn.Module:
    """A shallow copy of `module` with some tensors or submodules replaced (`module` unchanged)."""
    twin = copy.copy(module)
    twin._parameters = dict(module._parameters)
    twin._buffers = dict(module._buffers)
    twin._modules = dict(module._modules)
    for name, value in replacements.items():
        for registry in (twin._parameters, twin._buffers, twin._modules):
            if name in registry:
                registry[name] = value
                break
        else:
            if hasattr(module, name):
                object.__setattr__(twin, name, value)
    return twin
