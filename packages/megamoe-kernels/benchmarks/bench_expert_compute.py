"""Expert compute on one GPU: cutedsl against grouped_mm in the same run, per geometry and tokens.

    python packages/megamoe-kernels/benchmarks/bench_expert_compute.py [--geometry G ...]
        [--tokens T ...] [--csv PATH]

For each point: random softmax routing, a tight batch from the local dispatcher, both backends
timed as CUDA-graph replays (10 calls per graph, median of 15 replays), TFLOP/s, the fraction of
the roofline floor (megamoe_runtime.geometries) and rel-L2 against the fp32 oracle.
"""

from __future__ import annotations

import argparse
import csv
import statistics

import torch
from megamoe_kernels import GemmKnobs, down, gate_up_swiglu, knob_problems
from megamoe_kernels.reference import expert_mlp_reference, relative_l2_error
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.experts import make_backend
from megamoe_runtime.geometries import GEOMETRIES, TOKEN_COUNTS, roofline_floor_seconds
from megamoe_runtime.weights import Unquantized

CALLS_PER_GRAPH = 10
REPLAYS = 15


def graph_time_seconds(fn) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            fn()
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / CALLS_PER_GRAPH)
    return statistics.median(times)


def bench_point(geometry, tokens, weights, backends, prepared, capacity_factor=1):
    device = weights.w13_E2IH.device
    experts, hidden = geometry.num_experts, geometry.hidden_size
    logits = torch.randn(tokens, experts, device=device)
    topk_ids = logits.topk(geometry.top_k, dim=-1).indices
    topk_weights = torch.softmax(logits, -1).gather(1, topk_ids)
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    rows = tokens * geometry.top_k
    batch, _ = LocalDispatcher(experts, capacity=rows * capacity_factor, check_ids=False).dispatch(
        x, topk_ids, topk_weights
    )
    active = int((torch.bincount(topk_ids.flatten(), minlength=experts) > 0).sum())
    floor = roofline_floor_seconds(geometry, rows, active)
    expected = expert_mlp_reference(
        batch.rows_MH, batch.expert_offsets, weights.w13_E2IH, weights.w2_EHI
    )
    result = {
        "geometry": geometry.name,
        "tokens": tokens,
        "rows": rows,
        "capacity": batch.capacity,
        "active": active,
        "floor_us": floor * 1e6,
    }
    for name, backend in backends.items():
        out = backend(batch, prepared[name])
        result[f"{name}_relL2"] = relative_l2_error(out[:rows], expected[:rows])
        seconds = graph_time_seconds(lambda b=backend, n=name: b(batch, prepared[n]))
        result[f"{name}_us"] = seconds * 1e6
        result[f"{name}_tflops"] = geometry.expert_flops(rows) / seconds / 1e12
        result[f"{name}_of_floor"] = floor / seconds
    if "grouped_mm" in backends and "cutedsl" in backends:
        result["speedup"] = result["grouped_mm_us"] / result["cutedsl_us"]
    return result


SWEEP = {
    "prefill": [
        GemmKnobs(tile_rows=128, tile_cols=256, stages=4),
        GemmKnobs(tile_rows=128, tile_cols=256, stages=3),
        GemmKnobs(tile_rows=128, tile_cols=256, stages=4, rows_fastest=False),
        GemmKnobs(tile_rows=128, tile_cols=192, stages=4),
        GemmKnobs(tile_rows=128, tile_cols=128, stages=6),
        GemmKnobs(tile_rows=64, tile_cols=256, stages=5),
    ],
    "decode": [
        GemmKnobs(tile_rows=16, tile_cols=128, stages=12, swap_ab=True),
        GemmKnobs(tile_rows=16, tile_cols=128, stages=6, swap_ab=True),
        GemmKnobs(tile_rows=16, tile_cols=64, stages=12, swap_ab=True),
        GemmKnobs(tile_rows=32, tile_cols=128, stages=8, swap_ab=True),
    ],
}


def sweep_knobs(geometry, tokens, weights, prepared):
    """Times each GEMM alone under each candidate knob set (the default profile's family)."""
    device = weights.w13_E2IH.device
    logits = torch.randn(tokens, geometry.num_experts, device=device)
    topk_ids = logits.topk(geometry.top_k, dim=-1).indices
    x = torch.randn(tokens, geometry.hidden_size, device=device, dtype=torch.bfloat16)
    batch, _ = LocalDispatcher(geometry.num_experts, check_ids=False).dispatch(
        x, topk_ids, torch.ones_like(topk_ids, dtype=torch.float32)
    )
    rows = tokens * geometry.top_k
    family = "decode" if rows / geometry.num_experts <= 64 else "prefill"
    hidden_MI = gate_up_swiglu(batch.rows_MH, batch.expert_offsets, prepared.w13_EB2GH)
    flops = geometry.expert_flops(rows)
    for knobs in SWEEP[family]:
        line = f"sweep {geometry.name} tokens={tokens} {knobs}"
        for op, share, fn in (
            (
                "gate_up",
                2 / 3,
                lambda k=knobs: gate_up_swiglu(
                    batch.rows_MH, batch.expert_offsets, prepared.w13_EB2GH, knobs=k
                ),
            ),
            (
                "down",
                1 / 3,
                lambda k=knobs: down(hidden_MI, batch.expert_offsets, prepared.w2_EHI, knobs=k),
            ),
        ):
            if knob_problems(knobs, op):
                line += f" {op}=invalid"
                continue
            seconds = graph_time_seconds(fn)
            line += f" {op}={seconds * 1e6:.1f}us/{flops * share / seconds / 1e12:.0f}TF"
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--geometry", nargs="*", default=[g for g in GEOMETRIES if g != "tiny-qwen3"]
    )
    parser.add_argument("--tokens", nargs="*", type=int, default=list(TOKEN_COUNTS))
    parser.add_argument("--backends", nargs="*", default=["cutedsl", "grouped_mm"])
    parser.add_argument("--csv", default=None)
    parser.add_argument(
        "--capacity-factor", type=int, default=1, help="batch capacity = rows x this factor"
    )
    parser.add_argument("--sweep-knobs", action="store_true", help="time each GEMM per knob set")
    args = parser.parse_args()
    device = torch.device("cuda")
    results = []
    for name in args.geometry:
        geometry = GEOMETRIES[name]
        generator = torch.Generator(device=device).manual_seed(0)
        shape13 = (geometry.num_experts, 2 * geometry.intermediate_size, geometry.hidden_size)
        shape2 = (geometry.num_experts, geometry.hidden_size, geometry.intermediate_size)
        weights = Unquantized(
            w13_E2IH=(
                torch.randn(shape13, device=device, generator=generator) / geometry.hidden_size**0.5
            ).bfloat16(),
            w2_EHI=(
                torch.randn(shape2, device=device, generator=generator)
                / geometry.intermediate_size**0.5
            ).bfloat16(),
        )
        backends = {b: make_backend(b) for b in args.backends}
        prepared = {b: backend.prepare(weights) for b, backend in backends.items()}
        for tokens in args.tokens:
            if args.sweep_knobs:
                sweep_knobs(geometry, tokens, weights, prepared["cutedsl"])
                continue
            result = bench_point(
                geometry, tokens, weights, backends, prepared, args.capacity_factor
            )
            results.append(result)
            print(
                " ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in result.items()
                ),
                flush=True,
            )
        del weights, prepared
        torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=sorted({k for r in results for k in r}))
            writer.writeheader()
            writer.writerows(results)
    print(
        f"\n{'geometry':16} {'tokens':>6} {'cutedsl us':>10} {'gmm us':>8} {'x':>5} {'TFLOP/s':>7} {'floor':>5} {'relL2':>8}"
    )
    for r in results:
        print(
            f"{r['geometry']:16} {r['tokens']:>6} {r.get('cutedsl_us', 0):>10.1f} "
            f"{r.get('grouped_mm_us', 0):>8.1f} {r.get('speedup', 0):>5.2f} "
            f"{r.get('cutedsl_tflops', 0):>7.1f} {r.get('cutedsl_of_floor', 0):>5.2f} "
            f"{r.get('cutedsl_relL2', 0):>8.1e}"
        )
    speedups = [r["speedup"] for r in results if "speedup" in r]
    if speedups:
        print(f"geometric-mean speedup over grouped_mm: {statistics.geometric_mean(speedups):.3f}")


if __name__ == "__main__":
    main()
