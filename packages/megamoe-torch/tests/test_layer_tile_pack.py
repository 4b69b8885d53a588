"""MegaMoE(tile_pack=True): the cutedsl backend's weights in the weight-packet layout give the
bits of the row-major layer, bf16 and FP8, at decode and prefill batches, with shared experts
in the batch, and replayed in a CUDA graph; what cannot be packed is refused at load."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from megamoe_torch import MegaMoE, MegaMoEConfig


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def config(**overrides) -> MegaMoEConfig:
    fields = dict(
        hidden_size=1024,
        intermediate_size=512,
        num_experts=32,
        top_k=4,
        backend="cutedsl",
        tile_pack=True,
    )
    return MegaMoEConfig(**{**fields, **overrides})


def test_tile_pack_must_be_a_bool():
    with pytest.raises(TypeError, match="tile_pack must be a bool"):
        config(tile_pack="yes")


def test_weights_the_packets_cannot_hold_are_refused_at_load_with_the_reason():
    from megamoe_runtime.experts import CuteDSLExperts

    # gpt-oss's sizes: 2880 is no multiple of 256
    layer = MegaMoE(
        config(hidden_size=2880, intermediate_size=2880, num_experts=4, top_k=2, backend="auto"),
        dtype=torch.bfloat16,
    )
    with pytest.raises(ValueError, match="N=2880 weight rows is not a multiple of 256"):
        CuteDSLExperts(tile_pack=True).prepare(layer.expert_weight_pack())


def test_the_other_backends_keep_their_own_layout():
    packed = MegaMoE(config(backend="reference"), dtype=torch.float32)
    row_major = MegaMoE(config(backend="reference", tile_pack=False), dtype=torch.float32)
    row_major.load_state_dict(packed.state_dict())
    x = torch.randn(5, 1024)
    assert torch.equal(packed(x), row_major(x))


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("tokens", [1, 7, 300, 2048])
@pytest.mark.parametrize("weight_dtype", [None, "fp8"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shared_experts", [0, 1])
def test_packed_layers_give_the_bits_of_row_major_ones(tokens, weight_dtype, shared_experts):
    packed_config = config(weight_dtype=weight_dtype, num_shared_experts=shared_experts)
    torch.manual_seed(tokens)
    packed = MegaMoE(packed_config, device="cuda", dtype=torch.bfloat16)
    row_major = MegaMoE(
        replace(packed_config, tile_pack=False), device="cuda", dtype=torch.bfloat16
    )
    row_major.load_state_dict(packed.state_dict())
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y, expected = packed(x), row_major(x)
    assert torch.equal(y.view(torch.int16), expected.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("weight_dtype", [None, "fp8"], ids=["bf16", "fp8"])
def test_a_packed_layer_replays_in_a_cuda_graph_with_new_tokens(weight_dtype):
    tokens = 48
    packed = MegaMoE(
        config(weight_dtype=weight_dtype, capacity=tokens * 4), device="cuda", dtype=torch.bfloat16
    )
    row_major = MegaMoE(
        config(weight_dtype=weight_dtype, capacity=tokens * 4, tile_pack=False),
        device="cuda",
        dtype=torch.bfloat16,
    )
    row_major.load_state_dict(packed.state_dict())
    x = torch.randn(tokens, 1024, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        packed(x)  # compiles and prepares outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        y = packed(x)
    for seed in (1, 2):
        torch.manual_seed(seed)
        x.copy_(torch.randn_like(x))
        graph.replay()
        with torch.no_grad():
            expected = row_major(x)
        assert torch.equal(y.view(torch.int16), expected.view(torch.int16))
