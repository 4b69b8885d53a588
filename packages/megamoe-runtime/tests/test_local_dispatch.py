import pytest
import torch
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.routing import RouterConfig, route


def make_routing(tokens, experts, top_k, hidden=16, generator_seed=0):
    generator = torch.Generator().manual_seed(generator_seed)
    x = torch.randn(tokens, hidden, generator=generator)
    ids, weights = route(
        torch.randn(tokens, experts, generator=generator), RouterConfig(experts, top_k)
    )
    return x, ids, weights


def test_batch_is_expert_major_and_offsets_count_rows():
    x, ids, weights = make_routing(tokens=37, experts=8, top_k=3)
    batch, handle = LocalDispatcher(8).dispatch(x, ids, weights)
    offsets = batch.expert_offsets.tolist()
    assert batch.expert_offsets.dtype == torch.int32 and len(offsets) == 9
    for expert in range(8):
        assert offsets[expert + 1] - offsets[expert] == int((ids == expert).sum())
    # every row holds the token routed there, and rows of one expert keep token order
    for token in range(37):
        for k in range(3):
            row = int(handle.row_of_pair_TK[token, k])
            expert = int(ids[token, k])
            assert offsets[expert] <= row < offsets[expert + 1]
            torch.testing.assert_close(batch.rows_MH[row], x[token])


def test_round_trip_with_identity_experts_gives_weighted_sum():
    x, ids, weights = make_routing(tokens=23, experts=5, top_k=2)
    dispatcher = LocalDispatcher(5)
    batch, handle = dispatcher.dispatch(x, ids, weights)
    y = dispatcher.combine(batch.rows_MH * 3.0, handle)
    torch.testing.assert_close(y, 3.0 * x * weights.sum(-1, keepdim=True))


def test_row_weights_applied_in_epilogue_equals_combine_weighting():
    x, ids, weights = make_routing(tokens=11, experts=4, top_k=2)
    dispatcher = LocalDispatcher(4)
    batch, handle = dispatcher.dispatch(x, ids, weights)
    scaled = batch.rows_MH * dispatcher.row_weights(batch, handle).unsqueeze(-1)
    torch.testing.assert_close(
        dispatcher.combine(scaled, handle, weights_applied=True),
        dispatcher.combine(batch.rows_MH, handle),
    )


def test_only_the_one_gpu_dispatchers_declare_row_weights():
    from megamoe_runtime.dispatch import (
        DeepEPDispatcher,
        RowWeightsDispatcher,
        TorchDistributedDispatcher,
    )
    from megamoe_runtime.dispatch.device_routed import DeviceRoutedDispatcher
    from megamoe_runtime.dispatch.symmetric import SymmetricDispatcher

    assert isinstance(LocalDispatcher(4), RowWeightsDispatcher)
    assert callable(DeviceRoutedDispatcher.row_weights)
    # the expert-parallel ones keep each token's weights on its source rank
    for dispatcher in (TorchDistributedDispatcher, SymmetricDispatcher, DeepEPDispatcher):
        assert not hasattr(dispatcher, "row_weights"), dispatcher


def test_static_capacity_keeps_shape_and_marks_valid_rows():
    x, ids, weights = make_routing(tokens=5, experts=4, top_k=2)
    batch, handle = LocalDispatcher(4, capacity=64).dispatch(x, ids, weights)
    assert batch.capacity == 64
    assert int(batch.num_valid_rows) == 10
    # the host knows them too: the expert GEMMs launch only their kernel for 10 rows
    assert batch.valid_rows == 10
    y = LocalDispatcher(4, capacity=64).combine(batch.rows_MH, handle)
    torch.testing.assert_close(y, x * weights.sum(-1, keepdim=True))


def test_edge_cases_zero_tokens_one_expert_takes_all_and_empty_experts():
    dispatcher = LocalDispatcher(6)
    batch, handle = dispatcher.dispatch(
        torch.randn(0, 8), torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, 2)
    )
    assert batch.capacity == 0 and batch.expert_offsets.tolist() == [0] * 7
    assert dispatcher.combine(batch.rows_MH, handle).shape == (0, 8)

    x = torch.randn(9, 8)
    ids = torch.full((9, 1), 4, dtype=torch.int32)
    batch, handle = dispatcher.dispatch(x, ids, torch.ones(9, 1))
    assert batch.expert_offsets.tolist() == [0, 0, 0, 0, 0, 9, 9]
    torch.testing.assert_close(batch.rows_MH, x)


def test_bad_input_is_refused_with_the_offending_values():
    dispatcher = LocalDispatcher(4, capacity=3)
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="exceed the dispatcher's capacity 3"):
        dispatcher.dispatch(x, torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 2))
    checked = LocalDispatcher(4)
    with pytest.raises(ValueError, match=r"\[0, 4\); found values in \[0, 7\]"):
        checked.dispatch(x, torch.tensor([[0], [7]], dtype=torch.int32), torch.ones(2, 1))
    with pytest.raises(ValueError, match="found values in"):
        checked.dispatch(x, torch.tensor([[-1], [0]], dtype=torch.int32), torch.ones(2, 1))
    with pytest.raises(TypeError, match="int32 or int64"):
        checked.dispatch(x, torch.zeros(2, 1), torch.ones(2, 1))
    with pytest.raises(ValueError, match="topk_weights shape"):
        checked.dispatch(x, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 2))
    with pytest.raises(ValueError, match="2-D"):
        checked.dispatch(x[0], torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1))
    with pytest.raises(TypeError, match="num_experts must be an int, got 4.5"):
        LocalDispatcher(4.5)
    with pytest.raises(TypeError, match="capacity must be an int, got 3.0"):
        LocalDispatcher(4, capacity=3.0)


def test_combine_of_present_pairs_ignores_what_absent_pairs_rows_hold():
    # a rank's share of each token's experts (the DeepEP adapter's local partial sums): the rows
    # of absent pairs hold NaN here and must reach nothing
    from megamoe_runtime.dispatch.local import weighted_sum_over_topk

    x, ids, weights = make_routing(tokens=19, experts=6, top_k=3, generator_seed=5)
    batch, handle = LocalDispatcher(6).dispatch(x, ids, weights)
    present = torch.rand(19, 3, generator=torch.Generator().manual_seed(6)) < 0.6
    out = batch.rows_MH * 2.0 - 1.0
    poisoned = out.clone()
    poisoned[handle.row_of_pair_TK[~present]] = float("nan")
    y = weighted_sum_over_topk(
        poisoned, handle.row_of_pair_TK, weights, output_dtype=x.dtype, pair_present_TK=present
    )
    expected = weighted_sum_over_topk(
        out, handle.row_of_pair_TK, torch.where(present, weights, 0.0), output_dtype=x.dtype
    )
    assert torch.equal(y, expected)
