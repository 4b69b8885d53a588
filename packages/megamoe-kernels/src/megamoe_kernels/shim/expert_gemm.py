"""Stable API of the expert grouped GEMMs: checks, weight transform, compile cache, launch.

Shape legend: M batch rows (capacity), E experts, H hidden size, I intermediate size,
B = I / GATE_UP_BLOCK pair blocks. The batch is tight and expert-major: expert e owns rows
[expert_offsets[e], expert_offsets[e + 1]) (int32, on the GPU, never read here).

- `interleave_gate_up(w13_E2IH)` -> `w13_EB2GH` ([E, B, 2 * GATE_UP_BLOCK, H]): the layout the
  gate-up kernel takes; the kernel refuses anything else (a plain [E, 2I, H] w13 included).
- `gate_up_swiglu(rows_MH, expert_offsets, w13_EB2GH)` -> [M, I] = silu(x Wg^T) * (x Wu^T).
- `down(hidden_MI, expert_offsets, w2_EHI, row_scale_M=None)` -> [M, H].
Rows past expert_offsets[E] of an output are left as they were (unspecified).

Compiled kernels are cached by (op, knobs, dtype, weight shape): the capacity is a dynamic dim,
so one kernel serves every batch size. A launch passes raw data pointers and the row count
(shim/pointer_launch.py): nothing is converted per call and nothing is held after it. Kernels run
on torch's current stream, so CUDA-graph capture records them.
"""

from __future__ import annotations

import os
import threading

import torch

from megamoe_kernels.drop.gate_up_layout import GATE_UP_BLOCK, interleaved_source_row
from megamoe_kernels.shim.knobs import GemmKnobs, resolve_knobs

_COMPILE_LOCK = threading.Lock()
_COMPILED: dict[tuple, object] = {}
_SUPPORTED_DTYPES = (torch.bfloat16,)
_DEFAULT_SM_COUNT = 132  # H200; only used when compiling without a GPU


def interleave_gate_up(w13_E2IH: torch.Tensor) -> torch.Tensor:
    """[E, 2I, H] (gate rows, then up rows) -> [E, I / 8, 16, H]: blocks of 8 gate rows, each
    followed by its 8 up rows. Run once at load; the source can be released afterwards."""
    if w13_E2IH.dim() != 3 or w13_E2IH.shape[1] % (2 * GATE_UP_BLOCK):
        raise ValueError(
            f"w13 must be [E, 2I, H] with I a multiple of {GATE_UP_BLOCK}, got "
            f"{tuple(w13_E2IH.shape)}"
        )
    experts, two_intermediate, hidden = w13_E2IH.shape
    source_rows = interleaved_source_row(
        torch.arange(two_intermediate, device=w13_E2IH.device), two_intermediate // 2
    )
    return (
        w13_E2IH.index_select(1, source_rows)
        .reshape(experts, two_intermediate // (2 * GATE_UP_BLOCK), 2 * GATE_UP_BLOCK, hidden)
        .contiguous()
    )


def _check_common(name: str, tensor: torch.Tensor, *, dim: int, device: torch.device) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, the batch rows on {device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")
    if tensor.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned, got address {tensor.data_ptr():#x}")


def _check_batch(rows_MK: torch.Tensor, expert_offsets: torch.Tensor, num_experts: int) -> None:
    device = rows_MK.device
    _check_common("rows", rows_MK, dim=2, device=device)
    if rows_MK.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"rows must be one of {_SUPPORTED_DTYPES}, got {rows_MK.dtype}")
    if rows_MK.shape[1] % 8:
        raise ValueError(
            f"rows' last dim (K={rows_MK.shape[1]}) must be a multiple of 8 (16-byte TMA strides)"
        )
    if expert_offsets.dtype != torch.int32 or expert_offsets.dim() != 1:
        raise TypeError(
            f"expert_offsets must be 1-D int32, got {expert_offsets.dtype} "
            f"{tuple(expert_offsets.shape)}"
        )
    if expert_offsets.device != device or not expert_offsets.is_contiguous():
        raise ValueError("expert_offsets must be contiguous and on the rows' device")
    if expert_offsets.numel() != num_experts + 1:
        raise ValueError(
            f"expert_offsets has {expert_offsets.numel()} entries; the weights hold "
            f"{num_experts} experts, so {num_experts + 1} are needed"
        )


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SM_COUNT


def _cute_dtype(dtype: torch.dtype):
    import cutlass

    return {
        torch.bfloat16: cutlass.BFloat16,
        torch.int32: cutlass.Int32,
        torch.float32: cutlass.Float32,
    }[dtype]


def _stream(device: torch.device, fake: bool):
    if fake:
        from cutlass.cute.runtime import make_fake_stream

        return make_fake_stream()
    import cuda.bindings.driver as cuda_driver

    return cuda_driver.CUstream(torch.cuda.current_stream(device).cuda_stream)


def _run(
    op: str,
    knobs: GemmKnobs,
    *,
    x_MK: torch.Tensor,
    w_NKE: torch.Tensor,
    out_MN: torch.Tensor,
    expert_offsets: torch.Tensor,
    row_scale_M: torch.Tensor | None,
    compile_only: bool,
) -> None:
    fake = compile_only or x_MK.device.type != "cuda"
    if not torch.cuda.is_available():
        # without a GPU CuTe DSL guesses another architecture; must be set before it is imported
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    # one persistent CTA per SM: CTAs beyond the routed tiles find no work and exit
    num_ctas = _sm_count(x_MK.device)
    # the capacity is dynamic: the compiled kernel depends on the weights' shape only
    key = (
        op,
        knobs,
        x_MK.dtype,
        x_MK.shape[1],
        tuple(w_NKE.shape),
        tuple(w_NKE.stride()),
        out_MN.shape[1],
        row_scale_M is not None,
        num_ctas,
        fake,
    )
    # the launcher rebuilds the tensors from pointers: they must have the layouts it assumes
    k, n = x_MK.shape[1], w_NKE.shape[0]
    assert w_NKE.stride() == (k, 1, n * k), w_NKE.stride()
    assert x_MK.is_contiguous() and out_MN.is_contiguous() and expert_offsets.is_contiguous()
    args = _pointer_args(x_MK, w_NKE, out_MN, expert_offsets, row_scale_M, fake=fake)
    stream = _stream(x_MK.device, fake)
    compiled = _COMPILED.get(key)
    if compiled is None:
        with _COMPILE_LOCK:
            compiled = _COMPILED.get(key)
            if compiled is None:
                compiled = _compile(op, knobs, num_ctas, args, stream, shapes=(x_MK, w_NKE, out_MN))
                _COMPILED[key] = compiled
    if not fake:
        compiled(*args, stream)


def _pointer_args(x_MK, w_NKE, out_MN, expert_offsets, row_scale_M, *, fake: bool) -> list:
    """Data pointers and the row count: all a launch passes (nothing held, nothing converted)."""
    from cutlass import Int32

    from megamoe_kernels.shim.pointer_launch import pointer

    def address(tensor):
        # compiling without a GPU: any aligned address will do, nothing is dereferenced
        return 16 if fake else tensor.data_ptr()

    return [
        pointer("bfloat16", address(x_MK)),
        pointer("bfloat16", address(w_NKE)),
        pointer("bfloat16", address(out_MN)),
        pointer("int32", address(expert_offsets)),
        None if row_scale_M is None else pointer("float32", address(row_scale_M)),
        Int32(x_MK.shape[0]),
    ]


def _compile(op, knobs, num_ctas, args, stream, *, shapes):
    import cutlass.cute as cute

    from megamoe_kernels.drop.expert_gemm_sm90 import ExpertGroupedGemmSm90
    from megamoe_kernels.shim.pointer_launch import PointerLaunch

    x_MK, w_NKE, out_MN = shapes
    kernel = ExpertGroupedGemmSm90(
        tile_rows=knobs.tile_rows,
        tile_cols=knobs.tile_cols,
        stages=knobs.stages,
        swap_ab=knobs.swap_ab,
        swiglu=op == "gate_up",
        row_scale=args[4] is not None,
        rows_fastest=knobs.rows_fastest,
        num_ctas=num_ctas,
    )
    launch = PointerLaunch(
        kernel,
        k=x_MK.shape[1],
        n=w_NKE.shape[0],
        experts=w_NKE.shape[2],
        n_out=out_MN.shape[1],
        has_row_scale=args[4] is not None,
    )
    return cute.compile(launch, *args, stream)


def _rows_per_expert(capacity: int, experts: int) -> float:
    return capacity / max(1, experts)


def gate_up_swiglu(
    rows_MH: torch.Tensor,
    expert_offsets: torch.Tensor,
    w13_EB2GH: torch.Tensor,
    *,
    out_MI: torch.Tensor | None = None,
    knobs: GemmKnobs | None = None,
    compile_only: bool = False,
) -> torch.Tensor:
    """silu(x Wg^T) * (x Wu^T) per expert, bf16 out, fp32 accumulation."""
    if (
        not isinstance(w13_EB2GH, torch.Tensor)
        or w13_EB2GH.dim() != 4
        or w13_EB2GH.shape[2] != 2 * GATE_UP_BLOCK
    ):
        shape = tuple(w13_EB2GH.shape) if isinstance(w13_EB2GH, torch.Tensor) else w13_EB2GH
        raise ValueError(
            f"w13 must be the interleaved [E, I/{GATE_UP_BLOCK}, {2 * GATE_UP_BLOCK}, H] layout "
            f"from interleave_gate_up(w13_E2IH), got shape {shape}"
        )
    experts, blocks, _, hidden = w13_EB2GH.shape
    _check_batch(rows_MH, expert_offsets, experts)
    _check_common("w13", w13_EB2GH, dim=4, device=rows_MH.device)
    if w13_EB2GH.dtype != rows_MH.dtype or hidden != rows_MH.shape[1]:
        raise ValueError(
            f"w13 {w13_EB2GH.dtype} [..., H={hidden}] does not match rows {rows_MH.dtype} "
            f"[M, H={rows_MH.shape[1]}]"
        )
    intermediate = blocks * GATE_UP_BLOCK
    capacity = rows_MH.shape[0]
    if out_MI is None:
        out_MI = rows_MH.new_empty(capacity, intermediate)
    elif tuple(out_MI.shape) != (capacity, intermediate) or out_MI.dtype != rows_MH.dtype:
        raise ValueError(f"out_MI must be {rows_MH.dtype} [{capacity}, {intermediate}]")
    knobs = resolve_knobs("gate_up", _rows_per_expert(capacity, experts), knobs)
    if capacity == 0:
        return out_MI
    w_NKE = w13_EB2GH.view(experts, 2 * intermediate, hidden).permute(1, 2, 0)
    _run(
        "gate_up",
        knobs,
        x_MK=rows_MH,
        w_NKE=w_NKE,
        out_MN=out_MI,
        expert_offsets=expert_offsets,
        row_scale_M=None,
        compile_only=compile_only,
    )
    return out_MI


def down(
    hidden_MI: torch.Tensor,
    expert_offsets: torch.Tensor,
    w2_EHI: torch.Tensor,
    *,
    row_scale_M: torch.Tensor | None = None,
    out_MH: torch.Tensor | None = None,
    knobs: GemmKnobs | None = None,
    compile_only: bool = False,
) -> torch.Tensor:
    """x W2^T per expert, each row optionally multiplied by row_scale_M (float32, [M])."""
    _check_common("w2", w2_EHI, dim=3, device=hidden_MI.device)
    experts, hidden, intermediate = w2_EHI.shape
    _check_batch(hidden_MI, expert_offsets, experts)
    if w2_EHI.dtype != hidden_MI.dtype or intermediate != hidden_MI.shape[1]:
        raise ValueError(
            f"w2 {w2_EHI.dtype} [E, H, I={intermediate}] does not match rows {hidden_MI.dtype} "
            f"[M, I={hidden_MI.shape[1]}]"
        )
    if hidden % 8:
        raise ValueError(f"w2's H={hidden} must be a multiple of 8 (16-byte vector stores)")
    capacity = hidden_MI.shape[0]
    if row_scale_M is not None:
        _check_common("row_scale_M", row_scale_M, dim=1, device=hidden_MI.device)
        if row_scale_M.dtype != torch.float32 or row_scale_M.shape[0] != capacity:
            raise ValueError(
                f"row_scale_M must be float32 [{capacity}], got {row_scale_M.dtype} "
                f"{tuple(row_scale_M.shape)}"
            )
    if out_MH is None:
        out_MH = hidden_MI.new_empty(capacity, hidden)
    elif tuple(out_MH.shape) != (capacity, hidden) or out_MH.dtype != hidden_MI.dtype:
        raise ValueError(f"out_MH must be {hidden_MI.dtype} [{capacity}, {hidden}]")
    knobs = resolve_knobs("down", _rows_per_expert(capacity, experts), knobs)
    if capacity == 0:
        return out_MH
    _run(
        "down",
        knobs,
        x_MK=hidden_MI,
        w_NKE=w2_EHI.permute(1, 2, 0),
        out_MN=out_MH,
        expert_offsets=expert_offsets,
        row_scale_M=row_scale_M,
        compile_only=compile_only,
    )
    return out_MH


def cached_kernel_count() -> int:
    return len(_COMPILED)
