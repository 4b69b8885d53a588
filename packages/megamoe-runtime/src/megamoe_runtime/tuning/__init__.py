"""Tuning: a persistent knob cache and (collective) autotuning over candidate knobs.

The cutedsl-specific parts (candidate GemmKnobs, cache keys, the offline tuner) live in
`megamoe_runtime.tuning.expert_knobs`, imported on demand.
"""

from megamoe_runtime.tuning.autotune import pick_fastest
from megamoe_runtime.tuning.cache import (
    KnobCache,
    KnobKey,
    default_cache_path,
    rows_per_expert_bucket,
)

__all__ = ["KnobCache", "KnobKey", "default_cache_path", "pick_fastest", "rows_per_expert_bucket"]
