"""The FP8 (e4m3) block-scaling recipe shared by the kernels and the host transforms.

A value is stored as e4m3 q with a float32 scale s per block: value = q * s. A block's scale is
amax(|block|) / E4M3_MAX (amax floored at AMAX_FLOOR, so an all-zero block divides by a
normal number), and q = round-to-nearest-even(value / s), saturated to +-E4M3_MAX.

- weights: one scale per WEIGHT_BLOCK x WEIGHT_BLOCK block of each expert's [N, K] matrix
  (DeepSeek-V3's and Qwen3-FP8's `weight_scale_inv`);
- the batch rows fed to the gate-up GEMM: one scale per row and ACTIVATION_GROUP columns;
- the gate-up output fed to the down GEMM: one scale per row and INTERMEDIATE_GROUP or
  WIDE_INTERMEDIATE_GROUP columns. The epilogue quantizes whole groups of its own tile's
  output columns (the SwiGLU halves the accumulator columns): a decode (swap-AB) tile or a
  128-column prefill tile holds 64 of them, a 256-column prefill tile 128. So a gate-up whose
  every launch runs 256-column prefill tiles writes 128-column groups, and the down GEMM
  after it promotes its products once per 128 of K instead of twice (8-12% less time).

Plain Python: the kernels and the host code both read these.
"""

import struct

E4M3_MAX = 448.0
# 1 / E4M3_MAX rounded to the nearest fp32 (448 = 7 x 2^6: the binary digits of 1/7 repeat 001,
# never near a tie, so rounding Python's double to fp32 rounds the exact reciprocal)
E4M3_MAX_RECIPROCAL = struct.unpack("<f", struct.pack("<f", 1.0 / E4M3_MAX))[0]
AMAX_FLOOR = 1e-10
WEIGHT_BLOCK = 128
ACTIVATION_GROUP = 128
INTERMEDIATE_GROUP = 64
WIDE_INTERMEDIATE_GROUP = 128
