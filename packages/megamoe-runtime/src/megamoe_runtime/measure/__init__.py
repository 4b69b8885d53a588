"""The one timing and measurement harness of megamoe's benchmarks and tuners.

- `clock`: warm-up, the settled clock (SETTLE_SECONDS), CUDA events, CUDA-graph replay, the
  host clock, host time per call, per-step timing of a repeated sequence, alternating rounds,
  the slowest rank;
- `metrics`: TFLOP/s, GB/s, speedups, the fraction of the roofline floor;
- `output`: CSV, JSON, a bar chart (PNG), a text table;
- `smi`: the GPU's SM clock and power draw beside a reading (nvidia-smi in the background);
- `kernels`: each GPU kernel's device time per call (the torch profiler).

`megamoe bench` (every mode, expert parallel included), `megamoe tune`, the online autotuner and
the scripts under scripts/ time with these, so a number means the same wherever it was taken.
"""

from megamoe_runtime.measure.clock import (
    SETTLE_SECONDS,
    Readings,
    alternating_readings,
    captured_graph,
    host_seconds_per_call,
    keep_busy,
    median_graph_replay_seconds,
    median_seconds,
    median_step_seconds,
    slowest_across_ranks,
)
from megamoe_runtime.measure.kernels import KernelTime, kernel_times
from megamoe_runtime.measure.metrics import (
    expert_roofline_fraction,
    gigabytes_per_second,
    speedup,
    tflops,
)
from megamoe_runtime.measure.output import (
    as_records,
    format_columns,
    plot_bars,
    write_csv,
    write_json,
)
from megamoe_runtime.measure.smi import SmiSampler

__all__ = [
    "SETTLE_SECONDS",
    "KernelTime",
    "Readings",
    "SmiSampler",
    "alternating_readings",
    "as_records",
    "captured_graph",
    "expert_roofline_fraction",
    "format_columns",
    "gigabytes_per_second",
    "host_seconds_per_call",
    "keep_busy",
    "kernel_times",
    "median_graph_replay_seconds",
    "median_seconds",
    "median_step_seconds",
    "plot_bars",
    "slowest_across_ranks",
    "speedup",
    "tflops",
    "write_csv",
    "write_json",
]
