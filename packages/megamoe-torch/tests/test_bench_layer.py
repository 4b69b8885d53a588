"""`megamoe bench`'s layer mode: the whole forward timed eager (and graphed on a GPU), its ops
counted, against the expert GEMMs alone and the grouped_mm layer; through the Python API and the
command line."""

from __future__ import annotations

import csv
import math
from dataclasses import replace

import pytest
import torch
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.experts import backend_status, make_backend
from megamoe_runtime.geometries import Geometry
from megamoe_runtime.measure import write_csv
from megamoe_torch import bench
from megamoe_torch.cli import main

# a DeepSeek-like router (sigmoid, grouped top-k, correction bias) and a shared expert: every
# part of the forward runs
TINY = Geometry(
    "test-tiny",
    num_experts=8,
    top_k=2,
    hidden_size=64,
    intermediate_size=32,
    scoring="sigmoid",
    num_groups=4,
    top_groups=2,
    use_correction_bias=True,
    num_shared_experts=1,
)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_layer():
    return bench.build_layer(TINY, device=CPU, dtype=torch.bfloat16, seed=3)


def test_layer_rows_time_the_forward_and_count_its_ops_on_a_cpu(tiny_layer, tmp_path):
    rows = bench.bench_layer_point(tiny_layer, TINY, 7, backends=["reference"], repeats=2)
    assert [(row.geometry, row.tokens, row.backend) for row in rows] == [
        ("test-tiny", 7, "reference")
    ]
    row = rows[0]
    assert row.eager_microseconds > 0 and row.host_microseconds > 0
    assert row.gemm_microseconds > 0
    # a CPU has neither graphs nor kernels: aten ops are counted instead, and said so
    assert row.graph_microseconds is None
    assert row.ops_counted == "aten ops" and row.gpu_ops > 0 and row.gpu_memory_ops is None
    # and named, in the order they ran
    names = row.launched_ops.split("; ")
    assert len(names) == row.gpu_ops and all(name.startswith("aten::") for name in names)
    assert math.isclose(row.layer_over_gemms, row.eager_microseconds / row.gemm_microseconds)
    # grouped_mm was not in the run: nothing to compare with
    assert row.speedup is None and row.baseline_eager_microseconds is None

    write_csv(rows, tmp_path / "layer.csv")
    with (tmp_path / "layer.csv").open() as handle:
        records = list(csv.DictReader(handle))
    assert len(records) == 1
    assert float(records[0]["eager_microseconds"]) == pytest.approx(row.eager_microseconds)
    assert int(records[0]["gpu_ops"]) == row.gpu_ops
    assert records[0]["graph_microseconds"] == ""


def test_layer_point_reuses_the_kernels_rows_of_its_point():
    routed_only = replace(TINY, name="test-tiny-routed", num_shared_experts=0)
    layer = bench.build_layer(routed_only, device=CPU, dtype=torch.bfloat16, seed=3)
    measured = bench.bench_point(layer, routed_only, 5, backends=["reference"], repeats=2)
    # a sentinel time shows the rows were used, not measured again
    kernels = [replace(measured[0], microseconds=123.0)]
    rows = bench.bench_layer_point(
        layer, routed_only, 5, backends=["reference"], repeats=2, kernel_rows=kernels
    )
    assert rows[0].gemm_microseconds == pytest.approx(123.0)
    # rows of another point are not this point's GEMMs
    other = bench.bench_layer_point(
        layer, routed_only, 6, backends=["reference"], repeats=2, kernel_rows=kernels
    )
    assert other[0].gemm_microseconds != pytest.approx(123.0)


def test_a_layer_with_shared_experts_is_weighed_against_its_gemms_with_them(
    tiny_layer, monkeypatch
):
    measured = bench.bench_point(tiny_layer, TINY, 5, backends=["reference"], repeats=2)
    timed = []

    def sentinel(layer, tokens, *, backend_name, repeats):
        timed.append((tokens, backend_name))
        return 456e-6

    monkeypatch.setattr(bench, "shared_in_batch_seconds", sentinel)
    (row,) = bench.bench_layer_point(
        tiny_layer, TINY, 5, backends=["reference"], repeats=2, kernel_rows=measured
    )
    # the routed experts' kernels rows are not the layer's GEMMs: the batch with the shared
    # expert in it is
    assert timed == [(5, "reference")]
    assert row.gemm_microseconds == pytest.approx(456.0)
    assert math.isclose(row.layer_over_gemms, row.eager_microseconds / 456.0)


def test_shared_experts_that_cannot_join_the_batch_leave_the_routed_gemms(monkeypatch):
    # biased experts: the shared MLP (no biases) cannot be experts of their batch
    biased = replace(TINY, name="test-tiny-biased", expert_bias=True)
    layer = bench.build_layer(biased, device=CPU, dtype=torch.bfloat16, seed=3)
    assert layer.config.shared_experts_in_batch_problems
    measured = bench.bench_point(layer, biased, 5, backends=["reference"], repeats=2)
    kernels = [replace(measured[0], microseconds=123.0)]

    def not_timed(*args, **kwargs):
        raise AssertionError("timed a batch the layer never runs")

    monkeypatch.setattr(bench, "shared_in_batch_seconds", not_timed)
    (row,) = bench.bench_layer_point(
        layer, biased, 5, backends=["reference"], repeats=2, kernel_rows=kernels
    )
    assert row.gemm_microseconds == pytest.approx(123.0)


def test_the_batch_with_the_shared_experts_computes_the_layers_forward(tiny_layer):
    x_TH, batch, handle, pack = bench.shared_in_batch(tiny_layer, 6)
    shared = TINY.num_shared_experts
    offsets = batch.expert_offsets.tolist()
    # every token has a row in the shared expert, after the routed experts
    assert offsets[-1] - offsets[-1 - shared] == 6 * shared
    assert offsets[-1] == 6 * (TINY.top_k + shared)
    backend = make_backend("reference")
    expert_rows = backend(batch, backend.prepare(pack))
    combined = LocalDispatcher(TINY.num_experts + shared).combine(expert_rows, handle)
    tiny_layer.use_backend("reference")
    with torch.no_grad():
        expected = tiny_layer(x_TH)
    torch.testing.assert_close(combined.float(), expected.float(), rtol=2e-2, atol=2e-2)
    assert bench.shared_in_batch_seconds(tiny_layer, 6, backend_name="reference", repeats=2) > 0


def test_the_baseline_backend_compares_with_itself(tiny_layer, monkeypatch):
    monkeypatch.setattr(bench, "BASELINE", "reference")
    (row,) = bench.bench_layer_point(tiny_layer, TINY, 3, backends=["reference"], repeats=2)
    assert row.baseline_eager_microseconds == row.eager_microseconds
    assert row.speedup == pytest.approx(1.0)


def test_fixed_capacity_layer_shares_the_weights_and_computes_the_same(tiny_layer):
    tokens = 9
    fixed = bench.with_capacity(tiny_layer, tokens * TINY.top_k)
    x_TH = torch.randn(tokens, TINY.hidden_size, dtype=torch.bfloat16)
    tiny_layer.use_backend("reference")
    fixed.use_backend("reference")
    with torch.no_grad():
        torch.testing.assert_close(fixed(x_TH), tiny_layer(x_TH), rtol=0, atol=0)
        assert fixed.w13.data_ptr() == tiny_layer.w13.data_ptr()
        tiny_layer.w2.mul_(2)  # a change to the layer's weights is a change to the fixed one's
        torch.testing.assert_close(fixed(x_TH), tiny_layer(x_TH), rtol=0, atol=0)
        tiny_layer.w2.div_(2)


def test_a_layer_prepared_like_another_shares_its_parameters_and_prepared_weights(tiny_layer):
    # one preparation serves both; one that points the parameters at what it made (shared
    # experts in the batch) is then seen by both, not undone by the other's
    first = bench.with_capacity(tiny_layer, 64)
    second = bench.with_capacity(tiny_layer, 64, prepared_like=first, eager_graph_tokens=0)
    assert second._prepared is first._prepared
    for (name, mine), theirs in zip(second.named_parameters(), first.parameters(), strict=True):
        assert mine is theirs, name


def test_op_count_on_a_cpu_is_the_aten_ops_called_from_python():
    a, b = torch.randn(4, 8), torch.randn(3, 8)
    # linear runs transposes and a matmul inside it: one op called, one counted
    assert bench.ops_per_call(lambda: torch.nn.functional.linear(a, b), device=CPU)[0] == 1
    assert bench.ops_per_call(lambda: (a + 1).sum() * 2, device=CPU)[0] == 3
    # named in the order they ran
    assert bench.ops_per_call(lambda: (a + 1).sum() * 2, device=CPU)[3] == [
        "aten::add",
        "aten::sum",
        "aten::mul",
    ]


def test_bench_command_writes_the_layer_table_and_csv(tmp_path, capsys):
    args = ["bench", "--geometry", "tiny-qwen3", "--tokens", "3", "--backends", "reference"]
    args += ["--repeats", "2", "--out", str(tmp_path)]
    assert main([*args, "--modes", "kernels", "layer"]) == 0
    out = capsys.readouterr().out
    assert "eager us" in out and "graph us" in out and "/gemm" in out
    with (tmp_path / "layer.csv").open() as handle:
        (layer_record,) = csv.DictReader(handle)
    with (tmp_path / "bench.csv").open() as handle:
        (kernels_record,) = csv.DictReader(handle)
    assert layer_record["backend"] == "reference" and int(layer_record["tokens"]) == 3
    assert float(layer_record["eager_microseconds"]) > 0
    # the expert GEMMs of the layer row are the kernels row measured in the same run
    assert float(layer_record["gemm_microseconds"]) == pytest.approx(
        float(kernels_record["microseconds"])
    )


def test_bench_command_in_layer_mode_alone_writes_only_the_layer_csv(tmp_path):
    args = ["bench", "--geometry", "tiny-qwen3", "--tokens", "2", "--backends", "reference"]
    assert main([*args, "--modes", "layer", "--repeats", "2", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "layer.csv").exists() and not (tmp_path / "bench.csv").exists()


@pytest.mark.gpu
def test_layer_rows_on_a_gpu_count_kernels_and_time_graph_replays():
    device = torch.device("cuda") if torch.cuda.is_available() else None
    backends = [
        name
        for name in ("cutedsl", "grouped_mm")
        if device is not None and backend_status(name, device)[0]
    ]
    if not backends:
        pytest.skip("neither cutedsl nor grouped_mm can run here")
    geometry = Geometry("test-gpu", 16, 4, 512, 384)
    layer = bench.build_layer(geometry, device=device, dtype=torch.bfloat16)
    rows = bench.bench_layer_point(layer, geometry, 1, backends=backends, repeats=5)
    for row in rows:
        assert row.ops_counted == "kernels" and row.gpu_ops > 0 and row.gpu_memory_ops >= 0
        assert len(row.launched_ops.split("; ")) == row.gpu_ops
        if row.layer_path == "fused":  # its own routing and combine kernels among them
            assert "route" in row.launched_ops and "combine" in row.launched_ops
        assert 0 < row.graph_microseconds < row.eager_microseconds  # one token: host-bound
        assert math.isclose(row.layer_over_gemms, row.graph_microseconds / row.gemm_microseconds)
        if "grouped_mm" in backends:
            assert row.baseline_graph_microseconds is not None and row.speedup > 0


def test_an_ab_of_forwards_alternates_them_and_lists_each_kinds_times(monkeypatch):
    calls = []
    monkeypatch.setattr(bench, "median_graph_replay_seconds", lambda f, device: (f(), 1e-6)[1])
    monkeypatch.setattr(bench, "median_seconds", lambda f, device: (f(), 2.5e-6)[1])
    forwards = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    listed = bench.alternating_forward_times(forwards, device=torch.device("cpu"), rounds=2)
    assert listed == {"graph": "1.0 1.0 / 1.0 1.0", "eager": "2.5 2.5 / 2.5 2.5"}
    assert calls == ["a", "a", "b", "b"] * 2  # round by round: a's graph and eager, then b's
    graph_only = bench.alternating_forward_times(
        forwards, device=torch.device("cpu"), rounds=1, eager=False
    )
    assert graph_only == {"graph": "1.0 / 1.0", "eager": "-"}


def test_tables_widen_a_column_for_a_long_name_or_a_slow_time():
    # a CPU's FP8 forward takes 100+ ms and its backend reads "reference+fp8": fixed widths ran
    # such cells into their neighbours ("reference+fp8kernels  129980.7128104.6")
    point = bench.BenchRow(
        geometry="qwen3-30b-a3b",
        tokens=8192,
        rows=32768,
        active_experts=128,
        backend="reference+fp8",
        mode="kernels",
        microseconds=1299800.7,
        host_microseconds=1281040.6,
        baseline_microseconds=None,
        speedup=None,
        tflops=0.04,
        roofline_fraction=0.0001,
        rel_l2=1.7e-3,
        difference=2.1e-6,
    )
    header, rule, line = bench.format_table([point]).splitlines()
    assert line.split() == [
        *("qwen3-30b-a3b", "8192", "32768", "reference+fp8", "kernels"),
        *("1299800.7", "1281040.6", "-", "0.0", "0.000", "1.7e-03", "2.1e-06"),
    ]
    assert len(rule) == len(header) and header.index("diff") + len("diff") == len(line)

    forward = bench.LayerBenchRow(
        geometry="qwen3-30b-a3b",
        tokens=8192,
        backend="reference+fp8",
        layer_path="torch",
        eager_microseconds=5318662.5,
        graph_microseconds=None,
        host_microseconds=5279352.2,
        gpu_ops=443,
        gpu_memory_ops=None,
        ops_counted="aten ops",
        gemm_microseconds=4998156.3,
        layer_over_gemms=1.06,
        baseline_eager_microseconds=None,
        baseline_graph_microseconds=None,
        launched_eager_microseconds=None,
        launched_host_microseconds=None,
        speedup=None,
    )
    line = bench.format_layer_table([forward]).splitlines()[2]
    assert line.split() == [
        *("qwen3-30b-a3b", "8192", "reference+fp8", "torch", "5318662.5", "-", "5279352.2"),
        *("-", "-", "443", "-", "4998156.3", "1.06", "-", "-", "-"),
    ]
