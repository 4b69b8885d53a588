"""Benchmarks of expert compute and of the whole layer, backend against backend in one run.

Every point reports time, the ratio to the grouped_mm baseline measured in the same run, TFLOP/s,
the fraction of the roofline floor (shared/TARGETS.md) and rel-L2 against the fp32 oracle.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from megamoe_kernels.reference import expert_mlp_reference, relative_l2_error
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.experts import backend_status, make_backend
from megamoe_runtime.geometries import Geometry, roofline_floor_seconds
from megamoe_runtime.routing import route
from megamoe_runtime.weights import Unquantized

from megamoe_torch.config import MegaMoEConfig
from megamoe_torch.layer import MegaMoE
from megamoe_torch.timing import host_seconds_per_call, median_graph_replay_seconds, median_seconds

BASELINE = "grouped_mm"


@dataclass(frozen=True)
class BenchRow:
    geometry: str
    tokens: int
    rows: int
    active_experts: int
    backend: str
    mode: str  # "kernels" (graph replay of expert compute) or "eager" (whole layer forward)
    microseconds: float
    host_microseconds: float  # CPU time to issue one call (graphs off)
    baseline_microseconds: float | None
    speedup: float | None
    tflops: float
    roofline_fraction: float
    rel_l2: float


def build_layer(
    geometry: Geometry, *, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> MegaMoE:
    """A layer of `geometry` with random weights scaled so bf16 activations stay O(1)."""
    torch.manual_seed(seed)
    config = MegaMoEConfig.from_geometry(geometry, backend="reference")
    layer = MegaMoE(config, device=device, dtype=dtype)
    with torch.no_grad():
        layer.w13.normal_(0, geometry.hidden_size**-0.5)
        layer.w2.normal_(0, geometry.intermediate_size**-0.5)
        if layer.e_score_correction_bias is not None:
            layer.e_score_correction_bias.normal_(0, 0.01)
    return layer


def routed_tokens(layer: MegaMoE, tokens: int, *, seed: int = 1):
    """Random tokens, routed by the layer's own router: (x_TH, topk_ids_TK, topk_weights_TK)."""
    generator = torch.Generator(device=layer.w13.device).manual_seed(seed)
    x_TH = torch.randn(
        tokens,
        layer.config.hidden_size,
        device=layer.w13.device,
        dtype=layer.w13.dtype,
        generator=generator,
    )
    ids, weights = route(
        layer.router_logits(x_TH),
        layer.config.router,
        correction_bias_E=layer.e_score_correction_bias,
    )
    return x_TH, ids, weights


def available_backends(device: torch.device, requested: Iterable[str]) -> list[str]:
    return [name for name in requested if backend_status(name, device)[0]]


@torch.no_grad()
def bench_point(
    layer: MegaMoE,
    geometry: Geometry,
    tokens: int,
    *,
    backends: list[str],
    modes: tuple[str, ...] = ("kernels",),
    repeats: int = 30,
) -> list[BenchRow]:
    device = layer.w13.device
    x_TH, ids, weights = routed_tokens(layer, tokens)
    batch, _ = LocalDispatcher(geometry.num_experts).dispatch(x_TH, ids, weights)
    offsets = batch.expert_offsets.tolist()
    rows = offsets[-1]
    active = sum(1 for e in range(geometry.num_experts) if offsets[e + 1] > offsets[e])
    pack = Unquantized(w13_E2IH=layer.w13.detach(), w2_EHI=layer.w2.detach())
    oracle_MH = expert_mlp_reference(
        batch.rows_MH, batch.expert_offsets, pack.w13_E2IH, pack.w2_EHI
    )[:rows]
    floor = roofline_floor_seconds(geometry, rows, active)
    results: dict[tuple[str, str], tuple[float, float, float]] = {}
    for name in backends:
        backend = make_backend(name)
        prepared = backend.prepare(pack)
        error = relative_l2_error(backend(batch, prepared)[:rows], oracle_MH)
        for mode in modes:
            if mode == "kernels":
                timer = median_graph_replay_seconds if device.type == "cuda" else median_seconds

                def call(backend=backend, prepared=prepared):
                    return backend(batch, prepared)
            else:
                layer.use_backend(name)
                timer = median_seconds

                def call():
                    return layer(x_TH)

            seconds = timer(call, device=device, repeats=repeats)
            results[(name, mode)] = (seconds, host_seconds_per_call(call, device=device), error)
    out = []
    for (name, mode), (seconds, host_seconds, error) in results.items():
        baseline = results.get((BASELINE, mode), (None,))[0]
        out.append(
            BenchRow(
                geometry=geometry.name,
                tokens=tokens,
                rows=rows,
                active_experts=active,
                backend=name,
                mode=mode,
                microseconds=seconds * 1e6,
                host_microseconds=host_seconds * 1e6,
                baseline_microseconds=None if baseline is None else baseline * 1e6,
                speedup=None if baseline is None else baseline / seconds,
                tflops=geometry.expert_flops(rows) / seconds / 1e12,
                roofline_fraction=floor / seconds,
                rel_l2=error,
            )
        )
    return out


@torch.no_grad()
def capacity_sweep(
    layer: MegaMoE,
    geometry: Geometry,
    *,
    capacity_tokens: int,
    fractions: Iterable[float],
    backend_name: str,
    repeats: int = 30,
) -> list[dict]:
    """Fixed capacity, valid rows from a small fraction to all of it: cost should follow valid rows."""
    device = layer.w13.device
    capacity = capacity_tokens * geometry.top_k
    backend = make_backend(backend_name)
    prepared = backend.prepare(Unquantized(w13_E2IH=layer.w13.detach(), w2_EHI=layer.w2.detach()))
    out = []
    for fraction in fractions:
        tokens = max(1, round(capacity_tokens * fraction))
        x_TH, ids, weights = routed_tokens(layer, tokens)
        batch, _ = LocalDispatcher(geometry.num_experts, capacity=capacity).dispatch(
            x_TH, ids, weights
        )
        # the valid rows known on the device only (as at an expert-parallel receiver): the
        # sweep measures the device-side choice
        batch = replace(batch, valid_rows=None)
        tight, _ = LocalDispatcher(geometry.num_experts).dispatch(x_TH, ids, weights)
        timer = median_graph_replay_seconds if device.type == "cuda" else median_seconds
        padded = timer(lambda b=batch: backend(b, prepared), device=device, repeats=repeats)
        exact = timer(lambda b=tight: backend(b, prepared), device=device, repeats=repeats)
        out.append(
            dict(
                geometry=geometry.name,
                backend=backend_name,
                capacity=capacity,
                valid_rows=tokens * geometry.top_k,
                fraction=fraction,
                microseconds_at_capacity=padded * 1e6,
                microseconds_tight=exact * 1e6,
                overhead=padded / exact - 1.0,
            )
        )
    return out


def write_csv(rows: list, path: Path) -> None:
    records = [asdict(row) if isinstance(row, BenchRow) else row for row in rows]
    if not records:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows(records)


def plot_speedups(rows: list[BenchRow], path: Path) -> str:
    """Speedup over grouped_mm per point, one bar per backend and mode. Returns what it did."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'megamoe-torch[plot]')"
    series = sorted(
        {(r.backend, r.mode) for r in rows if r.speedup is not None and r.backend != BASELINE}
    )
    points = sorted({(r.geometry, r.tokens) for r in rows})
    if not series or not points:
        return "no plot: no backend to compare with the grouped_mm baseline"
    figure, axes = plt.subplots(figsize=(max(6, len(points) * 0.6), 4))
    width = 0.8 / len(series)
    for index, (backend, mode) in enumerate(series):
        lookup = {
            (r.geometry, r.tokens): r.speedup
            for r in rows
            if (r.backend, r.mode) == (backend, mode)
        }
        axes.bar(
            [p + index * width for p in range(len(points))],
            [lookup.get(point, 0.0) for point in points],
            width=width,
            label=f"{backend} ({mode})",
        )
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks([p + 0.4 - width / 2 for p in range(len(points))])
    axes.set_xticklabels([f"{g}\n{t}" for g, t in points], rotation=60, fontsize=7)
    axes.set_ylabel("speedup over torch._grouped_mm")
    axes.legend(fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return f"plot written to {path}"


def format_table(rows: list[BenchRow]) -> str:
    header = f"{'geometry':<16}{'tokens':>7}{'rows':>7} {'backend':<11}{'mode':<8}{'us':>9}{'host us':>8}{'x base':>8}{'TFLOP/s':>9}{'roof':>7}{'rel-L2':>9}"
    lines = [header, "-" * len(header)]
    for r in rows:
        speedup = "" if r.speedup is None else f"{r.speedup:.2f}"
        lines.append(
            f"{r.geometry:<16}{r.tokens:>7}{r.rows:>7} {r.backend:<11}{r.mode:<8}{r.microseconds:>9.1f}"
            f"{r.host_microseconds:>8.1f}"
            f"{speedup:>8}{r.tflops:>9.1f}{r.roofline_fraction:>7.3f}{r.rel_l2:>9.1e}"
        )
    return "\n".join(lines)
