"""megamoe for PyTorch: the MegaMoE layer and its configuration."""

from megamoe_torch.config import MegaMoEConfig
from megamoe_torch.layer import MegaMoE, SharedExperts

__all__ = ["MegaMoE", "MegaMoEConfig", "SharedExperts"]
