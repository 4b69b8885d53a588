"""The symmetric dispatcher's placement math, simulated for W ranks on the CPU: scattering every
rank's rows to the computed destinations builds, on each owner, exactly its share of the
single-GPU batch (same rows, same order, same expert_offsets)."""

from __future__ import annotations

import pytest
import torch
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.dispatch.symmetric import count_pairs, place_pairs


@pytest.mark.parametrize(("world", "experts", "top_k"), [(2, 8, 3), (4, 16, 4), (8, 16, 1)])
def test_placement_builds_the_single_gpu_batch(world, experts, top_k):
    generator = torch.Generator().manual_seed(world)
    local = experts // world
    tokens = [(7 * rank + 5) % 13 for rank in range(world)]  # uneven, one rank may have none
    xs = [torch.randn(t, 16, generator=generator) for t in tokens]
    ids = [
        torch.rand(t, experts, generator=generator).argsort(dim=1)[:, :top_k].to(torch.int32)
        for t in tokens
    ]
    counted = [count_pairs(i.reshape(-1), experts) for i in ids]
    gathered_WE = torch.stack([counts_E for counts_E, _ in counted])
    batches = [torch.full((sum(tokens) * top_k, 16), float("nan")) for _ in range(world)]
    offsets = []
    for rank in range(world):
        expert_of_pair = ids[rank].reshape(-1)
        dest_row, expert_offsets = place_pairs(
            expert_of_pair,
            counted[rank][1],
            gathered_WE,
            rank=rank,
            world=world,
            local_experts=local,
        )
        offsets.append(expert_offsets)
        for pair in range(expert_of_pair.numel()):
            owner = int(expert_of_pair[pair]) // local
            batches[owner][int(dest_row[pair])] = xs[rank][pair // top_k]
    single = LocalDispatcher(experts)
    batch, _ = single.dispatch(torch.cat(xs), torch.cat(ids), torch.rand(sum(tokens), top_k))
    for owner in range(world):
        share = batch.expert_offsets[owner * local : (owner + 1) * local + 1]
        assert torch.equal(offsets[owner], share - share[0])
        rows = int(share[-1] - share[0])
        assert torch.equal(batches[owner][:rows], batch.rows_MH[int(share[0]) : int(share[-1])])
