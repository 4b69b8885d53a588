"""Stable API of the expert grouped GEMMs: checks, weight transform, compile cache, launch.

Shape legend: M batch rows (capacity), E experts, H hidden size, I intermediate size,
B = I / GATE_UP_BLOCK pair blocks. The batch is tight and expert-major: expert e owns rows
[expert_offsets[e], expert_offsets[e + 1]) (int32, on the GPU, never read here).

- The gate-up kernel reads the interleaved order (gate_up_layout: blocks of GATE_UP_BLOCK gate
  rows, each followed by its up rows) from either of two layouts of w13: as the model holds it,
  [E, 2I, H] (gate rows, then up rows), through a view whose TMA boxes write the interleaved
  order into shared memory (no copy; a last tile past I's blocks is filled with zeros by the
  TMA and stores nothing there); or `interleave_gate_up(w13_E2IH)` -> `w13_EB2GH` ([E, B,
  2 * GATE_UP_BLOCK, H]), the copy in that order (the weight packets are made from it). Both
  give the same bits, for any I that is a multiple of GATE_UP_BLOCK.
- `gate_up_swiglu(rows_MH, expert_offsets, w13_EB2GH)` -> [M, I] = silu(x Wg^T) * (x Wu^T).
  `w13_bias_EB2G` (float32 [E, B, 2 * GATE_UP_BLOCK], from `interleave_gate_up_bias`) adds
  each expert's gate and up biases before the activation; `swiglu` (shim/epilogue.SwiGLU)
  picks the clamped variant gpt-oss computes. Both are compiled into the kernel variant.
  With `row_source_M` (int32 [M], the token of each batch row) the first argument is the
  tokens x_TH and the kernel gathers each row from its token (no expert-major copy of the
  tokens is made): the same bits as on rows_MH = x_TH[row_source_M].
- `down(hidden_MI, expert_offsets, w2_EHI, row_scale_M=None, w2_bias_EH=None)` -> [M, H]:
  (x W2^T + b2) x row scale, the bias float32 [E, H].
- FP8 (shim/fp8.py has the layouts and the host quantizers): `gate_up_swiglu_fp8(rows_MH,
  rows_scales, expert_offsets, w13_EB2GH, w13_scales)` -> (e4m3 [M, I], its scales
  [I / g, M]), the SwiGLU output quantized in the epilogue per g columns: 128 where every
  launch of the call runs 256-column prefill tiles, else 64 (knobs.intermediate_group; the
  launcher's `out_group`); `down_fp8(hidden_MI, hidden_scales, expert_offsets, w2_EHI,
  w2_scales, row_scale_M=None)` -> bf16 [M, H], the group told from the scales' shape (its
  launcher is bound for one: `x_group`). The weight scales are per 128 x 128 block of the
  weight before the gate/up interleave. The FP8 GEMMs are not built with biases or the
  clamped SwiGLU.
- Packed weights (`pack_weight_tiles`, shim/weight_packets.py) in place of w13_EB2GH or w2_EHI,
  with FP8 the scale words it returned in place of the weight scales: the same output bits;
  told from their 5-D shape and strides.
Rows past expert_offsets[E] of an output are left as they were (unspecified).
`offsets_published=True` (the gate-up ops): expert_offsets comes from the routing kernel
launched just before, which publishes them in the int32 word after them (RouteLauncher's
publish_offsets): the decode launches start loading their weights once it does, before that
kernel ends (knobs.polling_launches).
Masked batches (`expert_counts`, int32 [E] on the GPU, every op): expert e owns rows
[expert_offsets[e], expert_offsets[e] + expert_counts[e]) of a receive buffer with a stride per
expert; the other rows of each stride are neither read as data nor written.

Without knobs a call runs the default profile: one kernel, or, when the capacity asks for
prefill tiles, two (`default_launches`), launched from one host call: the one with decode tiles
works instead of the other on a batch of few valid rows, chosen on the device from
expert_offsets[E]. A caller that knows the valid rows on the host (`valid_rows`: a local batch
holds tokens x top-k) launches only the kernel for them.

Compiled kernels are cached by (op, the launches' knobs and valid-row ranges, weight shape, row
scale or not, bias or not, SwiGLU, device): the capacity is a dynamic dim, so one compile serves
every batch size. Each kind of call (op, knobs, shapes, valid rows, row scale or not, device) gets a
`GemmLauncher`, planned, checked and compiled once; `gate_up_launcher` / `down_launcher` hand it to
a caller that repeats the call, which then skips even the lookup. They are compiled for CuTe DSL's
TVM-FFI launch path (shim/ffi_launch.py): a launch hands the torch tensors to the compiled function,
which checks them against its signature in C and launches on torch's current stream (CUDA-graph
capture records it). Nothing is converted in Python and nothing is held after a call.

The Python checks (clear errors naming the argument) run when a kernel is compiled, when
compiling only, and when a launch fails; a launch that hits the cache relies on the compiled
signature, which refuses any tensor of another dtype, shape, layout, alignment or device.

Split-K variants also take a workspace: fp32 slices and int32 arrival counters, allocated once
per (device, stream, size), zeroed once and left zero by every launch, and never freed.
Launches on one stream run one after another, so they can share it. Prefill tiles without
clusters take their tiles from a counter (the drop's `dynamic_schedule`: the row tiles that
share a weight tile run at once, so its second read hits L2), kept the same way: two int32 per
(device, stream). Under CUDA-graph capture each capture makes its own, shared by its launches
and zeroed by fill kernels that each replay runs before the first of them (_stream_scratch), so
graphs replay in any order; the fill before a GEMM takes the place of the routing kernel's
programmatic dependency on it in the graph (0.4-0.7% of a prefill forward's replay,
docs/benchmarks.md, "Bucket graphs").
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import NoReturn

import torch

from megamoe_kernels.drop.gate_up_layout import GATE_UP_BLOCK, interleaved_source_row
from megamoe_kernels.drop.tiling import FP8_TILE_K, TILE_K
from megamoe_kernels.shim.epilogue import PLAIN_SWIGLU, SwiGLU
from megamoe_kernels.shim.fp8 import (
    ACTIVATION_GROUP,
    FP8_DTYPE,
    INTERMEDIATE_GROUP,
    WEIGHT_BLOCK,
    WIDE_INTERMEDIATE_GROUP,
    row_scales_buffer,
    weight_scales_shape,
)
from megamoe_kernels.shim.knobs import (
    GemmKnobs,
    Launch,
    default_launches,
    intermediate_group,
    is_fp8,
    is_gate_up,
    max_tiles,
    polling_launches,
    resolve_knobs,
    staged_scale_k_tiles,
)
from megamoe_kernels.shim.weight_packets import (
    PACKED_TILE_COLS,
    PACKET_ROWS,
    is_packed_shape,
    pack_problems,
    packed_dims,
    packed_scale_words,
    packet_strides,
    stored_shape_dims,
)

_COMPILE_LOCK = threading.Lock()
# key -> (the compiled launches, whether one of them takes the unit counter)
_COMPILED: dict[tuple, tuple[Callable, bool]] = {}
DEFAULT_SM_COUNT = 132  # H200; the SMs a kernel is compiled for without a GPU
_ALIGN_BYTES = 16  # TMA and 16-byte vector stores: every tensor's base address
# split-K is for decode batches: a workspace beyond this means the knobs do not fit the batch
_SPLIT_K_MAX_WORKSPACE_BYTES = 256 << 20
# scratch of the eager launches on a stream, by (device, stream, what)
_STREAM_SCRATCH: dict[tuple, object] = {}
# scratch of the capture a stream is in (or was in last), by (device, stream): (the capture's
# id, {what: scratch})
_CAPTURE_SCRATCH: dict[tuple, tuple[int, dict[tuple, object]]] = {}
# per thread: how many fresh_scratch() contexts are open
_FRESH_SCRATCH = threading.local()


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
    # e4m3 moves as bytes (index_select has no float8 kernel on every device)
    source = w13_E2IH.view(torch.uint8) if w13_E2IH.dtype == FP8_DTYPE else w13_E2IH
    return (
        source.index_select(1, source_rows)
        .reshape(experts, two_intermediate // (2 * GATE_UP_BLOCK), 2 * GATE_UP_BLOCK, hidden)
        .contiguous()
        .view(w13_E2IH.dtype)
    )


def _described(value) -> str:
    """What an argument is, for an error message: a tensor's dtype and shape, else its type."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {list(value.shape)}"
    return type(value).__name__


def _check_common(name: str, tensor: torch.Tensor, *, dim: int, device: torch.device) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(tensor.shape)}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, the batch rows on {device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")
    if tensor.data_ptr() % _ALIGN_BYTES:
        raise ValueError(
            f"{name} must be {_ALIGN_BYTES}-byte aligned, got address {tensor.data_ptr():#x}"
        )


def _check_batch(
    rows_MK: torch.Tensor, expert_offsets: torch.Tensor, num_experts: int, dtype: torch.dtype
) -> None:
    if not isinstance(rows_MK, torch.Tensor):
        raise TypeError(f"rows must be a torch.Tensor, got {type(rows_MK).__name__}")
    device = rows_MK.device
    _check_common("rows", rows_MK, dim=2, device=device)
    if rows_MK.dtype != dtype:
        raise TypeError(f"rows must be {dtype}, got {rows_MK.dtype}")
    multiple = 16 // dtype.itemsize
    if rows_MK.shape[1] % multiple:
        raise ValueError(
            f"rows' last dim (K={rows_MK.shape[1]}) must be a multiple of {multiple} (16-byte "
            "TMA strides)"
        )
    if (
        not isinstance(expert_offsets, torch.Tensor)
        or expert_offsets.dtype != torch.int32
        or expert_offsets.dim() != 1
    ):
        raise TypeError(
            f"expert_offsets must be a 1-D int32 tensor, got {_described(expert_offsets)}"
        )
    _check_common("expert_offsets", expert_offsets, dim=1, device=device)
    if expert_offsets.numel() != num_experts + 1:
        raise ValueError(
            f"expert_offsets has {expert_offsets.numel()} entries; the weights hold "
            f"{num_experts} experts, so {num_experts + 1} are needed"
        )


def _check_out(
    name: str,
    out: torch.Tensor | None,
    rows_MK: torch.Tensor,
    columns: int,
    dtype: torch.dtype,
    *,
    capacity: int | None = None,
) -> None:
    """out: `dtype` [capacity, columns] (capacity: the rows', unless given)."""
    if out is None:
        return
    capacity = rows_MK.shape[0] if capacity is None else capacity
    if (
        not isinstance(out, torch.Tensor)
        or tuple(out.shape) != (capacity, columns)
        or out.dtype != dtype
    ):
        raise ValueError(f"{name} must be {dtype} [{capacity}, {columns}]")
    _check_common(name, out, dim=2, device=rows_MK.device)


def _check_row_scales(
    name: str, scales: torch.Tensor, *, groups: int, rows: int, device, group: int
) -> None:
    """FP8 row scales: float32 [groups, rows] (one per row and `group` columns), rows
    contiguous (shim/fp8.row_scales_buffer)."""
    if (
        not isinstance(scales, torch.Tensor)
        or scales.dtype != torch.float32
        or tuple(scales.shape) != (groups, rows)
    ):
        got = _described(scales)
        raise ValueError(
            f"{name} must be float32 [{groups}, {rows}] (a scale per row and {group} "
            f"columns), got {got}"
        )
    if scales.device != device:
        raise ValueError(f"{name} is on {scales.device}, the batch rows on {device}")
    if scales.stride(1) != 1 or (groups > 1 and scales.stride(0) < rows):
        raise ValueError(
            f"{name} must have contiguous rows, one group after another "
            f"(fp8.row_scales_buffer makes one), got strides {scales.stride()}"
        )


def _check_weight_scales(
    name: str, scales: torch.Tensor, *, experts: int, n: int, k: int, device, packed_weight=None
) -> None:
    """FP8 weight scales: [E, N/128, K/128] float32, or with a packed weight its scale words'
    view of the same allocation."""
    if packed_weight is not None:
        words = packed_scale_words(packed_weight)
        if (
            not isinstance(scales, torch.Tensor)
            or scales.dtype != torch.float32
            or tuple(scales.shape) != words.shape
            or scales.stride() != words.stride()
            or scales.data_ptr() != words.data_ptr()
        ):
            raise ValueError(
                f"{name} of a packed weight must be the scale words pack_weight_tiles returned "
                f"beside it (float32 {list(words.shape)}, strides {words.stride()}, in the "
                f"weight's allocation), got {_described(scales)}"
            )
        return
    blocks = list(weight_scales_shape((experts, n, k)))
    if (
        not isinstance(scales, torch.Tensor)
        or scales.dtype != torch.float32
        or list(scales.shape) != blocks
    ):
        got = _described(scales)
        raise ValueError(
            f"{name} must be float32 [E, ceil(N/{WEIGHT_BLOCK}), ceil(K/{WEIGHT_BLOCK})] = "
            f"{blocks}, got {got}"
        )
    _check_common(name, scales, dim=3, device=device)


def can_gather_rows(hidden_size: int, dtype: torch.dtype) -> bool:
    """Whether the gate-up GEMM can read rows of this hidden size and dtype from the tokens
    (row_source_M): bf16 tokens of whole K tiles."""
    return dtype == torch.bfloat16 and hidden_size % TILE_K == 0


def _check_row_source(row_source_M, x_TH: torch.Tensor, hidden: int) -> int:
    """Gathered rows: row_source_M is int32 [M] beside bf16 tokens whose hidden size is a
    multiple of the K tile; returns M (the batch's capacity)."""
    if (
        not isinstance(row_source_M, torch.Tensor)
        or row_source_M.dtype != torch.int32
        or row_source_M.dim() != 1
    ):
        got = _described(row_source_M)
        raise TypeError(f"row_source_M must be a 1-D int32 tensor, got {got}")
    _check_common("row_source_M", row_source_M, dim=1, device=x_TH.device)
    if not can_gather_rows(hidden, x_TH.dtype):
        raise ValueError(
            f"gathered rows are bf16 tokens with H a multiple of {TILE_K} (whole K tiles), got "
            f"{x_TH.dtype} with H={hidden}; pass the expert-major rows instead"
        )
    return row_source_M.shape[0]


def _check_expert_counts(expert_counts, x_MK: torch.Tensor, experts: int) -> None:
    """A masked batch's counts: int32 [E] on the rows' device."""
    if (
        not isinstance(expert_counts, torch.Tensor)
        or expert_counts.dtype != torch.int32
        or tuple(expert_counts.shape) != (experts,)
    ):
        got = _described(expert_counts)
        raise TypeError(f"expert_counts must be int32 [{experts}] (one per expert), got {got}")
    _check_common("expert_counts", expert_counts, dim=1, device=x_MK.device)


def _check_bias(name: str, bias, *, shape: tuple[int, ...], device, made_by: str) -> None:
    """A per-expert bias: float32 of `shape`, contiguous and aligned, beside the rows."""
    if (
        not isinstance(bias, torch.Tensor)
        or bias.dtype != torch.float32
        or tuple(bias.shape) != shape
    ):
        got = _described(bias)
        raise ValueError(f"{name} must be float32 {list(shape)} ({made_by}), got {got}")
    _check_common(name, bias, dim=len(shape), device=device)


def _check_packed(
    name: str, weight: torch.Tensor, *, device, gate_up: bool
) -> tuple[int, int, int]:
    """A packed weight (shim/weight_packets.py): its dtype, packet shape and strides, device
    and alignment; returns its (E, N, K)."""
    experts, n, k = packed_dims(tuple(weight.shape))
    problems = pack_problems(weight.dtype, n, k, gate_up=gate_up)
    if problems:
        raise ValueError(f"{name} is packed but cannot be: " + "; ".join(problems))
    strides = packet_strides(weight.dtype, experts, n, k)
    if weight.shape[3] != PACKET_ROWS or weight.stride() != strides:
        raise ValueError(
            f"{name} packed must be [E, N/{PACKET_ROWS}, K tiles, {PACKET_ROWS}, K tile] with "
            f"strides {strides} (pack_weight_tiles makes it), got shape {tuple(weight.shape)} "
            f"and strides {weight.stride()}"
        )
    if weight.device != device:
        raise ValueError(f"{name} is on {weight.device}, the batch rows on {device}")
    if weight.data_ptr() % _ALIGN_BYTES:
        raise ValueError(
            f"{name} must be {_ALIGN_BYTES}-byte aligned, got address {weight.data_ptr():#x}"
        )
    return experts, n, k


def _check_gate_up(
    rows_MH, expert_offsets, w13_EB2GH, out_MI, *, fp8=False, row_source_M=None, bias=None
) -> None:
    """Every rule of gate_up_swiglu's arguments, with an error that names the argument (with
    row_source_M, rows_MH is the tokens the rows are gathered from)."""
    dtype = FP8_DTYPE if fp8 else torch.bfloat16
    packed = isinstance(w13_EB2GH, torch.Tensor) and is_packed_shape(w13_EB2GH.shape)
    if packed:
        if not isinstance(rows_MH, torch.Tensor):
            raise TypeError(f"rows must be a torch.Tensor, got {type(rows_MH).__name__}")
        experts, n, hidden = _check_packed("w13", w13_EB2GH, device=rows_MH.device, gate_up=True)
        blocks = n // (2 * GATE_UP_BLOCK)
    elif (
        isinstance(w13_EB2GH, torch.Tensor)
        and w13_EB2GH.dim() == 3
        and w13_EB2GH.shape[1] % (2 * GATE_UP_BLOCK) == 0
    ):
        experts, two_intermediate, hidden = w13_EB2GH.shape
        blocks = two_intermediate // (2 * GATE_UP_BLOCK)
    elif (
        not isinstance(w13_EB2GH, torch.Tensor)
        or w13_EB2GH.dim() != 4
        or w13_EB2GH.shape[2] != 2 * GATE_UP_BLOCK
    ):
        shape = tuple(w13_EB2GH.shape) if isinstance(w13_EB2GH, torch.Tensor) else w13_EB2GH
        raise ValueError(
            f"w13 must be [E, 2I, H] as the model holds it (gate rows, then up rows, I a "
            f"multiple of {GATE_UP_BLOCK}), the interleaved [E, I/{GATE_UP_BLOCK}, "
            f"{2 * GATE_UP_BLOCK}, H] layout from interleave_gate_up(w13_E2IH), or that packed "
            f"(pack_weight_tiles), got shape {shape}"
        )
    else:
        experts, blocks, _, hidden = w13_EB2GH.shape
    _check_batch(rows_MH, expert_offsets, experts, dtype)
    if not packed:
        _check_common("w13", w13_EB2GH, dim=w13_EB2GH.dim(), device=rows_MH.device)
    if w13_EB2GH.dtype != rows_MH.dtype or hidden != rows_MH.shape[1]:
        raise ValueError(
            f"w13 {w13_EB2GH.dtype} [..., H={hidden}] does not match rows {rows_MH.dtype} "
            f"[M, H={rows_MH.shape[1]}]"
        )
    intermediate = blocks * GATE_UP_BLOCK
    capacity = None
    if row_source_M is not None:
        if fp8:
            raise ValueError("row_source_M: gathered rows are bf16 (FP8 rows carry scales)")
        capacity = _check_row_source(row_source_M, rows_MH, hidden)
    if fp8 and intermediate % WEIGHT_BLOCK:
        raise ValueError(
            f"FP8 w13: I={intermediate} must be a multiple of {WEIGHT_BLOCK} (the gate and the up "
            "rows of a tile each lie in one weight block)"
        )
    _check_out("out_MI", out_MI, rows_MH, intermediate, dtype, capacity=capacity)
    if bias is not None:
        _check_bias(
            "w13_bias_EB2G",
            bias,
            shape=(experts, blocks, 2 * GATE_UP_BLOCK),
            device=rows_MH.device,
            made_by="interleave_gate_up_bias(w13_bias_E2I) makes it",
        )


def _check_down(
    hidden_MI,
    expert_offsets,
    w2_EHI,
    row_scale_M,
    out_MH,
    *,
    fp8=False,
    bias=None,
    row_source_M=None,
) -> None:
    """Every rule of down's arguments, with an error that names the argument."""
    if not isinstance(hidden_MI, torch.Tensor):
        raise TypeError(f"rows must be a torch.Tensor, got {type(hidden_MI).__name__}")
    if isinstance(w2_EHI, torch.Tensor) and is_packed_shape(w2_EHI.shape):
        experts, hidden, intermediate = _check_packed(
            "w2", w2_EHI, device=hidden_MI.device, gate_up=False
        )
    else:
        _check_common("w2", w2_EHI, dim=3, device=hidden_MI.device)
        experts, hidden, intermediate = w2_EHI.shape
    _check_batch(hidden_MI, expert_offsets, experts, FP8_DTYPE if fp8 else torch.bfloat16)
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
    if fp8 and intermediate % INTERMEDIATE_GROUP:
        raise ValueError(
            f"FP8 w2: I={intermediate} must be a multiple of {INTERMEDIATE_GROUP} (the "
            "intermediate's quantization group)"
        )
    if row_source_M is None:
        _check_out("out_MH", out_MH, hidden_MI, hidden, torch.bfloat16)
    else:
        _check_row_tokens(row_source_M, out_MH, hidden_MI, hidden=hidden)
    if bias is not None:
        _check_bias(
            "w2_bias_EH",
            bias,
            shape=(experts, hidden),
            device=hidden_MI.device,
            made_by="one bias per expert and output column; .float() of a bf16 one",
        )


def _check_row_tokens(row_source_M, out_TH, hidden_MI: torch.Tensor, *, hidden: int) -> None:
    """The down GEMM adding its rows into their tokens' rows: row_source_M int32 [M] (the
    batch's rows) and out_TH (None while a launcher is bound; a call gives it) bf16 [T, hidden],
    contiguous, beside the rows."""
    capacity = hidden_MI.shape[0]
    if (
        not isinstance(row_source_M, torch.Tensor)
        or row_source_M.dtype != torch.int32
        or tuple(row_source_M.shape) != (capacity,)
    ):
        got = _described(row_source_M)
        raise TypeError(
            f"row_source_M must be int32 [{capacity}] (the token of each batch row), got {got}"
        )
    _check_common("row_source_M", row_source_M, dim=1, device=hidden_MI.device)
    if out_TH is None:
        return
    if not isinstance(out_TH, torch.Tensor) or out_TH.dim() != 2:
        raise ValueError(
            f"out_MH must be the tokens' rows, bf16 [T, {hidden}], got {_described(out_TH)}"
        )
    _check_out("out_MH", out_TH, hidden_MI, hidden, torch.bfloat16, capacity=out_TH.shape[0])


def published_offsets_buffer(entries: int, *, device: torch.device | str) -> torch.Tensor:
    """Uninitialised int32 offsets of `entries` words, followed in their allocation by the word
    a routing kernel with publish_offsets publishes them in: the view of the offsets (what
    offsets_published=True takes)."""
    return torch.empty(entries + 1, dtype=torch.int32, device=device)[:entries]


def _check_published_offsets(op: str, expert_offsets) -> None:
    """offsets_published: a gate-up op's, with the word the routing kernel publishes them in
    (after the offsets) inside their storage."""
    if not is_gate_up(op):
        raise ValueError(f"offsets_published: the gate-up GEMMs poll for them; {op} does not")
    if not isinstance(expert_offsets, torch.Tensor) or expert_offsets.dtype != torch.int32:
        return  # the op's checks name it
    end = (expert_offsets.storage_offset() + expert_offsets.numel() + 1) * 4
    if not expert_offsets.is_contiguous() or expert_offsets.untyped_storage().nbytes() < end:
        raise ValueError(
            "offsets_published=True: expert_offsets must be contiguous and followed in its "
            "storage by the int32 word the routing kernel publishes them in (RouteLauncher "
            "with publish_offsets allocates them so: published_offsets_buffer)"
        )


def _raise_explained(failure: Exception, check: Callable[[], None]) -> NoReturn:
    """Re-raises a failed call's error as the check's error naming the argument at fault, or
    as it is when every argument passes (a CUDA error, invalid knobs)."""
    try:
        check()
    except (TypeError, ValueError) as explained:
        raise explained from failure
    raise failure


@cache
def _persistent_ctas(device_index: int, cluster_size: int) -> int:
    """CTAs of a persistent grid: one per SM, or as many clusters as fit on the GPU at once (a
    cluster that waited for SMs would run its tiles after everyone else's)."""
    if device_index < 0:
        return DEFAULT_SM_COUNT // cluster_size * cluster_size
    if cluster_size == 1:
        return torch.cuda.get_device_properties(device_index).multi_processor_count
    from cutlass.utils import HardwareInfo

    with torch.cuda.device(device_index):
        # the occupancy query runs in the thread's current CUDA context: make torch create it
        torch.cuda.synchronize()
        clusters = HardwareInfo(device_index).get_max_active_clusters(cluster_size)
    if clusters < 1:
        raise ValueError(
            f"cluster=({cluster_size}, 1): no cluster of {cluster_size} CTAs fits on GPU "
            f"{device_index} at once; use cluster=(1, 1)"
        )
    return clusters * cluster_size


def _split_k_workspace(
    knobs: GemmKnobs, x_MK: torch.Tensor, *, rows: int, experts: int, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials, arrivals) for a split-K launch on the current stream over a batch of `rows`
    rows (x_MK's, or the row source's when the rows are gathered)."""
    # a slot per tile the schedule can hold (a bound)
    slots = max_tiles(knobs, capacity=rows, experts=experts, columns=n)
    words = slots * knobs.split_k * knobs.tile_rows * knobs.tile_cols
    if words * 4 > _SPLIT_K_MAX_WORKSPACE_BYTES:
        raise ValueError(
            f"split_k={knobs.split_k} at capacity {rows} needs a {words * 4 >> 20} MiB "
            f"workspace (at most {_SPLIT_K_MAX_WORKSPACE_BYTES >> 20} MiB): split-K is for decode "
            "batches; use split_k=1 or a smaller capacity"
        )
    return _stream_scratch(
        x_MK.device,
        ("split_k", words, slots),
        lambda: (
            torch.empty(words, dtype=torch.float32, device=x_MK.device),
            torch.zeros(slots, dtype=torch.int32, device=x_MK.device),
        ),
    )


def _dynamic_schedule(knobs: GemmKnobs) -> bool:
    """Whether a kernel with `knobs` takes its tiles from the unit counter: prefill tiles
    without clusters (both CTAs of a cluster work one unit; decode batches have about a tile
    per CTA, where the counter's round trip would only add latency)."""
    return not knobs.swap_ab and tuple(knobs.cluster) == (1, 1)


def _unit_counter(x_MK: torch.Tensor) -> torch.Tensor:
    """The dynamic schedule's counter for launches on the current stream."""
    return _stream_scratch(
        x_MK.device,
        ("unit_counter",),
        lambda: torch.zeros(2, dtype=torch.int32, device=x_MK.device),
    )


def _current_stream_handle(device: torch.device) -> int:
    """The current stream's cudaStream_t as an int: torch's raw query, where
    torch.cuda.current_stream() would build a Stream object on every launch."""
    return torch._C._cuda_getCurrentRawStream(device.index)


def current_stream_handle(device: torch.device) -> int:
    """The current stream of `device` (an indexed CUDA device) as an int, cheaply: a key for
    buffers that launches on one stream share."""
    return _current_stream_handle(device)


@cache
def _cuda_available() -> bool:
    """Whether this torch has CUDA (a CPU build cannot ask whether a stream is capturing)."""
    return torch.cuda.is_available()


@contextmanager
def fresh_scratch() -> Iterator[None]:
    """Inside it, this thread's launches make their scratch anew for each call, and callers
    that keep buffers across calls (keeps_buffers()) make them anew too: for calls whose
    allocations must not outlive them, as in torch.compile's CUDA-graph trees, whose warm-up
    allocates from the graphs' pool and refuses pool memory that outlives the call."""
    _FRESH_SCRATCH.depth = getattr(_FRESH_SCRATCH, "depth", 0) + 1
    try:
        yield
    finally:
        _FRESH_SCRATCH.depth -= 1


def keeps_buffers() -> bool:
    """Whether a call may keep its buffers for the next call on its stream: not under CUDA-graph
    capture (the graph's pool owns what the capture allocates) nor inside fresh_scratch()."""
    if getattr(_FRESH_SCRATCH, "depth", 0):
        return False
    return not (_cuda_available() and torch.cuda.is_current_stream_capturing())


def _stream_scratch(device: torch.device, what: tuple, make: Callable[[], object]):
    """Scratch that launches leave as they found it, shared by the launches on the current
    stream (they run one after another): made by `make` on first use, then kept for good.

    Under CUDA-graph capture each capture has scratch of its own, made in it and shared by its
    launches: the fill that makes it (torch.zeros records one) runs at the start of each of
    that graph's replays, so a graph never reads what another graph left there or what a pool
    held before a capture that was never replayed (scratch shared by a stream's graphs would be
    zeroed by the first one's replays alone: a later graph replayed before it would read what
    the pool held, and the dynamic schedule's counter would take its tiles from there). It
    lives until the stream's next capture begins, past every launch of its own capture: freed
    within the capture, it would go back to the graph's pool, a later tensor of the graph (the
    down GEMM's output) could get its memory, and each replay's fill would overwrite rows a
    replay must leave as they were. Freed after it, it is memory of the finished graph's pool
    that the graph's replays fill before they read. Inside fresh_scratch() it is made anew for
    the call."""
    if getattr(_FRESH_SCRATCH, "depth", 0):
        return make()
    stream = _current_stream_handle(device)
    if _cuda_available() and torch.cuda.is_current_stream_capturing():
        capture = _capture_id(stream)
        held = _CAPTURE_SCRATCH.get((device, stream))
        if held is None or held[0] != capture:
            held = _CAPTURE_SCRATCH[(device, stream)] = (capture, {})
        scratch = held[1].get(what)
        if scratch is None:
            scratch = held[1][what] = make()
        return scratch
    key = (device, stream, what)
    scratch = _STREAM_SCRATCH.get(key)
    if scratch is None:
        scratch = _STREAM_SCRATCH[key] = make()
    return scratch


def _capture_id(stream: int) -> int:
    """The id of the capture sequence `stream` (a cudaStream_t as an int, capturing) is in,
    unique for the process's lifetime."""
    import cuda.bindings.driver as cuda_driver

    error, status, capture, *_ = cuda_driver.cuStreamGetCaptureInfo(cuda_driver.CUstream(stream))
    active = cuda_driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE
    if error != cuda_driver.CUresult.CUDA_SUCCESS or status != active:
        raise RuntimeError(
            f"stream {stream:#x} is capturing a CUDA graph, but cuStreamGetCaptureInfo answered "
            f"{error.name}, status {status.name}: the capture has been invalidated"
        )
    return int(capture)


def _gemm_dims(op: str, weight_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(N, K, output columns) of an op's GEMM from its stored weight's shape: gate-up
    [E, B, 16, H] has N = B x 16 weight rows, which SwiGLU halves; down [E, H, I] has N = H;
    a packed weight [E, N/128, K tiles, 128, K tile] its packets' rows and values."""
    _, n, k = stored_shape_dims(weight_shape)
    return n, k, n // 2 if is_gate_up(op) else n


def _check_split_k(op: str, knobs: GemmKnobs, k: int) -> None:
    tile_k = FP8_TILE_K if is_fp8(op) else TILE_K
    k_tiles = -(-k // tile_k)
    if knobs.split_k > k_tiles:
        raise ValueError(
            f"split_k={knobs.split_k} needs K >= {(knobs.split_k - 1) * tile_k + 1} (one K tile "
            f"of {tile_k} per slice), got K={k}"
        )


def _launches(
    op: str,
    knobs: GemmKnobs | None,
    tuned_knobs: GemmKnobs | None,
    x_shape: tuple[int, int],
    weight_shape: torch.Size,
    valid_rows: int | None,
    device_index: int,
    offsets_published: bool = False,
) -> tuple[Launch, ...]:
    """The kernels a call launches: one with `knobs` (checked; invalid ones raise), or the
    default profile's, with `tuned_knobs` in place of its own if given (default_launches: one
    per range of valid rows, for a capacity that asks for prefill tiles, or the one for
    `valid_rows` when the caller knows them), each with K long enough for its split-K; the
    gate-up's decode ones polling for published offsets (polling_launches). Worked out once per
    kind of call, when its launcher is bound."""
    capacity, k = x_shape
    experts = weight_shape[0]
    if valid_rows is not None and not (isinstance(valid_rows, int) and 0 <= valid_rows <= capacity):
        raise ValueError(
            f"valid_rows must be None or an int in [0, capacity={capacity}] (the batch's "
            f"expert_offsets[E]), got {valid_rows!r}"
        )
    if knobs is not None and tuned_knobs is not None:
        raise ValueError(
            f"pass knobs (exactly these) or tuned_knobs (these for the batch's class, decode tiles "
            f"for a small batch), not both: got knobs={knobs}, tuned_knobs={tuned_knobs}"
        )
    if knobs is None:
        n, _, _ = _gemm_dims(op, weight_shape)
        launches = default_launches(
            op,
            capacity,
            experts,
            weight_dims=(n, k),
            sms=_persistent_ctas(device_index, 1),
            tuned=tuned_knobs,
            valid_rows=valid_rows,
        )
    else:
        launches = (Launch(resolve_knobs(op, capacity / max(1, experts), knobs)),)
    if offsets_published:
        launches = polling_launches(op, launches)
    for launch in launches:
        _check_split_k(op, launch.knobs, k)
        if is_packed_shape(weight_shape) and launch.knobs.tile_cols not in PACKED_TILE_COLS:
            raise ValueError(
                f"tile_cols={launch.knobs.tile_cols} with packed weights: accepted "
                f"{PACKED_TILE_COLS} (a tile's weight rows lie in one packet of {PACKET_ROWS} or "
                "fill two)"
            )
    return launches


class GemmLauncher:
    """One GEMM op for one kind of call (op, knobs, shapes, valid rows, row scale or not,
    device), its launches planned, checked and compiled once: a call allocates the output
    (unless given) and hands the tensors to the compiled function, whose signature checks them
    in C. `gate_up_swiglu` and `down` look one up on every call; a caller that repeats a kind
    of call keeps it and skips that lookup (measured on the H200 host: 2-5 us less host time
    per expert-compute call, two GEMMs).

    Calls take any tensors the compiled signature accepts (capacity is a dynamic dim); a
    launch it refuses is re-raised as the op's check error that names the argument at fault."""

    __slots__ = (
        "columns",
        "compiled",
        "gathers",
        "has_bias",
        "knobs",
        "masked",
        "op",
        "out_group",
        "reduces",
        "swiglu",
        "takes_unit_counter",
        "weight_rows",
        "x_group",
    )

    def __init__(
        self,
        op: str,
        knobs: GemmKnobs,
        *,
        columns: int,
        weight_rows: int,
        entry: tuple[Callable, bool] | None,
        gathers: bool = False,
        reduces: bool = False,
        masked: bool = False,
        has_bias: bool = False,
        swiglu: SwiGLU = PLAIN_SWIGLU,
        x_group: int | None = None,
        out_group: int | None = None,
    ):
        self.op, self.knobs = op, knobs
        # FP8: columns per scale of the rows and (gate-up) of the e4m3 output; None in bf16
        self.x_group, self.out_group = x_group, out_group
        self.gathers = gathers  # the rows come from tokens by row_source_M
        # the down GEMM's rows are added into their tokens' rows (row_source_M) of the output
        self.reduces = reduces
        self.masked = masked  # each expert's rows are counted by expert_counts
        self.has_bias = has_bias  # a bias is added before the epilogue (a call passes it)
        self.swiglu = swiglu  # compiled into the gate-up kernel
        self.columns = columns  # of the output
        self.weight_rows = weight_rows  # N of the GEMM (the gate-up's output holds half)
        # the compile cache's entry: (compiled launches, whether one takes the unit counter);
        # None: nothing to launch (no rows when bound, or compiled only)
        self.compiled, self.takes_unit_counter = entry if entry is not None else (None, False)

    def __call__(
        self,
        x_MK: torch.Tensor,
        expert_offsets: torch.Tensor,
        w: torch.Tensor,
        *,
        row_scale_M: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        x_scales: torch.Tensor | None = None,
        w_scales: torch.Tensor | None = None,
        out_scales: torch.Tensor | None = None,
        row_source_M: torch.Tensor | None = None,
        expert_counts: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The output; with "gate_up_fp8" (the output, its scales). A gathering launcher takes
        the tokens as x_MK and row_source_M (the token of each batch row); a reducing one (the
        down GEMM bound with a row source) row_source_M and `out`, the tokens' rows its rows are
        added into; a masked one the counts (expert_counts); a launcher bound with a bias takes
        one (the op's layout) on every call."""
        scales = (x_scales, w_scales, out_scales)

        def check() -> None:
            _check_op(
                self.op,
                x_MK,
                expert_offsets,
                w,
                row_scale_M,
                out,
                scales,
                row_source_M,
                expert_counts,
                bias=bias,
                swiglu=self.swiglu,
                x_group=self.x_group,
                out_group=self.out_group,
            )

        try:
            by_token = self.gathers or self.reduces
            if (row_source_M is not None) != by_token:
                raise ValueError(
                    "row_source_M is required by a launcher bound with one, and refused by "
                    f"others (this one was bound {'with' if by_token else 'without'} one)"
                )
            if self.reduces and out is None:
                raise ValueError(
                    "out is required where the rows are added into their tokens' rows "
                    "(row_source_M): bf16 [T, H], holding what they add to (zeros)"
                )
            if (expert_counts is not None) != self.masked:
                raise ValueError(
                    "expert_counts is required by a launcher bound for a masked batch, and "
                    f"refused by others (this one is {'masked' if self.masked else 'tight'})"
                )
            if (bias is not None) != self.has_bias:
                raise ValueError(
                    "bias is required by a launcher bound with one, and refused by others "
                    f"(this one was bound {'with' if self.has_bias else 'without'} a bias)"
                )
            rows = row_source_M.shape[0] if self.gathers else x_MK.shape[0]
            quantized = self.op == "gate_up_fp8"
            if out is None:
                out = torch.empty(
                    (rows, self.columns),
                    dtype=FP8_DTYPE if quantized else torch.bfloat16,
                    device=x_MK.device,
                )
            if quantized and out_scales is None:
                out_scales = row_scales_buffer(
                    -(-self.columns // self.out_group), rows, device=x_MK.device
                )
            result = (out, out_scales) if quantized else out
            if self.compiled is None or rows == 0:
                # nothing runs, so no compiled signature checks the arguments
                check()
                return result
            partials = arrivals = unit_counter = None
            # split-K knobs (swap-AB) always launch alone
            if self.knobs.split_k > 1:
                partials, arrivals = _split_k_workspace(
                    self.knobs, x_MK, rows=rows, experts=w.shape[0], n=self.weight_rows
                )
            if self.takes_unit_counter:
                unit_counter = _unit_counter(x_MK)
            self.compiled(
                x_MK,
                w,
                out,
                expert_offsets,
                row_scale_M,
                partials,
                arrivals,
                unit_counter,
                x_scales,
                w_scales,
                out_scales,
                row_source_M,
                expert_counts,
                bias,
            )
            return result
        except Exception as failure:
            _raise_explained(failure, check)


def _check_op(
    op: str,
    x_MK,
    expert_offsets,
    w,
    row_scale_M,
    out,
    scales=None,
    row_source_M=None,
    expert_counts=None,
    *,
    bias=None,
    swiglu: SwiGLU = PLAIN_SWIGLU,
    x_group: int | None = None,
    out_group: int | None = None,
) -> None:
    """Every rule of an op's arguments; scales = (x_scales, w_scales, out_scales), or None to
    leave them out; with them, an FP8 op's groups (GemmLauncher.x_group, out_group)."""
    fp8 = is_fp8(op)
    if expert_counts is not None:
        if row_source_M is not None:
            raise ValueError("a masked batch's rows are read in place: no row_source_M")
        experts = w.shape[0] if isinstance(w, torch.Tensor) else 0
        _check_expert_counts(expert_counts, x_MK, experts)
    _check_epilogue(op, bias=bias, swiglu=swiglu)
    if bias is not None and isinstance(w, torch.Tensor) and is_packed_shape(w.shape):
        raise ValueError("packed weights are not built with a bias: pass the row-major weight")
    if is_gate_up(op):
        if row_scale_M is not None:
            raise ValueError("row_scale_M is the down GEMM's; the gate-up GEMM takes none")
        _check_gate_up(x_MK, expert_offsets, w, out, fp8=fp8, row_source_M=row_source_M, bias=bias)
    else:
        _check_down(
            x_MK, expert_offsets, w, row_scale_M, out, fp8=fp8, bias=bias, row_source_M=row_source_M
        )
    if scales is None:
        return
    x_scales, w_scales, out_scales = scales
    if not fp8:
        if any(scale is not None for scale in scales):
            raise ValueError(f"the {op} GEMM is bf16: it takes no scales")
        return
    n, k, n_out = _gemm_dims(op, w.shape)
    rows, device = x_MK.shape[0], x_MK.device
    _check_row_scales(
        "x_scales", x_scales, groups=-(-k // x_group), rows=rows, device=device, group=x_group
    )
    _check_weight_scales(
        "w_scales",
        w_scales,
        experts=w.shape[0],
        n=n,
        k=k,
        device=device,
        packed_weight=w if is_packed_shape(w.shape) else None,
    )
    if out_scales is not None:
        _check_row_scales(
            "out_scales",
            out_scales,
            groups=-(-n_out // out_group),
            rows=rows,
            device=device,
            group=out_group,
        )


def _check_epilogue(op: str, *, bias, swiglu) -> None:
    """The epilogue options an op is built with: the SwiGLU variant on the gate-up GEMMs (bf16
    and FP8), biases on the bf16 GEMMs."""
    if not isinstance(swiglu, SwiGLU):
        raise TypeError(
            f"swiglu must be a megamoe_kernels.SwiGLU (or None), got {type(swiglu).__name__}"
        )
    if is_fp8(op) and bias is not None:
        raise ValueError(
            f"the {op} GEMM is not built with a bias: biases run on the bf16 GEMMs "
            "(gate_up_swiglu, down)"
        )
    if not is_gate_up(op) and not swiglu.is_plain:
        raise ValueError(f"swiglu is the gate-up GEMM's; the {op} GEMM takes none, got {swiglu}")


# the launchers bound so far, by (op, knobs, tuned knobs, x shape, weight shape, valid rows and
# their type, row scale or not, bias or not, SwiGLU, device)
_LAUNCHERS: dict[tuple, GemmLauncher] = {}


def _launcher(
    op: str,
    x_MK: torch.Tensor,
    expert_offsets: torch.Tensor,
    w: torch.Tensor,
    *,
    row_scale_M: torch.Tensor | None,
    knobs: GemmKnobs | None,
    tuned_knobs: GemmKnobs | None,
    valid_rows: int | None,
    compile_only: bool,
    row_source_M: torch.Tensor | None = None,
    expert_counts: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    swiglu: SwiGLU | None = None,
    x_group: int | None = None,
    offsets_published: bool = False,
) -> GemmLauncher:
    """The launcher for this kind of call: looked up, else the op's checks run, the launches
    are planned and compiled (compile_only: compiled, nothing will run) and it is kept. A
    masked batch launches one kernel, for `valid_rows` (or the capacity when unknown): its
    valid rows are the counts' sum, which no kernel reads. `x_group`: down_fp8's columns per
    scale of its rows (the gate-up launcher's out_group). `offsets_published`: the module
    docstring (the gate-up ops; the word after expert_offsets is checked to lie in its
    storage)."""
    swiglu = PLAIN_SWIGLU if swiglu is None else swiglu
    if op == "down_fp8" and x_group not in (INTERMEDIATE_GROUP, WIDE_INTERMEDIATE_GROUP):
        raise ValueError(
            f"x_group must be {INTERMEDIATE_GROUP} or {WIDE_INTERMEDIATE_GROUP} (the columns per "
            f"scale of the gate-up's e4m3 output: its launcher's out_group), got {x_group!r}"
        )

    def check() -> None:
        # the scales are not part of the kind of call: a call's own are checked with it
        _check_op(
            op,
            x_MK,
            expert_offsets,
            w,
            row_scale_M,
            None,
            None,
            row_source_M,
            expert_counts,
            bias=bias,
            swiglu=swiglu,
        )
        if offsets_published:
            _check_published_offsets(op, expert_offsets)

    try:
        device_index = -1 if compile_only else x_MK.get_device()
        # a row source: the gate-up GEMM gathers its rows from the tokens, the down GEMM adds
        # its rows into the tokens' rows
        by_token = row_source_M is not None
        gathers = by_token and is_gate_up(op)
        masked = expert_counts is not None
        # the batch's (rows, K): with gathered rows, the row source's rows and the tokens' K
        batch_shape = (row_source_M.shape[0], x_MK.shape[1]) if gathers else tuple(x_MK.shape)
        # typed: a valid_rows of 2.0 or True is refused, not served the launcher of 2
        key = (
            op,
            knobs,
            tuned_knobs,
            batch_shape,
            by_token,
            masked,
            w.shape,
            valid_rows,
            type(valid_rows),
            row_scale_M is not None,
            bias is not None,
            swiglu,
            x_group,
            offsets_published,
            device_index,
        )
        launcher = _LAUNCHERS.get(key)
        if launcher is not None:
            return launcher
        check()
        if device_index < 0 and not compile_only:
            raise ValueError(
                f"the batch rows are on {x_MK.device}: the kernels run on a CUDA GPU "
                "(compile_only=True compiles them without one)"
            )
        planned_rows = batch_shape[0] if masked and valid_rows is None else valid_rows
        launches = _launches(
            op,
            knobs,
            tuned_knobs,
            batch_shape,
            w.shape,
            planned_rows,
            device_index,
            offsets_published=offsets_published,
        )
        weight_rows, _, columns = _gemm_dims(op, w.shape)
        # FP8 scale groups: the gate-up reads the hidden rows' and writes those its launches
        # allow; the down GEMM reads x_group (None both in bf16)
        out_group = None
        if op == "gate_up_fp8":
            x_group, out_group = ACTIVATION_GROUP, intermediate_group(launches, columns)
        groups = (x_group, out_group)
        has_row_scale, has_bias = row_scale_M is not None, bias is not None
        entry = None
        if batch_shape[0] > 0:
            entry = _compile(
                op,
                launches,
                (
                    op,
                    launches,
                    w.shape,
                    has_row_scale,
                    by_token,
                    masked,
                    has_bias,
                    swiglu,
                    groups,
                    device_index,
                ),
            )
        launcher = GemmLauncher(
            op,
            launches[0].knobs,
            columns=columns,
            weight_rows=weight_rows,
            entry=entry if device_index >= 0 else None,
            gathers=gathers,
            reduces=by_token and not gathers,
            masked=masked,
            has_bias=has_bias,
            swiglu=swiglu,
            x_group=x_group,
            out_group=out_group,
        )
    except Exception as failure:
        _raise_explained(failure, check)
    if device_index >= 0:
        _LAUNCHERS[key] = launcher
    return launcher


def _compile(op: str, launches: tuple[Launch, ...], key: tuple) -> tuple[Callable, bool]:
    (
        _,
        _,
        weight_shape,
        has_row_scale,
        by_token,
        masked,
        has_bias,
        swiglu,
        (x_group, out_group),
        device_index,
    ) = key
    # a row source: the gate-up gathers its rows from the tokens, the down GEMM adds its rows
    # into theirs
    gathers, reduces = by_token and is_gate_up(op), by_token and not is_gate_up(op)
    with _COMPILE_LOCK:
        entry = _COMPILED.get(key)
        if entry is not None:
            return entry
        if not torch.cuda.is_available():
            # without a GPU CuTe DSL guesses another architecture; set before it is imported
            os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
        from megamoe_kernels.drop.expert_gemm_sm90 import ExpertGroupedGemmSm90
        from megamoe_kernels.shim.ffi_launch import compile_stored_weight_launch

        n, k, n_out = _gemm_dims(op, weight_shape)
        kernels = [
            ExpertGroupedGemmSm90(
                tile_rows=launch.knobs.tile_rows,
                tile_cols=launch.knobs.tile_cols,
                stages=launch.knobs.stages,
                swap_ab=launch.knobs.swap_ab,
                swiglu=is_gate_up(op),
                row_scale=has_row_scale,
                rows_fastest=launch.knobs.rows_fastest,
                pingpong=launch.knobs.pingpong,
                cluster_rows=launch.knobs.cluster[0],
                split_k=launch.knobs.split_k,
                tail_rows=launch.knobs.tail_rows,
                min_valid_rows=launch.min_valid_rows,
                max_valid_rows=launch.max_valid_rows,
                # the down GEMM's offsets and weights are not written by the kernel before it
                # (its gate-up; `down` says so), so its weights may start loading while that
                # kernel runs: measured 1-4% faster at decode, 0.2-1.2% slower with prefill
                # tiles (docs/benchmarks.md, "Down weights before the wait")
                weights_before_wait=not is_gate_up(op) and launch.knobs.swap_ab,
                polls_offsets=launch.polls_offsets,
                l2_prefetch_ctas=launch.l2_prefetch_ctas,
                dynamic_schedule=_dynamic_schedule(launch.knobs),
                scale_group=x_group,
                out_scale_group=out_group,
                gather_rows=gathers,
                reduce_out=reduces,
                bias=has_bias,
                # a packed weight's scales lie a packet apart: one line per K tile
                prefetch_weight_scales=is_packed_shape(weight_shape),
                staged_scale_k_tiles=staged_scale_k_tiles(
                    launch.knobs, op, k=k, x_group=x_group or WEIGHT_BLOCK
                ),
                **(swiglu.kernel_constants() if is_gate_up(op) else {}),
                # persistent CTAs: those beyond the routed tiles find no work and exit
                num_ctas=_persistent_ctas(device_index, launch.knobs.cluster[0]),
            )
            for launch in launches
        ]
        takes_unit_counter = any(_dynamic_schedule(launch.knobs) for launch in launches)
        compiled = compile_stored_weight_launch(
            kernels,
            weight_shape=tuple(weight_shape),
            n=n,
            k=k,
            n_out=n_out,
            has_row_scale=has_row_scale,
            split_k=max(launch.knobs.split_k for launch in launches),
            dynamic_schedule=takes_unit_counter,
            scale_group=x_group,
            out_scale_group=out_group,
            gather_rows=gathers,
            reduce_out=reduces,
            masked=masked,
            has_bias=has_bias,
        )
        _COMPILED[key] = (compiled, takes_unit_counter)
        return _COMPILED[key]


def gate_up_swiglu(
    rows_MH: torch.Tensor,
    expert_offsets: torch.Tensor,
    w13_EB2GH: torch.Tensor,
    *,
    out_MI: torch.Tensor | None = None,
    knobs: GemmKnobs | None = None,
    tuned_knobs: GemmKnobs | None = None,
    valid_rows: int | None = None,
    compile_only: bool = False,
    expert_counts: torch.Tensor | None = None,
    row_source_M: torch.Tensor | None = None,
    w13_bias_EB2G: torch.Tensor | None = None,
    swiglu: SwiGLU | None = None,
    offsets_published: bool = False,
) -> torch.Tensor:
    """silu(x Wg^T) * (x Wu^T) per expert, bf16 out, fp32 accumulation.

    w13_bias_EB2G: float32 [E, I/8, 16] (interleave_gate_up_bias of the [E, 2I] bias), each
    expert's gate and up biases added to the accumulators before the activation. swiglu: the
    activation (SwiGLU; None: silu(gate) * up), e.g. gpt-oss's SwiGLU(limit=7.0, alpha=1.702,
    up_offset=1.0): gate * sigmoid(alpha * gate) * (up + up_offset) on the clamped values.

    row_source_M: int32 [M], the token of each batch row: rows_MH is then the tokens [T, H]
    and the kernel reads each batch row from its token (H a multiple of 64), with the bits of
    rows_MH[row_source_M] as the batch. Rows past expert_offsets[E] are never read.

    knobs: run exactly these. tuned_knobs: knobs tuned for the batch's class (a knob-cache
    entry), in place of the default profile's; with prefill ones a batch of few valid rows
    still runs the decode tiles (default_launches). Neither: the default profile.
    valid_rows: expert_offsets[E] when the caller knows it on the host: the default profile
    then launches only the kernel for that many rows (a wrong count costs speed, not rows).
    expert_counts: int32 [E], a masked batch (module docstring), for every op: one kernel is
    launched, the one for valid_rows when given. offsets_published: expert_offsets comes from
    the routing kernel just before, published in the word after them (module docstring)."""

    launcher = gate_up_launcher(
        rows_MH,
        expert_offsets,
        w13_EB2GH,
        knobs=knobs,
        tuned_knobs=tuned_knobs,
        valid_rows=valid_rows,
        compile_only=compile_only,
        expert_counts=expert_counts,
        row_source_M=row_source_M,
        w13_bias_EB2G=w13_bias_EB2G,
        swiglu=swiglu,
        offsets_published=offsets_published,
    )
    return launcher(
        rows_MH,
        expert_offsets,
        w13_EB2GH,
        out=out_MI,
        row_source_M=row_source_M,
        expert_counts=expert_counts,
        bias=w13_bias_EB2G,
    )


def down(
    hidden_MI: torch.Tensor,
    expert_offsets: torch.Tensor,
    w2_EHI: torch.Tensor,
    *,
    row_scale_M: torch.Tensor | None = None,
    out_MH: torch.Tensor | None = None,
    knobs: GemmKnobs | None = None,
    tuned_knobs: GemmKnobs | None = None,
    valid_rows: int | None = None,
    compile_only: bool = False,
    expert_counts: torch.Tensor | None = None,
    w2_bias_EH: torch.Tensor | None = None,
    row_source_M: torch.Tensor | None = None,
) -> torch.Tensor:
    """x W2^T per expert, plus w2_bias_EH[expert] (float32 [E, H], optional), each row then
    optionally multiplied by row_scale_M (float32, [M]); knobs, tuned_knobs and valid_rows as
    for gate_up_swiglu.

    row_source_M: int32 [M], the token of each batch row: the combine done by the GEMM. out_MH
    (required) is then the tokens' output [T, H] bf16, and each valid row's output (times its
    row_scale_M: the pair's routing weight) is added into out_MH[token] by atomic reductions at
    the L2 (red.add.bf16x2): each add rounds to bf16, and a token's adds land in no fixed
    order, so the result is not deterministic. out_MH holds what the rows add to (zeros, or a
    shared expert's output) before the call; a row whose token lies outside [0, T) adds
    nothing.

    With decode tiles the kernel starts loading w2_EHI (it reads expert_offsets to know which
    experts) while the kernel before it on the stream still runs, when that kernel lets it start
    early (megamoe's GEMMs do: gate-up then down overlap): neither may be written by the kernel
    just before."""

    launcher = down_launcher(
        hidden_MI,
        expert_offsets,
        w2_EHI,
        row_scale_M=row_scale_M,
        knobs=knobs,
        tuned_knobs=tuned_knobs,
        valid_rows=valid_rows,
        compile_only=compile_only,
        expert_counts=expert_counts,
        w2_bias_EH=w2_bias_EH,
        row_source_M=row_source_M,
    )
    return launcher(
        hidden_MI,
        expert_offsets,
        w2_EHI,
        row_scale_M=row_scale_M,
        out=out_MH,
        row_source_M=row_source_M,
        expert_counts=expert_counts,
        bias=w2_bias_EH,
    )


def gate_up_launcher(
    rows_MH: torch.Tensor,
    expert_offsets: torch.Tensor,
    w13_EB2GH: torch.Tensor,
    *,
    knobs: GemmKnobs | None = None,
    tuned_knobs: GemmKnobs | None = None,
    valid_rows: int | None = None,
    compile_only: bool = False,
    expert_counts: torch.Tensor | None = None,
    row_source_M: torch.Tensor | None = None,
    w13_bias_EB2G: torch.Tensor | None = None,
    swiglu: SwiGLU | None = None,
    offsets_published: bool = False,
) -> GemmLauncher:
    """gate_up_swiglu's launcher for calls like this one (arguments as there): keep it to
    launch the same kind of call again with no lookup, as launcher(rows_MH, expert_offsets,
    w13_EB2GH, out=None, row_source_M=None, bias=None) (a row source if it was bound with one,
    the w13 bias if it was bound with one; the SwiGLU is the bound one)."""
    return _launcher(
        "gate_up",
        rows_MH,
        expert_offsets,
        w13_EB2GH,
        row_scale_M=None,
        knobs=knobs,
        tuned_knobs=tuned_knobs,
        valid_rows=valid_rows,
        compile_only=compile_only,
        expert_counts=expert_counts,
        row_source_M=row_source_M,
        bias=w13_bias_EB2G,
        swiglu=swiglu,
        offsets_published=offsets_published,
    )


def down_launcher(
    hidden_MI: torch.Tensor,
    expert_offsets: torch.Tensor,
    w2_EHI: torch.Tensor,
    *,
    row_scale_M: torch.Tensor | None = None,
    knobs: GemmKnobs | None = None,
    tuned_knobs: GemmKnobs | None = None,
    valid_rows: int | None = None,
    compile_only: bool = False,
    expert_counts: torch.Tensor | None = None,
    w2_bias_EH: torch.Tensor | None = None,
    row_source_M: torch.Tensor | None = None,
) -> GemmLauncher:
    """down's launcher for calls like this one (with a row scale or without, a bias or
    without, a row source or without, as here): called as launcher(hidden_MI, expert_offsets,
    w2_EHI, row_scale_M=None, out=None, bias=None, row_source_M=None)."""
    return _launcher(
        "down",
        hidden_MI,
        expert_offsets,
        w2_EHI,
        row_scale_M=row_scale_M,
        knobs=knobs,
        tuned_knobs=tuned_knobs,
        valid_rows=valid_rows,
        compile_only=compile_only,
        expert_counts=expert_counts,
        bias=w2_bias_EH,
        row_source_M=row_source_M,
    )


def gate_up_swiglu_fp8(
    rows_MH: torch.Tensor,
    rows_scales: torch.Tensor,
    expert_offsets: torch.Tensor,
    w13_EB2GH: torch.Tensor,
    w13_scales: torch.Tensor,
    *,
    out_MI: torch.Tensor | None = None,
    out_scales: torch.Tensor | None = None,
    knobs: GemmKnobs | None = None,
    tuned_knobs: GemmKnobs | None = None,
    valid_rows: int | None = None,
    compile_only: bool = False,
    expert_counts: torch.Tensor | None = None,
    offsets_published: bool = False,
    swiglu: SwiGLU | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up_swiglu on e4m3 rows (scales [H / 128, M]) and an e4m3 interleaved w13 (scales
    [E, 2I / 128, H / 128], per block of the w13 before the interleave): the SwiGLU output
    (`swiglu`'s variant, the plain one by default) quantized per g columns, (e4m3 [M, I],
    scales [I / g, M]), g = 128 where every launch of the call runs 256-column prefill tiles,
    else 64 (gate_up_fp8_launcher(...).out_group says which; out_scales, if given, must have
    that shape). Arguments as there."""
    launcher = gate_up_fp8_launcher(
        rows_MH,
        expert_offsets,
        w13_EB2GH,
        knobs=knobs,
        tuned_knobs=tuned_knobs,
        valid_rows=valid_rows,
        compile_only=compile_only,
        expert_counts=expert_counts,
        offsets_published=offsets_published,
        swiglu=swiglu,
    )
    return launcher(
        rows_MH,
        expert_offsets,
        w13_EB2GH,
        out=out_MI,
        x_scales=rows_scales,
        w_scales=w13_scales,
        out_scales=out_scales,
        expert_counts=expert_counts,
    )


def down_fp8(
    hidden_MI: torch.Tensor,
    hidden_scales: torch.Tensor,
    expert_offsets: torch.Tensor,
    w2_EHI: torch.Tensor,
    w2_scales: torch.Tensor,
    *,
    row_scale_M: torch.Tensor | None = None,
    out_MH: torch.Tensor | None = None,
    knobs: GemmKnobs | None = None,
    tuned_knobs: GemmKnobs | None = None,
    valid_rows: int | None = None,
    compile_only: bool = False,
    expert_counts: torch.Tensor | None = None,
    row_source_M: torch.Tensor | None = None,
) -> torch.Tensor:
    """down on e4m3 rows (scales [I / 64, M] or [I / 128, M], as gate_up_swiglu_fp8 leaves
    them: the group is told from their shape) and an e4m3 w2 (scales [E, H / 128, I / 128]):
    bf16 [M, H] (with row_source_M, the tokens' [T, H] it adds into). Arguments as for
    down."""
    launcher = down_fp8_launcher(
        hidden_MI,
        expert_offsets,
        w2_EHI,
        x_group=_row_scales_group(hidden_scales, hidden_MI),
        row_scale_M=row_scale_M,
        knobs=knobs,
        tuned_knobs=tuned_knobs,
        valid_rows=valid_rows,
        compile_only=compile_only,
        expert_counts=expert_counts,
        row_source_M=row_source_M,
    )
    return launcher(
        hidden_MI,
        expert_offsets,
        w2_EHI,
        row_scale_M=row_scale_M,
        out=out_MH,
        x_scales=hidden_scales,
        w_scales=w2_scales,
        row_source_M=row_source_M,
        expert_counts=expert_counts,
    )


def gate_up_fp8_launcher(
    rows_MH: torch.Tensor,
    expert_offsets: torch.Tensor,
    w13_EB2GH: torch.Tensor,
    *,
    knobs: GemmKnobs | None = None,
    tuned_knobs: GemmKnobs | None = None,
    valid_rows: int | None = None,
    compile_only: bool = False,
    expert_counts: torch.Tensor | None = None,
    offsets_published: bool = False,
    swiglu: SwiGLU | None = None,
) -> GemmLauncher:
    """gate_up_swiglu_fp8's launcher: called as launcher(rows_MH, expert_offsets, w13_EB2GH,
    x_scales=..., w_scales=..., out=None, out_scales=None) -> (out, out_scales). `swiglu`: the
    SwiGLU variant compiled into its epilogue (as gate_up_swiglu's), the plain one by
    default."""
    return _launcher(
        "gate_up_fp8",
        rows_MH,
        expert_offsets,
        w13_EB2GH,
        row_scale_M=None,
        knobs=knobs,
        tuned_knobs=tuned_knobs,
        valid_rows=valid_rows,
        compile_only=compile_only,
        expert_counts=expert_counts,
        offsets_published=offsets_published,
        swiglu=swiglu,
    )


def down_fp8_launcher(
    hidden_MI: torch.Tensor,
    expert_offsets: torch.Tensor,
    w2_EHI: torch.Tensor,
    *,
    row_scale_M: torch.Tensor | None = None,
    knobs: GemmKnobs | None = None,
    tuned_knobs: GemmKnobs | None = None,
    valid_rows: int | None = None,
    compile_only: bool = False,
    expert_counts: torch.Tensor | None = None,
    x_group: int = INTERMEDIATE_GROUP,
    row_source_M: torch.Tensor | None = None,
) -> GemmLauncher:
    """down_fp8's launcher: called as launcher(hidden_MI, expert_offsets, w2_EHI,
    x_scales=..., w_scales=..., row_scale_M=None, out=None, row_source_M=None). `x_group`:
    columns per scale of hidden_MI, 64 or 128 (the gate-up launcher's out_group)."""
    return _launcher(
        "down_fp8",
        hidden_MI,
        expert_offsets,
        w2_EHI,
        row_scale_M=row_scale_M,
        knobs=knobs,
        tuned_knobs=tuned_knobs,
        valid_rows=valid_rows,
        compile_only=compile_only,
        expert_counts=expert_counts,
        x_group=x_group,
        row_source_M=row_source_M,
    )


def _row_scales_group(scales, rows) -> int:
    """The columns per scale of FP8 rows [M, K] that their scales' shape says: 128 for
    [ceil(K / 128), M] where that differs from ceil(K / 64), else 64 (a wrong shape is then
    refused by the launcher's checks)."""
    k = rows.shape[-1] if isinstance(rows, torch.Tensor) else 0
    groups = scales.shape[0] if isinstance(scales, torch.Tensor) and scales.dim() == 2 else None
    wide = -(-k // WIDE_INTERMEDIATE_GROUP)
    if groups == wide and wide != -(-k // INTERMEDIATE_GROUP):
        return WIDE_INTERMEDIATE_GROUP
    return INTERMEDIATE_GROUP


def cached_kernel_count() -> int:
    return len(_COMPILED)
