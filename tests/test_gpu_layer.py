"""The layer on a Hopper GPU: every backend that runs here against the fp32 oracle."""

import pytest
import torch
from megamoe_kernels.reference import relative_l2_error
from megamoe_runtime.experts import BACKEND_NAMES
from megamoe_runtime.geometries import GEOMETRIES
from megamoe_torch import bench
from megamoe_torch.cli import fp32_oracle_of, main

pytestmark = pytest.mark.gpu
requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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
