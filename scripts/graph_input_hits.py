"""Where a transformers generate() loop puts the tokens of each swapped MoE block's forward: how
many of the replays of the layers' own CUDA graphs found their tokens at the last replay's
address ("same": the graph's input copy needs no update) and how many elsewhere ("moved": one
update of its source, graph_input.py). A small random Qwen3-MoE model (4 layers, hidden 1024,
32 experts, top-4), bf16, greedy, batch 1. Run on the GPU machine from the project root:

    python3 scripts/graph_input_hits.py --new-tokens 64
"""

from __future__ import annotations

import argparse

import torch
import transformers
from megamoe_torch import graph_input, swap_moe_blocks


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    args = parser.parse_args()
    config = transformers.Qwen3MoeConfig(
        vocab_size=2048,
        hidden_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=2048,
        moe_intermediate_size=256,
        num_experts=32,
        num_experts_per_tok=4,
        norm_topk_prob=True,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).eval()
    report = swap_moe_blocks(model)
    print(f"swapped {len(report.swapped)} blocks, skipped {len(report.skipped)}")
    counts = {"same": 0, "moved": 0}
    point_at = graph_input.CopySource.point_at

    def counted(source, src):
        counts["same" if src == source.source else "moved"] += 1
        return point_at(source, src)

    graph_input.CopySource.point_at = counted
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt_tokens), device="cuda")
    model.generate(
        prompt,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
    )
    replays = counts["same"] + counts["moved"]
    print(
        f"{replays} replays over {args.new_tokens} generated tokens: "
        f"{counts['same']} at the last replay's address, {counts['moved']} moved"
    )


if __name__ == "__main__":
    main()
