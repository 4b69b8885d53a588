"""`megamoe bench --ep`'s scenarios on every rank: the rows agree across ranks, every combine
equals the reference dispatcher's, and the expert-parallel layers agree with the baseline.

On a CPU (gloo) only the torch dispatcher and the reference backend run; on GPUs the
symmetric-memory variants and the grouped_mm / cutedsl layers run too."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist
from megamoe_runtime.geometries import Geometry
from megamoe_torch import bench_ep

pytestmark = pytest.mark.multirank

# divisible into 2, 4 and 8 ranks' experts
TINY = Geometry(
    name="tiny-ep",
    num_experts=16,
    top_k=4,
    hidden_size=128,
    intermediate_size=64,
    scoring="sigmoid",
    num_groups=4,
    top_groups=2,
    routed_scaling_factor=2.5,
    use_correction_bias=True,
)


def times_same_on_every_rank(rows: list[dict]) -> bool:
    """Every time is the slowest rank's, so every rank reports the same (the byte counts are
    each rank's own)."""
    times = [
        {k: "nan" if math.isnan(v) else v for k, v in row.items() if k.endswith("_us")}
        for row in rows
    ]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, times)
    return all(rank == gathered[0] for rank in gathered)


def dispatch_combine_body(rank, world_size, device):
    rows = bench_ep.run(TINY, [3, 8], iterations=4)
    assert [row["tokens"] for row in rows] == [3, 8]
    for row in rows:
        assert row["combine_equals_reference_bitwise"], row
        assert row["torch_dispatch_us"] > 0 and row["nccl_all_to_all_us"] > 0
        assert row["deepep_bytes"] > 0
        if device.type == "cuda":
            assert row["nvshmem_dispatch_us"] > 0 and row["nvshmem_combine_us"] > 0
    assert times_same_on_every_rank(rows)


def layer_body(rank, world_size, device):
    backends = ["reference"] if device.type == "cpu" else ["grouped_mm", "cutedsl"]
    rows = bench_ep.run_layer(TINY, [5], backends=backends, iterations=3)
    (row,) = rows
    assert row["layer_outputs_close"], row
    timed = [key for key in row if key.startswith("layer_") and key.endswith("_us")]
    assert timed and all(row[key] > 0 for key in timed)
    assert times_same_on_every_rank(rows)
    if rank == 0:
        assert "| tokens |" in bench_ep.format_layer_table(rows)


def test_dispatch_and_combine_rows(multirank):
    multirank(dispatch_combine_body)


def test_expert_parallel_layer_rows(multirank):
    multirank(layer_body)
