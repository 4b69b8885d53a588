"""The Hugging Face MoE families megamoe reproduces, and how to read a block of each.

A family says how its block routes (scores, renormalisation, groups, router matmul dtype), where
its tensors live in a checkpoint, and how its decoder layer expects the block to answer. Two
readers turn a source into MegaMoEConfig fields: `read_block` from a live transformers module
(what its forward actually uses), `read_hf_config` from a model config (a checkpoint on disk).

Only exact reproductions pass: anything a block does that MegaMoE does not (another activation,
router jitter, biased or transposed experts, quantized tensors) raises `UnsupportedBlockError`
with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

Layout = Literal["fused", "per_expert"]


class UnsupportedBlockError(ValueError):
    """A block megamoe cannot reproduce exactly; the message says why."""


@dataclass(frozen=True)
class Family:
    name: str
    # transformers class names of the block, matched exactly (subclasses in other models may
    # route differently)
    block_class_names: tuple[str, ...]
    scoring: Literal["softmax", "sigmoid"]
    # dtype of the router matmul in transformers' forward
    router_dtype: Literal["input", "float32"]
    # per-expert checkpoint names of (gate, up, down) projections
    expert_projection_names: tuple[str, str, str]
    # block-relative prefix of the shared expert MLP, and of its sigmoid gate's weight
    shared_expert_prefix: str | None = None
    shared_expert_gate_key: str | None = None
    # the module name of the block inside a decoder layer, in checkpoints on disk
    checkpoint_block_name: str = "mlp"
    # model config keys of the routed experts' count (aliases, first set wins) and width
    num_experts_keys: tuple[str, ...] = ("num_experts", "num_local_experts")
    intermediate_size_key: str = "moe_intermediate_size"


MIXTRAL = Family(
    name="mixtral",
    block_class_names=("MixtralSparseMoeBlock",),
    scoring="softmax",
    router_dtype="input",
    expert_projection_names=("w1", "w3", "w2"),
    checkpoint_block_name="block_sparse_moe",
    num_experts_keys=("num_local_experts", "num_experts"),
    intermediate_size_key="intermediate_size",
)
QWEN2_MOE = Family(
    name="qwen2_moe",
    block_class_names=("Qwen2MoeSparseMoeBlock",),
    scoring="softmax",
    router_dtype="input",
    expert_projection_names=("gate_proj", "up_proj", "down_proj"),
    shared_expert_prefix="shared_expert",
    shared_expert_gate_key="shared_expert_gate.weight",
)
QWEN3_MOE = Family(
    name="qwen3_moe",
    block_class_names=("Qwen3MoeSparseMoeBlock",),
    scoring="softmax",
    router_dtype="input",
    expert_projection_names=("gate_proj", "up_proj", "down_proj"),
)
DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    block_class_names=("DeepseekV3MoE",),
    scoring="sigmoid",
    router_dtype="float32",
    expert_projection_names=("gate_proj", "up_proj", "down_proj"),
    shared_expert_prefix="shared_experts",
    num_experts_keys=("n_routed_experts", "num_local_experts"),
)

FAMILIES = {family.name: family for family in (MIXTRAL, QWEN2_MOE, QWEN3_MOE, DEEPSEEK_V3)}
_FAMILY_OF_CLASS = {
    name: family for family in FAMILIES.values() for name in family.block_class_names
}
# transformers model_type of each family's config
_FAMILY_OF_MODEL_TYPE = {
    "mixtral": MIXTRAL,
    "qwen2_moe": QWEN2_MOE,
    "qwen3_moe": QWEN3_MOE,
    "deepseek_v3": DEEPSEEK_V3,
}


def family_of_block(block: nn.Module) -> Family | None:
    return _FAMILY_OF_CLASS.get(type(block).__name__)


def family_named(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"family must be one of {tuple(FAMILIES)}, got {name!r}")
    return FAMILIES[name]


def looks_like_moe_block(module: nn.Module) -> bool:
    """An MoE block of a family megamoe may not know: routed experts next to a router."""
    children = dict(module.named_children())
    return "experts" in children and ("gate" in children or "router" in children)


@dataclass(frozen=True)
class BlockReading:
    """What a live block computes, as MegaMoEConfig fields plus how it is laid out."""

    family: Family
    config_fields: dict[str, Any]
    layout: Layout
    # the block's forward returns (hidden_states, router_logits), not hidden_states alone
    returns_router_logits: bool
    expert_dtype: torch.dtype
    # the routed experts' device, where the layer is built
    device: torch.device


def read_block(block: nn.Module) -> BlockReading:
    """MegaMoEConfig fields (semantics only) of a transformers MoE block instance."""
    family = family_of_block(block)
    if family is None:
        raise UnsupportedBlockError(
            f"{type(block).__name__} is not a supported MoE block (supported: "
            f"{', '.join(name for f in FAMILIES.values() for name in f.block_class_names)})"
        )
    if getattr(block, "_hf_hook", None) is not None:
        raise UnsupportedBlockError(
            "the block is managed by accelerate (device map / offload hooks): convert it "
            "before dispatching the model"
        )
    router = _child(block, "gate")
    experts = _child(block, "experts")
    router_weight = _tensor(router, "weight", what="router weight")
    num_experts, hidden_size = router_weight.shape
    layout, intermediate_size, expert_weight = _read_experts(experts, num_experts, hidden_size)
    _check_activation(experts, layout)
    holders = (router, block)  # transformers >= 5 keeps routing fields on the router
    is_deepseek = family is DEEPSEEK_V3
    fields = _routing_fields(
        family,
        top_k=_attribute(holders, "top_k"),
        norm_topk_prob=None if family is MIXTRAL else _attribute(holders, "norm_topk_prob"),
        router_jitter_noise=_attribute((block,), "jitter_noise", default=0.0),
        num_groups=_attribute(holders, "num_group", "n_group") if is_deepseek else 1,
        top_groups=_attribute(holders, "topk_group") if is_deepseek else 1,
        routed_scaling_factor=_attribute(holders, "routed_scaling_factor") if is_deepseek else 1.0,
    )
    fields.update(
        hidden_size=hidden_size, intermediate_size=intermediate_size, num_experts=num_experts
    )
    if is_deepseek and correction_bias_of(block) is None:
        raise UnsupportedBlockError("the DeepSeek-V3 router has no e_score_correction_bias")
    fields.update(_read_shared_experts(block, family, hidden_size))
    return BlockReading(
        family=family,
        config_fields=fields,
        layout=layout,
        returns_router_logits=layout == "per_expert" and family is not DEEPSEEK_V3,
        expert_dtype=expert_weight.dtype,
        device=expert_weight.device,
    )


def read_hf_config(hf_config: Any) -> tuple[Family, dict[str, Any]]:
    """(family, MegaMoEConfig fields) from a transformers config object or a config.json dict."""
    get = _config_getter(hf_config)
    model_type = get("model_type")
    if model_type not in _FAMILY_OF_MODEL_TYPE:
        raise UnsupportedBlockError(
            f"model_type {model_type!r} is not supported (supported: {tuple(_FAMILY_OF_MODEL_TYPE)})"
        )
    family = _FAMILY_OF_MODEL_TYPE[model_type]
    hidden_act = get("hidden_act", "silu")
    if hidden_act not in ("silu", "swish"):
        raise UnsupportedBlockError(
            f"hidden_act {hidden_act!r}: MegaMoE computes SwiGLU (SiLU) experts only"
        )
    fields = _routing_fields(
        family,
        top_k=get("num_experts_per_tok"),
        norm_topk_prob=get("norm_topk_prob"),
        router_jitter_noise=get("router_jitter_noise") or 0.0,
        num_groups=get("n_group"),
        top_groups=get("topk_group"),
        routed_scaling_factor=get("routed_scaling_factor"),
    )
    fields.update(
        hidden_size=get("hidden_size"),
        num_experts=next(
            (value for value in map(get, family.num_experts_keys) if value is not None), None
        ),
        intermediate_size=get(family.intermediate_size_key),
    )
    if family is QWEN2_MOE and get("shared_expert_intermediate_size"):
        fields.update(
            num_shared_experts=1,
            shared_intermediate_size=get("shared_expert_intermediate_size"),
            shared_expert_gate=True,
        )
    if family is DEEPSEEK_V3 and get("n_shared_experts"):
        fields.update(
            num_shared_experts=get("n_shared_experts"),
            shared_intermediate_size=get("moe_intermediate_size") * get("n_shared_experts"),
        )
    missing = [name for name, value in fields.items() if value is None]
    if missing:
        raise ValueError(f"hf_config of model_type {model_type!r} lacks values for {missing}")
    return family, fields


def _routing_fields(
    family: Family,
    *,
    top_k: int,
    norm_topk_prob: bool | None,
    router_jitter_noise: float,
    num_groups: int,
    top_groups: int,
    routed_scaling_factor: float,
) -> dict[str, Any]:
    """A family's routing as MegaMoEConfig fields, from the values its block or config holds."""
    needed = {"top_k": top_k}
    if family is not MIXTRAL:
        needed["norm_topk_prob"] = norm_topk_prob
    if family is DEEPSEEK_V3:
        needed.update(
            n_group=num_groups, topk_group=top_groups, routed_scaling_factor=routed_scaling_factor
        )
    missing = [name for name, value in needed.items() if value is None]
    if missing:
        raise ValueError(f"the {family.name} config lacks {missing}: its routing is undefined")
    if float(router_jitter_noise) > 0:
        raise UnsupportedBlockError(
            f"router_jitter_noise={router_jitter_noise} multiplies training inputs by random "
            "noise, which MegaMoE does not reproduce; set it to 0.0 to convert"
        )
    fields: dict[str, Any] = dict(
        top_k=int(top_k),
        scoring=family.scoring,
        router_dtype=family.router_dtype,
        # Mixtral always renormalises the top-k weights; the others when norm_topk_prob is set
        renormalize=True if family is MIXTRAL else bool(norm_topk_prob),
    )
    if family is DEEPSEEK_V3:
        fields.update(
            num_groups=int(num_groups),
            top_groups=int(top_groups),
            routed_scaling_factor=float(routed_scaling_factor),
            use_correction_bias=True,
        )
    return fields


def moe_layer_indices(hf_config: Any) -> list[int]:
    """Which decoder layers of a model hold an MoE block (the others hold a dense MLP)."""
    family, _ = read_hf_config(hf_config)
    get = _config_getter(hf_config)
    layers = range(get("num_hidden_layers"))
    if family is QWEN2_MOE or family is QWEN3_MOE:
        step, dense = get("decoder_sparse_step", 1) or 1, set(get("mlp_only_layers", []) or [])
        return [i for i in layers if i not in dense and (i + 1) % step == 0]
    if family is DEEPSEEK_V3:
        return [i for i in layers if i >= (get("first_k_dense_replace", 0) or 0)]
    return list(layers)


def _read_experts(
    experts: nn.Module, num_experts: int, hidden_size: int
) -> tuple[Layout, int, torch.Tensor]:
    """(layout, intermediate size, one expert weight tensor: its dtype and device)."""
    if hasattr(experts, "gate_up_proj"):
        for flag, wanted in (
            ("is_transposed", False),
            ("is_concatenated", True),
            ("has_bias", False),
            ("has_gate", True),
        ):
            if getattr(experts, flag, wanted) != wanted:
                raise UnsupportedBlockError(f"experts with {flag}={not wanted} are not supported")
        gate_up = _tensor(experts, "gate_up_proj", what="experts.gate_up_proj")
        down = _tensor(experts, "down_proj", what="experts.down_proj")
        intermediate_size = gate_up.shape[1] // 2 if gate_up.dim() == 3 else -1
        if (
            gate_up.dim() != 3
            or tuple(gate_up.shape) != (num_experts, 2 * intermediate_size, hidden_size)
            or tuple(down.shape) != (num_experts, hidden_size, intermediate_size)
        ):
            raise UnsupportedBlockError(
                f"experts.gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} "
                f"are not [{num_experts}, 2I, {hidden_size}] and [{num_experts}, {hidden_size}, I]"
            )
        return "fused", intermediate_size, gate_up
    if isinstance(experts, nn.ModuleList):
        if len(experts) != num_experts:
            raise UnsupportedBlockError(
                f"{len(experts)} experts but the router scores {num_experts}"
            )
        first = experts[0]
        for gate_name, _, _ in (MIXTRAL.expert_projection_names, QWEN3_MOE.expert_projection_names):
            if isinstance(getattr(first, gate_name, None), nn.Linear):
                projection = getattr(first, gate_name)
                if projection.bias is not None:
                    raise UnsupportedBlockError("experts with biases are not supported")
                weight = _tensor(projection, "weight", what=f"experts.0.{gate_name}.weight")
                return "per_expert", weight.shape[0], weight
        raise UnsupportedBlockError(
            f"per-expert modules of type {type(first).__name__} have neither w1/w2/w3 nor "
            "gate_proj/up_proj/down_proj linear layers"
        )
    raise UnsupportedBlockError(
        f"experts of type {type(experts).__name__} are neither fused (gate_up_proj/down_proj) "
        "nor a ModuleList of per-expert MLPs"
    )


def _check_activation(experts: nn.Module, layout: Layout) -> None:
    holder = experts if layout == "fused" else experts[0]
    activation = getattr(holder, "act_fn", None)
    if activation is None:
        raise UnsupportedBlockError(f"{type(holder).__name__} has no act_fn to check")
    if not (isinstance(activation, nn.SiLU) or type(activation).__name__ == "SiLUActivation"):
        raise UnsupportedBlockError(
            f"experts use {type(activation).__name__}; MegaMoE computes SwiGLU (SiLU) only"
        )


def _read_shared_experts(block: nn.Module, family: Family, hidden_size: int) -> dict[str, Any]:
    if family.shared_expert_prefix is None:
        return {}
    shared = getattr(block, family.shared_expert_prefix, None)
    if shared is None:
        return {}
    gate_proj = getattr(shared, "gate_proj", None)
    if not isinstance(gate_proj, nn.Linear) or gate_proj.bias is not None:
        raise UnsupportedBlockError(
            f"{family.shared_expert_prefix} is not a bias-free gate_proj/up_proj/down_proj MLP"
        )
    if gate_proj.out_features == 0:  # DeepSeek-V3 with n_shared_experts=0 builds an empty MLP
        return {}
    _check_activation(shared, "fused")
    fields: dict[str, Any] = dict(
        num_shared_experts=1, shared_intermediate_size=gate_proj.out_features
    )
    if family.shared_expert_gate_key is not None:
        gate = getattr(block, family.shared_expert_gate_key.split(".")[0], None)
        if gate is not None:
            if not isinstance(gate, nn.Linear) or gate.bias is not None or gate.out_features != 1:
                raise UnsupportedBlockError(
                    "the shared expert gate is not a bias-free Linear(H, 1)"
                )
            fields["shared_expert_gate"] = True
    return fields


def correction_bias_of(block: nn.Module) -> torch.Tensor | None:
    for holder in (block.gate, block):
        bias = getattr(holder, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            return bias
    return None


def _child(block: nn.Module, name: str) -> nn.Module:
    child = getattr(block, name, None)
    if not isinstance(child, nn.Module):
        raise UnsupportedBlockError(f"{type(block).__name__} has no {name!r} submodule")
    return child


def _tensor(module: nn.Module, name: str, *, what: str) -> torch.Tensor:
    tensor = getattr(module, name, None)
    if not isinstance(tensor, torch.Tensor):
        raise UnsupportedBlockError(f"{what} is missing")
    if tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise UnsupportedBlockError(
            f"{what} is {tensor.dtype}: quantized weights are not supported, dequantize first"
        )
    if tensor.device.type == "meta":
        raise UnsupportedBlockError(f"{what} is on the meta device: load the weights first")
    return tensor


_MISSING = object()


def _config_getter(hf_config: Any):
    """get(name, default=None) over a transformers config object or a config.json dict.

    A dict goes through its transformers config class where transformers is installed, so keys
    config.json leaves out take the defaults the model itself would use.
    """
    if isinstance(hf_config, dict):
        try:
            import transformers
        except ImportError:
            return hf_config.get
        fields = {key: value for key, value in hf_config.items() if key != "model_type"}
        try:
            hf_config = transformers.AutoConfig.for_model(hf_config.get("model_type"), **fields)
        except ValueError:  # a model_type this transformers does not know
            return hf_config.get
    return lambda name, default=None: getattr(hf_config, name, default)


def _attribute(holders: tuple, *names: str, default: Any = _MISSING) -> Any:
    for holder in holders:
        for name in names:
            value = getattr(holder, name, None)
            if value is not None and not isinstance(value, (nn.Module, torch.Tensor)):
                return value
    if default is not _MISSING:
        return default
    raise UnsupportedBlockError(
        f"none of {[type(h).__name__ for h in holders]} has {' or '.join(names)}"
    )
