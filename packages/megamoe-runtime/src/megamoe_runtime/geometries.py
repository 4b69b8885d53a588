"""The MoE geometries megamoe is measured on (docs/benchmarks.md), and their arithmetic.

A geometry is a model's MoE layer: its sizes, its routing and its experts' math, as the model
computes them (gpt-oss-120b: a router bias, biases on both expert projections and its clamped
SwiGLU), so that a layer built from it (MegaMoEConfig.from_geometry) measures that model's layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megamoe_kernels import SwiGLU


@dataclass(frozen=True)
class Geometry:
    name: str
    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    scoring: str = "softmax"
    # the top-k weights divided by their sum
    renormalize: bool = True
    num_groups: int = 1
    top_groups: int = 1
    routed_scaling_factor: float = 1.0
    use_correction_bias: bool = False
    num_shared_experts: int = 0
    # the shared experts' output is scaled by sigmoid(x . w_gate) (Qwen2-MoE)
    shared_expert_gate: bool = False
    # the router adds a bias to its logits
    router_bias: bool = False
    # each expert projection adds a per-expert bias
    expert_bias: bool = False
    # the experts' activation; SwiGLU() is silu(gate) * up
    swiglu: SwiGLU = field(default_factory=SwiGLU)

    def expert_flops(self, rows: int) -> float:
        """The expert MLP's FLOPs on `rows` rows: gate-up (2 x 2I x H) + down (2 x H x I)."""
        return 6.0 * rows * self.hidden_size * self.intermediate_size

    def expert_bytes(self, rows: int, active_experts: int, element_bytes: int = 2) -> float:
        """Fewest bytes the expert MLP moves: each active expert's weights once, rows in and out,
        and the intermediate written and read once."""
        weights = 3 * active_experts * self.hidden_size * self.intermediate_size
        activations = 2 * rows * self.hidden_size + 2 * rows * self.intermediate_size
        return float(element_bytes * (weights + activations))

    def fp8_expert_bytes(self, rows: int, active_experts: int) -> float:
        """Fewest bytes the FP8 expert MLP moves: each active expert's e4m3 weights once with
        their float32 scale per 128 x 128 block, the e4m3 rows in, the e4m3 intermediate
        written and read once, and the bf16 rows out (the activations' scales left out)."""
        h, i = self.hidden_size, self.intermediate_size
        weights = 3 * active_experts * h * i * (1 + 4 / (128 * 128))
        activations = rows * h + 2 * rows * i + 2 * rows * h
        return float(weights + activations)


GEOMETRIES: dict[str, Geometry] = {
    geometry.name: geometry
    for geometry in (
        Geometry("qwen3-30b-a3b", 128, 8, 2048, 768),
        Geometry("mixtral-8x7b", 8, 2, 4096, 14336),
        Geometry(
            "dsv3",
            256,
            8,
            7168,
            2048,
            scoring="sigmoid",
            num_groups=8,
            top_groups=4,
            routed_scaling_factor=2.5,
            use_correction_bias=True,
            num_shared_experts=1,
        ),
        Geometry("dsv3-ep8-local", 32, 1, 7168, 2048),
        # Qwen2-57B-A14B: a shared MLP of 20480 (8 routed sizes) under a sigmoid gate, top-8
        # weights not renormalised
        Geometry(
            "qwen2-57b-a14b",
            64,
            8,
            3584,
            2560,
            renormalize=False,
            num_shared_experts=8,
            shared_expert_gate=True,
        ),
        # softmax over the top-4 logits (the renormalised softmax); H = I = 2880 are not
        # multiples of 128
        Geometry(
            "gpt-oss-120b",
            128,
            4,
            2880,
            2880,
            router_bias=True,
            expert_bias=True,
            swiglu=SwiGLU(limit=7.0, alpha=1.702, up_offset=1.0),
        ),
        # small enough for a CPU: the demo's default there
        Geometry("tiny-qwen3", 16, 4, 256, 128),
    )
}

TOKEN_COUNTS = (1, 16, 128, 512, 2048, 8192)

# Limits measured on the H200: a dense bf16 and a dense e4m3 8192^3 product in a burst, the
# HBM copy rate (docs/benchmarks.md, "Roofline floor and targets")
H200_BF16_FLOPS = 788e12
H200_FP8_FLOPS = 1425e12
H200_HBM_BYTES_PER_S = 4.24e12


def roofline_floor_seconds(
    geometry: Geometry, rows: int, active_experts: int, *, weight_dtype: str | None = None
) -> float:
    """The time the expert MLP's FLOPs or its bytes need at the H200's limits, whichever is
    longer: bf16 experts, or FP8 ones (weight_dtype="fp8": e4m3 products, fp8_expert_bytes)."""
    if weight_dtype == "fp8":
        return max(
            geometry.expert_flops(rows) / H200_FP8_FLOPS,
            geometry.fp8_expert_bytes(rows, active_experts) / H200_HBM_BYTES_PER_S,
        )
    return max(
        geometry.expert_flops(rows) / H200_BF16_FLOPS,
        geometry.expert_bytes(rows, active_experts) / H200_HBM_BYTES_PER_S,
    )
