"""Per-expert blocks as transformers 4.x built them (w1/w2/w3, gate_proj/up_proj/down_proj).

The blocks below re-state the 4.x forward passes (class names as transformers spelled them, since
megamoe recognises blocks by name), so these tests need no transformers install.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings

import pytest
import torch
from megamoe_kernels.reference import relative_l2_error
from megamoe_torch import (
    UnsupportedBlockError,
    from_hf,
    hf_state_dict_from_megamoe,
    megamoe_state_dict_from_hf,
    swap_moe_blocks,
    unswap_moe_blocks,
)
from megamoe_torch.hf import read_hf_config
from torch import nn

HIDDEN, INTERMEDIATE = 32, 24


class ExpertMLP(nn.Module):
    def __init__(self, names: tuple[str, str, str], intermediate: int = INTERMEDIATE):
        super().__init__()
        self.names = names
        gate, up, down = names
        setattr(self, gate, nn.Linear(HIDDEN, intermediate, bias=False))
        setattr(self, up, nn.Linear(HIDDEN, intermediate, bias=False))
        setattr(self, down, nn.Linear(intermediate, HIDDEN, bias=False))
        self.act_fn = nn.SiLU()

    def forward(self, x):
        gate, up, down = (getattr(self, name) for name in self.names)
        return down(self.act_fn(gate(x)) * up(x))


def _weighted_expert_sum(experts, x_TH, ids_TK, weights_TK):
    out_TH = torch.zeros_like(x_TH, dtype=weights_TK.dtype)
    for expert_index, expert in enumerate(experts):
        token, slot = torch.where(ids_TK == expert_index)
        if token.numel():
            out_TH.index_add_(0, token, expert(x_TH[token]) * weights_TK[token, slot, None])
    return out_TH.to(x_TH.dtype)


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, num_experts: int = 6, top_k: int = 2):
        super().__init__()
        self.top_k, self.jitter_noise = top_k, 0.0
        self.gate = nn.Linear(HIDDEN, num_experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(("w1", "w3", "w2")) for _ in range(num_experts))

    def forward(self, hidden_states):
        x_TH = hidden_states.view(-1, HIDDEN)
        router_logits = self.gate(x_TH)
        weights = torch.softmax(router_logits, dim=1, dtype=torch.float)
        weights, ids = torch.topk(weights, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = _weighted_expert_sum(self.experts, x_TH, ids, weights)
        return out.view(hidden_states.shape), router_logits


class Qwen2MoeSparseMoeBlock(nn.Module):
    def __init__(self, num_experts: int = 6, top_k: int = 3):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, False
        self.gate = nn.Linear(HIDDEN, num_experts, bias=False)
        names = ("gate_proj", "up_proj", "down_proj")
        self.experts = nn.ModuleList(ExpertMLP(names) for _ in range(num_experts))
        self.shared_expert = ExpertMLP(names, intermediate=40)
        self.shared_expert_gate = nn.Linear(HIDDEN, 1, bias=False)

    def forward(self, hidden_states):
        x_TH = hidden_states.view(-1, HIDDEN)
        router_logits = self.gate(x_TH)
        weights, ids = torch.topk(
            torch.softmax(router_logits, dim=1, dtype=torch.float), self.top_k
        )
        out = _weighted_expert_sum(self.experts, x_TH, ids, weights)
        shared = torch.sigmoid(self.shared_expert_gate(x_TH)) * self.shared_expert(x_TH)
        return (out + shared).view(hidden_states.shape), router_logits


class DeepseekV3TopkRouter(nn.Module):
    """4.x: experts of dropped groups get choice score 0.0, and forward answers (ids, weights)."""

    def __init__(self, num_experts: int, top_k: int):
        super().__init__()
        self.top_k, self.n_routed_experts = top_k, num_experts
        self.routed_scaling_factor, self.n_group, self.topk_group = 2.5, 4, 2
        self.norm_topk_prob = True
        self.weight = nn.Parameter(torch.randn(num_experts, HIDDEN) * 0.3)
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def forward(self, hidden_states):
        logits = nn.functional.linear(hidden_states.view(-1, HIDDEN).float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        per_group = self.n_routed_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        kept = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, kept, 1).repeat_interleave(per_group, 1)
        choice = choice.masked_fill(~keep.bool(), 0.0)
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scaling_factor


class UnprobeableRouter(DeepseekV3TopkRouter):
    """A router whose answer megamoe does not know how to read."""

    def forward(self, hidden_states):
        ids, weights = super().forward(hidden_states)
        return {"ids": ids, "weights": weights}


class DeepseekV3MoE(nn.Module):
    def __init__(self, num_experts: int = 8, top_k: int = 3):
        super().__init__()
        names = ("gate_proj", "up_proj", "down_proj")
        self.experts = nn.ModuleList(ExpertMLP(names) for _ in range(num_experts))
        self.gate = DeepseekV3TopkRouter(num_experts, top_k)
        self.shared_experts = ExpertMLP(names, intermediate=INTERMEDIATE * 2)

    def forward(self, hidden_states):
        ids, weights = self.gate(hidden_states)
        x_TH = hidden_states.view(-1, HIDDEN)
        out = _weighted_expert_sum(self.experts, x_TH, ids, weights)
        return out.view(hidden_states.shape) + self.shared_experts(hidden_states)


def _randomised(block: nn.Module) -> nn.Module:
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0.0, 0.3)
    return block.eval()


@pytest.mark.parametrize("block_class", [MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock])
def test_legacy_softmax_block_swaps_and_answers_with_router_logits(block_class):
    block = _randomised(block_class())
    model = nn.ModuleDict({"block_sparse_moe": block})
    x = torch.randn(2, 7, HIDDEN)
    with torch.no_grad():
        expected_y, expected_logits = block(x)

    report = swap_moe_blocks(model, backend="reference")

    assert [(e.name, e.layout) for e in report.swapped] == [("block_sparse_moe", "per_expert")]
    with torch.no_grad():
        y, router_logits = model["block_sparse_moe"](x)
    assert relative_l2_error(y, expected_y) < 1e-5
    assert torch.equal(router_logits, expected_logits)


@pytest.mark.parametrize(
    "block_class", [MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock, DeepseekV3MoE]
)
def test_per_expert_state_dict_round_trips(block_class):
    block = _randomised(block_class())
    family = {"MixtralSparseMoeBlock": "mixtral", "Qwen2MoeSparseMoeBlock": "qwen2_moe"}.get(
        block_class.__name__, "deepseek_v3"
    )
    hf_state = block.state_dict()
    back = hf_state_dict_from_megamoe(
        megamoe_state_dict_from_hf(hf_state, family=family), family=family
    )
    assert sorted(back) == sorted(hf_state)
    assert all(torch.equal(back[key], hf_state[key]) for key in hf_state)


@pytest.mark.parametrize(
    "block_class", [MixtralSparseMoeBlock, Qwen2MoeSparseMoeBlock, DeepseekV3MoE]
)
def test_swapped_per_expert_block_saves_loads_and_unswaps_under_its_own_names(block_class):
    def hidden_states(output):
        return output[0] if isinstance(output, tuple) else output

    model = nn.ModuleDict({"mlp": _randomised(block_class())})
    original_state = {key: tensor.clone() for key, tensor in model.state_dict().items()}
    x = torch.randn(2, 5, HIDDEN)
    with torch.no_grad():
        expected = hidden_states(model["mlp"](x))
    swap_moe_blocks(model, backend="reference")
    other = nn.ModuleDict({"mlp": _randomised(block_class())})
    swap_moe_blocks(other, backend="reference")

    saved = model.state_dict()
    other.load_state_dict(original_state)
    unswapped = unswap_moe_blocks(model)

    assert sorted(saved) == sorted(original_state)
    assert all(torch.equal(saved[key], original_state[key]) for key in original_state)
    assert unswapped == ["mlp"] and type(model["mlp"]) is block_class
    with torch.no_grad():
        assert relative_l2_error(hidden_states(other["mlp"](x)), expected) < 1e-5
        torch.testing.assert_close(hidden_states(model["mlp"](x)), expected)


def test_model_without_moe_blocks_warns_and_says_what_is_looked_for():
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.SiLU())
    with pytest.warns(UserWarning, match="no MoE block") as caught:
        report = swap_moe_blocks(model)
    assert report.swapped == report.skipped == []
    message = str(caught[0].message)
    assert all(name in message for name in ("`gate`", "`router`", "`experts`"))

    swapped = nn.ModuleDict({"mlp": _randomised(Qwen2MoeSparseMoeBlock())})
    swap_moe_blocks(swapped, backend="reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # swapped already: nothing to warn about
        assert swap_moe_blocks(swapped, backend="reference").swapped == []


def test_deepseek_zero_masked_groups_are_detected_and_reproduced():
    block = _randomised(DeepseekV3MoE())
    with torch.no_grad():
        # biased scores all negative: the 0.0 mask then picks experts of dropped groups
        block.gate.e_score_correction_bias.copy_(-1.0 + 0.1 * torch.rand(8))
    x = torch.randn(3, 5, HIDDEN)

    layer = from_hf(block, backend="reference")

    assert layer.config.dropped_group_score == 0.0
    with torch.no_grad():
        expected = block(x)
        assert relative_l2_error(layer(x), expected) < 1e-5
        layer.config = dataclasses.replace(layer.config, dropped_group_score=float("-inf"))
        assert relative_l2_error(layer(x), expected) > 1e-3  # the option is what made them agree


def test_deepseek_mask_that_cannot_be_told_is_refused_only_where_it_matters():
    block = _randomised(DeepseekV3MoE())
    unprobeable = UnprobeableRouter(8, 3)
    unprobeable.load_state_dict(block.gate.state_dict())
    block.gate = unprobeable
    with torch.no_grad():
        block.gate.e_score_correction_bias.copy_(torch.rand(8))
    assert from_hf(block).config.dropped_group_score == float("-inf")
    with torch.no_grad():
        block.gate.e_score_correction_bias[3] = -0.5
    with pytest.raises(UnsupportedBlockError, match="negative"):
        from_hf(block)


def test_experts_with_biases_are_refused():
    block = _randomised(MixtralSparseMoeBlock())
    block.experts[0].w1 = nn.Linear(HIDDEN, INTERMEDIATE, bias=True)
    with pytest.raises(UnsupportedBlockError, match="bias"):
        from_hf(block)


def test_block_scales_next_to_full_precision_weights_are_refused():
    # FP8 checkpoints pair e4m3 weights with their scales (test_hf_fp8.py); a scale next to a
    # full-precision weight is no checkpoint megamoe knows
    state = _randomised(DeepseekV3MoE()).state_dict()
    state["experts.0.gate_proj.weight_scale_inv"] = torch.rand(1, 1)
    with pytest.raises(ValueError, match=r"weight_scale_inv comes with a torch.float32 experts"):
        megamoe_state_dict_from_hf(state, family="deepseek_v3")
    state = _randomised(DeepseekV3MoE()).state_dict()
    state["experts.0.gate_proj.input_scale"] = torch.rand(1)
    with pytest.raises(UnsupportedBlockError, match="quantized tensors"):
        megamoe_state_dict_from_hf(state, family="deepseek_v3")


def test_config_without_routing_keys_is_refused_when_no_defaults_are_known(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # defaults come from transformers
    config_json = {
        "model_type": "qwen3_moe",
        "hidden_size": HIDDEN,
        "num_experts": 6,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": INTERMEDIATE,
    }
    with pytest.raises(ValueError, match="norm_topk_prob"):
        read_hf_config(config_json)
    _, fields = read_hf_config({**config_json, "norm_topk_prob": True})
    assert fields["renormalize"] is True and fields["num_experts"] == 6
