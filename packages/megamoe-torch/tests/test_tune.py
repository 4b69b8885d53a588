"""The tuner without a GPU: its cold-L2 weight copies (plain arithmetic), and its plumbing with
the kernels and the timer stood in for: the batch is the layer's, each GEMM runs the geometry's
epilogue (gpt-oss-120b's biases and clamped SwiGLU), and the entries it stores are under the
keys the layer's cutedsl backend looks up."""

from __future__ import annotations

from dataclasses import replace

import megamoe_kernels
import megamoe_torch.layer
import pytest
import torch
from megamoe_runtime.experts import ReferenceExperts
from megamoe_runtime.experts.cutedsl import CuteDSLExperts
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_runtime.tuning import KnobCache
from megamoe_runtime.tuning.expert_knobs import gemm_candidates
from megamoe_torch import bench, tune
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


TINY_GPT_OSS = replace(
    GEOMETRIES["gpt-oss-120b"],
    name="test-gpt-oss",
    num_experts=8,
    hidden_size=64,
    intermediate_size=32,
)
GEOMETRY_CASES = {"gpt-oss": TINY_GPT_OSS, "plain": GEOMETRIES["tiny-qwen3"]}
CPU = torch.device("cpu")
TOKENS = 24


def layer_and_its_batch(geometry, monkeypatch):
    """A layer of `geometry` as the tuner builds it, and the batch it hands its expert backend
    in a forward of the tokens the tuner routes."""
    batches = []

    class RecordingExperts(ReferenceExperts):
        def __call__(self, batch, prepared, **options):
            batches.append(batch)
            return super().__call__(batch, prepared, **options)

    monkeypatch.setattr(megamoe_torch.layer, "make_backend", lambda name: RecordingExperts())
    layer = bench.build_layer(geometry, device=CPU, dtype=torch.bfloat16)
    x_TH, _, _ = bench.routed_tokens(layer, TOKENS)
    with torch.no_grad():
        layer(x_TH)
    (batch,) = batches
    return layer, batch


@pytest.mark.parametrize("case", sorted(GEOMETRY_CASES))
def test_tuned_knobs_are_stored_under_the_keys_the_layer_looks_up(case, tmp_path, monkeypatch):
    # tune_point without kernels: stand-in runners and a timer that reads each candidate's
    # time from a table; the entries it stores must be what the layer's backend finds
    geometry = GEOMETRY_CASES[case]
    fastest = {op: gemm_candidates(op, quick=True)[5] for op in ("gate_up", "down")}
    timed = []

    def stand_in_runners(point, **_):
        assert point.prepared.swiglu == geometry.swiglu
        return {op: lambda knobs, op=op: timed.append((op, knobs)) for op in fastest}

    def table_timer(fn, **_):
        fn()
        op, knobs = timed[-1]
        return 1e-6 if knobs == fastest[op] else 2e-6

    monkeypatch.setattr(tune, "gemm_runners", stand_in_runners)
    monkeypatch.setattr(tune, "median_graph_replay_seconds", table_timer)
    cache = KnobCache(tmp_path / "knobs.json")
    results = tune.tune_point(geometry, TOKENS, cache=cache, quick=True, device=CPU)
    assert {result.op: result.knobs for result in results} == fastest

    layer, batch = layer_and_its_batch(geometry, monkeypatch)
    backend = CuteDSLExperts(knob_cache=KnobCache(cache.path))
    prepared = backend.prepare(layer.expert_weight_pack())
    gate_up, down = backend._knob_arguments(batch, prepared)
    assert (gate_up, down) == (
        {"tuned_knobs": fastest["gate_up"]},
        {"tuned_knobs": fastest["down"]},
    )


@pytest.mark.parametrize("case", sorted(GEOMETRY_CASES))
def test_the_runners_run_the_geometrys_epilogue(case, monkeypatch):
    # the kernels stand in by recorders: each GEMM gets the bias and the SwiGLU the layer's do
    geometry = GEOMETRY_CASES[case]
    calls = []

    def recorder(name):
        def kernel(rows, offsets, weight, **options):
            calls.append((name, options))
            return torch.empty(0)

        return kernel

    monkeypatch.setattr(megamoe_kernels, "gate_up_swiglu", recorder("gate_up"))
    monkeypatch.setattr(megamoe_kernels, "down", recorder("down"))
    point = tune.tuning_point(geometry, TOKENS, device=CPU)
    runners = tune.gemm_runners(point, l2_bytes=1 << 20)
    knobs = {op: gemm_candidates(op, quick=True)[0] for op in runners}
    for op, run in runners.items():
        run(knobs[op])
    (_, default_gate_up), (_, gate_up), (_, down) = calls
    assert [name for name, _ in calls] == ["gate_up", "gate_up", "down"]
    prepared = point.prepared
    assert gate_up["knobs"] == knobs["gate_up"] and down["knobs"] == knobs["down"]
    for options in (default_gate_up, gate_up):
        assert options["swiglu"] == geometry.swiglu
        assert options["w13_bias_EB2G"] is prepared.w13_bias_EB2G
    assert down["w2_bias_EH"] is prepared.w2_bias_EH
    has_biases = geometry.expert_bias
    assert (prepared.w13_bias_EB2G is not None) == (prepared.w2_bias_EH is not None) == has_biases
