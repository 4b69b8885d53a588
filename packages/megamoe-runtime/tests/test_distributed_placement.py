"""The symmetric dispatcher's placement math, simulated for W ranks on the CPU: scattering every
rank's rows to the computed destinations builds, on each owner, exactly its share of the
single-GPU batch (same rows, same order, same expert_offsets)."""

from __future__ import annotations

import pytest
import torch
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.dispatch.reference import count_pairs, owner_partials_combine, place_pairs


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


@pytest.mark.parametrize("world", [1, 2, 4])
def test_owner_partials_reference_is_close_to_the_single_gpu_combine(world):
    generator = torch.Generator().manual_seed(world)
    tokens, experts, top_k, hidden = 29, 16, 4, 32
    x_TH = torch.randn(tokens, hidden, generator=generator).to(torch.bfloat16)
    ids_TK = torch.rand(tokens, experts, generator=generator).argsort(dim=1)[:, :top_k]
    weights_TK = torch.rand(tokens, top_k, generator=generator)
    out_TKH = (x_TH * 2 + 1).unsqueeze(1).expand(-1, top_k, -1)
    single = LocalDispatcher(experts)
    batch, handle = single.dispatch(x_TH, ids_TK.to(torch.int32), weights_TK)
    expected_TH = single.combine(batch.rows_MH * 2 + 1, handle)
    y_TH = owner_partials_combine(
        out_TKH, weights_TK, ids_TK // (experts // world), world=world, dtype=torch.bfloat16
    )
    if world == 1:  # one owner: one partial, the single-GPU arithmetic exactly
        assert torch.equal(y_TH, expected_TH)
    torch.testing.assert_close(y_TH, expected_TH, rtol=2e-2, atol=2e-2)
