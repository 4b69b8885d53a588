"""The project's performance targets, read off one `megamoe bench` run.

`megamoe bench --targets` evaluates each target of docs/benchmarks.md ("Roofline floor and
targets"; the FP8 experts' in "FP8 experts") at the points the run measured: the cutedsl
backend's rows, against the baselines of the same run (grouped_mm, and with `--weight-dtype
bf16 fp8` the bf16 kernels for the FP8 ones). A target holds where every point it covers
passes; the report gives the worst reading and the points that miss. Points the run did not
measure (a geometry, a token count, a mode, a dtype or a backend left out) leave a target "not
measured". The floor (the H200's limits) and the SonicMoE bounds (times measured on an H200 at
700 W) are an H200's: another GPU's readings of those targets do not compare with them, and the
report says so.

`megamoe bench --targets-of OUT ...` reads the rows of earlier runs back from the bench.csv and
layer.csv under each `--out` folder (`read_rows`) and evaluates the targets on them together: a
grid measured one geometry per process (a GPU's memory or a time limit per command) reads as one
run.
"""

from __future__ import annotations

import csv
import math
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

from megamoe_runtime.geometries import GEOMETRIES

from megamoe_torch.bench import BenchRow, LayerBenchRow

# the backend whose rows the targets read: megamoe's kernels (FP8 experts: KERNELS + "+fp8")
KERNELS = "cutedsl"
FP8_KERNELS = f"{KERNELS}+fp8"
# SonicMoE's whole layer, eager, us, on an H200 at 700 W (docs/benchmarks.md's peers), and the
# speedup over it the targets ask at each geometry
SONIC_MOE_LAYER_US = {
    ("qwen3-30b-a3b", 16): 1100.0,
    ("qwen3-30b-a3b", 2048): 1998.0,
    ("qwen3-30b-a3b", 8192): 1932.0,
    ("mixtral-8x7b", 16): 1826.0,
    ("mixtral-8x7b", 2048): 3536.0,
    ("mixtral-8x7b", 8192): 9864.0,
}
SPEEDUP_OVER_SONIC_MOE = {"qwen3-30b-a3b": 1.2, "mixtral-8x7b": 1.0}


@dataclass(frozen=True)
class Reading:
    """One point's value for a target, and the bound it must meet there."""

    point: str
    value: float
    bound: float


@dataclass(frozen=True)
class Target:
    """`name` as docs/benchmarks.md states it; `at_least`: values must be >= their bounds
    (else <=); `readings` picks the target's points from the run's rows; `value_format`
    formats a value."""

    name: str
    at_least: bool
    readings: Callable[[Sequence[BenchRow], Sequence[LayerBenchRow]], list[Reading]]
    value_format: str = "{:.2f}"

    def passes(self, reading: Reading) -> bool:
        if self.at_least:
            return reading.value >= reading.bound
        return reading.value <= reading.bound


@dataclass(frozen=True)
class TargetStatus:
    target: Target
    readings: list[Reading]

    @property
    def misses(self) -> list[Reading]:
        return [reading for reading in self.readings if not self.target.passes(reading)]

    @property
    def status(self) -> str:
        if not self.readings:
            return "not measured"
        if not self.misses:
            return "met"
        return f"missed at {len(self.misses)} of {len(self.readings)}"

    @property
    def worst(self) -> Reading | None:
        if not self.readings:
            return None
        # the reading furthest from its bound on the failing side, as a fraction of the bound
        pick = min if self.target.at_least else max
        return pick(self.readings, key=lambda reading: reading.value / reading.bound)


def _point(geometry: str, tokens: int) -> str:
    return f"{geometry} {tokens}"


def _kernel_rows(rows: Sequence[BenchRow], backend: str) -> list[BenchRow]:
    return [row for row in rows if row.backend == backend and row.mode == "kernels"]


def _field(
    field: str,
    bound: float,
    *,
    layer: bool = False,
    backend: str = KERNELS,
    tokens: Sequence[int] | None = None,
    geometry: str | None = None,
):
    """Readings of a field of `backend`'s "kernels" rows (BenchRow), or with `layer` of its
    layer rows (LayerBenchRow), those of `tokens` and `geometry` where given; rows without the
    value (no baseline in the run, no graph on a CPU) are left out."""

    def readings(rows: Sequence[BenchRow], layer_rows: Sequence[LayerBenchRow]) -> list[Reading]:
        picked = (
            [row for row in layer_rows if row.backend == backend]
            if layer
            else _kernel_rows(rows, backend)
        )
        return [
            Reading(_point(row.geometry, row.tokens), getattr(row, field), bound)
            for row in picked
            if getattr(row, field) is not None
            and (tokens is None or row.tokens in tokens)
            and (geometry is None or row.geometry == geometry)
        ]

    return readings


def _geometric_mean_speedup(rows: Sequence[BenchRow], _: Sequence[LayerBenchRow]) -> list[Reading]:
    speedups = [row.speedup for row in _kernel_rows(rows, KERNELS) if row.speedup is not None]
    if not speedups:
        return []
    mean = math.exp(sum(math.log(value) for value in speedups) / len(speedups))
    return [Reading(f"{len(speedups)} points", mean, 1.3)]


def _fp8_over_bf16(bound: float, tokens: Sequence[int]):
    """The bf16 kernels' time over the FP8 kernels' at the same point (both in the run)."""

    def readings(rows: Sequence[BenchRow], _: Sequence[LayerBenchRow]) -> list[Reading]:
        bf16 = {(row.geometry, row.tokens): row for row in _kernel_rows(rows, KERNELS)}
        return [
            Reading(
                _point(row.geometry, row.tokens),
                bf16[(row.geometry, row.tokens)].microseconds / row.microseconds,
                bound,
            )
            for row in _kernel_rows(rows, FP8_KERNELS)
            if row.tokens in tokens and (row.geometry, row.tokens) in bf16
        ]

    return readings


def _launches_without_shared_experts(
    _: Sequence[BenchRow], layer_rows: Sequence[LayerBenchRow]
) -> list[Reading]:
    """The GPU launches (kernels, memcpy and memset) of one launched forward of a layer
    without shared experts."""
    return [
        Reading(_point(row.geometry, row.tokens), row.gpu_ops + (row.gpu_memory_ops or 0), 6)
        for row in layer_rows
        if row.backend == KERNELS
        and row.ops_counted == "kernels"
        and row.geometry in GEOMETRIES
        and GEOMETRIES[row.geometry].num_shared_experts == 0
    ]


def _sonic_moe(_: Sequence[BenchRow], layer_rows: Sequence[LayerBenchRow]) -> list[Reading]:
    return [
        Reading(
            _point(row.geometry, row.tokens),
            row.eager_microseconds,
            SONIC_MOE_LAYER_US[(row.geometry, row.tokens)] / SPEEDUP_OVER_SONIC_MOE[row.geometry],
        )
        for row in layer_rows
        if row.backend == KERNELS and (row.geometry, row.tokens) in SONIC_MOE_LAYER_US
    ]


TARGETS = (
    Target("expert compute >= 0.75 of the floor", True, _field("roofline_fraction", 0.75)),
    Target("expert compute never slower than grouped_mm", True, _field("speedup", 1.0)),
    Target("geometric-mean speedup over grouped_mm >= 1.3x", True, _geometric_mean_speedup),
    Target(
        "expert compute >= 600 TFLOP/s at 8192 tokens",
        True,
        _field("tflops", 600.0, tokens=(8192,)),
        value_format="{:.0f}",
    ),
    Target(
        "expert compute rel-L2 <= 1e-2 against the fp32 oracle",
        False,
        _field("rel_l2", 1e-2),
        value_format="{:.1e}",
    ),
    Target(
        "layer <= 1.15x its GEMMs (graph replays)",
        False,
        _field("layer_over_gemms", 1.15, layer=True),
    ),
    Target(
        "<= 30 us host time per eager forward",
        False,
        _field("host_microseconds", 30.0, layer=True),
        value_format="{:.1f}",
    ),
    Target(
        "<= 6 GPU launches per forward without shared experts",
        False,
        _launches_without_shared_experts,
        value_format="{:.0f}",
    ),
    Target(
        "one-token qwen3-30b-a3b forward <= 30 us in a graph",
        False,
        _field("graph_microseconds", 30.0, layer=True, tokens=(1,), geometry="qwen3-30b-a3b"),
        value_format="{:.1f}",
    ),
    Target(
        "one-token qwen3-30b-a3b forward <= 40 us eager",
        False,
        _field("eager_microseconds", 40.0, layer=True, tokens=(1,), geometry="qwen3-30b-a3b"),
        value_format="{:.1f}",
    ),
    Target(
        "layer within SonicMoE's H200 times (1.2x faster at qwen3-30b-a3b), eager us",
        False,
        _sonic_moe,
        value_format="{:.1f}",
    ),
    Target("FP8 >= 1.6x our bf16 at 2048 and 8192 tokens", True, _fp8_over_bf16(1.6, (2048, 8192))),
    Target("FP8 >= 1.7x our bf16 at 1 and 16 tokens", True, _fp8_over_bf16(1.7, (1, 16))),
    Target(
        "FP8 >= 0.8 of its bytes floor at 1 and 16 tokens",
        True,
        _field("roofline_fraction", 0.8, backend=FP8_KERNELS, tokens=(1, 16)),
    ),
    Target(
        "FP8 difference <= 1e-3 against the fp32 oracle",
        False,
        _field("difference", 1e-3, backend=FP8_KERNELS),
        value_format="{:.1e}",
    ),
    Target(
        "FP8 >= 850 TFLOP/s at dsv3-ep8-local 8192 tokens",
        True,
        _field("tflops", 850.0, backend=FP8_KERNELS, tokens=(8192,), geometry="dsv3-ep8-local"),
        value_format="{:.0f}",
    ),
)


def evaluate_targets(
    rows: Sequence[BenchRow], layer_rows: Sequence[LayerBenchRow] = ()
) -> list[TargetStatus]:
    """Each of TARGETS at the points of this run's rows."""
    return [TargetStatus(target, target.readings(rows, layer_rows)) for target in TARGETS]


def format_targets(
    statuses: Sequence[TargetStatus],
    *,
    device: str,
    most_misses: int = 4,
    measured_by: str = "this run",
) -> str:
    """A markdown table of the statuses: the target, its points, met or missed, the worst
    reading, and the first `most_misses` points that miss; `device` and `measured_by` head it."""
    lines = [
        f"Targets at the points {measured_by} measured ({device}; ratios against baselines of the "
        "same run):",
        "",
        "| target | points | status | worst | missed at |",
        "|---|---|---|---|---|",
    ]
    for status in statuses:
        value = status.target.value_format.format
        worst = status.worst
        worst_cell = "-" if worst is None else f"{value(worst.value)} ({worst.point})"
        misses = status.misses
        missed_cell = ", ".join(
            f"{reading.point}: {value(reading.value)}" for reading in misses[:most_misses]
        )
        if len(misses) > most_misses:
            missed_cell += f", and {len(misses) - most_misses} more"
        lines.append(
            f"| {status.target.name} | {len(status.readings)} | {status.status} | {worst_cell} "
            f"| {missed_cell or '-'} |"
        )
    lines.append(
        "\nThe floor is the H200's (its HBM copy rate and dense product rates, "
        "megamoe_runtime.geometries) and the SonicMoE times were measured on an H200: on another "
        "GPU those targets read against an H200."
    )
    if not any(status.readings for status in statuses):
        lines.append(
            f"(the targets read the {KERNELS} backend's rows, {KERNELS} and {FP8_KERNELS}: "
            "this run has none that any target covers)"
        )
    return "\n".join(lines)


def _row_from_record(row_type: type, record: dict[str, str]):
    """One CSV record (write_csv's cells: an empty cell for None) as a `row_type` dataclass."""
    hints = typing.get_type_hints(row_type)
    values = {}
    for field in fields(row_type):
        cell = record.get(field.name, "")
        kind = hints[field.name]
        optional = type(None) in typing.get_args(kind)
        if cell == "" and optional:
            values[field.name] = None
        elif int in (kind, *typing.get_args(kind)):
            values[field.name] = int(cell)
        elif float in (kind, *typing.get_args(kind)):
            values[field.name] = float(cell)
        else:
            values[field.name] = cell
    return row_type(**values)


def read_rows(folders: Sequence[Path]) -> tuple[list[BenchRow], list[LayerBenchRow]]:
    """The kernels / eager rows and the layer rows `megamoe bench --out` wrote under each folder
    (bench.csv, layer.csv; either may be missing), in the folders' order. A ValueError names a
    folder holding neither, or a file whose columns are not those of its rows."""
    rows: list[BenchRow] = []
    layer_rows: list[LayerBenchRow] = []
    for folder in map(Path, folders):
        found = False
        for name, row_type, into in (
            ("bench.csv", BenchRow, rows),
            ("layer.csv", LayerBenchRow, layer_rows),
        ):
            path = folder / name
            if not path.is_file():
                continue
            found = True
            with path.open(newline="") as handle:
                for record in csv.DictReader(handle):
                    try:
                        into.append(_row_from_record(row_type, record))
                    except (TypeError, ValueError) as error:
                        raise ValueError(
                            f"{path} does not hold megamoe bench's {name} rows: {error}"
                        ) from None
        if not found:
            raise ValueError(
                f"{folder} holds neither bench.csv nor layer.csv (a `megamoe bench --out` folder)"
            )
    return rows, layer_rows
