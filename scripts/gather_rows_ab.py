"""The gate-up GEMM reading its rows from the tokens against the dispatch copying them out
(`MegaMoEConfig(gather_rows=...)`), the fused path on one GPU with the cutedsl backend: graph
replays and eager forwards, alternating rounds, each pair checked bitwise equal. Run on the GPU
machine from the project root:

    python3 scripts/gather_rows_ab.py --geometry qwen3-30b-a3b --tokens 1 16 128 2048 8192

--gemm times the gate-up GEMM alone instead (uniform random top-k routing, the default
profile): on rows copied out, gathered from the tokens, and gathered in order from the copied
rows themselves (the same addresses the copy reads, through the gathering loads).
"""

from __future__ import annotations

import argparse

import torch
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_runtime.measure import alternating_readings, median_graph_replay_seconds
from megamoe_torch.bench import (
    alternating_forward_times,
    build_layer,
    routed_tokens,
    with_capacity,
)


def gemm_alone(geometry, tokens: int, rounds: int, device: torch.device) -> None:
    """The gate-up GEMM alone on copied and on gathered rows, alternating rounds."""
    from megamoe_kernels import gate_up_swiglu, interleave_gate_up

    experts, hidden, top_k = geometry.num_experts, geometry.hidden_size, geometry.top_k
    generator = torch.Generator(device=device).manual_seed(0)
    x_TH = torch.randn(tokens, hidden, device=device, generator=generator).bfloat16()
    scores = torch.rand(tokens, experts, device=device, generator=generator)
    flat_ids = scores.topk(top_k, dim=1).indices.flatten()
    source_M = (torch.sort(flat_ids, stable=True).indices // top_k).to(torch.int32)
    offsets = torch.zeros(experts + 1, dtype=torch.int32, device=device)
    offsets[1:] = torch.cumsum(torch.bincount(flat_ids, minlength=experts), 0)
    rows_MH = x_TH[source_M.long()]
    in_order = torch.arange(rows_MH.shape[0], dtype=torch.int32, device=device)
    w13 = interleave_gate_up(
        (
            torch.randn(
                experts, 2 * geometry.intermediate_size, hidden, device=device, generator=generator
            )
            / hidden**0.5
        ).bfloat16()
    )
    valid = rows_MH.shape[0]
    cases = {
        "copied": lambda: gate_up_swiglu(rows_MH, offsets, w13, valid_rows=valid),
        "gathered": lambda: gate_up_swiglu(
            x_TH, offsets, w13, valid_rows=valid, row_source_M=source_M
        ),
        "gathered in order": lambda: gate_up_swiglu(
            rows_MH, offsets, w13, valid_rows=valid, row_source_M=in_order
        ),
    }
    equal = torch.equal(cases["copied"](), cases["gathered"]())
    readings = alternating_readings(
        {
            name: lambda call=call: median_graph_replay_seconds(call, device=device)
            for name, call in cases.items()
        },
        rounds=rounds,
    )
    print(
        f"{geometry.name} {tokens} gate-up us | "
        + " | ".join(
            f"{name} " + " ".join(f"{t * 1e6:.1f}" for t in readings[name].seconds)
            for name in cases
        )
        + f" | equal {equal}",
        flush=True,
    )


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--geometry", nargs="+", default=["qwen3-30b-a3b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 128, 2048, 8192])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-eager", action="store_true", help="graph replays only")
    parser.add_argument("--gemm", action="store_true", help="the gate-up GEMM alone")
    args = parser.parse_args()
    device = torch.device("cuda")
    if args.gemm:
        for name in args.geometry:
            for tokens in args.tokens:
                gemm_alone(GEOMETRIES[name], tokens, args.rounds, device)
        return
    print("geometry tokens | graph us: copied / gathered | eager us: copied / gathered | equal")
    for name in args.geometry:
        geometry = GEOMETRIES[name]
        base = build_layer(geometry, device=device, dtype=torch.bfloat16)
        for tokens in args.tokens:
            x_TH, _, _ = routed_tokens(base, tokens)
            layers = {
                gather: with_capacity(base, tokens * geometry.top_k, gather_rows=gather)
                for gather in (False, True)
            }
            for layer in layers.values():
                layer.use_backend("cutedsl")
            equal = torch.equal(layers[False](x_TH), layers[True](x_TH))
            listed = alternating_forward_times(
                {
                    gather: lambda layer=layer, x_TH=x_TH: layer(x_TH)
                    for gather, layer in layers.items()
                },
                device=device,
                rounds=args.rounds,
                eager=not args.no_eager,
            )
            print(f"{name} {tokens} | {listed['graph']} | {listed['eager']} | {equal}", flush=True)
            del layers
        del base  # each geometry's weights (and their prepared copies) leave before the next
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
