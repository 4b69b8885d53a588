"""Tiny random transformers models of each family: swapped, converted, loaded from checkpoints."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from megamoe_kernels.reference import relative_l2_error
from packaging.version import Version

transformers = pytest.importorskip("transformers")

from megamoe_torch import (  # noqa: E402
    MegaMoE,
    UnsupportedBlockError,
    from_hf,
    from_hf_state_dict,
    hf_state_dict_from_megamoe,
    megamoe_state_dict_from_hf,
    swap_moe_blocks,
)
from megamoe_torch.hf import moe_layer_indices  # noqa: E402

VOCAB = 96
ATTENTION = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _config(family: str):
    if family == "mixtral":
        return transformers.MixtralConfig(
            **ATTENTION, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2
        )
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **ATTENTION,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=3,
            norm_topk_prob=False,
        )
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **ATTENTION,
            head_dim=16,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        )
    return transformers.DeepseekV3Config(
        **{**ATTENTION, "num_key_value_heads": 4},
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=16,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    )


MODEL_CLASSES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
FAMILIES = tuple(MODEL_CLASSES)
# the first transformers release whose DeepSeek-V3 returns router logits (output_router_logits)
DEEPSEEK_V3_ROUTER_LOGITS_SINCE = "5.19.0"


def transformers_before(version: str) -> bool:
    """Whether the installed transformers is older than `version`."""
    return Version(transformers.__version__) < Version(version)


def returns_router_logits(family: str) -> bool:
    """Whether the installed transformers' `family` model returns its router logits."""
    return family != "deepseek_v3" or not transformers_before(DEEPSEEK_V3_ROUTER_LOGITS_SINCE)


def router_logits_pairs(family: str, actual, expected) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The router logits of two model outputs, (actual's, expected's) layer by layer, checked to
    be there in equal numbers where transformers returns them for `family`; where it does not,
    checked to be in neither, and none to compare."""
    if not returns_router_logits(family):
        assert not hasattr(expected, "router_logits") and not hasattr(actual, "router_logits")
        return []
    assert len(actual.router_logits) == len(expected.router_logits) > 0
    return list(zip(actual.router_logits, expected.router_logits, strict=True))


def tiny_model(family: str, **config_overrides) -> torch.nn.Module:
    config = _config(family)
    for name, value in config_overrides.items():
        setattr(config, name, value)
    model = getattr(transformers, MODEL_CLASSES[family])(config).eval()
    with torch.no_grad():
        # larger than transformers' init so routing is decisive and every expert matters
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.3 if "gate" in name else 0.08)
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.normal_(0.0, 0.2)  # negative entries included: group masking matters
    return model


def moe_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [
        (name, module)
        for name, module in model.named_modules()
        if name.endswith(".mlp") and hasattr(module, "experts")
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_swapped_model_gives_the_original_logits_router_logits_and_tokens(family):
    model = tiny_model(family)
    original = copy.deepcopy(model)
    input_ids = torch.randint(0, VOCAB, (2, 11))

    report = swap_moe_blocks(model, backend="reference")

    assert [entry.name for entry in report.swapped] == [name for name, _ in moe_blocks(original)]
    assert {entry.family for entry in report.swapped} == {family}
    assert report.skipped == []
    assert all(isinstance(block, MegaMoE) for _, block in moe_blocks(model))
    with torch.no_grad():
        expected = original(input_ids, output_router_logits=True)
        actual = model(input_ids, output_router_logits=True)
    assert relative_l2_error(actual.logits, expected.logits) < 1e-5
    for got, want in router_logits_pairs(family, actual, expected):
        assert got.dtype == want.dtype
        assert relative_l2_error(got, want) < 1e-5
    if getattr(expected, "aux_loss", None) is not None:
        assert torch.allclose(actual.aux_loss, expected.aux_loss, rtol=1e-5)
    prompt = torch.randint(0, VOCAB, (1, 5))
    generate = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **generate), original.generate(prompt, **generate))


def test_router_logits_still_recorded_when_capture_hooks_predate_the_swap():
    model = tiny_model("qwen3_moe")
    input_ids = torch.randint(0, VOCAB, (1, 7))
    with torch.no_grad():
        expected = model(input_ids, output_router_logits=True)  # installs transformers' hooks
        swap_moe_blocks(model, backend="reference")
        actual = model(input_ids, output_router_logits=True)
    assert len(actual.router_logits) == len(expected.router_logits) == 2
    for got, want in zip(actual.router_logits, expected.router_logits, strict=True):
        assert relative_l2_error(got, want) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_block_matches_the_block_on_any_leading_shape(family):
    _, block = moe_blocks(tiny_model(family))[0]
    layer = from_hf(block, backend="reference")
    assert layer.training == block.training
    assert from_hf(block.train(), backend="reference").training
    block.eval()
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        assert relative_l2_error(layer(x), block(x)) < 1e-5
        assert relative_l2_error(layer(x[:1, :1]), block(x[:1, :1])) < 1e-5


def test_deepseek_router_weight_stays_fp32_next_to_bf16_experts():
    model = tiny_model("deepseek_v3").to(torch.bfloat16)
    _, block = moe_blocks(model)[0]
    block.gate.weight.data = block.gate.weight.data.float()  # as from_pretrained keeps it
    layer = from_hf(block, backend="reference")
    assert layer.gate.weight.dtype == torch.float32 and layer.w13.dtype == torch.bfloat16
    assert torch.equal(layer.gate.weight, block.gate.weight)
    # the layer takes and answers the model's bf16 hidden states, not the router's fp32
    assert layer.activation_dtype == torch.bfloat16
    x = torch.randn(2, 7, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        y = layer(x)
        assert y.dtype == torch.bfloat16
        assert relative_l2_error(y, block(x)) < 2e-2
    assert layer.float().activation_dtype == torch.float32


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_state_dict_loads_without_the_model_and_round_trips(family, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    checkpoint = safetensors.load_file(tmp_path / "model.safetensors")
    layer_index = moe_layer_indices(model.config)[-1]
    _, block = moe_blocks(model)[-1]

    config_json = json.loads((tmp_path / "config.json").read_text())

    layer = from_hf_state_dict(checkpoint, config_json, layer=layer_index, backend="reference")
    assert not layer.training  # as a model that from_pretrained loads

    x = torch.randn(1, 9, 64)
    with torch.no_grad():
        assert relative_l2_error(layer(x), block(x)) < 1e-5
    exported = hf_state_dict_from_megamoe(layer.state_dict(), family=family, layout="per_expert")
    block_name = "block_sparse_moe" if family == "mixtral" else "mlp"
    prefix = f"model.layers.{layer_index}.{block_name}."
    on_disk = {k[len(prefix) :]: v for k, v in checkpoint.items() if k.startswith(prefix)}
    assert sorted(exported) == sorted(on_disk)
    assert all(torch.equal(exported[key], on_disk[key]) for key in on_disk)


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_block_state_dict_round_trips(family):
    _, block = moe_blocks(tiny_model(family))[0]
    hf_state = block.state_dict()
    megamoe_state = megamoe_state_dict_from_hf(hf_state, family=family)
    back = hf_state_dict_from_megamoe(megamoe_state, family=family, layout="fused")
    assert sorted(back) == sorted(hf_state)
    assert all(torch.equal(back[key], hf_state[key]) for key in hf_state)


def test_mixtral_with_router_jitter_is_refused_and_left_in_place():
    model = tiny_model("mixtral", router_jitter_noise=0.1)
    blocks_before = [block for _, block in moe_blocks(model)]

    report = swap_moe_blocks(model, backend="reference")

    assert report.swapped == []
    assert len(report.skipped) == 2
    assert all("jitter_noise=0.1" in entry.reason for entry in report.skipped)
    assert [block for _, block in moe_blocks(model)] == blocks_before
    with pytest.raises(UnsupportedBlockError, match="jitter_noise=0.1"):
        from_hf(blocks_before[0])


def test_reading_a_full_size_block_makes_no_copy_of_its_experts(monkeypatch):
    """The probes copy two experts of a block (and its router), never the whole experts module:
    DeepSeek-V3's own sizes, read from its config on the meta device."""
    from megamoe_torch.hf import probes
    from megamoe_torch.hf.reader import read_block

    largest = [0]
    normal = probes.ProbeRandom.normal

    def recording_normal(self, *shape, **kwargs):
        largest[0] = max(largest[0], math.prod(shape))
        return normal(self, *shape, **kwargs)

    monkeypatch.setattr(probes.ProbeRandom, "normal", recording_normal)
    modeling = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    with torch.device("meta"):
        block = modeling.DeepseekV3MoE(transformers.DeepseekV3Config())
    reading = read_block(block, structure_only=True)
    assert reading.config_fields["num_experts"] == 256
    # two experts' gate-up weights, 2 x 4096 x 7168: the 256 experts' are 128 times that
    assert largest[0] <= 2 * 4096 * 7168


def test_other_activation_is_refused():
    # the erf GELU: within about 1e-4 of the tanh one on unit-sized values, and refused
    model = tiny_model("qwen3_moe", hidden_act="gelu")
    report = swap_moe_blocks(model, backend="reference")
    assert report.swapped == [] and all("SiLU" in e.reason for e in report.skipped)


def test_tanh_gelu_gated_experts_swap_as_geglu():
    model = tiny_model("qwen3_moe", hidden_act="gelu_pytorch_tanh")
    original = copy.deepcopy(model)
    report = swap_moe_blocks(model, backend="reference")
    assert report.swapped and not report.skipped
    assert all("GeGLU" in entry.computes for entry in report.swapped)
    input_ids = torch.randint(3, VOCAB, (2, 7))
    with torch.no_grad():
        error = relative_l2_error(model(input_ids).logits, original(input_ids).logits)
    assert error < 1e-5


class _ReLUSquared(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) ** 2


class _UngatedExperts(torch.nn.Module):
    """act(x W_up^T) W_down^T experts: no gate projection. relu^2 is Nemotron-H's kind."""

    def __init__(self, experts: int, hidden: int, intermediate: int, activation: torch.nn.Module):
        super().__init__()
        self.up_proj = torch.nn.Parameter(torch.randn(experts, intermediate, hidden) * 0.1)
        self.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, intermediate) * 0.1)
        self.activation = activation  # a module, as transformers' act_fn: part of the structure

    def forward(self, x_TH, top_k_index, top_k_weights):
        y_TH = torch.zeros_like(x_TH)
        for k in range(top_k_index.shape[1]):
            up_proj, down_proj = self.up_proj[top_k_index[:, k]], self.down_proj[top_k_index[:, k]]
            hidden = self.activation(torch.einsum("th,tih->ti", x_TH, up_proj))
            y_TH += torch.einsum("ti,thi->th", hidden, down_proj) * top_k_weights[:, k, None]
        return y_TH


class _UngatedMoE(torch.nn.Module):
    def __init__(self, activation: torch.nn.Module):
        super().__init__()
        self.gate = torch.nn.Linear(64, 4, bias=False)
        self.experts = _UngatedExperts(4, 64, 32, activation)

    def forward(self, x):
        x_TH = x.reshape(-1, 64)
        weights_TK, ids_TK = torch.softmax(self.gate(x_TH), dim=-1).topk(2, dim=-1)
        return self.experts(x_TH, ids_TK, weights_TK).reshape(x.shape)


def test_an_unknown_block_of_ungated_relu2_experts_swaps_exactly():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), _UngatedMoE(_ReLUSquared()))
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected = model(x)
    report = swap_moe_blocks(model, backend="reference")
    assert [entry.name for entry in report.swapped] == ["1"]
    with torch.no_grad():
        assert relative_l2_error(model(x), expected) < 1e-5


def test_block_megamoe_cannot_reproduce_is_reported_with_its_reason_and_left_in_place():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), _UngatedMoE(torch.nn.GELU()))
    block = model[1]
    report = swap_moe_blocks(model, backend="reference")
    assert report.swapped == [] and model[1] is block
    assert [(entry.name, entry.class_name) for entry in report.skipped] == [("1", "_UngatedMoE")]
    assert "other than relu(up x)^2" in report.skipped[0].reason
    assert "skipped 1 (_UngatedMoE)" in str(report)
    assert "register_experts_implementation()" in str(report)  # the other way for the experts
    with pytest.raises(UnsupportedBlockError, match=r"other than relu\(up x\)\^2"):
        from_hf(block)


def test_transformers_weight_init_walks_the_swapped_model():
    model = tiny_model("mixtral")
    swap_moe_blocks(model, backend="reference")
    model.init_weights()  # visits the router-class stand-in, which holds no weight
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, VOCAB, (1, 4))).logits).all()


def test_routing_megamoe_cannot_express_is_refused_but_bad_run_options_raise():
    # top_k=3 from a single kept group of 2 experts: transformers would pick a masked expert
    model = tiny_model("deepseek_v3", n_group=8, topk_group=1)
    report = swap_moe_blocks(model, backend="reference")
    assert report.swapped == [] and "top_k=3" in report.skipped[0].reason
    with pytest.raises(ValueError, match="backend"):
        swap_moe_blocks(tiny_model("qwen3_moe"), backend="fastest")


def test_run_options_reach_the_layer():
    model = tiny_model("qwen3_moe")
    swap_moe_blocks(
        model,
        backend="reference",
        layer_path="torch",
        capacity=64,
        tile_pack=True,
        atomic_combine=True,
    )
    _, block = moe_blocks(model)[0]
    config = block.config
    assert (config.layer_path, config.capacity, config.tile_pack, config.atomic_combine) == (
        "torch",
        64,
        True,
        True,
    )
    with pytest.raises(ValueError, match="layer_path"):
        swap_moe_blocks(tiny_model("qwen3_moe"), backend="reference", layer_path="fastest")


def test_semantic_options_are_refused():
    _, block = moe_blocks(tiny_model("qwen2_moe"))[0]
    with pytest.raises(TypeError, match="top_k"):
        from_hf(block, top_k=1)


@pytest.mark.gpu
def test_qwen3_moe_on_cuda_backend_auto_matches_the_original_in_bf16():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = tiny_model("qwen3_moe").to("cuda", torch.bfloat16)
    original = copy.deepcopy(model)
    input_ids = torch.randint(0, VOCAB, (4, 33), device="cuda")
    x = torch.randn(4, 33, 64, device="cuda", dtype=torch.bfloat16)

    report = swap_moe_blocks(model, backend="auto")

    print(report)
    assert len(report.swapped) == 2
    swapped = [module for module in model.modules() if isinstance(module, MegaMoE)]
    block, original_block = model.model.layers[0].mlp, original.model.layers[0].mlp
    # bf16 rounding differs between the two (fp32 accumulation here, bf16 routing weights
    # there) and grows through attention; a wrong layer is off by ~1.4 at either point
    block_bound, logits_bound = 2e-2, 0.2
    with torch.no_grad():
        assert relative_l2_error(block(x), original_block(x)) < block_bound
        expected_logits = original(input_ids).logits
        assert relative_l2_error(model(input_ids).logits, expected_logits) < logits_bound
        # the bounds catch a wrong layer: experts shuffled must fail them
        for layer in swapped:
            layer.w13.data = layer.w13.data.roll(1, dims=0)
        assert relative_l2_error(block(x), original_block(x)) > block_bound
        assert relative_l2_error(model(input_ids).logits, expected_logits) > logits_bound
