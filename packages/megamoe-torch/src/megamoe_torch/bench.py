"""Benchmarks of expert compute and of the whole layer, backend against backend in one run.

`bench_point` (modes "kernels" and "eager"): time, the ratio to the grouped_mm baseline measured in
the same run, TFLOP/s, the fraction of the roofline floor (docs/benchmarks.md; FP8 experts':
e4m3 products and weights at one byte with their scales), and rel-L2 and DeepGEMM's difference
against the fp32 oracle. `bench_layer_point` (mode "layer"): the whole forward, router GEMM to
combine, eager and as a CUDA-graph replay, with the ops it launches and its host time, against
the expert GEMMs alone and against the grouped_mm layer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from megamoe_kernels.reference import expert_mlp_reference, fp8_difference, relative_l2_error
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.experts import backend_status, expert_slice, make_backend
from megamoe_runtime.geometries import Geometry
from megamoe_runtime.measure import (
    Readings,
    alternating_readings,
    expert_roofline_fraction,
    host_seconds_per_call,
    median_graph_replay_seconds,
    median_seconds,
    plot_bars,
    speedup,
    tflops,
)
from megamoe_runtime.routing import route
from megamoe_runtime.weights import WeightPack

from megamoe_torch.config import MegaMoEConfig
from megamoe_torch.layer import MegaMoE

BASELINE = "grouped_mm"
# the characters of an op's name a layer row keeps (a CuTe DSL kernel's name spells its whole
# signature: hundreds of characters; the first 80 tell the kernels apart)
OP_NAME_CHARS = 80
# experts whose oracle weights are dequantized to float32 at a time (oracle_rows)
ORACLE_EXPERTS_PER_CHUNK = 32


@dataclass(frozen=True)
class BenchRow:
    geometry: str
    tokens: int
    rows: int
    active_experts: int
    backend: str
    mode: str  # "kernels" (graph replay of expert compute) or "eager" (whole layer forward)
    microseconds: float
    host_microseconds: float  # CPU time to issue one call (graphs off)
    baseline_microseconds: float | None
    speedup: float | None
    tflops: float
    roofline_fraction: float
    rel_l2: float
    # DeepGEMM's 1 - 2 sum(xy) / sum(x^2 + y^2) against the same fp32 oracle (the FP8 experts'
    # accuracy target: <= 1e-3)
    difference: float


@dataclass(frozen=True)
class LayerBenchRow:
    """One backend's whole forward (router GEMM, routing, dispatch, expert MLP, combine, shared
    experts) at one point, per forward.

    `graph_microseconds` is a CUDA-graph replay's time, None on a CPU. `gpu_ops` counts what
    `ops_counted` names: on a GPU "kernels", the CUDA kernels one eager forward launches, with its
    memcpy and memset apart in `gpu_memory_ops`; on a CPU "aten ops", the aten ops the forward
    calls from Python (not those inside other aten ops), and `gpu_memory_ops` is None.
    `gemm_microseconds` is the expert compute alone on the same batch (the "kernels" mode); for
    a layer whose shared experts can join the batch (MegaMoEConfig.
    shared_experts_in_batch_problems empty), on that batch with them in it
    (shared_in_batch_seconds), so that `layer_over_gemms` weighs the routing, dispatch and
    combine and not the shared experts' own compute.
    `layer_over_gemms` and `speedup` (grouped_mm's layer time over this backend's) compare graph
    replays on a GPU and eager forwards on a CPU; the baseline fields are None when grouped_mm
    was not among the backends of the run. An eager forward of the fused path of up to
    `eager_graph_tokens` tokens replays the layer's own graph (forward_graphs.py): the
    `launched_*` fields time the same forward launching its kernels (eager_graph_tokens=0), in
    the same run, and are None where no graph is replayed; `gpu_ops` counts the launched
    forward's kernels, and `launched_ops` names them (or the aten ops), in the order they ran.
    """

    geometry: str
    tokens: int
    backend: str
    layer_path: str  # "fused" (device routing, dispatch, combine) or "torch"
    eager_microseconds: float
    graph_microseconds: float | None
    host_microseconds: float  # CPU time to issue one eager forward
    gpu_ops: int
    gpu_memory_ops: int | None
    ops_counted: str
    gemm_microseconds: float
    layer_over_gemms: float
    baseline_eager_microseconds: float | None
    baseline_graph_microseconds: float | None
    speedup: float | None
    launched_eager_microseconds: float | None = None
    launched_host_microseconds: float | None = None
    # what gpu_ops counts, in the order it ran, "; "-separated, each name cut to OP_NAME_CHARS
    launched_ops: str = ""


def build_layer(
    geometry: Geometry,
    *,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    weight_dtype: str | None = None,
) -> MegaMoE:
    """A layer of `geometry` (its routing and expert math too: MegaMoEConfig.from_geometry) with
    random weights scaled so bf16 activations stay O(1), and the router and expert biases a
    geometry has random too (as reset_parameters draws them), so that they are computed;
    weight_dtype="fp8": the same weights quantized per 128 x 128 block, the shared experts'
    too, as DeepSeek-V3's FP8 checkpoints hold them (a ValueError for a geometry whose expert
    biases FP8 experts do not compute)."""
    torch.manual_seed(seed)
    shared_weight_dtype = weight_dtype if geometry.num_shared_experts else None
    config = MegaMoEConfig.from_geometry(
        geometry,
        backend="reference",
        weight_dtype=weight_dtype,
        shared_weight_dtype=shared_weight_dtype,
    )
    layer = MegaMoE(config, device=device, dtype=dtype)
    with torch.no_grad():
        for name, fan_in in (("w13", geometry.hidden_size), ("w2", geometry.intermediate_size)):
            values = torch.empty(getattr(layer, name).shape, device=device, dtype=dtype)
            layer.load_expert_weights(**{name: values.normal_(0, fan_in**-0.5)})
        if layer.e_score_correction_bias is not None:
            layer.e_score_correction_bias.normal_(0, 0.01)
    return layer


def routed_tokens(layer: MegaMoE, tokens: int, *, seed: int = 1):
    """Random tokens, routed by the layer's own router: (x_TH, topk_ids_TK, topk_weights_TK)."""
    generator = torch.Generator(device=layer.w13.device).manual_seed(seed)
    x_TH = torch.randn(
        tokens,
        layer.config.hidden_size,
        device=layer.w13.device,
        dtype=layer.activation_dtype,
        generator=generator,
    )
    ids, weights = route(
        layer.router_logits(x_TH),
        layer.config.router,
        correction_bias_E=layer.e_score_correction_bias,
    )
    return x_TH, ids, weights


def backend_label(layer: MegaMoE, name: str) -> str:
    """How rows name a backend: `name`, with "+fp8" for a layer of FP8 experts."""
    return name if layer.config.weight_dtype is None else f"{name}+{layer.config.weight_dtype}"


def available_backends(device: torch.device, requested: Iterable[str]) -> list[str]:
    return [name for name in requested if backend_status(name, device)[0]]


def layer_backends(layer: MegaMoE, requested: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """(the backends of `requested` that compute `layer`'s experts on its device, why each
    other one does not): the device, and for FP8 experts the expert math (the cutedsl FP8
    kernels compute no expert biases or clamped SwiGLU)."""
    runnable, refused = [], {}
    for name in requested:
        can_run, reason = backend_status(
            name,
            layer.w13.device,
            fp8_weights=layer.config.weight_dtype == "fp8",
            expert_math=layer.config.expert_math_features,
        )
        if can_run:
            runnable.append(name)
        else:
            refused[name] = reason
    return runnable, refused


def fp8_rows_batch(batch: ExpertBatch) -> ExpertBatch:
    """The batch with its rows quantized to e4m3 per 128 channels, as the layer's dispatch
    writes them for FP8 experts (the FP8 kernels take them: timed without the dispatch)."""
    from megamoe_kernels import quantize_rows

    rows, scales = quantize_rows(batch.rows_MH)
    return replace(batch, rows_MH=rows, row_scales_GM=scales)


def oracle_rows(pack: WeightPack, batch: ExpertBatch, offsets: list[int]) -> torch.Tensor:
    """The fp32 oracle's output for the batch's valid rows (`offsets`: its expert offsets on the
    host), from the reference backend's weights (an FP8 pack's dequantized values) taken
    ORACLE_EXPERTS_PER_CHUNK experts at a time: DeepSeek-V3's 256 experts dequantized at once
    would take 45 GB of float32."""
    chunks = []
    experts = len(offsets) - 1
    for first in range(0, experts, ORACLE_EXPERTS_PER_CHUNK):
        last = min(first + ORACLE_EXPERTS_PER_CHUNK, experts)
        if offsets[last] == offsets[first]:
            continue
        exact = make_backend("reference").prepare(expert_slice(pack, first, last))
        chunks.append(
            expert_mlp_reference(
                batch.rows_MH[offsets[first] : offsets[last]],
                batch.expert_offsets[first : last + 1] - offsets[first],
                exact.w13_E2IH,
                exact.w2_EHI,
                w13_bias_E2I=exact.w13_bias_E2I,
                w2_bias_EH=exact.w2_bias_EH,
                limit=exact.swiglu.limit,
                alpha=exact.swiglu.alpha,
                up_offset=exact.swiglu.up_offset,
                activation=exact.activation,
            )
        )
    hidden = pack.w2_EHI.shape[1]
    if not chunks:
        return batch.rows_MH.new_zeros(0, hidden, dtype=torch.float32)
    return torch.cat(chunks)


@torch.no_grad()
def bench_point(
    layer: MegaMoE,
    geometry: Geometry,
    tokens: int,
    *,
    backends: list[str],
    modes: tuple[str, ...] = ("kernels",),
    repeats: int = 30,
) -> list[BenchRow]:
    device = layer.w13.device
    x_TH, ids, weights = routed_tokens(layer, tokens)
    batch, _ = LocalDispatcher(geometry.num_experts).dispatch(x_TH, ids, weights)
    offsets = batch.expert_offsets.tolist()
    rows = offsets[-1]
    active = sum(1 for e in range(geometry.num_experts) if offsets[e + 1] > offsets[e])
    pack = layer.expert_weight_pack()
    oracle_MH = oracle_rows(pack, batch, offsets)
    fp8_batch = fp8_rows_batch(batch) if layer.config.weight_dtype == "fp8" else None
    results: dict[tuple[str, str], tuple[float, float, tuple[float, float]]] = {}
    for name in backends:
        backend = make_backend(name)
        prepared = backend.prepare(pack)
        batch_in = fp8_batch if fp8_batch is not None and name == "cutedsl" else batch
        out_MH = backend(batch_in, prepared)[:rows]
        errors = (relative_l2_error(out_MH, oracle_MH), fp8_difference(out_MH, oracle_MH))
        for mode in modes:
            if mode == "kernels":
                # the reference backend reads the offsets on the host: it cannot be captured
                capturable = device.type == "cuda" and name != "reference"
                timer = median_graph_replay_seconds if capturable else median_seconds

                def call(backend=backend, prepared=prepared, batch_in=batch_in):
                    return backend(batch_in, prepared)
            else:
                layer.use_backend(name)
                timer = median_seconds

                def call():
                    return layer(x_TH)

            seconds = timer(call, device=device, repeats=repeats)
            results[(name, mode)] = (seconds, host_seconds_per_call(call, device=device), errors)
    out = []
    for (name, mode), (seconds, host_seconds, (error, difference)) in results.items():
        baseline = results.get((BASELINE, mode), (None,))[0]
        out.append(
            BenchRow(
                geometry=geometry.name,
                tokens=tokens,
                rows=rows,
                active_experts=active,
                backend=backend_label(layer, name),
                mode=mode,
                microseconds=seconds * 1e6,
                host_microseconds=host_seconds * 1e6,
                baseline_microseconds=None if baseline is None else baseline * 1e6,
                speedup=speedup(baseline, seconds),
                tflops=tflops(geometry.expert_flops(rows), seconds),
                roofline_fraction=expert_roofline_fraction(
                    geometry,
                    rows=rows,
                    active_experts=active,
                    seconds=seconds,
                    weight_dtype=layer.config.weight_dtype,
                ),
                rel_l2=error,
                difference=difference,
            )
        )
    return out


def shared_in_batch(layer: MegaMoE, tokens: int):
    """`tokens` routed tokens (routed_tokens) in a batch with the layer's shared experts in it,
    as the fused path's batch holds them where they join it: every token's row also in each of
    the S = shared_size / intermediate_size experts after the routed ones, with weight 1, and
    the pack whose experts E..E+S-1 compute the shared MLP's columns
    (MegaMoE.shared_in_batch_weight_pack).
    Returns (x_TH, batch, handle, pack); for shared experts that can join the batch
    (MegaMoEConfig.shared_experts_in_batch_problems empty)."""
    device = layer.w13.device
    config = layer.config
    x_TH, ids, weights = routed_tokens(layer, tokens)
    shared = config.shared_size // config.intermediate_size
    shared_ids = torch.arange(config.num_experts, config.num_experts + shared, device=device)
    ids = torch.cat((ids, shared_ids.to(ids.dtype).expand(tokens, shared)), dim=1)
    weights = torch.cat((weights, weights.new_ones(tokens, shared)), dim=1)
    batch, handle = LocalDispatcher(config.num_experts + shared).dispatch(x_TH, ids, weights)
    return x_TH, batch, handle, layer.shared_in_batch_weight_pack()


@torch.no_grad()
def shared_in_batch_seconds(
    layer: MegaMoE, tokens: int, *, backend_name: str, repeats: int = 30
) -> float:
    """The expert compute of shared_in_batch's batch on one backend: graph replays on a GPU,
    eager calls on a CPU."""
    _, batch, _, pack = shared_in_batch(layer, tokens)
    if layer.config.weight_dtype == "fp8" and backend_name == "cutedsl":
        batch = fp8_rows_batch(batch)
    backend = make_backend(backend_name)
    prepared = backend.prepare(pack)
    # the reference backend reads the offsets on the host: it cannot be captured
    capturable = batch.rows_MH.device.type == "cuda" and backend_name != "reference"
    timer = median_graph_replay_seconds if capturable else median_seconds
    return timer(lambda: backend(batch, prepared), device=batch.rows_MH.device, repeats=repeats)


def _gemms_take_shared_experts(layer: MegaMoE) -> bool:
    """Whether the layer's expert GEMMs can compute its shared experts too (in the batch)."""
    return layer.shared_experts is not None and not layer.config.shared_experts_in_batch_problems


def expert_compute_seconds(
    layer: MegaMoE, geometry: Geometry, tokens: int, *, backend_name: str, repeats: int = 30
) -> float:
    """The expert compute alone of a forward of `layer` on `tokens` routed tokens
    (routed_tokens), one backend: the layer bench's GEMMs, against which a forward's time is
    read. With shared experts that can join the batch it is that batch with them in it
    (shared_in_batch_seconds), else the "kernels" mode of bench_point."""
    if _gemms_take_shared_experts(layer):
        return shared_in_batch_seconds(layer, tokens, backend_name=backend_name, repeats=repeats)
    (row,) = bench_point(
        layer, geometry, tokens, backends=[backend_name], modes=("kernels",), repeats=repeats
    )
    return row.microseconds / 1e6


def with_capacity(
    layer: MegaMoE, capacity: int, *, prepared_like: MegaMoE | None = None, **overrides
) -> MegaMoE:
    """The same layer, sharing its parameter tensors (no copy), with a fixed expert-batch capacity
    of `capacity` rows (and any other config `overrides`): every shape of its forward is static,
    so the forward captures in a CUDA graph. `prepared_like`: another such layer whose backend
    weights (the prepared expert layout, a copy of the expert weights) this one shares, for
    variants of a layer on one backend side by side (one copy in memory, not one each)."""
    config = replace(layer.config, capacity=capacity, **overrides)
    fixed = MegaMoE(config, device="meta", dtype=layer.activation_dtype)
    fixed.load_state_dict(layer.state_dict(), assign=True)
    if prepared_like is not None:
        # its parameters too, the same objects: a preparation may point them at the weights
        # it made (MegaMoE._point_routed_weights_into), which both layers must then read
        twins = dict(prepared_like.named_modules())
        for name, module in fixed.named_modules():
            module._parameters.update(twins[name]._parameters)
        fixed._prepared = prepared_like._prepared
    return fixed


def calls_in_turn(fn: Callable[[object], object], inputs: Iterable) -> Callable[[], object]:
    """A call of `fn` on each of `inputs` in turn, one per call (a layer's forwards on copies of
    the tokens, as a model's activations move between forwards)."""
    turns = itertools.cycle(inputs)
    return lambda: fn(next(turns))


def alternating_forward_readings(
    forwards: Mapping[object, Callable[[], object]],
    *,
    device: torch.device,
    rounds: int,
    eager: bool = True,
) -> dict[tuple[str, object], Readings]:
    """An A/B of forwards (variants of one layer on the same tokens): each timed by CUDA-graph
    replay and, with `eager`, eagerly, in alternating rounds (the first's graph, its eager, the
    second's, ...). The readings by ("graph" or "eager", variant)."""
    readers = {}
    for variant, forward in forwards.items():
        readers["graph", variant] = lambda forward=forward: median_graph_replay_seconds(
            forward, device=device
        )
        if eager:
            readers["eager", variant] = lambda forward=forward: median_seconds(
                forward, device=device
            )
    return alternating_readings(readers, rounds=rounds)


def alternating_forward_times(
    forwards: Mapping[object, Callable[[], object]],
    *,
    device: torch.device,
    rounds: int,
    eager: bool = True,
) -> dict[str, str]:
    """alternating_forward_readings, listed (listed_forward_times)."""
    return listed_forward_times(
        alternating_forward_readings(forwards, device=device, rounds=rounds, eager=eager)
    )


def listed_forward_times(readings: Mapping[tuple[str, object], Readings]) -> dict[str, str]:
    """For "graph" and "eager": each forward's times in us (alternating_forward_readings), the
    forwards apart by " / " ("-" where not timed)."""
    listed = {}
    for kind in ("graph", "eager"):
        variants = [variant for timed, variant in readings if timed == kind]
        listed[kind] = (
            " / ".join(
                " ".join(f"{t * 1e6:.1f}" for t in readings[kind, variant].seconds)
                for variant in variants
            )
            or "-"
        )
    return listed


def ops_per_call(
    fn: Callable[[], object], *, device: torch.device
) -> tuple[int, int | None, str, list[str]]:
    """(ops, memory ops, what was counted, the counted ops' names in the order they ran) for one
    call of `fn()` after a warm-up call, from the torch profiler. On a GPU: the CUDA kernels it
    launches and, apart, its memcpy and memset, "kernels". On a CPU, which has no kernels to
    count: the aten ops it calls from Python (an op inside another aten op is not counted),
    None, "aten ops"."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def in_order(events) -> list[str]:
        return [e.name for e in sorted(events, key=lambda e: e.time_range.start)]

    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            fn()
            torch.cuda.synchronize(device)
        names = in_order(e for e in profiler.events() if e.device_type == DeviceType.CUDA)
        kernels = [name for name in names if not name.startswith(("Memcpy", "Memset"))]
        return len(kernels), len(names) - len(kernels), "kernels", kernels
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        fn()

    def is_aten(event) -> bool:
        return event.name.startswith("aten::")

    def called_from_python(event) -> bool:
        parent = event.cpu_parent
        while parent is not None:
            if is_aten(parent):
                return False
            parent = parent.cpu_parent
        return True

    names = in_order(e for e in profiler.events() if is_aten(e) and called_from_python(e))
    return len(names), None, "aten ops", names


@torch.no_grad()
def bench_layer_point(
    layer: MegaMoE,
    geometry: Geometry,
    tokens: int,
    *,
    backends: list[str],
    repeats: int = 30,
    kernel_rows: Iterable[BenchRow] = (),
) -> list[LayerBenchRow]:
    """The whole forward of `layer` on `tokens` random tokens, per backend: median eager time,
    median per-forward time of a CUDA-graph replay (graphs of several forwards, as the "kernels"
    mode times the expert compute), the ops one eager forward launches (ops_per_call) and the
    host time to issue it. The layer runs with a fixed capacity of tokens x top_k rows (the
    routed rows exactly, so nothing is padded) on its own parameters, its forwards on two
    copies of the tokens in turn, as a model's moving activations. The expert compute alone
    comes from this point's "kernels" rows in `kernel_rows`, measured here for the backends
    they lack; for a layer whose shared experts can join the batch it is that batch with them
    in it (shared_in_batch_seconds)."""
    device = layer.w13.device
    fixed = with_capacity(layer, tokens * geometry.top_k)
    # the baseline is the torch composition end to end: torch routing, dispatch and combine
    all_torch = with_capacity(layer, tokens * geometry.top_k, layer_path="torch")
    # the same forward launching its kernels where `fixed` replays its own graph
    launching = with_capacity(
        layer, tokens * geometry.top_k, prepared_like=fixed, eager_graph_tokens=0
    )
    x_TH, _, _ = routed_tokens(layer, tokens)  # the tokens bench_point dispatches
    # forwards alternate between two copies of the tokens: a model hands each forward fresh
    # activations at another address (a replayed forward points its graph's input copy at
    # them, graph_input.py)
    token_copies = (x_TH, x_TH.clone())
    gemm_seconds = {}
    if not _gemms_take_shared_experts(layer):
        gemm_seconds = {
            row.backend: row.microseconds / 1e6
            for row in kernel_rows
            if (row.geometry, row.tokens, row.mode) == (geometry.name, tokens, "kernels")
        }
    for name in backends:
        if backend_label(layer, name) not in gemm_seconds:
            gemm_seconds[backend_label(layer, name)] = expert_compute_seconds(
                layer, geometry, tokens, backend_name=name, repeats=repeats
            )
    measured = {}
    for name in backends:
        measured_layer = all_torch if name == BASELINE else fixed
        measured_layer.use_backend(name)

        forward = calls_in_turn(measured_layer, token_copies)
        eager = median_seconds(forward, device=device, repeats=repeats)
        # the reference backend reads the offsets on the host: it cannot be captured
        graph = (
            median_graph_replay_seconds(forward, device=device, repeats=repeats)
            if device.type == "cuda" and name != "reference"
            else None
        )
        host = host_seconds_per_call(forward, device=device)
        path = "fused" if measured_layer.fused_path_status(device)[0] else "torch"
        launched = (None, None)
        counted_forward = forward
        # the layer's own rule for which forwards replay its graphs (token count first)
        if measured_layer._replays_graphs(x_TH):
            launching.use_backend(name)

            counted_forward = calls_in_turn(launching, token_copies)
            launched = (
                median_seconds(counted_forward, device=device, repeats=repeats),
                host_seconds_per_call(counted_forward, device=device),
            )
        measured[name] = (
            path,
            eager,
            graph,
            host,
            launched,
            *ops_per_call(counted_forward, device=device),
        )
    baseline_eager, baseline_graph = measured.get(BASELINE, (None, None, None))[1:3]
    out = []
    for name, measurement in measured.items():
        path, eager, graph, host, launched, ops, memory_ops, counted, op_names = measurement
        seconds = eager if graph is None else graph
        baseline = baseline_eager if graph is None else baseline_graph
        out.append(
            LayerBenchRow(
                geometry=geometry.name,
                tokens=tokens,
                backend=backend_label(layer, name),
                layer_path=path,
                eager_microseconds=eager * 1e6,
                graph_microseconds=None if graph is None else graph * 1e6,
                host_microseconds=host * 1e6,
                gpu_ops=ops,
                gpu_memory_ops=memory_ops,
                ops_counted=counted,
                gemm_microseconds=gemm_seconds[backend_label(layer, name)] * 1e6,
                layer_over_gemms=seconds / gemm_seconds[backend_label(layer, name)],
                baseline_eager_microseconds=None
                if baseline_eager is None
                else baseline_eager * 1e6,
                baseline_graph_microseconds=None
                if baseline_graph is None
                else baseline_graph * 1e6,
                speedup=speedup(baseline, seconds),
                launched_eager_microseconds=None if launched[0] is None else launched[0] * 1e6,
                launched_host_microseconds=None if launched[1] is None else launched[1] * 1e6,
                launched_ops="; ".join(op[:OP_NAME_CHARS] for op in op_names),
            )
        )
    return out


@torch.no_grad()
def capacity_sweep(
    layer: MegaMoE,
    geometry: Geometry,
    *,
    capacity_tokens: int,
    fractions: Iterable[float],
    backend_name: str,
    repeats: int = 30,
) -> list[dict]:
    """Fixed capacity, valid rows from a small fraction to all of it: cost should follow them."""
    device = layer.w13.device
    capacity = capacity_tokens * geometry.top_k
    backend = make_backend(backend_name)
    prepared = backend.prepare(layer.expert_weight_pack())
    out = []
    for fraction in fractions:
        tokens = max(1, round(capacity_tokens * fraction))
        x_TH, ids, weights = routed_tokens(layer, tokens)
        batch, _ = LocalDispatcher(geometry.num_experts, capacity=capacity).dispatch(
            x_TH, ids, weights
        )
        # the valid rows known on the device only (as at an expert-parallel receiver): the
        # sweep measures the device-side choice
        batch = replace(batch, valid_rows=None)
        tight, _ = LocalDispatcher(geometry.num_experts).dispatch(x_TH, ids, weights)
        timer = median_graph_replay_seconds if device.type == "cuda" else median_seconds
        padded = timer(lambda b=batch: backend(b, prepared), device=device, repeats=repeats)
        exact = timer(lambda b=tight: backend(b, prepared), device=device, repeats=repeats)
        out.append(
            dict(
                geometry=geometry.name,
                backend=backend_name,
                capacity=capacity,
                valid_rows=tokens * geometry.top_k,
                fraction=fraction,
                microseconds_at_capacity=padded * 1e6,
                microseconds_tight=exact * 1e6,
                overhead=padded / exact - 1.0,
            )
        )
    return out


def plot_bench(rows: list[BenchRow], path: Path) -> str:
    """bench.png: one bar per backend and mode at each point, the speedup over grouped_mm where
    grouped_mm ran next to another backend, else the time per call. Returns what it did."""
    if not rows:
        return "no plot: nothing was timed in mode kernels or eager"
    compared = [r for r in rows if r.speedup is not None and r.backend != BASELINE]
    plotted = compared or rows
    series = {
        f"{backend} ({mode})": {
            (r.geometry, r.tokens): r.speedup if compared else r.microseconds
            for r in plotted
            if (r.backend, r.mode) == (backend, mode)
        }
        for backend, mode in sorted({(r.backend, r.mode) for r in plotted})
    }
    if compared:
        return plot_bars(series, path, ylabel="speedup over torch._grouped_mm", reference_line=1.0)
    # token counts span orders of magnitude, and so do the times
    return plot_bars(
        series,
        path,
        ylabel="microseconds per call",
        log_scale=True,
        title="time per call (no grouped_mm in this run to compare with)",
    )


def aligned_table(header: list[str], body: list[list[str]], *, align: str) -> list[str]:
    """A text table: each column as wide as its widest cell, two spaces between columns, column
    i aligned by align[i] ("<" left for names, ">" right for numbers), a rule under the
    header. A value wider than usual (a long backend name, a slow CPU's time) widens its
    column rather than running into the next."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *body, strict=True)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            cell.ljust(width) if side == "<" else cell.rjust(width)
            for cell, width, side in zip(cells, widths, align, strict=True)
        ).rstrip()

    head = line(header)
    return [head, "-" * len(head), *(line(cells) for cells in body)]


def _cell(value: float | int | None, spec: str) -> str:
    """A table cell: the value formatted, "-" where it does not exist."""
    return "-" if value is None else format(value, spec)


def format_table(rows: list[BenchRow]) -> str:
    header = ["geometry", "tokens", "rows", "backend", "mode", "us", "host us", "x base"]
    header += ["TFLOP/s", "roof", "rel-L2", "diff"]
    body = [
        [
            r.geometry,
            str(r.tokens),
            str(r.rows),
            r.backend,
            r.mode,
            f"{r.microseconds:.1f}",
            f"{r.host_microseconds:.1f}",
            _cell(r.speedup, ".2f"),
            f"{r.tflops:.1f}",
            f"{r.roofline_fraction:.3f}",
            f"{r.rel_l2:.1e}",
            f"{r.difference:.1e}",
        ]
        for r in rows
    ]
    return "\n".join(aligned_table(header, body, align="<>><<>>>>>>>"))


def format_layer_table(rows: list[LayerBenchRow]) -> str:
    """The layer mode's rows; "-" where a value does not exist (no graph on a CPU, no baseline)."""
    header = ["geometry", "tokens", "backend", "path", "eager us", "graph us", "host us"]
    header += ["launch us", "l.host us", "ops", "mem", "gemm us", "/gemm", "base eager"]
    header += ["base graph", "x base"]
    body = [
        [
            r.geometry,
            str(r.tokens),
            r.backend,
            r.layer_path,
            f"{r.eager_microseconds:.1f}",
            _cell(r.graph_microseconds, ".1f"),
            f"{r.host_microseconds:.1f}",
            _cell(r.launched_eager_microseconds, ".1f"),
            _cell(r.launched_host_microseconds, ".1f"),
            str(r.gpu_ops),
            _cell(r.gpu_memory_ops, "d"),
            f"{r.gemm_microseconds:.1f}",
            f"{r.layer_over_gemms:.2f}",
            _cell(r.baseline_eager_microseconds, ".1f"),
            _cell(r.baseline_graph_microseconds, ".1f"),
            _cell(r.speedup, ".2f"),
        ]
        for r in rows
    ]
    lines = aligned_table(header, body, align="<><<" + ">" * 12)
    if rows and rows[0].graph_microseconds is not None:
        lines.append(
            "eager/host: an eager forward (up to eager_graph_tokens tokens on the fused path it "
            "replays the layer's own graph), launch/l.host: the same forward launching its "
            "kernels; ops: CUDA kernels the launched forward runs, mem: its memcpy + memset; "
            "gemm: the experts' GEMMs alone (with the shared experts where they can join the "
            "batch); "
            "/gemm and x base: graph replays"
        )
    elif rows:
        lines.append(
            "ops: aten ops of one eager forward (a CPU has no kernels); "
            "/gemm and x base: eager forwards"
        )
    return "\n".join(lines)
