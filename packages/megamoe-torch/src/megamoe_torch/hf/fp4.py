"""DeepSeek-V4's FP4 experts and power-of-two scales, read as the FP8 format megamoe computes.

DeepSeek-V4 checkpoints (transformers' "fp8" quantization with `expert_dtype "fp4"` and
`scale_fmt "ue8m0"`) hold:
- FP4 experts: two e2m1 values a byte (the even column in the low nibble), int8 [..., N, K / 2],
  and one power-of-two scale per row and 32 columns, `weight_scale_inv` [..., N, K / 32];
- e4m3 weights (the shared experts) with one power-of-two scale per 128 x 128 block.
The scales are ue8m0 (torch.float8_e8m0fnu, or its bytes as uint8: 2^(byte - 127)).

On disk the scales sit at `X.scale` beside `X.weight` (`with_scales_inv_names` names them as
transformers does). `as_fp8_checkpoint` turns such tensors into megamoe's FP8 format, exactly: a power-of-two scale
is a float32 scale as it is; an FP4 weight's values, e2m1 x 2^s, are e4m3 values times one
power-of-two scale per 128 x 128 block where the block's values span few enough binades (e2m1
holds 0.5 to 6, e4m3 2^-9 to 448: the exponents of a block's 32-column scales within 14 of each
other). A block whose values e4m3 cannot hold exactly raises UnsupportedBlockError naming the
tensor; `weight_dtype=None` still converts it (`fp4_values`: e2m1 x 2^s is exact in bf16).
"""

from __future__ import annotations

import torch
from megamoe_kernels.shim.fp8 import WEIGHT_BLOCK
from megamoe_runtime.weights import FP8_WEIGHT_DTYPE

from megamoe_torch.hf.families import UnsupportedBlockError
from megamoe_torch.hf.fp8 import SCALES_SUFFIX, UE8M0_DTYPES

# e2m1 by its 4 bits (sign, two exponent bits, one mantissa bit): the magnitudes, then negated
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = E2M1_MAGNITUDES + tuple(-magnitude for magnitude in E2M1_MAGNITUDES)
# columns per power-of-two scale of an FP4 weight
FP4_GROUP = 32
# the containers of packed e2m1 pairs
FP4_DTYPES = tuple(
    dtype
    for dtype in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None))
    if dtype is not None
)
# e4m3's largest binade: 2^8 x 1.75 = 448; e2m1's mantissas are 1 and 1.5
E4M3_TOP_EXPONENT = 8


def is_fp4(weight: torch.Tensor, scales: torch.Tensor | None) -> bool:
    """Whether `weight` is packed e2m1 with one ue8m0 scale per row and 32 columns."""
    return (
        weight.dtype in FP4_DTYPES
        and scales is not None
        and scales.dtype in UE8M0_DTYPES
        and tuple(scales.shape) == (*weight.shape[:-1], 2 * weight.shape[-1] // FP4_GROUP)
    )


def ue8m0_values(scales: torch.Tensor, *, where: str) -> torch.Tensor:
    """float32 2^(byte - 127) of ue8m0 scales; the NaN byte 255 raises ValueError naming
    `where`."""
    exponent_bytes = scales.contiguous().view(torch.uint8).to(torch.int32)
    if bool((exponent_bytes == 255).any()):
        raise ValueError(f"{where} holds the ue8m0 NaN (255): not a scale")
    return torch.ldexp(torch.ones_like(exponent_bytes, dtype=torch.float32), exponent_bytes - 127)


def fp4_values(weight: torch.Tensor, scales: torch.Tensor, *, where: str) -> torch.Tensor:
    """float32 [..., N, K]: the values of an FP4 weight [..., N, K / 2] and its ue8m0 scales
    [..., N, K / 32], e2m1 x 2^s (exact)."""
    nibbles = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=weight.device)
    # each byte's pair of values, the low nibble first
    byte_values = torch.stack([nibbles.repeat(16), nibbles.repeat_interleave(16)], dim=-1)
    values = byte_values[weight.contiguous().view(torch.uint8).long()]  # [..., N, K / 2, 2]
    groups = values.view(*weight.shape[:-1], -1, FP4_GROUP)  # [..., N, K / 32, 32]
    groups *= ue8m0_values(scales, where=where).unsqueeze(-1)
    return groups.view(*weight.shape[:-1], 2 * weight.shape[-1])


def fp4_as_fp8(
    weight: torch.Tensor, scales: torch.Tensor, *, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [..., N, K], float32 scales [..., ceil(N/128), ceil(K/128)]) holding exactly the
    values of an FP4 weight and its ue8m0 scales: each 128 x 128 block scaled by the power of
    two that puts its largest magnitude in e4m3's top binade (zero blocks by 1), one expert at a
    time (a full-size expert's values take tens of MB in float32, a layer's tens of GB). Raises
    UnsupportedBlockError naming `where` for a block e4m3 cannot hold exactly."""
    if weight.dim() == 2:
        return _one_fp4_as_fp8(weight, scales, where=where)
    rows, cols = weight.shape[-2], 2 * weight.shape[-1]
    quantized = torch.empty(
        (weight.shape[0], rows, cols), dtype=FP8_WEIGHT_DTYPE, device=weight.device
    )
    block_scales = torch.empty(
        (weight.shape[0], -(-rows // WEIGHT_BLOCK), -(-cols // WEIGHT_BLOCK)),
        dtype=torch.float32,
        device=weight.device,
    )
    for expert in range(weight.shape[0]):
        quantized[expert], block_scales[expert] = _one_fp4_as_fp8(
            weight[expert], scales[expert], where=f"{where} (expert {expert})"
        )
    return quantized, block_scales


def _one_fp4_as_fp8(
    weight: torch.Tensor, scales: torch.Tensor, *, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp4_as_fp8 of one [N, K / 2] weight."""
    values = fp4_values(weight, scales, where=where)
    rows, cols = values.shape
    row_blocks, col_blocks = -(-rows // WEIGHT_BLOCK), -(-cols // WEIGHT_BLOCK)
    padded = values.new_zeros(row_blocks * WEIGHT_BLOCK, col_blocks * WEIGHT_BLOCK)
    padded[:rows, :cols] = values
    blocks = padded.view(row_blocks, WEIGHT_BLOCK, col_blocks, WEIGHT_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    _, amax_exponent = torch.frexp(amax)  # amax = m x 2^e, m in [0.5, 1)
    block_exponent = torch.where(amax > 0, amax_exponent - 1 - E4M3_TOP_EXPONENT, 0)
    block_scales = torch.ldexp(torch.ones_like(amax), block_exponent)
    # powers of two: the products are exact
    quantized = (blocks * torch.ldexp(torch.ones_like(amax), -block_exponent)).to(FP8_WEIGHT_DTYPE)
    inexact = quantized.float() * block_scales != blocks
    if bool(inexact.any()):
        row_block, _, col_block, _ = (int(i) for i in inexact.nonzero()[0])
        raise UnsupportedBlockError(
            f"{where}: the FP4 values of the 128 x 128 block at row {row_block * WEIGHT_BLOCK}, "
            f"column {col_block * WEIGHT_BLOCK} span more binades than e4m3 holds under one "
            "scale (their 32-column scales differ by more than 2^14), so megamoe's FP8 experts "
            "cannot hold them exactly; convert with weight_dtype=None for the exact values in "
            "the activations' dtype"
        )
    quantized = quantized.view(padded.shape)[:rows, :cols].contiguous()
    return quantized, block_scales.view(row_blocks, col_blocks)


def with_scales_inv_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with the scales stored as `X.scale` beside a one-byte `X.weight` (DeepSeek-V4's
    checkpoints on disk; transformers' FP8 loading renames them so) under
    `X.weight_scale_inv`."""
    out = {}
    for key, tensor in tensors.items():
        stem = key.removesuffix(".scale")
        weight = tensors.get(f"{stem}.weight")
        if stem != key and weight is not None and weight.element_size() == 1:
            key = f"{stem}.weight{SCALES_SUFFIX}"
        out[key] = tensor
    return out


def as_fp8_checkpoint(
    tensors: dict[str, torch.Tensor], *, dequantize_fp4_to: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """`tensors` with each FP4 weight (and its scales) replaced by e4m3 and float32 128 x 128
    block scales holding the same values (fp4_as_fp8), or by its values in
    `dequantize_fp4_to` where given (its scales removed), and each ue8m0 block scale of an e4m3
    weight by its float32 value. Other tensors are returned as they are."""
    out = dict(tensors)
    for key, weight in tensors.items():
        scales_name = key + SCALES_SUFFIX
        scales = tensors.get(scales_name)
        if scales is None:
            continue
        if is_fp4(weight, scales):
            if dequantize_fp4_to is not None:
                out[key] = _dequantized_fp4(weight, scales, dtype=dequantize_fp4_to, where=key)
                del out[scales_name]
            else:
                out[key], out[scales_name] = fp4_as_fp8(weight, scales, where=key)
        elif weight.dtype == FP8_WEIGHT_DTYPE and scales.dtype in UE8M0_DTYPES:
            out[scales_name] = ue8m0_values(scales, where=scales_name)
    return out


def _dequantized_fp4(
    weight: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype, where: str
) -> torch.Tensor:
    """The values of an FP4 weight in `dtype`, one expert at a time (fp4_as_fp8 says why)."""
    if weight.dim() == 2:
        return fp4_values(weight, scales, where=where).to(dtype)
    out = torch.empty((*weight.shape[:-1], 2 * weight.shape[-1]), dtype=dtype, device=weight.device)
    for expert in range(weight.shape[0]):
        out[expert] = fp4_values(weight[expert], scales[expert], where=where)
    return out
