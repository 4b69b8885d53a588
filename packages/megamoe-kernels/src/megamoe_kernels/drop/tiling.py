"""Tiling constants shared by the grouped GEMM kernels and their knob rules (plain Python)."""

from .fp8_scaling import WEIGHT_BLOCK

# bytes of one row of a K tile: 64 bf16 or 128 e4m3 values, the 128-byte swizzle's width
TILE_K_BYTES = 128
TILE_K = 64  # bf16 values per K tile
FP8_TILE_K = 128  # e4m3 values per K tile (one weight scale block)
SMEM_CAPACITY_BYTES = 227 * 1024
SMEM_RESERVED_BYTES = 1024
THREADS_PER_WARPGROUP = 128
# padding of each staged output row: keeps 16-byte alignment and spreads rows over banks
EPILOGUE_ROW_PAD = 8


def tile_k(element_bytes: int) -> int:
    """K values per K tile for operands of `element_bytes` bytes."""
    return TILE_K_BYTES // element_bytes


def fp8_column_slices(mma_n: int, *, swap_ab: bool) -> int:
    """How many column slices of its MMA's N an FP8 tile runs its MMAs and promotions in, one
    after the other: a prefill tile wider than a weight block a block's columns at a time (its
    running sum and one slice's products fit a consumer thread's registers where two sets of
    the whole tile would not), any other tile all at once (1). A ValueError for a prefill tile
    wider than a block that is not a multiple of it."""
    if swap_ab or mma_n <= WEIGHT_BLOCK:
        return 1
    if mma_n % WEIGHT_BLOCK:
        raise ValueError(
            f"an FP8 prefill tile of {mma_n} columns: one wider than {WEIGHT_BLOCK} columns is a "
            f"multiple of {WEIGHT_BLOCK} (its MMAs and promotions run a weight block's columns "
            "at a time)"
        )
    return mma_n // WEIGHT_BLOCK
