"""The only code that imports drop/: the stable API of megamoe's kernels.

Importing this package imports torch but not CuTe DSL; kernels compile on first use.
"""

from megamoe_kernels.shim.expert_gemm import (
    GemmLauncher,
    cached_kernel_count,
    current_stream_handle,
    down,
    down_launcher,
    gate_up_launcher,
    gate_up_swiglu,
    interleave_gate_up,
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
    knob_problems,
    resolve_knobs,
)

__all__ = [
    "OPS",
    "PROFILE_ROWS_PER_EXPERT",
    "GemmKnobs",
    "GemmLauncher",
    "Launch",
    "cached_kernel_count",
    "candidate_knobs",
    "check_knobs",
    "current_stream_handle",
    "default_knobs",
    "default_launches",
    "down",
    "down_launcher",
    "gate_up_launcher",
    "gate_up_swiglu",
    "interleave_gate_up",
    "knob_problems",
    "resolve_knobs",
]
