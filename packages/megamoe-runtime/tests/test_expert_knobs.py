import pytest
import torch
from megamoe_kernels import candidate_knobs, knob_problems
from megamoe_kernels.shim.knobs import default_stages, max_stages
from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.experts import cutedsl
from megamoe_runtime.experts.cutedsl import CuteDSLExperts
from megamoe_runtime.tuning import KnobCache, KnobKey, expert_knobs
from megamoe_runtime.tuning.cache import shipped_knob_cache
from megamoe_runtime.tuning.expert_knobs import (
    cache_fields,
    gemm_candidates,
    gemm_key,
    knobs_from_cache,
    tune_gemm,
)

# a batch of 64 rows over 2 experts and its down GEMM's (N, K)
DOWN_DIMS = (256, 128)


def small_batch(capacity=64, typical_rows=None):
    return ExpertBatch(
        rows_MH=torch.randn(capacity, 256),
        expert_offsets=torch.tensor([0, 30, 64], dtype=torch.int32),
        typical_rows=typical_rows,
    )


def down_key(batch):
    """The knob-cache key of the batch's down GEMM, for its capacity."""
    return gemm_key(
        "down",
        device=batch.rows_MH.device,
        dtype=batch.rows_MH.dtype,
        weight_dims=DOWN_DIMS,
        capacity=batch.capacity,
        num_experts=batch.num_experts,
    )


def test_candidates_are_valid_and_cover_both_orientations():
    for op in ("gate_up", "down"):
        candidates = candidate_knobs(op)
        assert candidates and all(not knob_problems(knobs, op) for knobs in candidates)
        assert {knobs.swap_ab for knobs in candidates} == {True, False}
        assert {knobs.pingpong for knobs in candidates} == {True, False}
        assert {knobs.cluster for knobs in candidates} == {(1, 1), (2, 1)}
        assert len(set(candidates)) == len(candidates)


def test_the_max_ring_choice_is_the_deepest_ring_of_every_shape():
    def shape(knobs):
        return (
            knobs.tile_rows,
            knobs.tile_cols,
            knobs.swap_ab,
            knobs.pingpong,
            knobs.cluster,
            knobs.tail_rows,
        )

    for op in ("gate_up", "down"):
        every = candidate_knobs(op)
        max_only = candidate_knobs(op, stage_choices=("max",))
        assert set(max_only) <= set(every)
        assert {shape(knobs) for knobs in max_only} == {shape(knobs) for knobs in every}
        deepest = {}
        for knobs in every:
            deepest[shape(knobs)] = max(deepest.get(shape(knobs), 0), knobs.stages)
        assert all(knobs.stages == deepest[shape(knobs)] for knobs in max_only)


def test_quick_candidates_take_the_profiles_ring_of_every_shape():
    # the deepest ring but for the FP8 decode tiles, whose profile ring holds 64 KiB of weights
    for op in ("gate_up", "down", "gate_up_fp8", "down_fp8"):
        quick = gemm_candidates(op, quick=True)
        assert set(quick) <= set(gemm_candidates(op))
        assert all(knobs.stages == default_stages(knobs, op) for knobs in quick)
        shallower = [knobs for knobs in quick if knobs.stages < max_stages(knobs, op)]
        if op.endswith("_fp8"):
            assert shallower and all(knobs.swap_ab for knobs in shallower)
        else:
            assert not shallower


def test_tuner_stores_the_fastest_and_the_backend_reads_it(tmp_path):
    cache = KnobCache(tmp_path / "knobs.json")
    batch = small_batch()
    key = down_key(batch)
    candidates = candidate_knobs("down")
    fastest = candidates[len(candidates) // 2]
    best, seconds = tune_gemm(
        "down",
        key=key,
        cache=cache,
        candidates=candidates,
        seconds_of=lambda knobs: 1.0 if knobs == fastest else 2.0,
    )
    assert best == fastest and seconds == 1.0
    assert knobs_from_cache(KnobCache(cache.path), key) == fastest
    backend = CuteDSLExperts(knob_cache=KnobCache(cache.path))
    assert backend._cached_knobs("down", batch, DOWN_DIMS) == fastest
    assert backend._cached_knobs("gate_up", batch, (256, 256)) is None  # not tuned: defaults


def test_a_cached_entry_that_became_invalid_is_ignored(tmp_path):
    cache = KnobCache(tmp_path / "knobs.json")
    key = gemm_key(
        "gate_up",
        device=torch.device("cpu"),
        dtype=torch.bfloat16,
        weight_dims=(1536, 2048),
        capacity=128,
        num_experts=128,
    )
    cache.put(
        key,
        {
            "tile_rows": 48,
            "tile_cols": 256,
            "stages": 4,
            "swap_ab": False,
            "cluster": [1, 1],
            "rows_fastest": True,
        },
        microseconds=1.0,
    )
    assert knobs_from_cache(cache, key) is None
    cache.put(key, {"no_such_knob": 1}, microseconds=1.0)
    assert knobs_from_cache(KnobCache(cache.path), key) is None


def test_every_shipped_entry_is_valid_for_its_op():
    entries = shipped_knob_cache().entries()
    assert entries
    for text in entries:
        op, device_name, dtype, n, k, bucket = text.split("|")
        key = KnobKey(op, device_name, dtype, int(n[1:]), int(k[1:]), int(bucket[1:]))
        assert key.text() == text
        assert knobs_from_cache(shipped_knob_cache(), key) is not None, text


def test_the_users_cache_wins_over_the_shipped_entries(tmp_path, monkeypatch):
    batch = small_batch()
    key = down_key(batch)
    shipped, users = KnobCache(tmp_path / "shipped.json"), KnobCache(tmp_path / "users.json")
    shipped_knobs, users_knobs = candidate_knobs("down")[:2]
    shipped.put(key, cache_fields(shipped_knobs), microseconds=2.0)
    monkeypatch.setattr(expert_knobs, "shipped_knob_cache", lambda: shipped)
    assert CuteDSLExperts(knob_cache=users)._cached_knobs("down", batch, DOWN_DIMS) == (
        shipped_knobs
    )
    users.put(key, cache_fields(users_knobs), microseconds=1.0)
    assert CuteDSLExperts(knob_cache=users)._cached_knobs("down", batch, DOWN_DIMS) == (users_knobs)


def test_a_worst_case_capacity_looks_up_the_class_of_its_typical_rows(tmp_path):
    # an expert-parallel receiver: capacity for 2 ranks' worth of rows, typically half valid
    cache = KnobCache(tmp_path / "knobs.json")
    tuned = candidate_knobs("down")[3]
    cache.put(down_key(small_batch()), cache_fields(tuned), microseconds=1.0)
    backend = CuteDSLExperts(knob_cache=cache)
    worst_case = small_batch(capacity=128, typical_rows=64)
    assert backend._cached_knobs("down", worst_case, DOWN_DIMS) == tuned
    assert backend._cached_knobs("down", small_batch(capacity=128), DOWN_DIMS) is None


@pytest.mark.parametrize("typical_rows", [-1, 129])
def test_typical_rows_outside_the_capacity_are_refused(typical_rows):
    with pytest.raises(ValueError, match=f"typical_rows.*capacity=128.*got {typical_rows}"):
        small_batch(capacity=128, typical_rows=typical_rows)


def test_the_backend_runs_explicit_knobs_exactly_and_cached_ones_as_tuned(tmp_path):
    # explicit knobs run alone; a cache entry replaces the default profile's knobs, which
    # keeps the decode tiles for small batches (megamoe_kernels.default_launches)
    cache = KnobCache(tmp_path / "knobs.json")
    batch = small_batch()
    tuned, explicit = candidate_knobs("down")[3:5]
    cache.put(down_key(batch), cache_fields(tuned), microseconds=1.0)
    prepared = cutedsl.CuteDSLWeights(w13=torch.empty(0), w2_EHI=torch.empty(2, *DOWN_DIMS))
    gate_up, down = CuteDSLExperts(knob_cache=cache)._knob_arguments(batch, prepared)
    assert gate_up == {"tuned_knobs": None} and down == {"tuned_knobs": tuned}
    gate_up, down = CuteDSLExperts(down_knobs=explicit, knob_cache=cache)._knob_arguments(
        batch, prepared
    )
    assert down == {"knobs": explicit}


def test_packed_weights_skip_cached_knobs_whose_tiles_their_packets_do_not_serve(tmp_path):
    # a 192-column tile would straddle the 128-row packets: the default profile runs instead
    from megamoe_kernels import pack_weight_tiles

    cache = KnobCache(tmp_path / "knobs.json")
    batch = small_batch()
    for tile_cols, served in ((192, False), (128, True)):
        tuned = next(k for k in candidate_knobs("down") if k.tile_cols == tile_cols)
        cache.put(down_key(batch), cache_fields(tuned), microseconds=1.0)
        w2 = torch.zeros(2, *DOWN_DIMS, dtype=torch.bfloat16)
        packed, _ = pack_weight_tiles(w2, gate_up=False)
        prepared = cutedsl.CuteDSLWeights(w13=torch.empty(0), w2_EHI=packed)
        assert (prepared.hidden_size, prepared.intermediate_size) == DOWN_DIMS
        _, down = CuteDSLExperts(knob_cache=cache, tile_pack=True)._knob_arguments(batch, prepared)
        assert down == {"tuned_knobs": tuned if served else None}
