"""Burst and sustained rate of the expert GEMMs and of a dense matmul, with the SM clock and power.

    python3 scripts/sustained_rate.py --geometry qwen3-30b-a3b dsv3-ep8-local --tokens 8192

The roofline floor's 788 TFLOP/s (docs/benchmarks.md) is a burst: ten 8192^3 products after three
warm-ups, about 20 ms, in which the SM clock stays at its 1980 MHz boost. A benchmark that keeps the
GPU busy for longer runs into the board's power limit, and the clock drops to what the limit allows.
For each workload this script idles a few seconds (the clock and the power budget recover), runs ten
calls to warm up and times ten more (the burst), then keeps replaying until `--hold` seconds have
passed and takes the median rate of the last half (sustained). nvidia-smi samples the SM clock, the
power draw and the clock-limit reasons every 50 ms meanwhile (0x4: the software power cap). Each
workload is one CUDA graph of ten calls; the expert GEMMs run on the default-profile knobs and read
their weights cold (the same runners as `megamoe tune` and scripts/gemm_knob_sweep.py). The dense
matmul runs first and last, so a drift of the card between them shows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from megamoe_kernels import default_knobs
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_runtime.measure import SmiSampler, captured_graph, tflops
from megamoe_torch.tune import gemm_runners, tuning_problem

CALLS = 10  # calls per captured graph


def seconds_per_call(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * CALLS)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--geometry", nargs="+", required=True, choices=sorted(GEOMETRIES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[8192])
    parser.add_argument("--idle", type=float, default=3.0, help="seconds idle before each")
    parser.add_argument("--hold", type=float, default=4.0, help="seconds of replay after it")
    args = parser.parse_args()
    device = torch.device("cuda")

    size = 8192
    a, b = (torch.randn(size, size, device=device, dtype=torch.bfloat16) for _ in range(2))
    product = torch.empty(size, size, device=device, dtype=torch.bfloat16)
    dense = ("dense matmul 8192^3", lambda: torch.mm(a, b, out=product), 2 * size**3)
    workloads = [dense]
    for geometry_name in args.geometry:
        geometry = GEOMETRIES[geometry_name]
        for tokens in args.tokens:
            problem = tuning_problem(geometry, tokens, device=device)
            runners = gemm_runners(problem)
            valid = int(problem.batch.expert_offsets[-1])
            rows_per_expert = problem.batch.capacity / geometry.num_experts
            for op, key in problem.keys.items():
                knobs = default_knobs(op, rows_per_expert)
                workloads.append(
                    (
                        f"{geometry_name} {tokens} {op}",
                        lambda run=runners[op], knobs=knobs: run(knobs),
                        2 * valid * key.out_features * key.in_features,
                    )
                )
    workloads.append((dense[0] + " (again)", *dense[1:]))
    graphs = [captured_graph(fn, device=device, calls=CALLS) for _, fn, _ in workloads]
    torch.cuda.synchronize()

    sampler = SmiSampler()
    print(
        f"{'workload':34s} {'burst':>6s} {'sustained':>9s} TFLOP/s   SM MHz  power W  limits",
        flush=True,
    )
    for (name, _, flops), graph in zip(workloads, graphs, strict=True):
        time.sleep(args.idle)
        began = time.time()
        graph.replay()  # the warm-up: the clock leaves its idle state
        burst = seconds_per_call(graph, replays=1)
        readings = []
        while time.time() - began < args.hold:
            readings.append((time.time(), seconds_per_call(graph, replays=10)))
        ended = time.time()
        late_start = ended - args.hold / 2
        sustained = statistics.median(
            [s for at, s in readings if at >= late_start] or [readings[-1][1]]
        )
        clock = sampler.median_of("clocks.sm", late_start, ended)
        power = sampler.median_of("power.draw", late_start, ended)
        late = sampler.between(late_start, ended)
        reasons_at = sampler.fields.index("clocks_event_reasons.active")
        reasons = " ".join(sorted({values[reasons_at] for _, values in late})) or "-"
        print(
            f"{name:34s} {tflops(flops, burst):6.0f} {tflops(flops, sustained):9.0f}"
            f"           {clock:6.0f} {power:8.0f}  {reasons}",
            flush=True,
        )
    sampler.stop()


if __name__ == "__main__":
    main()
