"""megamoe kernels: CuTe DSL expert-compute kernels for Hopper, and their pure-torch oracles.

`import megamoe_kernels` works on any machine: the kernel API (from `shim`) is loaded on first
attribute access, and CuTe DSL itself only when a kernel compiles.
"""

import importlib
import importlib.metadata

from megamoe_kernels import reference

try:
    __version__ = importlib.metadata.version("megamoe-kernels")
except importlib.metadata.PackageNotFoundError:  # imported from a source tree, not installed
    __version__ = "0+source"

_SHIM_NAMES = (
    "FP8_DTYPE",
    "GEGLU",
    "PACKED_TILE_COLS",
    "GemmKnobs",
    "GemmLauncher",
    "Launch",
    "ROUTER_LOGITS_MAX_TOKENS",
    "RouterLogitsLauncher",
    "SwiGLU",
    "cached_kernel_count",
    "can_gather_rows",
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
    "fresh_scratch",
    "gate_up_fp8_launcher",
    "gate_up_launcher",
    "gate_up_swiglu",
    "gate_up_swiglu_fp8",
    "gathers_rows_by_default",
    "shared_experts_in_batch_by_default",
    "interleave_gate_up",
    "interleave_gate_up_bias",
    "is_packed_weight",
    "keeps_buffers",
    "knob_problems",
    "pack_problems",
    "pack_weight_tiles",
    "quantize_rows",
    "quantize_weight_blocks",
    "resolve_knobs",
    "row_scales_buffer",
    "router_logits_faster_tokens",
    "router_logits_launcher",
    "router_logits_problems",
    "stored_weight_dims",
    "unpack_weight_tiles",
    "weight_scales_shape",
)

__all__ = ["__version__", "reference", *_SHIM_NAMES]


def __getattr__(name: str):
    if name in _SHIM_NAMES:
        return getattr(importlib.import_module("megamoe_kernels.shim"), name)
    raise AttributeError(f"module 'megamoe_kernels' has no attribute {name!r}")
