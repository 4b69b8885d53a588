"""One MoE block's tensors between Hugging Face key names and MegaMoE's, both ways.

Keys are relative to the block (`gate.weight`, `experts.3.w1.weight`, ...); a `BlockNaming`
(naming.py) says where each tensor lives and how it is laid out, for the fused layout of
transformers >= 5 modules and the per-expert layout of checkpoints on disk and transformers 4.x.
`family` arguments take a BlockNaming, a Family, or a known family's name.

FP8 blocks (fp8.py) map with their block scales: the e4m3 experts and their `_scale_inv` grids
stack into `w13`/`w13_scale_inv` and `w2`/`w2_scale_inv` (gate blocks then up blocks, exact when
the intermediate size is a multiple of 128), the shared experts' into
`shared_experts.*.weight_scale_inv` (a shared `gate_up_proj` and its scales cut into the gate's
and the up's, likewise exact on the 128 grid); the bytes are not touched either way.
"""

from __future__ import annotations

import re

import torch

from megamoe_torch.hf.families import Family, Layout, UnsupportedBlockError, family_named
from megamoe_torch.hf.fp8 import (
    check_stackable,
    is_fp8,
    scales_key,
    split_gate_up_scales,
    stacked_gate_up_scales,
    take_scales,
)
from megamoe_torch.hf.naming import (
    PER_EXPERT_PROJECTION_NAMES,
    SHARED_PROJECTIONS,
    BlockNaming,
    hf_experts_from_megamoe,
    hf_gate_up_bias_from_megamoe,
    megamoe_experts_from_hf,
    megamoe_gate_up_bias_from_hf,
)

# the tensors MegaMoE and a block hold as they are: MegaMoE's key, the BlockNaming field naming
# the block's, and what they are (a latent MoE's two projections, an output norm's weight, a
# table of each token id's experts)
KEPT_MODULE_TENSORS = (
    ("latent_in.weight", "latent_in", "latent projections"),
    ("latent_out.weight", "latent_out", "latent projections"),
    ("output_norm.weight", "output_norm", "output norm"),
    ("routing_table", "routing_table", "routing table"),
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
    if is_fp8(out["gate.weight"]):
        raise UnsupportedBlockError(
            f"the router weight {naming.router_weight} is e4m3: megamoe takes FP8 experts next "
            "to a full-precision router"
        )
    if naming.router_bias is not None:
        out["gate.bias"] = _take(remaining, naming.router_bias)
    if naming.correction_bias is not None and naming.correction_bias in remaining:
        out["e_score_correction_bias"] = remaining.pop(naming.correction_bias).float().reshape(-1)
    for key in naming.ignored:  # held by the block, unused by its computation
        remaining.pop(key, None)
    for ours, theirs in _kept_module_keys(naming):
        out[ours] = _take(remaining, theirs)
    if naming.expert_keys[0] in remaining:
        expert_tensors = {key: _take(remaining, key) for key in naming.expert_keys}
        scales = _fused_expert_scales(remaining, expert_tensors, naming)
        out["w13"], out["w2"] = megamoe_experts_from_hf(
            naming, expert_tensors, num_experts=out["gate.weight"].shape[0]
        )
        if scales is not None:
            out["w13_scale_inv"], out["w2_scale_inv"] = scales
        if naming.gate_up_bias is not None:
            bias = _take(remaining, naming.gate_up_bias)
            out["w13_bias"] = megamoe_gate_up_bias_from_hf(naming, bias)
            out["w2_bias"] = _take(remaining, naming.down_bias)
    else:
        out.update(_stack_per_expert(remaining, naming))
    if naming.shared_prefix is not None:
        out.update(_take_shared_projections(remaining, naming))
    if naming.shared_gate is not None and naming.shared_gate in remaining:
        out["shared_experts.gate.weight"] = remaining.pop(naming.shared_gate)
        if is_fp8(out["shared_experts.gate.weight"]):
            raise UnsupportedBlockError(
                f"the shared expert gate {naming.shared_gate} is e4m3: megamoe takes a "
                "full-precision gate"
            )
    if remaining:
        quantized = [key for key in remaining if "scale" in key]
        if quantized:
            raise UnsupportedBlockError(
                f"quantized tensors {sorted(quantized)[:4]} are not ones megamoe takes: it takes "
                "e4m3 weights with their 128 x 128 block scales (`<weight>_scale_inv`), or "
                "full-precision weights; dequantize others first"
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
    for ours, naming_field, what in KEPT_MODULE_TENSORS:
        theirs = getattr(naming, naming_field)
        if theirs is not None:
            out[theirs] = state_dict[ours]
        elif ours in state_dict:
            raise ValueError(f"family {naming.family!r} has no {what}")
    w13_E2IH, w2_EHI = state_dict["w13"], state_dict["w2"]
    w13_scales, w2_scales = state_dict.get("w13_scale_inv"), state_dict.get("w2_scale_inv")
    has_biases = "w13_bias" in state_dict
    if layout == "fused":
        out.update(hf_experts_from_megamoe(naming, w13_E2IH, w2_EHI))
        if w13_scales is not None:
            _check_fp8_layout(naming)  # FP8Experts' layout: the scales' blocks are w13's
            out[scales_key(naming.gate_up)], out[scales_key(naming.down)] = w13_scales, w2_scales
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
        out.update(_per_expert_from_megamoe(naming, w13_E2IH, w2_EHI, w13_scales, w2_scales))
    out.update(_shared_from_megamoe(state_dict, naming, layout=layout))
    return out


def _per_expert_from_megamoe(
    naming: BlockNaming,
    w13_E2IH: torch.Tensor,
    w2_EHI: torch.Tensor,
    w13_scales: torch.Tensor | None,
    w2_scales: torch.Tensor | None,
) -> dict[str, torch.Tensor]:
    """The routed experts' per-expert checkpoint tensors (and FP8 block scales), as views."""
    out: dict[str, torch.Tensor] = {}
    gate_name, up_name, down_name = naming.per_expert_projections
    if naming.experts_ungated:  # w13 holds the up projection alone
        for expert in range(w13_E2IH.shape[0]):
            out[f"experts.{expert}.{up_name}.weight"] = w13_E2IH[expert]
            out[f"experts.{expert}.{down_name}.weight"] = w2_EHI[expert]
        return out
    intermediate = w13_E2IH.shape[1] // 2
    for expert in range(w13_E2IH.shape[0]):
        out[f"experts.{expert}.{gate_name}.weight"] = w13_E2IH[expert, :intermediate]
        out[f"experts.{expert}.{up_name}.weight"] = w13_E2IH[expert, intermediate:]
        out[f"experts.{expert}.{down_name}.weight"] = w2_EHI[expert]
    if w13_scales is not None:
        gate_scales, up_scales = split_gate_up_scales(
            w13_scales, intermediate_size=intermediate, where=f"{naming.family} experts"
        )
        for expert in range(w13_E2IH.shape[0]):
            prefix = f"experts.{expert}."
            out[f"{prefix}{gate_name}.weight_scale_inv"] = gate_scales[expert]
            out[f"{prefix}{up_name}.weight_scale_inv"] = up_scales[expert]
            out[f"{prefix}{down_name}.weight_scale_inv"] = w2_scales[expert]
    return out


def _shared_from_megamoe(
    state_dict: dict[str, torch.Tensor], naming: BlockNaming, *, layout: Layout
) -> dict[str, torch.Tensor]:
    """The shared experts' tensors of MegaMoE's `state_dict` (and their gate's) under the
    block's names: gate_up_proj joined where the block holds it so in memory."""
    out: dict[str, torch.Tensor] = {}
    shared_keys = [key for key in state_dict if key.startswith("shared_experts.")]
    if shared_keys and naming.shared_prefix is None:
        raise ValueError(f"family {naming.family!r} has no shared experts, got {shared_keys}")
    shared = {
        name: state_dict[f"shared_experts.{name}.weight"]
        for name in SHARED_PROJECTIONS
        if f"shared_experts.{name}.weight" in state_dict
    }
    shared_scales = {
        name: state_dict[scales_key(f"shared_experts.{name}.weight")]
        for name in shared
        if scales_key(f"shared_experts.{name}.weight") in state_dict
    }
    if naming.shared_gate_up and layout == "fused" and {"gate_proj", "up_proj"} <= set(shared):
        gate, up = shared.pop("gate_proj"), shared.pop("up_proj")
        shared["gate_up_proj"] = torch.cat([gate, up])
        if "gate_proj" in shared_scales:
            shared_scales["gate_up_proj"] = stacked_gate_up_scales(
                shared_scales.pop("gate_proj"),
                shared_scales.pop("up_proj"),
                intermediate_size=gate.shape[0],
                where=f"{naming.family} shared experts",
            )
    for name, weight in shared.items():
        out[f"{naming.shared_prefix}.{name}.weight"] = weight
    for name, scales in shared_scales.items():
        out[f"{naming.shared_prefix}.{name}.weight_scale_inv"] = scales
    if "shared_experts.gate.weight" in state_dict:
        if naming.shared_gate is None:
            raise ValueError(f"family {naming.family!r} has no shared expert gate")
        out[naming.shared_gate] = state_dict["shared_experts.gate.weight"]
    return out


def _kept_module_keys(naming: BlockNaming) -> tuple[tuple[str, str], ...]:
    """(MegaMoE's key, the block's) of the tensors both hold as they are, where the block has
    them (KEPT_MODULE_TENSORS)."""
    return tuple(
        (ours, getattr(naming, naming_field))
        for ours, naming_field, _ in KEPT_MODULE_TENSORS
        if getattr(naming, naming_field) is not None
    )


def _take_shared_projections(
    remaining: dict[str, torch.Tensor], naming: BlockNaming
) -> dict[str, torch.Tensor]:
    """The shared experts' projections (and block scales) under megamoe's names, taken from
    `remaining`: gate_proj, up_proj and down_proj apart, or with naming.shared_gate_up one
    gate_up_proj of gate rows then up rows (in memory) cut into its two halves."""
    out: dict[str, torch.Tensor] = {}
    for name in SHARED_PROJECTIONS:
        key = f"{naming.shared_prefix}.{name}.weight"
        if key in remaining:
            weight = out[f"shared_experts.{name}.weight"] = remaining.pop(key)
            scales = take_scales(remaining, key, weight)
            if scales is not None:
                out[f"shared_experts.{name}.weight_scale_inv"] = scales
    key = f"{naming.shared_prefix}.gate_up_proj.weight"
    if not naming.shared_gate_up or key not in remaining:
        return out
    weight = remaining.pop(key)
    scales = take_scales(remaining, key, weight)
    if weight.shape[0] % 2:
        raise ValueError(
            f"{key} has {weight.shape[0]} rows: a gate_up_proj holds the gate rows then as many "
            "up rows"
        )
    intermediate = weight.shape[0] // 2
    out["shared_experts.gate_proj.weight"] = weight[:intermediate]
    out["shared_experts.up_proj.weight"] = weight[intermediate:]
    if scales is not None:
        gate_scales, up_scales = split_gate_up_scales(
            scales, intermediate_size=intermediate, where=f"{naming.family} shared experts"
        )
        out["shared_experts.gate_proj.weight_scale_inv"] = gate_scales
        out["shared_experts.up_proj.weight_scale_inv"] = up_scales
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


def _fused_expert_scales(
    remaining: dict[str, torch.Tensor],
    expert_tensors: dict[str, torch.Tensor],
    naming: BlockNaming,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(w13_scale_inv, w2_scale_inv) of a fused block's e4m3 experts, taken from `remaining`;
    None for full-precision experts."""
    gate_up, down = expert_tensors[naming.expert_keys[0]], expert_tensors[naming.down]
    if is_fp8(gate_up) or is_fp8(down):
        _check_fp8_layout(naming)
        # the [E, 2I, H] grid of 128-row blocks is the gate projection's grid then the up
        # projection's only when I is a multiple of 128
        check_stackable(gate_up.shape[1] // 2, where=f"{naming.family} experts")
    scales = [take_scales(remaining, key, expert_tensors[key]) for key in naming.expert_keys]
    if all(s is None for s in scales):
        return None
    _check_all_fp8([gate_up, down], [naming.gate_up, naming.down])
    return scales[0], scales[1]


def _check_fp8_layout(naming: BlockNaming) -> None:
    layouts = {
        "transposed ([E, H, 2I])": naming.experts_transposed,
        "gate/up interleaved": naming.gate_up_interleaved,
        "flattened": naming.flattened_gate_and_up is not None,
    }
    found = [name for name, used in layouts.items() if used]
    if found:
        raise UnsupportedBlockError(
            f"FP8 {naming.family} experts in the {', '.join(found)} layout: megamoe takes e4m3 "
            "experts as [E, 2I, H] gate rows then up rows and [E, H, I] (transformers' "
            "FP8Experts), with their block scales"
        )


def _check_all_fp8(weights: list[torch.Tensor], keys: list[str]) -> None:
    fp8 = [key for key, weight in zip(keys, weights, strict=True) if is_fp8(weight)]
    if fp8 and len(fp8) < len(keys):
        other = next(key for key in keys if key not in fp8)
        raise ValueError(
            f"the experts' weights mix e4m3 ({fp8[0]}, ...) and full-precision ones ({other}, "
            "...): megamoe takes all of them e4m3 with their block scales, or all of them in "
            "full precision"
        )


_PER_EXPERT_KEY = re.compile(r"experts\.(\d+)\.(\w+)\.weight")


def _stack_per_expert(
    remaining: dict[str, torch.Tensor], naming: BlockNaming
) -> dict[str, torch.Tensor]:
    """w13 and w2 (and w13_scale_inv and w2_scale_inv for e4m3 experts) stacked from the
    per-expert tensors in `remaining`, which are removed from it."""
    found: dict[int, dict[str, torch.Tensor]] = {}
    scales: dict[str, torch.Tensor] = {}
    for key in list(remaining):
        match = _PER_EXPERT_KEY.fullmatch(key)
        if match:
            found.setdefault(int(match.group(1)), {})[match.group(2)] = remaining.pop(key)
        elif key.endswith(".weight_scale_inv") and _PER_EXPERT_KEY.fullmatch(
            key[: -len("_scale_inv")]
        ):
            scales[key] = remaining.pop(key)
    expected = (*naming.expert_keys, *naming.per_expert_projections)
    if not found:
        raise UnsupportedBlockError(
            f"no routed expert tensors: expected {'/'.join(naming.expert_keys)} or "
            f"experts.{{e}}.{{{', '.join(naming.per_expert_projections)}}}.weight"
        )
    if sorted(found) != list(range(len(found))):
        raise UnsupportedBlockError(f"expert indices are not 0..{len(found) - 1}: {sorted(found)}")
    if naming.experts_ungated:
        return _stack_ungated(found, scales, naming)
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
    weights = {
        f"experts.{expert}.{name}.weight": found[expert][name] for expert in found for name in names
    }
    check_shapes(
        weights,
        {
            f"experts.{expert}.{name}.weight": shape
            for expert in found
            for name, shape in projection_shapes
        },
        reference=f"{reference_key} {(intermediate, hidden)}",
    )
    _check_all_fp8(list(weights.values()), list(weights))
    block_scales = {key: take_scales(scales, key, weight) for key, weight in weights.items()}
    if scales:  # scales left: of no weight here
        raise UnsupportedBlockError(f"block scales without their weights: {sorted(scales)[:4]}")
    experts = range(len(found))
    out = {
        "w13": torch.stack(
            [torch.cat([found[e][gate_name], found[e][up_name]], dim=0) for e in experts]
        ),
        "w2": torch.stack([found[expert][down_name] for expert in experts]),
    }
    if is_fp8(found[0][gate_name]):

        def scales_of(expert: int, name: str) -> torch.Tensor:
            return block_scales[f"experts.{expert}.{name}.weight"]

        out["w13_scale_inv"] = torch.stack(
            [
                stacked_gate_up_scales(
                    scales_of(e, gate_name),
                    scales_of(e, up_name),
                    intermediate_size=intermediate,
                    where=f"{naming.family} experts",
                )
                for e in experts
            ]
        )
        out["w2_scale_inv"] = torch.stack([scales_of(e, down_name) for e in experts])
    return out


def _stack_ungated(
    found: dict[int, dict[str, torch.Tensor]],
    scales: dict[str, torch.Tensor],
    naming: BlockNaming,
) -> dict[str, torch.Tensor]:
    """w13 (the up projections) and w2 of ungated experts from their per-expert tensors."""
    _, up_name, down_name = naming.per_expert_projections
    for expert, projections in found.items():
        if set(projections) != {up_name, down_name}:
            raise UnsupportedBlockError(
                f"expert {expert} has projections {sorted(projections)}, expected the ungated "
                f"{up_name} and {down_name}"
            )
    if scales or is_fp8(found[0][up_name]):
        raise UnsupportedBlockError(
            f"e4m3 ungated {naming.family} experts: megamoe computes ungated experts in full "
            "precision; convert with weight_dtype=None for the dequantized weights"
        )
    intermediate, hidden = found[0][up_name].shape
    check_shapes(
        {
            f"experts.{expert}.{name}.weight": found[expert][name]
            for expert in found
            for name in (up_name, down_name)
        },
        {
            f"experts.{expert}.{name}.weight": shape
            for expert in found
            for name, shape in (
                (up_name, (intermediate, hidden)),
                (down_name, (hidden, intermediate)),
            )
        },
        reference=f"experts.0.{up_name}.weight {(intermediate, hidden)}",
    )
    experts = range(len(found))
    return {
        "w13": torch.stack([found[expert][up_name] for expert in experts]),
        "w2": torch.stack([found[expert][down_name] for expert in experts]),
    }


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
