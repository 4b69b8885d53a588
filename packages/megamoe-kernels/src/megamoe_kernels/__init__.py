"""megamoe kernels: CuTe DSL expert-compute kernels for Hopper, and their pure-torch oracles.

`import megamoe_kernels` works on any machine: CuTe DSL is imported on first kernel use.
"""

from megamoe_kernels import reference

__all__ = ["reference"]
