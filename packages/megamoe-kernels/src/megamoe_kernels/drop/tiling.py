"""Tiling constants shared by the grouped GEMM kernels and their knob rules (plain Python)."""

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
