"""Where the shared experts run on the fused path (one GPU), `MegaMoEConfig.shared_experts_path`:
in the routed experts' batch ("batch"), on a side stream beside the routed experts
("side_stream") or on the caller's stream after them ("caller_stream"). Graph replays and eager
forwards, alternating rounds, for the geometries with shared experts, and each path's rel-L2
against "side_stream" on the same tokens. Run on the GPU machine from the project root:

    python3 scripts/shared_experts_ab.py --geometry dsv3 --tokens 1 16 128 2048 8192

`--weight-dtype fp8`: routed and shared experts FP8, as DeepSeek-V3's checkpoints hold them
(build_layer), the batch holding the shared MLP's e4m3 blocks.
"""

from __future__ import annotations

import argparse
import gc

import torch
from megamoe_kernels.reference import relative_l2_error
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_torch.bench import (
    alternating_forward_times,
    build_layer,
    routed_tokens,
    with_capacity,
)

PATHS = ("batch", "side_stream", "caller_stream")


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--geometry", nargs="+", default=["dsv3"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 128, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--no-eager", action="store_true", help="graph replays only")
    parser.add_argument("--weight-dtype", choices=("bf16", "fp8"), default="bf16")
    args = parser.parse_args()
    device = torch.device("cuda")
    print(f"geometry tokens | graph us: {' / '.join(args.paths)} | eager us | rel-L2 vs side")
    for name in args.geometry:
        geometry = GEOMETRIES[name]
        base = build_layer(
            geometry,
            device=device,
            dtype=torch.bfloat16,
            weight_dtype=None if args.weight_dtype == "bf16" else args.weight_dtype,
        )
        for tokens in args.tokens:
            x_TH, _, _ = routed_tokens(base, tokens)
            layers = {
                path: with_capacity(base, tokens * geometry.top_k, shared_experts_path=path)
                for path in args.paths
            }
            for layer in layers.values():
                layer.use_backend("cutedsl")
            outputs = {path: layer(x_TH) for path, layer in layers.items()}
            reference = outputs.get("side_stream")
            errors = (
                " ".join(
                    f"{path} {relative_l2_error(y.float(), reference.float()):.1e}"
                    for path, y in outputs.items()
                    if path != "side_stream"
                )
                if reference is not None
                else "-"
            )
            listed = alternating_forward_times(
                {
                    path: lambda layer=layer, x_TH=x_TH: layer(x_TH)
                    for path, layer in layers.items()
                },
                device=device,
                rounds=args.rounds,
                eager=not args.no_eager,
            )
            print(f"{name} {tokens} | {listed['graph']} | {listed['eager']} | {errors}", flush=True)
            # each variant holds its own prepared weights (and its graphs): freed before the next
            del layers, outputs, reference
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
