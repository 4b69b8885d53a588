"""`megamoe bench --ep`: expert-parallel dispatch and combine, and the expert-parallel layer.

Run under torchrun, one rank per GPU of one host (on a CPU: gloo ranks, the torch dispatcher
only, a smoke check):

    NVSHMEM_SYMMETRIC_SIZE=4G torchrun --standalone --nproc-per-node 2 -m megamoe_torch.cli \\
        bench --ep --tokens 128 512 2048 4096 8192 --out bench-out

Scenarios, per token count per rank, at one geometry (default dsv3: hidden 7168, top-8 of 256
experts), bf16, every time the slowest rank's:
- dispatch and combine (`run`), random routing (top-k of uniform scores), one row per token
  count. Adapters: megamoe's symmetric-memory dispatcher as five strategies (`SYMMETRIC_VARIANTS`:
  the staged two-kernel dispatch, the direct one that sends every pair's row, the one-kernel
  small-batch dispatch for the token counts within its limit, the owner-partials combine; and the
  staged dispatch with the FP8 wire both ways, its relative L2 error against the bf16 wire), each
  step captured in a CUDA graph and replayed back to back (events around each replay, median
  over iterations after the first two); the all_to_all_single reference dispatcher, eager (it
  syncs; a barrier before each iteration, the first dropped); one all_to_all_single of the
  dispatch payload with known splits, the floor of any all_to_all dispatch. Bandwidth two ways:
  NVLink GB/s = bytes this rank sends to other ranks / time (per direction); DeepEP GB/s = bytes
  received per rank counted as DeepEP does (each token once per receiving rank, its own
  included) / time.
- the layer (`run_layer`, `--ep-layer-tokens`): the routed part of a `MegaMoE` layer (no shared
  experts) built with `process_group`, its router scaled like a trained one, one eager forward
  per iteration behind a barrier (events, median over iterations after the first two), for each
  of `LAYER_VARIANTS` (a dispatcher, an expert backend, a combine order) against the first that
  runs here.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megamoe_kernels.reference import relative_l2_error
from megamoe_runtime.dispatch.torch_distributed import TorchDistributedDispatcher
from megamoe_runtime.experts import backend_status
from megamoe_runtime.geometries import Geometry
from megamoe_runtime.measure import (
    gigabytes_per_second,
    kernel_times,
    median_step_seconds,
    slowest_across_ranks,
    speedup,
    write_csv,
    write_json,
)
from megamoe_runtime.routing import route

from megamoe_torch.config import MegaMoEConfig
from megamoe_torch.layer import MegaMoE

# the symmetric-memory dispatcher's strategies timed, each its SymmetricDispatcher options
SYMMETRIC_VARIANTS = {
    "staged": {"small_batch": False},
    "direct": {"stage_remote_rows": False},
    "small": {"small_batch": True},
    "partial": {"combine_partial_sums": True, "small_batch": False},
    # the FP8 wire both ways (opt-in: it changes the numbers) on the staged dispatch
    "fp8": {"small_batch": False, "dispatch_dtype": "fp8", "combine_dtype": "fp8"},
}
# eager iterations of the torch reference and of the all_to_all: a third of the graphed ones
EAGER_FRACTION = 3


@dataclass(frozen=True)
class LayerVariant:
    """One way to run the expert-parallel layer: `MegaMoEConfig`'s dispatcher, backend and
    combine_order."""

    dispatcher: str
    backend: str
    combine_order: str = "exact"


# the first that runs here is the baseline every other is timed against
LAYER_VARIANTS = {
    "nccl_grouped_mm": LayerVariant("torch", "grouped_mm"),  # all_to_all + torch._grouped_mm
    "nvshmem_grouped_mm": LayerVariant("nvshmem", "grouped_mm"),  # megamoe's dispatcher alone
    "megamoe": LayerVariant("nvshmem", "cutedsl"),  # megamoe's whole layer (exact combine)
    "megamoe_partials": LayerVariant("nvshmem", "cutedsl", "owner_partials"),
    "torch_reference": LayerVariant("torch", "reference"),  # the oracle (a CPU smoke check)
}
# relative L2 error of a layer against the baseline layer: both are bf16 GEMMs with fp32
# accumulation, which round the SwiGLU hidden and the output to bf16 (~4e-3 per rounding)
LAYER_TOLERANCE = 1e-2


def _rank_device() -> torch.device:
    """This rank's device: its current GPU on an NCCL group, else the CPU (gloo)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _slowest(seconds: float) -> float:
    return slowest_across_ranks([seconds])[0]


def _barrier() -> None:
    dist.barrier()


def _routing(geometry: Geometry, tokens: int, *, rank: int, seed: int, device: torch.device):
    generator = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    x_TH = torch.randn(tokens, geometry.hidden_size, device=device, generator=generator)
    scores_TE = torch.rand(tokens, geometry.num_experts, device=device, generator=generator)
    weights_TK, ids_TK = torch.topk(scores_TE, geometry.top_k, dim=-1)
    return x_TH.to(torch.bfloat16), ids_TK.to(torch.int32), weights_TK


def _traffic(geometry: Geometry, ids_TK: torch.Tensor, rank: int, world: int) -> dict[str, int]:
    local = geometry.num_experts // world
    owner_TK = ids_TK.long() // local
    remote_pairs = int((owner_TK != rank).sum())
    # DeepEP: a token reaches each rank that owns one of its experts once
    reached_TW = torch.zeros(ids_TK.shape[0], world, dtype=torch.bool, device=ids_TK.device)
    reached_TW.scatter_(1, owner_TK, True)
    remote_tokens = int(reached_TW.sum()) - int(reached_TW[:, rank].sum())
    tokens_per_receiver_W = reached_TW.sum(0)
    dist.all_reduce(tokens_per_receiver_W)
    row_bytes = geometry.hidden_size * 2
    return {
        # the staged dispatch sends a token once per remote owner; combine (and the direct
        # dispatch) send every remote (token, expert) pair's row
        "nvlink_token_bytes": remote_tokens * row_bytes,
        "nvlink_pair_bytes": remote_pairs * row_bytes,
        "deepep_bytes": int(tokens_per_receiver_W[rank]) * row_bytes,
    }


def _time_graphs(dispatcher, x_TH, ids_TK, weights_TK, iterations: int):
    """(dispatch s, combine s, y) with each step a CUDA graph replayed back to back."""
    state = {}

    def dispatch():
        state["batch"], state["handle"] = dispatcher.dispatch(x_TH, ids_TK, weights_TK)

    def combine():
        state["y"] = dispatcher.combine(state["expert_out"], state["handle"])

    dispatch()
    # the experts' stand-in output: the batch rows (the routing is the same at every step, so
    # the rows are too), bf16 ones for an FP8 batch, dequantized once here outside the timing
    state["expert_out"] = state["batch"].dequantized().rows_MH
    combine()  # compile and load outside the capture
    torch.cuda.synchronize()
    dispatch_graph, combine_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(dispatch_graph):
        dispatch()
    with torch.cuda.graph(combine_graph, pool=dispatch_graph.pool()):
        combine()
    seconds = median_step_seconds(
        {"dispatch": dispatch_graph.replay, "combine": combine_graph.replay},
        device=x_TH.device,
        iterations=iterations,
        skip=2,
    )
    dispatcher.raise_if_timed_out()
    # a copy: the output lives in the graphs' pool, reused once they are gone
    return seconds["dispatch"], seconds["combine"], state["y"].clone()


def _time_eager(dispatcher, x_TH, ids_TK, weights_TK, iterations: int):
    """(dispatch s, combine s, y) of eager calls, a barrier before each iteration."""
    state = {}

    def dispatch():
        state["batch"], state["handle"] = dispatcher.dispatch(x_TH, ids_TK, weights_TK)

    def combine():
        state["y"] = dispatcher.combine(state["batch"].rows_MH, state["handle"])

    seconds = median_step_seconds(
        {"dispatch": dispatch, "combine": combine},
        device=x_TH.device,
        iterations=iterations,
        skip=1,
        before_each=_barrier,
    )
    return seconds["dispatch"], seconds["combine"], state["y"]


def _time_all_to_all(geometry: Geometry, ids_TK, *, world: int, iterations: int) -> float:
    device = ids_TK.device
    owner_P = ids_TK.reshape(-1).long() // (geometry.num_experts // world)
    sent_W = torch.bincount(owner_P, minlength=world)
    received_W = torch.empty_like(sent_W)
    dist.all_to_all_single(received_W, sent_W)
    sent, received = sent_W.tolist(), received_W.tolist()
    hidden = geometry.hidden_size
    send_PH = torch.randn(sum(sent), hidden, device=device).to(torch.bfloat16)
    receive_PH = torch.empty(sum(received), hidden, device=device, dtype=torch.bfloat16)
    seconds = median_step_seconds(
        {
            "all_to_all": lambda: dist.all_to_all_single(
                receive_PH, send_PH, output_split_sizes=received, input_split_sizes=sent
            )
        },
        device=device,
        iterations=iterations,
        skip=1,
        before_each=_barrier,
    )
    return seconds["all_to_all"]


def kernel_breakdown(dispatcher, x_TH, ids_TK, weights_TK, iterations: int = 5) -> dict:
    """Each kernel's GPU time per dispatch + combine (us; measure.kernel_times over
    `iterations` eager pairs): where a step's time goes (launch gaps excluded)."""

    def pairs():
        for _ in range(iterations):
            batch, handle = dispatcher.dispatch(x_TH, ids_TK, weights_TK)
            dispatcher.combine(batch.rows_MH, handle)

    kernels = kernel_times(pairs, device=x_TH.device, calls=iterations)
    return {name[:60]: kernel.us for name, kernel in kernels.items()}


def _symmetric_dispatchers(geometry: Geometry, token_counts: list[int], device: torch.device):
    """{variant: (dispatcher, token counts it takes)}: every variant of SYMMETRIC_VARIANTS
    sized for the largest count it takes; the small-batch dispatch takes the counts within its
    kernel's limit (wider than the range the default picks it for)."""
    from megamoe_kernels.shim import ep as ep_kernels
    from megamoe_runtime.dispatch.symmetric import SymmetricDispatcher

    world = dist.get_world_size()
    small_limit = ep_kernels.small_dispatch_limits()["max_pairs"] // (world * geometry.top_k)
    dispatchers = {}
    for name, options in SYMMETRIC_VARIANTS.items():
        counts = [t for t in token_counts if name != "small" or t <= small_limit]
        if not counts:
            continue
        dispatchers[name] = (
            SymmetricDispatcher(
                geometry.num_experts,
                top_k=geometry.top_k,
                hidden_size=geometry.hidden_size,
                dtype=torch.bfloat16,
                device=device,
                process_group=dist.group.WORLD,
                max_tokens_per_rank=max(counts),
                layer_name=f"bench-{name}",
                **options,
            ),
            counts,
        )
    return dispatchers


def run(
    geometry: Geometry, token_counts: list[int], *, iterations: int = 30, breakdown: bool = False
) -> list[dict]:
    """Dispatch and combine at every token count; every rank returns the same rows (slowest
    rank's times, us). The symmetric-memory variants run where CUDA GPUs are (NVSHMEM)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _rank_device()
    symmetric = (
        _symmetric_dispatchers(geometry, token_counts, device) if device.type == "cuda" else {}
    )
    reference = TorchDistributedDispatcher(geometry.num_experts, check_ids=False)
    eager_iterations = max(5, iterations // EAGER_FRACTION)
    rows, references = [], {}
    for tokens in token_counts:
        x_TH, ids_TK, weights_TK = _routing(geometry, tokens, rank=rank, seed=tokens, device=device)
        row = {"tokens": tokens, **_traffic(geometry, ids_TK, rank, world)}
        timed = {
            name: _time_graphs(dispatcher, x_TH, ids_TK, weights_TK, iterations)
            for name, (dispatcher, counts) in symmetric.items()
            if name != "partial" and tokens in counts
        }
        torch_dispatch, torch_combine, y_torch = _time_eager(
            reference, x_TH, ids_TK, weights_TK, eager_iterations
        )
        a2a = _time_all_to_all(geometry, ids_TK, world=world, iterations=eager_iterations)
        for key, (name, step) in {
            "dispatch": ("staged", 0),
            "combine": ("staged", 1),
            "direct_dispatch": ("direct", 0),
            "small_dispatch": ("small", 0),
            "small_combine": ("small", 1),
            "fp8_dispatch": ("fp8", 0),
            "fp8_combine": ("fp8", 1),
        }.items():
            seconds = timed[name][step] if name in timed else math.nan
            row[f"nvshmem_{key}_us"] = _slowest(seconds) * 1e6
        row["torch_dispatch_us"] = _slowest(torch_dispatch) * 1e6
        row["torch_combine_us"] = _slowest(torch_combine) * 1e6
        row["nccl_all_to_all_us"] = _slowest(a2a) * 1e6
        differences = slowest_across_ranks(
            [
                _max_abs_difference(timed.get("staged"), y_torch),
                _max_abs_difference(timed.get("direct"), y_torch),
                _elements_differing(timed.get("staged"), y_torch),
                _elements_differing(timed.get("small"), y_torch),
            ]
        )
        if "fp8" in timed and y_torch.numel():
            (row["relative_l2_fp8_wire"],) = slowest_across_ranks(
                [relative_l2_error(timed["fp8"][2], y_torch)]
            )
        row.update(
            combine_equals_reference_bitwise=max(differences) == 0,
            max_abs_difference_staged=differences[0],
            max_abs_difference_direct=differences[1],
            elements_differing_staged=int(differences[2]),
            elements_differing_small=int(differences[3]),
        )
        _add_bandwidths(row)
        if breakdown and symmetric:
            row["kernels_us"] = {
                name: kernel_breakdown(symmetric[name][0], x_TH, ids_TK, weights_TK)
                for name in ("staged", "partial")
                if name in symmetric
            }
        references[tokens] = y_torch
        rows.append(row)
    # the partial-sum combine last: a failure there (it is not the default) keeps the rows above
    for row in rows if "partial" in symmetric else ():
        tokens = row["tokens"]
        x_TH, ids_TK, weights_TK = _routing(geometry, tokens, rank=rank, seed=tokens, device=device)
        try:
            partial = _time_graphs(symmetric["partial"][0], x_TH, ids_TK, weights_TK, iterations)
        except RuntimeError as error:
            row["partial_error"] = str(error)
            break
        (difference,) = slowest_across_ranks([_max_abs_difference(partial, references[tokens])])
        row["nvshmem_partial_combine_us"] = _slowest(partial[1]) * 1e6
        row["max_abs_difference_partial"] = difference
        _add_bandwidths(row)
    return rows


def _max_abs_difference(timed, y_reference: torch.Tensor) -> float:
    if timed is None or y_reference.numel() == 0:
        return 0.0
    return (timed[2].float() - y_reference.float()).abs().max().item()


def _elements_differing(timed, y_reference: torch.Tensor) -> float:
    return 0.0 if timed is None else float((timed[2] != y_reference).sum())


def _add_bandwidths(row: dict) -> None:
    bytes_over_nvlink = {
        "dispatch": row["nvlink_token_bytes"],
        "direct_dispatch": row["nvlink_pair_bytes"],
        "small_dispatch": row["nvlink_token_bytes"],
        "combine": row["nvlink_pair_bytes"],
        "partial_combine": row["nvlink_token_bytes"],
        # e4m3 rows: half the bf16 bytes (the scales add 1/64 more)
        "fp8_dispatch": row["nvlink_token_bytes"] // 2,
        "fp8_combine": row["nvlink_pair_bytes"] // 2,
    }
    for step, num_bytes in bytes_over_nvlink.items():
        if f"nvshmem_{step}_us" not in row or f"nvshmem_{step}_nvlink_gbps" in row:
            continue
        seconds = row[f"nvshmem_{step}_us"] * 1e-6
        row[f"nvshmem_{step}_nvlink_gbps"] = gigabytes_per_second(num_bytes, seconds)
        row[f"nvshmem_{step}_deepep_gbps"] = gigabytes_per_second(row["deepep_bytes"], seconds)


def layer_variants(backends: list[str], device: torch.device) -> dict[str, LayerVariant]:
    """The LAYER_VARIANTS whose backend is among `backends` and runs on `device`, and whose
    dispatcher runs there (nvshmem: CUDA GPUs)."""
    return {
        name: variant
        for name, variant in LAYER_VARIANTS.items()
        if variant.backend in backends
        and backend_status(variant.backend, device)[0]
        and (variant.dispatcher != "nvshmem" or device.type == "cuda")
    }


@torch.no_grad()
def build_ep_layers(
    geometry: Geometry,
    variants: dict[str, LayerVariant],
    *,
    max_tokens_per_rank: int,
    device: torch.device,
) -> dict[str, MegaMoE]:
    """One expert-parallel MegaMoE per variant, the routed part of `geometry` (no shared
    experts) over the world group, all sharing one set of parameters: this rank's experts
    random (a seed per rank), the router the same on every rank and scaled like a trained one
    (logits ~ N(0, 1), not N(0, hidden), which would saturate the sigmoid to exactly 1.0 and let
    top-k ties send nearly every token to a few experts)."""
    rank = dist.get_rank()
    layers, first = {}, None
    for name, variant in variants.items():
        config = MegaMoEConfig.from_geometry(
            geometry,
            num_shared_experts=0,
            backend=variant.backend,
            dispatcher=variant.dispatcher,
            combine_order=variant.combine_order,
            # static buffers sized for this load (what a deployment sets)
            max_tokens_per_rank=max_tokens_per_rank,
        )
        if first is None:
            first = MegaMoE(
                config, process_group=dist.group.WORLD, device=device, dtype=torch.bfloat16
            )
            scale = geometry.hidden_size**-0.5
            generator = torch.Generator(device=device).manual_seed(rank)
            for weight in (first.w13, first.w2):
                weight.copy_(torch.randn(weight.shape, device=device, generator=generator) * scale)
            gate_generator = torch.Generator(device=device).manual_seed(1234)
            first.gate.weight.copy_(
                torch.randn(first.gate.weight.shape, device=device, generator=gate_generator)
                * scale
            )
            layers[name] = first
            continue
        layer = MegaMoE(config, process_group=dist.group.WORLD, device="meta", dtype=torch.bfloat16)
        layer.load_state_dict(first.state_dict(), assign=True)
        layers[name] = layer
    return layers


@torch.no_grad()
def run_layer(
    geometry: Geometry,
    token_counts: list[int],
    *,
    backends: list[str],
    iterations: int = 10,
) -> list[dict]:
    """The routed part of the expert-parallel MegaMoE layer at every token count, for each
    variant of `layer_variants(backends)` against the first (slowest rank's times, us).

    The dispatcher-only variant (nvshmem + grouped_mm) must equal the all_to_all + grouped_mm
    baseline bitwise (same expert backend, same batch order); the cutedsl variants differ from
    grouped_mm in rounding (bf16 GEMMs blocked differently), reported as relative L2 error and
    checked against `LAYER_TOLERANCE`."""
    rank = dist.get_rank()
    device = _rank_device()
    variants = layer_variants(backends, device)
    if not variants:
        raise ValueError(
            f"no expert-parallel layer variant runs backends {backends} on {device}; "
            f"variants: {', '.join(f'{n} ({v.backend})' for n, v in LAYER_VARIANTS.items())}"
        )
    baseline_name = next(iter(variants))
    generator = torch.Generator(device=device).manual_seed(rank)
    rows = []
    for tokens in token_counts:
        layers = build_ep_layers(geometry, variants, max_tokens_per_rank=tokens, device=device)
        x_TH = torch.randn(tokens, geometry.hidden_size, device=device, generator=generator)
        x_TH = x_TH.to(torch.bfloat16)
        first = layers[baseline_name]
        ids_TK, _ = route(
            first.router_logits(x_TH),
            first.config.router,
            correction_bias_E=first.e_score_correction_bias,
        )
        tokens_per_expert_E = torch.bincount(
            ids_TK.reshape(-1).long(), minlength=geometry.num_experts
        )
        dist.all_reduce(tokens_per_expert_E)
        row = {
            "tokens": tokens,
            # 1.0 is perfectly even
            "busiest_expert_over_mean": float(
                tokens_per_expert_E.max() / tokens_per_expert_E.float().mean()
            ),
        }
        outputs = {}
        for name, layer in layers.items():
            state = {}

            def forward(layer=layer, state=state, x_TH=x_TH):
                state["y"] = layer(x_TH)

            seconds = median_step_seconds(
                {"forward": forward},
                device=device,
                iterations=iterations,
                skip=2,  # compiles, warm-up
                before_each=_barrier,
            )["forward"]
            outputs[name] = state["y"]
            row[f"layer_{name}_us"] = _slowest(seconds) * 1e6
            timed_out = getattr(layer.dispatcher, "raise_if_timed_out", None)
            if timed_out is not None:
                timed_out()
        row.update(_layer_checks(row, outputs, baseline_name))
        rows.append(row)
        del layers
    return rows


def _layer_checks(row: dict, outputs: dict[str, torch.Tensor], baseline_name: str) -> dict:
    baseline = outputs[baseline_name]
    others = [name for name in outputs if name != baseline_name]
    # the dispatcher alone changes nothing: the same expert backend on the same batch order
    checks = [0.0]
    if baseline_name == "nccl_grouped_mm" and "nvshmem_grouped_mm" in outputs:
        checks = [float(not torch.equal(outputs["nvshmem_grouped_mm"], baseline))]
    checks += [relative_l2_error(outputs[name], baseline) for name in others]
    checks = slowest_across_ranks(checks)
    checked = {"layer_dispatcher_only_bitwise": checks[0] == 0}
    for name, error in zip(others, checks[1:], strict=True):
        checked[f"layer_{name}_speedup"] = speedup(
            row[f"layer_{baseline_name}_us"], row[f"layer_{name}_us"]
        )
        checked[f"layer_{name}_relative_l2"] = error
    checked["layer_outputs_close"] = checked["layer_dispatcher_only_bitwise"] and all(
        error <= LAYER_TOLERANCE for error in checks[1:]
    )
    return checked


def format_layer_table(rows: list[dict]) -> str:
    names = [key[len("layer_") : -len("_us")] for key in rows[0] if key.endswith("_us")]
    header = [
        "tokens",
        *(f"{name} us" for name in names),
        *(f"{name} speedup" for name in names[1:]),
        f"rel-L2 vs {names[0]}",
        "dispatcher-only bitwise",
        "busiest/mean expert",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        errors = ", ".join(f"{r[f'layer_{name}_relative_l2']:.1e}" for name in names[1:])
        cells = [
            str(r["tokens"]),
            *(f"{r[f'layer_{name}_us']:.0f}" for name in names),
            *(f"{r[f'layer_{name}_speedup']:.2f}x" for name in names[1:]),
            errors or "-",
            str(r["layer_dispatcher_only_bitwise"]),
            f"{r['busiest_expert_over_mean']:.2f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    """The dispatch and combine rows; nan where a variant did not run (no NVSHMEM, a token
    count past the small-batch limit)."""
    columns = [
        ("dispatch us", "nvshmem_dispatch_us", ".1f"),
        ("NVLink GB/s", "nvshmem_dispatch_nvlink_gbps", ".0f"),
        ("DeepEP GB/s", "nvshmem_dispatch_deepep_gbps", ".0f"),
        ("small dispatch us", "nvshmem_small_dispatch_us", ".1f"),
        ("DeepEP GB/s", "nvshmem_small_dispatch_deepep_gbps", ".0f"),
        ("direct dispatch us", "nvshmem_direct_dispatch_us", ".1f"),
        ("NVLink GB/s", "nvshmem_direct_dispatch_nvlink_gbps", ".0f"),
        ("combine us", "nvshmem_combine_us", ".1f"),
        ("NVLink GB/s", "nvshmem_combine_nvlink_gbps", ".0f"),
        ("DeepEP GB/s", "nvshmem_combine_deepep_gbps", ".0f"),
        ("partial combine us", "nvshmem_partial_combine_us", ".1f"),
        ("DeepEP GB/s", "nvshmem_partial_combine_deepep_gbps", ".0f"),
        ("fp8 dispatch us", "nvshmem_fp8_dispatch_us", ".1f"),
        ("fp8 combine us", "nvshmem_fp8_combine_us", ".1f"),
        ("fp8 rel-L2", "relative_l2_fp8_wire", ".4f"),
        ("torch dispatch us", "torch_dispatch_us", ".1f"),
        ("torch combine us", "torch_combine_us", ".1f"),
        ("NCCL a2a us", "nccl_all_to_all_us", ".1f"),
    ]
    header = "| tokens | " + " | ".join(title for title, _, _ in columns) + " | bitwise |"
    lines = [header, "|" + "---|" * (len(columns) + 2)]
    for r in rows:
        cells = [format(r.get(key, math.nan), spec) for _, key, spec in columns]
        lines.append(
            f"| {r['tokens']} | "
            + " | ".join(cells)
            + f" | {r['combine_equals_reference_bitwise']} |"
        )
    return "\n".join(lines)


def run_cli(
    *,
    geometry: Geometry,
    token_counts: list[int],
    layer_token_counts: list[int],
    backends: list[str],
    iterations: int,
    breakdown: bool,
    out: Path,
) -> int:
    """`megamoe bench --ep` on this rank: joins (or creates) the world process group from
    torchrun's environment, runs both scenarios, and on rank 0 prints the tables and writes
    ep.json, ep.csv and ep_layer.csv under `out`."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    owns_group = not dist.is_initialized()
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    if owns_group:
        if torch.cuda.is_available():
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        else:
            dist.init_process_group("gloo")
    try:
        rows = run(geometry, token_counts, iterations=iterations, breakdown=breakdown)
        layer_rows = []
        if layer_token_counts:
            layer_rows = run_layer(geometry, layer_token_counts, backends=backends)
        if dist.get_rank() == 0:
            print(
                f"{geometry.name} EP={dist.get_world_size()}: dispatch and combine, us per "
                "step, slowest rank",
                flush=True,
            )
            print(format_table(rows), flush=True)
            for row in rows:
                for variant, kernels in row.get("kernels_us", {}).items():
                    listed = ", ".join(f"{name} {us:.1f}" for name, us in kernels.items())
                    print(f"tokens {row['tokens']} {variant} kernels (us): {listed}", flush=True)
            if layer_rows:
                print(
                    f"layer {geometry.name} EP={dist.get_world_size()} (routed part, eager, us; "
                    "speedups over the first):",
                    flush=True,
                )
                print(format_layer_table(layer_rows), flush=True)
            write_json({"dispatch_combine": rows, "layer": layer_rows}, out / "ep.json")
            write_csv(
                [{k: v for k, v in r.items() if k != "kernels_us"} for r in rows], out / "ep.csv"
            )
            write_csv(layer_rows, out / "ep_layer.csv")
            print(f"rows written to {out}/ep.json, ep.csv and ep_layer.csv", flush=True)
    finally:
        from megamoe_runtime.workspace import release_all_workspaces

        release_all_workspaces()
        if owns_group:
            dist.destroy_process_group()
    return 0


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher that sets the
    env:// rendezvous variables)."""
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`megamoe bench`'s options that only --ep takes."""
    parser.add_argument(
        "--ep-layer-tokens",
        nargs="+",
        type=int,
        default=[],
        help="with --ep: also time the expert-parallel layer (megamoe against all_to_all + "
        "grouped_mm) at these token counts per rank",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="with --ep: also print each kernel's GPU time (torch profiler, eager calls, rank 0)",
    )
