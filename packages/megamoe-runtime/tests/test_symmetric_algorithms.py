"""The symmetric dispatcher's algorithm choice and buffer declarations (no GPU: the choice
depends only on the static sizes, and the small dispatch's limits come from its drop)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from megamoe_runtime.dispatch.symmetric_algorithms import (
    DirectDispatch,
    ExactCombine,
    PartialSumCombine,
    SmallBatchDispatch,
    StagedDispatch,
    SymmetricSizes,
    choose_combine,
    choose_dispatch,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="CuTe DSL not installed"
)


def sizes(*, world=2, experts=256, top_k=8, max_tokens=128):
    return SymmetricSizes(
        world=world,
        num_experts=experts,
        top_k=top_k,
        hidden_size=7168,
        dtype=torch.bfloat16,
        max_tokens_per_rank=max_tokens,
        capacity=world * max_tokens * top_k,
    )


@pytest.mark.parametrize(
    ("group", "stage", "small", "expected"),
    [
        (sizes(), True, None, SmallBatchDispatch),  # 2 x 128 x 8 = 2048 pairs fit
        (sizes(max_tokens=512), True, None, SmallBatchDispatch),  # 8192 pairs: the limit
        (sizes(max_tokens=513), True, None, StagedDispatch),
        (sizes(experts=2 * 513), True, None, StagedDispatch),  # 513 experts per rank
        (sizes(), True, False, StagedDispatch),
        (sizes(), False, None, DirectDispatch),
    ],
)
def test_dispatch_is_chosen_from_the_static_sizes(group, stage, small, expected):
    chosen = choose_dispatch(group, stage_remote_rows=stage, small_batch=small, grid=132)
    assert isinstance(chosen, expected)


def test_a_small_batch_request_that_cannot_run_is_refused():
    with pytest.raises(ValueError, match="needs stage_remote_rows=True"):
        choose_dispatch(sizes(), stage_remote_rows=False, small_batch=True, grid=132)
    with pytest.raises(ValueError, match=r"2 x 1024 x 8 = 16384"):
        choose_dispatch(sizes(max_tokens=1024), stage_remote_rows=True, small_batch=True, grid=132)
    with pytest.raises(ValueError, match="at least 2 CTAs"):
        choose_dispatch(sizes(), stage_remote_rows=True, small_batch=True, grid=1)


def test_each_algorithm_declares_the_buffers_its_kernels_address():
    group = sizes()
    slots = group.world * group.max_tokens_per_rank
    assert DirectDispatch().buffer_shapes(group) == {}
    staged = StagedDispatch().buffer_shapes(group)
    assert staged["staged"] == ((slots, 7168), torch.bfloat16)
    assert staged["pair_rows"] == ((slots * 8,), torch.int32)
    assert set(SmallBatchDispatch().buffer_shapes(group)) == {*staged, "ids"}
    partial = choose_combine(partial_sums=True)
    assert isinstance(partial, PartialSumCombine) and partial.writes_pair_weights
    assert set(partial.buffer_shapes(group)) == {"pair_rows", "pair_weights", "partials"}
    exact = choose_combine(partial_sums=False)
    assert isinstance(exact, ExactCombine) and not exact.writes_pair_weights
