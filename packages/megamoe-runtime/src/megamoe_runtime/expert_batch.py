"""ExpertBatch: the rows every expert-compute backend works on.

Rows are sorted expert-major and packed tight (no per-expert padding). `expert_offsets` is
GPU-resident int32 with E + 1 entries: expert e owns rows [offsets[e], offsets[e + 1]).
`capacity` rows are allocated so shapes never change and CUDA graphs replay; the valid-row count
is the device view `expert_offsets[-1:]`, never a host int. Rows past it are unspecified.

FP8 rows: `rows_MH` e4m3 with `row_scales_GM`, float32 [ceil(H / 128), capacity], one scale
per row and 128 columns (value = e4m3 x scale), as a dispatch of pre-quantized tokens leaves
them for FP8 experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megamoe_kernels.shim.fp8 import ACTIVATION_GROUP


@dataclass(frozen=True)
class ExpertBatch:
    rows_MH: torch.Tensor
    expert_offsets: torch.Tensor
    # the rows a batch of this capacity typically holds, where the capacity is sized for a worst
    # case (an expert-parallel receiver: world x max tokens x top-k rows, of which uniform
    # routing brings max tokens x top-k): tuned knobs are looked up for this class.
    # None: the capacity (a tight batch)
    typical_rows: int | None = None
    # expert_offsets[E] when the host knows it (a local batch holds tokens x top-k rows), so the
    # kernels need not be chosen on the device from it; None: known on the device only. A hint:
    # a wrong value costs speed, never rows
    valid_rows: int | None = None
    # FP8 rows' scales (see the module docstring); None: rows in full precision
    row_scales_GM: torch.Tensor | None = None

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
        for name in ("typical_rows", "valid_rows"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= self.capacity:
                raise ValueError(
                    f"{name} must be None or in [0, capacity={self.capacity}], got {value}"
                )

    @property
    def capacity(self) -> int:
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
        """Device view of the valid-row count (shape [1]); reading it on the host syncs."""
        return self.expert_offsets[-1:]
