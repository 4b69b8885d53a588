"""megamoe runtime: routing, dispatch and combine, expert-compute backends, weights, tuning."""

import importlib.metadata

from megamoe_runtime.dispatch import Dispatcher, LocalDispatcher
from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.experts import backend_status, make_backend, select_backend
from megamoe_runtime.geometries import GEOMETRIES, Geometry
from megamoe_runtime.routing import RouterConfig, route
from megamoe_runtime.weights import Prequantized, Unquantized, WeightPack, dequantize, quantize

try:
    __version__ = importlib.metadata.version("megamoe-runtime")
except importlib.metadata.PackageNotFoundError:  # imported from a source tree, not installed
    __version__ = "0+source"

__all__ = [
    "GEOMETRIES",
    "Dispatcher",
    "ExpertBatch",
    "Geometry",
    "LocalDispatcher",
    "Prequantized",
    "RouterConfig",
    "Unquantized",
    "WeightPack",
    "__version__",
    "backend_status",
    "dequantize",
    "make_backend",
    "quantize",
    "route",
    "select_backend",
]
