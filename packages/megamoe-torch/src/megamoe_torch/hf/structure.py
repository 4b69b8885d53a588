"""Where a transformers MoE block keeps its parts and tensors: its router, experts, shared
experts and biases, read from the module tree alone (no forward is run).

Shape legend: E experts, H hidden size, I intermediate size.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import torch
from torch import nn

from megamoe_torch.hf.families import UnsupportedBlockError, check_tensor
from megamoe_torch.hf.fp8 import check_fp8_modules
from megamoe_torch.hf.naming import BlockNaming

ROUTER_NAMES = ("gate", "router")
SHARED_NAMES = ("shared_experts", "shared_expert", "shared_mlp")
SHARED_GATE_NAME = "shared_expert_gate"
# the latent MoE's projections into and out of the routed experts' space (Nemotron-H): Linears,
# or nn.Identity where a block has none
LATENT_NAMES = ("fc1_latent_proj", "fc2_latent_proj")
# a norm of the block's output (A.X-K1's RMSNorm): a module holding one weight [H] (whether it
# computes the RMSNorm megamoe computes, a probe tells)
OUTPUT_NORM_NAMES = ("post_mlp_layernorm",)
# the inputs a block's forward may take besides the hidden states (with defaults): the token
# ids, which DeepSeek-V4's hash layers route by (its other layers take and ignore them)
BLOCK_INPUTS = ("input_ids",)
# attributes of blocks that multiply their training inputs by random noise (Mixtral, PhiMoE)
INPUT_JITTER_ATTRIBUTES = ("jitter_noise", "input_jitter_noise", "moe_jitter_eps")
# DBRX: each expert's gate, up and (transposed) down rows stacked, [E * I, H] each
FLATTENED_EXPERT_TENSORS = ("mlp.w1", "mlp.v1", "mlp.w2")
EXPERT_TENSORS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
# ungated experts (Nemotron-H): the up projection [E, I, H] alone beside down_proj
UNGATED_EXPERT_TENSORS = ("up_proj", "down_proj")
# the block scales of e4m3 experts (transformers' FP8Experts)
FP8_SCALES = ("gate_up_proj_scale_inv", "up_proj_scale_inv", "down_proj_scale_inv")


@dataclass(frozen=True)
class BlockParts:
    block: nn.Module
    router_name: str
    router: nn.Module
    experts: nn.Module
    shared_name: str | None
    shared: nn.Module | None
    shared_gate: nn.Linear | None
    naming: BlockNaming
    # the experts the router scores: the routed ones, then any identity experts
    num_experts: int
    hidden_size: int
    intermediate_size: int
    # the width of the routed experts' rows: a latent MoE's latent size, else hidden_size
    expert_hidden_size: int
    # scored experts past the experts module's, which compute no MLP (LongCat-Flash's
    # zero-computation experts): whether they return their token the probes tell
    num_identity_experts: int
    # the inputs of BLOCK_INPUTS the block's forward takes
    inputs: tuple[str, ...] = ()
    # the token ids the routing table holds rows for (0: no table)
    routing_table_vocab_size: int = 0

    @property
    def routed_experts(self) -> int:
        """The experts the experts module computes."""
        return self.num_experts - self.num_identity_experts

    @property
    def latent(self) -> bool:
        return self.naming.latent_in is not None

    @property
    def output_norm_name(self) -> str | None:
        """The name of the block's child normalising its output, or None."""
        return None if self.naming.output_norm is None else self.naming.output_norm.split(".")[0]

    @property
    def output_norm(self) -> nn.Module | None:
        """The module normalising the block's output, or None."""
        name = self.output_norm_name
        return None if name is None else getattr(self.block, name)

    @property
    def expert_weight(self) -> torch.Tensor:
        """One routed expert weight tensor: its dtype and device are the experts'."""
        return self.block.state_dict(keep_vars=True)[self.naming.expert_keys[0]]


def block_parts(block: nn.Module, *, allow_meta: bool = False) -> BlockParts:
    """The parts of `block` and where its tensors live; raises UnsupportedBlockError saying
    which part megamoe does not take."""
    children = dict(block.named_children())
    described = ", ".join(f"{name} ({type(child).__name__})" for name, child in children.items())
    router_name = next((name for name in ROUTER_NAMES if name in children), None)
    if router_name is None:
        raise UnsupportedBlockError(
            f"{type(block).__name__} routes with none of a `gate` or `router` child next to "
            f"stacked `experts` (its children: {described})"
        )
    experts = children.get("experts")
    if experts is None:
        raise UnsupportedBlockError(
            f"the routed experts are not one `experts` module of stacked expert weights "
            f"(the block's children: {described})"
        )
    attention = [name for name, child in children.items() if "Attention" in type(child).__name__]
    if attention:
        raise UnsupportedBlockError(
            f"the router and experts sit in {type(block).__name__} beside its attention "
            f"({', '.join(attention)}), not in an MoE block of their own that megamoe can replace"
        )
    shared_name = next((name for name in SHARED_NAMES if name in children), None)
    shared_gate = children.get(SHARED_GATE_NAME)
    known = {
        router_name,
        "experts",
        shared_name,
        SHARED_GATE_NAME,
        *LATENT_NAMES,
        *OUTPUT_NORM_NAMES,
    }
    for name, child in children.items():
        if name not in known and any(True for _ in child.state_dict()):
            raise UnsupportedBlockError(
                f"the block holds {name} ({type(child).__name__}) beside its router and "
                "experts, a part megamoe does not compute"
            )
    inputs = _forward_inputs(block)
    check_fp8_modules(block)
    for holder in (block, children[router_name]):
        for name, value in vars(holder).items():
            if name in INPUT_JITTER_ATTRIBUTES and isinstance(value, (int, float)) and value > 0:
                raise UnsupportedBlockError(
                    f"{name}={value} multiplies training inputs by random noise, which MegaMoE "
                    "does not reproduce; set it to 0.0 to convert"
                )
    parts = _named_tensors(
        block,
        allow_meta=allow_meta,
        router_name=router_name,
        experts=experts,
        shared_name=shared_name,
        shared_gate=shared_gate,
    )
    if parts.naming.routing_table is not None and "input_ids" not in inputs:
        raise UnsupportedBlockError(
            f"the router holds a routing table ({parts.naming.routing_table}) but the block's "
            "forward takes no input_ids to look it up with"
        )
    return replace(parts, inputs=inputs)


def _forward_inputs(block: nn.Module) -> tuple[str, ...]:
    """The inputs of BLOCK_INPUTS the block's forward takes besides the hidden states; raises
    for any other input, or one without a default."""
    parameters = list(inspect.signature(type(block).forward).parameters.values())[1:]
    extra = [
        p
        for p in parameters[1:]
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    unknown = [p.name for p in extra if p.name not in BLOCK_INPUTS or p.default is p.empty]
    if not parameters or unknown:
        raise UnsupportedBlockError(
            f"the block's forward takes {unknown or 'no input'} besides the hidden states (the "
            "layer computes from the hidden states, and from input_ids where it routes by token "
            "id)"
        )
    return tuple(p.name for p in extra)


def _named_tensors(
    block: nn.Module,
    *,
    allow_meta: bool,
    router_name: str,
    experts: nn.Module,
    shared_name: str | None,
    shared_gate: nn.Module | None,
) -> BlockParts:
    """Where each of the block's tensors lives, as a BlockNaming, and the block's sizes."""
    tensors = block.state_dict(keep_vars=True)
    router_prefix = f"{router_name}."
    # the [E, H] weight; a [1, E] correction bias (ERNIE 4.5's moe_statics) is not a matrix,
    # nor is a routing table of integers
    router_2d = [
        k
        for k, t in tensors.items()
        if k.startswith(router_prefix) and t.dim() == 2 and t.shape[0] > 1 and t.is_floating_point()
    ]
    if len(router_2d) != 1:
        raise UnsupportedBlockError(
            f"the router {router_name} holds {len(router_2d)} matrices {router_2d}, not one "
            "[experts, hidden] weight"
        )
    router_weight = router_2d[0]
    num_experts, hidden_size = tensors[router_weight].shape
    routing_table = _routing_table_key(tensors, router_prefix)
    latent_size = _latent_size(block, hidden_size)
    output_norm = _output_norm_key(block, hidden_size)
    router_bias = router_weight[: -len("weight")] + "bias"
    router_bias = (
        router_bias if router_weight.endswith(".weight") and router_bias in tensors else None
    )
    correction_bias: list[str] = []
    experts_found: dict[str, str] = {}
    for key, tensor in tensors.items():
        # e4m3 experts and shared experts with their block scales (hf/fp8.py); not the router
        in_experts = key.startswith("experts.") or (
            shared_name is not None and key.startswith(f"{shared_name}.")
        )
        if key == routing_table:
            if tensor.device.type == "meta" and not allow_meta:
                raise UnsupportedBlockError(f"{key} is on the meta device: load the weights first")
            continue
        check_tensor(tensor, what=key, allow_meta=allow_meta, allow_fp8=in_experts)
        if key in (router_weight, router_bias):
            continue
        if key.startswith(router_prefix) or "." not in key:
            if tuple(tensor.shape) in ((num_experts,), (1, num_experts)):
                correction_bias.append(key)
                continue
            raise UnsupportedBlockError(
                f"{key} {tuple(tensor.shape)} is neither the router's weight and bias nor a "
                "per-expert correction bias"
            )
        if key.startswith("experts."):
            experts_found[key[len("experts.") :]] = key
            continue
        if shared_name is not None and key.startswith(f"{shared_name}."):
            continue
        if latent_size is not None and key in (f"{name}.weight" for name in LATENT_NAMES):
            continue
        if key == output_norm:
            continue
        if key == f"{SHARED_GATE_NAME}.weight" and tensor.shape == (1, hidden_size):
            continue
        raise UnsupportedBlockError(f"the block's tensor {key} is not one megamoe reproduces")
    if len(correction_bias) > 1:
        raise UnsupportedBlockError(f"more than one per-expert bias: {correction_bias}")
    _check_expert_tensors(experts_found)
    ungated = "gate_up_proj" not in experts_found and "up_proj" in experts_found
    gate_up_key = "experts.up_proj" if ungated else "experts.gate_up_proj"
    expert_hidden_size = hidden_size if latent_size is None else latent_size
    routed = num_experts
    if set(experts_found) == set(FLATTENED_EXPERT_TENSORS):
        flattened = tuple(f"experts.{name}" for name in FLATTENED_EXPERT_TENSORS[:2])
        intermediate_size = _flattened_intermediate_size(
            [tensors[f"experts.{name}"] for name in FLATTENED_EXPERT_TENSORS],
            num_experts,
            expert_hidden_size,
        )
        down_key = f"experts.{FLATTENED_EXPERT_TENSORS[2]}"
    else:
        flattened, down_key = None, "experts.down_proj"
        gate_up, down = tensors[gate_up_key], tensors["experts.down_proj"]
        routed = _routed_experts(gate_up, down, num_experts)
        intermediate_size = _intermediate_size(
            gate_up, down, routed, expert_hidden_size, gated=not ungated
        )
    bias_key = correction_bias[0] if correction_bias else None
    if shared_gate is not None and (shared_name is None or not isinstance(shared_gate, nn.Linear)):
        raise UnsupportedBlockError("the shared expert gate is not a Linear next to shared experts")
    naming = BlockNaming(
        family=family_of(block),
        router_weight=router_weight,
        router_bias=router_bias,
        correction_bias=bias_key,
        correction_bias_shape=None if bias_key is None else tuple(tensors[bias_key].shape),
        correction_bias_dtype=None if bias_key is None else tensors[bias_key].dtype,
        gate_up_bias=experts_found.get("gate_up_proj_bias"),
        down_bias=experts_found.get("down_proj_bias"),
        gate_up=gate_up_key,
        down=down_key,
        experts_ungated=ungated,
        flattened_gate_and_up=flattened,
        per_expert_projections=_per_expert_projections(family_of(block)),
        shared_prefix=shared_name,
        shared_gate=None if shared_gate is None else f"{SHARED_GATE_NAME}.weight",
        shared_gate_up=f"{shared_name}.gate_up_proj.weight" in tensors,
        latent_in=None if latent_size is None else f"{LATENT_NAMES[0]}.weight",
        latent_out=None if latent_size is None else f"{LATENT_NAMES[1]}.weight",
        output_norm=output_norm,
        routing_table=routing_table,
    )
    return BlockParts(
        block=block,
        router_name=router_name,
        router=getattr(block, router_name),
        experts=experts,
        shared_name=shared_name,
        shared=None if shared_name is None else getattr(block, shared_name),
        shared_gate=shared_gate,
        naming=naming,
        num_experts=num_experts,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        expert_hidden_size=expert_hidden_size,
        num_identity_experts=num_experts - routed,
        routing_table_vocab_size=0 if routing_table is None else tensors[routing_table].shape[0],
    )


def _routing_table_key(tensors: dict[str, torch.Tensor], router_prefix: str) -> str | None:
    """The key of the router's table of each token id's experts ([V, K] integers: DeepSeek-V4's
    hash layers' tid2eid), or None."""
    tables = [
        k
        for k, t in tensors.items()
        if k.startswith(router_prefix) and t.dim() == 2 and not t.is_floating_point()
    ]
    if len(tables) > 1:
        raise UnsupportedBlockError(f"the router holds more than one table of integers: {tables}")
    return tables[0] if tables else None


def _routed_experts(gate_up: torch.Tensor, down: torch.Tensor, scored: int) -> int:
    """The experts the stacked tensors hold: all `scored` ones, or fewer, the others then being
    experts that compute no MLP (zero-computation experts, whose probe follows)."""
    held = gate_up.shape[0] if gate_up.dim() == down.dim() == 3 else 0
    if 0 < held < scored and down.shape[0] == held:
        return held
    return scored


def _latent_size(block: nn.Module, hidden_size: int) -> int | None:
    """L of a latent MoE's bias-free projections, [L, H] into the experts' space and [H, L] out
    of it; None for a block without them (or with nn.Identity in their place)."""
    into, out_of = (getattr(block, name, None) for name in LATENT_NAMES)
    if all(part is None or isinstance(part, nn.Identity) for part in (into, out_of)):
        return None
    if not (
        isinstance(into, nn.Linear)
        and isinstance(out_of, nn.Linear)
        and into.bias is None
        and out_of.bias is None
        and into.in_features == out_of.out_features == hidden_size
        and into.out_features == out_of.in_features
    ):
        described = ", ".join(
            f"{name} ({type(getattr(block, name, None)).__name__})" for name in LATENT_NAMES
        )
        raise UnsupportedBlockError(
            f"the latent projections {described} are not bias-free Linears [L, {hidden_size}] "
            f"and [{hidden_size}, L], the latent MoE megamoe computes"
        )
    return into.out_features


def _output_norm_key(block: nn.Module, hidden_size: int) -> str | None:
    """The key of the weight [H] of a norm of the block's output; None for a block without one."""
    for name in OUTPUT_NORM_NAMES:
        norm = getattr(block, name, None)
        if norm is None:
            continue
        tensors = norm.state_dict(keep_vars=True)
        if list(tensors) != ["weight"] or tuple(tensors["weight"].shape) != (hidden_size,):
            shapes = {key: tuple(tensor.shape) for key, tensor in tensors.items()}
            raise UnsupportedBlockError(
                f"the output norm {name} ({type(norm).__name__}) holds {shapes}, not one weight "
                f"[{hidden_size}]: the RMSNorm megamoe computes"
            )
        return f"{name}.weight"
    return None


def _check_expert_tensors(found: dict[str, str]) -> None:
    """Raises saying why the experts' tensors (names under `experts.`) are not megamoe's."""
    names = set(found)
    if names == set(FLATTENED_EXPERT_TENSORS):
        return
    quantized = sorted(name for name in names if "scale" in name and name not in FP8_SCALES)
    if quantized:
        raise UnsupportedBlockError(
            f"the experts hold quantized tensors {[found[n] for n in quantized]}: megamoe takes "
            "full-precision experts, or e4m3 ones with their 128 x 128 block scales "
            f"({', '.join(FP8_SCALES)}); dequantize others first"
        )
    names -= set(FP8_SCALES)
    if names == set(UNGATED_EXPERT_TENSORS):
        return
    extra = sorted(names - set(EXPERT_TENSORS) - set(UNGATED_EXPERT_TENSORS))
    projections = names - set(extra)
    if extra and (
        projections == set(UNGATED_EXPERT_TENSORS) or {"gate_up_proj", "down_proj"} <= projections
    ):
        raise UnsupportedBlockError(
            f"the experts hold {[found[name] for name in extra]} beside their projections, a "
            "part megamoe does not compute"
        )
    unknown = sorted(names - set(EXPERT_TENSORS))
    if unknown or not {"gate_up_proj", "down_proj"} <= names:
        raise UnsupportedBlockError(
            f"the experts hold {sorted(found.values())}: megamoe takes experts.gate_up_proj and "
            "experts.down_proj (with their biases, optionally), ungated experts.up_proj and "
            "experts.down_proj, or DBRX's flattened "
            f"experts.{{{', '.join(FLATTENED_EXPERT_TENSORS)}}}"
        )
    if ("gate_up_proj_bias" in names) != ("down_proj_bias" in names):
        raise UnsupportedBlockError("the experts hold a bias on one projection only")


def _flattened_intermediate_size(
    tensors: list[torch.Tensor], num_experts: int, hidden_size: int
) -> int:
    shapes = {tuple(tensor.shape) for tensor in tensors}
    rows = next(iter(shapes))[0] if len(shapes) == 1 and len(next(iter(shapes))) == 2 else 0
    if rows == 0 or rows % num_experts or next(iter(shapes))[1] != hidden_size:
        raise UnsupportedBlockError(
            f"the flattened experts {sorted(shapes)} are not three [{num_experts} * I, "
            f"{hidden_size}] tensors"
        )
    return rows // num_experts


def _intermediate_size(
    gate_up: torch.Tensor, down: torch.Tensor, num_experts: int, hidden_size: int, *, gated: bool
) -> int:
    """I from the experts' [E, 2I, H] (ungated: [E, I, H]) and [E, H, I] tensors, either of
    them transposed."""
    rows_per_i = 2 if gated else 1
    if gate_up.dim() == 3 and down.dim() == 3 and gate_up.shape[0] == down.shape[0] == num_experts:
        for first_rows, h in (gate_up.shape[1:], gate_up.shape[1:][::-1]):
            intermediate = first_rows // rows_per_i
            if (
                h == hidden_size
                and first_rows % rows_per_i == 0
                and {tuple(down.shape[1:])}
                & {
                    (hidden_size, intermediate),
                    (intermediate, hidden_size),
                }
            ):
                return intermediate
    first = "gate_up_proj" if gated else "up_proj"
    rows = "2I" if gated else "I"
    raise UnsupportedBlockError(
        f"experts.{first} {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not "
        f"[{num_experts}, {rows}, {hidden_size}] and [{num_experts}, {hidden_size}, I] (or "
        "transposed)"
    )


def family_of(block: nn.Module) -> str:
    """The transformers model family of a block's class (its models/<family>/ package)."""
    module = type(block).__module__.split(".")
    if len(module) >= 3 and module[0] == "transformers" and module[1] == "models":
        return module[2]
    return type(block).__name__


def _per_expert_projections(family: str) -> tuple[str, str, str]:
    """The per-expert names the family's checkpoints use on disk, from transformers' own
    loading conversions; gate_proj/up_proj/down_proj where it has none."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return ("gate_proj", "up_proj", "down_proj")
    for transform in get_checkpoint_conversion_mapping(family) or ():
        sources = list(getattr(transform, "source_patterns", ()))
        targets = "".join(getattr(transform, "target_patterns", ()))
        if targets.endswith("experts.gate_up_proj") and len(sources) == 2:
            gate, up = (source.rsplit(".", 2)[-2] for source in sources)
            down = "w2" if gate == "w1" else "down_proj"
            return (gate, up, down)
    return ("gate_proj", "up_proj", "down_proj")


def structure_key(block: nn.Module) -> tuple:
    """What a reading depends on: the classes and scalar attributes of the block and all its
    submodules, and its tensors' names, shapes and dtypes (not their values)."""
    shapes = tuple(
        (key, tuple(t.shape), t.dtype) for key, t in block.state_dict(keep_vars=True).items()
    )
    modules = tuple((name, type(m), _scalar_attributes(m)) for name, m in block.named_modules())
    return modules, shapes


def _scalar_attributes(module: nn.Module) -> tuple:
    return tuple(
        (name, value)
        for name, value in sorted(vars(module).items())
        if name != "training"
        and not name.startswith("_")
        and isinstance(value, (bool, int, float, str, type(None)))
    )
