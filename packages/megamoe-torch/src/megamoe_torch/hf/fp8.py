"""FP8 checkpoints under Hugging Face names: which of a block's tensors are e4m3 weights with
block scales, the checks that they are the format megamoe computes, and their dequantized values.

The format (DeepSeek-V3/R1, the Qwen3 FP8 releases; transformers' "fp8" quantization, its
finegrained FP8 integration): an e4m3 weight [N, K] or stacked [E, N, K], and beside it one scale
per 128 x 128 block, value = e4m3 x scale, [ceil(N/128), ceil(K/128)] (stacked [E, ...]), under
the weight's key + `_scale_inv`:

| where                               | weight                            | scales                                      |
|-------------------------------------|-----------------------------------|---------------------------------------------|
| checkpoints on disk (per expert)    | `experts.{e}.gate_proj.weight`    | `experts.{e}.gate_proj.weight_scale_inv`    |
| transformers >= 5 in memory (fused) | `experts.gate_up_proj` [E, 2I, H] | `experts.gate_up_proj_scale_inv`            |
| shared experts (both)               | `shared_experts.up_proj.weight`   | `shared_experts.up_proj.weight_scale_inv`   |

Scales are float32 (DeepSeek), bfloat16 (some Qwen releases) or ue8m0 powers of two
(DeepSeek-V4, whose FP4 experts fp4.py reads): megamoe keeps float32, which holds each exactly.
Activations are quantized at run time (activation_scheme "dynamic"). Refused, with the reason:
other block sizes, static activation scales, other scale formats, e5m2 weights.
"""

from __future__ import annotations

from typing import Any

import torch
from megamoe_kernels import dequantize_weight_blocks, weight_scales_shape
from megamoe_kernels.shim.fp8 import WEIGHT_BLOCK
from megamoe_runtime.weights import FP8_WEIGHT_DTYPE
from torch import nn

from megamoe_torch.hf.families import UnsupportedBlockError

SCALES_SUFFIX = "_scale_inv"
SCALE_DTYPES = (torch.float32, torch.bfloat16)
# power-of-two scales (scale_fmt "ue8m0"): torch.float8_e8m0fnu, or its bytes as uint8
UE8M0_DTYPES = tuple(
    dtype for dtype in (getattr(torch, "float8_e8m0fnu", None), torch.uint8) if dtype is not None
)
SUPPORTED_BLOCK = [WEIGHT_BLOCK, WEIGHT_BLOCK]
FULL_PRECISION = (torch.float32, torch.bfloat16, torch.float16)


def scales_key(weight_key: str) -> str:
    """Where a weight's block scales sit: `experts.3.up_proj.weight` ->
    `experts.3.up_proj.weight_scale_inv`, `experts.gate_up_proj` -> `experts.gate_up_proj_scale_inv`."""
    return weight_key + SCALES_SUFFIX


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype == FP8_WEIGHT_DTYPE


def holds_fp8(tensors: dict[str, torch.Tensor]) -> bool:
    return any(is_fp8(tensor) for tensor in tensors.values())


def take_scales(
    tensors: dict[str, torch.Tensor], weight_key: str, weight: torch.Tensor
) -> torch.Tensor | None:
    """The float32 block scales of `weight` (found under `weight_key`), removed from `tensors`;
    None for a full-precision weight. Raises ValueError naming the key when an e4m3 weight comes
    without its scales, scales come with a full-precision weight, or the scales are not one per
    128 x 128 block."""
    key = scales_key(weight_key)
    scales = tensors.pop(key, None)
    if not is_fp8(weight):
        if scales is not None:
            raise ValueError(
                f"{key} comes with a {weight.dtype} {weight_key}: block scales go with e4m3 weights"
            )
        return None
    if scales is None:
        raise ValueError(
            f"{weight_key} is e4m3 without its block scales {key}: an FP8 checkpoint holds one "
            "float32 scale per 128 x 128 block of each e4m3 weight"
        )
    expected = weight_scales_shape(weight.shape if weight.dim() == 3 else (1, *weight.shape))
    expected = expected if weight.dim() == 3 else expected[1:]
    if tuple(scales.shape) != tuple(expected) or scales.dtype not in SCALE_DTYPES:
        raise ValueError(
            f"{key} is {scales.dtype} {list(scales.shape)}: megamoe takes float32 (or bfloat16) "
            f"scales of 128 x 128 blocks (weight_block_size [128, 128]), {list(expected)} for "
            f"{weight_key} {list(weight.shape)}"
        )
    return scales.float()


def stacked_gate_up_scales(
    gate_scales: torch.Tensor, up_scales: torch.Tensor, *, intermediate_size: int, where: str
) -> torch.Tensor:
    """w13's block scales, gate blocks then up blocks along the rows, from the gate and up
    projections' own ([..., ceil(I/128), ceil(H/128)] each). Exact only when I is a multiple of
    128: otherwise a 128-row block of w13 straddles gate and up rows, which have scales of their
    own, and this raises UnsupportedBlockError (a ValueError)."""
    check_stackable(intermediate_size, where=where)
    return torch.cat([gate_scales, up_scales], dim=-2)


def check_stackable(intermediate_size: int, *, where: str) -> None:
    """Raises UnsupportedBlockError (a ValueError) unless gate and up block scales stack."""
    if intermediate_size % WEIGHT_BLOCK:
        raise UnsupportedBlockError(
            f"{where}: the experts' intermediate size {intermediate_size} is not a multiple of "
            f"{WEIGHT_BLOCK}, so the gate and up projections' {WEIGHT_BLOCK} x {WEIGHT_BLOCK} "
            "scale blocks do not stack into w13's (one block would hold gate and up rows of two "
            "scales); convert with weight_dtype=None for the dequantized weights"
        )


def split_gate_up_scales(
    w13_scales: torch.Tensor, *, intermediate_size: int, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `stacked_gate_up_scales`: (gate scales, up scales)."""
    check_stackable(intermediate_size, where=where)
    rows = intermediate_size // WEIGHT_BLOCK
    return w13_scales[..., :rows, :], w13_scales[..., rows:, :]


def dequantized(
    tensors: dict[str, torch.Tensor], *, dtype: torch.dtype, keys: set[str] | None = None
) -> dict[str, torch.Tensor]:
    """`tensors` with each e4m3 weight (of `keys`, or every one) replaced by the values it and
    its block scales stand for, in `dtype`, and those scales removed."""
    out = dict(tensors)
    for key, weight in tensors.items():
        if not is_fp8(weight) or (keys is not None and key not in keys):
            continue
        scales = take_scales(out, key, weight)
        stacked = weight if weight.dim() == 3 else weight[None]
        values = dequantize_weight_blocks(
            stacked, scales if weight.dim() == 3 else scales[None], dtype
        )
        out[key] = values if weight.dim() == 3 else values[0]
    return out


def activation_dtype_of(
    *, expert_dtype: torch.dtype, model_config: Any, router_dtype: torch.dtype
) -> torch.dtype:
    """The dtype of the hidden states a converted layer takes: its experts' when they are full
    precision; for e4m3 experts, which say nothing of it, the model's (its config's `dtype`),
    else the router weight's."""
    if expert_dtype in FULL_PRECISION:
        return expert_dtype
    if isinstance(model_config, dict):
        declared = model_config.get("dtype") or model_config.get("torch_dtype")
    else:
        declared = getattr(model_config, "dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return declared if declared in FULL_PRECISION else router_dtype


def model_config_of(block: nn.Module) -> Any:
    """The transformers config a block (or its experts module) was built from, or None."""
    return getattr(block, "config", None) or getattr(
        getattr(block, "experts", None), "config", None
    )


def check_quantization_config(hf_config: Any) -> bool:
    """Whether a model's config declares FP8 weights megamoe takes (True), or none (False).
    Raises UnsupportedBlockError for another quantization or FP8 recipe, naming it."""
    if isinstance(hf_config, dict):
        quantization = hf_config.get("quantization_config")
    else:
        quantization = getattr(hf_config, "quantization_config", None)
    if quantization is None:
        return False
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    method = quantization.get("quant_method")
    if method != "fp8":
        raise UnsupportedBlockError(
            f"quantization_config quant_method {method!r}: megamoe reads unquantized checkpoints "
            "and FP8 ones (quant_method 'fp8', e4m3 with 128 x 128 block scales)"
        )
    check_fp8_recipe(
        block_size=quantization.get("weight_block_size"),
        activation_scheme=quantization.get("activation_scheme", "dynamic"),
        scale_format=quantization.get("scale_fmt", "float"),
        weight_format=quantization.get("fmt", "e4m3"),
        where="quantization_config",
    )
    expert_dtype = quantization.get("expert_dtype", "fp8")
    if expert_dtype not in ("fp8", "fp4"):
        raise UnsupportedBlockError(
            f"quantization_config expert_dtype {expert_dtype!r}: megamoe reads FP8 experts and "
            "DeepSeek-V4's FP4 ones (expert_dtype 'fp8' or 'fp4')"
        )
    return True


def check_fp8_recipe(
    *,
    block_size: Any,
    activation_scheme: str | None,
    scale_format: str | None,
    weight_format: str | None = "e4m3",
    where: str,
) -> None:
    """Raises UnsupportedBlockError unless the recipe is the one megamoe computes."""
    if block_size is None or list(block_size) != SUPPORTED_BLOCK:
        raise UnsupportedBlockError(
            f"{where}: weight_block_size {block_size}: megamoe takes FP8 weights with one scale "
            f"per {SUPPORTED_BLOCK} block (DeepSeek-V3 / Qwen3 FP8); dequantize other recipes "
            "first"
        )
    if activation_scheme not in (None, "dynamic"):
        raise UnsupportedBlockError(
            f"{where}: activation_scheme {activation_scheme!r}: megamoe quantizes activations "
            "per row and 128 channels as they come (activation_scheme 'dynamic'), not with "
            "static scales"
        )
    if scale_format not in (None, "float", "ue8m0"):
        raise UnsupportedBlockError(
            f"{where}: scale_fmt {scale_format!r}: megamoe takes float32 (or bfloat16) block "
            "scales (scale_fmt 'float') and power-of-two ones (scale_fmt 'ue8m0')"
        )
    if weight_format not in (None, "e4m3"):
        raise UnsupportedBlockError(
            f"{where}: fmt {weight_format!r}: megamoe takes e4m3 weights (fmt 'e4m3')"
        )


def check_fp8_modules(block: nn.Module) -> None:
    """Raises UnsupportedBlockError for a module of `block` holding e4m3 weights (transformers'
    FP8Experts, FP8Linear) with a recipe other than megamoe's: block size, static activation
    scales, scale formats other than float32, bfloat16 and ue8m0."""
    for name, module in block.named_modules():
        tensors = dict(module.named_parameters(recurse=False))
        tensors.update(module.named_buffers(recurse=False))
        if not any(is_fp8(tensor) for tensor in tensors.values()):
            continue
        where = name or type(block).__name__
        scale_dtypes = {t.dtype for key, t in tensors.items() if key.endswith(SCALES_SUFFIX)}
        check_fp8_recipe(
            block_size=getattr(module, "block_size", None),
            activation_scheme=getattr(module, "activation_scheme", None),
            scale_format=None
            if scale_dtypes <= {*SCALE_DTYPES, *UE8M0_DTYPES}
            else str(scale_dtypes),
            where=f"{where} ({type(module).__name__})",
        )
