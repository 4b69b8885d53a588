"""The router-logits kernel against the GEMM library on the fused path (one GPU), the data for
megamoe_kernels.router_logits_faster_tokens (up to how many tokens the layer takes the kernel
for a router of its size). Per geometry and token count (up to ROUTER_LOGITS_MAX_TOKENS):

(a) the router alone, CUDA-graph replays: the layer's router_logits (the GEMM library) and the
    kernel (both through layer.router_logits, with the layer's bound at 0 and at every size the
    kernel takes, whatever the rule says);
(b) the whole fused forward, CUDA-graph replays, with the kernel off and on;

each in alternating rounds (--rounds readings per point: a difference smaller than their range
is noise); with --expert-blocks, (c) the kernel alone with each of those experts per CTA
(shim.router_logits.ROUTER_LOGITS_EXPERT_BLOCK; capped by what a thread's registers hold), its
logits' bits compared with the first block's; and the checks: the kernel's logits within fp32
summation-order differences of the library's (1e-5 of the sum of |products|, plus half a bf16
ulp for bf16 logits) and the same top-k experts. Run on the GPU machine from the project root:

    python3 scripts/router_ab.py --geometry qwen3-30b-a3b dsv3 mixtral-8x7b gpt-oss-120b \\
        --tokens 1 4 16 32 64
"""

from __future__ import annotations

import argparse
import contextlib
import gc

import torch
from megamoe_kernels import ROUTER_LOGITS_MAX_TOKENS
from megamoe_kernels.shim import router_logits as router_logits_shim
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_runtime.measure import alternating_readings, median_graph_replay_seconds
from megamoe_runtime.routing import route
from megamoe_torch import layer as layer_module
from megamoe_torch.bench import build_layer, routed_tokens, with_capacity


@contextlib.contextmanager
def router_kernel_tokens(limit: int):
    """The layer takes the kernel for up to `limit` tokens inside the block, whatever the
    router's size (ROUTER_KERNEL_MAX_TOKENS and router_logits_faster_tokens, read at each
    forward and capture)."""
    before = layer_module.ROUTER_KERNEL_MAX_TOKENS, layer_module.router_logits_faster_tokens
    layer_module.ROUTER_KERNEL_MAX_TOKENS = limit
    layer_module.router_logits_faster_tokens = lambda num_experts, hidden_size: limit
    try:
        yield
    finally:
        layer_module.ROUTER_KERNEL_MAX_TOKENS, layer_module.router_logits_faster_tokens = before


def logits_check(layer, x_TH, library_TE, kernel_TE) -> str:
    """'ok' when the kernel's logits are within summation-order differences of the library's
    and pick the same experts, else what differs."""
    weight = layer.gate.weight
    allowed = 1e-5 * (x_TH.float().abs() @ weight.float().abs().t()) + 1e-30
    if kernel_TE.dtype == torch.bfloat16:
        allowed = allowed + library_TE.float().abs() * 2.0**-7
    worst = ((kernel_TE.float() - library_TE.float()).abs() / allowed).max().item()
    bias = layer.e_score_correction_bias
    library_ids, _ = route(library_TE, layer.config.router, correction_bias_E=bias)
    kernel_ids, _ = route(kernel_TE, layer.config.router, correction_bias_E=bias)
    differing = int((library_ids.sort(-1).values != kernel_ids.sort(-1).values).any(-1).sum())
    problems = []
    if worst > 1:
        problems.append(f"logits {worst:.1f}x the tolerance")
    if differing:
        problems.append(f"top-k differs for {differing} tokens")
    return "; ".join(problems) or f"ok ({worst:.2f} of tol)"


def graph_us(fn, *, limit: int, device: torch.device):
    """A reader: the graph-replay seconds of fn with the kernel taken up to `limit` tokens
    (router_kernel_tokens, while it warms up and is captured)."""

    def read() -> float:
        with router_kernel_tokens(limit):
            return median_graph_replay_seconds(fn, device=device)

    return read


@contextlib.contextmanager
def forced_expert_block(block: int | None):
    """The kernel takes `block` experts per CTA (None: its rule), whatever the rule says."""
    before = router_logits_shim.ROUTER_LOGITS_EXPERT_BLOCK
    router_logits_shim.ROUTER_LOGITS_EXPERT_BLOCK = block
    try:
        yield
    finally:
        router_logits_shim.ROUTER_LOGITS_EXPERT_BLOCK = before


def expert_block_row(layer, x_TH, blocks, *, rounds: int, device) -> tuple:
    """(the kernel's us with each of `blocks` experts per CTA, 'same bits' or what differs). A
    block past what the router's registers hold (max_expert_block) launches the cap N: the
    launch is timed once, in the first of `blocks` that launches it, and every later one reads
    '(N)'."""
    most = router_logits_shim.max_expert_block(*layer.gate.weight.shape)
    launched = list(dict.fromkeys(min(block, most) for block in blocks))

    def logits(block):
        with forced_expert_block(block), router_kernel_tokens(ROUTER_LOGITS_MAX_TOKENS):
            return layer.router_logits(x_TH)

    def read(block):
        def reading() -> float:
            with forced_expert_block(block):
                return graph_us(
                    lambda: layer.router_logits(x_TH), limit=ROUTER_LOGITS_MAX_TOKENS, device=device
                )()

        return reading

    first = logits(launched[0])
    differing = [block for block in launched[1:] if not torch.equal(logits(block), first)]
    readings = alternating_readings({block: read(block) for block in launched}, rounds=rounds)
    bits = f"bits differ at {differing}" if differing else "same bits"
    cells, timed = [], set()
    for block in blocks:
        taken = min(block, most)
        cells.append(us(readings[taken]) if taken not in timed else f"({taken})")
        timed.add(taken)
    return (*cells, bits)


def us(readings) -> str:
    return " ".join(f"{seconds * 1e6:.1f}" for seconds in readings.seconds)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--geometry", nargs="+", default=["qwen3-30b-a3b"])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--expert-blocks",
        nargs="+",
        type=int,
        default=[],
        help="also time the kernel alone with each of these experts per CTA",
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    on = ROUTER_LOGITS_MAX_TOKENS
    table = []
    block_table = []
    for name in args.geometry:
        geometry = GEOMETRIES[name]
        base = build_layer(geometry, device=device, dtype=torch.bfloat16)
        for tokens in args.tokens:
            if tokens > ROUTER_LOGITS_MAX_TOKENS:
                print(f"{name} {tokens}: past the kernel's {ROUTER_LOGITS_MAX_TOKENS} tokens")
                continue
            x_TH, _, _ = routed_tokens(base, tokens)
            # no graphs of the layer's own: the outer capture records the forward as launched
            layer = with_capacity(base, tokens * geometry.top_k, eager_graph_tokens=0)
            layer.use_backend("cutedsl")
            ok, why = layer.fused_path_status()
            if not ok:
                print(f"{name} {tokens}: no fused path ({why})")
                continue
            with router_kernel_tokens(0):
                library_TE = layer.router_logits(x_TH)
            with router_kernel_tokens(on):
                kernel_TE = layer.router_logits(x_TH)
            check = logits_check(layer, x_TH, library_TE, kernel_TE)
            readings = alternating_readings(
                {
                    "router library": graph_us(
                        lambda layer=layer, x_TH=x_TH: layer.router_logits(x_TH),
                        limit=0,
                        device=device,
                    ),
                    "router kernel": graph_us(
                        lambda layer=layer, x_TH=x_TH: layer.router_logits(x_TH),
                        limit=on,
                        device=device,
                    ),
                    "forward off": graph_us(
                        lambda layer=layer, x_TH=x_TH: layer(x_TH), limit=0, device=device
                    ),
                    "forward on": graph_us(
                        lambda layer=layer, x_TH=x_TH: layer(x_TH), limit=on, device=device
                    ),
                },
                rounds=args.rounds,
            )
            row = (name, tokens, *(us(r) for r in readings.values()), check)
            print(" | ".join(str(cell) for cell in row), flush=True)
            table.append(row)
            if args.expert_blocks:
                blocks_row = (
                    name,
                    tokens,
                    *expert_block_row(
                        layer, x_TH, args.expert_blocks, rounds=args.rounds, device=device
                    ),
                )
                print(" | ".join(str(cell) for cell in blocks_row), flush=True)
                block_table.append(blocks_row)
            del layer
            gc.collect()
            torch.cuda.empty_cache()
    header = (
        "geometry",
        "tokens",
        "router library us",
        "router kernel us",
        "forward kernel off us",
        "forward kernel on us",
        "logits and top-k",
    )
    print_table(header, table)
    if block_table:
        blocks = tuple(f"kernel us, {block} experts a CTA" for block in args.expert_blocks)
        print_table(("geometry", "tokens", *blocks, "logits"), block_table)


def print_table(header, rows) -> None:
    print()
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(cell) for cell in row) + " |")


if __name__ == "__main__":
    main()
