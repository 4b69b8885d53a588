"""FP8 expert compute against our BF16 kernels and torch's FP8 grouped GEMM, in one run.

For each geometry and token count: random top-k routing, the tight expert-major batch, and the
two GEMMs of the expert MLP (gate-up with SwiGLU, then down), timed as CUDA-graph replays:
- bf16: gate_up_swiglu + down (megamoe's BF16 kernels);
- fp8: gate_up_swiglu_fp8 (its output quantized in the epilogue, per 128 columns with
  256-column tiles, else per 64) + down_fp8 on those groups, on
  rows already quantized (the dispatch quantizes them);
- scaled_mm: two torch._scaled_grouped_mm (rowwise scales) with an unfused SwiGLU and a rowwise
  requantization between them, where torch runs it.
Also the accuracy of the fp8 MLP against the fp32 oracle on the bf16 rows and the dequantized
weights: rel-L2 and DeepGEMM's 1 - 2xy/(x^2+y^2). Run on the GPU machine from the project root:

    python3 scripts/fp8_experts_bench.py [--geometry ...] [--tokens ...] [--weight-copies N]
        [--smi] [--csv out.csv]

--weight-copies N: the three MLPs take N copies of their weights in turn, one per call, as a
model's layers do: with N times a call's weights well past the L2's 50 MB, no call finds its
weights in the L2 (with 1, the default, the MLP replays on one set of weights, of which the
L2 keeps a part between calls where they nearly fit in it). Each copy holds the geometry's
bf16 and FP8 weights again: about 2.2 GB at qwen3-30b-a3b, 5.2 GB at dsv3-ep8-local and
mixtral-8x7b, 41 GB at dsv3.

--smi: nvidia-smi sampled beside the timings (every 50 ms), each MLP's median SM clock (MHz) and
board power (W) over the spans of its readings: under the board's power limit a reading runs on
the clock the limit allows it (docs/benchmarks.md, "The power limit"), so two MLPs that draw
different power compare on different clocks.
"""

from __future__ import annotations

import argparse
import time

import torch
from megamoe_kernels import (
    dequantize_weight_blocks,
    down_fp8_launcher,
    down_launcher,
    gate_up_fp8_launcher,
    gate_up_launcher,
    interleave_gate_up,
    quantize_rows,
    quantize_weight_blocks,
)
from megamoe_kernels.reference import expert_mlp_reference, fp8_difference, relative_l2_error
from megamoe_runtime.geometries import GEOMETRIES, H200_HBM_BYTES_PER_S
from megamoe_runtime.measure import (
    SmiSampler,
    alternating_readings,
    median_graph_replay_seconds,
    tflops,
    write_csv,
)
from megamoe_torch.bench import calls_in_turn

DEVICE = torch.device("cuda")
DEFAULT_GEOMETRIES = ("qwen3-30b-a3b", "dsv3-ep8-local", "dsv3", "mixtral-8x7b")
DEFAULT_TOKENS = (1, 16, 128, 2048, 8192)


def routed_counts(experts: int, top_k: int, tokens: int, seed: int) -> list[int]:
    """Per-expert rows of `tokens` tokens routed to top_k distinct random experts each."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, experts, generator=generator).topk(top_k, dim=1).indices
    return torch.bincount(ids.flatten(), minlength=experts).tolist()


class Weights:
    def __init__(self, geometry, seed: int = 0):
        e, h, i = geometry.num_experts, geometry.hidden_size, geometry.intermediate_size
        generator = torch.Generator(device=DEVICE).manual_seed(seed)
        w13 = torch.randn(e, 2 * i, h, device=DEVICE, generator=generator) / h**0.5
        w2 = torch.randn(e, h, i, device=DEVICE, generator=generator) / i**0.5
        self.w13_bf16 = w13.bfloat16()
        self.w2_bf16 = w2.bfloat16()
        self.w13_bf16_interleaved = interleave_gate_up(self.w13_bf16)
        self.w13, self.w13_scales = quantize_weight_blocks(w13)
        del w13
        self.w2, self.w2_scales = quantize_weight_blocks(w2)
        del w2
        self.w13_interleaved = interleave_gate_up(self.w13)
        # torch._scaled_grouped_mm: B column-major [E, K, N], one scale per output column
        self.w13_t = self.w13.transpose(1, 2)
        self.w2_t = self.w2.transpose(1, 2)
        self.w13_col_scales = torch.ones(e, 2 * i, device=DEVICE)
        self.w2_col_scales = torch.ones(e, h, device=DEVICE)


class CopiedWeights:
    """Another copy of the weights the three MLPs read (bench_point's weight_sets)."""

    def __init__(self, weights: Weights):
        for name in ("w13_bf16_interleaved", "w2_bf16", "w13", "w13_interleaved", "w13_scales"):
            setattr(self, name, getattr(weights, name).clone())
        self.w2, self.w2_scales = weights.w2.clone(), weights.w2_scales.clone()
        # torch._scaled_grouped_mm's column-major views, of this copy
        self.w13_t = self.w13.transpose(1, 2)
        self.w2_t = self.w2.transpose(1, 2)
        self.w13_col_scales = weights.w13_col_scales
        self.w2_col_scales = weights.w2_col_scales


def scaled_grouped_mm_mlp(rows, row_scales, ends, weights, intermediate):
    gate_up = torch._scaled_grouped_mm(
        rows,
        weights.w13_t,
        row_scales,
        weights.w13_col_scales,
        offs=ends,
        out_dtype=torch.bfloat16,
    )
    hidden = torch.nn.functional.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    scale = hidden.abs().amax(dim=1).float().clamp(min=1e-10) / 448
    hidden_q = (hidden / scale[:, None]).to(torch.float8_e4m3fn)
    return torch._scaled_grouped_mm(
        hidden_q, weights.w2_t, scale, weights.w2_col_scales, offs=ends, out_dtype=torch.bfloat16
    )


def bench_point(geometry, weight_sets, tokens: int, sampler: SmiSampler | None = None) -> dict:
    """One point of the table; the MLPs take the weights of `weight_sets` in turn (the first
    is a Weights, the others CopiedWeights of it). With `sampler`, each MLP's median SM clock
    and board power over its readings' spans."""
    weights = weight_sets[0]
    counts = routed_counts(geometry.num_experts, geometry.top_k, tokens, seed=tokens)
    rows = tokens * geometry.top_k
    active = sum(1 for c in counts if c)
    offsets = torch.zeros(geometry.num_experts + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(torch.tensor(counts), 0)
    offsets = offsets.to(DEVICE)
    h, i = geometry.hidden_size, geometry.intermediate_size
    x = torch.randn(rows, h, device=DEVICE).bfloat16()
    x_q, x_scales = quantize_rows(x, 128)

    gate_up16 = gate_up_launcher(x, offsets, weights.w13_bf16_interleaved, valid_rows=rows)
    hidden16 = gate_up16(x, offsets, weights.w13_bf16_interleaved)
    down16 = down_launcher(hidden16, offsets, weights.w2_bf16, valid_rows=rows)
    gate_up8 = gate_up_fp8_launcher(x_q, offsets, weights.w13_interleaved, valid_rows=rows)
    hidden8, hidden8_scales = gate_up8(
        x_q, offsets, weights.w13_interleaved, x_scales=x_scales, w_scales=weights.w13_scales
    )
    down8 = down_fp8_launcher(
        hidden8, offsets, weights.w2, valid_rows=rows, x_group=gate_up8.out_group
    )
    out16 = torch.empty(rows, h, dtype=torch.bfloat16, device=DEVICE)
    out8 = torch.empty_like(out16)

    def bf16(weights=weights):
        gate_up16(x, offsets, weights.w13_bf16_interleaved, out=hidden16)
        down16(hidden16, offsets, weights.w2_bf16, out=out16)

    def fp8(weights=weights):
        gate_up8(
            x_q,
            offsets,
            weights.w13_interleaved,
            x_scales=x_scales,
            w_scales=weights.w13_scales,
            out=hidden8,
            out_scales=hidden8_scales,
        )
        down8(
            hidden8,
            offsets,
            weights.w2,
            x_scales=hidden8_scales,
            w_scales=weights.w2_scales,
            out=out8,
        )

    fp8()
    torch.cuda.synchronize()
    row = {"geometry": geometry.name, "tokens": tokens, "rows": rows, "active_experts": active}
    # accuracy against the fp32 oracle (bf16 rows, dequantized weights), on the rows of the
    # first experts (at most 16 experts and about 2048 rows: the oracle's weights are fp32)
    ends = offsets[1:].cpu()
    last = int(torch.searchsorted(ends, torch.tensor([2048], dtype=torch.int32), right=True))
    last = max(1, min(last, 16, geometry.num_experts))
    if int(ends[last - 1]) > 0:
        w13 = dequantize_weight_blocks(weights.w13[:last], weights.w13_scales[:last])
        w2 = dequantize_weight_blocks(weights.w2[:last], weights.w2_scales[:last])
        valid = int(ends[last - 1])
        expected = expert_mlp_reference(x[:valid], offsets[: last + 1], w13, w2)
        del w13, w2
        row["fp8_rel_l2"] = relative_l2_error(out8[:valid], expected)
        row["fp8_diff"] = fp8_difference(out8[:valid], expected)
    bf16()
    torch.cuda.synchronize()
    row["bf16_vs_fp8_rel_l2"] = relative_l2_error(out8, out16)
    ends = offsets[1:].contiguous()
    candidates = {"bf16": calls_in_turn(bf16, weight_sets), "fp8": calls_in_turn(fp8, weight_sets)}
    unit_scales = torch.ones(rows, device=DEVICE)
    try:
        scaled_grouped_mm_mlp(x_q, unit_scales, ends, weights, i)
        candidates["scaled_mm"] = calls_in_turn(
            lambda weights: scaled_grouped_mm_mlp(x_q, unit_scales, ends, weights, i),
            weight_sets,
        )
    except (RuntimeError, TypeError) as failure:
        row["scaled_mm_error"] = str(failure).split("\n")[0][:80]
    spans = {name: [] for name in candidates}

    def timed(name, fn):
        start = time.time()
        seconds = median_graph_replay_seconds(fn, device=DEVICE, repeats=20)
        spans[name].append((start, time.time()))
        return seconds

    # alternate rounds, keep each candidate's best median (the board's clock drifts under load)
    readings = alternating_readings(
        {name: lambda name=name, fn=fn: timed(name, fn) for name, fn in candidates.items()},
        rounds=3,
    )
    for name, reading in readings.items():
        row[f"{name}_us"] = reading.best * 1e6
        row[f"{name}_spread"] = reading.spread
        if sampler is not None:
            row[f"{name}_sm_mhz"] = sampler.median_over("clocks.sm", spans[name])
            row[f"{name}_watts"] = sampler.median_over("power.draw", spans[name])
    row["fp8_speedup_vs_bf16"] = row["bf16_us"] / row["fp8_us"]
    if "scaled_mm_us" in row:
        row["fp8_speedup_vs_scaled_mm"] = row["scaled_mm_us"] / row["fp8_us"]
    row["fp8_tflops"] = tflops(geometry.expert_flops(rows), row["fp8_us"] * 1e-6)
    # the FP8 bytes floor: the time fp8_expert_bytes take at the HBM rate
    fp8_floor_seconds = geometry.fp8_expert_bytes(rows, active) / H200_HBM_BYTES_PER_S
    row["fp8_floor_fraction"] = fp8_floor_seconds / (row["fp8_us"] * 1e-6)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--geometry", nargs="+", default=list(DEFAULT_GEOMETRIES))
    parser.add_argument("--tokens", nargs="+", type=int, default=list(DEFAULT_TOKENS))
    parser.add_argument(
        "--weight-copies",
        type=int,
        default=1,
        help="copies of the weights the MLPs take in turn (cold weights)",
    )
    parser.add_argument(
        "--smi", action="store_true", help="each MLP's median SM clock and power beside it"
    )
    parser.add_argument("--csv", help="write every row to this CSV file")
    args = parser.parse_args()
    if args.weight_copies < 1:
        parser.error(f"--weight-copies must be at least 1, got {args.weight_copies}")
    sampler = SmiSampler() if args.smi else None
    rows = []
    for name in args.geometry:
        geometry = GEOMETRIES[name]
        weights = Weights(geometry)
        weight_sets = [weights] + [CopiedWeights(weights) for _ in range(args.weight_copies - 1)]
        for tokens in args.tokens:
            row = bench_point(geometry, weight_sets, tokens, sampler)
            rows.append(row)
            print(row, flush=True)
        del weights, weight_sets
        torch.cuda.empty_cache()
    if sampler is not None:
        sampler.stop()
    if args.csv:
        write_csv(rows, args.csv)
    print(
        f"{'geometry':<16}{'tokens':>7}{'bf16 us':>9}{'fp8 us':>9}{'smm us':>9}"
        f"{'x bf16':>8}{'x smm':>7}{'TFLOP/s':>9}{'floor':>7}{'diff':>9}{'relL2':>8}"
    )
    for row in rows:
        print(
            f"{row['geometry']:<16}{row['tokens']:>7}{row['bf16_us']:>9.1f}{row['fp8_us']:>9.1f}"
            f"{row.get('scaled_mm_us', float('nan')):>9.1f}{row['fp8_speedup_vs_bf16']:>8.2f}"
            f"{row.get('fp8_speedup_vs_scaled_mm', float('nan')):>7.2f}{row['fp8_tflops']:>9.0f}"
            f"{row['fp8_floor_fraction']:>7.2f}{row.get('fp8_diff', float('nan')):>9.1e}"
            f"{row.get('fp8_rel_l2', float('nan')):>8.3f}"
        )
    if sampler is not None:
        print(
            f"{'geometry':<16}{'tokens':>7}{'bf16 MHz':>10}{'fp8 MHz':>9}{'bf16 W':>8}{'fp8 W':>7}"
        )
        for row in rows:
            print(
                f"{row['geometry']:<16}{row['tokens']:>7}{row['bf16_sm_mhz']:>10.0f}"
                f"{row['fp8_sm_mhz']:>9.0f}{row['bf16_watts']:>8.0f}{row['fp8_watts']:>7.0f}"
            )


if __name__ == "__main__":
    main()
