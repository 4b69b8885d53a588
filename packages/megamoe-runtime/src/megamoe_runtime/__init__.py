"""megamoe runtime: routing, dispatch and combine, expert-compute backends, weights, tuning."""

import importlib.metadata

from megamoe_runtime.dispatch import Dispatcher, LocalDispatcher
from megamoe_runtime.expert_batch import ExpertBatch
from megamoe_runtime.experts import backend_status, make_backend, select_backend
from megamoe_runtime.geometries import GEOMETRIES, Geometry
from megamoe_runtime.routing import RouterConfig, route
from megamoe_runtime.weights import Unquantized, WeightPack

__version__ = importlib.metadata.version("megamoe-runtime")

__all__ = [
    "GEOMETRIES",
    "Dispatcher",
    "ExpertBatch",
    "Geometry",
    "LocalDispatcher",
    "RouterConfig",
    "Unquantized",
    "WeightPack",
    "__version__",
    "backend_status",
    "make_backend",
    "route",
    "select_backend",
]
