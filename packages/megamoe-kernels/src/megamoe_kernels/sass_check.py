"""Checks that every default kernel profile, and each kernel variant no profile picks (pingpong,
2-CTA clusters, split-K, FP8 on packed weights, decode gate-ups that poll for published
offsets), compiles to wgmma: its SASS must hold HGMMA, or for the FP8 ops QGMMA
with e4m3 inputs (the SASS name of an FP8 wgmma), and a polling gate-up an acquire load
(LDG.E.STRONG.GPU: its poll of the offsets' word). Also that the decode (swap-AB) kernels, and
only they, load with an L2 cache policy (their evict-first weight loads: a TMA load whose
`desc[...]` operand names a register, where a load without a policy names URZ), and that no
kernel spills more registers to local memory (STL in its SASS) than KNOWN_SPILL_STORES records
for it: a spilled value is a round trip through the L1, and one in a K loop would cost every
step.

    python -m megamoe_kernels.sass_check [--dump-dir DIR]

Compiles each default profile of the four ops for sm_90a (no GPU needed), keeps each cubin, and
disassembles it with cuobjdump (which needs nvdisasm beside it: the `nvidia-cuda-cuobjdump` and
`nvidia-cuda-nvdisasm` wheels, the CUDA toolkit, or CUDA_HOME/bin). Exits non-zero when a kernel
lacks them (it would run on a slow path whatever its tests say) or no tool is found.
CuTe DSL reads CUTE_DSL_KEEP/CUTE_DSL_DUMP_DIR once per process: run it in a process of its own.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

# one gate-up (2I x H) and one down (H x I) shape per profile; 2880 also compiles masked tiles
EXPERTS, HIDDEN, INTERMEDIATE = 8, 2880, 2880
# FP8: I a multiple of the 128-row weight block; H = 16.5 K tiles (a partial last one)
FP8_HIDDEN, FP8_INTERMEDIATE = 2112, 1408
# FP8 packed weights: whole packets
PACKED_HIDDEN, PACKED_INTERMEDIATE = 2048, 768


def packed_meta(n: int, k: int):
    """A meta tensor in the packed layout of an e4m3 [EXPERTS, n, k] weight."""
    import torch

    from megamoe_kernels import FP8_DTYPE
    from megamoe_kernels.shim.weight_packets import PACKET_ROWS, packet_strides

    strides = packet_strides(FP8_DTYPE, EXPERTS, n, k)
    shape = (EXPERTS, n // PACKET_ROWS, k // strides[3], PACKET_ROWS, strides[3])
    return torch.empty_strided(shape, strides, dtype=FP8_DTYPE, device="meta")


def disassembler_bin_dir() -> Path | None:
    """A folder holding both cuobjdump and nvdisasm, or None."""
    candidates = [Path(p) for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    candidates.append(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin")
    try:
        import nvidia

        candidates += [Path(p) / "cu13" / "bin" for p in nvidia.__path__]
    except ImportError:
        pass
    for folder in candidates:
        if (folder / "cuobjdump").is_file() and (folder / "nvdisasm").is_file():
            return folder
    return None


def disassembly(cubin: Path, tools: Path) -> str:
    """The SASS of a cubin (cuobjdump --dump-sass)."""
    env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ.get('PATH', '')}"}
    result = subprocess.run(
        [str(tools / "cuobjdump"), "--dump-sass", str(cubin)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return result.stdout


def hgmma_shapes(sass: str) -> list[str]:
    """The wgmma instructions (HGMMA, QGMMA) of a disassembly, each shape once."""
    return sorted(
        {
            word
            for line in sass.splitlines()
            for word in line.split()
            if word.startswith(("HGMMA.", "QGMMA."))
        }
    )


def loads_with_cache_policy(sass: str) -> int:
    """How many TMA loads (UTMALDG) of a disassembly carry an L2 cache policy."""
    return len(re.findall(r"UTMALDG\S* .*desc\[UR\d+\]", sass))


# Spill stores each kernel is known to hold, each looked at in its SASS; any other kernel
# holds none. The FP8 gate-up's 64 x 256 prefill tile (one consumer warpgroup at 232
# registers, its running sum and a weight block's products taking 192 of them) stores two
# 64-bit values after zeroing its accumulators at a tile's start and loads them back about
# twenty instructions later: 16 bytes a tile, none in its K loop.
KNOWN_SPILL_STORES = {"gate_up_fp8-rows32-64x256": 2}


def strong_gpu_loads(sass: str) -> int:
    """How many loads at GPU scope that no cache serves stale (LDG.E.STRONG.GPU: an acquire
    poll's) a disassembly holds."""
    return len(re.findall(r"\bLDG\.E(?:\.\S+)?\.STRONG\.GPU\b", sass))


def local_memory_stores(sass: str) -> int:
    """How many stores to local memory (STL: register spills) a disassembly holds."""
    return len(re.findall(r"\bSTL(?:\.\S+)? ", sass))


def variants_to_check() -> list[tuple[str, str, object, int]]:
    """(label, op, knobs, rows per expert): every default profile and the decode down tiles
    that widen (beside the gate-up; FP8 past one wave), plus the pingpong, 2-CTA cluster,
    tail-row and split-K decode variants, which no profile picks but a tuner may."""
    from megamoe_kernels import GemmKnobs, default_knobs, default_launches
    from megamoe_kernels.shim.expert_gemm import DEFAULT_SM_COUNT
    from megamoe_kernels.shim.knobs import PROFILE_ROWS_PER_EXPERT, max_stages

    variants = [
        (f"rows{rows}", op, default_knobs(op, rows), rows)
        for rows in PROFILE_ROWS_PER_EXPERT
        for op in ("gate_up", "down", "gate_up_fp8", "down_fp8")
    ]
    tuned = (
        GemmKnobs(tile_rows=64, tile_cols=256, pingpong=True),
        GemmKnobs(tile_rows=128, tile_cols=256, cluster=(2, 1)),
        GemmKnobs(tile_rows=128, tile_cols=256, tail_rows=16),
    )
    variants += [
        ("tuned", op, replace(knobs, stages=max_stages(knobs, op)), 512)
        for knobs in tuned
        for op in ("gate_up", "down")
    ]
    variants += [
        ("split4", op, replace(default_knobs(op, 1), split_k=4), 1) for op in ("gate_up", "down")
    ]
    # the wider decode down tile that fits beside its gate-up (dsv3, 8-way EP rank, 1 token)
    (beside,) = default_launches("down", 1, 32, weight_dims=(7168, 2048), sms=DEFAULT_SM_COUNT)
    variants.append(("beside-gate-up", "down", beside.knobs, 1))
    # the FP8 decode down tile that widens past one wave (qwen3-30b-a3b, 1 token)
    (wide_fp8,) = default_launches(
        "down_fp8", 8, 128, weight_dims=(2048, 768), sms=DEFAULT_SM_COUNT
    )
    variants.append(("wide-fp8", "down_fp8", wide_fp8.knobs, 1))
    # packed weights (their FP8 kernels prefetch the scales): a decode and a prefill profile
    variants += [
        ("packed", op, default_knobs(op, rows), rows)
        for rows in (1, 512)
        for op in ("gate_up_fp8", "down_fp8")
    ]
    # decode gate-ups polling for the offsets the routing kernel publishes (the profile's at one
    # token: knobs.GATE_UP_POLLS_OFFSETS_MAX_TOKENS)
    variants += [("polls", op, default_knobs(op, 1), 1) for op in ("gate_up", "gate_up_fp8")]
    # down GEMMs adding their rows into the tokens' rows (the atomic combine): a decode and a
    # prefill profile
    variants += [
        ("reduces", op, default_knobs(op, rows), rows)
        for rows in (1, 512)
        for op in ("down", "down_fp8")
    ]
    return variants


def compile_profiles(dump_dir: Path) -> dict[str, list[Path]]:
    """Compiles every variant to check; returns the cubins of each, by a readable name."""
    import torch

    from megamoe_kernels import (
        FP8_DTYPE,
        default_launches,
        down,
        down_fp8_launcher,
        gate_up_fp8_launcher,
        gate_up_swiglu,
        interleave_gate_up,
    )
    from megamoe_kernels.shim.expert_gemm import DEFAULT_SM_COUNT, published_offsets_buffer
    from megamoe_kernels.shim.knobs import intermediate_group
    from megamoe_kernels.shim.weight_packets import stored_shape_dims

    meta = {"device": "meta", "dtype": torch.bfloat16}
    fp8_meta = {"device": "meta", "dtype": FP8_DTYPE}
    offsets = torch.empty(EXPERTS + 1, dtype=torch.int32, device="meta")
    # as the routing kernel that publishes them leaves them: the word it publishes them in after
    published_offsets = published_offsets_buffer(EXPERTS + 1, device="meta")
    w13 = interleave_gate_up(torch.empty(EXPERTS, 2 * INTERMEDIATE, HIDDEN, **meta))
    w2 = torch.empty(EXPERTS, HIDDEN, INTERMEDIATE, **meta)
    w13_fp8 = torch.empty(EXPERTS, 2 * FP8_INTERMEDIATE // 16, 16, FP8_HIDDEN, **fp8_meta)
    w2_fp8 = torch.empty(EXPERTS, FP8_HIDDEN, FP8_INTERMEDIATE, **fp8_meta)
    # packed: whole packets (N a multiple of 256, K of the 128-value K tile)
    packed_fp8 = {
        "gate_up_fp8": packed_meta(2 * PACKED_INTERMEDIATE, PACKED_HIDDEN),
        "down_fp8": packed_meta(PACKED_HIDDEN, PACKED_INTERMEDIATE),
    }
    packed_rows = {"gate_up_fp8": PACKED_HIDDEN, "down_fp8": PACKED_INTERMEDIATE}

    def gate_up_fp8(rows, offsets, weight, *, knobs, compile_only, offsets_published=False):
        return gate_up_fp8_launcher(
            rows,
            offsets,
            weight,
            knobs=knobs,
            compile_only=compile_only,
            offsets_published=offsets_published,
        )

    def down_fp8(rows, offsets, weight, *, knobs, compile_only, row_source_M=None):
        # on the scale groups the default gate-up of the same batch writes
        _, hidden, intermediate = stored_shape_dims(weight.shape)
        gate_up = default_launches(
            "gate_up_fp8",
            rows.shape[0],
            EXPERTS,
            weight_dims=(2 * intermediate, hidden),
            sms=DEFAULT_SM_COUNT,
        )
        return down_fp8_launcher(
            rows,
            offsets,
            weight,
            knobs=knobs,
            compile_only=compile_only,
            x_group=intermediate_group(gate_up, intermediate),
            row_source_M=row_source_M,
        )

    gemms = {
        "gate_up": (gate_up_swiglu, HIDDEN, w13, meta),
        "down": (down, INTERMEDIATE, w2, meta),
        "gate_up_fp8": (gate_up_fp8, FP8_HIDDEN, w13_fp8, fp8_meta),
        "down_fp8": (down_fp8, FP8_INTERMEDIATE, w2_fp8, fp8_meta),
    }
    cubins = {}
    seen = set()
    for label, op, knobs, rows_per_expert in variants_to_check():
        capacity = rows_per_expert * EXPERTS
        # compiled already (capacity is dynamic)? Packed, polling and reducing variants are
        # kernels of their own
        kind = (op, knobs, label if label in ("packed", "polls", "reduces") else None)
        if kind in seen:
            continue
        seen.add(kind)
        gemm, width, weight, rows_meta = gemms[op]
        if label == "packed":
            width, weight = packed_rows[op], packed_fp8[op]
        options = {"offsets_published": True} if label == "polls" else {}
        if label == "reduces":
            options["row_source_M"] = torch.empty(capacity, dtype=torch.int32, device="meta")
            if op == "down":  # the call, not only its launcher: it takes the tokens' rows
                options["out_MH"] = torch.empty(capacity, HIDDEN, **meta)
        gemm(
            torch.empty(capacity, width, **rows_meta),
            published_offsets if label == "polls" else offsets,
            weight,
            knobs=knobs,
            compile_only=True,
            **options,
        )
        # cubin names do not carry the knobs: move each away before the next compile
        variant = "-swap" if knobs.swap_ab else "-pingpong" if knobs.pingpong else ""
        variant += "-cluster2" if knobs.cluster != (1, 1) else ""
        variant += f"-tail{knobs.tail_rows}" if knobs.tail_rows else ""
        name = f"{op}-{label}-{knobs.tile_rows}x{knobs.tile_cols}{variant}"
        target = dump_dir / name
        target.mkdir(exist_ok=True)
        cubins[name] = [Path(shutil.move(str(cubin), target)) for cubin in dump_dir.glob("*.cubin")]
    return cubins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megamoe_kernels.sass_check", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--dump-dir", help="where to keep the cubins (default: a temporary folder)")
    args = parser.parse_args(argv)
    tools = disassembler_bin_dir()
    if tools is None:
        print(
            "no folder holds both cuobjdump and nvdisasm: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm"
        )
        return 2
    dump_dir = Path(args.dump_dir or tempfile.mkdtemp(prefix="megamoe-sass-"))
    dump_dir.mkdir(parents=True, exist_ok=True)
    os.environ["CUTE_DSL_KEEP"] = "cubin"
    os.environ["CUTE_DSL_DUMP_DIR"] = str(dump_dir)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    failures = 0
    for name, cubins in compile_profiles(dump_dir).items():
        sass = [disassembly(cubin, tools) for cubin in cubins]
        shapes = sorted({shape for text in sass for shape in hgmma_shapes(text)})
        ok = bool(cubins) and bool(shapes)
        if "_fp8-" in name:
            ok = ok and all(shape.startswith("QGMMA.") and "E4M3" in shape for shape in shapes)
        evict_first = any(loads_with_cache_policy(text) for text in sass)
        spills = sum(local_memory_stores(text) for text in sass)
        known_spills = KNOWN_SPILL_STORES.get(name, 0)
        ok = ok and evict_first == ("-swap" in name) and spills <= known_spills
        polls = "-polls-" in name
        ok = ok and (not polls or any(strong_gpu_loads(text) for text in sass))
        failures += not ok
        loads = "evict-first weights" if evict_first else "default loads"
        spilled = f"{spills} spill stores (known: {known_spills})" if spills else "no spills"
        polled = "; polls the offsets (an acquire load)" if polls else ""
        print(
            f"{'ok  ' if ok else 'FAIL'} {name:<32} {', '.join(shapes) or 'no wgmma'}; {loads}; "
            f"{spilled}{polled}"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
