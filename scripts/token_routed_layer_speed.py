"""A layer routing by token id (DeepSeek-V4's hash layers: `routing_table_vocab_size`) on the
fused path against the torch path, at real sizes.

The layer: 256 experts, top-6, hidden 4096, intermediate 2048, sqrt(softplus) scores scaled by
1.5, SwiGLU clamped at 10, one shared expert, a routing table of 129280 token ids; random bf16
weights and table. For each token count, the median wall time of an eager forward and the
per-forward time of a CUDA-graph replay (a caller's capture of 10 forwards), the fused path
(the table's experts placed by the routing kernel, weighted by their scores there, and the
combine kernel; its eager forwards up to eager_graph_tokens tokens replay the layer's own
graphs, "launched" the same forwards launching their kernels, eager_graph_tokens=0) against
layer_path="torch" (torch ops around the same expert GEMMs), the three timed in turn, and the
fused and torch paths' outputs' rel-L2. Run on the GPU machine from the project root
(docs/benchmarks.md, "Setting up a GPU machine"):

    python3 scripts/token_routed_layer_speed.py --tokens 1 16 128 2048
"""

from __future__ import annotations

import argparse
from dataclasses import replace

import torch
from megamoe_kernels.reference import relative_l2_error
from megamoe_runtime.measure import format_columns, median_graph_replay_seconds, median_seconds
from megamoe_torch.config import MegaMoEConfig
from megamoe_torch.layer import MegaMoE

VOCAB = 129280
HASH_LAYER = dict(
    hidden_size=4096,
    intermediate_size=2048,
    num_experts=256,
    top_k=6,
    scoring="sqrtsoftplus",
    routed_scaling_factor=1.5,
    swiglu_limit=10.0,
    num_shared_experts=1,
    shared_swiglu="routed",
    routing_table_vocab_size=VOCAB,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 128, 2048])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    fused = MegaMoE(MegaMoEConfig(**HASH_LAYER), device=device, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        fused.routing_table.copy_(torch.randint(256, fused.routing_table.shape, device=device))
    # the same tensors (12.9 GB of experts), each layer with its own prepared weights
    plain = MegaMoE(replace(fused.config, layer_path="torch"), device="meta", dtype=torch.bfloat16)
    plain.load_state_dict(fused.state_dict(), assign=True)
    plain.eval()
    launched = MegaMoE(
        replace(fused.config, eager_graph_tokens=0), device="meta", dtype=torch.bfloat16
    )
    launched.load_state_dict(fused.state_dict(), assign=True)
    launched.eval()
    ok, why = fused.fused_path_status(device)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}; fused path: {why}")
    if not ok:
        raise SystemExit(why)
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, 4096, device=device, dtype=torch.bfloat16)
        ids = torch.randint(VOCAB, (tokens,), device=device)
        times = {}
        with torch.no_grad():
            error = relative_l2_error(
                fused(x, input_ids=ids).float(), plain(x, input_ids=ids).float()
            )
            if not torch.equal(fused(x, input_ids=ids), launched(x, input_ids=ids)):
                raise SystemExit(f"{tokens} tokens: a replayed forward differs from a launched one")
            for _ in range(2):  # the three in turn, twice
                for name, layer in (("fused", fused), ("launched", launched), ("torch", plain)):

                    def forward(layer=layer, x=x, ids=ids):
                        return layer(x, input_ids=ids)

                    eager = median_seconds(forward, device=device, repeats=args.repeats)
                    graph = median_graph_replay_seconds(
                        forward, device=device, repeats=args.repeats
                    )
                    times.setdefault(name, []).append((eager * 1e6, graph * 1e6))
        fused_eager = min(t[0] for t in times["fused"])
        fused_graph = min(t[1] for t in times["fused"])
        torch_eager = min(t[0] for t in times["torch"])
        torch_graph = min(t[1] for t in times["torch"])
        rows.append(
            [
                str(tokens),
                " / ".join(f"{t[0]:.1f}" for t in times["fused"]),
                " / ".join(f"{t[0]:.1f}" for t in times["launched"]),
                " / ".join(f"{t[0]:.1f}" for t in times["torch"]),
                " / ".join(f"{t[1]:.1f}" for t in times["fused"]),
                " / ".join(f"{t[1]:.1f}" for t in times["torch"]),
                f"{torch_eager / fused_eager:.2f}",
                f"{torch_graph / fused_graph:.2f}",
                f"{error:.2e}",
            ]
        )
    print(
        format_columns(
            [
                "tokens",
                "fused eager us",
                "launched eager us",
                "torch eager us",
                "fused graph us",
                "torch graph us",
                "x eager",
                "x graph",
                "rel-L2",
            ],
            rows,
        )
    )


if __name__ == "__main__":
    main()
