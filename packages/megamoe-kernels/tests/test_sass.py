"""Every default profile's SASS, and the pingpong and cluster variants', holds HGMMA (wgmma): without it a
kernel is on a slow path. The decode (swap-AB) kernels, and only they, load their weights
evict-first."""

import subprocess
import sys

import pytest
from megamoe_kernels.sass_check import disassembler_bin_dir

pytestmark = pytest.mark.compile


@pytest.mark.skipif(disassembler_bin_dir() is None, reason="needs cuobjdump and nvdisasm")
def test_every_default_profile_emits_hgmma(tmp_path):
    pytest.importorskip("cutlass")
    # a process of its own: CuTe DSL reads its dump settings once per process
    result = subprocess.run(
        [sys.executable, "-m", "megamoe_kernels.sass_check", "--dump-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout and result.stdout.count("ok  ") >= 2, result.stdout
