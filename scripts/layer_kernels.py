"""Where one eager MegaMoE forward spends its time: each GPU kernel's device time (torch
profiler) and the host time of each step of the forward, for the geometries and token counts
given. Run on the GPU machine from the project root:

    python3 scripts/layer_kernels.py --geometry qwen3-30b-a3b --tokens 1 16 2048 8192
"""

from __future__ import annotations

import argparse
import time

import torch
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_torch.bench import build_layer, routed_tokens, with_capacity
from torch.profiler import ProfilerActivity, profile


def host_us(fn, calls: int = 50) -> float:
    """Median over rounds of the CPU time to issue `calls` calls, per call (GPU runs behind)."""
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[len(rounds) // 2]


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--geometry", nargs="+", default=["qwen3-30b-a3b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 2048, 8192])
    args = parser.parse_args()
    for name in args.geometry:
        geometry = GEOMETRIES[name]
        base = build_layer(geometry, device=torch.device("cuda"), dtype=torch.bfloat16)
        for tokens in args.tokens:
            layer = with_capacity(base, tokens * geometry.top_k)
            layer.use_backend("cutedsl")
            x_TH, _, _ = routed_tokens(base, tokens)
            report(layer, x_TH, f"{name} {tokens} tokens")


def report(layer, x_TH, title: str) -> None:
    """Prints the device time of each kernel of one forward, and the host time of each step."""
    layer(x_TH)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(5):
            layer(x_TH)
        torch.cuda.synchronize()
    print(f"\n{title}, fused path: {layer.fused_path_status()}")
    for event in profiler.key_averages():
        if event.device_type.name == "CUDA":
            print(f"  {event.device_time:9.1f} us  x{event.count // 5}  {event.key[:90]}")
    logits = layer.router_logits(x_TH)
    dispatcher = layer._device_routed
    batch, handle, _ = dispatcher.route_and_dispatch(x_TH, logits)
    prepared = layer._prepared_weights()
    out = layer._expert_backend(batch, prepared)
    steps = {
        "forward": lambda: layer(x_TH),
        "router logits": lambda: layer.router_logits(x_TH),
        "route+dispatch": lambda: dispatcher.route_and_dispatch(x_TH, logits),
        "expert compute": lambda: layer._expert_backend(batch, prepared),
        "combine": lambda: dispatcher.combine(out, handle),
        "empty 4 KB": lambda: torch.empty(1024, device="cuda"),
    }
    print("  host us: " + ", ".join(f"{k} {host_us(f):.1f}" for k, f in steps.items()))


if __name__ == "__main__":
    main()
