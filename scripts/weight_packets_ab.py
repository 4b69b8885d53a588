"""The expert MLP on the cutedsl backend's weight layouts against each other, bf16 and FP8:
row-major (as the backend prepares them: w13 as the model holds it where the gate-up GEMMs read
that order, else interleaved), packed (the weight-packet layout, `tile_pack=True`) and
interleaved (w13 as interleave_gate_up's copy).

    python3 scripts/weight_packets_ab.py --geometry qwen3-30b-a3b dsv3-ep8-local mixtral-8x7b \
        --tokens 1 16 128 2048 8192 --weight-dtype bf16 fp8 --rounds 3
    python3 scripts/weight_packets_ab.py --layouts row-major interleaved --geometry qwen3-30b-a3b \
        dsv3-ep8-local mixtral-8x7b --tokens 1 16 128 2048 8192 --weight-dtype bf16 fp8

Per (geometry, dtype, tokens): the batch `megamoe tune` times (the layer's router on random
tokens; FP8 rows quantized as the FP8 dispatch writes them) and the layer's weights prepared by
the cutedsl backend in each layout; then the whole MLP, gate-up then down on one stream, in
CUDA-graph replays, each GEMM cycling through copies of its weights so they come from HBM as in
a layer. Alternating rounds in one process; prints every reading, the first layout's best over
each other's and whether their outputs are bitwise equal to the first's (they must be).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from megamoe_kernels import interleave_gate_up
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.experts import CuteDSLExperts
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_runtime.measure import alternating_readings, median_graph_replay_seconds
from megamoe_torch import bench
from megamoe_torch.tune import TuningProblem, gemm_runners

LAYOUTS = ("row-major", "packed", "interleaved")


def prepared_in(layout: str, pack):
    """The cutedsl backend's (backend, prepared weights) of `pack` in `layout`."""
    backend = CuteDSLExperts(tile_pack=layout == "packed")
    prepared = backend.prepare(pack)
    if layout == "interleaved":
        prepared = replace(prepared, w13=interleave_gate_up(pack.w13_E2IH))
    return backend, prepared


@torch.no_grad()
def compare(
    layer, geometry_name: str, dtype: str, tokens: int, *, layouts, rounds: int, repeats: int
):
    device = torch.device("cuda")
    x_TH, ids, weights = bench.routed_tokens(layer, tokens)
    batch, _ = LocalDispatcher(layer.config.num_experts).dispatch(x_TH, ids, weights)
    pack = layer.expert_weight_pack()
    runners = {}
    for layout in layouts:
        backend, prepared = prepared_in(layout, pack)
        problem = TuningProblem(
            batch=batch, prepared=prepared, keys=backend.knob_keys(batch, prepared)
        )
        runners[layout] = (gemm_runners(problem), problem.keys)
    valid = int(batch.expert_offsets[-1])

    def mlp(name):
        gemms, (gate_up_op, down_op) = runners[name]
        gemms[gate_up_op](None)
        return gemms[down_op](None)

    outputs = {name: mlp(name)[:valid].clone().view(torch.int16) for name in runners}
    readings = alternating_readings(
        {
            name: lambda name=name: median_graph_replay_seconds(
                lambda: mlp(name), device=device, repeats=repeats
            )
            for name in runners
        },
        rounds=rounds,
    )
    first = layouts[0]
    columns = [f"{first} {readings[first].best * 1e6:8.1f} us ({readings[first]})"]
    for name in layouts[1:]:
        columns.append(
            f"{name} {readings[name].best * 1e6:8.1f} us ({readings[name]}) "
            f"{first}/{name} {readings[first].best / readings[name].best:.3f} "
            f"bitwise equal {torch.equal(outputs[first], outputs[name])}"
        )
    print(f"{geometry_name:16s} {dtype:5s} {tokens:6d} " + " | ".join(columns), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--geometry", nargs="+", required=True, choices=sorted(GEOMETRIES))
    parser.add_argument("--tokens", nargs="+", type=int, required=True)
    parser.add_argument("--weight-dtype", nargs="+", choices=["bf16", "fp8"], default=["bf16"])
    parser.add_argument(
        "--layouts",
        nargs="+",
        choices=LAYOUTS,
        default=["row-major", "packed"],
        help="the first is the baseline",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating timings per layout")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda")
    for geometry_name in args.geometry:
        for dtype in args.weight_dtype:
            layer = bench.build_layer(
                GEOMETRIES[geometry_name],
                device=device,
                dtype=torch.bfloat16,
                weight_dtype=None if dtype == "bf16" else dtype,
            )
            for tokens in args.tokens:
                compare(
                    layer,
                    geometry_name,
                    dtype,
                    tokens,
                    layouts=args.layouts,
                    rounds=args.rounds,
                    repeats=args.repeats,
                )
            del layer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
