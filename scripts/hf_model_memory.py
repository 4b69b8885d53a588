"""A whole transformers MoE model at its real size, swapped for megamoe: the GPU memory it holds
and its greedy decode against the unswapped model's.

Qwen3-30B-A3B's architecture (48 layers, 128 experts of 768 rows, top-8; random bf16 weights:
61 GB, which an 80 GB GPU holds once) is built on the GPU. The unswapped model generates
--new-tokens greedy tokens after a --prompt-tokens prompt (transformers' experts implementation
as from_config picks it); `swap_moe_blocks` swaps every MoE block and the swapped model generates
the same (compiling the kernels and preparing the weights). Then --rounds alternating rounds
time the decode of three models on the same blocks' weights: transformers' blocks, megamoe's,
and blocks answering zeros (the rest of the model's time).

It prints the memory allocated after each step and the peak, the best decode time per token of
each model and of its MoE blocks (the model's less the rest's), and how many of the generated
tokens agree (bf16 near-ties may pick another expert, then another token). Run on the GPU
machine from the project root (docs/benchmarks.md, "Setting up a GPU machine"):

    python3 scripts/hf_model_memory.py

--weight-dtype fp8 swaps the blocks with e4m3 experts quantized per 128 x 128 block (the bf16
experts go with the blocks that held them: the memory falls by about half of theirs) and times
megamoe's blocks against the zeros alone (transformers' blocks cannot come back to FP8 experts;
their time is the bf16 run's). --layers builds fewer decoder layers (the memory per layer is the
same); --tiny shrinks every size so the script runs on a CPU in seconds:

    python3 scripts/hf_model_memory.py --tiny --device cpu
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers
from megamoe_torch import swap_moe_blocks, unswap_moe_blocks
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig

GB = 1e9

# Qwen3-30B-A3B as released (its config.json)
QWEN3_30B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=4,
)


class Zeros(nn.Module):
    """A block answering zeros (the model's other work timed without its MoE blocks)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(hidden_states)


def allocated_gb(device: torch.device) -> float:
    return torch.cuda.memory_allocated(device) / GB if device.type == "cuda" else float("nan")


def timed(call, device: torch.device) -> tuple[object, float]:
    """(call's result, the seconds it took, the device drained before and after)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


@torch.no_grad()
def generate(model, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    """(the greedy tokens after the prompt, seconds per generated token past the first)."""

    def tokens(count: int) -> torch.Tensor:
        return model.generate(prompt, max_new_tokens=count, do_sample=False)

    _, first_seconds = timed(lambda: tokens(1), prompt.device)
    out, seconds = timed(lambda: tokens(new_tokens), prompt.device)
    # the whole generation less its prefill and first token, over the tokens after the first
    per_token = max(0.0, seconds - first_seconds) / max(1, new_tokens - 1)
    return out[:, prompt.shape[1] :], per_token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: 48)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--weight-dtype", choices=["bf16", "fp8"], default="bf16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    sizes = dict(QWEN3_30B_A3B, **(TINY if args.tiny else {}))
    if args.layers is not None:
        sizes["num_hidden_layers"] = args.layers
    config = Qwen3MoeConfig(**sizes)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    parameters_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / GB
    memory = [("built", allocated_gb(device))]
    generator = torch.Generator(device=device).manual_seed(1)
    prompt = torch.randint(
        config.vocab_size, (1, args.prompt_tokens), device=device, generator=generator
    )
    hf_tokens, _ = generate(model, prompt, args.new_tokens)
    memory.append(("transformers generated", allocated_gb(device)))
    fp8 = args.weight_dtype == "fp8"
    report = swap_moe_blocks(model, weight_dtype="fp8" if fp8 else None)
    memory.append((f"swapped ({len(report.swapped)} blocks)", allocated_gb(device)))
    tokens, _ = generate(model, prompt, args.new_tokens)  # compiles, prepares the weights
    memory.append(("megamoe generated", allocated_gb(device)))
    agree = int((tokens == hf_tokens).sum())

    names = [entry.name for entry in report.swapped]
    blocks = {"megamoe": [model.get_submodule(name) for name in names]}
    if not fp8:
        unswap_moe_blocks(model)
        blocks["transformers"] = [model.get_submodule(name) for name in names]
    blocks["zeros"] = [Zeros() for _ in names]
    per_token = {kind: float("inf") for kind in blocks}
    for _ in range(args.rounds):
        for kind, modules in blocks.items():
            for name, module in zip(names, modules, strict=True):
                model.set_submodule(name, module)
            per_token[kind] = min(per_token[kind], generate(model, prompt, args.new_tokens)[1])
    memory.append(("after the rounds", allocated_gb(device)))

    print(
        f"transformers {transformers.__version__}, torch {torch.__version__}, "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else device}"
    )
    print(
        f"{config.num_hidden_layers} layers, {parameters_gb:.1f} GB of bf16 parameters; "
        f"experts implementation {getattr(config, '_experts_implementation', None)!r}; "
        f"backend {report.swapped[0].backend if report.swapped else '-'}, "
        f"{args.weight_dtype} experts"
    )
    for step, gb in memory:
        print(f"  {step:28s} {gb:7.1f} GB allocated")
    if device.type == "cuda":
        print(f"  {'peak':28s} {torch.cuda.max_memory_allocated(device) / GB:7.1f} GB allocated")
    rest, ours = per_token["zeros"], per_token["megamoe"]
    line = (
        f"decode per token, best of {args.rounds}: megamoe {ours * 1e3:.2f} ms (its MoE blocks "
        f"{(ours - rest) * 1e3:.2f}), the rest {rest * 1e3:.2f} ms"
    )
    if "transformers" in per_token:
        hf = per_token["transformers"]
        line += (
            f", transformers {hf * 1e3:.2f} ms (its MoE blocks {(hf - rest) * 1e3:.2f}): the "
            f"model {hf / ours:.2f}x, its MoE blocks {(hf - rest) / max(ours - rest, 1e-12):.2f}x"
        )
    print(f"{line}; {agree} of {args.new_tokens} generated tokens agree with transformers' bf16")


if __name__ == "__main__":
    main()
