"""The offline tuner without a GPU: its cold-L2 weight copies (plain arithmetic), what it
stores, with stand-in runners and timings, read back as a layer of the tuned weight dtype
resolves its knobs, and the epilogue its runners give each GEMM (gpt-oss-120b's biases and
clamped SwiGLU), with the kernels stood in for."""

from __future__ import annotations

from dataclasses import replace

import megamoe_kernels
import pytest
import torch
from megamoe_kernels import quantize_weight_blocks
from megamoe_runtime.experts.cutedsl import CuteDSLExperts
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_runtime.tuning.cache import KnobCache
from megamoe_runtime.tuning.expert_knobs import gemm_candidates
from megamoe_runtime.tuning.online import OnlineAutotuner
from megamoe_torch import MegaMoE, MegaMoEConfig, bench, tune
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


# ---- what `megamoe tune` stores, read back as a layer resolves its knobs (no kernels run) -------

GEOMETRY = GEOMETRIES["tiny-qwen3"]
TOKENS = 16


def fastest_of(op: str):
    """The candidate the stand-in timings make fastest: one that is not the default profile's."""
    return gemm_candidates(op, quick=True)[-2]


def stand_in_runners(problem):
    """Runners that compute nothing and report which op and knobs they were called with."""
    return {op: (lambda knobs, op=op: (op, knobs)) for op in problem.keys}


def stand_in_timer(call):
    op, knobs = call()
    return 1e-6 if knobs == fastest_of(op) else 2e-6


def tuned_cache(tmp_path, monkeypatch, weight_dtype):
    monkeypatch.setattr(tune, "gemm_runners", stand_in_runners)
    cache = KnobCache(tmp_path / "knobs.json")
    results = tune.tune_point(
        GEOMETRY,
        TOKENS,
        cache=cache,
        weight_dtype=weight_dtype,
        quick=True,
        device=torch.device("cpu"),
        timer=stand_in_timer,
    )
    return KnobCache(cache.path), results  # read back from the file


def a_layers_batch_and_weights(weight_dtype, *, knob_cache):
    """What a layer of the tuned geometry hands its cutedsl backend at a forward of TOKENS
    tokens (other tokens than the tuner's, from the layer's own dispatcher)."""
    torch.manual_seed(3)
    config = MegaMoEConfig.from_geometry(GEOMETRY, weight_dtype=weight_dtype, knobs="auto")
    layer = MegaMoE(config, dtype=torch.bfloat16)
    x_TH, ids, weights = bench.routed_tokens(layer, TOKENS, seed=7)
    batch, _ = layer.dispatcher.dispatch(x_TH, ids, weights)
    backend = CuteDSLExperts(knob_cache=knob_cache)
    return backend, batch, backend.prepare(layer.expert_weight_pack())


def never_timed(trial):
    raise AssertionError(f"the online autotuner timed {trial.op}: the cache lacked its class")


@pytest.mark.parametrize(
    ("weight_dtype", "ops"),
    [(None, ("gate_up", "down")), ("fp8", ("gate_up_fp8", "down_fp8"))],
)
def test_a_tuned_cache_is_what_a_layer_of_that_dtype_resolves(
    weight_dtype, ops, tmp_path, monkeypatch
):
    cache, results = tuned_cache(tmp_path, monkeypatch, weight_dtype)
    assert [result.op for result in results] == list(ops)
    for result in results:
        assert result.knobs == fastest_of(result.op)
        assert result.candidates == len(gemm_candidates(result.op, quick=True))
        assert (result.microseconds, result.default_microseconds) == (1.0, 2.0)
    dtype = "float8_e4m3fn" if weight_dtype == "fp8" else "bfloat16"
    stored = {(text.split("|")[0], text.split("|")[2]) for text in cache.entries()}
    assert stored == {(op, dtype) for op in ops}  # keys name (op, GPU, dtype, N, K, rows)

    backend, batch, prepared = a_layers_batch_and_weights(weight_dtype, knob_cache=cache)
    # the launchers' knobs: the tuned ones, in place of the default profile's
    assert backend._knob_arguments(batch, prepared) == tuple(
        {"tuned_knobs": fastest_of(op)} for op in ops
    )
    # knobs="auto": the online autotuner finds both classes and times nothing
    OnlineAutotuner(seconds_of=never_timed).ensure_tuned(backend, batch, prepared)


def test_fp8_entries_are_not_the_bf16_layers(tmp_path, monkeypatch):
    cache, _ = tuned_cache(tmp_path, monkeypatch, "fp8")
    backend, batch, prepared = a_layers_batch_and_weights(None, knob_cache=cache)
    assert backend._knob_arguments(batch, prepared) == ({"tuned_knobs": None},) * 2


def test_fp8_weight_copies_carry_their_block_scales():
    w_ENK, scales = quantize_weight_blocks(torch.randn(4, 256, 128))
    copies = tune._cycled_copies((w_ENK, scales), experts_with_rows=1, l2_bytes=L2)
    cycle = [next(copies) for _ in range(8)]
    distinct = {pair[0].data_ptr(): pair for pair in cycle}
    assert len(distinct) > 1  # one expert's weights are far smaller than the L2
    for copy_ENK, copy_scales in distinct.values():
        assert torch.equal(copy_ENK.view(torch.uint8), w_ENK.view(torch.uint8))
        assert torch.equal(copy_scales, scales)
        # each copy of the weight reads scales of its own: the original's, or a clone
        is_original = copy_ENK.data_ptr() == w_ENK.data_ptr()
        assert (copy_scales.data_ptr() == scales.data_ptr()) == is_original


TINY_GPT_OSS = replace(
    GEOMETRIES["gpt-oss-120b"],
    name="test-gpt-oss",
    num_experts=8,
    hidden_size=64,
    intermediate_size=32,
)


@pytest.mark.parametrize("geometry", [TINY_GPT_OSS, GEOMETRY], ids=lambda g: g.name)
def test_the_runners_run_the_geometrys_epilogue(geometry, monkeypatch):
    # the kernels stood in for by recorders: each GEMM gets the bias and the SwiGLU the layer's do
    calls = []

    def recorder(name):
        def kernel(rows, offsets, weight, **options):
            calls.append((name, options))
            return torch.empty(0)

        return kernel

    monkeypatch.setattr(megamoe_kernels, "gate_up_swiglu", recorder("gate_up"))
    monkeypatch.setattr(megamoe_kernels, "down", recorder("down"))
    problem = tune.tuning_problem(geometry, TOKENS, device=torch.device("cpu"))
    runners = tune.gemm_runners(problem, l2_bytes=L2)
    knobs = {op: gemm_candidates(op, quick=True)[0] for op in runners}
    for op, run in runners.items():
        run(knobs[op])
    assert [name for name, _ in calls] == ["gate_up", "gate_up", "down"]
    (_, default_gate_up), (_, gate_up), (_, down) = calls
    prepared = problem.prepared
    assert gate_up["knobs"] == knobs["gate_up"] and down["knobs"] == knobs["down"]
    for options in (default_gate_up, gate_up):
        assert options["swiglu"] == geometry.swiglu
        assert options["w13_bias_EB2G"] is prepared.w13_bias_EB2G
    assert down["w2_bias_EH"] is prepared.w2_bias_EH
    has_biases = geometry.expert_bias
    assert (prepared.w13_bias_EB2G is not None) == (prepared.w2_bias_EH is not None) == has_biases
