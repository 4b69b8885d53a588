"""FP8 (e4m3) block scaling on the host: weight and row quantization, dequantization, and the
scale layouts the FP8 grouped GEMMs take (drop/fp8_scaling.py holds the recipe).

Layouts:
- weights: e4m3 [E, N, K] with float32 scales [E, ceil(N / 128), ceil(K / 128)], one per
  128 x 128 block (a checkpoint's `weight_scale_inv`, stacked over experts);
- batch rows: e4m3 [M, K] with float32 scales [ceil(K / group), M]: group-major, rows
  contiguous (a view of a wider buffer is taken too); `row_scales_buffer` makes one.

Quantization is deterministic (amax, one division, round to nearest even) and the same on any
device, so a kernel that quantizes in its epilogue or its dispatch gives the values these do.
"""

from __future__ import annotations

import torch

from megamoe_kernels.drop.fp8_scaling import (
    ACTIVATION_GROUP,
    AMAX_FLOOR,
    E4M3_MAX,
    E4M3_MAX_RECIPROCAL,
    INTERMEDIATE_GROUP,
    WEIGHT_BLOCK,
    WIDE_INTERMEDIATE_GROUP,
)

FP8_DTYPE = torch.float8_e4m3fn

__all__ = [
    "ACTIVATION_GROUP",
    "E4M3_MAX_RECIPROCAL",
    "FP8_DTYPE",
    "INTERMEDIATE_GROUP",
    "WEIGHT_BLOCK",
    "WIDE_INTERMEDIATE_GROUP",
    "dequantize_rows",
    "dequantize_weight_blocks",
    "quantize_rows",
    "quantize_weight_blocks",
    "row_scales_buffer",
    "weight_scales_shape",
]


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    amax = amax.float().clamp(min=AMAX_FLOOR)
    # an IEEE division, as the kernels divide: torch turns a division by a Python number into a
    # multiplication by its rounded reciprocal, which differs in the last bit for some amax
    return amax / torch.full_like(amax, E4M3_MAX)


def _blocks(size: int, block: int) -> int:
    return -(-size // block)


def weight_scales_shape(weight_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """The block scales' shape of an [E, N, K] weight: [E, ceil(N/128), ceil(K/128)]."""
    experts, n, k = weight_shape
    return experts, _blocks(n, WEIGHT_BLOCK), _blocks(k, WEIGHT_BLOCK)


# experts quantized or dequantized at a time: bounds the float32 temporaries (a checkpoint's
# whole expert stack would need several times its size)
_EXPERT_CHUNK_BYTES = 1 << 30


def _expert_chunks(experts: int, elements_per_expert: int) -> range:
    """The first expert of each chunk of experts whose float32 copies take about 1 GiB."""
    step = max(1, _EXPERT_CHUNK_BYTES // (4 * max(1, elements_per_expert)))
    return range(0, experts, step)


def quantize_weight_blocks(w_ENK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] (any float dtype) -> (e4m3 [E, N, K], float32 scales [E, N/128, K/128],
    partial blocks rounded up): each 128 x 128 block scaled by its amax / 448."""
    if w_ENK.dim() != 3 or not w_ENK.is_floating_point():
        raise ValueError(
            f"weights to quantize must be a floating [E, N, K] tensor, got {w_ENK.dtype} "
            f"{tuple(w_ENK.shape)}"
        )
    experts, n, k = w_ENK.shape
    _, nb, kb = weight_scales_shape(w_ENK.shape)
    quantized = torch.empty(w_ENK.shape, dtype=FP8_DTYPE, device=w_ENK.device)
    scales = torch.empty(experts, nb, kb, dtype=torch.float32, device=w_ENK.device)
    step = _expert_chunks(experts, nb * kb * WEIGHT_BLOCK * WEIGHT_BLOCK).step
    for first in range(0, experts, step):
        chunk = w_ENK[first : first + step]
        padded = chunk.new_zeros(
            chunk.shape[0], nb * WEIGHT_BLOCK, kb * WEIGHT_BLOCK, dtype=torch.float32
        )
        padded[:, :n, :k] = chunk
        blocks = padded.view(chunk.shape[0], nb, WEIGHT_BLOCK, kb, WEIGHT_BLOCK)
        chunk_scales = _scale_of(blocks.abs().amax(dim=(2, 4)))
        values = (blocks / chunk_scales[:, :, None, :, None]).to(FP8_DTYPE)
        quantized[first : first + step] = values.view(padded.shape)[:, :n, :k]
        scales[first : first + step] = chunk_scales
    return quantized, scales


def dequantize_weight_blocks(
    w_ENK: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The values an e4m3 [E, N, K] weight and its block scales stand for, in `dtype`: each
    product is exact in float32 and rounded once to `dtype` (the whole float32 weight is never
    held, so a bf16 copy of a large pack needs only its own bytes beside the pack)."""
    experts, n, k = w_ENK.shape
    expected = weight_scales_shape(w_ENK.shape)
    if tuple(scales.shape) != expected:
        raise ValueError(
            f"weight scales must be [E, ceil(N/128), ceil(K/128)] = {list(expected)} for a "
            f"weight of shape {list(w_ENK.shape)}, got {list(scales.shape)}"
        )
    values = torch.empty(w_ENK.shape, dtype=dtype, device=w_ENK.device)
    step = _expert_chunks(experts, n * k).step
    for first in range(0, experts, step):
        full = scales[first : first + step].float()
        full = full.repeat_interleave(WEIGHT_BLOCK, 1).repeat_interleave(WEIGHT_BLOCK, 2)
        values[first : first + step] = w_ENK[first : first + step].float() * full[:, :n, :k]
    return values


def row_scales_buffer(
    groups: int, rows: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """An uninitialised float32 [groups, rows] scale tensor in the kernels' layout."""
    return torch.empty(groups, rows, dtype=torch.float32, device=device)


def quantize_rows(
    x_MK: torch.Tensor, group: int = ACTIVATION_GROUP
) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], float32 scales [ceil(K/group), M] in the kernels' layout): one
    scale per row and `group` columns (the last group may be partial)."""
    if x_MK.dim() != 2 or not x_MK.is_floating_point():
        raise ValueError(
            f"rows to quantize must be a floating [M, K] tensor, got {x_MK.dtype} "
            f"{tuple(x_MK.shape)}"
        )
    if group not in (ACTIVATION_GROUP, INTERMEDIATE_GROUP, WIDE_INTERMEDIATE_GROUP):
        raise ValueError(
            f"group must be {ACTIVATION_GROUP} (the hidden rows, or the intermediate after "
            f"256-column gate-up tiles) or {INTERMEDIATE_GROUP} (the intermediate after decode "
            f"or 128-column tiles), got {group}"
        )
    rows, k = x_MK.shape
    groups = _blocks(k, group)
    if k % group:  # a partial last group: pad it with zeros (they move no amax)
        padded = x_MK.new_zeros(rows, groups * group)
        padded[:, :k] = x_MK
        x_MK = padded
    grouped = x_MK.view(rows, groups, group)
    # few passes over the rows: the amax in the rows' dtype (exact), one division in fp32
    amax = torch.linalg.vector_norm(grouped, ord=float("inf"), dim=2)
    scales = _scale_of(amax)
    quantized = torch.div(grouped, scales[:, :, None]).to(FP8_DTYPE).view(rows, groups * group)
    # an explicit [groups, rows] buffer: .t().contiguous() keeps odd strides for a single row
    scales_GM = row_scales_buffer(groups, rows, device=quantized.device).copy_(scales.t())
    return quantized[:, :k].contiguous(), scales_GM


def dequantize_rows(
    x_MK: torch.Tensor, scales_GM: torch.Tensor, group: int = ACTIVATION_GROUP
) -> torch.Tensor:
    """The float32 values e4m3 rows and their [groups, M] scales (one per `group` columns)
    stand for."""
    rows, k = x_MK.shape
    expected = (_blocks(k, group), rows)
    if tuple(scales_GM.shape) != expected:
        raise ValueError(
            f"row scales must be [ceil(K/{group}), M] = {list(expected)}, got "
            f"{list(scales_GM.shape)}"
        )
    full = scales_GM.float().t().repeat_interleave(group, 1)[:, :k]
    return x_MK.float() * full
