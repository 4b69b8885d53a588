"""What the fills of a capture's scratch cost a prefill graph's replay: the layer's bucket graphs
(bucket_graph_tokens, the bucket equal to the tokens) as megamoe_kernels captures them, each
graph filling the scratch it makes (the routing kernel's words, the unit counter), against the
same graphs over scratch zeroed eagerly before the capture (no fill kernels in the graph), and
against the forward launching its kernels. Eager forwards alternating between two copies of the
tokens, alternating rounds, wall us per forward (the median of 20 back-to-back forwards), the
median round and the range. Run on the GPU machine from the project root:

    python3 scripts/capture_fills_ab.py --geometry qwen3-30b-a3b --tokens 512 2048 8192

The graphs without fills are an experiment, not a mode of megamoe: they share one zeroed copy
of each scratch, which is correct only for graphs replayed one at a time on one stream
(megamoe_kernels.shim.expert_gemm._stream_scratch says why megamoe gives each capture its own).
For it this script stands in for the shim's scratch lookup.
"""

from __future__ import annotations

import argparse

import torch
from megamoe_kernels.reference import relative_l2_error
from megamoe_kernels.shim import expert_gemm, local_layer
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_runtime.measure import alternating_readings, median_seconds
from megamoe_torch.bench import build_layer, calls_in_turn, with_capacity


class ZeroedBeforeCapture:
    """The shim's scratch lookup, except that while `serving`, a capture takes scratch made
    eagerly (zeroed, outside the graph) for the kinds an eager forward asked for while
    `recording`."""

    def __init__(self, lookup):
        self.lookup = lookup
        self.recording = self.serving = False
        self.kinds: dict[tuple, object] = {}
        self.zeroed: dict[tuple, object] = {}
        self.served: set[str] = set()

    def __call__(self, device, what, make):
        capturing = torch.cuda.is_current_stream_capturing()
        if self.recording and not capturing:
            self.kinds[device, what] = make
        if self.serving and capturing and (device, what) in self.zeroed:
            self.served.add(what[0])
            return self.zeroed[device, what]
        return self.lookup(device, what, make)

    def zero_recorded(self) -> None:
        self.zeroed = {key: make() for key, make in self.kinds.items()}


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", default="qwen3-30b-a3b")
    parser.add_argument("--tokens", nargs="+", type=int, default=[512, 2048, 8192])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    lookup = ZeroedBeforeCapture(expert_gemm._stream_scratch)
    expert_gemm._stream_scratch = local_layer._stream_scratch = lookup
    device = torch.device("cuda")
    most = max(args.tokens)
    base = build_layer(GEOMETRIES[args.geometry], device=device, dtype=torch.bfloat16)
    fills = with_capacity(base, None, bucket_graph_tokens=most, eager_graph_tokens=4)
    no_fills = with_capacity(
        base, None, prepared_like=fills, bucket_graph_tokens=most, eager_graph_tokens=4
    )
    launched = with_capacity(base, None, prepared_like=fills, eager_graph_tokens=0)
    for layer in (fills, no_fills, launched):
        layer.use_backend("cutedsl")
    del base
    for tokens in args.tokens:
        if fills._forward_graphs.bucket_of(tokens) != tokens:
            raise SystemExit(f"--tokens: {tokens} is not a bucket (a power of two above 4)")
        generator = torch.Generator(device=device).manual_seed(tokens)
        x_TH = torch.randn(
            tokens, fills.config.hidden_size, device=device, generator=generator
        ).bfloat16()
        for _ in range(3):  # launched, captured, replayed
            fills(x_TH)
            launched(x_TH)
        lookup.recording = True
        no_fills(x_TH)  # the bucket's first forward launches: the kinds of scratch it takes
        lookup.recording = False
        lookup.zero_recorded()
        torch.cuda.synchronize()
        lookup.serving = True
        no_fills(x_TH)  # captures
        lookup.serving = False
        errors = [relative_l2_error(layer(x_TH), launched(x_TH)) for layer in (fills, no_fills)]
        copies = (x_TH, x_TH.clone())
        forwards = {
            "fills": calls_in_turn(fills, copies),
            "no fills": calls_in_turn(no_fills, copies),
            "launched": calls_in_turn(launched, copies),
        }
        readings = alternating_readings(
            {
                label: lambda forward=forward: median_seconds(forward, device=device, repeats=20)
                for label, forward in forwards.items()
            },
            rounds=args.rounds,
        )
        times = "  ".join(
            f"{label} {reading.median_and_range_us()}" for label, reading in readings.items()
        )
        print(
            f"{args.geometry} {tokens}: {times}  rel-L2 {errors[0]:.1e} / {errors[1]:.1e}"
            f"  (scratch zeroed before the capture: {', '.join(sorted(lookup.served))})",
            flush=True,
        )


if __name__ == "__main__":
    main()
