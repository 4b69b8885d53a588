"""The host time of MegaMoE's eager forwards: this tree's layer against another build's, in one
process, in turns. Run on the GPU machine from the project root, with the other build's
megamoe_torch sources extracted beside it:

    mkdir -p ab/base && git archive <rev> packages/megamoe-torch/src | tar -x -C ab/base
    python3 scripts/layer_host_ab.py --base ab/base/packages/megamoe-torch/src/megamoe_torch \
        --geometry qwen3-30b-a3b --tokens 512 8192

The other build's layer.py and forward_graphs.py are loaded as modules of their own (the rest of
megamoe comes from this tree), and one layer, built by this tree, takes either build's classes
in turn (its instance's __class__ swapped between readings): the builds must hold the same
attributes, as host-path changes to the forward's methods do. The layer first replays a
one-token forward from its own graph, as a serving process's decode does. Each round reads each
build's median host time of single forwards, each issued after the GPU drained, and of 50
forwards in a row with the GPU running behind (megamoe_runtime.measure.host_seconds_per_call);
the builds' outputs are compared bit for bit.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_runtime.measure import alternating_readings, host_seconds_per_call
from megamoe_torch import forward_graphs, layer
from megamoe_torch.bench import build_layer, routed_tokens, with_capacity


def load_module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and typing resolve names through it
    spec.loader.exec_module(module)
    return module


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", type=Path, required=True, help="the other build's megamoe_torch")
    parser.add_argument("--geometry", nargs="+", default=["qwen3-30b-a3b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[512, 8192])
    parser.add_argument("--weight-dtype", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    base_graphs = load_module("base_forward_graphs", args.base / "forward_graphs.py")
    base_layer = load_module("base_layer", args.base / "layer.py")
    builds = {
        "base": (base_layer.MegaMoE, base_graphs.ForwardGraphs),
        "this tree": (layer.MegaMoE, forward_graphs.ForwardGraphs),
    }
    device = torch.device("cuda")
    weight_dtype = None if args.weight_dtype == "bf16" else args.weight_dtype
    for name in args.geometry:
        geometry = GEOMETRIES[name]
        built = build_layer(
            geometry, device=device, dtype=torch.bfloat16, weight_dtype=weight_dtype
        )
        for tokens in args.tokens:
            moe = with_capacity(built, tokens * geometry.top_k)
            moe.use_backend("cutedsl")
            x_TH, _, _ = routed_tokens(built, tokens)
            one_token, _, _ = routed_tokens(built, 1)
            for _ in range(3):  # launched, captured, replayed
                moe(one_token)
            print(f"{name} {args.weight_dtype} {tokens} tokens, host us per eager forward:")
            compare(moe, x_TH, builds, rounds=args.rounds)


def compare(moe, x_TH: torch.Tensor, builds: dict, *, rounds: int) -> None:
    """Prints each build's readings (alternating rounds) and whether their outputs are equal."""
    device = x_TH.device

    def take(build: str) -> None:
        moe.__class__, moe._forward_graphs.__class__ = builds[build]

    def reader(build: str, calls: int):
        def read() -> float:
            take(build)
            return host_seconds_per_call(
                lambda: moe(x_TH),
                device=device,
                rounds=21 if calls == 1 else 5,
                calls_per_round=calls,
            )

        return read

    readers = {(build, calls): reader(build, calls) for build in builds for calls in (1, 50)}
    readings = alternating_readings(readers, rounds=rounds)
    outputs = []
    for build in builds:
        take(build)
        outputs.append(moe(x_TH).clone())
    take("this tree")
    for (build, calls), reading in readings.items():
        times = " ".join(f"{t * 1e6:.1f}" for t in reading.seconds)
        what = "single forwards" if calls == 1 else "50 in a row    "
        print(f"  {build:9s} {what} {times}")
    print(f"  outputs bitwise equal: {torch.equal(*outputs)}")


if __name__ == "__main__":
    main()
