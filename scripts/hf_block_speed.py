"""A transformers MoE block against the same block converted to megamoe, at real model sizes.

For the MoE block of Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V3 and gpt-oss-120b (random bf16 weights,
built alone from a one-layer config, one family's weights alive at a time; gpt-oss's checkpoints
hold MXFP4 experts, its block here bf16 ones), on the same inputs at each token count: the median
wall time of the transformers block's own eager forward, once per experts implementation of
--hf-experts ('eager' loops over the experts; from_pretrained picks 'grouped_mm'; 'megamoe' is
megamoe's experts implementation, the block's own router and code around megamoe's expert compute);
of the block converted by `from_hf`, eager and as a CUDA-graph replay (capacity fixed at tokens x
top_k); of the transformers block as a CUDA-graph replay, '-' where its forward does not capture
(host syncs); the speedups of megamoe eager and graph over the transformers eager forward; megamoe's
rel-L2 against the transformers output (the hidden states, where a block also answers its routing
weights). Needs transformers >= 5. Run on the GPU machine from the project root (docs/benchmarks.md,
"Setting up a GPU machine"):

    python3 scripts/hf_block_speed.py

--fp32-reference adds each block's rel-L2 against the transformers block in fp32 on the same
weights (its eager experts loop; bf16 inputs cast up): transformers' own bf16 error beside
megamoe's (the block in fp32 takes 2x its bf16 memory: one family at a time).

--atomic-combine converts each block with `atomic_combine=True` (the down GEMM adds its rows
into the output in place of the combine kernel; MegaMoEConfig.atomic_combine).

--tiny shrinks every size so the script runs on a CPU in seconds (no CUDA graphs there):

    python3 scripts/hf_block_speed.py --tiny --device cpu --repeats 3
"""

from __future__ import annotations

import argparse
import copy
import gc
import platform

import torch
import transformers
from megamoe_kernels.reference import relative_l2_error
from megamoe_runtime.measure import format_columns, median_graph_replay_seconds, median_seconds
from megamoe_torch import from_hf, register_experts_implementation
from megamoe_torch.bench import calls_in_turn, with_capacity
from megamoe_torch.layer import MegaMoE
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3MoE,
    DeepseekV3PreTrainedModel,
)
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP, GptOssPreTrainedModel
from transformers.models.mixtral.modeling_mixtral import (
    MixtralPreTrainedModel,
    MixtralSparseMoeBlock,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoePreTrainedModel,
    Qwen3MoeSparseMoeBlock,
)

# family: (its PreTrainedModel class, MoE block class, fields set at every size as the released
# config has them, real sizes, --tiny sizes)
FAMILIES = {
    "qwen3_moe": (
        Qwen3MoePreTrainedModel,
        Qwen3MoeSparseMoeBlock,
        dict(norm_topk_prob=True),
        dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8),
        dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=4),
    ),
    "mixtral": (
        MixtralPreTrainedModel,
        MixtralSparseMoeBlock,
        dict(router_jitter_noise=0.0),
        dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2),
        dict(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    ),
    "deepseek_v3": (
        DeepseekV3PreTrainedModel,
        DeepseekV3MoE,
        dict(routed_scaling_factor=2.5, n_shared_experts=1, norm_topk_prob=True),
        dict(
            hidden_size=7168,
            moe_intermediate_size=2048,
            n_routed_experts=256,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
        ),
        # groups of two experts: a group scores the sum of its two best
        dict(
            hidden_size=64,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=3,
        ),
    ),
    # router bias, softmax over the top-4 logits, [E, H, 2I] experts with gate and up columns
    # interleaved and biased, SwiGLU clamped at 7 with alpha 1.702 and (up + 1): the block's own
    # constants (transformers 5.17 sets them on the experts, 5.24 reads them from the config)
    "gpt_oss": (
        GptOssPreTrainedModel,
        GptOssMLP,
        dict(),
        dict(
            hidden_size=2880, intermediate_size=2880, num_local_experts=128, num_experts_per_tok=4
        ),
        dict(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=4),
    ),
}


@torch.no_grad()
def build_block(family: str, *, tiny: bool, device: torch.device) -> nn.Module:
    """The family's MoE block alone on `device`, with random weights, in the dtypes
    from_pretrained gives a bf16 checkpoint: bf16 but for what the model keeps in fp32."""
    model_class, block_class, fixed_fields, real_sizes, tiny_sizes = FAMILIES[family]
    sizes = tiny_sizes if tiny else real_sizes
    config = model_class.config_class(num_hidden_layers=1, **fixed_fields, **sizes)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            block = block_class(config)
    finally:
        torch.set_default_dtype(default_dtype)
    keep_fp32 = tuple(getattr(model_class, "_keep_in_fp32_modules_strict", None) or ())
    # experts held [E, in, out] (gpt-oss) take their inputs along the second-to-last dim
    transposed = getattr(block.experts, "is_transposed", False)
    torch.manual_seed(0)
    for name, tensor in [*block.named_parameters(), *block.named_buffers()]:
        if name.endswith(keep_fp32):
            tensor.data = tensor.data.float()
        if name.endswith("e_score_correction_bias"):
            tensor.uniform_(0.0, 0.1)  # non-negative: -inf and 0.0 group masking pick alike
        else:
            # unit-variance outputs from unit-variance inputs, at every layer of the block
            expert_weight = transposed and name.startswith("experts.") and tensor.dim() == 3
            tensor.normal_(std=tensor.shape[-2 if expert_weight else -1] ** -0.5)
    return block.eval()


def hidden_states_of(output) -> torch.Tensor:
    """A block's hidden states: its output, or the first of the outputs it answers (gpt-oss's
    block answers its top-k routing weights too)."""
    return output[0] if isinstance(output, tuple) else output


def graph_seconds_or_none(fn, *, device: torch.device, repeats: int) -> float | None:
    """A CUDA-graph replay's time per call, None where `fn` cannot be captured (host syncs)."""
    try:
        return median_graph_replay_seconds(fn, device=device, repeats=repeats)
    except RuntimeError:
        torch.cuda.synchronize(device)
        return None


def microseconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def ratio(numerator: float, denominator: float | None) -> str:
    return "-" if denominator is None else f"{numerator / denominator:.2f}"


@torch.no_grad()
def bench_point(
    family: str,
    block: nn.Module,
    layer: MegaMoE,
    x: torch.Tensor,
    args: argparse.Namespace,
    reference: nn.Module | None = None,
) -> list[list[str]]:
    """One table row per transformers experts implementation, at the token count of `x`;
    `reference`: the block in fp32, the rel-L2 of both bf16 blocks against it."""
    device, repeats, tokens = x.device, args.repeats, x.shape[1]
    megamoe_out = layer(x)
    expected = None if reference is None else hidden_states_of(reference(x.float()))
    # two copies of the tokens in turn: a model's activations move between forwards, and a
    # replayed forward then points its graph's input copy at them (graph_input.py)
    megamoe_eager = median_seconds(
        calls_in_turn(layer, (x, x.clone())), device=device, repeats=repeats
    )
    megamoe_graph = None
    if device.type == "cuda":
        fixed = with_capacity(layer, tokens * layer.config.top_k, prepared_like=layer)
        megamoe_graph = median_graph_replay_seconds(
            lambda: fixed(x), device=device, repeats=repeats
        )
    rows = []
    for experts_implementation in args.hf_experts:
        block.experts.config._experts_implementation = experts_implementation
        hf_out = hidden_states_of(block(x))
        hf_eager = median_seconds(lambda: block(x), device=device, repeats=repeats)
        hf_graph = None
        if device.type == "cuda":
            hf_graph = graph_seconds_or_none(lambda: block(x), device=device, repeats=repeats)
        times = [hf_eager, megamoe_eager, megamoe_graph, hf_graph]
        speedups = [ratio(hf_eager, megamoe_eager), ratio(hf_eager, megamoe_graph)]
        errors = [relative_l2_error(megamoe_out, hf_out)]
        if expected is not None:
            errors += [
                relative_l2_error(hf_out, expected),
                relative_l2_error(megamoe_out, expected),
            ]
        row = [family, str(tokens), experts_implementation, *map(microseconds, times), *speedups]
        rows.append([*row, *(f"{error:.2e}" for error in errors)])
    return rows


def bench_family(family: str, args: argparse.Namespace, device: torch.device) -> list[list[str]]:
    block = build_block(family, tiny=args.tiny, device=device)
    # shares the block's expert tensors
    layer = from_hf(block, atomic_combine=args.atomic_combine)
    reference = None
    if args.fp32_reference:
        reference = copy.deepcopy(block).float()
        reference.experts.config._experts_implementation = "eager"
    hidden_size, rows = layer.config.hidden_size, []
    for tokens in args.tokens:
        x = torch.randn(1, tokens, hidden_size, device=device, dtype=torch.bfloat16)
        rows += bench_point(family, block, layer, x, args, reference)
    # the next family's weights get the memory (DeepSeek-V3's experts alone are 22 GB; from_hf
    # copies gpt-oss's experts into megamoe's layout, 6.4 GB)
    del block, layer, reference
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    register_experts_implementation()  # "megamoe" among the --hf-experts choices
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--family", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 4096])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--hf-experts",
        nargs="+",
        choices=["eager", *ALL_EXPERTS_FUNCTIONS.keys()],
        default=["eager", "grouped_mm"],
        help="transformers experts implementations to time (from_pretrained picks grouped_mm)",
    )
    parser.add_argument("--tiny", action="store_true", help="toy sizes, for a CPU")
    parser.add_argument(
        "--fp32-reference",
        action="store_true",
        help="rel-L2 of the transformers and the megamoe block against the block in fp32",
    )
    parser.add_argument(
        "--atomic-combine",
        action="store_true",
        help="megamoe's down GEMM adds its rows into the output (MegaMoEConfig.atomic_combine: "
        "not deterministic) in place of the combine kernel",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = platform.processor() or platform.machine()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{device.type}: {device_name}{', tiny sizes' if args.tiny else ''}"
        f"{', atomic combine' if args.atomic_combine else ''}"
    )
    timed = ["hf eager us", "megamoe eager us", "megamoe graph us", "hf graph us"]
    header = ["family", "tokens", "hf experts", *timed, "x eager", "x graph", "rel-L2"]
    if args.fp32_reference:
        header += ["hf vs fp32", "megamoe vs fp32"]
    rows = []
    for family in args.family:
        rows += bench_family(family, args, device)
    print(format_columns(header, rows))


if __name__ == "__main__":
    main()
