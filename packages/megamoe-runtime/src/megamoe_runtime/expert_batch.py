"""ExpertBatch: the rows every expert-compute backend works on, in one of two layouts.

Tight (the default): rows sorted expert-major and packed with no per-expert padding.
`expert_offsets` is GPU-resident int32 with E + 1 entries: expert e owns rows
[offsets[e], offsets[e + 1]). `capacity` rows are allocated so shapes never change and CUDA
graphs replay; the valid-row count is the device view `expert_offsets[-1:]`, never a host int.
Rows past it are unspecified.

Masked (`ExpertBatch.masked`, `expert_counts` set): a receive buffer read in place, as DeepEP's
low-latency dispatch leaves it ([E, S, H]) and DeepGEMM's masked grouped GEMM reads it. Every
expert has a fixed stride of S = capacity / E rows, expert e's start at e x S
(`expert_offsets` holds these starts, [0, S, ..., E x S]), and only the first
`expert_counts[e]` (int32 [E] on the device, each <= S) are rows; the rest of its stride is
unspecified. A valid output row depends only on its own input row, so a backend may compute the
unspecified rows too (their outputs are unspecified) but must never let them reach a valid one.

In both layouts "never read as data": no valid output depends on an unspecified row.

Gathered (`ExpertBatch.gathered`, `row_source_M` set): a tight batch whose rows are not copied
out: `rows_MH` holds the tokens [T, H] and `row_source_M` (int32 [capacity] on the device) the
token of each batch row, so batch row r is rows_MH[row_source_M[r]] (row_source_M past the
valid rows unspecified). The cutedsl backend's gate-up GEMM reads the rows from the tokens; the
other backends take `materialized()`, the same batch with its rows copied out.

Published offsets (`offsets_published`): `expert_offsets` comes from the routing kernel launched
just before on the stream, which sets the int32 word after them (in their storage) to 1 once they
are final, before it ends; the cutedsl backend's decode gate-up GEMM then starts loading its
weights before that kernel ends (megamoe_kernels' gate_up_swiglu, `offsets_published`).

FP8 rows: `rows_MH` e4m3 with `row_scales_GM`, float32 [ceil(H / 128), capacity], one scale
per row and 128 columns (value = e4m3 x scale), as a dispatch of pre-quantized tokens leaves
them for FP8 experts. Backends with bf16 weights take `dequantized()`: the same batch with bf16
rows (e4m3 x scale in fp32, rounded to bf16).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from megamoe_kernels.shim.fp8 import ACTIVATION_GROUP, dequantize_rows

# rows ExpertBatch.dequantized turns to bf16 at a time: its fp32 temporaries stay near
# 4096 x H x 4 bytes, whatever the capacity (an expert-parallel receiver's is W x T x K rows)
DEQUANTIZE_CHUNK_ROWS = 4096


@dataclass(frozen=True)
class ExpertBatch:
    rows_MH: torch.Tensor
    expert_offsets: torch.Tensor
    # the rows a batch of this capacity typically holds, where the capacity is sized for a worst
    # case (an expert-parallel receiver: world x max tokens x top-k rows, of which uniform
    # routing brings max tokens x top-k): tuned knobs are looked up for this class.
    # None: the capacity (a tight batch)
    typical_rows: int | None = None
    # the valid-row count (expert_offsets[E]; the counts' sum when masked) when the host knows
    # it (a local batch holds tokens x top-k rows), so the kernels need not be chosen on the
    # device from it; None: known on the device only. A hint: a wrong value costs speed, never
    # rows
    valid_rows: int | None = None
    # FP8 rows' scales (see the module docstring); None: rows in full precision
    row_scales_GM: torch.Tensor | None = None
    # the masked layout's valid rows per expert, int32 [E] on the device (see the module
    # docstring); None: the tight layout
    expert_counts: torch.Tensor | None = None
    # gathered rows: the token of each batch row, int32 [capacity] on the device, rows_MH being
    # the tokens (see the module docstring); None: rows_MH holds the batch rows
    row_source_M: torch.Tensor | None = None
    # the routing kernel before publishes the offsets in the word after them (see the module
    # docstring)
    offsets_published: bool = False

    @classmethod
    def gathered(
        cls,
        tokens_TH: torch.Tensor,
        row_source_M: torch.Tensor,
        expert_offsets: torch.Tensor,
        *,
        valid_rows: int | None = None,
        typical_rows: int | None = None,
        offsets_published: bool = False,
    ) -> ExpertBatch:
        """A tight batch whose row r is tokens_TH[row_source_M[r]], not copied out."""
        return cls(
            rows_MH=tokens_TH,
            expert_offsets=expert_offsets,
            typical_rows=typical_rows,
            valid_rows=valid_rows,
            row_source_M=row_source_M,
            offsets_published=offsets_published,
        )

    def materialized(self) -> ExpertBatch:
        """The batch with its rows copied out (itself unless gathered): for a backend that
        reads batch rows. The sources past the valid rows are clamped to a token (their rows
        stay unspecified, never out of bounds)."""
        if self.row_source_M is None:
            return self
        tokens = self.rows_MH.shape[0]
        source = self.row_source_M.clamp(0, max(tokens - 1, 0))
        rows_MH = (
            self.rows_MH.index_select(0, source)
            if tokens
            else self.rows_MH.new_empty((self.capacity, self.hidden_size))
        )
        return ExpertBatch(
            rows_MH=rows_MH,
            expert_offsets=self.expert_offsets,
            typical_rows=self.typical_rows,
            valid_rows=self.valid_rows,
            offsets_published=self.offsets_published,
        )

    def dequantized(self) -> ExpertBatch:
        """The batch with bf16 rows (itself unless its rows are FP8): each row's e4m3 values
        times their scales in fp32, rounded to bf16, for experts with bf16 weights. One pass
        over the capacity rows, DEQUANTIZE_CHUNK_ROWS at a time (bounded fp32 temporaries), no
        host sync; rows past the valid ones stay unspecified."""
        if self.row_scales_GM is None:
            return self
        rows_MH = torch.empty(self.rows_MH.shape, dtype=torch.bfloat16, device=self.rows_MH.device)
        for first in range(0, self.capacity, DEQUANTIZE_CHUNK_ROWS):
            last = min(first + DEQUANTIZE_CHUNK_ROWS, self.capacity)
            rows_MH[first:last] = dequantize_rows(
                self.rows_MH[first:last], self.row_scales_GM[:, first:last]
            )
        return replace(self, rows_MH=rows_MH, row_scales_GM=None)

    @classmethod
    def masked(
        cls,
        rows_ESH: torch.Tensor,
        expert_counts: torch.Tensor,
        *,
        row_scales_GM: torch.Tensor | None = None,
        typical_rows: int | None = None,
        valid_rows: int | None = None,
    ) -> ExpertBatch:
        """A masked batch over `rows_ESH` ([E, S, H], read in place: a view, no copy) whose
        expert e holds `expert_counts[e]` rows from its stride's start."""
        if rows_ESH.dim() != 3 or not rows_ESH.is_contiguous():
            raise ValueError(
                f"rows_ESH must be a contiguous [experts, rows per expert, hidden] tensor, got "
                f"shape {tuple(rows_ESH.shape)} (contiguous: {rows_ESH.is_contiguous()})"
            )
        experts, stride, hidden = rows_ESH.shape
        starts = torch.arange(experts + 1, dtype=torch.int32, device=rows_ESH.device) * stride
        return cls(
            rows_MH=rows_ESH.view(experts * stride, hidden),
            expert_offsets=starts,
            typical_rows=typical_rows,
            valid_rows=valid_rows,
            row_scales_GM=row_scales_GM,
            expert_counts=expert_counts,
        )

    def __post_init__(self) -> None:
        if self.rows_MH.dim() != 2:
            raise ValueError(
                f"rows_MH must be 2-D [capacity, hidden], got {tuple(self.rows_MH.shape)}"
            )
        if self.expert_offsets.dim() != 1 or self.expert_offsets.numel() < 2:
            raise ValueError(
                f"expert_offsets must be 1-D with num_experts + 1 >= 2 entries, "
                f"got shape {tuple(self.expert_offsets.shape)}"
            )
        if self.expert_offsets.dtype != torch.int32:
            raise TypeError(f"expert_offsets must be int32, got {self.expert_offsets.dtype}")
        if self.expert_offsets.device != self.rows_MH.device:
            raise ValueError(
                f"expert_offsets on {self.expert_offsets.device} but rows on {self.rows_MH.device}"
            )
        if self.row_scales_GM is not None:
            groups = -(-self.rows_MH.shape[1] // ACTIVATION_GROUP)
            if self.rows_MH.dtype != torch.float8_e4m3fn:
                raise TypeError(f"rows with row_scales_GM must be e4m3, got {self.rows_MH.dtype}")
            scales = self.row_scales_GM
            if scales.dtype != torch.float32 or tuple(scales.shape) != (groups, self.capacity):
                raise ValueError(
                    f"row_scales_GM must be float32 [{groups}, {self.capacity}], got "
                    f"{scales.dtype} {list(scales.shape)}"
                )
            if scales.device != self.rows_MH.device:
                raise ValueError(
                    f"row_scales_GM on {scales.device} but rows on {self.rows_MH.device}"
                )
        if self.expert_counts is not None:
            self._check_masked_layout()
        if self.row_source_M is not None:
            self._check_gathered()
        for name in ("typical_rows", "valid_rows"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= self.capacity:
                raise ValueError(
                    f"{name} must be None or in [0, capacity={self.capacity}], got {value}"
                )

    def _check_masked_layout(self) -> None:
        counts, experts = self.expert_counts, self.num_experts
        if counts.dtype != torch.int32 or tuple(counts.shape) != (experts,):
            raise ValueError(
                f"expert_counts must be int32 [{experts}] (one count per expert), got "
                f"{counts.dtype} {list(counts.shape)}"
            )
        if counts.device != self.rows_MH.device:
            raise ValueError(f"expert_counts on {counts.device} but rows on {self.rows_MH.device}")
        if self.capacity % experts:
            raise ValueError(
                f"a masked batch's capacity ({self.capacity} rows) must be a multiple of its "
                f"{experts} experts (each expert has the same stride)"
            )

    def _check_gathered(self) -> None:
        source = self.row_source_M
        if source.dtype != torch.int32 or source.dim() != 1:
            raise ValueError(
                f"row_source_M must be 1-D int32 (the token of each batch row), got "
                f"{source.dtype} {list(source.shape)}"
            )
        if source.device != self.rows_MH.device:
            raise ValueError(f"row_source_M on {source.device} but tokens on {self.rows_MH.device}")
        if self.row_scales_GM is not None or self.expert_counts is not None:
            raise ValueError("gathered rows are bf16 tokens of a tight batch (no scales, no masks)")

    @property
    def is_gathered(self) -> bool:
        """Whether the rows are gathered from the tokens (row_source_M set)."""
        return self.row_source_M is not None

    @property
    def is_masked(self) -> bool:
        """Whether the batch has the masked layout (per-expert counts at a fixed stride)."""
        return self.expert_counts is not None

    @property
    def expert_stride(self) -> int | None:
        """Rows between consecutive experts' starts in the masked layout; None when tight."""
        return self.capacity // self.num_experts if self.is_masked else None

    @property
    def capacity(self) -> int:
        if self.row_source_M is not None:
            return self.row_source_M.shape[0]
        return self.rows_MH.shape[0]

    @property
    def output_dtype(self) -> torch.dtype:
        """The dtype of the expert outputs: the rows', bf16 for FP8 rows."""
        return torch.bfloat16 if self.row_scales_GM is not None else self.rows_MH.dtype

    @property
    def hidden_size(self) -> int:
        return self.rows_MH.shape[1]

    @property
    def num_experts(self) -> int:
        return self.expert_offsets.numel() - 1

    @property
    def num_valid_rows(self) -> torch.Tensor:
        """The valid-row count on the device (shape [1]; a view of expert_offsets when tight,
        the counts' sum when masked); reading it on the host syncs."""
        if self.is_masked:
            return self.expert_counts.sum(dtype=torch.int32).view(1)
        return self.expert_offsets[-1:]
