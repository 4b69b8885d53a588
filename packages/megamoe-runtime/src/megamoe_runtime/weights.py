"""Expert weight packs and their checks.

Shape legend: E experts, I intermediate size, H hidden size.
`w13_E2IH` holds each expert's gate rows [0, I) then up rows [I, 2I); `w2_EHI` the down projection.
Ungated experts (`activation="relu2"`, Nemotron-H: down(relu(up x)^2)) hold their up rows alone
in `w13_E2IH`, [E, I, H].
Backends transform a pack into their own layout once (ExpertBackend.prepare) and cache it.

- `Unquantized`: bf16/fp16/fp32 weights, optionally with per-expert biases (`w13_bias_E2I`
  [E, 2I] in w13's row order, `w2_bias_EH` [E, H]) and a SwiGLU other than silu(gate) * up
  (`swiglu`, megamoe_kernels.SwiGLU: gpt-oss's clamped one, Inkling2's softcapped one), or
  ungated relu^2 experts (`activation`): the expert math a backend computes from the pack
  (`expert_math` names what a pack holds of it; the backends that lack it refuse such a pack
  in `prepare`).
- `Prequantized`: e4m3 weights with one float32 scale per 128 x 128 block (value = e4m3 x
  scale: the `weight_scale_inv` of DeepSeek-V3's and Qwen3's FP8 checkpoints), the blocks of
  w13 over its stored rows (gate rows, then up rows), and the experts' SwiGLU (clamped,
  softcapped or GeGLU as Unquantized's; no biases, gated experts). `quantize` makes one from an
  Unquantized pack (deterministic: each block's amax / 448); `dequantize` gives the values it
  stands for.
- `with_dense_experts(pack, ...)`: the pack with a dense SwiGLU MLP (shared experts) appended as
  experts of the routed size, for a batch whose last experts every token visits (an FP8 pack
  with an e4m3 MLP and its block scales).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from megamoe_kernels import FP8_DTYPE, SwiGLU, weight_scales_shape
from megamoe_kernels.shim.fp8 import WEIGHT_BLOCK

FP8_WEIGHT_DTYPE = FP8_DTYPE
# the experts' activations: "swiglu", gated, swiglu(gate x, up x); "relu2", ungated, relu(up x)^2
ACTIVATIONS = ("swiglu", "relu2")
# how `Unquantized.expert_math` names ungated relu^2 experts (the cutedsl backend refuses them
# by this name) and a softcapped SwiGLU
UNGATED_RELU2 = "ungated relu^2 experts"
SOFTCAPPED_SWIGLU = "softcapped SwiGLU"


@dataclass(frozen=True)
class Unquantized:
    """BF16/FP16/FP32 expert weights in the model's own layout, their optional biases (in the
    weights' dtype or float32) and the experts' activation: the SwiGLU of gated experts, or
    ungated relu^2 (`activation="relu2"`: w13 holds the up rows alone, [E, I, H])."""

    w13_E2IH: torch.Tensor
    w2_EHI: torch.Tensor
    w13_bias_E2I: torch.Tensor | None = None
    w2_bias_EH: torch.Tensor | None = None
    swiglu: SwiGLU = field(default_factory=SwiGLU)
    activation: str = "swiglu"

    def __post_init__(self) -> None:
        _check_weights(self.w13_E2IH, self.w2_EHI, swiglu=self.swiglu, activation=self.activation)
        if not self.w13_E2IH.is_floating_point() or self.w13_E2IH.dtype.itemsize < 2:
            raise TypeError(
                "w13 and w2 must be full-precision floating point, such as bfloat16, float16 or "
                f"float32 (e4m3 weights with their block scales: Prequantized), got "
                f"{self.w13_E2IH.dtype}"
            )
        experts, two_intermediate, hidden = self.w13_E2IH.shape
        biases = {
            "w13_bias_E2I": (self.w13_bias_E2I, (experts, two_intermediate)),
            "w2_bias_EH": (self.w2_bias_EH, (experts, hidden)),
        }
        for name, (bias, shape) in biases.items():
            if bias is None:
                continue
            if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != shape:
                got = tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
                raise ValueError(f"{name} must have shape {shape} to match the weights, got {got}")
            if not bias.is_floating_point() or bias.device != self.w13_E2IH.device:
                raise ValueError(
                    f"{name} must be a float tensor on the weights' device "
                    f"({self.w13_E2IH.device}), got {bias.dtype} on {bias.device}"
                )

    @property
    def expert_math(self) -> tuple[str, ...]:
        """What the pack holds beyond bias-free silu(gate) * up experts: () when nothing."""
        biased = self.w13_bias_E2I is not None or self.w2_bias_EH is not None
        return _expert_math(self.swiglu, biased=biased, gated=self.gated)

    @property
    def gated(self) -> bool:
        """Whether the experts are gated (w13 holds gate and up rows)."""
        return self.activation == "swiglu"

    @property
    def num_experts(self) -> int:
        return self.w13_E2IH.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13_E2IH.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w13_E2IH.shape[1] // 2 if self.gated else self.w13_E2IH.shape[1]


@dataclass(frozen=True)
class Prequantized:
    """FP8 expert weights: e4m3 `w13_E2IH` [E, 2I, H] and `w2_EHI` [E, H, I] with float32 block
    scales `w13_scales` [E, ceil(2I/128), ceil(H/128)] and `w2_scales` [E, ceil(H/128),
    ceil(I/128)], and the experts' SwiGLU (gated experts)."""

    w13_E2IH: torch.Tensor
    w13_scales: torch.Tensor
    w2_EHI: torch.Tensor
    w2_scales: torch.Tensor
    swiglu: SwiGLU = field(default_factory=SwiGLU)

    def __post_init__(self) -> None:
        for name in ("w13_E2IH", "w2_EHI"):
            tensor = getattr(self, name)
            if not isinstance(tensor, torch.Tensor) or tensor.dtype != FP8_WEIGHT_DTYPE:
                got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise TypeError(f"{name} must be {FP8_WEIGHT_DTYPE}, got {got}")
        _check_weights(self.w13_E2IH, self.w2_EHI, swiglu=self.swiglu, activation="swiglu")
        expected = {
            "w13_scales": weight_scales_shape(self.w13_E2IH.shape),
            "w2_scales": weight_scales_shape(self.w2_EHI.shape),
        }
        for name, shape in expected.items():
            scales = getattr(self, name)
            if (
                not isinstance(scales, torch.Tensor)
                or scales.dtype != torch.float32
                or tuple(scales.shape) != shape
            ):
                got = (
                    f"{scales.dtype} {list(scales.shape)}"
                    if isinstance(scales, torch.Tensor)
                    else type(scales).__name__
                )
                raise ValueError(
                    f"{name} must be float32 {list(shape)} (one scale per 128 x 128 block), "
                    f"got {got}"
                )
            if scales.device != self.w13_E2IH.device:
                raise ValueError(
                    f"{name} is on {scales.device}, the weights on {self.w13_E2IH.device}"
                )

    @property
    def num_experts(self) -> int:
        return self.w13_E2IH.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13_E2IH.shape[2]

    @property
    def intermediate_size(self) -> int:
        return self.w13_E2IH.shape[1] // 2

    @property
    def expert_math(self) -> tuple[str, ...]:
        """What the pack holds beyond silu(gate) * up experts: () when nothing."""
        return _expert_math(self.swiglu, biased=False, gated=True)


WeightPack = Unquantized | Prequantized


def _check_weights(
    w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor, *, swiglu: SwiGLU, activation: str
) -> None:
    """The rules of every pack's weights and activation: w13 [E, 2I, H] ([E, I, H] ungated) and
    w2 [E, H, I] of one dtype on one device, a megamoe_kernels.SwiGLU, none with relu^2."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if not isinstance(swiglu, SwiGLU):
        raise TypeError(f"swiglu must be a megamoe_kernels.SwiGLU, got {type(swiglu).__name__}")
    gated = activation == "swiglu"
    if not gated and not swiglu.is_plain:
        raise ValueError(f"ungated relu^2 experts take no SwiGLU, got {swiglu}")
    first = "[E, 2I, H]" if gated else "[E, I, H]"
    if w13_E2IH.dim() != 3 or w2_EHI.dim() != 3:
        raise ValueError(
            f"w13 must be {first} and w2 [E, H, I]; got {tuple(w13_E2IH.shape)} "
            f"and {tuple(w2_EHI.shape)}"
        )
    experts, rows, hidden = w13_E2IH.shape
    if gated and rows % 2:
        raise ValueError(f"w13's second dim must be 2 * intermediate, got {rows}")
    expected_w2 = (experts, hidden, rows // 2 if gated else rows)
    if tuple(w2_EHI.shape) != expected_w2:
        raise ValueError(
            f"w2 must have shape {expected_w2} to match w13, got {tuple(w2_EHI.shape)}"
        )
    if w13_E2IH.dtype != w2_EHI.dtype or w13_E2IH.device != w2_EHI.device:
        raise ValueError("w13 and w2 must share dtype and device")


def _expert_math(swiglu: SwiGLU, *, biased: bool, gated: bool) -> tuple[str, ...]:
    """What experts compute beyond bias-free silu(gate) * up, by the names the backends refuse
    them by: () when nothing."""
    features = []
    if biased:
        features.append("per-expert biases")
    if swiglu.softcapped:
        features.append(SOFTCAPPED_SWIGLU)
    if swiglu.clamped:
        features.append(f"a clamped/scaled SwiGLU ({swiglu})")
    if not gated:
        features.append(UNGATED_RELU2)
    return tuple(features)


def quantize(weights: Unquantized) -> Prequantized:
    """e4m3 weights with per-128x128-block scales (amax / 448), deterministic on any device."""
    from megamoe_kernels import quantize_weight_blocks

    unbuilt = [
        name
        for name, held in (
            (
                "per-expert biases",
                weights.w13_bias_E2I is not None or weights.w2_bias_EH is not None,
            ),
            (UNGATED_RELU2, not weights.gated),
        )
        if held
    ]
    if unbuilt:
        raise ValueError(
            "an FP8 pack holds gated experts' weights, their scales and their SwiGLU: these "
            f"experts have {', '.join(unbuilt)}, which the FP8 kernels are not built for"
        )
    w13, w13_scales = quantize_weight_blocks(weights.w13_E2IH)
    w2, w2_scales = quantize_weight_blocks(weights.w2_EHI)
    return Prequantized(
        w13_E2IH=w13,
        w13_scales=w13_scales,
        w2_EHI=w2,
        w2_scales=w2_scales,
        swiglu=weights.swiglu,
    )


def dequantize(weights: Prequantized, dtype: torch.dtype = torch.float32) -> Unquantized:
    """The values an FP8 pack stands for, in `dtype` (float32: exactly)."""
    from megamoe_kernels import dequantize_weight_blocks

    return Unquantized(
        w13_E2IH=dequantize_weight_blocks(weights.w13_E2IH, weights.w13_scales, dtype),
        w2_EHI=dequantize_weight_blocks(weights.w2_EHI, weights.w2_scales, dtype),
        swiglu=weights.swiglu,
    )


def with_dense_experts(
    weights: WeightPack,
    *,
    gate_FH: torch.Tensor,
    up_FH: torch.Tensor,
    down_HF: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> WeightPack:
    """`weights` and, after its E experts, a dense SwiGLU MLP down(silu(gate x) * up x) of
    intermediate size F cut into S = F / I experts of the routed experts' size I: expert E + s
    computes columns [s I, (s + 1) I) of the MLP, so the S experts' outputs sum to the MLP's.
    A new pack (the routed weights copied once); bias-free plain-SwiGLU experts only.

    A Prequantized pack takes an e4m3 MLP with its float32 128 x 128 block scales, `scales` =
    (gate [F/128, ceil(H/128)], up [F/128, ceil(H/128)], down [ceil(H/128), F/128]), as FP8
    checkpoints hold them: each of the S experts takes its rows of blocks as they are, so I
    must be a multiple of 128 (no block straddles two experts)."""
    _, two_intermediate, hidden = weights.w13_E2IH.shape
    intermediate = two_intermediate // 2
    dense = gate_FH.shape[0]
    if weights.expert_math:
        raise ValueError(
            f"dense experts join bias-free silu(gate) * up experts; these have "
            f"{', '.join(weights.expert_math)}"
        )
    shapes = {"gate": (gate_FH, (dense, hidden)), "up": (up_FH, (dense, hidden))}
    shapes["down"] = (down_HF, (hidden, dense))
    for name, (tensor, shape) in shapes.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")
    if dense % intermediate:
        raise ValueError(
            f"the dense MLP's intermediate size {dense} is not a multiple of the experts' "
            f"{intermediate}"
        )
    quantized = isinstance(weights, Prequantized)
    if quantized != (scales is not None):
        raise ValueError(
            "an FP8 pack takes the dense MLP's e4m3 weights with their block scales (scales=)"
            if quantized
            else "scales= come with an FP8 (Prequantized) pack; this one is full precision"
        )
    pieces = dense // intermediate
    w13_S2IH = torch.cat(
        (
            gate_FH.reshape(pieces, intermediate, hidden),
            up_FH.reshape(pieces, intermediate, hidden),
        ),
        dim=1,
    )
    w2_SHI = down_HF.reshape(hidden, pieces, intermediate).permute(1, 0, 2)
    if not quantized:
        dtype = weights.w13_E2IH.dtype
        return Unquantized(
            w13_E2IH=torch.cat((weights.w13_E2IH, w13_S2IH.to(dtype))),
            w2_EHI=torch.cat((weights.w2_EHI, w2_SHI.to(dtype))),
            swiglu=weights.swiglu,
        )
    if intermediate % WEIGHT_BLOCK:
        raise ValueError(
            f"FP8 dense experts of intermediate size {intermediate} would split 128 x 128 scale "
            f"blocks between experts: it must be a multiple of {WEIGHT_BLOCK}"
        )
    for (name, (tensor, shape)), scale in zip(shapes.items(), scales, strict=True):
        if tensor.dtype != FP8_WEIGHT_DTYPE:
            raise TypeError(
                f"{name} must be {FP8_WEIGHT_DTYPE} for an FP8 pack, got {tensor.dtype}"
            )
        scale_shape = weight_scales_shape((1, *shape))[1:]  # a one-expert weight's blocks
        if tuple(scale.shape) != scale_shape or scale.dtype != torch.float32:
            raise ValueError(
                f"the {name} scales must be float32 {list(scale_shape)} (one per 128 x 128 "
                f"block), got {scale.dtype} {list(scale.shape)}"
            )
    gate_scales, up_scales, down_scales = scales
    blocks, hidden_blocks = intermediate // WEIGHT_BLOCK, down_scales.shape[0]
    w13_scales_S = torch.cat(
        (
            gate_scales.reshape(pieces, blocks, hidden_blocks),
            up_scales.reshape(pieces, blocks, hidden_blocks),
        ),
        dim=1,
    )
    w2_scales_S = down_scales.reshape(hidden_blocks, pieces, blocks).permute(1, 0, 2)
    return Prequantized(
        w13_E2IH=torch.cat((weights.w13_E2IH, w13_S2IH)),
        w13_scales=torch.cat((weights.w13_scales, w13_scales_S)),
        w2_EHI=torch.cat((weights.w2_EHI, w2_SHI)),
        w2_scales=torch.cat((weights.w2_scales, w2_scales_S)),
        swiglu=weights.swiglu,
    )
