"""DeepSeek-V4's FP4 experts and power-of-two scales, read as the FP8 format megamoe computes.

DeepSeek-V4 checkpoints (transformers' "fp8" quantization with `expert_dtype "fp4"` and
`scale_fmt "ue8m0"`) hold:
- FP4 experts: two e2m1 values a byte (the even column in the low nibble), int8 [..., N, K / 2],
  and one power-of-two scale per row and 32 columns, `weight_scale_inv` [..., N, K / 32];
- e4m3 weights (the shared experts) with one power-of-two scale per 128 x 128 block.
The scales are ue8m0 (torch.float8_e8m0fnu, or its bytes as uint8: 2^(byte - 127)).

On disk the scales sit at `X.scale` beside `X.weight` (`with_scales_inv_names` names them as
transformers does). `as_fp8_checkpoint` turns such tensors into megamoe's FP8 format, exactly:
a power-of-two scale is a float32 scale as it is; an FP4 weight's values, e2m1 x 2^s, are e4m3
values times one power-of-two scale per 128 x 128 block where the block's values span few
enough binades (e2m1 holds 0.5 to 6, e4m3 2^-9 to 448: the exponents of a block's 32-column
scales within 14 of each other). A block whose values e4m3 cannot hold exactly raises
UnsupportedBlockError naming the tensor; `weight_dtype=None` still converts it (`fp4_values`:
e2m1 x 2^s is exact in bf16).

A block transformers loaded from such a checkpoint holds FP8Experts of FP4 weights: reader.py
reads it through `fp8_experts_view` (meta tensors of the FP8 weights it converts to), and a
swapped block saves its experts back in the formats the block held (`in_block_formats`,
`fp8_as_fp4`: the same values).
"""

from __future__ import annotations

import copy

import torch
from megamoe_kernels import dequantize_weight_blocks
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


def fp8_as_fp4(
    weight: torch.Tensor, scales: torch.Tensor, *, like: tuple[torch.dtype, torch.dtype], where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of fp4_as_fp8, one expert at a time: (packed e2m1 [..., N, K / 2], ue8m0
    scales [..., N, K / 32]) in the dtypes `like` (the FP4 weight's and its scales') holding the
    values of e4m3 [..., N, K] and its float32 128 x 128 block scales; each 32 columns scaled by
    the power of two that puts their largest magnitude at 4 or 6, the scale an encoder rounding
    amax / 6 up to a power of two picks (32 values whose largest rounded to 3 have another
    encoding too: 3 x 2^s is 6 x 2^(s-1)). Raises RuntimeError naming `where` for values FP4
    cannot hold (weights that changed since they were read)."""
    if weight.dim() == 2:
        return _one_fp8_as_fp4(weight, scales, like=like, where=where)
    packed, group_scales = zip(
        *(
            _one_fp8_as_fp4(weight[e], scales[e], like=like, where=f"{where} (expert {e})")
            for e in range(weight.shape[0])
        ),
        strict=True,
    )
    return torch.stack(packed), torch.stack(group_scales)


def _one_fp8_as_fp4(
    weight: torch.Tensor, scales: torch.Tensor, *, like: tuple[torch.dtype, torch.dtype], where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    values = dequantize_weight_blocks(weight[None], scales[None])[0]
    groups = values.view(weight.shape[0], -1, FP4_GROUP)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    _, amax_exponent = torch.frexp(amax)  # amax = m x 2^e: floor(log2(amax)) = e - 1
    exponent = torch.where(amax > 0, amax_exponent - 3, 0)
    scaled = groups * torch.ldexp(torch.ones_like(amax), -exponent)  # powers of two: exact
    magnitudes = torch.tensor(E2M1_MAGNITUDES, device=weight.device)
    index = torch.searchsorted(magnitudes, scaled.abs()).clamp(max=len(E2M1_MAGNITUDES) - 1)
    if not torch.equal(magnitudes[index], scaled.abs()) or int(exponent.abs().max()) > 127:
        raise RuntimeError(
            f"{where}: the weights hold values FP4 (e2m1 times a power of two per 32 columns) "
            "cannot: they changed since the FP4 checkpoint was read, and are saved in it no more"
        )
    code = (index + 8 * torch.signbit(scaled)).flatten(-2).to(torch.uint8)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).view(like[0])
    scale_bytes = (exponent.squeeze(-1) + 127).to(torch.uint8).view(like[1])
    return packed, scale_bytes


def in_block_formats(
    hf_state: dict[str, torch.Tensor], block_state: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """`hf_state` (megamoe's FP8 format under a block's names) in the formats `block_state`
    holds (the replaced block's tensors, their dtypes and shapes): FP4 weights and their ue8m0
    scales where the block held FP4, ue8m0 block scales where it held them; others as they
    are."""
    out = dict(hf_state)
    for key, held in block_state.items():
        scales_name = key + SCALES_SUFFIX
        held_scales = block_state.get(scales_name)
        if held_scales is None or scales_name not in out or key not in out:
            continue
        if is_fp4(held, held_scales) and out[key].dtype == FP8_WEIGHT_DTYPE:
            out[key], out[scales_name] = fp8_as_fp4(
                out[key], out[scales_name], like=(held.dtype, held_scales.dtype), where=key
            )
        elif held_scales.dtype in UE8M0_DTYPES and out[scales_name].dtype == torch.float32:
            mantissa, exponent = torch.frexp(out[scales_name])
            if not bool((mantissa == 0.5).all()):
                raise RuntimeError(f"{scales_name}: block scales that are not powers of two")
            out[scales_name] = (exponent - 1 + 127).to(torch.uint8).view(held_scales.dtype)
    return out


def fp8_experts_view(experts: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of an experts module holding, in place of FP4 weights and their ue8m0
    scales, meta tensors of the e4m3 weights and float32 block scales megamoe reads them as
    (fp4_as_fp8), and float32 meta tensors in place of other ue8m0 scales: what reader.py reads
    its structure by (the probes never need the weights' values). `experts` is left as it
    is."""
    held = dict(experts.named_parameters(recurse=False))
    view = copy.copy(experts)
    view._parameters = dict(experts._parameters)
    for name, weight in held.items():
        scales = held.get(name + SCALES_SUFFIX)
        if scales is None or not is_fp4(weight, scales):
            continue
        rows, cols = weight.shape[-2], 2 * weight.shape[-1]
        blocks = (-(-rows // WEIGHT_BLOCK), -(-cols // WEIGHT_BLOCK))
        view._parameters[name] = torch.nn.Parameter(
            torch.empty((*weight.shape[:-2], rows, cols), dtype=FP8_WEIGHT_DTYPE, device="meta"),
            requires_grad=False,
        )
        view._parameters[name + SCALES_SUFFIX] = torch.nn.Parameter(
            torch.empty((*weight.shape[:-2], *blocks), device="meta"), requires_grad=False
        )
    return _with_float32_scales(view)


def fp8_reading_view(block: torch.nn.Module) -> torch.nn.Module:
    """A shallow copy of `block` whose experts module is fp8_experts_view's and whose other
    ue8m0 scales (FP8 shared experts', FP8 experts') are float32 meta tensors: the block as
    reader.py reads the FP8 layer it converts to. `block` is left as it is."""
    view = copy.copy(block)
    view._modules = {**block._modules, "experts": fp8_experts_view(block.experts)}
    return _with_float32_scales(view)


def reads_through_fp8_view(module: torch.nn.Module) -> bool:
    """Whether reader.py reads a block (or an experts module) through the views above: its
    experts hold FP4 weights, or it holds ue8m0 scales."""
    return (
        holds_fp4_weights(module)
        or holds_fp4_weights(getattr(module, "experts", None))
        or any(
            name.endswith(SCALES_SUFFIX) and tensor.dtype in UE8M0_DTYPES
            for name, tensor in module.named_parameters()
        )
    )


def _with_float32_scales(module: torch.nn.Module) -> torch.nn.Module:
    """`module`, or a shallow copy of it whose ue8m0 scales (in it or its children) are float32
    meta tensors of their shape."""
    own = {
        name: parameter
        for name, parameter in module._parameters.items()
        if parameter is not None
        and parameter.dtype in UE8M0_DTYPES
        and name.endswith(SCALES_SUFFIX)
    }
    children = {
        name: _with_float32_scales(child)
        for name, child in module._modules.items()
        if child is not None
    }
    changed = {
        name: child for name, child in children.items() if child is not module._modules[name]
    }
    if not own and not changed:
        return module
    view = copy.copy(module)
    view._parameters = dict(module._parameters)
    for name, parameter in own.items():
        view._parameters[name] = torch.nn.Parameter(
            torch.empty(parameter.shape, device="meta"), requires_grad=False
        )
    view._modules = {**module._modules, **changed}
    return view


def holds_fp4_weights(experts: torch.nn.Module | None) -> bool:
    """Whether an experts module holds FP4 weights with their ue8m0 scales."""
    if not isinstance(experts, torch.nn.Module):
        return False
    held = dict(experts.named_parameters(recurse=False))
    return any(is_fp4(weight, held.get(name + SCALES_SUFFIX)) for name, weight in held.items())
