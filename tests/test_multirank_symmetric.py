"""The NVSHMEM dispatcher on GPUs: CUDA-graph replay with changing routing, no memory growth
over many forwards, and a peer that never arrives. Skips without 2 GPUs and nvshmem4py (run under
torchrun with one GPU per rank)."""

from __future__ import annotations

import itertools

import pytest
import torch
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.distributed import nvshmem_status

pytestmark = [pytest.mark.multirank, pytest.mark.gpu]

HIDDEN = 256
NUM_EXPERTS = 16
TOP_K = 4


@pytest.fixture
def gpu_multirank(multirank):
    available, reason = nvshmem_status(multirank.device)
    if not available:
        pytest.skip(reason)
    return multirank


def build(rank, world_size, device, *, max_tokens, **options):
    from megamoe_runtime.dispatch.symmetric import SymmetricDispatcher

    return SymmetricDispatcher(
        NUM_EXPERTS,
        top_k=TOP_K,
        hidden_size=HIDDEN,
        dtype=torch.bfloat16,
        device=device,
        process_group=torch.distributed.group.WORLD,
        max_tokens_per_rank=max_tokens,
        **options,
    )


def fill_routing(generator, tokens_per_rank, x_all, ids_all, weights_all):
    """Fresh tokens and routing for every rank, written into the given static tensors."""
    total = sum(tokens_per_rank)
    x_all.copy_(torch.randn(total, HIDDEN, generator=generator).to(x_all.dtype))
    choice = torch.rand(total, NUM_EXPERTS, generator=generator).argsort(dim=1)[:, :TOP_K]
    ids_all.copy_(choice.to(torch.int32))
    weights_all.copy_(torch.rand(total, TOP_K, generator=generator))


def check_graph_replay(rank, world_size, device, options):
    tokens_per_rank = [(24, 40)[r % 2] for r in range(world_size)]
    dispatcher = build(rank, world_size, device, max_tokens=64, **options)
    # the partial-sum combine rounds the owners' partials to bf16: close, not bitwise
    bitwise = not options.get("combine_partial_sums", False)
    total = sum(tokens_per_rank)
    x_all = torch.empty(total, HIDDEN, dtype=torch.bfloat16, device=device)
    ids_all = torch.empty(total, TOP_K, dtype=torch.int32, device=device)
    weights_all = torch.empty(total, TOP_K, dtype=torch.float32, device=device)
    first = sum(tokens_per_rank[:rank])
    mine = slice(first, first + tokens_per_rank[rank])
    generator = torch.Generator().manual_seed(5)

    def step():
        batch, handle = dispatcher.dispatch(x_all[mine], ids_all[mine], weights_all[mine])
        return dispatcher.combine(batch.rows_MH * 2 + 1, handle)

    fill_routing(generator, tokens_per_rank, x_all, ids_all, weights_all)
    step()  # compiles and loads the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step()
    failures = []
    for replay in range(4):
        fill_routing(generator, tokens_per_rank, x_all, ids_all, weights_all)
        graph.replay()
        single = LocalDispatcher(NUM_EXPERTS)
        batch, handle = single.dispatch(x_all, ids_all, weights_all)
        expected = single.combine(batch.rows_MH * 2 + 1, handle)[mine]
        if bitwise and not torch.equal(y_static, expected):
            failures.append((replay, (y_static.float() - expected.float()).abs().max().item()))
        if not bitwise and not torch.allclose(y_static, expected, rtol=2e-2, atol=2e-2):
            failures.append((replay, (y_static.float() - expected.float()).abs().max().item()))
    torch.cuda.synchronize()
    dispatcher.raise_if_timed_out()
    assert not failures, f"rank {rank}: replays differ from the single-GPU combine: {failures}"


@pytest.mark.parametrize(
    "options",
    [
        {"small_batch": True},
        {"small_batch": False},
        {"stage_remote_rows": False},
        {"combine_partial_sums": True, "small_batch": True},
        {"combine_partial_sums": True, "small_batch": False},
    ],
    ids=["small", "staged", "direct", "small-partial", "staged-partial"],
)
def test_graph_capture_and_replay_with_changing_routing(gpu_multirank, options):
    gpu_multirank(check_graph_replay, options)


def check_no_memory_growth(rank, world_size, device):
    from megamoe_torch import MegaMoE, MegaMoEConfig

    config = MegaMoEConfig(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_experts=NUM_EXPERTS,
        top_k=TOP_K,
        backend="grouped_mm",
        dispatcher="nvshmem",
        max_tokens_per_rank=32,
    )
    torch.manual_seed(3)
    layer = MegaMoE(
        config, process_group=torch.distributed.group.WORLD, device=device, dtype=torch.bfloat16
    )
    x = torch.randn(16 + 8 * rank, HIDDEN, device=device, dtype=torch.bfloat16)
    allocated = []
    with torch.no_grad():
        for forward in range(1100):
            y = layer(x)
            if forward in (99, 599, 1099):  # after a warm-up, then every 500 forwards
                torch.cuda.synchronize()
                allocated.append(torch.cuda.memory_allocated(device))
    layer.dispatcher.raise_if_timed_out()
    assert torch.isfinite(y.float()).all()
    # a leak grows in both windows; a library's one-off lazy allocation (a few KiB) in one
    growth = [later - earlier for earlier, later in itertools.pairwise(allocated)]
    assert min(growth) <= 0 and max(growth) < 1 << 20, f"rank {rank}: growth per 500: {growth}"


def test_thousand_forwards_do_not_grow_gpu_memory(gpu_multirank):
    gpu_multirank(check_no_memory_growth)


def check_lost_peer_times_out(rank, world_size, device):
    # a pool of its own: the skipped rank leaves this pool's signals out of step, not the default's
    dispatcher = build(
        rank, world_size, device, max_tokens=8, timeout_s=0.2, layer_name="layer-7", pool="lost"
    )
    if rank == 0:
        x = torch.randn(8, HIDDEN, device=device, dtype=torch.bfloat16)
        ids = torch.randint(0, NUM_EXPERTS, (8, TOP_K), device=device, dtype=torch.int32)
        weights = torch.rand(8, TOP_K, device=device)
        dispatcher.dispatch(x, ids, weights)
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match=r"dispatch counts timed out on rank 0.*layer-7"):
            dispatcher.raise_if_timed_out()


def test_peer_that_never_arrives_raises_timeout(gpu_multirank):
    gpu_multirank(check_lost_peer_times_out)


def check_small_batch_refused_where_it_cannot_run(rank, world_size, device):
    with pytest.raises(ValueError, match="small_batch=True needs stage_remote_rows=True"):
        build(rank, world_size, device, max_tokens=8, stage_remote_rows=False, small_batch=True)
    with pytest.raises(ValueError, match="world x max_tokens x top_k <= 8192"):
        build(rank, world_size, device, max_tokens=8192, small_batch=True)


def test_small_batch_dispatch_refused_where_it_cannot_run(gpu_multirank):
    gpu_multirank(check_small_batch_refused_where_it_cannot_run)


def check_dispatch_without_combine_refused(rank, world_size, device):
    dispatcher = build(rank, world_size, device, max_tokens=8, layer_name="layer-3")
    x = torch.randn(8, HIDDEN, device=device, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, device=device)[:TOP_K] for _ in range(8)])
    weights = torch.rand(8, TOP_K, device=device)
    batch, handle = dispatcher.dispatch(x, ids.to(torch.int32), weights)
    with pytest.raises(RuntimeError, match="'layer-3'.*has not been combined"):
        dispatcher.dispatch(x, ids.to(torch.int32), weights)
    # refused before any launch: the group is still in step
    for _ in range(2):
        y = dispatcher.combine(batch.rows_MH, handle)
        batch, handle = dispatcher.dispatch(x, ids.to(torch.int32), weights)
    dispatcher.combine(batch.rows_MH, handle)
    torch.cuda.synchronize()
    dispatcher.raise_if_timed_out()
    assert torch.isfinite(y.float()).all()


def test_a_dispatch_without_its_combine_is_refused(gpu_multirank):
    gpu_multirank(check_dispatch_without_combine_refused)
