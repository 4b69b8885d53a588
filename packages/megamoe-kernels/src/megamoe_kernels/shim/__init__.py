"""The only code that imports drop/: the stable API of megamoe's kernels.

Importing this package imports torch but not CuTe DSL; kernels compile on first use.
"""

from megamoe_kernels.shim.epilogue import SwiGLU, interleave_gate_up_bias
from megamoe_kernels.shim.expert_gemm import (
    GemmLauncher,
    cached_kernel_count,
    current_stream_handle,
    down,
    down_fp8,
    down_fp8_launcher,
    down_launcher,
    gate_up_fp8_launcher,
    gate_up_launcher,
    gate_up_swiglu,
    gate_up_swiglu_fp8,
    interleave_gate_up,
)
from megamoe_kernels.shim.fp8 import (
    FP8_DTYPE,
    dequantize_rows,
    dequantize_weight_blocks,
    quantize_rows,
    quantize_weight_blocks,
    row_scales_buffer,
    weight_scales_shape,
)
from megamoe_kernels.shim.knobs import (
    OPS,
    PROFILE_ROWS_PER_EXPERT,
    GemmKnobs,
    Launch,
    candidate_knobs,
    check_knobs,
    default_knobs,
    default_launches,
    gathers_rows_by_default,
    knob_problems,
    resolve_knobs,
)

__all__ = [
    "FP8_DTYPE",
    "OPS",
    "PROFILE_ROWS_PER_EXPERT",
    "GemmKnobs",
    "GemmLauncher",
    "Launch",
    "SwiGLU",
    "cached_kernel_count",
    "candidate_knobs",
    "check_knobs",
    "current_stream_handle",
    "default_knobs",
    "default_launches",
    "dequantize_rows",
    "dequantize_weight_blocks",
    "down",
    "down_fp8",
    "down_fp8_launcher",
    "down_launcher",
    "gate_up_fp8_launcher",
    "gate_up_launcher",
    "gate_up_swiglu",
    "gate_up_swiglu_fp8",
    "gathers_rows_by_default",
    "interleave_gate_up",
    "interleave_gate_up_bias",
    "knob_problems",
    "quantize_rows",
    "quantize_weight_blocks",
    "resolve_knobs",
    "row_scales_buffer",
    "weight_scales_shape",
]
