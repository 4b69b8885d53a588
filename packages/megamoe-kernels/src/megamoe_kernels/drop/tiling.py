"""Tiling constants shared by the grouped GEMM kernels and their knob rules (plain Python)."""

TILE_K = 64
SMEM_CAPACITY_BYTES = 227 * 1024
SMEM_RESERVED_BYTES = 1024
# padding of each staged output row: keeps 16-byte alignment and spreads rows over banks
EPILOGUE_ROW_PAD = 8
