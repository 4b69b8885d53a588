"""Times chosen knob sets of both expert GEMMs, one after the other on the same batch.

    python3 scripts/gemm_knob_sweep.py --geometry qwen3-30b-a3b dsv3 --tokens 2048 8192

Per (geometry, tokens): the layer's own router on random tokens, the tight expert-major batch,
then each GEMM with each tile shape of SHAPES (the deepest ring that fits), CUDA-graph replay;
prints us, TFLOP/s and the largest difference from the first variant's output (every variant
computes the same sums in the same order, so 0 is expected). `megamoe tune` searches every
valid combination and stores the winner; this is the quick side-by-side look.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from megamoe_kernels import GemmKnobs, down, gate_up_swiglu, knob_problems
from megamoe_kernels.shim.knobs import max_stages
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.experts.cutedsl import CuteDSLExperts
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_runtime.weights import Unquantized
from megamoe_torch import bench
from megamoe_torch.timing import median_graph_replay_seconds

# (tile_rows, tile_cols, pingpong)
SHAPES = [
    (128, 256, False),
    (64, 256, True),
    (128, 128, True),
    (128, 128, False),
    (64, 192, True),
    (128, 192, False),
]


@torch.no_grad()
def sweep(geometry_name: str, tokens: int, *, repeats: int) -> None:
    device = torch.device("cuda")
    geometry = GEOMETRIES[geometry_name]
    layer = bench.build_layer(geometry, device=device, dtype=torch.bfloat16)
    x_TH, ids, weights = bench.routed_tokens(layer, tokens)
    batch, _ = LocalDispatcher(geometry.num_experts).dispatch(x_TH, ids, weights)
    prepared = CuteDSLExperts().prepare(
        Unquantized(w13_E2IH=layer.w13.detach(), w2_EHI=layer.w2.detach())
    )
    hidden_MI = gate_up_swiglu(batch.rows_MH, batch.expert_offsets, prepared.w13_EB2GH)
    valid = int(batch.expert_offsets[-1])
    hidden, intermediate = geometry.hidden_size, geometry.intermediate_size
    ops = {
        "gate_up": (
            2 * valid * 2 * intermediate * hidden,
            lambda knobs: gate_up_swiglu(
                batch.rows_MH, batch.expert_offsets, prepared.w13_EB2GH, knobs=knobs
            ),
        ),
        "down": (
            2 * valid * hidden * intermediate,
            lambda knobs: down(hidden_MI, batch.expert_offsets, prepared.w2_EHI, knobs=knobs),
        ),
    }
    for op, (flops, run) in ops.items():
        first = None
        for tile_rows, tile_cols, pingpong in SHAPES:
            shape = GemmKnobs(tile_rows=tile_rows, tile_cols=tile_cols, pingpong=pingpong)
            knobs = replace(shape, stages=max_stages(shape, op))
            if knob_problems(knobs, op):
                continue
            out = run(knobs)[:valid].float()
            first = out if first is None else first
            difference = (out - first).abs().max().item()
            seconds = median_graph_replay_seconds(
                lambda knobs=knobs, run=run: run(knobs), device=device, repeats=repeats
            )
            print(
                f"{geometry_name:16s} {tokens:6d} {op:8s} {tile_rows}x{tile_cols}"
                f"{' pingpong' if pingpong else '':9s} stages={knobs.stages:2d} "
                f"{seconds * 1e6:9.1f} us {flops / seconds / 1e12:6.0f} TFLOP/s "
                f"max difference {difference:.3g}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--geometry", nargs="+", required=True, choices=sorted(GEOMETRIES))
    parser.add_argument("--tokens", nargs="+", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    for geometry_name in args.geometry:
        for tokens in args.tokens:
            sweep(geometry_name, tokens, repeats=args.repeats)


if __name__ == "__main__":
    main()
