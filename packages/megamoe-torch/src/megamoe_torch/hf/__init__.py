"""Hugging Face transformers interop: convert MoE blocks, swap them in a model, map state dicts.

Needs no transformers import of its own: it reads the modules and tensors it is given. The
`megamoe-torch[hf]` extra installs transformers for building the models themselves.
"""

from megamoe_torch.hf.convert import RUN_OPTIONS, from_hf, from_hf_state_dict
from megamoe_torch.hf.experts_implementation import register_experts_implementation
from megamoe_torch.hf.families import (
    FAMILIES,
    UnsupportedBlockError,
    moe_layer_indices,
    read_hf_config,
)
from megamoe_torch.hf.state_dict import (
    block_state_dict,
    hf_state_dict_from_megamoe,
    megamoe_state_dict_from_hf,
)
from megamoe_torch.hf.swap import (
    SwappedMoEBlock,
    SwapReport,
    swap_moe_blocks,
    unswap_moe_blocks,
)

__all__ = [
    "FAMILIES",
    "RUN_OPTIONS",
    "SwapReport",
    "SwappedMoEBlock",
    "UnsupportedBlockError",
    "block_state_dict",
    "from_hf",
    "from_hf_state_dict",
    "hf_state_dict_from_megamoe",
    "megamoe_state_dict_from_hf",
    "moe_layer_indices",
    "read_hf_config",
    "register_experts_implementation",
    "swap_moe_blocks",
    "unswap_moe_blocks",
]
