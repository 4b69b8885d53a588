"""torch.compile: the layer and a Hugging Face model with swapped blocks compile with
fullgraph=True (no graph break: the expert compute is the custom op megamoe::expert_mlp) and
give the eager outputs."""

from __future__ import annotations

import pytest
import torch
from megamoe_torch import MegaMoE, MegaMoEConfig
from megamoe_torch.ops import expert_mlp, expert_parallel_mlp

FAMILIES = {
    "softmax": dict(num_experts=8, top_k=2),
    "sigmoid_grouped_shared_gated": dict(
        num_experts=8,
        top_k=2,
        scoring="sigmoid",
        num_groups=4,
        top_groups=2,
        use_correction_bias=True,
        routed_scaling_factor=2.5,
        num_shared_experts=1,
        shared_expert_gate=True,
    ),
}


def tiny_qwen3_moe(transformers, *, hidden_size: int, head_dim: int, moe_intermediate_size: int):
    """A random two-layer Qwen3-MoE (8 experts, top-2, 96 tokens of vocabulary) in eval mode;
    the dense MLP as wide as the hidden size (at least 96)."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=96,
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        head_dim=head_dim,
        intermediate_size=max(96, hidden_size),
        moe_intermediate_size=moe_intermediate_size,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    return transformers.Qwen3MoeForCausalLM(config).eval()


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_layer_compiles_with_no_graph_break_and_matches_eager(family):
    torch.manual_seed(0)
    config = MegaMoEConfig(
        hidden_size=64, intermediate_size=32, backend="reference", **FAMILIES[family]
    )
    layer = MegaMoE(config, dtype=torch.float32)
    x = torch.randn(3, 7, 64)
    explained = torch._dynamo.explain(layer)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-6)
    # a second input of the same shape routes differently and reuses the compiled graph
    x2 = torch.randn(3, 7, 64)
    torch.testing.assert_close(compiled(x2), layer(x2), rtol=1e-5, atol=1e-6)


@torch.no_grad()
def test_check_inputs_under_compile_is_a_graph_break_that_says_why():
    torch.manual_seed(0)
    config = MegaMoEConfig(
        hidden_size=64, intermediate_size=32, check_inputs=True, **FAMILIES["softmax"]
    )
    layer = MegaMoE(config, dtype=torch.float32)
    x = torch.randn(5, 64)
    with pytest.raises(
        torch._dynamo.exc.Unsupported,
        match=r"check_inputs=True\) reads the input .* fullgraph=False",
    ):
        torch.compile(layer, fullgraph=True)(x)
    torch._dynamo.reset()
    compiled = torch.compile(layer)  # the checks run between graphs
    torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-6)
    x[2, 7] = float("nan")
    with pytest.raises(ValueError, match="x holds NaN"):
        compiled(x)


def test_expert_mlp_op_passes_the_custom_op_checks():
    torch.manual_seed(0)
    layer = MegaMoE(MegaMoEConfig(hidden_size=32, intermediate_size=16, num_experts=4, top_k=2))
    rows_MH = torch.randn(6, 32)
    offsets = torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32)
    torch.library.opcheck(
        expert_mlp,
        (rows_MH, offsets, layer.w13.detach(), layer.w2.detach(), layer._layer_id, 6),
        test_utils=("test_schema", "test_faketensor"),
    )


def test_expert_parallel_op_passes_the_custom_op_checks():
    # the op runs whatever dispatcher the layer holds: here one rank's local dispatcher (the
    # expert-parallel layers compile in tests/test_multirank_layer.py)
    torch.manual_seed(0)
    layer = MegaMoE(MegaMoEConfig(hidden_size=32, intermediate_size=16, num_experts=4, top_k=2))
    x_TH = torch.randn(5, 32)
    topk_ids_TK = torch.tensor([[0, 3], [1, 3], [2, 0], [3, 1], [0, 1]])
    topk_weights_TK = torch.rand(5, 2)
    args = (x_TH, topk_ids_TK, topk_weights_TK, layer.w13.detach(), layer.w2.detach())
    torch.library.opcheck(
        expert_parallel_mlp,
        (*args, layer._layer_id),
        test_utils=("test_schema", "test_faketensor"),
    )


@torch.no_grad()
def test_hugging_face_model_with_swapped_blocks_compiles_fullgraph():
    transformers = pytest.importorskip("transformers")
    from megamoe_torch import swap_moe_blocks

    torch.manual_seed(0)
    model = tiny_qwen3_moe(transformers, hidden_size=64, head_dim=16, moe_intermediate_size=32)
    swap_moe_blocks(model, backend="reference")
    input_ids = torch.randint(0, 96, (2, 9))
    eager = model(input_ids).logits
    compiled = torch.compile(model, fullgraph=True)
    torch.testing.assert_close(compiled(input_ids).logits, eager, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
@torch.no_grad()
def test_cutedsl_layer_compiles_on_a_gpu(mode):
    from megamoe_runtime.experts import backend_status

    if not torch.cuda.is_available() or not backend_status("cutedsl", torch.device("cuda"))[0]:
        pytest.skip("needs an sm_90 GPU with CuTe DSL")
    torch.manual_seed(0)
    config = MegaMoEConfig(
        hidden_size=512,
        intermediate_size=256,
        backend="cutedsl",
        capacity=64 * 4,
        **FAMILIES["softmax"],
    )
    layer = MegaMoE(config, device="cuda", dtype=torch.bfloat16)
    # an eager forward first: the backend prepares its weights and buffers outside the CUDA
    # graphs' memory pool, which refuses memory that outlives a call (README, torch.compile)
    layer(torch.randn(64, 512, device="cuda", dtype=torch.bfloat16))
    compiled = torch.compile(layer, fullgraph=True, mode=mode)
    for _ in range(3):  # reduce-overhead records, then replays a CUDA graph
        x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(compiled(x).clone(), layer(x), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@torch.no_grad()
def test_hugging_face_model_on_cutedsl_compiles_on_a_gpu():
    # bf16: the compiled attention and norms round differently, so a token whose top-k choice
    # is a near-tie may take another expert (README "torch.compile": 0-3 of 18 tokens a batch,
    # max 0.09, grouped_mm alike); every other token matches eager. reduce-overhead replays,
    # with new tokens (new routings), give the default mode's bits
    from megamoe_runtime.experts import backend_status

    transformers = pytest.importorskip("transformers")
    from megamoe_torch import swap_moe_blocks

    if not torch.cuda.is_available() or not backend_status("cutedsl", torch.device("cuda"))[0]:
        pytest.skip("needs an sm_90 GPU with CuTe DSL")
    torch.manual_seed(0)
    model = tiny_qwen3_moe(transformers, hidden_size=256, head_dim=64, moe_intermediate_size=128)
    model = model.to("cuda", torch.bfloat16)
    report = swap_moe_blocks(model, backend="cutedsl")
    assert len(report.swapped) == 2, report
    batches = [torch.randint(0, 96, (2, 9), device="cuda") for _ in range(3)]
    eager = [model(ids).logits.float() for ids in batches]  # also prepares the weights
    outputs = {}
    for mode in (None, "reduce-overhead"):
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, mode=mode)
        # reduce-overhead records, then replays a CUDA graph
        outputs[mode] = [compiled(ids).logits.float().clone() for ids in batches + batches]
    for mode, logits in outputs.items():
        for i, out in enumerate(logits):
            error = (out - eager[i % 3]).abs()
            tokens_off = (error.amax(dim=-1) > 2e-2).float().mean()
            assert tokens_off <= 0.25 and error.max() < 0.25, (mode, i, tokens_off, error.max())
    for default, replayed in zip(outputs[None], outputs["reduce-overhead"], strict=True):
        assert torch.equal(default, replayed)
