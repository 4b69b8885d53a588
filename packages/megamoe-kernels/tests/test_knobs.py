"""Knob validity, fail-closed overrides and the default profile (no GPU, no CuTe DSL)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from megamoe_kernels import (
    GemmKnobs,
    Launch,
    candidate_knobs,
    check_knobs,
    default_knobs,
    default_launches,
    knob_problems,
    resolve_knobs,
)
from megamoe_kernels.shim.knobs import (
    DECODE_MAX_ROWS_PER_EXPERT,
    FP8_DECODE_MAX_ROWS_PER_EXPERT,
    FP8_NARROW_PREFILL_MAX_ROWS_PER_EXPERT,
    FP8_OPS,
    OPS,
    PROFILE_ROWS_PER_EXPERT,
    SMALL_BATCH_ROWS_PER_EXPERT,
    default_stages,
    epilogue_smem_bytes,
    intermediate_group,
    max_stages,
    polling_launches,
    stage_smem_bytes,
    staged_scale_k_tiles,
)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("rows_per_expert", [0, 0.5, *PROFILE_ROWS_PER_EXPERT, 10_000])
def test_default_profile_is_always_valid(op, rows_per_expert):
    knobs = default_knobs(op, rows_per_expert)
    assert knob_problems(knobs, op) == []
    decode_max = FP8_DECODE_MAX_ROWS_PER_EXPERT if op in FP8_OPS else DECODE_MAX_ROWS_PER_EXPERT
    assert knobs.swap_ab == (rows_per_expert <= decode_max)


@pytest.mark.parametrize(
    "knobs, reason",
    [
        (GemmKnobs(tile_rows=96), "tile_rows=96"),
        (GemmKnobs(tile_rows=16), "tile_rows=16 without swap_ab"),
        (GemmKnobs(tile_cols=256, swap_ab=True, tile_rows=16), "tile_cols=256 with swap_ab"),
        (GemmKnobs(stages=1), "stages=1"),
        (GemmKnobs(stages=9), "stages=9"),
        (GemmKnobs(cluster=(1, 2)), "cluster=(1, 2): accepted"),
        (
            GemmKnobs(cluster=(2, 1), swap_ab=True, tile_rows=32, tile_cols=128),
            "cluster=(2, 1) with swap_ab",
        ),
        (GemmKnobs(pingpong=True), "pingpong with a 128x256 tile"),
        (
            GemmKnobs(pingpong=True, swap_ab=True, tile_rows=32, tile_cols=128),
            "pingpong with swap_ab",
        ),
        (GemmKnobs(split_k=3, swap_ab=True, tile_rows=16, tile_cols=128), "split_k=3: accepted"),
        (GemmKnobs(split_k=2), "split_k=2 without swap_ab"),
        (GemmKnobs(tail_rows=8, stages=3), "tail_rows=8: accepted"),
        (
            GemmKnobs(tail_rows=16, swap_ab=True, tile_rows=32, tile_cols=128),
            "tail_rows=16: bf16 prefill tiles only",
        ),
        (GemmKnobs(tail_rows=16, tile_rows=64, pingpong=True), "tail_rows=16: bf16 prefill"),
        (GemmKnobs(tail_rows=16, tile_cols=192, stages=3), "tail_rows=16 with a 128x192 tile"),
    ],
)
def test_invalid_combination_says_why_and_fails_closed(knobs, reason):
    assert any(reason in problem for problem in knob_problems(knobs, "gate_up"))
    with pytest.raises(ValueError, match=reason.split("=")[0]):
        check_knobs(knobs, "gate_up")
    with pytest.raises(ValueError):
        resolve_knobs("gate_up", 1000, knobs)


def test_unknown_op_is_refused():
    assert knob_problems(GemmKnobs(), "up") == [f"op must be one of {OPS}, got 'up'"]


def test_override_wins_when_valid():
    knobs = GemmKnobs(tile_rows=64, tile_cols=128, stages=3)
    assert resolve_knobs("down", 1, knobs) is knobs


def test_pingpong_stages_count_both_epilogue_buffers():
    cooperative = GemmKnobs(tile_rows=128, tile_cols=128, stages=2)
    pingpong = GemmKnobs(tile_rows=128, tile_cols=128, stages=2, pingpong=True)
    assert epilogue_smem_bytes(pingpong, "down") == 2 * epilogue_smem_bytes(cooperative, "down")
    assert max_stages(pingpong, "down") < max_stages(cooperative, "down")
    assert knob_problems(replace(pingpong, stages=max_stages(pingpong, "down")), "down") == []
    assert knob_problems(replace(pingpong, stages=max_stages(cooperative, "down")), "down")


def test_tail_rows_take_their_stage_and_staging_bytes_and_only_bf16_prefill_tiles():
    plain = GemmKnobs(tile_rows=128, tile_cols=256, stages=3)
    tailed = replace(plain, tail_rows=16)
    assert stage_smem_bytes(tailed) == stage_smem_bytes(plain) + 16 * 128
    assert epilogue_smem_bytes(tailed, "down") * 128 == epilogue_smem_bytes(plain, "down") * 144
    assert knob_problems(tailed, "gate_up") == knob_problems(tailed, "down") == []
    assert max_stages(tailed, "gate_up") == 3
    assert any("bf16 prefill tiles only" in p for p in knob_problems(tailed, "gate_up_fp8"))
    tuned = [knobs for knobs in candidate_knobs("down") if knobs.tail_rows]
    assert tuned and all(not knobs.swap_ab and not knobs.pingpong for knobs in tuned)
    assert not [knobs for knobs in candidate_knobs("down_fp8") if knobs.tail_rows]


H200_SMS = 132
# (N, K) per expert: qwen3-30b-a3b's gate-up and down, dsv3's
QWEN3 = {"gate_up": (1536, 2048), "down": (2048, 768)}
DSV3 = {"gate_up": (4096, 7168), "down": (7168, 2048)}


def launches(op, capacity, experts, dims):
    dims_of_op = dims[op.removesuffix("_fp8")]
    return default_launches(op, capacity, experts, weight_dims=dims_of_op, sms=H200_SMS)


@pytest.mark.parametrize(
    "rows_per_expert, tile_rows, tile_cols", [(0, 16, 64), (1, 16, 64), (5, 16, 64), (8, 32, 128)]
)
def test_decode_tiles_narrow_with_the_row_tile(rows_per_expert, tile_rows, tile_cols):
    # a 16-row tile is bound by its weight stream: 64 columns put twice the CTAs on it
    for op in ("gate_up", "down"):
        knobs = default_knobs(op, rows_per_expert)
        assert (knobs.tile_rows, knobs.tile_cols) == (tile_rows, tile_cols)


@pytest.mark.parametrize("rows_per_expert", [0, 0.25, 1, 1.5, 2, 8, 10, 11, 16, 17, 32])
def test_fp8_decode_tiles_end_at_sixteen_rows_per_expert(rows_per_expert):
    # up to 16 rows per expert the decode tile of 1.5x the mean rows (no margin), 64 columns
    # with 16 rows but for gate-up (128 columns: whole quantization groups); above, the narrow
    # prefill tile
    down = default_knobs("down_fp8", rows_per_expert)
    gate_up = default_knobs("gate_up_fp8", rows_per_expert)
    if rows_per_expert <= FP8_DECODE_MAX_ROWS_PER_EXPERT:
        tile_rows = 16 if 1.5 * rows_per_expert <= 16 else 32
        assert (down.swap_ab, down.tile_rows) == (True, tile_rows)
        assert down.tile_cols == (64 if tile_rows == 16 else 128)
        assert (gate_up.swap_ab, gate_up.tile_rows, gate_up.tile_cols) == (True, tile_rows, 128)
    else:
        for knobs in (down, gate_up):
            assert (knobs.swap_ab, knobs.tile_rows, knobs.tile_cols) == (False, 64, 256)


@pytest.mark.parametrize("rows_per_expert", [0.0625, 1, 16, 512])
def test_only_fp8_decode_rings_stop_short_of_the_deepest(rows_per_expert):
    # FP8 decode tiles: 64 KiB of weight tiles in the ring (4 stages of 128 columns, 8 of 64);
    # every other tile the deepest ring that fits
    for op in OPS:
        knobs = default_knobs(op, rows_per_expert)
        if knobs.swap_ab and op in FP8_OPS:
            assert knobs.stages == 64 * 1024 // (knobs.tile_cols * 128) < max_stages(knobs, op)
        else:
            assert knobs.stages == max_stages(knobs, op)
        assert knobs.stages == default_stages(knobs, op)
        assert knob_problems(knobs, op) == []
    wide = replace(default_knobs("down_fp8", 1), tile_cols=128)
    assert default_stages(wide, "down_fp8") == 4


@pytest.mark.parametrize("rows_per_expert", [1, 16])
@pytest.mark.parametrize("op", FP8_OPS)
def test_fp8_decode_rings_deepen_where_k_is_short(op, rows_per_expert):
    # up to 16 K tiles with more tiles than SMs: the deepest ring beside which the tile's
    # scales still stage (at the finest x group); one wave of more than half the SMs' tiles
    # (or K unknown): 64 KiB of weight tiles
    knobs = default_knobs(op, rows_per_expert)
    short = 16 * 128
    deep = default_stages(knobs, op, k=short, tiles_per_sm=1.5)
    assert default_stages(knobs, op, k=short) == default_stages(knobs, op) == knobs.stages
    assert knobs.stages < deep <= max_stages(knobs, op)
    for x_group in (64, 128):
        assert staged_scale_k_tiles(replace(knobs, stages=deep), op, k=short, x_group=x_group)
    if deep < max_stages(knobs, op):
        one_more = replace(knobs, stages=deep + 1)
        assert not staged_scale_k_tiles(one_more, op, k=short, x_group=64)
    # the default launches deepen it where K is short and the tiles outnumber the SMs (qwen3:
    # 128 experts, K of 16 and 6 K tiles)
    (launch,) = launches(op, int(rows_per_expert * 128), 128, QWEN3)
    assert launch.knobs.stages == deep
    # one qwen3 token: 8 rows, 96 gate-up and 128 down tiles of 128 columns, one wave
    (one_wave,) = launches(op, 8, 128, QWEN3)
    ring = 64 * 1024 // (one_wave.knobs.tile_cols * 128)
    assert one_wave.knobs.stages == default_stages(one_wave.knobs, op) == ring


@pytest.mark.parametrize("op", FP8_OPS)
def test_fp8_decode_rings_hold_96_kib_on_long_k_or_few_tiles(op):
    # K past 16 K tiles, or short K with at most half a tile per SM: 96 KiB of weight tiles
    # (6 stages of 128 columns, 12 of 64), scales staged beside them
    knobs = default_knobs(op, 1)
    long_ring = 96 * 1024 // (knobs.tile_cols * 128)
    for k, tiles_per_sm in ((16 * 128 + 1, 0.9), (14336, 2.0), (16 * 128, 0.5)):
        stages = default_stages(knobs, op, k=k, tiles_per_sm=tiles_per_sm)
        assert stages == long_ring > knobs.stages
        assert staged_scale_k_tiles(replace(knobs, stages=stages), op, k=k, x_group=64)
    assert default_stages(knobs, op, k=16 * 128, tiles_per_sm=0.51) == knobs.stages
    # mixtral-8x7b at 8 tokens (K of 32 and 112 K tiles)
    mixtral = {"gate_up": (28672, 4096), "down": (4096, 14336)}
    (long_k,) = launches(op, 8 * 2, 8, mixtral)
    assert long_k.knobs.stages == 96 * 1024 // (long_k.knobs.tile_cols * 128)
    # one dsv3-ep8-local token: one expert; the gate-up's K of 56 K tiles in 4 slices (96 KiB);
    # the down's 112 tiles of 64 columns on a K of 16 K tiles, more than half a tile per SM
    # (64 KiB)
    (one_token,) = launches(op, 1, 32, DSV3)
    ring = 96 if op == "gate_up_fp8" else 64
    assert one_token.knobs.stages == ring * 1024 // (one_token.knobs.tile_cols * 128)


def test_fp8_decode_rings_stay_shallower_where_the_scales_would_not_stage():
    # a 32 x 128 down tile on a K so long that 96 KiB of weight tiles leave its scales no room:
    # the deepest ring that still stages them
    knobs = default_knobs("down_fp8", 16)
    assert (knobs.tile_rows, knobs.tile_cols) == (32, 128)
    k = 420 * 128
    stages = default_stages(knobs, "down_fp8", k=k, tiles_per_sm=0.5)
    assert 2 <= stages < 96 * 1024 // (knobs.tile_cols * 128)
    assert staged_scale_k_tiles(replace(knobs, stages=stages), "down_fp8", k=k, x_group=64)
    one_more = replace(knobs, stages=stages + 1)
    assert not staged_scale_k_tiles(one_more, "down_fp8", k=k, x_group=64)


@pytest.mark.parametrize(
    "op, k, x_group",
    [
        # gate-up: K = H, the dispatch's 128-column groups (qwen3, mixtral, dsv3)
        ("gate_up_fp8", 2048, 128),
        ("gate_up_fp8", 4096, 128),
        ("gate_up_fp8", 7168, 128),
        # down: K = I, the decode gate-up's 64-column groups (qwen3, dsv3, mixtral)
        ("down_fp8", 768, 64),
        ("down_fp8", 2048, 64),
        ("down_fp8", 14336, 64),
    ],
)
def test_fp8_decode_tiles_stage_every_k_tiles_scales_where_they_fit(op, k, x_group):
    # the profile's FP8 decode tile, at the profile's ring and at the deepest: all of
    # ceil(K / 128) K tiles (qwen3's down: 6; mixtral's: 112)
    knobs = default_knobs(op, 1)
    assert knobs.swap_ab
    for stages in (knobs.stages, max_stages(knobs, op)):
        staged = replace(knobs, stages=stages)
        assert staged_scale_k_tiles(staged, op, k=k, x_group=x_group) == -(-k // 128)
    # bf16 and the FP8 prefill tiles load their scales otherwise (bf16 has none)
    bf16 = op.removesuffix("_fp8")
    assert staged_scale_k_tiles(default_knobs(bf16, 1), bf16, k=k, x_group=x_group) == 0
    assert staged_scale_k_tiles(default_knobs(op, 512), op, k=k, x_group=x_group) == 0


def test_fp8_decode_scales_that_do_not_fit_beside_the_ring_are_not_staged():
    # a 128 x 128 decode tile at its deepest ring leaves about 6 KB: 112 K tiles of 128 rows'
    # scales in 64-column groups (115 KB) do not fit, 6 K tiles of 16-row tiles do
    tile = GemmKnobs(tile_rows=128, tile_cols=128, swap_ab=True)
    deepest = replace(tile, stages=max_stages(tile, "down_fp8"))
    assert staged_scale_k_tiles(deepest, "down_fp8", k=14336, x_group=64) == 0
    shallow = replace(tile, stages=2)
    assert staged_scale_k_tiles(shallow, "down_fp8", k=768, x_group=64) == 6


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("capacity, experts", [(2, 32), (8 * 128, 128), (60, 8), (32 * 8, 8)])
def test_a_capacity_of_few_rows_launches_one_kernel_for_every_batch(op, capacity, experts):
    # up to 32 rows per expert (decode tiles, or FP8's narrow prefill tiles above 1): one
    # launch, whose tiles serve any batch the capacity holds
    (launch,) = launches(op, capacity, experts, DSV3)
    assert (launch.min_valid_rows, launch.max_valid_rows) == (0, None)
    profile = default_knobs(op, capacity / experts)
    # a decode down GEMM may take wider columns, an FP8 decode gate-up split K (the tests
    # below); nothing else changes
    unchanged = replace(
        launch.knobs, tile_cols=profile.tile_cols, stages=profile.stages, split_k=profile.split_k
    )
    assert unchanged == profile


def test_the_fp8_decode_down_takes_128_columns_past_one_wave():
    # qwen3, one token: 8 experts with rows, 256 CTAs of 64 columns (two waves): FP8 widens,
    # bf16 keeps the profile (neither fits beside the gate-up)
    (fp8,) = launches("down_fp8", 8, 128, QWEN3)
    assert (fp8.knobs.tile_rows, fp8.knobs.tile_cols) == (16, 128)
    assert fp8.knobs.stages == default_stages(fp8.knobs, "down_fp8")
    assert knob_problems(fp8.knobs, "down_fp8") == []
    (bf16,) = launches("down", 8, 128, QWEN3)
    assert bf16.knobs == default_knobs("down", 8 / 128)
    # mixtral-8x7b, one token: 2 experts with rows, 128 CTAs of 64 columns fit in one wave
    # (their ring: 96 KiB on a K of 112 K tiles)
    (fp8,) = launches("down_fp8", 2, 8, {"down": (4096, 14336)})
    assert fp8.knobs == replace(default_knobs("down_fp8", 2 / 8), stages=12)


@pytest.mark.parametrize(
    "tokens, experts, dims, split",
    [(1, 32, DSV3, 4), (2, 32, DSV3, 2), (4, 32, DSV3, 1), (8, 128, QWEN3, 1), (256, 256, DSV3, 1)],
)
def test_the_fp8_decode_gate_up_splits_k_over_the_sms_its_tiles_leave_idle(
    tokens, experts, dims, split
):
    # dsv3 on an 8-way expert-parallel rank, one token: one expert with rows, 32 tiles of 128
    # columns: 4 slices each fill 128 of the 132 SMs. qwen3, one token: 96 tiles, none fits
    (fp8,) = launches("gate_up_fp8", tokens, experts, dims)
    assert fp8.knobs.split_k == split
    assert knob_problems(fp8.knobs, "gate_up_fp8") == []
    profile = default_knobs("gate_up_fp8", tokens / experts)
    # the ring depends on K and the tiles (test_fp8_decode_rings_deepen_where_k_is_short)
    assert replace(fp8.knobs, split_k=1, stages=profile.stages) == profile
    # bf16 keeps K whole, and so does the FP8 down GEMM
    (bf16,) = launches("gate_up", tokens, experts, dims)
    (down,) = launches("down_fp8", tokens, experts, dims)
    assert bf16.knobs.split_k == down.knobs.split_k == 1


def test_the_decode_down_widens_its_tiles_to_fit_beside_its_gate_up():
    # dsv3 on an 8-way expert-parallel rank, one token: one expert with rows. Gate-up takes 64
    # CTAs (4096 / 64); down 112 at 64 columns (176 in all: more than the SMs), 56 at 128 (120)
    (gate_up,) = launches("gate_up", 1, 32, DSV3)
    (down,) = launches("down", 1, 32, DSV3)
    assert gate_up.knobs == default_knobs("gate_up", 1 / 32)
    assert (down.knobs.tile_rows, down.knobs.tile_cols) == (16, 128)
    assert down.knobs.stages == max_stages(down.knobs, "down")
    assert knob_problems(down.knobs, "down") == []
    # two experts with rows need 240 CTAs even so: the profile's tiles stay
    (down,) = launches("down", 2, 32, DSV3)
    assert down.knobs == default_knobs("down", 2 / 32)
    # qwen3, one token (8 experts with rows): neither fits
    (down,) = launches("down", 8, 128, QWEN3)
    assert down.knobs == default_knobs("down", 8 / 128)
    # small weights, where both grids fit with the profile's tiles: nothing to widen
    (down,) = launches("down", 1, 32, {"down": (1024, 256)})
    assert down.knobs == default_knobs("down", 1 / 32)


def test_no_decode_down_prefetches_into_l2_by_default():
    for op, capacity, experts, dims in (
        ("down_fp8", 8, 128, QWEN3),
        ("down_fp8", 1, 32, DSV3),
        ("down", 2, 32, DSV3),
    ):
        (down,) = launches(op, capacity, experts, dims)
        assert down.l2_prefetch_ctas == 0, (op, capacity, experts)


def test_the_decode_down_ctas_beside_the_gate_up_prefetch_the_others_weights(down_l2_prefetch):
    # one qwen3 token with FP8 experts: the gate-up's 96 tiles (8 experts x 12 of 128 columns)
    # leave 36 SMs idle, fewer than the down's 128 tiles (8 x 16): its CTAs there prefetch
    (down,) = launches("down_fp8", 8, 128, QWEN3)
    assert down.knobs.swap_ab and down.l2_prefetch_ctas == H200_SMS - 96
    # one dsv3-ep8-local token: the FP8 gate-up's 32 tiles in 4 K slices leave 4 SMs idle
    (down,) = launches("down_fp8", 1, 32, DSV3)
    assert down.l2_prefetch_ctas == H200_SMS - 128
    # the bf16 down of that token (56 tiles of 128 columns) fits beside its gate-up's 64 CTAs:
    # every CTA starts at once, none prefetches
    (down,) = launches("down", 1, 32, DSV3)
    assert down.l2_prefetch_ctas == 0
    # one qwen3 token in bf16: the gate-up's 192 tiles of 64 columns fill the GPU
    (down,) = launches("down", 8, 128, QWEN3)
    assert down.l2_prefetch_ctas == 0
    # gate-ups and prefill tiles never
    (gate_up,) = launches("gate_up_fp8", 8, 128, QWEN3)
    assert gate_up.l2_prefetch_ctas == 0
    assert all(launch.l2_prefetch_ctas == 0 for launch in launches("down_fp8", 65536, 128, QWEN3))


@pytest.mark.parametrize("op", OPS)
def test_only_decode_gate_ups_poll_for_published_offsets(op):
    # a decode capacity (one launch) and a prefill one (decode tiles for small batches beside
    # the prefill tiles): the gate-up's decode launches poll, its prefill ones and the down's
    # launches wait for the routing kernel to end
    for capacity in (8, 65536):
        planned = launches(op, capacity, 128, QWEN3)
        polling = polling_launches(op, planned)
        assert [launch.polls_offsets for launch in planned] == [False] * len(planned)
        assert [launch.polls_offsets for launch in polling] == [
            op.startswith("gate_up") and launch.knobs.swap_ab for launch in planned
        ]
        assert [replace(launch, polls_offsets=False) for launch in polling] == list(planned)
    # one qwen3 token: the gate-up's one launch, decode tiles, polls
    (one_token,) = polling_launches(op, launches(op, 8, 128, QWEN3))
    assert one_token.polls_offsets == op.startswith("gate_up")


def test_the_fp8_decode_down_counts_the_gate_ups_k_slices():
    # the same token with FP8 experts: the gate-up's 32 tiles split K in 4 slices, 128 CTAs, so
    # neither down grid fits beside it and the down keeps the profile's 112 tiles of 64 columns
    # (counting the gate-up's tiles alone, 32 + 56 fit)
    (gate_up,) = launches("gate_up_fp8", 1, 32, DSV3)
    assert (gate_up.knobs.tile_cols, gate_up.knobs.split_k) == (128, 4)
    (down,) = launches("down_fp8", 1, 32, DSV3)
    assert replace(down.knobs, stages=0) == replace(default_knobs("down_fp8", 1 / 32), stages=0)
    assert down.knobs.tile_cols == 64
    # (the bf16 gate-up keeps K whole on 64 CTAs, and its down widens: the test above)


@pytest.mark.parametrize("op", OPS)
def test_a_prefill_capacity_adds_decode_tiles_for_batches_of_few_rows(op):
    # qwen3 at 8192 tokens: a capacity of 512 rows per expert; a batch of at most 32 rows per
    # expert runs the decode tiles, a larger one the prefill tiles: the ranges tile [0, inf)
    experts = 128
    small, large = launches(op, 512 * experts, experts, QWEN3)
    boundary = SMALL_BATCH_ROWS_PER_EXPERT * experts + 1
    assert small == Launch(default_knobs(op, SMALL_BATCH_ROWS_PER_EXPERT), 0, boundary)
    assert large == Launch(default_knobs(op, 512), boundary, None)
    assert not large.knobs.swap_ab
    # FP8's small batches take its narrow prefill tile (decode tiles stop at 16 rows per expert),
    # bf16's the decode tiles
    if op in FP8_OPS:
        assert (small.knobs.swap_ab, small.knobs.tile_rows) == (False, 64)
    else:
        assert small.knobs.swap_ab


def test_tuned_prefill_knobs_take_the_prefill_range_and_leave_small_batches_to_decode_tiles():
    tuned = GemmKnobs(tile_rows=128, tile_cols=128, stages=5, pingpong=True)
    experts = 128
    small, large = default_launches(
        "gate_up", 512 * experts, experts, weight_dims=QWEN3["gate_up"], sms=H200_SMS, tuned=tuned
    )
    boundary = SMALL_BATCH_ROWS_PER_EXPERT * experts + 1
    assert small == Launch(default_knobs("gate_up", SMALL_BATCH_ROWS_PER_EXPERT), 0, boundary)
    assert large == Launch(tuned, boundary, None)
    # a capacity the decode launch would cover whole: the tuned knobs alone
    assert default_launches(
        "gate_up", 16 * experts, experts, weight_dims=QWEN3["gate_up"], sms=H200_SMS, tuned=tuned
    ) == (Launch(tuned),)


@pytest.mark.parametrize(
    "tuned", [None, GemmKnobs(tile_rows=128, tile_cols=128, stages=5, pingpong=True)]
)
def test_valid_rows_known_on_the_host_launch_one_kernel_without_a_range(tuned):
    # a capacity of 512 rows per expert (qwen3 at 8192 tokens): the launch that the device
    # would pick for the valid rows runs alone, over every row count (a wrong count costs speed)
    experts = 128
    small, large = default_launches(
        "gate_up", 512 * experts, experts, weight_dims=QWEN3["gate_up"], sms=H200_SMS, tuned=tuned
    )
    boundary = SMALL_BATCH_ROWS_PER_EXPERT * experts + 1
    for valid_rows, chosen in [
        (0, small),
        (boundary - 1, small),
        (boundary, large),
        (512 * experts, large),
    ]:
        assert default_launches(
            "gate_up",
            512 * experts,
            experts,
            weight_dims=QWEN3["gate_up"],
            sms=H200_SMS,
            tuned=tuned,
            valid_rows=valid_rows,
        ) == (Launch(chosen.knobs),), valid_rows


def test_tuned_decode_knobs_launch_alone_and_are_not_widened():
    tuned = GemmKnobs(tile_rows=16, tile_cols=64, stages=12, swap_ab=True)
    # dsv3 on an 8-way EP rank at one token, where the profile's down tile would widen
    assert launches("down", 1, 32, DSV3) != (Launch(tuned),)
    assert default_launches("down", 1, 32, weight_dims=DSV3["down"], sms=H200_SMS, tuned=tuned) == (
        Launch(tuned),
    )


def test_invalid_tuned_knobs_fail_closed():
    with pytest.raises(ValueError, match="pingpong with a 128x256 tile"):
        default_launches(
            "down",
            512 * 8,
            8,
            weight_dims=QWEN3["down"],
            sms=H200_SMS,
            tuned=GemmKnobs(pingpong=True),
        )


@pytest.mark.parametrize("op", FP8_OPS)
@pytest.mark.parametrize("rows_per_expert", [1, 16, 32, 64, 128, 512])
def test_fp8_profiles_fit_the_running_sum_and_a_group_s_products_in_registers(op, rows_per_expert):
    knobs = default_knobs(op, rows_per_expert)
    assert knob_problems(knobs, op) == []
    if rows_per_expert > FP8_NARROW_PREFILL_MAX_ROWS_PER_EXPERT:
        assert (knobs.swap_ab, knobs.tile_rows, knobs.tile_cols) == (False, 128, 256)
    elif rows_per_expert > FP8_DECODE_MAX_ROWS_PER_EXPERT:
        assert (knobs.swap_ab, knobs.tile_rows, knobs.tile_cols) == (False, 64, 256)
    if op == "gate_up_fp8":
        # the tile's output columns are whole 64-column quantization groups
        assert knobs.tile_cols % 128 == 0


@pytest.mark.parametrize(
    "op, knobs, reason",
    [
        ("gate_up_fp8", GemmKnobs(tile_rows=128, tile_cols=192), "is a multiple of 128"),
        ("down_fp8", GemmKnobs(tile_rows=64, tile_cols=192), "tile_cols=192 for down_fp8"),
        (
            "gate_up_fp8",
            GemmKnobs(tile_rows=16, tile_cols=64, swap_ab=True),
            "quantization groups",
        ),
        (
            "down_fp8",
            GemmKnobs(tile_rows=128, tile_cols=128, pingpong=True),
            "with pingpong holds 128",
        ),
    ],
)
def test_fp8_tiles_that_do_not_fit_are_refused(op, knobs, reason):
    assert any(reason in problem for problem in knob_problems(knobs, op))


@pytest.mark.parametrize("op", ["gate_up_fp8", "down_fp8"])
@pytest.mark.parametrize(
    "knobs",
    [
        GemmKnobs(tile_rows=128, tile_cols=256, stages=3),
        GemmKnobs(tile_rows=64, tile_cols=256, stages=3),
        GemmKnobs(tile_rows=64, tile_cols=256, stages=3, pingpong=True),
        GemmKnobs(tile_rows=128, tile_cols=256, stages=3, cluster=(2, 1)),
    ],
    ids=str,
)
def test_fp8_tiles_of_two_weight_blocks_are_accepted(op, knobs):
    # their MMAs and promotions run a weight block's 128 columns at a time: 64 products per
    # thread beside a running sum of at most 128
    assert knob_problems(knobs, op) == []


def test_a_stage_holds_128_bytes_of_k_per_row_in_bf16_and_fp8():
    # 64 bf16 or 128 e4m3 values of K per row of x and w: the same stages fit both dtypes
    knobs = GemmKnobs(tile_rows=128, tile_cols=128)
    assert stage_smem_bytes(knobs) == 256 * 128
    assert max_stages(knobs, "down_fp8") == max_stages(knobs, "down")


def test_rows_are_gathered_by_default_where_the_decode_tiles_run_from_two_tokens():
    from megamoe_kernels import gathers_rows_by_default

    def gathers(tokens, *, capacity=None, experts=128, top_k=8):  # qwen3-30b-a3b
        rows = tokens * top_k
        return gathers_rows_by_default(
            tokens=tokens,
            valid_rows=rows,
            capacity=rows if capacity is None else capacity,
            num_experts=experts,
        )

    assert not gathers(1)  # one token: its copy is cheaper than the load before each gather
    assert gathers(16) and gathers(512)  # up to 32 rows per expert: decode tiles of <= 64 rows
    assert not gathers(1024)  # 64 rows per expert: prefill tiles copy
    # gpt-oss-120b and dsv3 at 2048 tokens: 64 rows per expert, prefill tiles
    assert not gathers(2048, experts=128, top_k=4) and not gathers(2048, experts=256, top_k=8)
    assert not gathers(2048) and not gathers(8192)  # prefill tiles
    # a capacity sized for prefill: a few valid rows still run the decode tiles
    assert gathers(16, capacity=65536)
    assert not gathers(1000, capacity=65536)  # 62.5 rows per expert: the prefill tiles run


def test_shared_experts_join_the_batch_where_one_decode_row_tile_holds_every_token():
    from megamoe_kernels import shared_experts_in_batch_by_default

    def joins(tokens, *, capacity=None, experts=256, top_k=8, shared=1, fp8=False):  # dsv3
        rows = tokens * (top_k + shared)
        return shared_experts_in_batch_by_default(
            tokens=tokens,
            valid_rows=rows,
            capacity=rows if capacity is None else capacity,
            num_experts=experts + shared,
            fp8=fp8,
        )

    assert joins(1) and joins(16)  # 16-row decode tiles hold every token
    assert not joins(17)  # the shared rows would take two row tiles
    assert not joins(128) and not joins(2048) and not joins(8192)
    # a capacity sized for prefill: a few valid rows run the 64-row decode tiles
    assert joins(64, capacity=8192 * 9) and not joins(65, capacity=8192 * 9)
    assert not joins(1000, capacity=8192 * 9)  # the prefill tiles run
    # FP8: the prefill tiles take the shared rows too; several decode row tiles still do not
    assert joins(1, fp8=True) and joins(16, fp8=True)
    assert not joins(17, fp8=True) and not joins(128, fp8=True)
    assert joins(2048, fp8=True) and joins(8192, fp8=True)
    assert joins(1000, capacity=8192 * 9, fp8=True)


def test_the_fp8_gate_up_writes_128_column_groups_where_every_launch_runs_256_column_tiles():
    def group(*knobs, intermediate=768):
        return intermediate_group(tuple(Launch(k) for k in knobs), intermediate)

    wide = GemmKnobs(tile_rows=128, tile_cols=256)
    small = GemmKnobs(tile_rows=64, tile_cols=256)
    narrow = GemmKnobs(tile_rows=128, tile_cols=128)
    decode = default_knobs("gate_up_fp8", 1)
    assert decode.swap_ab
    assert group(wide) == group(small, wide) == 128
    # a decode tile (its M side: 128 weight rows, 64 output columns) or a 128-column tile
    # holds 64 output columns, and I must hold whole 128-column groups
    assert group(decode) == group(narrow) == group(decode, wide) == 64
    assert group(wide, intermediate=704) == 64
    # the default profile: decode tiles at one row per expert, 128-column groups above, the
    # launch pair of a prefill capacity included
    one_row = default_launches("gate_up_fp8", 128, 128, weight_dims=(1536, 2048), sms=132)
    prefill = default_launches("gate_up_fp8", 65536, 128, weight_dims=(1536, 2048), sms=132)
    assert len(prefill) == 2
    assert (intermediate_group(one_row, 768), intermediate_group(prefill, 768)) == (64, 128)
