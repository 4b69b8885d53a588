"""Expert-parallel dispatch and combine benchmark: megamoe's NVSHMEM kernels next to NCCL.

Run on the GPUs of one host, one rank per GPU:

    NVSHMEM_SYMMETRIC_SIZE=4G torchrun --standalone --nproc-per-node 2 \\
        -m megamoe_runtime.bench_ep --tokens 128,512,2048,4096,8192 --out bench_ep.json

`main(argv)` is what a CLI subcommand (`megamoe bench-ep`) calls under torchrun.

Per token count (per rank; hidden 7168, top-8 of 256 experts, random routing, bf16):
- nvshmem: dispatch alone and combine alone, each captured in a CUDA graph and replayed back to
  back (events around each replay; median over iterations; slowest rank); "direct" is the
  dispatch without staging (every pair's row over NVLink), "small" the staged dispatch as the
  one small-batch kernel (for the token counts within its limit; "dispatch" is the two-kernel
  staged dispatch at every size), "partial" the combine with owner-side partial sums (one row
  per token and owner over NVLink);
- torch: the all_to_all_single reference dispatcher's dispatch and combine (eager: it syncs);
- a2a: one NCCL all_to_all_single of the dispatch payload (rows sorted by destination, splits
  known), the floor of any all_to_all-based dispatch.
Bandwidth two ways: NVLink GB/s = bytes this rank sends to other ranks / time (per direction);
DeepEP GB/s = bytes received per rank counted as DeepEP does (each token once per receiving rank,
its own included) / time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
from megamoe_kernels.reference import relative_l2_error
from megamoe_kernels.shim import ep as ep_kernels

from megamoe_runtime.dispatch.symmetric import SymmetricDispatcher
from megamoe_runtime.dispatch.torch_distributed import TorchDistributedDispatcher
from megamoe_runtime.experts.grouped_mm import GroupedMMExperts
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_runtime.routing import RouterConfig, route
from megamoe_runtime.weights import Unquantized

HIDDEN = 7168
NUM_EXPERTS = 256
TOP_K = 8


def _median_event_ms(pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> float:
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in pairs)


def _slowest(value: float) -> float:
    carrier = torch.tensor([value], device="cuda")
    dist.all_reduce(carrier, op=dist.ReduceOp.MAX)
    return float(carrier.item())


def _routing(tokens: int, rank: int, seed: int):
    generator = torch.Generator(device="cuda").manual_seed(seed * 1000 + rank)
    x_TH = torch.randn(tokens, HIDDEN, device="cuda", generator=generator).to(torch.bfloat16)
    scores_TE = torch.rand(tokens, NUM_EXPERTS, device="cuda", generator=generator)
    weights_TK, ids_TK = torch.topk(scores_TE, TOP_K, dim=-1)
    return x_TH, ids_TK.to(torch.int32), weights_TK


def _traffic(ids_TK: torch.Tensor, rank: int, world: int) -> dict[str, float]:
    local = NUM_EXPERTS // world
    owner_TK = ids_TK.long() // local
    remote_pairs = int((owner_TK != rank).sum())
    # DeepEP: a token reaches each rank that owns one of its experts once
    reached_TW = torch.zeros(ids_TK.shape[0], world, dtype=torch.bool, device=ids_TK.device)
    reached_TW.scatter_(1, owner_TK, True)
    remote_tokens = int(reached_TW.sum()) - int(reached_TW[:, rank].sum())
    tokens_per_receiver_W = reached_TW.sum(0)
    dist.all_reduce(tokens_per_receiver_W)
    row_bytes = HIDDEN * 2
    return {
        # the staged dispatch sends a token once per remote owner; combine (and the direct
        # dispatch) send every remote (token, expert) pair's row
        "nvlink_token_bytes": remote_tokens * row_bytes,
        "nvlink_pair_bytes": remote_pairs * row_bytes,
        "deepep_bytes": int(tokens_per_receiver_W[rank]) * row_bytes,
    }


def _time_graphs(dispatcher, x_TH, ids_TK, weights_TK, iterations):
    """(dispatch ms, combine ms, y) with each step a CUDA graph replayed back to back."""
    state = {}

    def dispatch():
        state["batch"], state["handle"] = dispatcher.dispatch(x_TH, ids_TK, weights_TK)

    def combine():
        state["y"] = dispatcher.combine(state["batch"].rows_MH, state["handle"])

    dispatch()
    combine()  # compile and load outside the capture
    torch.cuda.synchronize()
    dispatch_graph, combine_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(dispatch_graph):
        dispatch()
    with torch.cuda.graph(combine_graph, pool=dispatch_graph.pool()):
        combine()
    dispatch_events, combine_events = [], []
    for _ in range(iterations):
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        marks[0].record()
        dispatch_graph.replay()
        marks[1].record()
        combine_graph.replay()
        marks[2].record()
        dispatch_events.append((marks[0], marks[1]))
        combine_events.append((marks[1], marks[2]))
    dispatch_ms = _median_event_ms(dispatch_events[2:])
    combine_ms = _median_event_ms(combine_events[2:])
    dispatcher.raise_if_timed_out()
    # a copy: the output lives in the graphs' pool, reused once they are gone
    return dispatch_ms, combine_ms, state["y"].clone()


def kernel_breakdown(dispatcher, x_TH, ids_TK, weights_TK, iterations: int = 5) -> dict:
    """Mean GPU time per kernel name (us) over eager dispatch + combine calls, from the torch
    profiler: where a step's time goes (launch gaps excluded)."""
    from torch.profiler import ProfilerActivity, profile

    batch, handle = dispatcher.dispatch(x_TH, ids_TK, weights_TK)
    dispatcher.combine(batch.rows_MH, handle)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(iterations):
            batch, handle = dispatcher.dispatch(x_TH, ids_TK, weights_TK)
            dispatcher.combine(batch.rows_MH, handle)
        torch.cuda.synchronize()
    times = {}
    for event in profiler.key_averages():
        if event.device_time_total > 0:
            times[event.key[:60]] = event.device_time_total / iterations
    return times


def _time_torch_reference(dispatcher, x_TH, ids_TK, weights_TK, iterations):
    dispatch_events, combine_events = [], []
    for _ in range(iterations):
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        dist.barrier()
        marks[0].record()
        batch, handle = dispatcher.dispatch(x_TH, ids_TK, weights_TK)
        marks[1].record()
        y_TH = dispatcher.combine(batch.rows_MH, handle)
        marks[2].record()
        dispatch_events.append((marks[0], marks[1]))
        combine_events.append((marks[1], marks[2]))
    return _median_event_ms(dispatch_events[1:]), _median_event_ms(combine_events[1:]), y_TH


def _time_all_to_all(ids_TK, rank, world, iterations):
    local = NUM_EXPERTS // world
    owner_P = ids_TK.reshape(-1).long() // local
    sent_W = torch.bincount(owner_P, minlength=world)
    received_W = torch.empty_like(sent_W)
    dist.all_to_all_single(received_W, sent_W)
    sent, received = sent_W.tolist(), received_W.tolist()
    send_PH = torch.randn(sum(sent), HIDDEN, device="cuda").to(torch.bfloat16)
    receive_PH = torch.empty(sum(received), HIDDEN, device="cuda", dtype=torch.bfloat16)
    events = []
    for _ in range(iterations):
        marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        dist.barrier()
        marks[0].record()
        dist.all_to_all_single(
            receive_PH, send_PH, output_split_sizes=received, input_split_sizes=sent
        )
        marks[1].record()
        events.append(tuple(marks))
    return _median_event_ms(events[1:])


def run(token_counts: list[int], *, iterations: int = 30, breakdown: bool = False) -> list[dict]:
    """Benchmarks every token count; every rank returns the same rows (slowest rank's times)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())

    def make_dispatcher(max_tokens: int, layer_name: str, **options) -> SymmetricDispatcher:
        return SymmetricDispatcher(
            NUM_EXPERTS,
            top_k=TOP_K,
            hidden_size=HIDDEN,
            dtype=torch.bfloat16,
            device=device,
            process_group=dist.group.WORLD,
            max_tokens_per_rank=max_tokens,
            layer_name=layer_name,
            **options,
        )

    symmetric, direct, partial = (
        make_dispatcher(max(token_counts), "bench", **options)
        for options in (
            {"small_batch": False},
            {"stage_remote_rows": False},
            {"combine_partial_sums": True, "small_batch": False},
        )
    )
    # the one-kernel dispatch of a small batch, for the token counts within its kernel's limit
    # (wider than the range the default picks it for)
    small_limit = ep_kernels.small_dispatch_limits()["max_pairs"] // (world * TOP_K)
    small_counts = [tokens for tokens in token_counts if tokens <= small_limit]
    small = None
    if small_counts:
        small = make_dispatcher(max(small_counts), "bench-small", small_batch=True)
    reference = TorchDistributedDispatcher(NUM_EXPERTS, check_ids=False)
    rows, references = [], {}
    for tokens in token_counts:
        x_TH, ids_TK, weights_TK = _routing(tokens, rank, seed=tokens)
        traffic = _traffic(ids_TK, rank, world)
        nv_dispatch, nv_combine, y_nv = _time_graphs(
            symmetric, x_TH, ids_TK, weights_TK, iterations
        )
        direct_dispatch, _, y_direct = _time_graphs(direct, x_TH, ids_TK, weights_TK, iterations)
        small_dispatch = small_combine = float("nan")
        y_small = None
        if tokens in small_counts:
            small_dispatch, small_combine, y_small = _time_graphs(
                small, x_TH, ids_TK, weights_TK, iterations
            )
        torch_dispatch, torch_combine, y_torch = _time_torch_reference(
            reference, x_TH, ids_TK, weights_TK, max(5, iterations // 3)
        )
        a2a = _time_all_to_all(ids_TK, rank, world, max(5, iterations // 3))
        differences = torch.tensor(
            [
                (y_nv.float() - y_torch.float()).abs().max().item() if tokens else 0.0,
                (y_direct.float() - y_torch.float()).abs().max().item() if tokens else 0.0,
                float((y_nv != y_torch).sum()),
                float((y_small != y_torch).sum()) if y_small is not None else 0.0,
            ],
            device=device,
        )
        dist.all_reduce(differences, op=dist.ReduceOp.MAX)
        row = {
            "tokens": tokens,
            "nvshmem_dispatch_us": _slowest(nv_dispatch) * 1e3,
            "nvshmem_combine_us": _slowest(nv_combine) * 1e3,
            "nvshmem_direct_dispatch_us": _slowest(direct_dispatch) * 1e3,
            "nvshmem_small_dispatch_us": _slowest(small_dispatch) * 1e3,
            "nvshmem_small_combine_us": _slowest(small_combine) * 1e3,
            "torch_dispatch_us": _slowest(torch_dispatch) * 1e3,
            "torch_combine_us": _slowest(torch_combine) * 1e3,
            "nccl_all_to_all_us": _slowest(a2a) * 1e3,
            **traffic,
            "combine_equals_reference_bitwise": bool(differences.abs().max().item() == 0),
            "max_abs_difference_staged": differences[0].item(),
            "max_abs_difference_direct": differences[1].item(),
            "elements_differing_staged": int(differences[2].item()),
            "elements_differing_small": int(differences[3].item()),
        }
        _add_bandwidths(row, ("dispatch", "direct_dispatch", "small_dispatch", "combine"))
        if breakdown:
            row["kernels_us"] = {
                name: kernel_breakdown(dispatcher, x_TH, ids_TK, weights_TK)
                for name, dispatcher in (("staged", symmetric), ("partial", partial))
            }
        references[tokens] = y_torch
        rows.append(row)
    # the partial-sum combine last: a failure there (it is not the default) keeps the rows above
    for row in rows:
        tokens = row["tokens"]
        x_TH, ids_TK, weights_TK = _routing(tokens, rank, seed=tokens)
        try:
            _, partial_combine, y_partial = _time_graphs(
                partial, x_TH, ids_TK, weights_TK, iterations
            )
        except RuntimeError as error:
            row["partial_error"] = str(error)
            break
        difference = torch.tensor(
            [(y_partial.float() - references[tokens].float()).abs().max().item() if tokens else 0],
            device=device,
        )
        dist.all_reduce(difference, op=dist.ReduceOp.MAX)
        row["nvshmem_partial_combine_us"] = _slowest(partial_combine) * 1e3
        row["max_abs_difference_partial"] = difference.item()
        _add_bandwidths(row, ("partial_combine",))
    return rows


def _add_bandwidths(row: dict, steps: tuple[str, ...]) -> None:
    bytes_over_nvlink = {
        "dispatch": row["nvlink_token_bytes"],
        "direct_dispatch": row["nvlink_pair_bytes"],
        "small_dispatch": row["nvlink_token_bytes"],
        "combine": row["nvlink_pair_bytes"],
        "partial_combine": row["nvlink_token_bytes"],
    }
    for step in steps:
        seconds = row[f"nvshmem_{step}_us"] * 1e-6
        row[f"nvshmem_{step}_nvlink_gbps"] = bytes_over_nvlink[step] / seconds / 1e9
        row[f"nvshmem_{step}_deepep_gbps"] = row["deepep_bytes"] / seconds / 1e9


# the routed part of the EP layer, each variant a (dispatcher, expert backend) pair; the first
# is the baseline every other is timed against
LAYER_VARIANTS = {
    "nccl_grouped_mm": ("torch", "grouped_mm"),  # NCCL all_to_all + torch._grouped_mm
    "nvshmem_grouped_mm": ("nvshmem", "grouped_mm"),  # megamoe's dispatcher alone
    "megamoe": ("nvshmem", "cutedsl"),  # megamoe's whole layer (exact combine)
    "megamoe_partials": ("nvshmem_partials", "cutedsl"),  # ... owner-partials combine
}


def run_layer(token_counts: list[int], *, iterations: int = 10) -> list[dict]:
    """The routed part of an EP layer at the dsv3 geometry: route -> dispatch -> experts
    (E/W per rank) -> combine, for each of LAYER_VARIANTS against the NCCL all_to_all +
    grouped_mm composition; eager forwards (the NCCL path syncs the host for its split sizes;
    the nvshmem ones do not, but eager timing includes their launch costs), events, slowest
    rank.

    Routing is the dsv3 router's (sigmoid, grouped top-k) on a gate scaled like a trained one
    (logits of unit scale), so tokens spread over the experts as in a real layer. The
    dispatcher-only variant must equal the baseline bitwise (same expert backend, same batch
    order); the cutedsl variants differ from grouped_mm in rounding (bf16 GEMMs blocked
    differently), reported as relative L2 error and checked against `LAYER_TOLERANCE`.
    """
    from megamoe_runtime.experts.cutedsl import CuteDSLExperts

    geometry = GEOMETRIES["dsv3"]
    rank, world = dist.get_rank(), dist.get_world_size()
    local = geometry.num_experts // world
    router = RouterConfig(
        num_experts=geometry.num_experts,
        top_k=geometry.top_k,
        scoring=geometry.scoring,
        num_groups=geometry.num_groups,
        top_groups=geometry.top_groups,
        routed_scaling_factor=geometry.routed_scaling_factor,
    )
    device = torch.device("cuda", torch.cuda.current_device())
    generator = torch.Generator(device="cuda").manual_seed(rank)
    hidden, intermediate = geometry.hidden_size, geometry.intermediate_size
    scale = hidden**-0.5
    weights = Unquantized(
        w13_E2IH=(torch.randn(local, 2 * intermediate, hidden, device="cuda") * scale).to(
            torch.bfloat16
        ),
        w2_EHI=(torch.randn(local, hidden, intermediate, device="cuda") * scale).to(torch.bfloat16),
    )
    # scaled like a trained router: logits ~ N(0, 1), not N(0, hidden), which would saturate
    # the sigmoid to exactly 1.0 and let top-k ties send nearly every token to a few experts
    # (the router is replicated: the same gate on every rank)
    gate_generator = torch.Generator(device="cuda").manual_seed(1234)
    gate_EH = (
        torch.randn(geometry.num_experts, hidden, device="cuda", generator=gate_generator) * scale
    )
    backends = {"grouped_mm": GroupedMMExperts(), "cutedsl": CuteDSLExperts()}
    prepared = {name: backend.prepare(weights) for name, backend in backends.items()}
    rows = []
    for tokens in token_counts:
        # static capacity sized for this load (what a deployment sets), so the experts' work
        # over capacity rows matches the rows that arrive
        def symmetric(tokens=tokens, **options):
            return SymmetricDispatcher(
                geometry.num_experts,
                top_k=geometry.top_k,
                hidden_size=hidden,
                dtype=torch.bfloat16,
                device=device,
                process_group=dist.group.WORLD,
                max_tokens_per_rank=tokens,
                layer_name="bench-layer",
                **options,
            )

        dispatchers = {
            "torch": TorchDistributedDispatcher(geometry.num_experts, check_ids=False),
            "nvshmem": symmetric(),
            "nvshmem_partials": symmetric(combine_partial_sums=True),
        }
        x_TH = torch.randn(tokens, hidden, device="cuda", generator=generator).to(torch.bfloat16)
        ids_TK, _ = route(x_TH.float() @ gate_EH.T, router)
        tokens_per_expert_E = torch.bincount(
            ids_TK.reshape(-1).long(), minlength=router.num_experts
        )
        dist.all_reduce(tokens_per_expert_E)
        row = {
            "tokens": tokens,
            # 1.0 is perfectly even; the unscaled gate gave ~20
            "busiest_expert_over_mean": float(
                tokens_per_expert_E.max() / tokens_per_expert_E.float().mean()
            ),
        }
        outputs = {}
        for name, (dispatcher_name, backend_name) in LAYER_VARIANTS.items():
            dispatcher = dispatchers[dispatcher_name]
            experts, expert_weights = backends[backend_name], prepared[backend_name]

            def forward(
                dispatcher=dispatcher, experts=experts, expert_weights=expert_weights, x_TH=x_TH
            ):
                ids_TK, weights_TK = route(x_TH.float() @ gate_EH.T, router)
                batch, handle = dispatcher.dispatch(x_TH, ids_TK, weights_TK)
                return dispatcher.combine(experts(batch, expert_weights), handle)

            events = []
            for _ in range(iterations):  # the first two (compiles, warm-up) are not counted
                marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                dist.barrier()
                marks[0].record()
                outputs[name] = forward()
                marks[1].record()
                events.append(tuple(marks))
            row[f"layer_{name}_us"] = _slowest(_median_event_ms(events[2:])) * 1e3
        for dispatcher in dispatchers.values():
            if isinstance(dispatcher, SymmetricDispatcher):
                dispatcher.raise_if_timed_out()
        baseline_name = next(iter(LAYER_VARIANTS))
        baseline = outputs[baseline_name]
        checks = [float(not torch.equal(outputs["nvshmem_grouped_mm"], baseline))]
        for name in LAYER_VARIANTS:
            if name == baseline_name:
                continue
            row[f"layer_{name}_speedup"] = (
                row[f"layer_{baseline_name}_us"] / row[f"layer_{name}_us"]
            )
            checks.append(relative_l2_error(outputs[name], baseline))
        checks_W = torch.tensor(checks, device=device)
        dist.all_reduce(checks_W, op=dist.ReduceOp.MAX)
        row["layer_dispatcher_only_bitwise"] = bool(checks_W[0] == 0)
        for name, error in zip(list(LAYER_VARIANTS)[1:], checks_W[1:].tolist(), strict=True):
            row[f"layer_{name}_relative_l2"] = error
        row["layer_outputs_close"] = row["layer_dispatcher_only_bitwise"] and all(
            error <= LAYER_TOLERANCE for error in checks_W[1:].tolist()
        )
        rows.append(row)
    return rows


# relative L2 error of a cutedsl layer against the grouped_mm one: both are bf16 GEMMs with
# fp32 accumulation, which round the SwiGLU hidden and the output to bf16 (~4e-3 per rounding)
LAYER_TOLERANCE = 1e-2


def format_layer_table(rows: list[dict]) -> str:
    names = list(LAYER_VARIANTS)
    header = (
        "| tokens | "
        + " | ".join(f"{name} us" for name in names)
        + " | "
        + " | ".join(f"{name} speedup" for name in names[1:])
        + " | rel-L2 (cutedsl vs grouped_mm) | dispatcher-only bitwise | busiest/mean expert |"
    )
    lines = [header, "|" + "---|" * (2 * len(names) + 2)]
    for r in rows:
        errors = ", ".join(f"{r[f'layer_{name}_relative_l2']:.1e}" for name in names[2:])
        lines.append(
            f"| {r['tokens']} | "
            + " | ".join(f"{r[f'layer_{name}_us']:.0f}" for name in names)
            + " | "
            + " | ".join(f"{r[f'layer_{name}_speedup']:.2f}x" for name in names[1:])
            + f" | {errors} | {r['layer_dispatcher_only_bitwise']} | "
            f"{r['busiest_expert_over_mean']:.2f} |"
        )
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    header = (
        "| tokens | dispatch us | NVLink GB/s | DeepEP GB/s | small dispatch us | DeepEP GB/s "
        "| direct dispatch us | NVLink GB/s "
        "| combine us | NVLink GB/s | DeepEP GB/s | partial combine us | DeepEP GB/s "
        "| torch dispatch us | torch combine us | NCCL a2a us | bitwise |"
    )
    lines = [header, "|" + "---|" * 17]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['nvshmem_dispatch_us']:.1f} | "
            f"{r['nvshmem_dispatch_nvlink_gbps']:.0f} | {r['nvshmem_dispatch_deepep_gbps']:.0f} | "
            f"{r['nvshmem_small_dispatch_us']:.1f} | "
            f"{r['nvshmem_small_dispatch_deepep_gbps']:.0f} | "
            f"{r['nvshmem_direct_dispatch_us']:.1f} | "
            f"{r['nvshmem_direct_dispatch_nvlink_gbps']:.0f} | "
            f"{r['nvshmem_combine_us']:.1f} | {r['nvshmem_combine_nvlink_gbps']:.0f} | "
            f"{r['nvshmem_combine_deepep_gbps']:.0f} | "
            f"{r.get('nvshmem_partial_combine_us', float('nan')):.1f} | "
            f"{r.get('nvshmem_partial_combine_deepep_gbps', float('nan')):.0f} | "
            f"{r['torch_dispatch_us']:.1f} | "
            f"{r['torch_combine_us']:.1f} | {r['nccl_all_to_all_us']:.1f} | "
            f"{r['combine_equals_reference_bitwise']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megamoe bench-ep", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="128,512,2048,4096,8192")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--out", default=None, help="JSON file for the rows (rank 0 writes it)")
    parser.add_argument(
        "--layer-tokens",
        default="",
        help="also time the whole dsv3 EP layer (megamoe vs NCCL + grouped_mm) at these token counts",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also print each kernel's GPU time (torch profiler, eager calls, rank 0)",
    )
    args = parser.parse_args(argv)
    token_counts = [int(value) for value in args.tokens.split(",")]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    try:
        rows = run(token_counts, iterations=args.iterations, breakdown=args.breakdown)
        if dist.get_rank() == 0:
            print(format_table(rows), flush=True)
            for row in rows:
                for variant, kernels in row.get("kernels_us", {}).items():
                    listed = ", ".join(f"{name} {us:.1f}" for name, us in kernels.items())
                    print(f"tokens {row['tokens']} {variant} kernels (us): {listed}", flush=True)
        layer_rows = []
        if args.layer_tokens:
            layer_tokens = [int(value) for value in args.layer_tokens.split(",")]
            layer_rows = run_layer(layer_tokens)
        if dist.get_rank() == 0:
            if layer_rows:
                print(
                    f"layer dsv3 EP={dist.get_world_size()} (routed part, eager, us; speedups "
                    f"over {next(iter(LAYER_VARIANTS))}):",
                    flush=True,
                )
                print(format_layer_table(layer_rows), flush=True)
            if args.out:
                with open(args.out, "w") as handle:
                    json.dump({"dispatch_combine": rows, "layer": layer_rows}, handle, indent=1)
    finally:
        from megamoe_runtime.workspace import release_all_workspaces

        release_all_workspaces()
        if owns_group:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
