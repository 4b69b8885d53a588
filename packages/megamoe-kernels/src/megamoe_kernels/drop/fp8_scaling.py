"""The FP8 (e4m3) block-scaling recipe shared by the kernels and the host transforms.

A value is stored as e4m3 q with a float32 scale s per block: value = q * s. A block's scale is
amax(|block|) / E4M3_MAX (amax floored at AMAX_FLOOR, so an all-zero block divides by a
normal number), and q = round-to-nearest-even(value / s), saturated to +-E4M3_MAX.

- weights: one scale per WEIGHT_BLOCK x WEIGHT_BLOCK block of each expert's [N, K] matrix
  (DeepSeek-V3's and Qwen3-FP8's `weight_scale_inv`);
- the batch rows fed to the gate-up GEMM: one scale per row and ACTIVATION_GROUP columns;
- the gate-up output fed to the down GEMM: one scale per row and INTERMEDIATE_GROUP columns.
  A gate-up tile of 128 accumulator columns holds 64 output columns (the SwiGLU halves them),
  so the epilogue quantizes whole groups without another tile's values; 128-column groups
  would need every gate-up tile to hold 256 accumulator columns, and the decode (swap-AB)
  tiles hold 128 (their M side, with a running sum and two product sets per thread).

Plain Python: the kernels and the host code both read these.
"""

E4M3_MAX = 448.0
AMAX_FLOOR = 1e-10
WEIGHT_BLOCK = 128
ACTIVATION_GROUP = 128
INTERMEDIATE_GROUP = 64
