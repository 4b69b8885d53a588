"""Fixtures the kernel tests share."""

from __future__ import annotations

import pytest
from megamoe_kernels import default_launches
from megamoe_kernels.shim import expert_gemm, knobs


@pytest.fixture
def down_l2_prefetch(monkeypatch):
    """The default profile with its decode down GEMMs' L2 prefetch on (knobs.DOWN_L2_PREFETCH,
    off by default). The planned launches and the bound launchers are cleared before and after,
    so no launcher planned without it serves the test, nor one planned with it a later test."""
    monkeypatch.setattr(knobs, "DOWN_L2_PREFETCH", True)
    monkeypatch.setattr(expert_gemm, "_LAUNCHERS", {})
    default_launches.cache_clear()
    yield
    default_launches.cache_clear()
