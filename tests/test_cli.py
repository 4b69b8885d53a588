"""The megamoe command end to end, on whatever device this machine has."""

import csv

import pytest
from megamoe_torch.cli import main


def test_demo_prints_backend_error_and_timings(capsys):
    assert main(["demo", "--tokens", "8", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "backend: " in out and "rel-L2 vs fp32 oracle" in out and "forward us" in out


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
    assert all(int(row["rows"]) == 5 * 4 for row in rows)


@pytest.mark.parametrize("command", ["demo", "bench", "tune"])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert "usage: megamoe" in capsys.readouterr().out
