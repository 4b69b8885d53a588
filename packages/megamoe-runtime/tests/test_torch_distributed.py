"""The torch.distributed reference dispatcher in one process (a world of one on gloo): it must
build exactly the single-GPU batch and combine. Multi-rank behaviour: tests/test_multirank_*.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megamoe_runtime.dispatch import LocalDispatcher, TorchDistributedDispatcher, experts_per_rank


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised (torchrun)")
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "file"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_world_of_one_equals_local_dispatch(world_of_one):
    generator = torch.Generator().manual_seed(0)
    x_TH = torch.randn(29, 32, generator=generator)
    ids_TK = torch.randint(0, 6, (29, 3), generator=generator)
    weights_TK = torch.rand(29, 3, generator=generator)
    reference = TorchDistributedDispatcher(6)
    local = LocalDispatcher(6)
    batch, handle = reference.dispatch(x_TH, ids_TK, weights_TK)
    local_batch, local_handle = local.dispatch(x_TH, ids_TK, weights_TK)
    assert torch.equal(batch.rows_MH, local_batch.rows_MH)
    assert torch.equal(batch.expert_offsets, local_batch.expert_offsets)
    out_MH = torch.tanh(batch.rows_MH) * 3
    assert torch.equal(reference.combine(out_MH, handle), local.combine(out_MH, local_handle))


def test_capacity_overflow_is_named(world_of_one):
    dispatcher = TorchDistributedDispatcher(4, capacity=5)
    x_TH = torch.randn(3, 8)
    ids_TK = torch.tensor([[0, 1], [2, 3], [0, 2]])
    with pytest.raises(ValueError, match="capacity 5"):
        dispatcher.dispatch(x_TH, ids_TK, torch.rand(3, 2))


def test_experts_must_split_evenly():
    with pytest.raises(ValueError, match="num_experts=10 must be divisible"):
        experts_per_rank(10, 4)
    assert experts_per_rank(256, 8) == 32
