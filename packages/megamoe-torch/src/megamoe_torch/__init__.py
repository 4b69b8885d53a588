"""megamoe for PyTorch: the MegaMoE layer and its configuration."""

import importlib.metadata

from megamoe_torch.config import MegaMoEConfig
from megamoe_torch.hf import (
    SwapReport,
    UnsupportedBlockError,
    from_hf,
    from_hf_state_dict,
    hf_state_dict_from_megamoe,
    megamoe_state_dict_from_hf,
    register_experts_implementation,
    swap_moe_blocks,
    unswap_moe_blocks,
)
from megamoe_torch.layer import MegaMoE, SharedExperts

try:
    __version__ = importlib.metadata.version("megamoe-torch")
except importlib.metadata.PackageNotFoundError:  # imported from a source tree, not installed
    __version__ = "0+source"

__all__ = [
    "MegaMoE",
    "MegaMoEConfig",
    "SharedExperts",
    "SwapReport",
    "UnsupportedBlockError",
    "__version__",
    "from_hf",
    "from_hf_state_dict",
    "hf_state_dict_from_megamoe",
    "megamoe_state_dict_from_hf",
    "register_experts_implementation",
    "swap_moe_blocks",
    "unswap_moe_blocks",
]
