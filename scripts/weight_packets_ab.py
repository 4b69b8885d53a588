"""The expert MLP on packed weights (the weight-packet layout, `tile_pack=True`) against the same
weights row-major, bf16 and FP8.

    python3 scripts/weight_packets_ab.py --geometry qwen3-30b-a3b dsv3-ep8-local mixtral-8x7b \
        --tokens 1 16 128 2048 8192 --weight-dtype bf16 fp8 --rounds 3

Per (geometry, dtype, tokens): the batch `megamoe tune` times (the layer's router on random
tokens; FP8 rows quantized as the FP8 dispatch writes them) and the layer's weights prepared by
the cutedsl backend twice, row-major and packed; then the whole MLP, gate-up then down on one
stream, in CUDA-graph replays, each GEMM cycling through copies of its weights so they come
from HBM as in a layer. Alternating rounds in one process; prints every reading, the ratio of
the best ones and whether the two outputs are bitwise equal (they must be).
"""

from __future__ import annotations

import argparse

import torch
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.experts import CuteDSLExperts
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_runtime.measure import alternating_readings, median_graph_replay_seconds
from megamoe_torch import bench
from megamoe_torch.tune import TuningProblem, gemm_runners


@torch.no_grad()
def compare(layer, geometry_name: str, dtype: str, tokens: int, *, rounds: int, repeats: int):
    device = torch.device("cuda")
    x_TH, ids, weights = bench.routed_tokens(layer, tokens)
    batch, _ = LocalDispatcher(layer.config.num_experts).dispatch(x_TH, ids, weights)
    pack = layer.expert_weight_pack()
    runners = {}
    for name, tile_pack in (("row-major", False), ("packed", True)):
        backend = CuteDSLExperts(tile_pack=tile_pack)
        prepared = backend.prepare(pack)
        problem = TuningProblem(
            batch=batch, prepared=prepared, keys=backend.knob_keys(batch, prepared)
        )
        runners[name] = (gemm_runners(problem), problem.keys)
    valid = int(batch.expert_offsets[-1])

    def mlp(name):
        gemms, (gate_up_op, down_op) = runners[name]
        gemms[gate_up_op](None)
        return gemms[down_op](None)

    outputs = {name: mlp(name)[:valid].clone() for name in runners}
    same = torch.equal(outputs["row-major"].view(torch.int16), outputs["packed"].view(torch.int16))
    readings = alternating_readings(
        {
            name: lambda name=name: median_graph_replay_seconds(
                lambda: mlp(name), device=device, repeats=repeats
            )
            for name in runners
        },
        rounds=rounds,
    )
    row_major, packed = readings["row-major"], readings["packed"]
    print(
        f"{geometry_name:16s} {dtype:5s} {tokens:6d} row-major {row_major.best * 1e6:8.1f} us "
        f"({row_major}) | packed {packed.best * 1e6:8.1f} us ({packed}) "
        f"row-major/packed {row_major.best / packed.best:.3f} bitwise equal {same}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--geometry", nargs="+", required=True, choices=sorted(GEOMETRIES))
    parser.add_argument("--tokens", nargs="+", type=int, required=True)
    parser.add_argument("--weight-dtype", nargs="+", choices=["bf16", "fp8"], default=["bf16"])
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
                    layer, geometry_name, dtype, tokens, rounds=args.rounds, repeats=args.repeats
                )
            del layer
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
