"""The cutedsl backend: megamoe's CuTe DSL kernels (megamoe_kernels). Being built (issue 3)."""

from __future__ import annotations

import torch


def cutedsl_status(device: torch.device) -> tuple[bool, str]:
    return False, "the CuTe DSL expert kernels are not in this build yet"


class CuteDSLExperts:
    name = "cutedsl"

    def prepare(self, weights):
        raise NotImplementedError("the cutedsl backend is not in this build yet")

    def __call__(self, batch, prepared, *, row_scale_M=None):
        raise NotImplementedError("the cutedsl backend is not in this build yet")
