"""The expert GEMMs' epilogue options beyond the plain ones: the SwiGLU variant and per-expert
biases (plain Python and torch; no CuTe DSL).

- `SwiGLU(limit, alpha, up_offset, gate_softcap, up_softcap, gate_cubic)`: gate *
  sigmoid(alpha * (gate + gate_cubic * gate^3)) * (up + up_offset), gate clamped to at most
  `limit` and up to [-limit, limit] first when `limit` is set, the linear gate factor and up
  softcapped (c * tanh(v / c)) when their caps are set (megamoe_kernels.reference.swiglu is its
  oracle). `SwiGLU()` is silu(gate) * up; gpt-oss computes `SwiGLU(limit=7.0, alpha=1.702,
  up_offset=1.0)`, Inkling2 softcaps, and `GEGLU` (alpha 2 sqrt(2 / pi), gate_cubic 0.044715)
  is the tanh GELU of the gate times up (Gemma 4). The bf16 gate-up kernel compiles the
  constants in: each distinct SwiGLU is its own kernel variant.
- `interleave_gate_up_bias(w13_bias_E2I)` -> float32 [E, I / 8, 16]: the gate-up bias in the
  interleaved order of the weight rows (interleave_gate_up), the layout gate_up_swiglu takes.
  The down GEMM takes its bias [E, H] in float32 as it is.

Shape legend: E experts, I intermediate size, H hidden size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megamoe_kernels.drop.gate_up_layout import GATE_UP_BLOCK, interleaved_source_row
from megamoe_kernels.reference import swiglu


@dataclass(frozen=True)
class SwiGLU:
    """The gate-up GEMM's activation; the defaults are silu(gate) * up."""

    limit: float | None = None
    alpha: float = 1.0
    up_offset: float = 0.0
    gate_softcap: float | None = None
    up_softcap: float | None = None
    gate_cubic: float = 0.0

    def __post_init__(self) -> None:
        for name in ("limit", "gate_softcap", "up_softcap"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"SwiGLU {name} must be a number or None, got {value!r}")
            if not 0 < value < math.inf:
                raise ValueError(f"SwiGLU {name} must be finite and > 0, or None; got {value}")
            object.__setattr__(self, name, float(value))
        for name in ("alpha", "up_offset", "gate_cubic"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"SwiGLU {name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"SwiGLU {name} must be finite, got {value}")
            object.__setattr__(self, name, float(value))

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """This activation of `gate` and `up` in fp32 (megamoe_kernels.reference.swiglu)."""
        return swiglu(gate, up, **self.constants())

    @property
    def is_plain(self) -> bool:
        """Whether this is silu(gate) * up."""
        return self == SwiGLU()

    @property
    def clamped(self) -> bool:
        """Whether a clamp, an alpha, an up offset (gpt-oss's kind) or a cubic gate term (GeGLU)
        is set."""
        return (self.limit, self.alpha, self.up_offset, self.gate_cubic) != (None, 1.0, 0.0, 0.0)

    @property
    def softcapped(self) -> bool:
        """Whether a softcap is set."""
        return self.gate_softcap is not None or self.up_softcap is not None

    def constants(self) -> dict[str, float | None]:
        """The keyword arguments of megamoe_kernels.reference's swiglu and expert oracles."""
        return {
            "limit": self.limit,
            "alpha": self.alpha,
            "up_offset": self.up_offset,
            "gate_softcap": self.gate_softcap,
            "up_softcap": self.up_softcap,
            "gate_cubic": self.gate_cubic,
        }

    def kernel_constants(self) -> dict[str, float | None]:
        """The drop kernel's keyword arguments for this activation (MegaMoEConfig's fields of
        it have the same names)."""
        return {f"swiglu_{name}": value for name, value in self.constants().items()}


PLAIN_SWIGLU = SwiGLU()
# GeGLU with the tanh GELU, 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) = g sigmoid(2
# sqrt(2 / pi) (g + 0.044715 g^3)): transformers' gelu_pytorch_tanh of the gate, times up
GELU_TANH_ALPHA = 2.0 * math.sqrt(2.0 / math.pi)
GELU_TANH_CUBIC = 0.044715
GEGLU = SwiGLU(alpha=GELU_TANH_ALPHA, gate_cubic=GELU_TANH_CUBIC)


def interleave_gate_up_bias(w13_bias_E2I: torch.Tensor) -> torch.Tensor:
    """[E, 2I] gate biases then up biases, any float dtype -> float32 [E, I / 8, 16]: blocks of
    8 gate biases, each followed by its 8 up biases (the rows of interleave_gate_up's weight).
    Run once at load."""
    if (
        not isinstance(w13_bias_E2I, torch.Tensor)
        or w13_bias_E2I.dim() != 2
        or w13_bias_E2I.shape[1] % (2 * GATE_UP_BLOCK)
        or not w13_bias_E2I.is_floating_point()
    ):
        got = (
            f"{w13_bias_E2I.dtype} {tuple(w13_bias_E2I.shape)}"
            if isinstance(w13_bias_E2I, torch.Tensor)
            else type(w13_bias_E2I).__name__
        )
        raise ValueError(
            f"w13_bias must be a float [E, 2I] tensor with I a multiple of {GATE_UP_BLOCK}, "
            f"got {got}"
        )
    experts, two_intermediate = w13_bias_E2I.shape
    source_rows = interleaved_source_row(
        torch.arange(two_intermediate, device=w13_bias_E2I.device), two_intermediate // 2
    )
    return (
        w13_bias_E2I.float()
        .index_select(1, source_rows)
        .reshape(experts, two_intermediate // (2 * GATE_UP_BLOCK), 2 * GATE_UP_BLOCK)
        .contiguous()
    )
