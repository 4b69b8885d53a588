"""megamoe kernels: CuTe DSL expert-compute kernels for Hopper, and their pure-torch oracles.

`import megamoe_kernels` works on any machine: the kernel API (from `shim`) is loaded on first
attribute access, and CuTe DSL itself only when a kernel compiles.
"""

import importlib
import importlib.metadata

from megamoe_kernels import reference

__version__ = importlib.metadata.version("megamoe-kernels")

_SHIM_NAMES = (
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
)

__all__ = ["__version__", "reference", *_SHIM_NAMES]


def __getattr__(name: str):
    if name in _SHIM_NAMES:
        return getattr(importlib.import_module("megamoe_kernels.shim"), name)
    raise AttributeError(f"module 'megamoe_kernels' has no attribute {name!r}")
