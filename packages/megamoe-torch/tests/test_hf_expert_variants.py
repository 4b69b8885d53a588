"""Expert MLPs other than the gated SwiGLU through the Hugging Face path, read, converted and
mapped back: MiniMax-M3's shared MLP, one `gate_up_proj` Linear (gate rows then up rows)
computing the routed experts' clamped SwiGLU, in full precision and in e4m3 with its block
scales; Nemotron-H's ungated relu^2 experts and shared MLP, and its latent MoE; LongCat-Flash's
zero-computation (identity) experts; Inkling2's softcapped SwiGLU; A.X-K1's output RMSNorm."""

from __future__ import annotations

import pytest
import torch
from megamoe_kernels import quantize_weight_blocks
from megamoe_kernels.reference import relative_l2_error

transformers = pytest.importorskip("transformers")

from megamoe_torch import (  # noqa: E402
    MegaMoE,
    UnsupportedBlockError,
    from_hf,
    hf_state_dict_from_megamoe,
    megamoe_state_dict_from_hf,
)
from megamoe_torch.hf.naming import BlockNaming  # noqa: E402
from megamoe_torch.hf.reader import read_block  # noqa: E402
from test_hf_fp8 import assert_same_bytes, raw  # noqa: E402

HIDDEN = 64
LIMIT = 7.0


def with_random_weights(block: torch.nn.Module, *, bias_std: float = 0.2) -> torch.nn.Module:
    """`block` in eval mode with seeded weights large enough that the clamps and the routing's
    choices matter, and a correction bias with negative entries."""
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0.0, 0.3)
        for name, buffer in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, bias_std)
    return block.eval()


def converts_exactly(block: torch.nn.Module) -> tuple[MegaMoE, BlockNaming]:
    """The reference-backend layer of `block` and its naming, after checking that the layer
    computes what the block does and maps back to the block's tensors, bit for bit."""
    x = torch.randn(2, 13, HIDDEN)
    with torch.no_grad():
        expected = block(x)
        layer = from_hf(block, backend="reference")
        actual = layer(x)
    assert relative_l2_error(actual, expected) < 1e-5
    naming = read_block(block).naming
    mapped = hf_state_dict_from_megamoe(layer.state_dict(), family=naming, layout="fused")
    assert_same_bytes(mapped, block.state_dict())
    return layer, naming


def minimax_block() -> torch.nn.Module:
    """A tiny MiniMax-M3 sparse block whose gate and up values pass the SwiGLU limit."""
    modeling = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import (
        MiniMaxM3VLTextConfig,
    )

    config = MiniMaxM3VLTextConfig(
        hidden_size=HIDDEN,
        intermediate_size=32,
        shared_intermediate_size=48,
        num_local_experts=8,
        num_experts_per_tok=2,
        swiglu_limit=LIMIT,
    )
    return with_random_weights(modeling.MiniMaxM3VLSparseMoeBlock(config))


def test_the_shared_mlp_computes_the_routed_swiglu_and_converts_exactly():
    block = minimax_block()
    x = torch.randn(2, 13, HIDDEN)
    with torch.no_grad():
        shared_gate_up = block.shared_experts.gate_up_proj(x)
        expected = block(x)
        layer = from_hf(block, backend="reference")
        actual = layer(x)
    assert (shared_gate_up.abs() > LIMIT).any()  # the clamp matters
    config = layer.config
    assert config.shared_swiglu == "routed" and config.shared_intermediate_size == 48
    assert (config.swiglu_limit, config.swiglu_alpha, config.swiglu_up_offset) == (
        LIMIT,
        1.702,
        1.0,
    )
    assert relative_l2_error(actual, expected) < 1e-5


def test_the_layer_maps_back_to_the_blocks_tensors():
    block = minimax_block()
    naming = read_block(block).naming
    assert naming.shared_gate_up
    layer = from_hf(block, backend="reference")
    mapped = hf_state_dict_from_megamoe(layer.state_dict(), family=naming, layout="fused")
    expected = block.state_dict()
    assert_same_bytes(mapped, expected)
    on_disk = hf_state_dict_from_megamoe(layer.state_dict(), family=naming, layout="per_expert")
    assert "shared_experts.gate_up_proj.weight" not in on_disk
    gate_up = expected["shared_experts.gate_up_proj.weight"]
    assert torch.equal(on_disk["shared_experts.gate_proj.weight"], gate_up[:48])
    assert torch.equal(on_disk["shared_experts.up_proj.weight"], gate_up[48:])


def fp8_block_tensors(shared_size: int) -> dict[str, torch.Tensor]:
    """A block's tensors with full-precision routed experts and an e4m3 shared MLP whose
    gate_up_proj holds the gate then the up projection, with their block scales."""
    experts, hidden, intermediate = 4, 256, 128
    tensors = {
        "gate.weight": torch.randn(experts, hidden),
        "experts.gate_up_proj": torch.randn(experts, 2 * intermediate, hidden),
        "experts.down_proj": torch.randn(experts, hidden, intermediate),
    }
    shapes = {"gate_up_proj": (2 * shared_size, hidden), "down_proj": (hidden, shared_size)}
    for name, shape in shapes.items():
        # rows of growing magnitude: each 128-row block has a scale of its own
        weight = torch.randn(shape) * torch.linspace(0.5, 4.0, shape[0])[:, None]
        quantized, scales = quantize_weight_blocks(weight[None])
        tensors[f"shared_experts.{name}.weight"] = quantized[0]
        tensors[f"shared_experts.{name}.weight_scale_inv"] = scales[0]
    return tensors


NAMING = BlockNaming(family="minimax_m3_vl", shared_prefix="shared_experts", shared_gate_up=True)


def test_an_e4m3_shared_gate_up_splits_with_its_scales_and_maps_back_bit_for_bit():
    hf = fp8_block_tensors(shared_size=256)
    ours = megamoe_state_dict_from_hf(hf, family=NAMING)
    gate_up = raw(hf["shared_experts.gate_up_proj.weight"])
    scales = hf["shared_experts.gate_up_proj.weight_scale_inv"]
    assert torch.equal(raw(ours["shared_experts.gate_proj.weight"]), gate_up[:256])
    assert torch.equal(raw(ours["shared_experts.up_proj.weight"]), gate_up[256:])
    assert torch.equal(ours["shared_experts.gate_proj.weight_scale_inv"], scales[:2])
    assert torch.equal(ours["shared_experts.up_proj.weight_scale_inv"], scales[2:])
    back = hf_state_dict_from_megamoe(ours, family=NAMING, layout="fused")
    assert_same_bytes(back, hf)
    # the names on disk hold the two projections apart, and read back the same
    on_disk = hf_state_dict_from_megamoe(ours, family=NAMING, layout="per_expert")
    assert "shared_experts.gate_proj.weight_scale_inv" in on_disk
    assert "shared_experts.gate_up_proj.weight" not in on_disk
    again = megamoe_state_dict_from_hf(on_disk, family=NAMING)
    for key in ("gate_proj", "up_proj", "down_proj"):
        weight = f"shared_experts.{key}.weight"
        assert torch.equal(raw(again[weight]), raw(ours[weight]))
        assert torch.equal(again[f"{weight}_scale_inv"], ours[f"{weight}_scale_inv"])


def test_an_e4m3_shared_gate_up_off_the_128_grid_is_refused_naming_it():
    hf = fp8_block_tensors(shared_size=192)
    with pytest.raises(UnsupportedBlockError, match=r"minimax_m3_vl shared experts.*192"):
        megamoe_state_dict_from_hf(hf, family=NAMING)


def nemotron_block(latent_size: int | None = None) -> torch.nn.Module:
    """A tiny Nemotron-H MoE block: ungated relu^2 experts and shared MLP, grouped routing, and
    with `latent_size` the latent MoE's projections around the routed experts."""
    modeling = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    config = transformers.NemotronHConfig(
        moe_latent_size=latent_size,
        hidden_size=HIDDEN,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
    )
    return with_random_weights(modeling.NemotronHMoE(config))


@pytest.mark.parametrize("latent_size", [None, 24], ids=["nemotron-h", "latent"])
def test_ungated_relu2_experts_convert_exactly(latent_size):
    block = nemotron_block(latent_size)
    x = torch.randn(2, 13, HIDDEN)
    with torch.no_grad():
        expected = block(x)
        layer = from_hf(block, backend="reference")
        actual = layer(x)
    config = layer.config
    assert config.activation == "relu2" and (config.num_groups, config.top_groups) == (2, 1)
    assert config.latent_size == latent_size
    assert layer.w13.shape == (8, 32, latent_size or HIDDEN)
    assert layer.shared_experts.gate_proj is None
    assert relative_l2_error(actual, expected) < 1e-5


@pytest.mark.parametrize("latent_size", [None, 24], ids=["nemotron-h", "latent"])
def test_ungated_experts_map_back_to_the_blocks_and_the_per_expert_tensors(latent_size):
    block = nemotron_block(latent_size)
    naming = read_block(block).naming
    assert naming.experts_ungated and naming.gate_up == "experts.up_proj"
    layer = from_hf(block, backend="reference")
    mapped = hf_state_dict_from_megamoe(layer.state_dict(), family=naming, layout="fused")
    expected = block.state_dict()
    assert_same_bytes(mapped, expected)
    on_disk = hf_state_dict_from_megamoe(layer.state_dict(), family=naming, layout="per_expert")
    assert torch.equal(on_disk["experts.3.up_proj.weight"], expected["experts.up_proj"][3])
    assert not any("gate_proj" in key for key in on_disk)
    again = megamoe_state_dict_from_hf(on_disk, family=naming)
    assert_same_bytes(again, layer.state_dict())
    del on_disk["experts.3.down_proj.weight"]
    with pytest.raises(UnsupportedBlockError, match=r"expert 3 has projections \['up_proj'\]"):
        megamoe_state_dict_from_hf(on_disk, family=naming)


def longcat_block() -> torch.nn.Module:
    """A tiny LongCat-Flash MoE block: 8 routed experts and 4 identity experts, top-3."""
    modeling = pytest.importorskip("transformers.models.longcat_flash.modeling_longcat_flash")
    config = transformers.LongcatFlashConfig(
        hidden_size=HIDDEN,
        expert_ffn_hidden_size=32,
        n_routed_experts=8,
        zero_expert_num=4,
        num_experts_per_tok=3,
        routed_scaling_factor=6.0,
    )
    # a bias of the softmax scores' size (1 / 12): the logits still choose
    return with_random_weights(modeling.LongcatFlashMoE(config), bias_std=0.02)


def test_identity_experts_convert_exactly_and_map_back():
    layer, _ = converts_exactly(longcat_block())
    with torch.no_grad():
        ids_TK = layer.router_logits(torch.randn(26, HIDDEN)).topk(3, dim=-1).indices
    config = layer.config
    assert (config.num_experts, config.num_identity_experts, config.top_k) == (8, 4, 3)
    assert (ids_TK >= 8).any()  # identity experts chosen


def inkling2_block(*, gate_softcap: float, up_softcap: float) -> torch.nn.Module:
    """A tiny Inkling2 sparse block; with weights of std 0.3 its gate and up values reach a few
    units, past caps of that size."""
    modeling = pytest.importorskip("transformers.models.inkling2.modeling_inkling2")
    from transformers.models.inkling2.configuration_inkling2 import Inkling2TextConfig

    config = Inkling2TextConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        mlp_gate_softcap=gate_softcap,
        mlp_up_softcap=up_softcap,
    )
    return with_random_weights(modeling.Inkling2SparseMoeBlock(config))


@pytest.mark.parametrize("caps", [(4.0, 25.0), (1.5, 2.0)], ids=["inkling2", "tight-caps"])
def test_softcapped_experts_convert_exactly_and_map_back(caps):
    gate_softcap, up_softcap = caps
    layer, _ = converts_exactly(inkling2_block(gate_softcap=gate_softcap, up_softcap=up_softcap))
    assert (layer.config.swiglu_gate_softcap, layer.config.swiglu_up_softcap) == caps


def axk1_block() -> torch.nn.Module:
    """A tiny A.X-K1 MoE block: DeepSeek-V3's, its output RMSNorm-ed (a weight of its own)."""
    modeling = pytest.importorskip("transformers.models.axk1.modeling_axk1")
    config = transformers.AXK1Config(
        hidden_size=HIDDEN,
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
    )
    return with_random_weights(modeling.AXK1MoE(config))


def test_an_output_norm_converts_exactly_and_maps_back():
    block = axk1_block()
    layer, naming = converts_exactly(block)
    assert layer.config.output_norm_eps == 1e-5
    assert torch.equal(layer.output_norm.weight, block.post_mlp_layernorm.weight)
    assert naming.output_norm == "post_mlp_layernorm.weight"
    mapped = hf_state_dict_from_megamoe(layer.state_dict(), family=naming, layout="fused")
    assert_same_bytes(megamoe_state_dict_from_hf(mapped, family=naming), layer.state_dict())


def test_an_output_norm_other_than_the_rmsnorm_is_refused_naming_it():
    class OffsetRMSNorm(torch.nn.Module):  # Gemma's: weight + 1
        def __init__(self, hidden: int):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(hidden))
            self.variance_epsilon = 1e-6

        def forward(self, y):
            return y * torch.rsqrt(y.square().mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)

    block = axk1_block()
    block.post_mlp_layernorm = OffsetRMSNorm(HIDDEN)
    with pytest.raises(UnsupportedBlockError, match="OffsetRMSNorm.*other than the RMSNorm"):
        from_hf(block)
    block.post_mlp_layernorm = torch.nn.LayerNorm(HIDDEN)
    with pytest.raises(UnsupportedBlockError, match=r"output norm post_mlp_layernorm.*not one"):
        from_hf(block)
