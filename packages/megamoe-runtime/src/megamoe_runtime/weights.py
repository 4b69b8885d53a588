"""Expert weight packs and their checks.

Shape legend: E experts, I intermediate size, H hidden size.
`w13_E2IH` holds each expert's gate rows [0, I) then up rows [I, 2I); `w2_EHI` the down projection.
Backends transform a pack into their own layout once (ExpertBackend.prepare) and cache it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Unquantized:
    """BF16/FP16/FP32 expert weights in the model's own layout."""

    w13_E2IH: torch.Tensor
    w2_EHI: torch.Tensor

    def __post_init__(self) -> None:
        if self.w13_E2IH.dim() != 3 or self.w2_EHI.dim() != 3:
            raise ValueError(
                f"w13 must be [E, 2I, H] and w2 [E, H, I]; got {tuple(self.w13_E2IH.shape)} "
                f"and {tuple(self.w2_EHI.shape)}"
            )
        experts, two_intermediate, hidden = self.w13_E2IH.shape
        if two_intermediate % 2:
            raise ValueError(f"w13's second dim must be 2 * intermediate, got {two_intermediate}")
        expected_w2 = (experts, hidden, two_intermediate // 2)
        if tuple(self.w2_EHI.shape) != expected_w2:
            raise ValueError(
                f"w2 must have shape {expected_w2} to match w13, got {tuple(self.w2_EHI.shape)}"
            )
        if self.w13_E2IH.dtype != self.w2_EHI.dtype or self.w13_E2IH.device != self.w2_EHI.device:
            raise ValueError("w13 and w2 must share dtype and device")

    @property
    def num_experts(self) -> int:
        return self.w13_E2IH.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13_E2IH.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w13_E2IH.shape[1] // 2


WeightPack = Unquantized
