"""Compiles every default profile with CUTE_DSL_KEEP=cubin and counts HGMMA in each cubin's SASS.

    CUTE_DSL_KEEP=cubin CUTE_DSL_DUMP_DIR=DIR python sass_check.py DIR
(needs cuobjdump or nvdisasm on PATH, or under CUDA_HOME/bin)
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import torch
from megamoe_kernels import default_knobs, down, gate_up_swiglu, interleave_gate_up
from megamoe_kernels.shim.knobs import PROFILE_ROWS_PER_EXPERT


def main(dump_dir: str) -> int:
    os.makedirs(dump_dir, exist_ok=True)
    meta = {"device": "meta", "dtype": torch.bfloat16}
    experts, hidden, intermediate = 8, 2880, 2880
    for rows_per_expert in PROFILE_ROWS_PER_EXPERT:
        capacity = rows_per_expert * experts
        offsets = torch.empty(experts + 1, dtype=torch.int32, device="meta")
        w13 = interleave_gate_up(torch.empty(experts, 2 * intermediate, hidden, **meta))
        hidden_MI = gate_up_swiglu(
            torch.empty(capacity, hidden, **meta),
            offsets,
            w13,
            knobs=default_knobs("gate_up", rows_per_expert),
            compile_only=True,
        )
        down(
            hidden_MI,
            offsets,
            torch.empty(experts, hidden, intermediate, **meta),
            knobs=default_knobs("down", rows_per_expert),
            compile_only=True,
        )
    tool = shutil.which("cuobjdump") or os.path.join(
        os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump"
    )
    failures = 0
    for cubin in sorted(glob.glob(os.path.join(dump_dir, "*.cubin"))):
        sass = subprocess.run([tool, "--dump-sass", cubin], capture_output=True, text=True).stdout
        hgmma = sum("HGMMA" in line for line in sass.splitlines())
        kinds = sorted(
            {
                word
                for line in sass.splitlines()
                for word in line.split()
                if word.startswith("HGMMA.")
            }
        )
        print(f"{hgmma:5d} HGMMA {kinds[:2]} {os.path.basename(cubin)[:90]}")
        failures += hgmma == 0
    return failures


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
