"""The `megamoe` command: demo (the main job), bench."""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

import megamoe_kernels
import megamoe_runtime
import torch
from megamoe_kernels.reference import fp8_difference, relative_l2_error
from megamoe_runtime.experts import BACKEND_NAMES, backend_status
from megamoe_runtime.geometries import GEOMETRIES, TOKEN_COUNTS
from megamoe_runtime.measure import median_seconds, write_csv
from megamoe_runtime.weights import Prequantized, dequantize
from tqdm import tqdm

import megamoe_torch
from megamoe_torch import bench, bench_ep
from megamoe_torch.bench_targets import evaluate_targets, format_targets, read_rows
from megamoe_torch.config import MegaMoEConfig
from megamoe_torch.fp8_linear import BlockFP8Linear
from megamoe_torch.layer import MegaMoE

GPU_GEOMETRIES = ("qwen3-30b-a3b", "mixtral-8x7b", "dsv3", "dsv3-ep8-local", "gpt-oss-120b")
CPU_GEOMETRIES = ("tiny-qwen3",)
# bench's backends unless --backends names others: megamoe's kernels against the baseline
BENCH_BACKENDS = ("cutedsl", "grouped_mm")
# the demo's bounds against the fp32 oracle: rel-L2 of the bf16 layer, DeepGEMM's difference
# 1 - 2xy/(x^2+y^2) of the FP8 layer (the activations' e4m3 rounding on the FP8 kernels)
BF16_BOUND = 1e-2
FP8_BOUND = 2e-3
# --weight-dtype of bench and tune: the experts' weights, bf16 or FP8 (e4m3 with 128x128 block
# scales); MegaMoEConfig's weight_dtype of each (config_weight_dtype)
WEIGHT_DTYPES = ("bf16", "fp8")


class OneLineErrorParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line: the usage it would print first runs over
    several lines (the geometry and backend choices)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def version_line() -> str:
    return (
        f"megamoe {megamoe_torch.__version__} (megamoe-kernels {megamoe_kernels.__version__}, "
        f"megamoe-runtime {megamoe_runtime.__version__}, torch {torch.__version__})"
    )


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer (need >= 1)")
    return value


def available_devices() -> list[str]:
    return ["cpu", *(f"cuda:{index}" for index in range(torch.cuda.device_count()))]


def usable_device(text: str) -> torch.device:
    """argparse type: a cpu or cuda device this machine has."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a torch device (cpu, cuda, cuda:N)"
        ) from None
    available = ", ".join(available_devices())
    if device.type == "cuda" and not torch.cuda.is_available():
        why = (
            f"torch {torch.__version__} is built without CUDA"
            if torch.version.cuda is None
            else "torch sees no CUDA GPU here"
        )
        raise argparse.ArgumentTypeError(f"{text}: {why}; available: {available}")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: no such GPU; available: {available}")
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(
            f"{text}: megamoe runs on cpu or cuda; available: {available}"
        )
    return device


def output_folder(text: str) -> Path:
    """argparse type: a folder that exists and is writable, or can be created (not created here)."""
    path = Path(text)
    existing = path
    while not existing.exists():  # the nearest ancestor that exists: the folders start there
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == path else f"cannot be created: {existing} is a file"
        raise argparse.ArgumentTypeError(f"{text} {what}, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: {existing} is not writable")
    return path


def writable_output_folder(parser: argparse.ArgumentParser, out: Path) -> None:
    """Creates `out` and writes a probe file in it, before anything is measured: a folder
    `output_folder` let through can still refuse writes (a read-only file system, /proc, or
    permissions root ignores in os.access) and an argparse error then beats a traceback after
    the measurements."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        parser.error(f"argument --out: cannot write into {out}: {error.strerror or error}")


def runnable_backends(
    parser: argparse.ArgumentParser, requested: list[str] | None, device: torch.device
) -> tuple[list[str], str | None]:
    """The backends bench times and a line that says which were skipped and why (None: none
    was): those requested (default BENCH_BACKENDS) that run on `device`; where none of the
    defaults does, those that run; where none requested does, an argparse error naming the
    ones that would."""
    statuses = {name: backend_status(name, device) for name in requested or BENCH_BACKENDS}
    runnable = [name for name, (ok, _) in statuses.items() if ok]
    skipped = "; ".join(f"{name}: {reason}" for name, (ok, reason) in statuses.items() if not ok)
    if runnable:
        return runnable, (f"timing {', '.join(runnable)} (skipped {skipped})" if skipped else None)
    elsewhere = bench.available_backends(device, BACKEND_NAMES)
    if requested:
        parser.error(
            f"argument --backends: none of {' '.join(requested)} can run on {device} ({skipped}); "
            f"what can: --backends {' '.join(elsewhere)}"
        )
    return elsewhere, (
        f"none of the default backends can run on {device} ({skipped}): timing "
        f"{', '.join(elsewhere)} instead (--backends chooses)"
    )


def device_name(device: torch.device) -> str:
    """The GPU's name (e.g. "NVIDIA H200"), or "CPU"."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def config_weight_dtype(weight_dtype: str) -> str | None:
    """MegaMoEConfig's weight_dtype for a --weight-dtype (one of WEIGHT_DTYPES)."""
    return None if weight_dtype == "bf16" else weight_dtype


def add_weight_dtype_argument(
    parser: argparse.ArgumentParser, *, what: str, several: bool = False
) -> None:
    """--weight-dtype, as bench and tune name it; `what`: what the choice does there;
    `several`: it takes one or more (a list), else one."""
    parser.add_argument(
        "--weight-dtype",
        choices=WEIGHT_DTYPES,
        nargs="+" if several else None,
        default=["bf16"] if several else "bf16",
        help=f"the experts' weights: bf16, or fp8 (e4m3 with 128x128 block scales); {what} "
        "(default: bf16)",
    )


def fp32_oracle_of(layer: MegaMoE) -> MegaMoE:
    """The same layer in fp32 on the reference backend's torch path, FP8 weights dequantized
    (the values they stand for): the oracle the demo and the GPU tests check against."""
    config = replace(
        layer.config,
        backend="reference",
        layer_path="torch",
        weight_dtype=None,
        shared_weight_dtype=None,
    )
    fp8_linear = {
        f"{name}.weight": module
        for name, module in layer.named_modules()
        if isinstance(module, BlockFP8Linear)
    }
    pack = layer.expert_weight_pack()
    state = {
        name: fp8_linear[name].dequantized_weight() if name in fp8_linear else value.float()
        for name, value in layer.state_dict().items()
        if not name.endswith("_scale_inv")
        and not (isinstance(pack, Prequantized) and name in ("w13", "w2"))
    }
    if isinstance(pack, Prequantized):
        exact = dequantize(pack)  # float32: the values the e4m3 weights and scales stand for
        state["w13"], state["w2"] = exact.w13_E2IH, exact.w2_EHI
    oracle = MegaMoE(config, device="meta", dtype=torch.float32)
    oracle.load_state_dict(state, assign=True)  # no second fp32 copy of the weights
    return oracle


def run_demo(args: argparse.Namespace) -> int:
    device = args.device or default_device()
    if args.backend != "auto":
        available, reason = backend_status(args.backend, device)
        if not available:
            args.parser.error(
                f"argument --backend: {args.backend} cannot run on {device} ({reason}); what can: "
                f"--backend auto or {' or '.join(bench.available_backends(device, BACKEND_NAMES))}"
            )
    geometries = args.geometry or (GPU_GEOMETRIES if device.type == "cuda" else CPU_GEOMETRIES)
    tokens = args.tokens or (512 if device.type == "cuda" else 64)
    print(
        f"megamoe demo on {device} ({device_name(device)}), torch {torch.__version__}, bf16, "
        f"{tokens} tokens"
    )
    table = []
    worst_error, worst_fp8_difference = 0.0, 0.0
    for name in geometries:
        geometry = GEOMETRIES[name]
        print(
            f"\n{name}: E={geometry.num_experts} top-{geometry.top_k} H={geometry.hidden_size} "
            f"I={geometry.intermediate_size}"
        )
        x_TH = None
        # the same weights twice: in bf16, then quantized per 128 x 128 block (FP8 experts)
        for weights in ("bf16", "fp8"):
            try:
                layer = bench.build_layer(
                    geometry,
                    device=device,
                    dtype=torch.bfloat16,
                    weight_dtype=None if weights == "bf16" else weights,
                )
            except ValueError as error:  # FP8 experts with expert math they do not compute
                print(f"  {weights} experts: not built: {error}")
                continue
            refused = (
                bench.layer_backends(layer, [args.backend])[1] if args.backend != "auto" else {}
            )
            if refused:
                print(f"  {weights} experts: not run: {args.backend}: {refused[args.backend]}")
                continue
            layer.use_backend(args.backend)
            if x_TH is None:
                x_TH = torch.randn(
                    tokens, geometry.hidden_size, device=device, dtype=torch.bfloat16
                )
            with torch.no_grad():
                expected_TH = fp32_oracle_of(layer)(x_TH.float())
                try:
                    y_TH = layer(x_TH)
                except ValueError as error:  # a shape the backend's FP8 kernels do not take
                    print(f"  fp8 experts: do not run on {layer.backend}: {error}")
                    continue
            error = relative_l2_error(y_TH, expected_TH)
            if weights == "bf16":
                worst_error = max(worst_error, error)
                print(
                    f"  backend: {layer.backend} ({layer.backend_reason})\n"
                    f"  rel-L2 vs fp32 oracle: {error:.2e}"
                )
            else:
                difference = fp8_difference(y_TH.float(), expected_TH)
                worst_fp8_difference = max(worst_fp8_difference, difference)
                print(
                    f"  fp8 experts (e4m3, 128x128 block scales) on {layer.backend}: against the "
                    f"fp32 oracle on their dequantized weights, rel-L2 {error:.2e}, DeepGEMM's "
                    f"difference 1 - 2xy/(x^2+y^2) {difference:.2e}"
                )
            del expected_TH, y_TH
            table += _demo_timings(layer, name, weights, x_TH, device=device, repeats=args.repeats)
            del layer  # one layer of the geometry at a time
    print(f"\n{'geometry':<16}{'backend':<12}{'experts':<9}{'forward us':>12}")
    for name, backend, weights, microseconds, chosen in table:
        print(
            f"{name:<16}{backend:<12}{weights:<9}{microseconds:>12.1f}"
            f"{'  <- chosen' if chosen else ''}"
        )
    within = worst_error <= BF16_BOUND and worst_fp8_difference <= FP8_BOUND
    print(
        f"\nworst rel-L2 {worst_error:.2e} ({'within' if worst_error <= BF16_BOUND else 'OVER'} "
        f"the bf16 bound {BF16_BOUND}); worst fp8 difference {worst_fp8_difference:.2e} "
        f"({'within' if worst_fp8_difference <= FP8_BOUND else 'OVER'} the fp8 bound "
        f"{FP8_BOUND})"
    )
    return 0 if within else 1


def _demo_timings(
    layer: MegaMoE,
    name: str,
    weights: str,
    x_TH: torch.Tensor,
    *,
    device: torch.device,
    repeats: int,
) -> list[tuple[str, str, str, float, bool]]:
    """The demo table's rows of one layer: its forward on every backend that runs it here."""
    chosen, rows = layer.backend, []
    for backend in tqdm(
        bench.layer_backends(layer, BACKEND_NAMES)[0],
        desc=f"timing {name} {weights}",
        leave=False,
        disable=None,  # no bar where stderr is not a terminal (logs, pipes)
    ):
        layer.use_backend(backend)
        try:
            with torch.no_grad():
                seconds = median_seconds(
                    lambda moe=layer, x=x_TH: moe(x), device=device, repeats=repeats
                )
        except ValueError:  # a shape this backend's FP8 kernels do not take
            continue
        rows.append((name, backend, weights, seconds * 1e6, backend == chosen))
    return rows


# `megamoe bench --ep`'s defaults: the geometry and token counts per rank
EP_GEOMETRY = "dsv3"
EP_TOKEN_COUNTS = (128, 512, 2048, 4096, 8192)


def run_bench_ep(args: argparse.Namespace) -> int:
    """`megamoe bench --ep`, on each rank torchrun started."""
    if not bench_ep.under_torchrun():
        args.parser.error(
            "argument --ep: the expert-parallel bench runs one process per GPU under torchrun: "
            "torchrun --standalone --nproc-per-node 2 -m megamoe_torch.cli bench --ep ..."
        )
    if args.geometry and len(args.geometry) > 1:
        args.parser.error(
            f"argument --geometry: --ep times one geometry, got {' '.join(args.geometry)}"
        )
    if args.device is not None:
        args.parser.error("argument --device: with --ep each rank takes the GPU LOCAL_RANK names")
    device = default_device()
    quiet = int(os.environ.get("RANK", "0")) != 0
    if quiet:
        backends = [
            name for name in args.backends or BENCH_BACKENDS if backend_status(name, device)[0]
        ]
    else:
        backends, note = runnable_backends(args.parser, args.backends, device)
    writable_output_folder(args.parser, args.out)  # the last argument check: it makes the folder
    if not quiet and note:
        print(note)
    return bench_ep.run_cli(
        geometry=GEOMETRIES[args.geometry[0] if args.geometry else EP_GEOMETRY],
        token_counts=list(args.tokens or EP_TOKEN_COUNTS),
        layer_token_counts=list(args.ep_layer_tokens),
        backends=backends or bench.available_backends(device, BACKEND_NAMES),
        iterations=args.repeats,
        breakdown=args.breakdown,
        out=args.out,
    )


def run_bench_targets_of(args: argparse.Namespace) -> int:
    """--targets-of: the targets of earlier runs' rows, read together; nothing is measured."""
    measuring = [
        option
        for option, value in (
            ("--geometry", args.geometry),
            ("--tokens", args.tokens),
            ("--backends", args.backends),
            ("--device", args.device),
            ("--ep", args.ep),
            ("--capacity-sweep", args.capacity_sweep),
        )
        if value
    ]
    if measuring:
        args.parser.error(
            f"--targets-of reads earlier runs and measures nothing: drop {', '.join(measuring)}"
        )
    try:
        rows, layer_rows = read_rows(args.targets_of)
    except ValueError as error:
        args.parser.error(f"argument --targets-of: {error}")
    folders = ", ".join(str(folder) for folder in args.targets_of)
    report = format_targets(
        evaluate_targets(rows, layer_rows),
        device=f"read from {folders}",
        measured_by="these runs" if len(args.targets_of) > 1 else "this run",
    )
    print(report)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    if args.targets_of:
        return run_bench_targets_of(args)
    if args.ep:
        return run_bench_ep(args)
    if args.ep_layer_tokens or args.breakdown:
        args.parser.error("arguments --ep-layer-tokens and --breakdown need --ep")
    device = args.device or default_device()
    geometries = args.geometry or (GPU_GEOMETRIES if device.type == "cuda" else CPU_GEOMETRIES)
    token_counts = args.tokens or (TOKEN_COUNTS if device.type == "cuda" else (16, 64))
    backends, note = runnable_backends(args.parser, args.backends, device)
    writable_output_folder(args.parser, args.out)  # the last argument check: it makes the folder
    if note:
        print(note)
    point_modes = tuple(mode for mode in args.modes if mode != "layer")
    rows, layer_rows = [], []
    out = args.out
    weight_dtypes = list(dict.fromkeys(args.weight_dtype))  # in order, each once
    progress = tqdm(
        total=len(geometries) * len(weight_dtypes) * len(token_counts),
        desc="bench",
        disable=None,  # no bar where stderr is not a terminal (logs, pipes)
    )
    # each geometry's dtypes one after the other, so that their rows compare on one clock
    for name, weight_dtype in itertools.product(geometries, weight_dtypes):
        try:
            layer = bench.build_layer(
                GEOMETRIES[name],
                device=device,
                dtype=torch.bfloat16,
                weight_dtype=config_weight_dtype(weight_dtype),
            )
        except ValueError as error:  # FP8 experts with expert math they do not compute
            progress.write(f"skipped {name} {weight_dtype}: {error}")
            progress.update(len(token_counts))
            continue
        # the backends that compute this geometry's experts here
        layer_backends, refused = bench.layer_backends(layer, backends)
        if refused:
            skipped = "; ".join(f"{backend}: {why}" for backend, why in refused.items())
            progress.write(f"{name} {weight_dtype}: skipped {skipped}")
        if not layer_backends:
            progress.update(len(token_counts))
            del layer
            continue
        for tokens in token_counts:
            point_rows = (
                bench.bench_point(
                    layer,
                    GEOMETRIES[name],
                    tokens,
                    backends=layer_backends,
                    modes=point_modes,
                    repeats=args.repeats,
                )
                if point_modes
                else []
            )
            rows += point_rows
            if "layer" in args.modes:
                layer_rows += bench.bench_layer_point(
                    layer,
                    GEOMETRIES[name],
                    tokens,
                    backends=layer_backends,
                    repeats=args.repeats,
                    kernel_rows=point_rows,
                )
            # after every point: a cut-short run keeps what it measured
            write_csv(rows, out / "bench.csv")
            write_csv(layer_rows, out / "layer.csv")
            progress.update()
        del layer
    progress.close()
    if rows:
        print(bench.plot_bench(rows, out / "bench.png"))
    if args.capacity_sweep:
        sweep = []
        for name in geometries:
            layer = bench.build_layer(GEOMETRIES[name], device=device, dtype=torch.bfloat16)
            layer_backends = bench.layer_backends(layer, backends)[0]
            if not layer_backends:
                continue  # said above
            sweep += bench.capacity_sweep(
                layer,
                GEOMETRIES[name],
                capacity_tokens=max(token_counts),
                fractions=(0.01, 1 / 16, 0.1, 0.25, 0.5, 1.0),  # 1/16: a capacity 16x the rows
                backend_name=layer_backends[0],
                repeats=args.repeats,
            )
        write_csv(sweep, out / "capacity_sweep.csv")
        for record in sweep:
            print(
                f"capacity sweep {record['geometry']} {record['backend']}: valid {record['fraction']:.0%} "
                f"of {record['capacity']} rows: {record['microseconds_at_capacity']:.1f} us at capacity, "
                f"{record['microseconds_tight']:.1f} us tight ({record['overhead']:+.1%})"
            )
    if rows:
        print(bench.format_table(rows))
    if layer_rows:
        print(bench.format_layer_table(layer_rows))
    if args.targets:
        report = format_targets(
            evaluate_targets(rows, layer_rows),
            device=f"{device_name(device)}, torch {torch.__version__}",
        )
        (out / "targets.md").write_text(report + "\n")
        print(f"\n{report}")
    return 0


def run_tune(args: argparse.Namespace) -> int:
    from megamoe_runtime.tuning.cache import KnobCache

    from megamoe_torch.tune import tune_point

    weight_dtype = config_weight_dtype(args.weight_dtype)
    for name in args.geometry:
        try:  # the layer's own refusal: FP8 experts with expert math they do not compute
            MegaMoEConfig.from_geometry(GEOMETRIES[name], weight_dtype=weight_dtype)
        except ValueError as error:
            args.parser.error(
                f"argument --geometry: {name} has no {args.weight_dtype} experts ({error}); "
                "tune it with --weight-dtype bf16"
            )
    available, reason = backend_status("cutedsl", default_device())
    if not available:
        print(
            f"megamoe tune times the cutedsl kernels, which cannot run here: {reason}",
            file=sys.stderr,
        )
        return 2
    cache = KnobCache(args.cache)
    points = [(g, t) for g in args.geometry for t in args.tokens]
    print(f"tuning {len(points)} points of {args.weight_dtype} experts into {cache.path}")
    for name, tokens in tqdm(points, desc="tune", disable=None):
        for result in tune_point(
            GEOMETRIES[name],
            tokens,
            cache=cache,
            weight_dtype=weight_dtype,
            repeats=args.repeats,
            quick=args.quick,
        ):
            print(
                f"{name} {tokens} tokens {result.op}: {result.microseconds:.1f} us "
                f"(default {result.default_microseconds:.1f} us, {result.candidates} candidates) {result.knobs}"
            )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="megamoe", description="megamoe: a fast Mixture-of-Experts layer for Hopper GPUs"
    )
    parser.add_argument("--version", action="version", version=version_line())
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="build a layer, run it on the best backend here, check it against the fp32 oracle and time it",
        description="Builds MegaMoE layers (the benchmark geometries on a GPU, a small Qwen3-like one on a CPU), "
        "each with bf16 experts and with the same weights in FP8 (e4m3, 128x128 block scales; not gpt-oss-120b, "
        "whose expert biases FP8 experts do not compute), runs them on the "
        "best backend available, prints the backend, the error against the fp32 oracle (rel-L2; for FP8 also "
        "DeepGEMM's 1 - 2xy/(x^2+y^2), against the dequantized weights) and a timing table of both on every "
        "backend that runs here.",
    )
    demo.add_argument("--geometry", nargs="+", choices=sorted(GEOMETRIES), help="geometries to run")
    demo.add_argument(
        "--tokens",
        type=positive_int,
        help="tokens per forward (default: 512 on a GPU, 64 on a CPU)",
    )
    demo.add_argument(
        "--backend",
        default="auto",
        choices=("auto", *BACKEND_NAMES),
        help="backend of the checked forward (default auto: the best that runs here, said why); "
        "the timing table has every backend that runs here",
    )
    demo.add_argument(
        "--repeats", type=positive_int, default=20, help="timed forwards per backend (median)"
    )
    demo.add_argument(
        "--device",
        type=usable_device,
        help="cpu, cuda or cuda:N (default: cuda if present, else cpu)",
    )
    demo.set_defaults(run=run_demo, parser=demo)

    bench_parser = commands.add_parser(
        "bench",
        help="sweep geometries x token counts, backend against grouped_mm in the same run",
        description="Times expert compute (kernels: CUDA-graph replay) and/or the whole layer (eager) per backend "
        "(at each geometry those that run here and compute its experts, gpt-oss-120b's biases and clamped "
        "SwiGLU included; the others skipped, said why), "
        "with the speedup over grouped_mm, TFLOP/s, fraction of the roofline floor, and rel-L2 and DeepGEMM's "
        "difference 1 - 2xy/(x^2+y^2) against the fp32 oracle; for modes kernels and eager writes bench.csv "
        "and bench.png under --out (bench.png: the speedup "
        "over grouped_mm where grouped_mm ran next to another backend, else the time per call; it needs "
        "matplotlib, megamoe-torch's extra plot). "
        "Mode layer times the whole forward (router GEMM to "
        "combine) eager and as a CUDA-graph replay, counts the GPU kernels one eager forward launches and its host "
        "time, against the expert GEMMs alone and the grouped_mm layer; writes layer.csv (with the kernels' "
        "names).",
    )
    bench_parser.add_argument("--geometry", nargs="+", choices=sorted(GEOMETRIES))
    bench_parser.add_argument(
        "--tokens",
        nargs="+",
        type=positive_int,
        help=f"token counts (default: {' '.join(map(str, TOKEN_COUNTS))} on a GPU, 16 64 on a CPU)",
    )
    bench_parser.add_argument(
        "--backends",
        nargs="+",
        choices=BACKEND_NAMES,
        help=f"backends to time, those that run here (default: {' '.join(BENCH_BACKENDS)}; where "
        "neither runs, those that do: reference on a CPU)",
    )
    bench_parser.add_argument(
        "--modes",
        nargs="+",
        default=["kernels"],
        choices=("kernels", "eager", "layer"),
        help="kernels: expert compute, graph replay; eager: the layer, eager; layer: the layer "
        "eager and graphed, its kernel count and host time, against its GEMMs (default: kernels)",
    )
    add_weight_dtype_argument(
        bench_parser,
        what="with fp8 rows name the backend with +fp8, accuracy is against the oracle on the "
        "dequantized weights and the floor is FP8's (e4m3 products, weights at 1 byte and "
        "their scales); several (bf16 fp8) time each geometry with each in turn",
        several=True,
    )
    bench_parser.add_argument("--repeats", type=positive_int, default=30)
    bench_parser.add_argument(
        "--out",
        type=output_folder,
        default="bench-out",
        help="folder for bench.csv, bench.png and layer.csv, created if missing (default: bench-out)",
    )
    bench_parser.add_argument(
        "--targets",
        action="store_true",
        help="also print which of the project's targets (docs/benchmarks.md) the cutedsl rows of "
        "this run meet, their worst readings and the points that miss, and write targets.md "
        "under --out (the FP8 ones need --weight-dtype bf16 fp8; the layer ones --modes layer)",
    )
    bench_parser.add_argument(
        "--targets-of",
        nargs="+",
        type=Path,
        metavar="OUT",
        help="print the targets (as --targets does) of earlier runs' rows, read together from "
        "the bench.csv and layer.csv under each OUT (their --out folders), measuring nothing: a "
        "grid measured one geometry per process reads as one run",
    )
    bench_parser.add_argument(
        "--capacity-sweep",
        action="store_true",
        help="also time a fixed capacity with 1%%..100%% valid rows",
    )
    bench_parser.add_argument(
        "--device",
        type=usable_device,
        help="cpu, cuda or cuda:N (default: cuda if present, else cpu)",
    )
    bench_parser.add_argument(
        "--ep",
        action="store_true",
        help="expert parallel, under torchrun (one rank per GPU): megamoe's dispatch and combine "
        "against the all_to_all reference, and with --ep-layer-tokens the expert-parallel layer; "
        f"--tokens per rank (default {' '.join(map(str, EP_TOKEN_COUNTS))}), --geometry one "
        f"(default {EP_GEOMETRY}), --repeats the iterations; writes ep.json, ep.csv and "
        "ep_layer.csv under --out (docs/expert-parallel.md)",
    )
    bench_ep.add_arguments(bench_parser)
    bench_parser.set_defaults(run=run_bench, parser=bench_parser)

    tune = commands.add_parser(
        "tune",
        help="time every valid cutedsl knob combination per point and store the fastest in the knob cache",
        description="Offline tuner: for each geometry and token count, times every valid knob combination of the "
        "gate-up and down kernels (CUDA-graph replay) on the batch the geometry's layer makes of random tokens, "
        "each kernel with the layer's epilogue (gpt-oss-120b: its expert biases and clamped SwiGLU), and stores "
        "the fastest in the knob cache ($MEGAMOE_KNOB_CACHE, default ~/.cache/megamoe/knobs.json) under the key "
        "the cutedsl backend looks up for that batch. --weight-dtype fp8 tunes the FP8 kernels (gate_up_fp8, "
        "down_fp8) that layers with weight_dtype='fp8' run.",
    )
    tune.add_argument("--geometry", nargs="+", required=True, choices=sorted(GEOMETRIES))
    tune.add_argument("--tokens", nargs="+", type=positive_int, required=True)
    tune.add_argument(
        "--cache",
        help="knob cache file (default: $MEGAMOE_KNOB_CACHE or ~/.cache/megamoe/knobs.json)",
    )
    tune.add_argument("--repeats", type=positive_int, default=10)
    tune.add_argument(
        "--quick",
        action="store_true",
        help="only the deepest ring that fits per tile shape (about a third of the candidates)",
    )
    add_weight_dtype_argument(
        tune,
        what="fp8 times the FP8 GEMMs (gate_up_fp8, down_fp8) on e4m3 rows (one scale per row "
        "and 128 columns) and stores the fastest under the keys an FP8 layer looks up (not "
        "gpt-oss-120b, whose expert biases FP8 experts do not compute)",
    )
    tune.set_defaults(run=run_tune, parser=tune)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
