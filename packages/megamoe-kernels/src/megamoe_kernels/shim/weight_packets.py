"""The weight-packet layout: each expert's weight tiles in the order the kernels read them.

A row-major weight [E, N, K] keeps a 128-row x 128-byte tile as 128 runs of 128 bytes, K bytes
apart. Packed (`pack_weight_tiles`), tile (e, n, k) (128 weight rows by one K tile: 64 bf16 or
128 e4m3 values) is one contiguous run, the tiles in the order expert -> tile row -> K tile,
and with FP8 each tile is followed by its scale words (the block scales its rows take, float32)
in the same allocation, padded so every packet starts on a 128-byte line:

    packet (e, n, k) at byte ((e * N_tiles + n) * K_tiles + k) * packet_bytes
    its rows: 128 x 128 bytes, row-major;  FP8: then 2 float32 scale words, then padding

The GEMMs read the tiles with the same single TMA descriptor (a view of the allocation whose
modes are (rows within a packet, packets) and (values within a row, K tiles)), so a kernel tile
of 64, 128 or 256 weight rows is one box, and read the scale words from the same allocation
(each tile's consumers prefetch their lines into L2 first: a packet's words are a line apart).

A packed weight is a tensor of its own shape and strides, which is how the shim tells it from a
row-major one: [E, N_tiles, K_tiles, 128, K tile values] with strides
(N_tiles * K_tiles * P, K_tiles * P, P, K tile values, 1), P the packet's elements; FP8 scales
are a float32 view of the same storage, [E, N_tiles, K_tiles, 2] with strides (N_tiles * K_tiles
* P / 4, K_tiles * P / 4, P / 4, 1), starting after the first tile's bytes. The scale words of a
gate-up packet (w13 interleaved, gate_up_layout) are (its gate rows' block scale, its up rows'
block scale); of a down packet (the block's scale, the same again).

Packing needs N a multiple of 256 (a 128 x 256 prefill tile is two whole packets), K a multiple
of the K tile and, with FP8, I a multiple of 128; anything else is refused at load with the
reason. Packed and row-major weights give the same bits (the kernels read the same values and
scales); `unpack_weight_tiles` gives the row-major weight back.
"""

from __future__ import annotations

import math

import torch

from megamoe_kernels.drop.gate_up_layout import GATE_UP_BLOCK
from megamoe_kernels.drop.tiling import TILE_K_BYTES
from megamoe_kernels.shim.fp8 import FP8_DTYPE, WEIGHT_BLOCK, weight_scales_shape

PACKET_ROWS = 128  # weight rows per packet: one FP8 scale block
PACKED_N_MULTIPLE = 256  # the widest kernel tile of weight rows (bf16 prefill, 128 x 256)
TILE_BYTES = PACKET_ROWS * TILE_K_BYTES
SCALE_WORDS = 2  # float32 words after an FP8 tile
# an FP8 packet: the tile, then its scale words padded to a 128-byte line
SCALED_PACKET_BYTES = TILE_BYTES + TILE_K_BYTES
PACKED_DTYPES = (torch.bfloat16, FP8_DTYPE)
# the kernel tiles' weight rows a packed weight serves: within one packet, or two whole ones
PACKED_TILE_COLS = (64, 128, 256)

__all__ = [
    "PACKED_N_MULTIPLE",
    "PACKED_TILE_COLS",
    "PACKET_ROWS",
    "is_packed_shape",
    "is_packed_weight",
    "pack_problems",
    "pack_weight_tiles",
    "packed_dims",
    "packed_scale_words",
    "packet_strides",
    "stored_shape_dims",
    "stored_weight_dims",
    "unpack_weight_tiles",
]


def _row_values(dtype: torch.dtype) -> int:
    return TILE_K_BYTES // dtype.itemsize


def packet_elements(dtype: torch.dtype) -> int:
    """Elements of `dtype` per packet (a bf16 packet is its tile; an e4m3 one has its scales)."""
    return (SCALED_PACKET_BYTES if dtype == FP8_DTYPE else TILE_BYTES) // dtype.itemsize


def packet_strides(dtype: torch.dtype, experts: int, n: int, k: int) -> tuple[int, ...]:
    """The strides of a packed [E, N/128, K/tile, 128, tile] weight of `dtype` (elements)."""
    row_values = _row_values(dtype)
    n_tiles, k_tiles = n // PACKET_ROWS, k // row_values
    p = packet_elements(dtype)
    return (n_tiles * k_tiles * p, k_tiles * p, p, row_values, 1)


def is_packed_shape(shape: tuple[int, ...]) -> bool:
    """Whether a stored weight of this shape is in the packet layout (5-D; row-major weights
    are 3-D, or 4-D interleaved gate-up)."""
    return len(shape) == 5


def is_packed_weight(weight: torch.Tensor) -> bool:
    """Whether a stored weight tensor is in the packet layout."""
    return is_packed_shape(tuple(weight.shape))


def packed_dims(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(E, N, K) of a packed weight's shape."""
    experts, n_tiles, k_tiles, rows, row_values = shape
    return experts, n_tiles * rows, k_tiles * row_values


def stored_shape_dims(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(E, N, K) of a stored weight's shape in either layout: packed, interleaved gate-up
    [E, I/8, 16, H] (N = 2I) or [E, N, K]."""
    shape = tuple(shape)
    if is_packed_shape(shape):
        return packed_dims(shape)
    return shape[0], math.prod(shape[1:-1]), shape[-1]


def stored_weight_dims(weight: torch.Tensor) -> tuple[int, int, int]:
    """(E, N, K) of a stored weight tensor (stored_shape_dims)."""
    return stored_shape_dims(weight.shape)


def pack_problems(dtype: torch.dtype, n: int, k: int, *, gate_up: bool) -> list[str]:
    """Why an [E, N, K] weight of `dtype` cannot be packed (empty: it can)."""
    problems = []
    if dtype not in PACKED_DTYPES:
        problems.append(f"dtype {dtype} (accepted: torch.bfloat16, {FP8_DTYPE})")
        return problems
    if n % PACKED_N_MULTIPLE:
        problems.append(
            f"N={n} weight rows is not a multiple of {PACKED_N_MULTIPLE} (a 128 x 256 tile is "
            "two whole packets)"
        )
    if k % _row_values(dtype):
        problems.append(f"K={k} is not a multiple of the K tile ({_row_values(dtype)} values)")
    if dtype == FP8_DTYPE and gate_up and (n // 2) % WEIGHT_BLOCK:
        problems.append(
            f"I={n // 2} is not a multiple of {WEIGHT_BLOCK} (a packet's gate rows and up rows "
            "each lie in one scale block)"
        )
    return problems


def _scale_words(scales_ENK: torch.Tensor, *, gate_up: bool, n_tiles: int) -> torch.Tensor:
    """float32 [E, N/128, K tiles, 2]: the scale words of each packet. A gate-up packet of 128
    interleaved rows holds 64 gate rows of gate block t // 2 and their 64 up rows, of block
    (I / 128) + t // 2; a down packet is block t."""
    if gate_up:
        gate_blocks = scales_ENK.shape[1] // 2
        blocks = torch.arange(n_tiles, device=scales_ENK.device) // 2
        gate = scales_ENK.index_select(1, blocks)
        up = scales_ENK.index_select(1, blocks + gate_blocks)
        return torch.stack((gate, up), dim=-1)
    return torch.stack((scales_ENK, scales_ENK), dim=-1)


def pack_weight_tiles(
    weight: torch.Tensor, scales: torch.Tensor | None = None, *, gate_up: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A stored weight (gate-up: interleave_gate_up's [E, I/8, 16, H]; down: [E, H, I]; bf16,
    or e4m3 with its [E, N/128, K/128] block scales) -> (the packed weight, for FP8 its scale
    words' view of the same allocation, else None). Deterministic; it allocates the packets
    alone (the source's size, FP8 0.8% more) and the source can be released afterwards.
    Refuses (ValueError, with the reason) what cannot be packed."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != (4 if gate_up else 3):
        what = "interleave_gate_up's [E, I/8, 16, H]" if gate_up else "[E, H, I]"
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight to pack must be {what}, got {got}")
    if gate_up and weight.shape[2] != 2 * GATE_UP_BLOCK:
        raise ValueError(
            f"gate-up weight to pack must be interleaved [E, I/{GATE_UP_BLOCK}, "
            f"{2 * GATE_UP_BLOCK}, H], got {tuple(weight.shape)}"
        )
    experts, n, k = stored_shape_dims(weight.shape)
    problems = pack_problems(weight.dtype, n, k, gate_up=gate_up)
    fp8 = weight.dtype == FP8_DTYPE
    if fp8:
        expected = weight_scales_shape((experts, n, k))
        if (
            not isinstance(scales, torch.Tensor)
            or scales.dtype != torch.float32
            or tuple(scales.shape) != expected
        ):
            got = None if scales is None else f"{scales.dtype} {tuple(scales.shape)}"
            problems.append(
                f"e4m3 weights need their float32 block scales {list(expected)}, got {got}"
            )
    elif scales is not None:
        problems.append("bf16 weights take no scales")
    if problems:
        raise ValueError("cannot pack this weight: " + "; ".join(problems))
    row_values = _row_values(weight.dtype)
    n_tiles, k_tiles = n // PACKET_ROWS, k // row_values
    packet_bytes = SCALED_PACKET_BYTES if fp8 else TILE_BYTES
    storage = torch.empty(
        (experts, n_tiles, k_tiles, packet_bytes), dtype=torch.uint8, device=weight.device
    )
    # copied as bytes (e4m3 has no copy kernel on every device) from a permuted view of the
    # source straight into the packets: no other copy of the weight is made
    storage[..., :TILE_BYTES].unflatten(-1, (PACKET_ROWS, TILE_K_BYTES)).copy_(
        weight.view(torch.uint8)
        .reshape(experts, n_tiles, PACKET_ROWS, k_tiles, TILE_K_BYTES)
        .permute(0, 1, 3, 2, 4)
    )
    if fp8:
        words = _scale_words(scales, gate_up=gate_up, n_tiles=n_tiles).contiguous()
        storage[..., TILE_BYTES : TILE_BYTES + 4 * SCALE_WORDS] = words.view(torch.uint8).view(
            experts, n_tiles, k_tiles, 4 * SCALE_WORDS
        )
        storage[..., TILE_BYTES + 4 * SCALE_WORDS :] = 0
    packed = torch.as_strided(
        storage.view(-1).view(weight.dtype),
        (experts, n_tiles, k_tiles, PACKET_ROWS, row_values),
        packet_strides(weight.dtype, experts, n, k),
    )
    return packed, packed_scale_words(packed) if fp8 else None


def packed_scale_words(packed: torch.Tensor) -> torch.Tensor:
    """The float32 [E, N/128, K tiles, 2] view of a packed e4m3 weight's scale words."""
    experts, n_tiles, k_tiles, _, _ = packed.shape
    words = packed.stride(2) * packed.dtype.itemsize // 4
    first = (packed.storage_offset() * packed.dtype.itemsize + TILE_BYTES) // 4
    return torch.as_strided(
        packed.view(torch.float32),
        (experts, n_tiles, k_tiles, SCALE_WORDS),
        (n_tiles * k_tiles * words, k_tiles * words, words, 1),
        first,
    )


def unpack_weight_tiles(packed: torch.Tensor) -> torch.Tensor:
    """A packed weight -> the row-major [E, N, K] it was packed from (a gate-up weight comes
    back as [E, N, K]: `.view(E, I/8, 16, H)` gives interleave_gate_up's layout)."""
    experts, n, k = packed_dims(tuple(packed.shape))
    rows = packed.permute(0, 1, 3, 2, 4).view(torch.uint8)
    return rows.reshape(experts, n, k * packed.dtype.itemsize).view(packed.dtype)
