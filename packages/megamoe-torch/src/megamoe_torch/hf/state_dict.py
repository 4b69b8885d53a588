"""One MoE block's tensors between Hugging Face key names and MegaMoE's, both ways.

Keys are relative to the block (`gate.weight`, `experts.3.w1.weight`, ...). Hugging Face blocks
come in two layouts, both read here:

| layout     | where                                   | routed expert tensors                      |
|------------|-----------------------------------------|--------------------------------------------|
| fused      | transformers >= 5 modules in memory     | experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I] |
| per_expert | checkpoints on disk, transformers 4.x   | experts.{e}.{gate, up, down}.weight, names per family |

MegaMoE: gate.weight [E, H]; w13 [E, 2I, H] (gate rows, then up rows); w2 [E, H, I];
e_score_correction_bias [E] fp32; shared_experts.{gate_proj, up_proj, down_proj, gate}.weight.
"""

from __future__ import annotations

import re

import torch

from megamoe_torch.hf.families import Family, Layout, UnsupportedBlockError, family_named

_SHARED_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def megamoe_state_dict_from_hf(
    hf_block_state_dict: dict[str, torch.Tensor], *, family: str | Family
) -> dict[str, torch.Tensor]:
    """MegaMoE's state dict from one Hugging Face block's tensors (either layout)."""
    family = family_named(family) if isinstance(family, str) else family
    remaining = dict(hf_block_state_dict)
    out: dict[str, torch.Tensor] = {"gate.weight": _take(remaining, "gate.weight")}
    for key in ("gate.e_score_correction_bias", "e_score_correction_bias"):
        if key in remaining:
            out["e_score_correction_bias"] = remaining.pop(key).float()
    if "experts.gate_up_proj" in remaining:
        out["w13"] = _take(remaining, "experts.gate_up_proj")
        out["w2"] = _take(remaining, "experts.down_proj")
    else:
        out["w13"], out["w2"] = _stack_per_expert(remaining, family)
    if family.shared_expert_prefix is not None:
        for name in _SHARED_PROJECTIONS:
            key = f"{family.shared_expert_prefix}.{name}.weight"
            if key in remaining:
                out[f"shared_experts.{name}.weight"] = remaining.pop(key)
    if family.shared_expert_gate_key is not None and family.shared_expert_gate_key in remaining:
        out["shared_experts.gate.weight"] = remaining.pop(family.shared_expert_gate_key)
    if remaining:
        quantized = [key for key in remaining if "scale" in key]
        if quantized:
            raise UnsupportedBlockError(
                f"quantized tensors {sorted(quantized)[:4]} are not supported: dequantize first"
            )
        raise UnsupportedBlockError(
            f"{family.name} block tensors not understood: {sorted(remaining)[:8]}"
        )
    return out


def hf_state_dict_from_megamoe(
    state_dict: dict[str, torch.Tensor], *, family: str | Family, layout: Layout = "per_expert"
) -> dict[str, torch.Tensor]:
    """One Hugging Face block's tensors (block-relative keys) from a MegaMoE state dict.

    layout "per_expert" gives the names of checkpoints on disk, "fused" those of transformers >= 5
    modules in memory. Tensors are views where the layout allows.
    """
    family = family_named(family) if isinstance(family, str) else family
    if layout not in ("fused", "per_expert"):
        raise ValueError(f"layout must be 'fused' or 'per_expert', got {layout!r}")
    out: dict[str, torch.Tensor] = {"gate.weight": state_dict["gate.weight"]}
    if "e_score_correction_bias" in state_dict:
        out["gate.e_score_correction_bias"] = state_dict["e_score_correction_bias"]
    w13_E2IH, w2_EHI = state_dict["w13"], state_dict["w2"]
    if layout == "fused":
        out["experts.gate_up_proj"] = w13_E2IH
        out["experts.down_proj"] = w2_EHI
    else:
        gate_name, up_name, down_name = family.expert_projection_names
        intermediate = w13_E2IH.shape[1] // 2
        for expert in range(w13_E2IH.shape[0]):
            out[f"experts.{expert}.{gate_name}.weight"] = w13_E2IH[expert, :intermediate]
            out[f"experts.{expert}.{up_name}.weight"] = w13_E2IH[expert, intermediate:]
            out[f"experts.{expert}.{down_name}.weight"] = w2_EHI[expert]
    shared_keys = [key for key in state_dict if key.startswith("shared_experts.")]
    if shared_keys and family.shared_expert_prefix is None:
        raise ValueError(f"family {family.name!r} has no shared experts, got {shared_keys}")
    for name in _SHARED_PROJECTIONS:
        key = f"shared_experts.{name}.weight"
        if key in state_dict:
            out[f"{family.shared_expert_prefix}.{name}.weight"] = state_dict[key]
    if "shared_experts.gate.weight" in state_dict:
        if family.shared_expert_gate_key is None:
            raise ValueError(f"family {family.name!r} has no shared expert gate")
        out[family.shared_expert_gate_key] = state_dict["shared_experts.gate.weight"]
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
    remaining: dict[str, torch.Tensor], family: Family
) -> tuple[torch.Tensor, torch.Tensor]:
    expert_key = re.compile(r"experts\.(\d+)\.(\w+)\.weight")
    found: dict[int, dict[str, torch.Tensor]] = {}
    for key in [key for key in remaining if expert_key.fullmatch(key)]:
        match = expert_key.fullmatch(key)
        found.setdefault(int(match.group(1)), {})[match.group(2)] = remaining.pop(key)
    if not found:
        raise UnsupportedBlockError(
            "no routed expert tensors: expected experts.gate_up_proj/down_proj or "
            f"experts.{{e}}.{{{', '.join(family.expert_projection_names)}}}.weight"
        )
    if sorted(found) != list(range(len(found))):
        raise UnsupportedBlockError(f"expert indices are not 0..{len(found) - 1}: {sorted(found)}")
    gate_name, up_name, down_name = family.expert_projection_names
    for expert in range(len(found)):
        if set(found[expert]) != {gate_name, up_name, down_name}:
            raise UnsupportedBlockError(
                f"expert {expert} has projections {sorted(found[expert])}, expected "
                f"{family.expert_projection_names}"
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
            for name in (gate_name, up_name, down_name)
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


def layout_of(hf_block_state_dict: dict[str, torch.Tensor]) -> Layout:
    """'fused' (transformers >= 5 in memory) or 'per_expert' (checkpoints on disk, 4.x)."""
    return "fused" if "experts.gate_up_proj" in hf_block_state_dict else "per_expert"


def _take(remaining: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    if key not in remaining:
        raise UnsupportedBlockError(f"missing tensor {key!r}")
    return remaining.pop(key)
