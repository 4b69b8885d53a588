"""Saves the expert GEMMs' outputs on fixed inputs, or compares them with a saved file, so a
kernel change can be checked bitwise against the build before it.

    python3 scripts/gemm_outputs.py save before.pt      # with the kernels before the change
    python3 scripts/gemm_outputs.py compare before.pt   # with the kernels after it
    (--fp8-only: the FP8 points alone)

The kernels are the `megamoe_kernels` on the import path (PYTHONPATH picks the build). Each case
is a geometry's expert batch at a rows-per-expert count with the default knobs of its size (the
swap-AB decode tiles, the prefill tiles), plus the knob variants no profile picks (pingpong,
clusters, split-K), on inputs drawn from a fixed seed: the same bytes in both runs. The FP8
GEMMs run at FP8_POINTS with their default knobs, on the batch `megamoe tune` times (the
geometry's layer and router on seeded random tokens, the rows quantized as the dispatch
quantizes them): the gate-up's e4m3 rows and scales and the down's bf16 rows; and the FP8
decode gate-up in K slices (FP8_SPLIT_POINT).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

import torch
from megamoe_kernels import GemmKnobs, default_knobs, down, gate_up_swiglu, interleave_gate_up
from megamoe_kernels.shim.knobs import max_stages
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_torch.tune import gemm_runners, tuning_problem

DEVICE = torch.device("cuda")
# (experts, hidden, intermediate, rows per expert)
CASES = {
    "qwen3-decode": (128, 2048, 768, 1),
    "qwen3-mid": (128, 2048, 768, 24),
    "qwen3-prefill": (128, 2048, 768, 300),
    "dsv3-local-prefill": (32, 7168, 2048, 260),
    "gpt-oss-masked": (16, 2880, 2880, 70),
}
# FP8 (geometry, tokens): decode tiles (one token: 16 x 128 down tiles at qwen3-30b-a3b, 64
# columns at mixtral-8x7b; a K of 7168 at dsv3-ep8-local), the 64 x 256 and 128 x 256 prefill
# tiles
FP8_POINTS = (
    ("qwen3-30b-a3b", 1),
    ("dsv3-ep8-local", 1),
    ("mixtral-8x7b", 1),
    ("qwen3-30b-a3b", 16),
    ("qwen3-30b-a3b", 512),
    ("qwen3-30b-a3b", 2048),
    ("dsv3-ep8-local", 8192),
    ("mixtral-8x7b", 1024),
)
# the knob variants no default profile picks, each on the case whose size it suits
VARIANTS = {
    "pingpong": ("qwen3-prefill", GemmKnobs(tile_rows=64, tile_cols=256, pingpong=True)),
    "cluster2": ("qwen3-prefill", GemmKnobs(tile_rows=128, tile_cols=256, cluster=(2, 1))),
    "split_k4": ("qwen3-decode", None),  # the decode profile with split_k=4
}
# the FP8 decode gate-up in K slices, as the default launches split it on few experts
FP8_SPLIT_POINT = ("dsv3-ep8-local", 1, 4)


def problem(experts: int, hidden: int, intermediate: int, rows_per_expert: int, seed: int):
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    ids = torch.randint(
        0, experts, (experts * rows_per_expert,), device=DEVICE, generator=generator
    )
    counts = torch.bincount(ids, minlength=experts)
    offsets = torch.zeros(experts + 1, dtype=torch.int32, device=DEVICE)
    offsets[1:] = torch.cumsum(counts, 0)
    rows = int(offsets[-1])
    x = torch.randn(rows, hidden, device=DEVICE, generator=generator).bfloat16()
    w13 = torch.randn(experts, 2 * intermediate, hidden, device=DEVICE, generator=generator)
    w2 = torch.randn(experts, hidden, intermediate, device=DEVICE, generator=generator)
    w13 = interleave_gate_up((w13 / hidden**0.5).bfloat16())
    w2 = (w2 / intermediate**0.5).bfloat16()
    row_scale = torch.rand(rows, device=DEVICE, generator=generator)
    return x, offsets, w13, w2, row_scale


def variant_knobs(op: str, knobs: GemmKnobs | None, rows_per_expert: int) -> GemmKnobs:
    if knobs is None:
        return replace(default_knobs(op, rows_per_expert), split_k=4)
    return replace(knobs, stages=max_stages(knobs, op))


def fp8_outputs(
    geometry: str, tokens: int, *, ops=("gate_up_fp8", "down_fp8"), split_k: int = 1
) -> dict[str, torch.Tensor]:
    """The FP8 GEMMs `ops` at one point, with the default knobs of its size (K in split_k
    slices where split_k > 1), e4m3 outputs as their bytes."""
    tuning = tuning_problem(GEOMETRIES[geometry], tokens, device=DEVICE, weight_dtype="fp8")
    rows_per_expert = tuning.batch.capacity / GEOMETRIES[geometry].num_experts
    runners = gemm_runners(tuning)
    point = f"fp8-{geometry}-{tokens}" + (f"-split{split_k}" if split_k > 1 else "")
    results = {}
    for op in ops:
        knobs = replace(default_knobs(op, rows_per_expert), split_k=split_k)
        out = runners[op](knobs)
        for index, tensor in enumerate(out if isinstance(out, tuple) else (out,)):
            # e4m3 compared as its bytes
            bits = tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor
            results[f"{point}/{op}/{index}"] = bits.cpu()
    return results


def outputs(*, fp8_only: bool = False) -> dict[str, torch.Tensor]:
    results = {}
    problems, variants = {}, {}
    if not fp8_only:
        problems = {
            name: problem(*dims, seed=seed) for seed, (name, dims) in enumerate(CASES.items())
        }
        variants = VARIANTS
    for name, (x, offsets, w13, w2, row_scale) in problems.items():
        hidden = gate_up_swiglu(x, offsets, w13)
        results[f"{name}/gate_up"] = hidden.cpu()
        results[f"{name}/down"] = down(hidden, offsets, w2, row_scale_M=row_scale).cpu()
    for variant, (name, knobs) in variants.items():
        x, offsets, w13, w2, _ = problems[name]
        rows_per_expert = CASES[name][3]
        gate_up_knobs = variant_knobs("gate_up", knobs, rows_per_expert)
        hidden = gate_up_swiglu(x, offsets, w13, knobs=gate_up_knobs)
        results[f"{variant}/gate_up"] = hidden.cpu()
        down_knobs = variant_knobs("down", knobs, rows_per_expert)
        results[f"{variant}/down"] = down(hidden, offsets, w2, knobs=down_knobs).cpu()
    for geometry, tokens in FP8_POINTS:
        results.update(fp8_outputs(geometry, tokens))
    geometry, tokens, split = FP8_SPLIT_POINT
    results.update(fp8_outputs(geometry, tokens, ops=("gate_up_fp8",), split_k=split))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("save", "compare"))
    parser.add_argument("path")
    parser.add_argument(
        "--fp8-only", action="store_true", help="only the FP8 points (a change to FP8 alone)"
    )
    args = parser.parse_args()
    current = outputs(fp8_only=args.fp8_only)
    if args.mode == "save":
        torch.save(current, args.path)
        print(f"saved {len(current)} outputs to {args.path}")
        return 0
    saved = torch.load(args.path)
    different = [name for name in saved if not torch.equal(saved[name], current.get(name))]
    missing = sorted(set(saved) ^ set(current))
    for name in saved:
        print(f"{'equal' if name not in different else 'DIFFERENT':<10} {name}")
    if missing:
        print(f"only in one run: {missing}")
    print(f"{len(saved) - len(different)} of {len(saved)} outputs bitwise equal")
    return 1 if different or missing else 0


if __name__ == "__main__":
    sys.exit(main())
