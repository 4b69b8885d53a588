"""The Dispatcher protocol every dispatch/combine implementation follows.

Shape legend: T tokens of this rank, K experts per token, H hidden size, M batch capacity.

A dispatcher the caller builds and hands the layer (`MegaMoE(config, dispatcher=...)`, e.g.
DeepEPDispatcher) may also say what the layer checks it against: `process_group` (the group
its transport spans), `num_experts`, `top_k`, `hidden_size`, `masked_batches` and
`fp8_batches` (it hands out masked batches or FP8 rows, which not every backend takes: they
steer the backend choice) and `describe()` (for `dispatcher_reason`).

A dispatcher that knows each batch row's routing weight where the experts run (one GPU: local,
device-routed) also declares `RowWeightsDispatcher`: the layer then applies the weights before
the expert compute (MegaMoEConfig.routing_weights_on_input, the Llama 4 expert math) and
combines outputs that already carry them. The expert-parallel dispatchers keep each token's
weights on its source rank, so they do not declare it.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

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


@runtime_checkable
class RowWeightsDispatcher(Dispatcher, Protocol):
    """A Dispatcher that hands out each batch row's routing weight and combines outputs that
    already carry it (see the module docstring)."""

    def row_weights(self, batch: ExpertBatch, handle: Any) -> torch.Tensor:
        """float32 [capacity]: each batch row's routing weight, 0 past the valid rows."""
        ...

    def combine(
        self, expert_out_MH: torch.Tensor, handle: Any, *, weights_applied: bool = False
    ) -> torch.Tensor:
        """As Dispatcher.combine; with `weights_applied` the rows already carry their routing
        weights, so they are summed unweighted (in the same fixed order)."""
        ...
