"""The fused layer's combine kernel against its down GEMM adding the rows into their tokens' rows
(`MegaMoEConfig(atomic_combine=...)`), the fused path on one GPU with the cutedsl backend: the
whole layer as CUDA-graph replays (a fixed capacity) and eager forwards, alternating rounds;
the expert GEMMs alone on the same batch in the same run (the layer bench's GEMMs, graph
replays) and each layer's graph time over them (the median of its rounds); and the two
outputs' rel-L2 apart (the atomic adds are not deterministic). Run on the GPU machine from
the project root:

    python3 scripts/atomic_combine_ab.py --geometry qwen3-30b-a3b --tokens 1 16 128 2048 8192
    python3 scripts/atomic_combine_ab.py --weight-dtype fp8 ...   # FP8 experts
"""

from __future__ import annotations

import argparse

import torch
from megamoe_kernels.reference import relative_l2_error
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_torch.bench import (
    alternating_forward_readings,
    build_layer,
    expert_compute_seconds,
    listed_forward_times,
    routed_tokens,
    with_capacity,
)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--geometry", nargs="+", default=["qwen3-30b-a3b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 128, 2048, 8192])
    parser.add_argument("--weight-dtype", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-eager", action="store_true", help="graph replays only")
    args = parser.parse_args()
    device = torch.device("cuda")
    weight_dtype = None if args.weight_dtype == "bf16" else "fp8"
    print(
        f"{args.weight_dtype} experts | geometry tokens | graph us: ordered / atomic | "
        "eager us: ordered / atomic | GEMMs us | layer / GEMMs: ordered / atomic | rel-L2 apart"
    )
    for name in args.geometry:
        geometry = GEOMETRIES[name]
        base = build_layer(geometry, device=device, dtype=torch.bfloat16, weight_dtype=weight_dtype)
        for tokens in args.tokens:
            x_TH, _, _ = routed_tokens(base, tokens)
            ordered = with_capacity(base, tokens * geometry.top_k)
            layers = {
                False: ordered,
                # one copy of the prepared weights for both
                True: with_capacity(
                    base, tokens * geometry.top_k, prepared_like=ordered, atomic_combine=True
                ),
            }
            for layer in layers.values():
                layer.use_backend("cutedsl")
            apart = relative_l2_error(layers[True](x_TH).float(), layers[False](x_TH).float())
            readings = alternating_forward_readings(
                {
                    atomic: lambda layer=layer, x_TH=x_TH: layer(x_TH)
                    for atomic, layer in layers.items()
                },
                device=device,
                rounds=args.rounds,
                eager=not args.no_eager,
            )
            listed = listed_forward_times(readings)
            gemms = expert_compute_seconds(ordered, geometry, tokens, backend_name="cutedsl")
            over_gemms = " / ".join(
                f"{readings['graph', atomic].median / gemms:.3f}" for atomic in layers
            )
            print(
                f"{name} {tokens} | {listed['graph']} | {listed['eager']} | {gemms * 1e6:.1f} | "
                f"{over_gemms} | {apart:.2e}",
                flush=True,
            )
            del layers, ordered
        del base  # each geometry's weights (and their prepared copies) leave before the next
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
