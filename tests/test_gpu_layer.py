"""The layer on a Hopper GPU: every backend that runs here against the fp32 oracle."""

import fcntl
import gc
import tempfile
from pathlib import Path

import pytest
import torch
from megamoe_kernels.reference import relative_l2_error
from megamoe_runtime.experts import BACKEND_NAMES
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_torch import bench
from megamoe_torch.cli import fp32_oracle_of, main

pytestmark = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# every pytest-xdist worker of this machine opens this file
REAL_SIZE_LOCK = Path(tempfile.gettempdir()) / "megamoe-real-size-layer.lock"


@pytest.fixture(autouse=True)
def one_real_size_layer_at_a_time():
    """A real-size layer takes much of an 80 GB GPU (DeepSeek-V3's: 21 GiB of bf16 weights,
    then 42 GiB for its fp32 oracle's experts): three at once in parallel workers ran out of
    memory on an H100. So the workers take this module's tests one at a time, each under an
    exclusive lock on a file that they all open, and give their cached memory back to the GPU
    before they release it; the other modules' tests run beside them (1-2.5 GiB each: where
    that is too much, scripts/gpu-check.sh runs this module alone)."""
    with open(REAL_SIZE_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


@requires_gpu
@torch.no_grad()
@pytest.mark.parametrize("geometry", ["qwen3-30b-a3b", "dsv3", "gpt-oss-120b"])
@pytest.mark.parametrize("tokens", [1, 77, 600])
def test_every_available_backend_matches_fp32_oracle(geometry, tokens):
    device = torch.device("cuda")
    layer = bench.build_layer(GEOMETRIES[geometry], device=device, dtype=torch.bfloat16)
    x_TH = torch.randn(
        tokens, GEOMETRIES[geometry].hidden_size, device=device, dtype=torch.bfloat16
    )
    expected = fp32_oracle_of(layer)(x_TH.float())
    # gpt-oss-120b's biases and clamped SwiGLU on every backend
    for name in bench.layer_backends(layer, BACKEND_NAMES)[0]:
        layer.use_backend(name)
        error = relative_l2_error(layer(x_TH), expected)
        assert error < 1e-2, (name, error)


@requires_gpu
def test_auto_picks_a_gpu_backend_and_demo_passes(capsys):
    layer = bench.build_layer(
        GEOMETRIES["tiny-qwen3"], device=torch.device("cuda"), dtype=torch.bfloat16
    )
    layer.use_backend("auto")
    assert layer.backend in ("cutedsl", "grouped_mm")
    assert main(["demo", "--geometry", "qwen3-30b-a3b", "--tokens", "256", "--repeats", "3"]) == 0
