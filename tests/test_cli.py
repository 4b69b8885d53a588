"""The megamoe command end to end, on whatever device this machine has."""

import csv
import importlib.util
import os

import megamoe_kernels
import megamoe_runtime
import megamoe_torch
import pytest
import torch
from megamoe_torch import bench
from megamoe_torch.cli import main


def test_demo_prints_backend_error_and_timings(capsys):
    assert main(["demo", "--tokens", "8", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "backend: " in out and "rel-L2 vs fp32 oracle" in out and "forward us" in out
    # the FP8 layer next to the bf16 one, checked against the oracle on its dequantized weights
    assert "fp8 experts (e4m3, 128x128 block scales) on reference" in out
    assert "DeepGEMM's difference" in out and "within the fp8 bound" in out
    assert {line.split()[2] for line in out.splitlines() if line.startswith("tiny-qwen3 ")} == {
        "bf16",
        "fp8",
    }


def test_bench_writes_csv_with_oracle_error(tmp_path):
    assert (
        main(
            [
                "bench",
                "--geometry",
                "tiny-qwen3",
                "--tokens",
                "5",
                "--backends",
                "reference",
                "--modes",
                "kernels",
                "eager",
                "--repeats",
                "2",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    with (tmp_path / "bench.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {row["mode"] for row in rows} == {"kernels", "eager"}
    assert all(float(row["rel_l2"]) < 1e-2 for row in rows)
    # DeepGEMM's difference: about half the square of the rel-L2 where the error is small
    assert all(0 < float(row["difference"]) < float(row["rel_l2"]) ** 2 for row in rows)
    assert all(int(row["rows"]) == 5 * 4 for row in rows)


def test_bench_times_each_weight_dtype_and_reports_the_targets(tmp_path, capsys):
    argv = ["bench", "--device", "cpu", "--geometry", "tiny-qwen3", "--tokens", "3"]
    argv += ["--weight-dtype", "bf16", "fp8", "--targets", "--repeats", "1", "--out", str(tmp_path)]
    assert main(argv) == 0
    with (tmp_path / "bench.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert [row["backend"] for row in rows] == ["reference", "reference+fp8"]
    report = (tmp_path / "targets.md").read_text()
    assert report.splitlines()[0].startswith("Targets at the points this run measured (CPU")
    assert "| FP8 >= 1.7x our bf16 at 1 and 16 tokens | 0 | not measured |" in report
    assert report.strip() in capsys.readouterr().out


@pytest.mark.parametrize("command", ["demo", "bench", "tune"])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: megamoe" in capsys.readouterr().out


def test_version_names_every_package(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for module in (megamoe_torch, megamoe_runtime, megamoe_kernels):
        assert module.__version__ in out


@pytest.fixture
def no_work(monkeypatch):
    """Fails a test that builds a layer: argument errors come before any work."""

    def fail(*args, **kwargs):
        raise AssertionError("a layer was built before the arguments were checked")

    monkeypatch.setattr(bench, "build_layer", fail)


def exits_with_one_line_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: " in err, err
    return err


@pytest.mark.parametrize(
    ("argv", "argument"),
    [
        (["bench", "--tokens", "-4"], "--tokens"),
        (["bench", "--tokens", "16", "0"], "--tokens"),
        (["bench", "--repeats", "0"], "--repeats"),
        (["demo", "--tokens", "-1"], "--tokens"),
        (["demo", "--repeats", "zero"], "--repeats"),
        (["demo", "--device", "nowhere"], "--device"),
    ],
)
def test_bad_numbers_and_devices_are_argument_errors(argv, argument, no_work, capsys):
    assert f"argument {argument}: " in exits_with_one_line_error(argv, capsys)


def test_tune_weight_dtype_is_bf16_or_fp8(no_work, capsys):
    argv = ["tune", "--geometry", "tiny-qwen3", "--tokens", "16", "--weight-dtype", "fp16"]
    err = exits_with_one_line_error(argv, capsys)
    assert "argument --weight-dtype: invalid choice: 'fp16'" in err
    assert "'bf16', 'fp8'" in err


def test_tune_refuses_fp8_for_experts_fp8_does_not_compute(no_work, capsys):
    # gpt-oss-120b's expert biases and clamped SwiGLU: said before any tuning starts
    argv = ["tune", "--geometry", "tiny-qwen3", "gpt-oss-120b", "--tokens", "16"]
    err = exits_with_one_line_error([*argv, "--weight-dtype", "fp8"], capsys)
    assert "argument --geometry: gpt-oss-120b has no fp8 experts" in err
    assert "tune it with --weight-dtype bf16" in err


def test_out_that_is_a_file_is_an_argument_error(tmp_path, no_work, capsys):
    a_file = tmp_path / "results"
    a_file.write_text("")
    for out in (a_file, a_file / "below"):
        err = exits_with_one_line_error(["bench", "--out", str(out)], capsys)
        assert "argument --out: " in err and "is a file" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_out_that_is_not_writable_is_an_argument_error(tmp_path, no_work, capsys):
    tmp_path.chmod(0o500)
    try:
        err = exits_with_one_line_error(["bench", "--out", str(tmp_path / "out")], capsys)
    finally:
        tmp_path.chmod(0o700)
    assert "argument --out: " in err and "not writable" in err


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_out_where_nothing_can_be_written_is_an_argument_error_before_any_work(no_work, capsys):
    # /proc takes no new folders, even from root, whom os.access lets through everywhere
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--out", "/proc/megamoe-bench-out"])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert err.count("\n") == 1
    assert "argument --out: cannot write into /proc/megamoe-bench-out" in err
    assert out == ""  # nothing said about the backends it would have timed


def test_bench_ep_outside_torchrun_says_how_to_launch_it(no_work, monkeypatch, capsys):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    err = exits_with_one_line_error(["bench", "--ep"], capsys)
    assert "argument --ep: " in err and "torchrun" in err


def test_ep_options_without_ep_are_argument_errors(no_work, capsys):
    err = exits_with_one_line_error(["bench", "--ep-layer-tokens", "128"], capsys)
    assert "need --ep" in err


def test_a_gpu_this_machine_lacks_is_an_argument_error(no_work, capsys):
    missing = f"cuda:{torch.cuda.device_count()}"
    err = exits_with_one_line_error(["demo", "--device", missing], capsys)
    assert f"argument --device: {missing}" in err and "available: cpu" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_demo_on_cuda_without_a_gpu_says_what_is_available(no_work, capsys):
    err = exits_with_one_line_error(["demo", "--device", "cuda"], capsys)
    assert "argument --device: cuda" in err and "available: cpu" in err


def test_demo_backend_that_cannot_run_names_those_that_can(no_work, capsys):
    err = exits_with_one_line_error(["demo", "--device", "cpu", "--backend", "grouped_mm"], capsys)
    assert "argument --backend: grouped_mm cannot run on cpu" in err
    assert "--backend auto or reference" in err


def test_bench_backends_that_cannot_run_name_the_flag_that_can(no_work, capsys):
    err = exits_with_one_line_error(
        ["bench", "--device", "cpu", "--backends", "cutedsl", "grouped_mm"], capsys
    )
    assert "argument --backends: none of cutedsl grouped_mm can run on cpu" in err
    assert "--backends reference" in err


def test_bench_falls_back_to_the_backends_that_run_and_plots_them(tmp_path, capsys):
    argv = ["bench", "--device", "cpu", "--geometry", "tiny-qwen3", "--tokens", "3", "7"]
    assert main([*argv, "--repeats", "1", "--out", str(tmp_path / "new" / "out")]) == 0
    out = capsys.readouterr().out
    assert "none of the default backends can run on cpu" in out
    assert "timing reference instead (--backends chooses)" in out
    with (tmp_path / "new" / "out" / "bench.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {(row["backend"], row["tokens"]) for row in rows} == {
        ("reference", "3"),
        ("reference", "7"),
    }
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "new" / "out" / "bench.png").stat().st_size > 0
    else:
        assert "no plot: matplotlib is not installed" in out
