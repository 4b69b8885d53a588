"""Where one eager MegaMoE forward spends its time: each GPU kernel's device time (torch
profiler) and the host time of each step of the forward, for the geometries and token counts
given. Run on the GPU machine from the project root:

    python3 scripts/layer_kernels.py --geometry qwen3-30b-a3b --tokens 1 16 2048 8192

--weight-dtype fp8 profiles the FP8 layer (e4m3 experts, the dispatch quantizing the rows);

--route-ab times the routing kernel's knobs (graph replays, alternating rounds); --phases the
routing kernel with and without its row copies and the combine alone, beside torch's kernels on
the same bytes (graph replays, alternating rounds); --forward the whole forward (graph replays
of 10 forwards, three readings) and a checksum of its output's bits; --critical-path what each
step of a decode forward costs it: the whole fused forward against the forward without its
combine (the expert rows returned as they are) and without its router GEMM (the logits
computed before), and the router and routing launches alone (graph replays, alternating
rounds; layers without shared experts); --timeline when each kernel of a forward starts and
ends, in us from the forward's first kernel (the medians over 49 forwards replayed in a CUDA
graph, from the torch profiler's CUDA activity), and of the expert GEMMs alone on its batch;
--output-ab eager forwards replayed from the layer's graph with the graph's own output handed
out (the layer's way) against a copy of it (what a forward that must return a fresh tensor
costs): the wall time of back-to-back forwards and the host time of single ones, alternating
rounds; --copy-in-ab a replayed forward's tokens brought in by the graph's own copy node
against a torch copy before the replay (wall and host time, alternating rounds); --polls-ab the
fused forward with the routing launch publishing the offsets and the decode gate-up polling for
them (megamoe_kernels' knobs.GATE_UP_POLLS_OFFSETS_MAX_TOKENS set to the call's tokens) against
the gate-up waiting for the routing launch to end: their outputs' bits compared, graph replays
of 20 forwards in three alternating rounds, and each one's kernel timeline (as --timeline);
--graph-copy what an eager forward replayed from the layer's graph costs the GPU beyond its
kernels: back-to-back replays of the layer's graph (its first node copies the tokens in), of a
graph of the same forward without that node (its input read in place) and the forward in a
graph of 10 (per forward), alternating rounds; --graph-gap
the whole forward eager and replayed from graphs of 10 forwards and of 1, with the layer's fixed
capacity and without one (alternating rounds, each reading beside the SM clock and board power
nvidia-smi sampled meanwhile), then each kernel's device time per forward, eager and
replayed, with the fixed capacity and without; --router-host
the host time of the ways to compute fp32 router logits; --host-profile prints
where the host time of an eager forward goes: single forwards, each issued after the GPU
drained (as the bench's "host us" times them), under cProfile (each function's own and
cumulative us per forward, which cProfile inflates, the largest own time first), then,
uninstrumented, the steps of a forward that replays the layer's graph.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch
from megamoe_kernels.shim.local_layer import CombineLauncher, RouteLauncher
from megamoe_runtime.dispatch.device_routed import route_launcher_constants
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_runtime.measure import (
    SmiSampler,
    alternating_readings,
    captured_graph,
    host_seconds_per_call,
    kernel_times,
    median_graph_replay_seconds,
    median_seconds,
)
from megamoe_torch.bench import build_layer, calls_in_turn, routed_tokens, with_capacity
from torch.profiler import ProfilerActivity, profile


def readings_line(readings) -> str:
    """Each candidate's readings in us, on one line: "name t t t | name t t t"."""
    return " | ".join(
        f"{name} " + " ".join(f"{t * 1e6:.1f}" for t in r.seconds) for name, r in readings.items()
    )


def host_us(fn, calls: int = 50) -> float:
    """Median over rounds of the CPU time to issue `calls` calls, per call (GPU runs behind)."""
    device = torch.device("cuda")
    return host_seconds_per_call(fn, device=device, rounds=5, calls_per_round=calls) * 1e6


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--geometry", nargs="+", default=["qwen3-30b-a3b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 2048, 8192])
    # each option runs its study of every point, in this order (the module docstring)
    studies = {
        "route_ab": route_ab,
        "phases": phases,
        "forward": forward_graph,
        "critical_path": critical_path,
        "timeline": timeline,
        "host_profile": host_profile,
        "output_ab": output_ab,
        "copy_in_ab": copy_in_ab,
        "polls_ab": polls_ab,
        "graph_copy": graph_copy,
        "graph_gap": graph_gap,
        "router_host": router_host,
    }
    for option in studies:
        parser.add_argument("--" + option.replace("_", "-"), action="store_true")
    parser.add_argument("--weight-dtype", choices=["bf16", "fp8"], default="bf16")
    args = parser.parse_args()
    weight_dtype = None if args.weight_dtype == "bf16" else args.weight_dtype
    for name in args.geometry:
        geometry = GEOMETRIES[name]
        base = build_layer(
            geometry, device=torch.device("cuda"), dtype=torch.bfloat16, weight_dtype=weight_dtype
        )
        for tokens in args.tokens:
            layer = with_capacity(base, tokens * geometry.top_k)
            layer.use_backend("cutedsl")
            x_TH, _, _ = routed_tokens(base, tokens)
            report(layer, x_TH, f"{name} {args.weight_dtype} {tokens} tokens")
            for option, study in studies.items():
                if getattr(args, option):
                    study(layer, x_TH)


def router_host(layer, x_TH) -> None:
    """Host us of the ways to compute fp32 router logits from bf16 tokens and weights."""
    weight = layer.gate.weight.detach()
    weight_t = weight.t()
    weight_t_contiguous = weight.t().contiguous()
    weight_float32 = weight.float()
    mm_dtype = torch.ops.aten.mm.dtype
    ways = {
        "mm(x, w.t(), out_dtype)": lambda: torch.mm(x_TH, weight.t(), out_dtype=torch.float32),
        "mm(x, w_t view, out_dtype)": lambda: torch.mm(x_TH, weight_t, out_dtype=torch.float32),
        "mm(x, w_t contiguous)": lambda: torch.mm(
            x_TH, weight_t_contiguous, out_dtype=torch.float32
        ),
        "aten.mm.dtype": lambda: mm_dtype(x_TH, weight_t, torch.float32),
        "linear(x.float(), w fp32)": lambda: torch.nn.functional.linear(
            x_TH.float(), weight_float32
        ),
        "linear bf16 (bf16 out)": lambda: torch.nn.functional.linear(x_TH, weight),
    }
    print("  router host us: " + ", ".join(f"{k} {host_us(f):.1f}" for k, f in ways.items()))


def route_launcher(layer, x_TH, **knobs) -> RouteLauncher:
    """A routing kernel of the layer's routing constants (e4m3 rows for FP8 experts) with
    `knobs`."""
    fp8 = layer.config.weight_dtype == "fp8"
    return RouteLauncher(
        **route_launcher_constants(layer.config.router),
        hidden_size=layer.config.hidden_size,
        rows_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
        device=x_TH.device,
        **knobs,
    )


def phases(layer, x_TH) -> None:
    """Graph-replay us of the routing kernel copying the rows and writing only each row's token
    (gather_rows: the routing, its barriers and the placement without the copy), the combine
    alone, and torch's copies of the same bytes: each token into its top-k rows, contiguous
    (the routing's HBM traffic) and the sum of each token's top-k rows, contiguous (the
    combine's); three alternating rounds."""
    config = layer.config
    tokens, hidden, top_k = x_TH.shape[0], config.hidden_size, config.top_k
    logits = layer.router_logits(x_TH)
    bias = layer.e_score_correction_bias
    capacity = tokens * top_k
    copying = route_launcher(layer, x_TH)
    gathering = route_launcher(layer, x_TH, gather_rows=True)
    routed = copying(logits, x_TH, capacity=capacity, correction_bias_E=bias)
    weights_TK, row_of_pair_TK = routed.topk_weights_TK, routed.row_of_pair_TK
    rows_MH = routed.rows_MH
    combine = CombineLauncher(top_k=top_k, hidden_size=hidden, device=x_TH.device)
    expert_out_MH = torch.randn_like(rows_MH)
    spread_TKH = torch.empty((tokens, top_k, hidden), dtype=x_TH.dtype, device=x_TH.device)
    y_TH = torch.empty_like(x_TH)
    work = {
        "route+copy": lambda: copying(logits, x_TH, capacity=capacity, correction_bias_E=bias),
        "route, no copy": lambda: gathering(
            logits, x_TH, capacity=capacity, correction_bias_E=bias
        ),
        "torch spread": lambda: spread_TKH.copy_(x_TH[:, None, :].expand(-1, top_k, -1)),
        "combine": lambda: combine(expert_out_MH, row_of_pair_TK, weights_TK),
        "torch sum": lambda: torch.sum(expert_out_MH.view(tokens, top_k, hidden), 1, out=y_TH),
    }
    readings = alternating_readings(
        {
            name: lambda fn=fn: median_graph_replay_seconds(fn, device=x_TH.device, repeats=10)
            for name, fn in work.items()
        },
        rounds=3,
    )
    copy_bytes = tokens * hidden * 2 * (1 + top_k)
    print(
        f"  phases us ({copy_bytes / 1e6:.0f} MB each way, route/combine): "
        + readings_line(readings)
    )


def forward_graph(layer, x_TH) -> None:
    """Graph-replay us of the whole forward (10 forwards a graph), three readings, and the sum of
    its output's bits as int16 (builds that compute the same bits print the same sum)."""
    checksum = int(layer(x_TH).view(torch.int16).long().sum())
    readings = [
        median_graph_replay_seconds(lambda: layer(x_TH), device=x_TH.device, repeats=10)
        for _ in range(3)
    ]
    print(
        "  forward us (graph): "
        + " ".join(f"{t * 1e6:.1f}" for t in readings)
        + f"; output checksum {checksum}"
    )


def critical_path(layer, x_TH) -> None:
    """Graph-replay us of the fused forward's steps as its chain runs them: the whole forward,
    the forward without its combine and without its router GEMM, and the router and the routing
    launch alone; three alternating rounds."""
    if layer.shared_experts is not None:
        print("  critical path: layers without shared experts only")
        return
    dispatcher = layer._device_routed
    logits_TE = layer.router_logits(x_TH)

    def route(logits):
        return forward_routing(layer, x_TH, logits)

    def experts(logits):
        batch, handle, _ = route(logits)
        return layer._run_expert_backend(batch), handle

    def forward():
        expert_out_MH, handle = experts(layer.router_logits(x_TH))
        return dispatcher.combine(expert_out_MH, handle)

    work = {
        "forward": forward,
        "no combine": lambda: experts(layer.router_logits(x_TH)),
        "no router": lambda: dispatcher.combine(*experts(logits_TE)),
        "router + routing": lambda: route(layer.router_logits(x_TH)),
    }
    assert torch.equal(forward(), layer._fused_forward(x_TH, logits_TE))
    readings = alternating_readings(
        {
            name: lambda fn=fn: median_graph_replay_seconds(fn, device=x_TH.device, repeats=20)
            for name, fn in work.items()
        },
        rounds=3,
    )
    print(f"  critical path us: {readings_line(readings)}")


def forward_routing(layer, x_TH, logits_TE):
    """The routing launch as the fused forward makes it (e4m3 rows for FP8 experts, rows
    gathered where it gathers): (batch, handle, topk ids)."""
    return layer._device_routed.route_and_dispatch(
        x_TH,
        logits_TE,
        correction_bias_E=layer.e_score_correction_bias,
        rows_dtype=torch.float8_e4m3fn if layer._dispatches_fp8_rows() else None,
        gather_rows=layer._gathers_rows(x_TH),
    )


def timeline(layer, x_TH) -> None:
    """Each kernel's start and end in a forward replayed in a CUDA graph, and in the expert
    GEMMs alone on the forward's batch: us from the forward's first kernel, the medians over
    the forwards of 5 replays of a graph of 10 (the first left out)."""
    batch, _, _ = forward_routing(layer, x_TH, layer.router_logits(x_TH))
    work = {
        "forward": lambda: layer._fused_forward_from_tokens(x_TH)[0],
        "GEMMs alone": lambda: layer._run_expert_backend(batch),
    }
    for name, fn in work.items():
        print(f"  timeline, {name} (start, end us):")
        for start, end, kernel in kernel_timeline(fn, device=x_TH.device):
            print(f"    {start:7.2f} {end:7.2f}  {kernel[:70]}")


def polls_ab(layer, x_TH, rounds: int = 3) -> None:
    """The fused forward whose routing launch publishes the offsets, its decode gate-up polling
    for them, against the one whose gate-up waits for the routing launch to end: the same bits,
    graph-replay us (20 forwards a graph) in alternating rounds, and both kernel timelines. Each
    call sets the knob for its own forward (a graph captures the routing launcher its call
    picks; the dispatcher keeps one of each kind), then puts it back."""
    from megamoe_kernels.shim import knobs

    default = knobs.GATE_UP_POLLS_OFFSETS_MAX_TOKENS

    def forward(polls: bool):
        def run():
            knobs.GATE_UP_POLLS_OFFSETS_MAX_TOKENS = x_TH.shape[0] if polls else -1
            try:
                return layer._fused_forward_from_tokens(x_TH)[0]
            finally:
                knobs.GATE_UP_POLLS_OFFSETS_MAX_TOKENS = default

        return run

    waits, polls = forward(False), forward(True)
    same = torch.equal(waits(), polls())
    readings = alternating_readings(
        {
            name: lambda fn=fn: median_graph_replay_seconds(fn, device=x_TH.device, repeats=20)
            for name, fn in (("waits", waits), ("polls", polls))
        },
        rounds=rounds,
    )
    print(f"  polls-ab us (graph): {readings_line(readings)}; same bits: {same}")
    for name, fn in (("waits", waits), ("polls", polls)):
        print(f"  timeline, gate-up {name} (start, end us):")
        for start, end, kernel in kernel_timeline(fn, device=x_TH.device):
            print(f"    {start:7.2f} {end:7.2f}  {kernel[:70]}")


def kernel_timeline(fn, *, device, forwards: int = 10, replays: int = 5):
    """(start, end, name) of each kernel `fn` launches, us from its first kernel's start: the
    medians over the calls of `replays` replays of a CUDA graph of `forwards` calls, the first
    call left out (the GPU idle before it)."""
    graph = captured_graph(fn, device=device, calls=forwards, warmup=1)
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    per_call = len(kernels) // (forwards * replays)
    calls = [kernels[i * per_call : (i + 1) * per_call] for i in range(1, forwards * replays)]
    rows = []
    for k in range(per_call):
        starts = [call[k]["ts"] - call[0]["ts"] for call in calls]
        ends = [call[k]["ts"] + call[k]["dur"] - call[0]["ts"] for call in calls]
        rows.append((statistics.median(starts), statistics.median(ends), calls[0][k]["name"]))
    return rows


def route_ab(layer, x_TH) -> None:
    """The routing kernel's knobs against its defaults (rows copied by token, one CTA up to the
    profile's bound, a CTA's rows split between its warps below 16 tokens where the row holds
    several slices, the most loads in flight): one CTA up to 16 tokens, rows not split, and
    rows split at every unroll that divides the row (slices of 32 x unroll vectors; with FP8
    experts e4m3 rows quantized by token). Graph replays, three alternating rounds."""
    config = layer.config
    logits = layer.router_logits(x_TH)
    row_vectors = config.hidden_size // 8
    variants = {
        "default": dict(),
        "one CTA": dict(one_cta_tokens=16),
        "rows not split": dict(split_tokens=0),
        "split": dict(split_tokens=16),
    }
    for unroll in (1, 2, 4, 8):
        if row_vectors % (32 * unroll) == 0:
            variants[f"unroll {unroll} split"] = dict(unroll=unroll, split_tokens=16)
    launchers = {name: route_launcher(layer, x_TH, **knobs) for name, knobs in variants.items()}
    bias = layer.e_score_correction_bias
    capacity = x_TH.shape[0] * config.top_k
    readings = alternating_readings(
        {
            name: lambda launcher=launcher: median_graph_replay_seconds(
                lambda: launcher(logits, x_TH, capacity=capacity, correction_bias_E=bias),
                device=x_TH.device,
                repeats=10,
            )
            for name, launcher in launchers.items()
        },
        rounds=3,
    )
    print(f"  route+dispatch us: {readings_line(readings)}")


def profile_lines(stats: pstats.Stats, *, calls: int, most: int = 40) -> list[str]:
    """cProfile's functions by their own time, per call of the profiled code: own us,
    cumulative us, calls, where (most of them, the largest first)."""
    rows = sorted(
        (
            (own, cumulative, count, f"{Path(file).name}:{line}({name})")
            for (file, line, name), (_, count, own, cumulative, _) in stats.stats.items()
        ),
        reverse=True,
    )
    return ["   own us    cum us  calls  where"] + [
        f"{own / calls * 1e6:8.2f} {cumulative / calls * 1e6:9.2f} {count / calls:6.1f}  {where}"
        for own, cumulative, count, where in rows[:most]
    ]


def host_profile(layer, x_TH, rounds: int = 40) -> None:
    """Where the host time of single eager forwards goes (each after the GPU drained): each
    function's own and cumulative time under cProfile, then the uninstrumented steps of a
    replayed forward."""
    for _ in range(3):
        layer(x_TH)
    profiler = cProfile.Profile()
    for _ in range(rounds):
        torch.cuda.synchronize()
        profiler.enable()
        layer(x_TH)
        profiler.disable()
    torch.cuda.synchronize()
    print(f"  cProfile, {rounds} single forwards, per forward (instrumented):")
    for line in profile_lines(pstats.Stats(profiler), calls=rounds):
        print("  " + line)
    graphs = layer._forward_graphs._graphs
    if not graphs:
        return
    entry = next(reversed(graphs.values()))[0]
    # at the other of two buffers each call
    point_copy_node = calls_in_turn(
        lambda tokens: entry.copy_source.point_at(tokens.data_ptr()), (x_TH.clone(), x_TH)
    )

    steps = {
        "forward": lambda: layer(x_TH),
        "torch copy": lambda: entry.x.copy_(x_TH),
        **({"point copy node": point_copy_node} if entry.copy_source is not None else {}),
        "graph replay": entry.graph.replay,
        "output free?": entry.output_free,
        "run": lambda: entry.run(x_TH, None, False),
        "weights signature": lambda: layer._forward_graphs._weights_signature(layer),
        "stream capturing?": torch.cuda.is_current_stream_capturing,
        "empty 4 KB": lambda: torch.empty(1024, device="cuda"),
    }
    device = torch.device("cuda")
    single = {
        name: host_seconds_per_call(step, device=device, rounds=41) * 1e6
        for name, step in steps.items()
    }
    print(
        "  replay host us (single calls): " + ", ".join(f"{k} {v:.1f}" for k, v in single.items())
    )


def graph_copy(layer, x_TH, rounds: int = 3) -> None:
    """GPU us per eager forward replayed from the layer's graph (the tokens in one buffer, so
    its copy node is not re-pointed) against a graph of the same forward without the copy node
    and against the forward in a graph of 10, alternating rounds: the copy node's cost and the
    graph launch's."""
    with torch.no_grad():
        for _ in range(3):  # the third replays the graph the second captured
            layer(x_TH)
    graphs = layer._forward_graphs._graphs
    if not graphs:
        print("  graph copy: the layer replays no graph of this forward")
        return
    entry = next(reversed(graphs.values()))[0]
    static_TH = entry.x.view(-1, layer.config.hidden_size)
    entry.x.copy_(x_TH.view(entry.x.shape))

    def forward():
        return layer._fused_forward_from_tokens(static_TH)[0]

    uncopied = captured_graph(forward, device=x_TH.device, calls=1)
    device = x_TH.device
    readings = alternating_readings(
        {
            "with copy node": lambda: median_seconds(entry.graph.replay, device=device, repeats=50),
            "without": lambda: median_seconds(uncopied.replay, device=device, repeats=50),
            "graph of 10": lambda: median_graph_replay_seconds(forward, device=device, repeats=20),
        },
        rounds=rounds,
    )
    print(f"  graph copy us (a replay back to back): {readings_line(readings)}")


def graph_gap(layer, x_TH, rounds: int = 3, repeats: int = 20) -> None:
    """The whole forward, launching its kernels, timed per forward eagerly (median_seconds:
    after the clock's settle, events around each of `repeats` forwards) and replayed from a
    CUDA graph of 10 forwards and of 1, with the layer's fixed capacity ("fixed") and without
    one ("free"), in alternating rounds; beside each reading the median SM clock and board
    power nvidia-smi sampled over its second half. Then each kernel's device time per forward
    (torch profiler) in each variant: 5 eager forwards and one replay of its graph of 10."""
    device = x_TH.device
    copies = (x_TH, x_TH.clone())
    variants = {
        "fixed": with_capacity(
            layer, layer.config.capacity, prepared_like=layer, eager_graph_tokens=0
        ),
        "free": with_capacity(layer, None, prepared_like=layer, eager_graph_tokens=0),
    }
    for variant in variants.values():
        variant.use_backend(layer.backend)
    forwards = {name: calls_in_turn(variant, copies) for name, variant in variants.items()}
    # sampling from before the captures: nvidia-smi takes a moment to print its first line
    with SmiSampler() as sampler:
        readers, graphs = {}, {}
        for name, forward in forwards.items():
            readers[f"{name} eager"] = lambda forward=forward: median_seconds(
                forward, device=device, repeats=repeats
            )
        for name, forward in forwards.items():
            for calls in (10, 1):
                graph = captured_graph(forward, device=device, calls=calls)
                graphs[name, calls] = graph
                readers[f"{name} x{calls}"] = lambda graph=graph, calls=calls: (
                    median_seconds(graph.replay, device=device, repeats=repeats) / calls
                )
        spans = {name: [] for name in readers}

        def spanned(name, read):
            def reading():
                start = time.time()
                seconds = read()
                spans[name].append((start, time.time()))
                return seconds

            return reading

        readings = alternating_readings(
            {name: spanned(name, read) for name, read in readers.items()}, rounds=rounds
        )
    print("  graph gap, us per forward (SM MHz, board W over its second half), by round:")
    for name, reading in readings.items():
        cells = []
        for seconds, (start, end) in zip(reading.seconds, spans[name], strict=True):
            late = (start + end) / 2
            clock = sampler.median_of("clocks.sm", late, end)
            power = sampler.median_of("power.draw", late, end)
            cells.append(f"{seconds * 1e6:8.1f} ({clock:4.0f}, {power:3.0f})")
        print(f"    {name:11s} " + "  ".join(cells))
    columns = {}
    for name, forward in forwards.items():
        columns[f"{name} eager"] = kernel_us(
            lambda forward=forward: [forward() for _ in range(5)], device=device, calls=5
        )
        columns[f"{name} x10"] = kernel_us(graphs[name, 10].replay, device=device, calls=10)
    kernels = sorted(
        set().union(*columns.values()), key=lambda k: -columns["fixed eager"].get(k, 0.0)
    )
    print("  kernel us per forward: " + " | ".join(columns))
    for kernel in kernels:
        cells = " | ".join(f"{us.get(kernel, 0.0):10.1f}" for us in columns.values())
        print(f"    {cells}  {kernel[:70]}")
    print("    " + " | ".join(f"{sum(us.values()):10.1f}" for us in columns.values()) + "  (all)")


def kernel_us(fn, *, device, calls: int) -> dict[str, float]:
    """Each kernel's device time in us per call (measure.kernel_times)."""
    return {
        name: kernel.us for name, kernel in kernel_times(fn, device=device, calls=calls).items()
    }


def replayed_forward_readings(variants: dict, *, rounds: int) -> dict:
    """Alternating readings of eager forwards replayed from the layer's graphs, each variant a
    (stand-in for forward_graphs._Graph.run, forward): the wall time of 50 back-to-back
    forwards (median) and the host time of single forwards, each after the GPU drained (median
    of 21)."""
    from megamoe_torch import forward_graphs

    layer_run = forward_graphs._Graph.run
    device = torch.device("cuda")

    def with_run(run, read):
        def reading():
            forward_graphs._Graph.run = run
            try:
                return read()
            finally:
                forward_graphs._Graph.run = layer_run

        return reading

    readers = {}
    for name, (run, forward) in variants.items():
        readers[f"eager-{name}"] = with_run(
            run, lambda forward=forward: median_seconds(forward, device=device, repeats=50)
        )
        readers[f"host-{name}"] = with_run(
            run, lambda forward=forward: host_seconds_per_call(forward, device=device, rounds=21)
        )
    return alternating_readings(readers, rounds=rounds)


def output_ab(layer, x_TH, rounds: int = 3) -> None:
    """Eager forwards replayed from the layer's graph: the graph's own output handed out
    (forward_graphs._Graph.run) against a copy of it (replayed_forward_readings)."""
    from megamoe_torch import forward_graphs

    handed_out = forward_graphs._Graph.run

    def copied(graph, x, router_logits):
        y, logits_TE = handed_out(graph, x, router_logits)
        return y.clone(), logits_TE

    def forward():
        return layer(x_TH)

    for _ in range(3):  # launched, captured, replayed
        forward()
    readings = replayed_forward_readings(
        {"copied": (copied, forward), "handed-out": (handed_out, forward)}, rounds=rounds
    )
    print(f"  replayed forwards, output copied or handed out, us: {readings_line(readings)}")


def copy_in_ab(layer, x_TH, rounds: int = 3) -> None:
    """How a replayed forward brings its tokens in: the graph's first node pointed at tokens
    that move between two buffers ("node, moved") or stay in one ("node, same"; the layer's way,
    graph_input.py), against a torch copy into a buffer the node reads before the replay and
    the output aliased by `view` ("torch copy", the host work of replays before the node)
    (replayed_forward_readings)."""
    from megamoe_torch import forward_graphs

    staging = torch.empty_like(x_TH)

    def torch_copy(graph, x, router_logits):
        staging.copy_(x)
        graph.copy_source.point_at(staging.data_ptr())
        graph.graph.replay()
        return graph.y.view(graph.y.shape), None

    moved = calls_in_turn(layer, (x_TH.clone(), x_TH))

    def same():
        return layer(x_TH)

    for _ in range(3):  # launched, captured, replayed
        same()
    layer_run = forward_graphs._Graph.run
    readings = replayed_forward_readings(
        {
            "torch copy": (torch_copy, same),
            "node, moved": (layer_run, moved),
            "node, same": (layer_run, same),
        },
        rounds=rounds,
    )
    print(f"  replayed forwards' copy in, us: {readings_line(readings)}")


def report(layer, x_TH, title: str) -> None:
    """Prints the device time of each kernel of one forward, and the host time of each step."""
    kernels = kernel_times(lambda: [layer(x_TH) for _ in range(5)], device=x_TH.device, calls=5)
    print(f"\n{title}, fused path: {layer.fused_path_status()}")
    for name, kernel in kernels.items():
        print(f"  {kernel.us:9.1f} us  x{kernel.launches:g}  {name[:90]}")
    logits = layer.router_logits(x_TH)
    dispatcher = layer._device_routed
    rows_dtype = torch.float8_e4m3fn if layer._dispatches_fp8_rows() else None
    bias = layer.e_score_correction_bias
    batch, handle, _ = dispatcher.route_and_dispatch(
        x_TH, logits, correction_bias_E=bias, rows_dtype=rows_dtype
    )
    prepared = layer._prepared_weights()
    out = layer._expert_backend(batch, prepared)
    steps = {
        "forward": lambda: layer(x_TH),
        "router logits": lambda: layer.router_logits(x_TH),
        "route+dispatch": lambda: dispatcher.route_and_dispatch(
            x_TH, logits, correction_bias_E=bias, rows_dtype=rows_dtype
        ),
        "expert compute": lambda: layer._expert_backend(batch, prepared),
        "combine": lambda: dispatcher.combine(out, handle),
        "empty 4 KB": lambda: torch.empty(1024, device="cuda"),
    }
    print("  host us: " + ", ".join(f"{k} {host_us(f):.1f}" for k, f in steps.items()))


if __name__ == "__main__":
    main()
