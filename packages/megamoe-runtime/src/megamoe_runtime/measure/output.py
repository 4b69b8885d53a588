"""Where measurements go: CSV and JSON files, a bar chart (PNG), a text table.

Rows are dataclasses or dicts; a file is written whole, so a run cut short after any point keeps
everything measured up to it when the caller writes after every point.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, is_dataclass
from pathlib import Path


def as_records(rows: Sequence) -> list[dict]:
    """Each row (a dataclass or a dict) as a dict."""
    return [asdict(row) if is_dataclass(row) else dict(row) for row in rows]


def write_csv(rows: Sequence, path: Path) -> None:
    """One CSV of `rows` (dataclasses or dicts), the columns every key any row has, in the order
    they first appear (a row without a key leaves its cell empty). Nothing is written for no
    rows."""
    records = as_records(rows)
    if not records:
        return
    columns = list(dict.fromkeys(key for record in records for key in record))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(records)


def write_json(value: object, path: Path) -> None:
    """`value` (dataclass rows inside it included) as indented JSON."""

    def plain(item: object) -> object:
        if is_dataclass(item):
            return asdict(item)
        raise TypeError(f"{type(item).__name__} is not JSON serializable")

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        json.dump(value, handle, indent=1, default=plain)


def plot_bars(
    series: Mapping[str, Mapping[tuple, float]],
    path: Path,
    *,
    ylabel: str,
    log_scale: bool = False,
    reference_line: float | None = None,
    title: str | None = None,
) -> str:
    """A grouped bar chart as a PNG: one bar per series at each point (a point is a tuple, its
    fields one line each under the axis; a series without a point draws 0 there), a
    horizontal line at `reference_line` (1.0 for speedups). Returns what it did: a plot
    written, or why not (matplotlib missing, nothing to plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install matplotlib, or megamoe-torch's extra plot)"
    points = sorted({point for values in series.values() for point in values})
    if not points:
        return "no plot: nothing to plot"
    figure, axes = plt.subplots(figsize=(max(6, len(points) * 0.6), 4))
    width = 0.8 / len(series)
    for index, (label, values) in enumerate(series.items()):
        axes.bar(
            [p + index * width for p in range(len(points))],
            [values.get(point, 0.0) for point in points],
            width=width,
            label=label,
        )
    if reference_line is not None:
        axes.axhline(reference_line, color="black", linewidth=0.8)
    if log_scale:
        axes.set_yscale("log")
    axes.set_ylabel(ylabel)
    if title:
        axes.set_title(title, fontsize=8)
    axes.set_xticks([p + 0.4 - width / 2 for p in range(len(points))])
    axes.set_xticklabels(["\n".join(map(str, point)) for point in points], rotation=60, fontsize=7)
    axes.legend(fontsize=7)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return f"plot written to {path}"


def format_columns(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A text table, each column as wide as its widest cell, right-aligned."""
    table = [list(header), *map(list, rows)]
    widths = [max(len(row[index]) for row in table) for index in range(len(header))]
    return "\n".join(
        "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True))
        for row in table
    )
