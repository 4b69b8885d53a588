"""A derived value is recomputed when a tensor it came from is written or replaced, else kept."""

from __future__ import annotations

import weakref

import torch
from megamoe_torch.tensor_cache import DerivedTensorCache


def test_derived_value_follows_its_tensors():
    weight = torch.randn(4, 3)
    cache, calls = DerivedTensorCache(), []

    def derive():
        calls.append(1)
        return weight.float() * 2

    first = cache.get((weight, None), derive)
    assert cache.get((weight, None), derive) is first and len(calls) == 1
    weight.add_(1.0)  # in place: its version moves
    torch.testing.assert_close(cache.get((weight, None), derive), weight * 2)
    weight = torch.randn(4, 3)  # replaced: another storage
    torch.testing.assert_close(cache.get((weight, None), derive), weight * 2)
    cache.get((weight, None), derive, context=("other",))  # a different context
    assert len(calls) == 4


def test_a_replaced_value_is_dropped_before_its_successor_is_derived():
    # the old value's memory is free for the new one (prepared weights of tens of GB)
    weight = torch.randn(4, 3)
    cache = DerivedTensorCache()
    first = cache.get((weight,), lambda: weight * 2)
    dropped = weakref.ref(first)
    del first
    weight.add_(1.0)

    def derive():
        assert dropped() is None, "the value being replaced is still held"
        return weight * 2

    torch.testing.assert_close(cache.get((weight,), derive), weight * 2)
