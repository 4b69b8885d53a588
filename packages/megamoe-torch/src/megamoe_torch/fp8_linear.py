"""BlockFP8Linear: a bias-free linear layer holding an e4m3 weight with one float32 scale per
128 x 128 block, as the FP8 checkpoints of DeepSeek-V3 and Qwen3 store their dense projections
(the shared experts of a MegaMoE with shared_weight_dtype="fp8")."""

from __future__ import annotations

import math

import torch
from megamoe_kernels import dequantize_weight_blocks, quantize_weight_blocks, weight_scales_shape
from megamoe_runtime.weights import FP8_WEIGHT_DTYPE
from torch import nn

from megamoe_torch.tensor_cache import DerivedTensorCache


class BlockFP8Linear(nn.Module):
    """y = x W^T, W the values `weight` (e4m3 [out, in], not trained) and `weight_scale_inv`
    (float32 [ceil(out/128), ceil(in/128)], value = e4m3 x scale) stand for: the names and
    layout of an FP8 checkpoint's linear layer.

    The forward computes in the input's dtype with the weight dequantized into it; the
    dequantized weight is kept until the weight, its scales or the input's dtype or device
    change, so a forward costs what an unquantized layer's does (and the memory of one more
    weight in that dtype). A full-precision `weight` loaded without its scales is quantized per
    block as it loads (each block's amax / 448).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=FP8_WEIGHT_DTYPE),
            requires_grad=False,
        )
        _, scale_rows, scale_columns = weight_scales_shape((1, out_features, in_features))
        self.register_buffer(
            "weight_scale_inv",
            torch.empty(scale_rows, scale_columns, device=device, dtype=torch.float32),
        )
        self.register_load_state_dict_pre_hook(_quantize_loaded_weight)
        self._dequantized = DerivedTensorCache()
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's default initialisation, quantized."""
        bound = 1 / math.sqrt(self.in_features)
        values = torch.empty(self.weight.shape, device=self.weight.device, dtype=torch.float32)
        self.load_weight(values.uniform_(-bound, bound))

    @torch.no_grad()
    def load_weight(self, values: torch.Tensor) -> None:
        """Quantizes full-precision [out, in] `values` per 128 x 128 block into the layer."""
        if tuple(values.shape) != tuple(self.weight.shape):
            raise ValueError(
                f"weight must have shape {list(self.weight.shape)}, got {list(values.shape)}"
            )
        quantized, scales = quantize_weight_blocks(values.to(self.weight.device).unsqueeze(0))
        self.weight.copy_(quantized[0])
        self.weight_scale_inv.copy_(scales[0])

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The [out, in] values the weight stands for, in `dtype` (float32: exactly)."""
        values = dequantize_weight_blocks(
            self.weight.detach().unsqueeze(0), self.weight_scale_inv.unsqueeze(0), dtype
        )
        return values[0]

    def _weight_in(self, dtype: torch.dtype) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the compiled graph holds the dequantization
            return self.dequantized_weight(dtype)
        return self._dequantized.get(
            (self.weight, self.weight_scale_inv),
            lambda: self.dequantized_weight(dtype),
            context=(self.weight.device, dtype),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self._weight_in(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 128x128"


def quantize_loaded_weights(state_dict: dict[str, torch.Tensor], keys: tuple[str, ...]) -> None:
    """What an FP8 module's load_state_dict pre-hook does with its weights `keys` ([E, N, K] or
    [N, K]): a full-precision weight without its `<key>_scale_inv` is quantized per 128 x 128
    block in `state_dict` (each block's amax / 448); an e4m3 one stays, with its scales."""
    for key in keys:
        scales_key = key + "_scale_inv"
        if key not in state_dict or state_dict[key].dtype == FP8_WEIGHT_DTYPE:
            continue
        if scales_key in state_dict:
            raise ValueError(
                f"{key} is {state_dict[key].dtype} but comes with {scales_key}: an FP8 layer "
                "takes e4m3 weights with their scales, or full-precision weights alone (it "
                "quantizes them)"
            )
        weight = state_dict[key]
        quantized, scales = quantize_weight_blocks(weight if weight.dim() == 3 else weight[None])
        if weight.dim() != 3:
            quantized, scales = quantized[0], scales[0]
        state_dict[key], state_dict[scales_key] = quantized, scales


def _quantize_loaded_weight(
    module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
) -> None:
    quantize_loaded_weights(state_dict, (prefix + "weight",))
