"""Runs each expert GEMM of one point once inside an NVTX range named "profile", for Nsight
Compute to profile just those launches:

    ncu --clock-control none --nvtx --nvtx-include "profile/" --section SpeedOfLight \\
        --section WarpStateStats python3 scripts/ncu_gemm.py qwen3-30b-a3b 8192 fp8 128x256

Arguments: a geometry, a token count, bf16 or fp8, and tile shapes as gemm_knob_sweep.py takes
them (ROWSxCOLS, ROWSxCOLSpp for pingpong, ROWSxCOLSswap for swap-AB; each at the deepest ring
that fits). The batch is the one `gemm_knob_sweep.py` times
(the geometry's router on random tokens, the tight expert-major batch); each GEMM runs twice
first, so compilation and the first launches stay outside the range.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from gemm_knob_sweep import parse_shape  # this script's folder: one syntax for tile shapes
from megamoe_kernels import GemmKnobs
from megamoe_kernels.shim.knobs import max_stages
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_torch.tune import gemm_runners, tuning_problem


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("geometry", choices=sorted(GEOMETRIES))
    parser.add_argument("tokens", type=int)
    parser.add_argument("weight_dtype", choices=["bf16", "fp8"])
    parser.add_argument("shapes", nargs="+", type=parse_shape)
    args = parser.parse_args()
    problem = tuning_problem(
        GEOMETRIES[args.geometry],
        args.tokens,
        device=torch.device("cuda"),
        weight_dtype="fp8" if args.weight_dtype == "fp8" else None,
    )
    for op, run in gemm_runners(problem).items():
        for tile_rows, tile_cols, pingpong, swap_ab in args.shapes:
            knobs = GemmKnobs(
                tile_rows=tile_rows, tile_cols=tile_cols, pingpong=pingpong, swap_ab=swap_ab
            )
            knobs = replace(knobs, stages=max_stages(knobs, op))
            run(knobs)
            run(knobs)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("profile")
            run(knobs)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            print(op, knobs, flush=True)


if __name__ == "__main__":
    main()
