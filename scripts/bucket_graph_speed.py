"""Forwards past eager_graph_tokens replayed from the graph of their bucket (bucket_graph_tokens,
forward_graphs.py) against the same forwards launching their kernels, at real sizes.

For each geometry and token count: a layer (build_layer's random weights, no fixed capacity,
cutedsl) with bucket_graph_tokens set and the same layer with none (the same tensors and
prepared weights), their eager forwards alternating between two copies of the tokens as a
model's activations move; in `--rounds` rounds, each layer's median wall time per forward and
host time per forward (the CPU time to issue it, the GPU drained first), the two layers in
turns; and the rel-L2 of their outputs. A count below its bucket's rows pays for the router
GEMM over the bucket's rows; the table says which bucket each count replays. Run on the GPU
machine from the project root (docs/benchmarks.md, "Setting up a GPU machine"):

    python3 scripts/bucket_graph_speed.py --geometry qwen3-30b-a3b --tokens 129 1500 2048 8192
"""

from __future__ import annotations

import argparse

import torch
from megamoe_kernels.reference import relative_l2_error
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_runtime.measure import (
    alternating_readings,
    format_columns,
    host_seconds_per_call,
    median_seconds,
)
from megamoe_torch.bench import build_layer, calls_in_turn, with_capacity


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", nargs="+", default=["qwen3-30b-a3b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[129, 1500, 2048, 8192])
    parser.add_argument("--bucket-graph-tokens", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    for name in args.geometry:
        base = build_layer(GEOMETRIES[name], device=device, dtype=torch.bfloat16)
        bucketed = with_capacity(base, None, bucket_graph_tokens=args.bucket_graph_tokens)
        launched = with_capacity(base, None, prepared_like=bucketed)
        for layer in (bucketed, launched):
            layer.use_backend("cutedsl")
        del base
        for tokens in args.tokens:
            generator = torch.Generator(device=device).manual_seed(tokens)
            x_TH = torch.randn(
                tokens, bucketed.config.hidden_size, device=device, generator=generator
            ).bfloat16()
            copies = (x_TH, x_TH.clone())
            forwards = {
                "bucket": calls_in_turn(bucketed, copies),
                "launched": calls_in_turn(launched, copies),
            }
            for forward in forwards.values():  # launched, captured, replayed
                for _ in range(3):
                    forward()
            error = relative_l2_error(bucketed(x_TH), launched(x_TH))
            readers = {}
            for label, forward in forwards.items():
                readers["wall", label] = lambda forward=forward: median_seconds(
                    forward, device=device, repeats=args.repeats
                )
                readers["host", label] = lambda forward=forward: host_seconds_per_call(
                    forward, device=device
                )
            readings = alternating_readings(readers, rounds=args.rounds)
            bucket = bucketed._forward_graphs.bucket_of(tokens)
            captured = {key[0] for key in bucketed._forward_graphs._graphs}
            replays = ("bucket", bucket, bucketed.config.hidden_size) in captured
            rows.append(
                [
                    name,
                    str(tokens),
                    str(bucket) if replays else "launched",
                    readings["host", "bucket"].median_and_range_us(),
                    readings["host", "launched"].median_and_range_us(),
                    readings["wall", "bucket"].median_and_range_us(),
                    readings["wall", "launched"].median_and_range_us(),
                    f"{error:.1e}",
                ]
            )
            print(format_columns(HEADER, rows[-1:]), flush=True)
        del bucketed, launched
        torch.cuda.empty_cache()
    print()
    print(format_columns(HEADER, rows))


HEADER = [
    "geometry",
    "tokens",
    "bucket",
    "host us, bucket",
    "host us, launched",
    "wall us, bucket",
    "wall us, launched",
    "rel-L2",
]

if __name__ == "__main__":
    main()
