"""The gpt-oss-120b benchmark geometry at a tiny size: a layer built from it computes transformers'
gpt-oss MoE block (router bias, softmax over the top-k logits, biases on both expert projections,
SwiGLU clamped at 7 with alpha 1.702 and up + 1), and `megamoe bench` and `megamoe demo` run it on
every backend that runs on the device, grouped_mm and its all-torch layer among them (FP8
experts, which do not compute it, skipped with the reason)."""

from __future__ import annotations

import csv
from dataclasses import replace

import pytest
import torch
from megamoe_kernels.reference import relative_l2_error
from megamoe_runtime import experts
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_torch import bench
from megamoe_torch.cli import main
from test_layer_expert_math import grouped_mm_runs_on_cpu

# the real geometry's routing and expert math, at a size a CPU runs in a blink
TINY_GPT_OSS = replace(
    GEOMETRIES["gpt-oss-120b"],
    name="test-gpt-oss",
    num_experts=8,
    hidden_size=64,
    intermediate_size=32,
)
CPU = torch.device("cpu")


@pytest.fixture
def tiny_gpt_oss_geometry(monkeypatch):
    """TINY_GPT_OSS among the geometries the command line offers."""
    monkeypatch.setitem(GEOMETRIES, TINY_GPT_OSS.name, TINY_GPT_OSS)
    return TINY_GPT_OSS


@torch.no_grad()
def test_a_layer_of_the_geometry_computes_transformers_gpt_oss_block():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    geometry = TINY_GPT_OSS
    config = transformers.GptOssConfig(
        num_hidden_layers=1,
        hidden_size=geometry.hidden_size,
        intermediate_size=geometry.intermediate_size,
        num_local_experts=geometry.num_experts,
        num_experts_per_tok=geometry.top_k,
    )
    torch.manual_seed(0)
    block = GptOssMLP(config).eval()
    block.experts.config._experts_implementation = "eager"  # the loop over experts: the oracle
    for tensor in block.parameters():
        tensor.normal_(std=0.3)
    # large tokens: the clamp at 7 cuts gate and up values of most experts
    x_BTH = 3.0 * torch.randn(1, 40, geometry.hidden_size)

    layer = bench.build_layer(geometry, device=CPU, dtype=torch.float32)
    assert layer.backend == "reference"
    # transformers holds the experts [E, H, 2I] with gate and up columns interleaved,
    # megamoe [E, 2I, H] gate rows then up rows
    gate_up, gate_up_bias = block.experts.gate_up_proj, block.experts.gate_up_proj_bias
    layer.load_state_dict(
        {
            "gate.weight": block.router.weight,
            "gate.bias": block.router.bias,
            "w13": torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2),
            "w13_bias": torch.cat([gate_up_bias[:, ::2], gate_up_bias[:, 1::2]], dim=-1),
            "w2": block.experts.down_proj.transpose(1, 2),
            "w2_bias": block.experts.down_proj_bias,
        }
    )
    expected_BTH, _ = block(x_BTH)
    assert relative_l2_error(layer(x_BTH), expected_BTH) < 1e-5

    gate_up_ETI2 = torch.einsum("th,ehj->etj", x_BTH[0], gate_up) + gate_up_bias[:, None]
    limit = geometry.swiglu.limit
    assert (gate_up_ETI2 > limit).float().mean() > 0.05  # the clamp is exercised
    assert (gate_up_ETI2.abs() < limit).float().mean() > 0.5


def test_the_layer_holds_random_router_and_expert_biases():
    layer = bench.build_layer(TINY_GPT_OSS, device=CPU, dtype=torch.bfloat16)
    for bias in (layer.gate.bias, layer.w13_bias, layer.w2_bias):
        assert bias is not None and bias.float().std() > 0
    # an expert's biases are its own
    assert not torch.equal(layer.w13_bias[0], layer.w13_bias[1])


def test_the_backends_are_chosen_for_the_device_not_for_the_expert_math():
    layer = bench.build_layer(TINY_GPT_OSS, device=CPU, dtype=torch.bfloat16)
    runnable, refused = bench.layer_backends(layer, ["grouped_mm", "reference"])
    assert runnable == ["reference"]
    assert "needs a CUDA device" in refused["grouped_mm"]
    assert "expert_bias" not in refused["grouped_mm"]


@pytest.mark.skipif(not grouped_mm_runs_on_cpu(), reason="this torch has no CPU torch._grouped_mm")
def test_bench_times_grouped_mm_and_the_all_torch_layer_at_the_geometry(
    tiny_gpt_oss_geometry, monkeypatch, tmp_path, capsys
):
    # grouped_mm as it is on an H200: this CPU's torch._grouped_mm computes it
    monkeypatch.setattr(experts, "grouped_mm_status", lambda device: (True, "an sm_90 GPU"))
    argv = ["bench", "--device", "cpu", "--geometry", tiny_gpt_oss_geometry.name, "--tokens", "5"]
    argv += ["--backends", "grouped_mm", "reference", "--modes", "kernels", "layer"]
    assert main([*argv, "--repeats", "1", "--out", str(tmp_path)]) == 0
    assert "skipped" not in capsys.readouterr().out
    with (tmp_path / "bench.csv").open() as handle:
        kernels_rows = {row["backend"]: row for row in csv.DictReader(handle)}
    with (tmp_path / "layer.csv").open() as handle:
        layer_rows = {row["backend"]: row for row in csv.DictReader(handle)}
    assert set(kernels_rows) == set(layer_rows) == {"grouped_mm", "reference"}
    for row in kernels_rows.values():
        # against the fp32 oracle of the same expert math: bf16 rounding only
        assert float(row["rel_l2"]) < 1e-2
        assert row["speedup"] != ""  # against grouped_mm, measured in the same run
    # the all-torch layer (grouped_mm on the torch path) is the layer mode's baseline
    assert layer_rows["grouped_mm"]["layer_path"] == "torch"
    assert float(layer_rows["reference"]["baseline_eager_microseconds"]) > 0
    assert layer_rows["reference"]["speedup"] != ""


def test_bench_with_fp8_experts_skips_the_geometry_with_the_reason(
    tiny_gpt_oss_geometry, tmp_path, capsys
):
    argv = ["bench", "--device", "cpu", "--geometry", tiny_gpt_oss_geometry.name, "--tokens", "2"]
    argv += ["--weight-dtype", "fp8", "--repeats", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"skipped {tiny_gpt_oss_geometry.name} fp8: weight_dtype='fp8' does not combine" in out


def test_demo_checks_the_bf16_layer_and_says_why_there_are_no_fp8_experts(
    tiny_gpt_oss_geometry, capsys
):
    argv = ["demo", "--device", "cpu", "--geometry", tiny_gpt_oss_geometry.name]
    assert main([*argv, "--tokens", "6", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "rel-L2 vs fp32 oracle" in out
    assert "fp8 experts: not built: weight_dtype='fp8' does not combine with expert_bias" in out
