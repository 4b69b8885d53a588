"""The Dispatcher protocol every dispatch/combine implementation follows.

Shape legend: T tokens of this rank, K experts per token, H hidden size, M batch capacity.

A dispatcher the caller builds and hands the layer (`MegaMoE(config, dispatcher=...)`, e.g.
DeepEPDispatcher) may also say what the layer checks it against: `process_group` (the group
its transport spans), `num_experts`, `top_k`, `hidden_size`, `masked_batches` and
`fp8_batches` (it hands out masked batches or FP8 rows, which not every backend takes: they
steer the backend choice) and `describe()` (for `dispatcher_reason`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from megamoe_runtime.expert_batch import ExpertBatch


class Dispatcher(Protocol):
    num_local_experts: int

    def dispatch(
        self, x_TH: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[ExpertBatch, Any]:
        """Sends each token row to its K experts; returns the batch this rank computes and an
        opaque handle for combine."""
        ...

    def combine(self, expert_out_MH: torch.Tensor, handle: Any) -> torch.Tensor:
        """Returns y_TH: each token's K expert outputs weighted by its routing weights and summed
        in a fixed order (deterministic)."""
        ...
