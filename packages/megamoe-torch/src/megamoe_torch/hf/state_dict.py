"""One MoE block's tensors between Hugging Face key names and MegaMoE's, both ways.

Keys are relative to the block (`gate.weight`, `experts.3.w1.weight`, ...); a `BlockNaming`
(naming.py) says where each tensor lives and how it is laid out, for the fused layout of
transformers >= 5 modules and the per-expert layout of checkpoints on disk and transformers 4.x.
`family` arguments take a BlockNaming, a Family, or a known family's name.
"""

from __future__ import annotations

import re

import torch

from megamoe_torch.hf.families import Family, Layout, UnsupportedBlockError, family_named
from megamoe_torch.hf.naming import (
    PER_EXPERT_PROJECTION_NAMES,
    SHARED_PROJECTIONS,
    BlockNaming,
    hf_experts_from_megamoe,
    hf_gate_up_bias_from_megamoe,
    megamoe_experts_from_hf,
    megamoe_gate_up_bias_from_hf,
)


def naming_of(family: str | Family | BlockNaming) -> BlockNaming:
    """The BlockNaming of a family name, a Family or a BlockNaming."""
    if isinstance(family, BlockNaming):
        return family
    return (family_named(family) if isinstance(family, str) else family).naming


def megamoe_state_dict_from_hf(
    hf_block_state_dict: dict[str, torch.Tensor], *, family: str | Family | BlockNaming
) -> dict[str, torch.Tensor]:
    """MegaMoE's state dict from one Hugging Face block's tensors (either layout)."""
    naming = naming_of(family)
    remaining = dict(hf_block_state_dict)
    out: dict[str, torch.Tensor] = {"gate.weight": _take(remaining, naming.router_weight)}
    if naming.router_bias is not None:
        out["gate.bias"] = _take(remaining, naming.router_bias)
    if naming.correction_bias is not None and naming.correction_bias in remaining:
        out["e_score_correction_bias"] = remaining.pop(naming.correction_bias).float().reshape(-1)
    for key in naming.ignored:  # held by the block, unused by its computation
        remaining.pop(key, None)
    if naming.expert_keys[0] in remaining:
        expert_tensors = {key: _take(remaining, key) for key in naming.expert_keys}
        out["w13"], out["w2"] = megamoe_experts_from_hf(
            naming, expert_tensors, num_experts=out["gate.weight"].shape[0]
        )
        if naming.gate_up_bias is not None:
            bias = _take(remaining, naming.gate_up_bias)
            out["w13_bias"] = megamoe_gate_up_bias_from_hf(naming, bias)
            out["w2_bias"] = _take(remaining, naming.down_bias)
    else:
        out["w13"], out["w2"] = _stack_per_expert(remaining, naming)
    if naming.shared_prefix is not None:
        for name in SHARED_PROJECTIONS:
            key = f"{naming.shared_prefix}.{name}.weight"
            if key in remaining:
                out[f"shared_experts.{name}.weight"] = remaining.pop(key)
    if naming.shared_gate is not None and naming.shared_gate in remaining:
        out["shared_experts.gate.weight"] = remaining.pop(naming.shared_gate)
    if remaining:
        quantized = [key for key in remaining if "scale" in key]
        if quantized:
            raise UnsupportedBlockError(
                f"quantized tensors {sorted(quantized)[:4]} are not supported: dequantize first"
            )
        raise UnsupportedBlockError(
            f"{naming.family} block tensors not understood: {sorted(remaining)[:8]}"
        )
    return out


def hf_state_dict_from_megamoe(
    state_dict: dict[str, torch.Tensor],
    *,
    family: str | Family | BlockNaming,
    layout: Layout = "per_expert",
) -> dict[str, torch.Tensor]:
    """One Hugging Face block's tensors (block-relative keys) from a MegaMoE state dict.

    layout "per_expert" gives the names of checkpoints on disk, "fused" those of transformers >= 5
    modules in memory. Tensors are views where the layout allows.
    """
    naming = naming_of(family)
    if layout not in ("fused", "per_expert"):
        raise ValueError(f"layout must be 'fused' or 'per_expert', got {layout!r}")
    out: dict[str, torch.Tensor] = {naming.router_weight: state_dict["gate.weight"]}
    if "gate.bias" in state_dict:
        if naming.router_bias is None:
            raise ValueError(f"family {naming.family!r} has no router bias")
        out[naming.router_bias] = state_dict["gate.bias"]
    if "e_score_correction_bias" in state_dict:
        bias_E = state_dict["e_score_correction_bias"]
        if naming.correction_bias_shape is not None:
            bias_E = bias_E.reshape(naming.correction_bias_shape)
        if naming.correction_bias_dtype is not None:
            bias_E = bias_E.to(naming.correction_bias_dtype)
        if naming.correction_bias is None:
            raise ValueError(f"family {naming.family!r} has no correction bias")
        out[naming.correction_bias] = bias_E
    w13_E2IH, w2_EHI = state_dict["w13"], state_dict["w2"]
    has_biases = "w13_bias" in state_dict
    if layout == "fused":
        out.update(hf_experts_from_megamoe(naming, w13_E2IH, w2_EHI))
        if has_biases:
            if naming.gate_up_bias is None:
                raise ValueError(f"family {naming.family!r} has no expert biases")
            bias = hf_gate_up_bias_from_megamoe(naming, state_dict["w13_bias"])
            out[naming.gate_up_bias], out[naming.down_bias] = bias, state_dict["w2_bias"]
    else:
        if has_biases:
            raise ValueError(
                "expert biases have no per-expert checkpoint names: use layout='fused'"
            )
        gate_name, up_name, down_name = naming.per_expert_projections
        intermediate = w13_E2IH.shape[1] // 2
        for expert in range(w13_E2IH.shape[0]):
            out[f"experts.{expert}.{gate_name}.weight"] = w13_E2IH[expert, :intermediate]
            out[f"experts.{expert}.{up_name}.weight"] = w13_E2IH[expert, intermediate:]
            out[f"experts.{expert}.{down_name}.weight"] = w2_EHI[expert]
    shared_keys = [key for key in state_dict if key.startswith("shared_experts.")]
    if shared_keys and naming.shared_prefix is None:
        raise ValueError(f"family {naming.family!r} has no shared experts, got {shared_keys}")
    for name in SHARED_PROJECTIONS:
        key = f"shared_experts.{name}.weight"
        if key in state_dict:
            out[f"{naming.shared_prefix}.{name}.weight"] = state_dict[key]
    if "shared_experts.gate.weight" in state_dict:
        if naming.shared_gate is None:
            raise ValueError(f"family {naming.family!r} has no shared expert gate")
        out[naming.shared_gate] = state_dict["shared_experts.gate.weight"]
    return out


def block_state_dict(
    model_state_dict: dict[str, torch.Tensor], *, prefix: str
) -> dict[str, torch.Tensor]:
    """The tensors under `prefix` (e.g. 'model.layers.3.mlp.'), with the prefix removed."""
    if not prefix.endswith("."):
        prefix += "."
    return {
        key[len(prefix) :]: value
        for key, value in model_state_dict.items()
        if key.startswith(prefix)
    }


def _stack_per_expert(
    remaining: dict[str, torch.Tensor], naming: BlockNaming
) -> tuple[torch.Tensor, torch.Tensor]:
    expert_key = re.compile(r"experts\.(\d+)\.(\w+)\.weight")
    found: dict[int, dict[str, torch.Tensor]] = {}
    for key in [key for key in remaining if expert_key.fullmatch(key)]:
        match = expert_key.fullmatch(key)
        found.setdefault(int(match.group(1)), {})[match.group(2)] = remaining.pop(key)
    expected = (*naming.expert_keys, *naming.per_expert_projections)
    if not found:
        raise UnsupportedBlockError(
            f"no routed expert tensors: expected {'/'.join(naming.expert_keys)} or "
            f"experts.{{e}}.{{{', '.join(naming.per_expert_projections)}}}.weight"
        )
    if sorted(found) != list(range(len(found))):
        raise UnsupportedBlockError(f"expert indices are not 0..{len(found) - 1}: {sorted(found)}")
    # the family's names, else the other names checkpoints use for the same projections
    candidates = (naming.per_expert_projections, *PER_EXPERT_PROJECTION_NAMES)
    names = next((n for n in candidates if set(found[0]) == set(n)), naming.per_expert_projections)
    gate_name, up_name, down_name = names
    for expert in range(len(found)):
        if set(found[expert]) != set(names):
            raise UnsupportedBlockError(
                f"expert {expert} has projections {sorted(found[expert])}, expected {names} "
                f"(or {expected[0]}/{expected[1]})"
            )
    # without the model's config, expert 0 is the reference every expert must match
    reference_key = f"experts.0.{gate_name}.weight"
    if found[0][gate_name].dim() != 2:
        raise ValueError(
            f"{reference_key} has shape {tuple(found[0][gate_name].shape)}, expected "
            "[intermediate_size, hidden_size]"
        )
    intermediate, hidden = found[0][gate_name].shape
    projection_shapes = (
        (gate_name, (intermediate, hidden)),
        (up_name, (intermediate, hidden)),
        (down_name, (hidden, intermediate)),
    )
    check_shapes(
        {
            f"experts.{expert}.{name}.weight": found[expert][name]
            for expert in found
            for name in names
        },
        {
            f"experts.{expert}.{name}.weight": shape
            for expert in found
            for name, shape in projection_shapes
        },
        reference=f"{reference_key} {(intermediate, hidden)}",
    )
    w13 = [torch.cat([found[e][gate_name], found[e][up_name]], dim=0) for e in range(len(found))]
    w2 = [found[expert][down_name] for expert in range(len(found))]
    return torch.stack(w13), torch.stack(w2)


def check_shapes(
    tensors: dict[str, torch.Tensor],
    expected_shapes: dict[str, tuple[int, ...]],
    *,
    reference: str,
    prefix: str = "",
) -> None:
    """Raises ValueError naming every tensor whose shape is not the expected one.

    Keys only one side has are left to the caller. `reference` names where the expected shapes
    come from; `prefix` goes before the keys in the message (the checkpoint's full names).
    """
    wrong = [
        f"{prefix + key!r} has shape {tuple(tensor.shape)}, expected {tuple(expected_shapes[key])}"
        for key, tensor in tensors.items()
        if key in expected_shapes and tuple(tensor.shape) != tuple(expected_shapes[key])
    ]
    if wrong:
        more = f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else ""
        raise ValueError(f"{'; '.join(wrong[:4])}{more} (expected shapes from {reference})")


def layout_of(
    hf_block_state_dict: dict[str, torch.Tensor], naming: BlockNaming | None = None
) -> Layout:
    """'fused' (transformers >= 5 in memory) or 'per_expert' (checkpoints on disk, 4.x)."""
    gate_up = "experts.gate_up_proj" if naming is None else naming.expert_keys[0]
    return "fused" if gate_up in hf_block_state_dict else "per_expert"


def _take(remaining: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in remaining:
        raise UnsupportedBlockError(f"missing tensor {key!r}")
    return remaining.pop(key)
