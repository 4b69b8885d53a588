"""Dispatch tokens to experts and combine expert outputs back, behind one protocol."""

from megamoe_runtime.dispatch.checks import experts_per_rank
from megamoe_runtime.dispatch.deepep import DeepEPDispatcher
from megamoe_runtime.dispatch.local import LocalDispatcher, LocalHandle
from megamoe_runtime.dispatch.protocol import Dispatcher, RowWeightsDispatcher
from megamoe_runtime.dispatch.torch_distributed import (
    TorchDistributedDispatcher,
    TorchDistributedHandle,
)

__all__ = [
    "DeepEPDispatcher",
    "Dispatcher",
    "LocalDispatcher",
    "LocalHandle",
    "RowWeightsDispatcher",
    "TorchDistributedDispatcher",
    "TorchDistributedHandle",
    "experts_per_rank",
]
