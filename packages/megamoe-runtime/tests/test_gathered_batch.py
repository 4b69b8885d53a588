"""The gathered expert batch (the tokens and the token of each batch row, the rows not copied
out) against the tight batch of the same rows on the CPU backend, and its refusals."""

from __future__ import annotations

import pytest
import torch
from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.experts import make_backend
from megamoe_runtime.weights import Unquantized

E, H, INTER, TOKENS = 4, 128, 64, 9


def gathered_and_tight(counts: list[int], *, capacity: int | None = None, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    tokens_TH = torch.randn(TOKENS, H, generator=generator)
    valid = sum(counts)
    capacity = valid if capacity is None else capacity
    source_M = torch.randint(0, TOKENS, (capacity,), generator=generator, dtype=torch.int32)
    source_M[valid:] = 1 << 30  # unspecified past the valid rows: never an index
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    gathered = ExpertBatch.gathered(tokens_TH, source_M, offsets, valid_rows=valid)
    tight = ExpertBatch(rows_MH=tokens_TH[source_M[:valid].long()], expert_offsets=offsets)
    return gathered, tight


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 0], [9, 0, 0, 0]])
def test_a_gathered_batch_computes_what_its_copied_rows_compute(counts):
    gathered, tight = gathered_and_tight(counts, capacity=sum(counts) + 5)
    assert gathered.is_gathered and not tight.is_gathered
    assert gathered.capacity == sum(counts) + 5 and gathered.hidden_size == H
    generator = torch.Generator().manual_seed(2)
    weights = Unquantized(
        w13_E2IH=torch.randn(E, 2 * INTER, H, generator=generator) / H**0.5,
        w2_EHI=torch.randn(E, H, INTER, generator=generator) / INTER**0.5,
    )
    backend = make_backend("reference")
    valid = sum(counts)
    out = backend(gathered, backend.prepare(weights))
    assert out.shape == (gathered.capacity, H)
    assert torch.equal(out[:valid], backend(tight, backend.prepare(weights))[:valid])
    materialized = gathered.materialized()
    assert not materialized.is_gathered and materialized.capacity == gathered.capacity
    assert torch.equal(materialized.rows_MH[:valid], tight.rows_MH)
    assert tight.materialized() is tight


def test_a_gathered_batch_refuses_what_it_cannot_hold():
    gathered, _ = gathered_and_tight([2, 2, 0, 0])
    with pytest.raises(ValueError, match="row_source_M must be 1-D int32"):
        ExpertBatch.gathered(
            gathered.rows_MH, gathered.row_source_M.long(), gathered.expert_offsets
        )
    with pytest.raises(ValueError, match="valid_rows"):
        ExpertBatch.gathered(
            gathered.rows_MH, gathered.row_source_M, gathered.expert_offsets, valid_rows=99
        )


def test_published_offsets_stay_published_when_the_rows_are_copied_out():
    gathered, _ = gathered_and_tight([2, 1, 0, 3])
    published = ExpertBatch.gathered(
        gathered.rows_MH,
        gathered.row_source_M,
        gathered.expert_offsets,
        offsets_published=True,
    )
    assert published.materialized().offsets_published
    assert not gathered.materialized().offsets_published
