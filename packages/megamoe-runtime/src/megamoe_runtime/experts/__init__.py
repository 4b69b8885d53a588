"""Expert-compute backends and the choice between them.

| backend    | where                   | what                                          |
|------------|-------------------------|-----------------------------------------------|
| reference  | CPU or any GPU          | pure torch, fp32 accumulate: the oracle        |
| grouped_mm | sm_90 GPU, torch >= 2.8 | torch._grouped_mm composition: the baseline    |
| cutedsl    | sm_90a GPU              | megamoe's CuTe DSL kernels                     |

`auto` picks the first of cutedsl, grouped_mm, reference that can run, and says why.
"""

from __future__ import annotations

import torch

from megamoe_runtime.experts.base import ExpertBackend, check_batch_matches_weights
from megamoe_runtime.experts.cutedsl import CuteDSLExperts, cutedsl_status
from megamoe_runtime.experts.grouped_mm import GroupedMMExperts, grouped_mm_status
from megamoe_runtime.experts.reference import ReferenceExperts

BACKEND_NAMES = ("cutedsl", "grouped_mm", "reference")


def backend_status(
    name: str, device: torch.device, *, masked_batches: bool = False
) -> tuple[bool, str]:
    """(can run, why) for one backend on `device`; `masked_batches`: for batches in the masked
    layout (a DeepEP low-latency receive buffer), which the cutedsl kernels do not take."""
    if masked_batches and name == "cutedsl":
        return False, (
            "the cutedsl kernels take tight expert batches, and this layer's dispatcher hands "
            "the experts masked ones (per-expert counts at a fixed stride: DeepEP's low-latency "
            "mode); the kernels have no per-expert valid count yet"
        )
    if name == "reference":
        return True, "pure torch runs everywhere"
    if name == "grouped_mm":
        return grouped_mm_status(device)
    if name == "cutedsl":
        return cutedsl_status(device)
    raise ValueError(f"backend must be one of {('auto', *BACKEND_NAMES)}, got {name!r}")


def select_backend(
    requested: str, device: torch.device, *, masked_batches: bool = False
) -> tuple[str, str]:
    """Resolves 'auto' (or checks an explicit name) to (backend name, reason); see
    `backend_status` for `masked_batches`."""
    device = torch.device(device)
    if requested != "auto":
        available, reason = backend_status(requested, device, masked_batches=masked_batches)
        if not available:
            raise ValueError(f"backend {requested!r} cannot run on {device}: {reason}")
        return requested, reason
    skipped = []
    for name in BACKEND_NAMES:
        available, reason = backend_status(name, device, masked_batches=masked_batches)
        if available:
            because = f"; skipped {'; '.join(skipped)}" if skipped else ""
            return name, f"auto: {name} ({reason}){because}"
        skipped.append(f"{name}: {reason}")
    raise AssertionError("the reference backend always runs")


def make_backend(name: str) -> ExpertBackend:
    backends = {
        "reference": ReferenceExperts,
        "grouped_mm": GroupedMMExperts,
        "cutedsl": CuteDSLExperts,
    }
    if name not in backends:
        raise ValueError(f"backend must be one of {tuple(backends)}, got {name!r}")
    return backends[name]()


__all__ = [
    "BACKEND_NAMES",
    "CuteDSLExperts",
    "ExpertBackend",
    "GroupedMMExperts",
    "ReferenceExperts",
    "backend_status",
    "check_batch_matches_weights",
    "make_backend",
    "select_backend",
]
