"""`megamoe bench`'s fp32 oracle, computed a chunk of experts at a time (an FP8 pack of
DeepSeek-V3's experts dequantized whole would take 45 GB of float32): the same values as the
whole pack's oracle, for bf16 experts with biases and a clamped SwiGLU and for FP8 experts, with
experts left empty."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_torch import bench

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("geometry_name", "weight_dtype"), [("gpt-oss-120b", None), ("qwen3-30b-a3b", "fp8")]
)
@torch.no_grad()
def test_the_oracle_a_chunk_of_experts_at_a_time_is_the_whole_packs(
    geometry_name, weight_dtype, monkeypatch
):
    geometry = replace(
        GEOMETRIES[geometry_name], num_experts=10, top_k=2, hidden_size=160, intermediate_size=96
    )
    layer = bench.build_layer(geometry, device=CPU, dtype=torch.bfloat16, weight_dtype=weight_dtype)
    x_TH, ids, weights = bench.routed_tokens(layer, 6)
    # a busy expert (each token's experts stay distinct), and experts 0-9 not all visited
    ids[:, 1] = torch.where(ids[:, 1] == 3, ids[:, 0], ids[:, 1])
    ids[:, 0] = 3
    batch, _ = LocalDispatcher(geometry.num_experts).dispatch(x_TH, ids, weights)
    offsets = batch.expert_offsets.tolist()
    assert any(offsets[e + 1] == offsets[e] for e in range(geometry.num_experts))
    pack = layer.expert_weight_pack()
    monkeypatch.setattr(bench, "ORACLE_EXPERTS_PER_CHUNK", geometry.num_experts)
    whole = bench.oracle_rows(pack, batch, offsets)  # one chunk: the whole pack at once
    monkeypatch.setattr(bench, "ORACLE_EXPERTS_PER_CHUNK", 3)  # chunks 0-2, 3-5, 6-8, 9

    chunked = bench.oracle_rows(pack, batch, offsets)

    assert chunked.dtype == torch.float32 and chunked.shape == (offsets[-1], geometry.hidden_size)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=0)
