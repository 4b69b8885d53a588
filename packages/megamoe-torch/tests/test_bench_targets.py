"""`megamoe bench --targets`: each target read off a run's rows (bench_targets.py)."""

from dataclasses import replace

import pytest
from megamoe_runtime.measure import write_csv
from megamoe_torch.bench import BenchRow, LayerBenchRow
from megamoe_torch.bench_targets import (
    SONIC_MOE_LAYER_US,
    evaluate_targets,
    format_targets,
    read_rows,
)
from megamoe_torch.cli import main

KERNEL_ROW = BenchRow(
    geometry="qwen3-30b-a3b",
    tokens=16,
    rows=128,
    active_experts=64,
    backend="cutedsl",
    mode="kernels",
    microseconds=100.0,
    host_microseconds=10.0,
    baseline_microseconds=150.0,
    speedup=1.5,
    tflops=700.0,
    roofline_fraction=0.9,
    rel_l2=2.4e-3,
    difference=1.5e-6,
)
LAYER_ROW = LayerBenchRow(
    geometry="qwen3-30b-a3b",
    tokens=1,
    backend="cutedsl",
    layer_path="fused",
    eager_microseconds=35.0,
    graph_microseconds=28.0,
    host_microseconds=20.0,
    gpu_ops=5,
    gpu_memory_ops=0,
    ops_counted="kernels",
    gemm_microseconds=25.0,
    layer_over_gemms=1.12,
    baseline_eager_microseconds=None,
    baseline_graph_microseconds=None,
    speedup=None,
)


def status_of(statuses, name):
    (status,) = [status for status in statuses if status.target.name == name]
    return status


def test_a_target_every_point_passes_is_met_and_one_that_misses_names_the_point():
    rows = [
        replace(KERNEL_ROW, tokens=1),
        replace(KERNEL_ROW, tokens=8192, roofline_fraction=0.64),
        replace(KERNEL_ROW, tokens=2048, roofline_fraction=0.74),
    ]
    statuses = evaluate_targets(rows)
    never_slower = status_of(statuses, "expert compute never slower than grouped_mm")
    assert never_slower.status == "met" and len(never_slower.readings) == 3
    floor = status_of(statuses, "expert compute >= 0.75 of the floor")
    assert floor.status == "missed at 2 of 3"
    assert [reading.point for reading in floor.misses] == [
        "qwen3-30b-a3b 8192",
        "qwen3-30b-a3b 2048",
    ]
    assert floor.worst.point == "qwen3-30b-a3b 8192" and floor.worst.value == 0.64
    # only the 8192-token row counts for the TFLOP/s target
    tflops = status_of(statuses, "expert compute >= 600 TFLOP/s at 8192 tokens")
    assert [reading.point for reading in tflops.readings] == ["qwen3-30b-a3b 8192"]


def test_an_at_most_target_reports_the_reading_furthest_above_its_bound():
    rows = [
        replace(LAYER_ROW, tokens=1, layer_over_gemms=1.30),
        replace(LAYER_ROW, tokens=16, layer_over_gemms=1.13),
        replace(LAYER_ROW, tokens=8192, layer_over_gemms=1.17),
    ]
    layer = status_of(evaluate_targets([], rows), "layer <= 1.15x its GEMMs (graph replays)")
    assert layer.status == "missed at 2 of 3"
    assert layer.worst.point == "qwen3-30b-a3b 1" and layer.worst.value == 1.30


def test_rows_of_other_backends_modes_and_missing_values_are_not_read():
    rows = [
        replace(KERNEL_ROW, backend="grouped_mm", speedup=None, roofline_fraction=0.1),
        replace(KERNEL_ROW, mode="eager", roofline_fraction=0.1),
        replace(KERNEL_ROW, speedup=None, baseline_microseconds=None),  # no baseline in the run
    ]
    statuses = evaluate_targets(rows)
    assert status_of(statuses, "expert compute >= 0.75 of the floor").status == "met"
    for name in (
        "expert compute never slower than grouped_mm",
        "geometric-mean speedup over grouped_mm >= 1.3x",
    ):
        assert status_of(statuses, name).status == "not measured"
    layer_rows = [
        replace(LAYER_ROW, graph_microseconds=None),
        replace(LAYER_ROW, backend="grouped_mm"),
    ]
    graph = status_of(
        evaluate_targets([], layer_rows), "one-token qwen3-30b-a3b forward <= 30 us in a graph"
    )
    assert graph.status == "not measured"


def test_the_geometric_mean_speedup_is_one_reading_over_every_point():
    rows = [replace(KERNEL_ROW, tokens=t, speedup=s) for t, s in ((1, 2.0), (16, 1.0), (2048, 1.0))]
    (reading,) = status_of(
        evaluate_targets(rows), "geometric-mean speedup over grouped_mm >= 1.3x"
    ).readings
    assert reading.value == pytest.approx(2.0 ** (1 / 3))
    assert reading.point == "3 points" and reading.value > 1.25


def test_fp8_targets_pair_each_fp8_point_with_the_bf16_kernels_of_the_same_point():
    bf16 = [replace(KERNEL_ROW, tokens=t, microseconds=us) for t, us in ((1, 23.0), (2048, 410.0))]
    fp8 = [
        replace(
            KERNEL_ROW, backend="cutedsl+fp8", tokens=1, microseconds=13.9, roofline_fraction=0.64
        ),
        replace(KERNEL_ROW, backend="cutedsl+fp8", tokens=2048, microseconds=290.0),
        # no bf16 row at 16 tokens: not paired, but its floor fraction still counts
        replace(
            KERNEL_ROW, backend="cutedsl+fp8", tokens=16, microseconds=99.0, roofline_fraction=0.93
        ),
    ]
    statuses = evaluate_targets(bf16 + fp8)
    decode = status_of(statuses, "FP8 >= 1.7x our bf16 at 1 and 16 tokens")
    (one_token,) = decode.readings
    assert one_token.value == pytest.approx(23.0 / 13.9) and decode.status == "missed at 1 of 1"
    prefill = status_of(statuses, "FP8 >= 1.6x our bf16 at 2048 and 8192 tokens")
    assert prefill.readings[0].value == pytest.approx(410.0 / 290.0)
    floor = status_of(statuses, "FP8 >= 0.8 of its bytes floor at 1 and 16 tokens")
    assert [(r.point, r.value) for r in floor.misses] == [("qwen3-30b-a3b 1", 0.64)]
    assert len(floor.readings) == 2
    # the bf16 targets read none of the FP8 rows
    assert len(status_of(statuses, "expert compute >= 0.75 of the floor").readings) == 2


def test_the_sonic_moe_bounds_are_its_times_over_the_speedup_asked():
    rows = [
        replace(LAYER_ROW, tokens=8192, eager_microseconds=1309.2),
        replace(LAYER_ROW, geometry="mixtral-8x7b", tokens=2048, eager_microseconds=3600.0),
        replace(LAYER_ROW, geometry="dsv3", tokens=2048),  # no SonicMoE reading there
    ]
    status = status_of(
        evaluate_targets([], rows),
        "layer within SonicMoE's H200 times (1.2x faster at qwen3-30b-a3b), eager us",
    )
    bounds = {reading.point: reading.bound for reading in status.readings}
    assert bounds == {
        "qwen3-30b-a3b 8192": SONIC_MOE_LAYER_US[("qwen3-30b-a3b", 8192)] / 1.2,
        "mixtral-8x7b 2048": SONIC_MOE_LAYER_US[("mixtral-8x7b", 2048)],
    }
    assert [reading.point for reading in status.misses] == ["mixtral-8x7b 2048"]


def test_the_report_is_a_markdown_table_that_names_the_misses():
    rows = [replace(KERNEL_ROW, tokens=t, roofline_fraction=0.5) for t in range(1, 8)]
    report = format_targets(evaluate_targets(rows), device="NVIDIA H200", most_misses=4)
    lines = report.splitlines()
    assert "NVIDIA H200" in lines[0]
    assert lines[2] == "| target | points | status | worst | missed at |"
    (floor_line,) = [line for line in lines if line.startswith("| expert compute >= 0.75")]
    cells = [cell.strip() for cell in floor_line.strip("|").split("|")]
    assert cells[1:3] == ["7", "missed at 7 of 7"]
    assert cells[3] == "0.50 (qwen3-30b-a3b 1)"
    assert cells[4].endswith("qwen3-30b-a3b 4: 0.50, and 3 more")
    assert not any("this run has none" in line for line in lines)
    assert any(line.startswith("The floor is the H200's") for line in lines)
    # no cutedsl rows: every target not measured, and the report says what it reads
    empty = format_targets(
        evaluate_targets([replace(KERNEL_ROW, backend="reference")]), device="CPU"
    )
    assert empty.count("| not measured |") == len(evaluate_targets([]))
    assert "this run has none" in empty.splitlines()[-1]


def test_launches_are_counted_for_layers_without_shared_experts_only():
    rows = [
        replace(LAYER_ROW, gpu_ops=5, gpu_memory_ops=0),
        replace(LAYER_ROW, tokens=8192, gpu_ops=5, gpu_memory_ops=2),
        replace(LAYER_ROW, geometry="dsv3", gpu_ops=9),  # its shared expert's launches
        replace(LAYER_ROW, gpu_ops=300, gpu_memory_ops=None, ops_counted="aten ops"),  # a CPU's
    ]
    status = status_of(
        evaluate_targets([], rows), "<= 6 GPU launches per forward without shared experts"
    )
    assert [(r.point, r.value) for r in status.readings] == [
        ("qwen3-30b-a3b 1", 5),
        ("qwen3-30b-a3b 8192", 7),
    ]
    assert status.status == "missed at 1 of 2"


def test_rows_written_by_bench_read_back_equal_and_in_the_folders_order(tmp_path):
    first, second = tmp_path / "qwen3", tmp_path / "mixtral"
    kernel_rows = [KERNEL_ROW, replace(KERNEL_ROW, backend="grouped_mm", speedup=None)]
    layer_rows = [
        LAYER_ROW,
        replace(LAYER_ROW, tokens=16, gpu_memory_ops=None, launched_eager_microseconds=40.5),
    ]
    write_csv(kernel_rows, first / "bench.csv")
    write_csv(layer_rows, first / "layer.csv")
    mixtral = replace(KERNEL_ROW, geometry="mixtral-8x7b", tokens=8192, tflops=651.9)
    write_csv([mixtral], second / "bench.csv")  # a run without layer rows

    rows, read_layer_rows = read_rows([first, second])

    assert rows == [*kernel_rows, mixtral]
    assert read_layer_rows == layer_rows


def test_reading_a_folder_without_rows_or_with_other_columns_fails_naming_it(tmp_path):
    with pytest.raises(ValueError, match="neither bench.csv nor layer.csv"):
        read_rows([tmp_path])
    (tmp_path / "bench.csv").write_text("geometry,tokens\nqwen3-30b-a3b,sixteen\n")
    with pytest.raises(ValueError, match=r"bench.csv does not hold megamoe bench's bench.csv rows"):
        read_rows([tmp_path])


def test_the_command_reads_the_targets_of_runs_measured_one_geometry_each(tmp_path, capsys):
    qwen3, mixtral = tmp_path / "qwen3", tmp_path / "mixtral"
    write_csv([replace(KERNEL_ROW, tokens=8192, tflops=557.0)], qwen3 / "bench.csv")
    write_csv([replace(KERNEL_ROW, geometry="mixtral-8x7b", tokens=8192)], mixtral / "bench.csv")

    assert main(["bench", "--targets-of", str(qwen3), str(mixtral)]) == 0

    report = capsys.readouterr().out
    assert report.startswith(f"Targets at the points these runs measured (read from {qwen3}, ")
    assert (
        "| expert compute >= 600 TFLOP/s at 8192 tokens | 2 | missed at 1 of 2 | "
        "557 (qwen3-30b-a3b 8192) | qwen3-30b-a3b 8192: 557 |"
    ) in report
    # it measures nothing: options that would are refused
    with pytest.raises(SystemExit):
        main(["bench", "--targets-of", str(qwen3), "--geometry", "dsv3"])
    assert "measures nothing: drop --geometry" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--targets-of", str(tmp_path)])
    assert "neither bench.csv nor layer.csv" in capsys.readouterr().err
