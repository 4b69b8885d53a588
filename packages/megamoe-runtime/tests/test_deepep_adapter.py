"""The DeepEP adapter's promises that need no process group: megamoe neither imports deep_ep
nor depends on it, and anything but a DeepEP buffer is refused with what was expected. Its
behaviour across ranks is tested in tests/test_multirank_deepep.py."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from megamoe_runtime.dispatch import LocalDispatcher
from megamoe_runtime.dispatch.deepep import DeepEPDispatcher, deepep_api_of

ROOT = Path(__file__).resolve().parents[3]


def test_importing_megamoe_never_imports_deep_ep():
    # megamoe_torch too where it is installed (this package's own session has the runtime alone)
    probe = (
        "import importlib.util, sys, megamoe_runtime.dispatch, megamoe_runtime.distributed\n"
        "if importlib.util.find_spec('megamoe_torch'): import megamoe_torch\n"
        "print('deep_ep' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], check=False, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_no_package_depends_on_deep_ep():
    for pyproject in sorted(ROOT.glob("packages/*/pyproject.toml")):
        required = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
        assert not [d for d in required if d.lower().replace("-", "_").startswith("deep_ep")]


def test_anything_but_a_deepep_buffer_is_refused_naming_what_it_lacks():
    with pytest.raises(
        TypeError, match=r"got LocalDispatcher, which lacks \[.*'capture'.* of the v2 buffer's API"
    ):
        DeepEPDispatcher(LocalDispatcher(8), num_experts=8, top_k=2, hidden_size=128)
    with pytest.raises(TypeError, match="got object"):
        deepep_api_of(object())
