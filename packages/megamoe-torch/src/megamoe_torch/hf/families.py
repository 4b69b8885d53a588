"""Families megamoe knows by name, what every reading of a block gives, and config reading.

transformers >= 5 blocks are read by their structure (reader.py), whatever their class. Four
families are also known by name, for what structure cannot show: blocks of transformers 4.x,
whose per-expert modules route inside the block's own forward (`read_legacy_block`), and
config.json files read without transformers installed (`read_hf_config`).

Only exact reproductions pass: anything a block does that MegaMoE does not (another activation,
router jitter, quantized tensors) raises `UnsupportedBlockError` with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from megamoe_torch.hf.naming import BlockNaming

Layout = Literal["fused", "per_expert"]
# how a block's forward answers: the hidden states, or a pair of them and the router logits or
# the top-k routing weights
Answer = Literal["hidden", "hidden_and_router_logits", "hidden_and_topk_weights"]
OutputShape = Literal["input", "tokens", "flat"]


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

    @property
    def naming(self) -> BlockNaming:
        return BlockNaming(
            family=self.name,
            correction_bias="gate.e_score_correction_bias" if self.scoring == "sigmoid" else None,
            per_expert_projections=self.expert_projection_names,
            shared_prefix=self.shared_expert_prefix,
            shared_gate=self.shared_expert_gate_key,
        )


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
FAMILY_OF_MODEL_TYPE = {
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
    """A module that routes tokens to experts: a router (a child named `gate`, `router` or
    `*router*`) next to routed experts (a child named `experts` or of an *Experts class, as
    JetMoE's, or expert embeddings, as Doge's)."""
    children = dict(module.named_children())
    if not any(name in ("gate", "router") or "router" in name for name in children):
        return False
    return any(
        name == "experts"
        or "Experts" in type(child).__name__
        or "expert" in name.lower()
        or (isinstance(child, nn.Embedding) and "embed" in name and name != "embed_tokens")
        for name, child in children.items()
    )


def moe_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules of `model` shaped like MoE blocks (`looks_like_moe_block`), by
    name; MegaMoE layers (blocks swapped already) are not among them."""
    from megamoe_torch.layer import MegaMoE

    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        if not isinstance(module, MegaMoE) and looks_like_moe_block(module):
            found.append((name, module))
    return found


@dataclass(frozen=True)
class BlockReading:
    """What a live block computes, as MegaMoEConfig fields, plus how it names and lays out its
    tensors and how it answers."""

    naming: BlockNaming
    config_fields: dict[str, Any]
    layout: Layout
    answer: Answer
    expert_dtype: torch.dtype
    # the routed experts' device, where the layer is built
    device: torch.device
    # the router child ("gate" or "router")
    router_name: str = "gate"
    # the shape the block answers in: the input's, [tokens, hidden] whatever the input's leading
    # shape, or flattened to one dimension (with the router logits, ERNIE 4.5 VL)
    output_shape: OutputShape = "input"
    # where the router's forward puts the logits among its outputs, and how many it has (for
    # a stand-in of its class that hands the logits to transformers' hooks); None: no stand-in
    router_logits_index: int | None = None
    router_outputs: int = 3
    # the router's logits are fp32 whatever the input dtype
    router_logits_float32: bool = False
    # the inputs the block's forward takes besides the hidden states (structure.BLOCK_INPUTS)
    inputs: tuple[str, ...] = ()

    @property
    def family(self) -> str:
        return self.naming.family

    def describe(self) -> str:
        """What the block computes, in a few words (for reports and the family table)."""
        fields, naming = self.config_fields, self.naming
        routing = [fields["scoring"]]
        if fields["scoring"] == "sparsemixer":
            routing[0] = f"sparsemixer (eps {fields['sparsemixer_eps']:g})"
        if fields.get("num_groups", 1) > 1:
            best = "best" if fields.get("group_score") == "max" else "two best"
            routing.append(
                f"top {fields['top_groups']} of {fields['num_groups']} groups (by their {best})"
            )
        identity = fields.get("num_identity_experts", 0)
        if fields.get("routing_table_vocab_size"):
            routing.append(
                f"{fields['top_k']} of {fields['num_experts']} by token id (a table of "
                f"{fields['routing_table_vocab_size']} ids)"
            )
        else:
            routing.append(
                f"top-{fields['top_k']} of {fields['num_experts']}"
                + (f" + {identity} identity experts" if identity else "")
            )
        routing.append("renormalised" if fields["renormalize"] else "not renormalised")
        if fields.get("use_correction_bias"):
            on = "logits" if fields.get("choice_on_logits") else "scores"
            routing.append(f"correction bias on the {on} for the choice")
        if fields.get("routed_scaling_factor", 1.0) != 1.0:
            routing.append(f"scaled by {fields['routed_scaling_factor']:g}")
        if fields.get("router_bias"):
            routing.append("router bias")
        if fields.get("router_dtype") == "float32":
            routing.append("fp32 router")
        rows = "I" if fields.get("activation") == "relu2" else "2I"
        experts = [
            f"[E, H, {rows}] experts" if naming.experts_transposed else f"[E, {rows}, H] experts"
        ]
        if naming.flattened_gate_and_up is not None:
            experts = ["flattened [E * I, H] gate, up and down"]
        if self.layout == "per_expert":
            experts = ["per-expert modules"]
        if naming.gate_up_interleaved:
            experts.append("gate/up interleaved")
        if fields.get("expert_bias"):
            experts.append("biased")
        if fields.get("swiglu_gate_cubic", 0.0) != 0.0:
            limit = fields.get("swiglu_limit")
            experts.append(
                "GeGLU (tanh GELU)" + ("" if limit is None else f", clamped at {limit:g}")
            )
        elif fields.get("swiglu_limit") is not None:
            experts.append(
                f"SwiGLU clamped at {fields['swiglu_limit']:g}, alpha "
                f"{fields.get('swiglu_alpha', 1.0):g}, up + {fields.get('swiglu_up_offset', 0.0):g}"
            )
        elif (fields.get("swiglu_alpha", 1.0), fields.get("swiglu_up_offset", 0.0)) != (1.0, 0.0):
            experts.append(
                f"SwiGLU alpha {fields.get('swiglu_alpha', 1.0):g}, up + "
                f"{fields.get('swiglu_up_offset', 0.0):g}"
            )
        softcaps = [
            f"{name} softcapped at {fields[f'swiglu_{name}_softcap']:g}"
            for name in ("gate", "up")
            if fields.get(f"swiglu_{name}_softcap") is not None
        ]
        if softcaps:
            experts.append(f"SwiGLU with {' and '.join(softcaps)}")
        if fields.get("activation") == "relu2":
            experts.append("up projection alone, relu(up)^2")
        if fields.get("latent_size") is not None:
            experts.append(f"on {fields['latent_size']}-wide latent projections of the tokens")
        if fields.get("routing_weights_on_input"):
            experts.append("routing weights on the expert input")
        parts = [", ".join(routing), ", ".join(experts)]
        if fields.get("num_shared_experts"):
            shared = "with a sigmoid gate" if fields.get("shared_expert_gate") else "ungated"
            if fields.get("shared_swiglu") == "routed":
                shared += ", with the routed experts' SwiGLU"
            if fields.get("activation") == "relu2":
                shared += ", relu(up)^2"
            parts.append(f"shared expert {shared}")
        if fields.get("output_norm_eps") is not None:
            parts.append(f"the output RMSNorm-ed (eps {fields['output_norm_eps']:g})")
        return "; ".join(parts)


def read_legacy_block(block: nn.Module) -> BlockReading:
    """MegaMoEConfig fields (semantics only) of a transformers 4.x MoE block, whose experts are a
    ModuleList of per-expert MLPs, of a family known by name."""
    family = family_of_block(block)
    if family is None:
        raise UnsupportedBlockError(
            f"{type(block).__name__} keeps per-expert modules and routes in its own forward: "
            "megamoe reads such blocks for the transformers 4.x families "
            f"{', '.join(name for f in FAMILIES.values() for name in f.block_class_names)} only"
        )
    router = _child(block, "gate")
    experts = _child(block, "experts")
    router_weight = _tensor(router, "weight", what="router weight")
    num_experts, hidden_size = router_weight.shape
    intermediate_size, expert_weight = _read_per_expert_modules(experts, num_experts)
    _check_activation(experts[0])
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
    fields.update(_read_shared_experts(block, family))
    return BlockReading(
        naming=family.naming,
        config_fields=fields,
        layout="per_expert",
        answer="hidden" if family is DEEPSEEK_V3 else "hidden_and_router_logits",
        expert_dtype=expert_weight.dtype,
        device=expert_weight.device,
    )


def read_hf_config(hf_config: Any) -> tuple[Family, dict[str, Any]]:
    """(family, MegaMoEConfig fields) from a transformers config object or a config.json dict."""
    get = _config_getter(hf_config)
    model_type = get("model_type")
    if model_type not in FAMILY_OF_MODEL_TYPE:
        raise UnsupportedBlockError(
            f"model_type {model_type!r} is not supported (supported: {tuple(FAMILY_OF_MODEL_TYPE)})"
        )
    family = FAMILY_OF_MODEL_TYPE[model_type]
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


def _read_per_expert_modules(experts: nn.Module, num_experts: int) -> tuple[int, torch.Tensor]:
    """(intermediate size, one expert weight tensor: its dtype and device)."""
    if not isinstance(experts, nn.ModuleList):
        raise UnsupportedBlockError(
            f"experts of type {type(experts).__name__} are not a ModuleList of per-expert MLPs"
        )
    if len(experts) != num_experts:
        raise UnsupportedBlockError(f"{len(experts)} experts but the router scores {num_experts}")
    first = experts[0]
    for gate_name, _, _ in (MIXTRAL.expert_projection_names, QWEN3_MOE.expert_projection_names):
        if isinstance(getattr(first, gate_name, None), nn.Linear):
            projection = getattr(first, gate_name)
            if projection.bias is not None:
                raise UnsupportedBlockError("experts with biases are not supported")
            weight = _tensor(projection, "weight", what=f"experts.0.{gate_name}.weight")
            return weight.shape[0], weight
    raise UnsupportedBlockError(
        f"per-expert modules of type {type(first).__name__} have neither w1/w2/w3 nor "
        "gate_proj/up_proj/down_proj linear layers"
    )


def is_silu(activation: Any) -> bool:
    return isinstance(activation, nn.SiLU) or type(activation).__name__ == "SiLUActivation"


def _check_activation(holder: nn.Module) -> None:
    activation = getattr(holder, "act_fn", None)
    if activation is None:
        raise UnsupportedBlockError(f"{type(holder).__name__} has no act_fn to check")
    if not is_silu(activation):
        raise UnsupportedBlockError(
            f"experts use {type(activation).__name__}; MegaMoE computes SwiGLU (SiLU) only"
        )


def _read_shared_experts(block: nn.Module, family: Family) -> dict[str, Any]:
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
    _check_activation(shared)
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
    return check_tensor(tensor, what=what)


def check_tensor(
    tensor: torch.Tensor, *, what: str, allow_meta: bool = False, allow_fp8: bool = False
) -> torch.Tensor:
    """`tensor` if megamoe can take it: floating point, not quantized (unless `allow_fp8`: e4m3
    experts, hf/fp8.py), not on the meta device (unless `allow_meta`: a block read for its
    structure alone)."""
    if allow_fp8 and tensor.dtype == torch.float8_e4m3fn:
        pass
    elif tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        accepted = "e4m3 with 128 x 128 block scales, or " if allow_fp8 else ""
        raise UnsupportedBlockError(
            f"{what} is {tensor.dtype}: megamoe takes {accepted}full-precision weights; "
            "dequantize others first"
        )
    if tensor.device.type == "meta" and not allow_meta:
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
