"""Expert-parallel MegaMoE equals the single-GPU layer built from the same weights.

Dispatch keeps every expert's rows in the single-GPU order and combine sums top-k in the same
order (test_multirank_dispatch checks both bitwise), but the expert GEMMs see other row counts
than the single-GPU layer's, and matmul libraries block differently per shape: the last bits may
differ, so the layers compare within float32 (CPU) or bf16 (GPU) tolerance.
"""

from __future__ import annotations

import pytest
import torch
from megamoe_runtime.distributed import nvshmem_status
from megamoe_torch import MegaMoE, MegaMoEConfig

pytestmark = pytest.mark.multirank


def layer_config(
    dispatcher: str,
    device: torch.device,
    combine_order: str = "exact",
    wire: str = "bf16",
    **fields,
) -> MegaMoEConfig:
    return MegaMoEConfig(
        **dict(
            dict(
                hidden_size=128,
                intermediate_size=64,
                num_experts=16,
                top_k=4,
                scoring="sigmoid",
                num_groups=4,
                top_groups=2,
                use_correction_bias=True,
                routed_scaling_factor=2.5,
                num_shared_experts=1,
                backend="reference" if device.type == "cpu" else "grouped_mm",
                dispatcher=dispatcher,
                max_tokens_per_rank=96,
                combine_order=combine_order,
                dispatch_dtype=wire,
                combine_dtype=wire,
            ),
            **fields,
        )
    )


def check_layer_matches_single_gpu(
    rank,
    world_size,
    device,
    dispatcher,
    token_pattern,
    combine_order="exact",
    wire="bf16",
    fields=None,
):
    # rank r sends token_pattern[r % len(token_pattern)] tokens: any world size
    tokens_per_rank = [token_pattern[r % len(token_pattern)] for r in range(world_size)]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = layer_config(dispatcher, device, combine_order, wire, **(fields or {}))
    torch.manual_seed(7)  # the same full weights on every rank
    single = MegaMoE(config, device=device, dtype=dtype)
    vocab = config.routing_table_vocab_size
    with torch.no_grad():
        if single.e_score_correction_bias is not None:
            single.e_score_correction_bias.uniform_(-0.1, 0.1)
        if vocab:  # each token id's experts, random and distinct
            table = torch.rand(vocab, config.num_experts).argsort(dim=1)[:, : config.top_k]
            single.routing_table.copy_(table)
    parallel = MegaMoE(
        config, process_group=torch.distributed.group.WORLD, device=device, dtype=dtype
    )
    parallel.load_full_state_dict(single.state_dict())
    assert parallel.w13.shape[0] == config.num_experts // world_size
    generator = torch.Generator().manual_seed(11)
    results = []
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for _ in range(3):  # repeated forwards on the same layer and buffers
        xs = [torch.randn(t, config.hidden_size, generator=generator) for t in tokens_per_rank]
        xs = [x.to(device=device, dtype=dtype) for x in xs]
        ids = [torch.randint(max(vocab, 1), (t,), generator=generator) for t in tokens_per_rank]
        ids = [i.to(device) for i in ids]
        with torch.no_grad():
            y_single = single(torch.cat(xs), input_ids=torch.cat(ids))
            y = parallel(xs[rank], input_ids=ids[rank])
        first = sum(tokens_per_rank[:rank])
        results.append((y, y_single[first : first + tokens_per_rank[rank]]))
    # compared after the last collective, so one rank's failure cannot hang the others
    for y, expected in results:
        if wire == "fp8":
            # e4m3 on both ways: each value that crosses rounds by at most 2^-4 of itself. One
            # rank holds every expert and dispatches nothing: no value crosses, no rounding
            error = (y.float() - expected.float()).norm() / expected.float().norm()
            assert error < 2 * 2.0**-4, error
            assert (error > 0) == (world_size > 1), error
        else:
            torch.testing.assert_close(y, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dispatcher", ["torch", "nvshmem"])
def test_expert_parallel_layer_equals_single_gpu(multirank, dispatcher):
    if dispatcher == "nvshmem" and not nvshmem_status(multirank.device)[0]:
        pytest.skip(nvshmem_status(multirank.device)[1])
    multirank(check_layer_matches_single_gpu, dispatcher, [40, 0 if dispatcher == "torch" else 9])


def test_expert_parallel_latent_layer_equals_single_gpu(multirank):
    # Nemotron-H's latent MoE: the dispatch sends 48-wide projections of the 128-wide tokens to
    # ungated relu^2 experts
    fields = dict(latent_size=48, activation="relu2")
    multirank(check_layer_matches_single_gpu, "torch", [40, 0], "exact", "bf16", fields)


def test_expert_parallel_softcapped_layer_with_an_output_norm_equals_single_gpu(multirank):
    # Inkling2's softcapped SwiGLU and A.X-K1's output RMSNorm, after the combine
    fields = dict(swiglu_gate_softcap=4.0, swiglu_up_softcap=2.0, output_norm_eps=1e-6)
    multirank(check_layer_matches_single_gpu, "torch", [40, 0], "exact", "bf16", fields)


def test_expert_parallel_layer_routing_by_token_id_equals_single_gpu(multirank):
    # DeepSeek-V4's hash layers: each token's experts the row of its id in the routing table,
    # weighted by their sqrt(softplus) scores
    fields = dict(
        scoring="sqrtsoftplus",
        num_groups=1,
        top_groups=1,
        use_correction_bias=False,
        routing_table_vocab_size=64,
    )
    multirank(check_layer_matches_single_gpu, "torch", [40, 0], "exact", "bf16", fields)


def test_expert_parallel_layer_with_owner_partials(multirank):
    # the partial-sum combine: one more bf16 rounding, so within the bf16 tolerance only
    if not nvshmem_status(multirank.device)[0]:
        pytest.skip(nvshmem_status(multirank.device)[1])
    multirank(check_layer_matches_single_gpu, "nvshmem", [40, 9], "owner_partials")


@pytest.mark.gpu
@pytest.mark.parametrize("combine_order", ["exact", "owner_partials"])
def test_expert_parallel_layer_with_the_fp8_wire(multirank, combine_order):
    # FP8 dispatch and combine into bf16 experts (grouped_mm on the dequantized batch): within
    # e4m3 rounding of the single-GPU layer
    if not nvshmem_status(multirank.device)[0]:
        pytest.skip(nvshmem_status(multirank.device)[1])
    multirank(check_layer_matches_single_gpu, "nvshmem", [40, 9], combine_order, "fp8")


def check_compiled_layer_matches_single_gpu(rank, world_size, device):
    # torch.compile(fullgraph=True) of the expert-parallel layer, with no eager forward before
    # it (the op builds the dispatcher): the routing is traced, the dispatch, expert MLP and
    # combine run as the op megamoe::expert_parallel_mlp; new token counts, a rank without tokens
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    config = layer_config("torch", device)
    torch.manual_seed(7)
    single = MegaMoE(config, device=device, dtype=dtype)
    with torch.no_grad():
        single.e_score_correction_bias.uniform_(-0.1, 0.1)
    parallel = MegaMoE(
        config, process_group=torch.distributed.group.WORLD, device=device, dtype=dtype
    )
    parallel.load_full_state_dict(single.state_dict())
    compiled = torch.compile(parallel, fullgraph=True)
    generator = torch.Generator().manual_seed(11)
    results = []
    for pattern in ([23, 9], [6, 0], [31, 17]):
        tokens_per_rank = [pattern[r % len(pattern)] for r in range(world_size)]
        xs = [torch.randn(t, config.hidden_size, generator=generator) for t in tokens_per_rank]
        xs = [x.to(device=device, dtype=dtype) for x in xs]
        with torch.no_grad():
            y_single = single(torch.cat(xs))
            y = compiled(xs[rank])
        first = sum(tokens_per_rank[:rank])
        results.append((y, y_single[first : first + tokens_per_rank[rank]]))
    with torch.no_grad():
        explained = torch._dynamo.explain(parallel)(xs[rank])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for y, expected in results:
        torch.testing.assert_close(y, expected, rtol=tolerance, atol=tolerance)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_expert_parallel_layer_compiles_with_no_graph_break(multirank):
    multirank(check_compiled_layer_matches_single_gpu)


def test_unknown_combine_order_raises():
    with pytest.raises(ValueError, match="combine_order"):
        layer_config("torch", torch.device("cpu"), "fastest")


@pytest.mark.parametrize("world_size", [4, 8])
def test_layer_on_more_ranks(multirank, world_size):
    # 8 ranks: 2 of the 16 experts each, so most of a token's top-4 live on other ranks
    multirank(check_layer_matches_single_gpu, "torch", [5, 17, 0, 8], world_size=world_size)


def check_indivisible_layer_raises(rank, world_size, device):
    config = MegaMoEConfig(hidden_size=32, intermediate_size=16, num_experts=7, top_k=2)
    with pytest.raises(ValueError, match="divisible"):
        MegaMoE(config, process_group=torch.distributed.group.WORLD)


def test_layer_with_indivisible_experts_raises(multirank):
    multirank(check_indivisible_layer_raises)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dispatch_dtype": "e5m2"}, r"dispatch_dtype must be one of \('bf16', 'fp8'\)"),
        ({"combine_dtype": "fp8", "hidden_size": 120}, "combine_dtype='fp8' needs .*=120"),
    ],
)
def test_wire_dtypes_are_checked_by_the_config(options, message):
    from dataclasses import replace

    with pytest.raises(ValueError, match=message):
        replace(layer_config("torch", torch.device("cpu")), **options)
