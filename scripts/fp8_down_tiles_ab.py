"""The FP8 expert MLP at decode with the down GEMM's default swap-AB tiles against 128-column ones.

    python3 scripts/fp8_down_tiles_ab.py --geometry qwen3-30b-a3b dsv3-ep8-local mixtral-8x7b \
        --tokens 1 4 16 --rounds 3

Per (geometry, tokens): the batch and FP8 weights `megamoe tune --weight-dtype fp8` times
(tune.tuning_problem: the layer's router on random tokens, rows quantized as the FP8 dispatch
writes them), then the whole MLP, gate-up then down on one stream (the down GEMM launched with
programmatic dependent launch behind the gate-up), in CUDA-graph replays, each GEMM cycling
through copies of its weights so they come from HBM as in a layer. "default": the down GEMM's
default launches (the 16-row tile takes 64 columns, or 128 where they fit beside the gate-up
grid); "wide": the same tile with 128 columns. Alternating rounds; prints every reading and
the largest difference between the two outputs (the same sums in the same order: 0 expected).
Points whose default already takes 128 columns are skipped.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from megamoe_kernels import default_knobs
from megamoe_kernels.shim.knobs import SWAP_COL_TILES, max_stages
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_runtime.measure import alternating_readings, median_graph_replay_seconds
from megamoe_torch.tune import gemm_runners, tuning_problem


@torch.no_grad()
def compare(geometry_name: str, tokens: int, *, rounds: int, repeats: int) -> None:
    device = torch.device("cuda")
    geometry = GEOMETRIES[geometry_name]
    problem = tuning_problem(geometry, tokens, device=device, weight_dtype="fp8")
    runners = gemm_runners(problem)
    gate_up_op, down_op = problem.keys
    profile = default_knobs(down_op, problem.batch.capacity / geometry.num_experts)
    if not profile.swap_ab or profile.tile_cols == SWAP_COL_TILES[-1]:
        print(f"{geometry_name:16s} {tokens:6d} default already {profile.tile_cols} columns")
        return
    wide = replace(profile, tile_cols=SWAP_COL_TILES[-1])
    wide = replace(wide, stages=max_stages(wide, down_op))
    variants = {"default": None, "wide": wide}
    valid = int(problem.batch.expert_offsets[-1])
    outputs = {name: runners[down_op](knobs)[:valid].float() for name, knobs in variants.items()}
    difference = (outputs["default"] - outputs["wide"]).abs().max().item()

    def mlp_seconds(knobs):
        def mlp():
            runners[gate_up_op](None)
            return runners[down_op](knobs)

        return median_graph_replay_seconds(mlp, device=device, repeats=repeats)

    readings = alternating_readings(
        {name: lambda knobs=knobs: mlp_seconds(knobs) for name, knobs in variants.items()},
        rounds=rounds,
    )
    default, wide_readings = readings["default"], readings["wide"]
    print(
        f"{geometry_name:16s} {tokens:6d} {profile.tile_rows}x{profile.tile_cols} "
        f"{default.best * 1e6:7.1f} us ({default}) | {wide.tile_rows}x{wide.tile_cols} "
        f"stages={wide.stages} {wide_readings.best * 1e6:7.1f} us ({wide_readings}) "
        f"default/wide {default.best / wide_readings.best:.3f} max difference {difference:.3g}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--geometry", nargs="+", required=True, choices=sorted(GEOMETRIES))
    parser.add_argument("--tokens", nargs="+", type=int, required=True)
    parser.add_argument("--rounds", type=int, default=3, help="alternating timings per variant")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    for geometry_name in args.geometry:
        for tokens in args.tokens:
            compare(geometry_name, tokens, rounds=args.rounds, repeats=args.repeats)


if __name__ == "__main__":
    main()
