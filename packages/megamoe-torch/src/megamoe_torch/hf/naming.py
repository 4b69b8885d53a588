"""How one Hugging Face MoE block names and lays out its tensors, and the maps to MegaMoE's.

Shape legend: E experts, H hidden size, I intermediate size.

A `BlockNaming` is read from a live block (reader.py) or given by a known family (families.py).
Keys are block-relative. The routed experts come in two layouts:

| layout     | where                                  | routed expert tensors                          |
|------------|----------------------------------------|------------------------------------------------|
| fused      | transformers >= 5 modules in memory    | `gate_up` [E, 2I, H] and `down` [E, H, I], or transposed [E, H, 2I] and [E, I, H] (`experts_transposed`); gate and up halves, or alternating columns (`gate_up_interleaved`); optional biases [E, 2I] and [E, H]; or (`flattened_gate_and_up`, DBRX) gate and up apart, each [E * I, H], and `down` [E * I, H] (each expert's [I, H] rows, transposed); ungated experts (`experts_ungated`, Nemotron-H): `gate_up` the up projection alone [E, I, H] |
| per_expert | checkpoints on disk, transformers 4.x  | experts.{e}.{gate, up, down}.weight, names per family |

MegaMoE: gate.weight [E, H] (gate.bias [E]); w13 [E, 2I, H] (gate rows, then up rows; ungated
experts: [E, I, H], the up rows); w2 [E, H, I];
w13_bias [E, 2I]; w2_bias [E, H]; e_score_correction_bias [E] fp32;
shared_experts.{gate_proj, up_proj, down_proj, gate}.weight. A block's shared MLP may hold
`gate_up_proj` [2I, H] in place of gate_proj and up_proj (`shared_gate_up`). A latent MoE:
latent_in.weight [L, H], latent_out.weight [H, L], and the experts' H is L. A norm of the
block's output: output_norm.weight [H].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PER_EXPERT_PROJECTION_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
SHARED_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class BlockNaming:
    """The keys (block-relative) and layouts of one Hugging Face MoE block's tensors."""

    # the transformers model family the block belongs to (e.g. "qwen3_moe"), for reports
    family: str
    router_weight: str = "gate.weight"
    router_bias: str | None = None
    # where the correction bias lives (on the router, the block, a statistics submodule), its
    # shape there ([E] or [1, E]) and dtype (megamoe keeps an fp32 [E] buffer)
    correction_bias: str | None = None
    correction_bias_shape: tuple[int, ...] | None = None
    correction_bias_dtype: torch.dtype | None = None
    gate_up: str = "experts.gate_up_proj"
    down: str = "experts.down_proj"
    gate_up_bias: str | None = None
    down_bias: str | None = None
    experts_transposed: bool = False
    gate_up_interleaved: bool = False
    # ungated experts (Nemotron-H): `gate_up` holds the up projection alone, [E, I, H] (or
    # transposed), and the per-expert checkpoint names are the up and down projections'
    experts_ungated: bool = False
    # DBRX: the keys of the gate and up tensors, each [E * I, H]; `down` then holds [E * I, H]
    # too, and `gate_up` is unused
    flattened_gate_and_up: tuple[str, str] | None = None
    # per-expert checkpoint names of the (gate, up, down) projections
    per_expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # block-relative prefix of the shared expert MLP, and its sigmoid gate's weight
    shared_prefix: str | None = None
    shared_gate: str | None = None
    # the shared MLP holds its gate and up projections as one `gate_up_proj` Linear, gate rows
    # then up rows (MiniMax-M3 in memory; its checkpoints on disk hold them apart)
    shared_gate_up: bool = False
    # a latent MoE's projections into and out of the routed experts' space (Nemotron-H's
    # fc1_latent_proj / fc2_latent_proj): MegaMoE's latent_in / latent_out
    latent_in: str | None = None
    latent_out: str | None = None
    # a norm of the block's output (A.X-K1's post_mlp_layernorm): its weight [H], MegaMoE's
    # output_norm.weight
    output_norm: str | None = None
    # a table routing each token id to its experts (DeepSeek-V4's hash layers: the router's
    # tid2eid, [V, K] integers): MegaMoE's routing_table
    routing_table: str | None = None
    # keys of tensors the block holds but its forward does not use (a correction bias switched
    # off): a swapped block keeps them as they are, for its checkpoint
    ignored: tuple[str, ...] = ()

    @property
    def expert_keys(self) -> tuple[str, ...]:
        """The keys of the routed experts' weights: the gate/up tensor(s), then down."""
        gate_up = self.flattened_gate_and_up or (self.gate_up,)
        return (*gate_up, self.down)


def megamoe_experts_from_hf(
    naming: BlockNaming, hf_tensors: dict[str, torch.Tensor], *, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13_E2IH, w2_EHI) from a fused block's expert tensors (`naming.expert_keys` of
    `hf_tensors`): views where the layouts agree, contiguous copies where they do not."""
    if naming.flattened_gate_and_up is not None:
        gate_key, up_key = naming.flattened_gate_and_up
        gate_EIH, up_EIH, down_EIH = (
            hf_tensors[key].reshape(num_experts, -1, hf_tensors[key].shape[-1])
            for key in (gate_key, up_key, naming.down)
        )
        return torch.cat([gate_EIH, up_EIH], dim=1), down_EIH.transpose(1, 2).contiguous()
    gate_up, down = hf_tensors[naming.gate_up], hf_tensors[naming.down]
    if naming.experts_transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    if naming.gate_up_interleaved:
        gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
    if naming.experts_transposed:
        gate_up, down = gate_up.contiguous(), down.contiguous()
    return gate_up, down


def hf_experts_from_megamoe(
    naming: BlockNaming, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The inverse of `megamoe_experts_from_hf`: the block's expert tensors by key."""
    if naming.flattened_gate_and_up is not None:
        gate_EIH, up_EIH = w13_E2IH.chunk(2, dim=1)
        gate_key, up_key = naming.flattened_gate_and_up
        return {
            gate_key: gate_EIH.flatten(0, 1),
            up_key: up_EIH.flatten(0, 1),
            naming.down: w2_EHI.transpose(1, 2).flatten(0, 1),
        }
    gate_up, down = w13_E2IH, w2_EHI
    if naming.gate_up_interleaved:
        gate_up = _interleaved(gate_up, dim=1)
    if naming.experts_transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return {naming.gate_up: gate_up, naming.down: down}


def megamoe_gate_up_bias_from_hf(naming: BlockNaming, bias_E2I: torch.Tensor) -> torch.Tensor:
    if naming.gate_up_interleaved:
        return torch.cat([bias_E2I[:, 0::2], bias_E2I[:, 1::2]], dim=1)
    return bias_E2I


def hf_gate_up_bias_from_megamoe(naming: BlockNaming, bias_E2I: torch.Tensor) -> torch.Tensor:
    return _interleaved(bias_E2I, dim=1) if naming.gate_up_interleaved else bias_E2I


def _interleaved(gate_then_up: torch.Tensor, *, dim: int) -> torch.Tensor:
    """[.., 2I, ..] of gate rows then up rows -> gate and up alternating (g0, u0, g1, u1, ...)."""
    gate, up = gate_then_up.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)
