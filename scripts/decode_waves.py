"""A decode GEMM's time against its number of tiles: experts of one batch row each, so each
expert adds the same weight tiles, from a fraction of a wave of CTAs to several.

    python3 scripts/decode_waves.py --geometry qwen3-30b-a3b --op gate_up --shapes 16x64swap \
        --stages 12 6 4 --experts 1 2 3 4 5 6 7 8 11 16

For each op (gate_up, down), tile shape (ROWSxCOLSswap, as gemm_knob_sweep.py takes them),
ring depth and expert count n: the bf16 GEMM on n experts of one row each (the rest empty),
its weights read cold (each call of a CUDA graph names another n experts, the sets together
larger than the L2), the better of two medians of graph replays. Prints the tiles (n x the
weight's column tiles), the waves they make on the SMs, the time, the weight stream's rate
and the rate per busy CTA. A second partial wave that costs more than its bytes shows as a
step in the time where the tiles pass a multiple of the SM count.
"""

from __future__ import annotations

import argparse

import torch
from gemm_knob_sweep import parse_shape  # this script's folder: one syntax for tile shapes
from megamoe_kernels import GemmKnobs, down, gate_up_swiglu, interleave_gate_up
from megamoe_runtime.dispatch.local import expert_offsets_from_ids
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_runtime.measure import median_graph_replay_seconds

# the weight bytes the expert sets of one graph cycle through: four times the H200's L2
COLD_BYTES = 200_000_000


def cycling_call(gemm, rows, offsets: list[torch.Tensor], weight, knobs: GemmKnobs):
    """A call of the GEMM whose every call takes the next of `offsets` (another expert set)."""
    calls = iter(range(1 << 62))

    def call():
        return gemm(rows, offsets[next(calls) % len(offsets)], weight, knobs=knobs)

    return call


@torch.no_grad()
def study(geometry_name: str, op: str, knobs: GemmKnobs, expert_counts: list[int]) -> None:
    device = torch.device("cuda")
    geometry = GEOMETRIES[geometry_name]
    experts, hidden, inter = geometry.num_experts, geometry.hidden_size, geometry.intermediate_size
    generator = torch.Generator(device=device).manual_seed(0)
    if op == "gate_up":
        columns, depth = 2 * inter, hidden
        weight = interleave_gate_up(
            torch.randn(experts, columns, depth, device=device, generator=generator).bfloat16()
        )
    else:
        columns, depth = hidden, inter
        weight = torch.randn(experts, columns, depth, device=device, generator=generator)
        weight = weight.bfloat16()
    expert_bytes = columns * depth * 2
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    gemm = gate_up_swiglu if op == "gate_up" else down
    for n in expert_counts:
        if n > experts:
            continue
        sets = min(experts // n, max(4, -(-COLD_BYTES // (n * expert_bytes))))
        # set s: one row for each of experts s n .. (s + 1) n - 1
        offsets = [
            expert_offsets_from_ids(torch.arange(s * n, (s + 1) * n, device=device), experts)
            for s in range(sets)
        ]
        rows = torch.randn(n, depth, device=device, generator=generator).bfloat16()
        call = cycling_call(gemm, rows, offsets, weight, knobs)
        seconds = min(
            median_graph_replay_seconds(call, device=device, calls_per_graph=sets, repeats=20)
            for _ in range(2)
        )
        tiles = n * -(-columns // knobs.tile_cols)
        busy = min(tiles, sms)
        print(
            f"{geometry_name:16s} {op:8s} {knobs.tile_rows}x{knobs.tile_cols} stages={knobs.stages:2d}"
            f" experts={n:3d} tiles={tiles:4d} waves={tiles / sms:4.2f} {seconds * 1e6:8.2f} us"
            f" {n * expert_bytes / seconds / 1e12:5.2f} TB/s"
            f" {n * expert_bytes / busy / seconds / 1e9:6.1f} GB/s per busy CTA",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--geometry", default="qwen3-30b-a3b", choices=sorted(GEOMETRIES))
    parser.add_argument("--op", nargs="+", default=["gate_up"], choices=["gate_up", "down"])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[parse_shape("16x64swap")])
    parser.add_argument("--stages", nargs="+", type=int, default=[12])
    parser.add_argument("--experts", nargs="+", type=int, default=[1, 2, 4, 5, 6, 8, 11, 16])
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count)
    for op in args.op:
        for tile_rows, tile_cols, pingpong, swap_ab in args.shapes:
            if pingpong or not swap_ab:
                parser.error("--shapes: decode (swap-AB) tiles only, e.g. 16x64swap")
            for stages in args.stages:
                knobs = GemmKnobs(
                    tile_rows=tile_rows, tile_cols=tile_cols, stages=stages, swap_ab=True
                )
                study(args.geometry, op, knobs, args.experts)


if __name__ == "__main__":
    main()
