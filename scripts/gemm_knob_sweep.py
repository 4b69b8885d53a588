"""Times chosen knob sets of both expert GEMMs, one after the other on the same batch.

    python3 scripts/gemm_knob_sweep.py --geometry qwen3-30b-a3b dsv3 --tokens 2048 8192 \
        [--clusters 1 2] [--stages 3 max]
    python3 scripts/gemm_knob_sweep.py --geometry dsv3-ep8-local --tokens 1 --split-k 1 2 4 8
    python3 scripts/gemm_knob_sweep.py --geometry qwen3-30b-a3b --tokens 8192 --shapes 128x256 \
        --clusters 1 2 --rounds 3
    python3 scripts/gemm_knob_sweep.py --geometry dsv3-ep8-local --tokens 2048 --weight-dtype fp8 \
        --shapes 128x128swap 64x128 64x128pp 128x128 --rounds 2
    python3 scripts/gemm_knob_sweep.py --geometry dsv3 --tokens 4096 --shapes 128x256 \
        --tail-rows 0 16 --stages 3 --rounds 3

Per (geometry, tokens): the layer's own router on random tokens, the tight expert-major batch,
then each GEMM with each tile shape of SHAPES, in each cluster size and ring depth asked for
("max": the deepest that fits; default), CUDA-graph replay; prints us, TFLOP/s and the largest
difference from the first variant's output (every variant computes the same sums in the same
order, so 0 is expected). `megamoe tune` searches every
valid combination and stores the winner; this is the quick side-by-side look. --shapes keeps
only the named tile shapes (ROWSxCOLS, ROWSxCOLSpp for pingpong, ROWSxCOLSswap for the swap-AB
decode tiles); a shape invalid for an op (knob_problems) is left out of that op's variants.
--rounds times every variant that many times, alternating, and prints each reading: a
difference smaller than the readings' spread is noise. --weight-dtype fp8 times the FP8 GEMMs
(gate_up_fp8, down_fp8) on e4m3 rows and block-scaled weights, as `megamoe tune` does; their
weight stream counts one byte per weight.

--tail-rows times each shape with each of these tail rows (GemmKnobs.tail_rows; an invalid pair,
such as a tail with pingpong or FP8, is left out).

--split-k times the batch's default-profile knobs (swap-AB at decode) with each split-K instead
of SHAPES, and also prints the weight stream's rate (the bytes of every expert with rows over the
time): split-K sums in another order, so its differences are rounding, not 0.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import replace

import torch
from megamoe_kernels import GemmKnobs, default_knobs, knob_problems
from megamoe_kernels.shim.knobs import max_stages
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_runtime.measure import (
    alternating_readings,
    gigabytes_per_second,
    median_graph_replay_seconds,
    tflops,
)
from megamoe_torch.tune import gemm_runners, tuning_problem

# (tile_rows, tile_cols, pingpong, swap_ab)
SHAPES = [
    (128, 256, False, False),
    (64, 256, True, False),
    (128, 128, True, False),
    (128, 128, False, False),
    (64, 192, True, False),
    (128, 192, False, False),
]


def parse_shape(text: str) -> tuple[int, int, bool, bool]:
    """A tile shape argument: 128x256 -> (128, 256, False, False), 64x256pp -> (64, 256, True,
    False), 128x128swap -> (128, 128, False, True)."""
    pingpong, swap_ab = text.endswith("pp"), text.endswith("swap")
    rows, _, cols = text.removesuffix("pp").removesuffix("swap").partition("x")
    if not (rows.isdigit() and cols.isdigit()):
        raise argparse.ArgumentTypeError(
            f"tile shape {text!r}: expected ROWSxCOLS, ROWSxCOLSpp or ROWSxCOLSswap, e.g. 128x256, "
            "64x256pp or 128x128swap"
        )
    return int(rows), int(cols), pingpong, swap_ab


@torch.no_grad()
def sweep(
    geometry_name: str,
    tokens: int,
    *,
    repeats: int,
    clusters: list[int],
    stages: list[str],
    splits: list[int] | None,
    shapes: list[tuple[int, int, bool, bool]],
    tails: list[int],
    rounds: int,
    weight_dtype: str,
) -> None:
    device = torch.device("cuda")
    geometry = GEOMETRIES[geometry_name]
    fp8 = weight_dtype == "fp8"
    problem = tuning_problem(geometry, tokens, device=device, weight_dtype="fp8" if fp8 else None)
    batch, runners = problem.batch, gemm_runners(problem)
    valid = int(batch.expert_offsets[-1])
    experts_with_rows = int((batch.expert_offsets.diff() > 0).sum())
    for op, key in problem.keys.items():
        n, k, run = key.out_features, key.in_features, runners[op]
        flops = 2 * valid * n * k
        weight_bytes = experts_with_rows * n * k * (1 if fp8 else 2)
        first = None
        variants = []
        if splits:
            profile = default_knobs(op, batch.capacity / geometry.num_experts)
            variants = [replace(profile, split_k=split) for split in splits]
        for (tile_rows, tile_cols, pingpong, swap_ab), cluster, tail in itertools.product(
            [] if splits else shapes, clusters, tails
        ):
            shape = GemmKnobs(
                tile_rows=tile_rows,
                tile_cols=tile_cols,
                pingpong=pingpong,
                swap_ab=swap_ab,
                cluster=(cluster, 1),
                tail_rows=tail,
            )
            for depth in stages:
                knobs = replace(
                    shape, stages=max_stages(shape, op) if depth == "max" else int(depth)
                )
                if knobs not in variants and not knob_problems(knobs, op):
                    variants.append(knobs)
        differences = []
        for knobs in variants:
            out = run(knobs)
            out = (out[0] if isinstance(out, tuple) else out)[:valid].float()  # FP8: e4m3, scales
            first = out if first is None else first
            differences.append((out - first).abs().max().item())
        readings = alternating_readings(
            {
                index: lambda knobs=knobs, run=run: median_graph_replay_seconds(
                    lambda: run(knobs), device=device, repeats=repeats
                )
                for index, knobs in enumerate(variants)
            },
            rounds=rounds,
        )
        for index, (knobs, difference) in enumerate(zip(variants, differences, strict=True)):
            seconds = readings[index].best
            all_readings = str(readings[index])
            print(
                f"{geometry_name:16s} {tokens:6d} {op:11s} {knobs.tile_rows}x{knobs.tile_cols}"
                f"{' swap' if knobs.swap_ab else ''}{' pingpong' if knobs.pingpong else '':9s} "
                f"cluster={knobs.cluster[0]} split_k={knobs.split_k} tail={knobs.tail_rows:2d} "
                f"stages={knobs.stages:2d} "
                f"{seconds * 1e6:9.1f} us {tflops(flops, seconds):6.0f} TFLOP/s "
                f"weights {gigabytes_per_second(weight_bytes, seconds) / 1e3:5.2f} TB/s "
                f"max difference {difference:.3g}"
                + (f" (readings {all_readings} us)" if rounds > 1 else ""),
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--geometry", nargs="+", required=True, choices=sorted(GEOMETRIES))
    parser.add_argument("--tokens", nargs="+", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--clusters", nargs="+", type=int, default=[1], choices=[1, 2])
    parser.add_argument("--stages", nargs="+", default=["max"], help="ring depths, or max")
    parser.add_argument(
        "--split-k", nargs="+", type=int, help="time the default profile with these split-Ks"
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=parse_shape,
        default=SHAPES,
        help="tile shapes ROWSxCOLS, ROWSxCOLSpp for pingpong, ROWSxCOLSswap for swap-AB "
        "(default: all of SHAPES)",
    )
    parser.add_argument(
        "--tail-rows", nargs="+", type=int, default=[0], help="tail rows of each shape (0: none)"
    )
    parser.add_argument("--rounds", type=int, default=1, help="alternating timings per variant")
    parser.add_argument(
        "--weight-dtype",
        choices=["bf16", "fp8"],
        default="bf16",
        help="bf16 experts, or fp8 (e4m3 weights with 128x128 block scales, e4m3 rows)",
    )
    args = parser.parse_args()
    for geometry_name in args.geometry:
        for tokens in args.tokens:
            sweep(
                geometry_name,
                tokens,
                repeats=args.repeats,
                clusters=args.clusters,
                stages=args.stages,
                splits=args.split_k,
                shapes=args.shapes,
                tails=args.tail_rows,
                rounds=args.rounds,
                weight_dtype=args.weight_dtype,
            )


if __name__ == "__main__":
    main()
