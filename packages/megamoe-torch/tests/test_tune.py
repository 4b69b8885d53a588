"""The tuner's cold-L2 weight copies (no GPU: the copy count is plain arithmetic)."""

from __future__ import annotations

from megamoe_torch.tune import (
    COLD_L2_FACTOR,
    WEIGHT_COPY_BUDGET_BYTES,
    weight_copies_for_cold_l2,
)

L2 = 50 << 20  # the H200's


def test_weights_larger_than_the_l2_are_not_copied():
    # dsv3 at 2048 tokens: every expert active, gigabytes per call
    assert weight_copies_for_cold_l2(active_bytes=22 << 30, l2_bytes=L2, tensor_bytes=22 << 30) == 1
    assert (
        weight_copies_for_cold_l2(active_bytes=COLD_L2_FACTOR * L2, l2_bytes=L2, tensor_bytes=1)
        == 1
    )


def test_small_active_weights_cycle_until_they_exceed_the_l2():
    # one dsv3 expert's down weights (29.4 MB) of a 32-expert tensor: 4 copies = 117 MB per cycle
    active = 7168 * 2048 * 2
    copies = weight_copies_for_cold_l2(active_bytes=active, l2_bytes=L2, tensor_bytes=32 * active)
    assert copies == 4
    assert copies * active >= COLD_L2_FACTOR * L2 > (copies - 1) * active


def test_copies_stay_within_the_memory_budget():
    tensor = WEIGHT_COPY_BUDGET_BYTES // 2
    assert weight_copies_for_cold_l2(active_bytes=1 << 20, l2_bytes=L2, tensor_bytes=tensor) == 3


def test_a_batch_without_rows_needs_no_copies():
    assert weight_copies_for_cold_l2(active_bytes=0, l2_bytes=L2, tensor_bytes=1 << 30) == 1
