"""Every default profile's SASS, and the pingpong and cluster variants', holds HGMMA (wgmma):
without it a kernel is on a slow path. The decode (swap-AB) kernels, and only they, load their
weights evict-first, and no kernel spills registers to local memory past the few it is known to."""

import subprocess
import sys

import pytest
from megamoe_kernels.sass_check import (
    disassembler_bin_dir,
    local_memory_stores,
    strong_gpu_loads,
)

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


def test_spill_stores_are_counted_by_instruction():
    sass = """
        /*0a10*/                   STL.64 [R1+0x8], R4 ;
        /*0a20*/                   STL [R1], R2 ;
        /*0a30*/                   LDL R3, [R1] ;
        /*0a40*/                   STG.E desc[UR4][R2.64], R5 ;
        /*0a50*/                   UTMASTG.2D [UR8], [UR4] ;
    """
    assert local_memory_stores(sass) == 2
    assert local_memory_stores("STS [R2], R3 ;") == 0


def test_acquire_polls_are_counted_by_instruction():
    sass = """
        /*0430*/                   LDG.E.STRONG.GPU R4, desc[UR4][R8.64+0x204] ;
        /*0440*/                   CCTL.IVALL ;
        /*0450*/                   LDG.E.64.STRONG.GPU R6, desc[UR4][R2.64] ;
        /*0460*/                   LDG.E R5, desc[UR4][R2.64] ;
        /*0470*/                   STG.E.STRONG.GPU desc[UR4][R2.64], R3 ;
    """
    assert strong_gpu_loads(sass) == 2
    assert strong_gpu_loads("LDG.E.CONSTANT R3, desc[UR4][R2.64] ;") == 0
