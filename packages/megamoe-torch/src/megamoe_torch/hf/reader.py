"""What a transformers MoE block computes, read from its structure and confirmed by probes.

Shape legend: T probe tokens, H hidden size, E experts, K experts per token, I intermediate size.

A transformers >= 5 MoE block is a router child (`gate` or `router`) holding one [E, H] weight
(and maybe a bias), stacked expert weights in an `experts` child, maybe a shared expert MLP and its
sigmoid gate, and maybe a correction bias on the router, the block or a statistics submodule. The
structure says where every tensor lives; what the code does with them (which scores, which
renormalisation, which groups, which SwiGLU, how the parts are summed) is observed by running
copies of the block's own modules on random probe inputs:

- routing: a copy of the block whose router, correction bias and shared expert gate hold random
  fp32 weights, whose experts module records what it is called with, and whose shared experts
  answer a fixed random tensor. The recorded (ids, weights) are matched against megamoe's routings
  (softmax or sigmoid scores, renormalised or not, with or without the correction bias, grouped
  top-k); the ratio of the weights gives the routed scaling. The block's output, fitted against
  the recorded parts, shows how they combine (scaled routed sum, shared experts, their gate).
  Experts called on the weighted token copies of every expert (Llama 4) show routing weights
  applied to the input.
- experts: a copy holding two random experts, on tokens of several magnitudes, matched against
  the SwiGLU variants (plain, clamped with alpha and (up + 1)) in each layout (gate/up halves or
  interleaved, [E, 2I, H] or transposed [E, H, 2I]), with the biases it holds.
- router dtype: the router's copy on bf16 inputs shows whether its logits are an fp32 product.

No probe touches the block or its weights, and none depends on the weights' values (random
values show what zeros or equal values would hide). A reading is cached per block structure (its
classes, tensor shapes and scalar attributes), so a model's blocks are probed once. A block that
none of megamoe's computations reproduces raises UnsupportedBlockError saying what differs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megamoe_kernels import SwiGLU
from torch import nn

from megamoe_torch.config import MegaMoEConfig
from megamoe_torch.hf.families import BlockReading, UnsupportedBlockError, read_legacy_block
from megamoe_torch.hf.matching import (
    identity_weights,
    match_routing,
    read_experts_math,
    read_output_norm,
    read_router_dtype,
    read_shared_experts,
    snapped_scale,
)
from megamoe_torch.hf.naming import BlockNaming
from megamoe_torch.hf.probes import (
    ProbeRandom,
    answer_of,
    combination,
    routed_of,
    router_logits_position,
    run_block,
)
from megamoe_torch.hf.structure import BlockParts, block_parts, structure_key


def read_block(block: nn.Module, *, structure_only: bool = False) -> BlockReading:
    """What a transformers MoE block computes (MegaMoEConfig fields), how it names its tensors
    and how it answers. Raises UnsupportedBlockError saying why a block cannot be reproduced.

    `structure_only`: the block may hold meta tensors (a model built from its config alone, to
    read a checkpoint's tensors by): the probes never need the weights' values."""
    if getattr(block, "_hf_hook", None) is not None:
        raise UnsupportedBlockError(
            "the block is managed by accelerate (device map / offload hooks): convert it "
            "before dispatching the model"
        )
    if isinstance(getattr(block, "experts", None), nn.ModuleList):
        return read_legacy_block(block)
    parts = block_parts(block, allow_meta=structure_only)
    key = structure_key(block)
    recipe = _RECIPES.get(key)
    if recipe is None:
        try:
            recipe = _Recipe(reading=_read_by_probes(block, parts), error=None)
        except UnsupportedBlockError as error:
            recipe = _Recipe(reading=None, error=str(error))
        except Exception as error:  # the block's code on probe inputs it did not expect
            recipe = _Recipe(
                reading=None,
                error=f"probing the block failed ({type(error).__name__}: {error})",
            )
        _RECIPES[key] = recipe
    if recipe.error is not None:
        raise UnsupportedBlockError(recipe.error)
    expert_weight = parts.expert_weight
    return replace(recipe.reading, expert_dtype=expert_weight.dtype, device=expert_weight.device)


@dataclass(frozen=True)
class _Recipe:
    reading: BlockReading | None
    error: str | None


_RECIPES: dict[tuple, _Recipe] = {}


def _read_by_probes(block: nn.Module, parts: BlockParts) -> BlockReading:
    random = ProbeRandom()
    has_bias = parts.naming.correction_bias is not None
    # a second probe with biased scores all negative tells how dropped groups are masked
    runs = [
        run_block(block, parts, random, bias_mean=mean)
        for mean in ((0.0, -2.0) if has_bias else (0.0,))
    ]
    routed = [routed_of(run, parts) for run in runs]
    weights_on_input = routed[0].weights_on_input
    routing_fields, weight_scale = match_routing(parts, runs, routed)
    logits_index, router_outputs = router_logits_position(runs[0])
    answer, y_TH, output_shape = answer_of(runs[0], routed[0])
    identity_T1 = identity_weights(routing_fields, parts, runs[0])
    output_scale, identity_scale = combination(runs[0], routed[0], y_TH, identity_T1=identity_T1)
    if identity_scale is not None:
        _check_identity_scale(identity_scale, weight_scale * output_scale)
    if weights_on_input and abs(output_scale - 1.0) > 1e-4:
        raise UnsupportedBlockError(
            f"the block scales its experts' output by {output_scale:.4g} after weighting their "
            "input"
        )
    router_dtype, logits_float32 = read_router_dtype(parts, runs[0], logits_index)
    expert_math = read_experts_math(parts, random, weights_on_input=weights_on_input)
    naming_fields = dict(vars(parts.naming))
    for name in ("experts_transposed", "gate_up_interleaved"):
        if name in expert_math:
            naming_fields[name] = expert_math.pop(name)
    if has_bias and not routing_fields["use_correction_bias"]:  # held, unused by the routing
        naming_fields.update(correction_bias=None, ignored=(parts.naming.correction_bias,))
    naming = BlockNaming(**naming_fields)
    routing_fields = {k: v for k, v in routing_fields.items() if k != "num_experts"}
    fields = dict(
        hidden_size=parts.hidden_size,
        latent_size=parts.expert_hidden_size if parts.latent else None,
        intermediate_size=parts.intermediate_size,
        num_experts=parts.routed_experts,
        num_identity_experts=parts.num_identity_experts,
        router_dtype=router_dtype,
        router_bias=parts.naming.router_bias is not None,
        expert_bias=parts.naming.gate_up_bias is not None,
        routing_weights_on_input=weights_on_input,
        routed_scaling_factor=snapped_scale(weight_scale * output_scale, parts),
        **routing_fields,
        **expert_math,
    )
    routed_swiglu = SwiGLU(
        limit=fields["swiglu_limit"],
        alpha=fields["swiglu_alpha"],
        up_offset=fields["swiglu_up_offset"],
        gate_softcap=fields["swiglu_gate_softcap"],
        up_softcap=fields["swiglu_up_softcap"],
        gate_cubic=fields["swiglu_gate_cubic"],
    )
    fields.update(
        read_shared_experts(
            parts, random, routed_swiglu=routed_swiglu, activation=fields["activation"]
        ),
        **read_output_norm(parts, random),
    )
    try:
        MegaMoEConfig(**fields)
    except ValueError as error:
        raise UnsupportedBlockError(f"megamoe cannot express this block: {error}") from error
    gate_up = parts.expert_weight
    return BlockReading(
        naming=naming,
        config_fields=fields,
        layout="fused",
        answer=answer,
        expert_dtype=gate_up.dtype,
        device=gate_up.device,
        router_name=parts.router_name,
        output_shape=output_shape,
        router_logits_index=logits_index,
        router_outputs=router_outputs,
        router_logits_float32=logits_float32,
        inputs=parts.inputs,
    )


def _check_identity_scale(identity_scale: float, routed_scale: float) -> None:
    """The identity experts' tokens are weighted as the routed experts' outputs are (the
    layer scales every pair's weight alike); raises otherwise."""
    if abs(identity_scale - routed_scale) > 1e-4 * abs(routed_scale):
        raise UnsupportedBlockError(
            f"the block weighs its identity experts' tokens by {identity_scale:.4g} times their "
            f"routing weights where its routed experts' outputs take {routed_scale:.4g}: "
            "megamoe scales both alike"
        )
