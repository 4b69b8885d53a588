"""The single-GPU combine kernel alone: graph replays (us, three readings), the bytes it moves
per second, and a checksum of its output bits, at (hidden size, top-k, tokens) points on random
expert rows placed by a random permutation. Run on the GPU machine from the project root:

    python3 scripts/combine_bench.py

To compare two builds, run it once with each (another checkout's kernels first on the path:
`PYTHONPATH=<checkout>/packages/megamoe-kernels/src python3 scripts/combine_bench.py`),
alternating; the same checksums mean the same bits.
"""

from __future__ import annotations

import argparse

import torch
from megamoe_kernels.shim.local_layer import CombineLauncher
from megamoe_runtime.measure import median_graph_replay_seconds

# name, hidden size, top-k, tokens: the prefill points of the geometries' combines (dsv3's
# routed top-8 of 7168 and its shared expert as a ninth pair)
POINTS = (
    ("qwen3-30b-a3b", 2048, 8, 2048),
    ("qwen3-30b-a3b", 2048, 8, 8192),
    ("dsv3 routed", 7168, 8, 8192),
    ("dsv3 + shared", 7168, 9, 2048),
    ("dsv3-ep8-local", 7168, 1, 8192),
    ("mixtral-8x7b", 4096, 2, 8192),
    ("gpt-oss-120b", 2880, 4, 8192),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tag", default="", help="a label printed on each line")
    args = parser.parse_args()
    device = torch.device("cuda")
    for name, hidden, top_k, tokens in POINTS:
        generator = torch.Generator(device=device).manual_seed(0)
        rows = tokens * top_k
        expert_out_MH = torch.randn(rows, hidden, device=device, generator=generator).bfloat16()
        row_of_pair_TK = torch.randperm(rows, device=device, generator=generator)
        row_of_pair_TK = row_of_pair_TK.int().view(tokens, top_k)
        weights_TK = torch.rand(tokens, top_k, device=device, generator=generator)
        combine = CombineLauncher(top_k=top_k, hidden_size=hidden, device=device)
        arguments = (expert_out_MH, row_of_pair_TK, weights_TK)
        checksum = int(combine(*arguments).view(torch.int16).long().sum())
        times = [
            median_graph_replay_seconds(
                lambda combine=combine, arguments=arguments: combine(*arguments),
                device=device,
                repeats=20,
            )
            for _ in range(3)
        ]
        terabytes = (rows + tokens) * hidden * 2 / 1e12
        print(
            f"{args.tag} {name:15s} {tokens:5d} tokens: "
            + " ".join(f"{t * 1e6:.1f}" for t in times)
            + f" us, {terabytes / min(times):.2f} TB/s, checksum {checksum}",
            flush=True,
        )


if __name__ == "__main__":
    main()
