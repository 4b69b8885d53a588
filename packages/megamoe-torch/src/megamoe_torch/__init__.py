"""megamoe for PyTorch: the MegaMoE layer and its configuration."""

from megamoe_torch.config import MegaMoEConfig
from megamoe_torch.hf import (
    SwapReport,
    UnsupportedBlockError,
    from_hf,
    from_hf_state_dict,
    hf_state_dict_from_megamoe,
    megamoe_state_dict_from_hf,
    swap_moe_blocks,
)
from megamoe_torch.layer import MegaMoE, SharedExperts

__all__ = [
    "MegaMoE",
    "MegaMoEConfig",
    "SharedExperts",
    "SwapReport",
    "UnsupportedBlockError",
    "from_hf",
    "from_hf_state_dict",
    "hf_state_dict_from_megamoe",
    "megamoe_state_dict_from_hf",
    "swap_moe_blocks",
]
