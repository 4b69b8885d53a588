"""The shared experts on the caller's stream against a side stream beside the routed experts
(`MegaMoEConfig(shared_experts_on_side_stream=...)`), the fused path on one GPU: graph replays
and eager forwards, alternating rounds, for the geometries with shared experts. Run on the GPU
machine from the project root:

    python3 scripts/shared_experts_ab.py --geometry dsv3 --tokens 1 16 128 2048
"""

from __future__ import annotations

import argparse

import torch
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_torch.bench import (
    alternating_forward_times,
    build_layer,
    routed_tokens,
    with_capacity,
)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--geometry", nargs="+", default=["dsv3"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 128, 2048])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = torch.device("cuda")
    print("geometry tokens | graph us: same stream / side stream | eager us: same / side")
    for name in args.geometry:
        geometry = GEOMETRIES[name]
        base = build_layer(geometry, device=device, dtype=torch.bfloat16)
        for tokens in args.tokens:
            x_TH, _, _ = routed_tokens(base, tokens)
            layers = {
                side: with_capacity(
                    base, tokens * geometry.top_k, shared_experts_on_side_stream=side
                )
                for side in (False, True)
            }
            for layer in layers.values():
                layer.use_backend("cutedsl")
            listed = alternating_forward_times(
                {
                    side: lambda layer=layer, x_TH=x_TH: layer(x_TH)
                    for side, layer in layers.items()
                },
                device=device,
                rounds=args.rounds,
            )
            print(f"{name} {tokens} | {listed['graph']} | {listed['eager']}")


if __name__ == "__main__":
    main()
