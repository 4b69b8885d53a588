"""Swap every supported MoE block of a loaded transformers model for a MegaMoE, in place.

The swapped module answers as the block did (the reading's `answer`): the hidden states, or a
pair of them and the router logits (4.x Mixtral and Qwen, Granite-MoE, Jamba, ...) or the top-k
routing weights, in the block's output shape. transformers >= 5 models record router logits with a
forward hook on the router class (`output_router_logits`): a weightless module of the original
router's class stands in the swapped block and hands those hooks the logits where the router's
own output held them; hooks already installed on the block or its router move along.

A swapped block saves and loads under the replaced block's names and layout (see checkpoint.py),
and `unswap_moe_blocks` puts the transformers blocks back with the current weights.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from megamoe_runtime.routing import route
from torch import nn

from megamoe_torch.hf.checkpoint import keep_hf_checkpoint_format, restored_hf_block
from megamoe_torch.hf.convert import convert_block
from megamoe_torch.hf.families import (
    Answer,
    BlockReading,
    Layout,
    OutputShape,
    UnsupportedBlockError,
    moe_blocks,
)
from megamoe_torch.hf.naming import BlockNaming
from megamoe_torch.layer import MegaMoE


class SwappedMoEBlock(MegaMoE):
    """A MegaMoE standing where a transformers MoE block stood, answering as that block did.

    Its state_dict() and load_state_dict() use the replaced block's Hugging Face names and
    layout (`hf_naming`, `hf_layout`); `hf_checkpoint_format = False` gives megamoe's own.
    """

    hf_answer: Answer = "hidden"
    hf_output_shape: OutputShape = "input"
    hf_router_logits_float32: bool = False
    hf_naming: BlockNaming
    hf_layout: Layout
    hf_checkpoint_format: bool = True
    # the inputs the replaced block's forward took besides the hidden states (the token ids
    # of DeepSeek-V4's blocks, which its hash layers route by)
    hf_inputs: tuple[str, ...] = ()

    def forward(self, hidden_states: torch.Tensor, **inputs):
        unknown = sorted(set(inputs) - set(self.hf_inputs))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}.forward() got inputs {unknown} the replaced block did "
                f"not take (it took {list(self.hf_inputs)} besides the hidden states)"
            )
        y, router_logits = super().forward(
            hidden_states, input_ids=inputs.get("input_ids"), return_router_logits=True
        )
        if self.hf_router_logits_float32:
            router_logits = router_logits.float()
        probe = self._modules.get("router_logits_probe")
        if probe is not None:
            probe(router_logits)
        second = router_logits
        if self.hf_answer == "hidden_and_topk_weights":
            # gpt-oss answers its top-k routing weights too (its decoder layer drops them): the
            # routing again, on the same logits, rather than a second output of every forward
            _, topk_weights_TK = route(
                router_logits, self.config.router, correction_bias_E=self.e_score_correction_bias
            )
            second = topk_weights_TK.to(router_logits.dtype)
        if self.hf_output_shape == "tokens":
            y = y.reshape(-1, y.shape[-1])
        elif self.hf_output_shape == "flat":
            y, second = y.reshape(-1), second.reshape(-1)
        if self.hf_answer != "hidden":
            return y, second
        return y


@dataclass(frozen=True)
class SwappedEntry:
    name: str
    family: str
    layout: str
    backend: str
    # what the block computes (BlockReading.describe)
    computes: str = ""
    # the routed experts' weights: "fp8" (e4m3, 128 x 128 block scales) or their torch dtype
    experts: str = ""


@dataclass(frozen=True)
class SkippedEntry:
    name: str
    class_name: str
    reason: str


@dataclass
class SwapReport:
    """Which MoE blocks of a model were swapped for MegaMoE, and which were not and why."""

    swapped: list[SwappedEntry] = field(default_factory=list)
    skipped: list[SkippedEntry] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"swapped {len(self.swapped)} MoE block(s), skipped {len(self.skipped)}"]
        lines += [
            f"  swapped {e.name}: {e.family} ({e.layout} layout) on {e.backend}, "
            f"{e.experts.removeprefix('torch.')} experts: {e.computes}"
            for e in self.swapped
        ]
        lines += [f"  skipped {e.name} ({e.class_name}): {e.reason}" for e in self.skipped]
        if self.skipped:
            lines.append(
                "  (a skipped block's experts may still compute on megamoe: "
                "register_experts_implementation(), then "
                'model.set_experts_implementation("megamoe"))'
            )
        return "\n".join(lines)


def swap_moe_blocks(
    model: nn.Module,
    *,
    backend: str = "auto",
    weight_dtype: str | None = "auto",
    **options: Any,
) -> SwapReport:
    """Replaces every supported MoE block of `model` with a MegaMoE computing the same, in place.

    A block megamoe cannot reproduce exactly is left as it is and listed in the report's
    `skipped` with the reason; a model with no MoE block at all gets a warning.
    `weight_dtype`: "auto" (the experts' precision as the blocks hold them: a model loaded from
    an FP8 checkpoint keeps its e4m3 experts and their scales), "fp8" (quantized per 128 x 128
    block where they are not), or None (the activations' dtype, e4m3 experts dequantized).
    Each block is let go once its layer is in place, so a swap that makes new expert tensors
    needs room for one block's beyond the model.
    `options`: see `from_hf` (capacity, check_inputs, process_group, ...).

    The swapped model's state_dict() holds the original Hugging Face names and layout, so
    `save_pretrained` writes a checkpoint the unswapped model class loads, and load_state_dict()
    takes the original model's state dict. Expert-parallel layers (`process_group`) load such a
    state dict (keeping their rank's experts) but raise on state_dict(): a Hugging Face block
    holds every expert. `unswap_moe_blocks` undoes the swap.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    report = SwapReport()
    blocks = moe_blocks(model)
    if not blocks and not any(isinstance(m, SwappedMoEBlock) for m in model.modules()):
        warnings.warn(
            f"swap_moe_blocks found no MoE block in {type(model).__name__}, so nothing was "
            "swapped: megamoe looks for modules holding a router child (`gate` or `router`) next "
            "to routed experts (`experts`)",
            stacklevel=2,
        )
    # popped, so that nothing here holds a block once its layer stands in the model
    while blocks:
        name, block = blocks.pop(0)
        class_name = type(block).__name__
        try:
            swapped, reading = convert_block(
                block,
                layer_class=SwappedMoEBlock,
                options={"backend": backend, **options},
                weight_dtype=weight_dtype,
            )
            _answer_like(swapped, block, reading)
            keep_hf_checkpoint_format(
                swapped,
                block,
                naming=reading.naming,
                layout=reading.layout,
                router_name=reading.router_name,
            )
        except UnsupportedBlockError as error:
            report.skipped.append(SkippedEntry(name, class_name, str(error)))
            continue
        swapped.train(block.training)
        if not any(p.requires_grad for p in block.parameters()):
            swapped.requires_grad_(False)
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, swapped)
        report.swapped.append(
            SwappedEntry(
                name,
                reading.family,
                reading.layout,
                swapped.backend,
                reading.describe(),
                experts="fp8" if swapped.config.weight_dtype == "fp8" else str(swapped.w13.dtype),
            )
        )
    return report


def unswap_moe_blocks(model: nn.Module) -> list[str]:
    """Puts back the transformers block in place of every swapped one, in place; their names.

    Each block gets the swapped layer's current weights (shared, not copied), its training mode,
    and the forward hooks now on the layer and its router stand-in. Raises for expert-parallel
    layers, which hold only their rank's experts.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    swapped = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, SwappedMoEBlock)
    ]
    # every block first: an expert-parallel layer raises before the model is changed
    blocks = [restored_hf_block(layer) for _, layer in swapped]
    for (name, layer), block in zip(swapped, blocks, strict=True):
        probe = layer._modules.get("router_logits_probe")
        if probe is not None:
            _move_hooks(probe, block.gate, pre=False)
        _move_hooks(layer, block, pre=True)
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, block)
    return [name for name, _ in swapped]


def _answer_like(swapped: SwappedMoEBlock, block: nn.Module, reading: BlockReading) -> None:
    swapped.hf_answer = reading.answer
    swapped.hf_output_shape = reading.output_shape
    swapped.hf_router_logits_float32 = reading.router_logits_float32
    swapped.hf_inputs = reading.inputs
    router = getattr(block, reading.router_name)
    if _has_hooks(router, "_forward_pre_hooks"):
        raise UnsupportedBlockError(
            "the router has forward pre-hooks, which would see other inputs after the swap"
        )
    if reading.router_logits_index is not None and not isinstance(router, nn.Linear):
        probe_class = _router_logits_probe_class(
            type(router), index=reading.router_logits_index, outputs=reading.router_outputs
        )
        swapped.router_logits_probe = probe_class()
        _move_hooks(router, swapped.router_logits_probe, pre=False)
    elif _has_hooks(router, "_forward_hooks"):
        raise UnsupportedBlockError(
            "the router has forward hooks and no stand-in of its class can carry them"
        )
    _move_hooks(block, swapped, pre=True)


_PROBE_CLASSES: dict[tuple[type, int, int], type] = {}


def _router_logits_probe_class(router_class: type, *, index: int, outputs: int) -> type:
    """A weightless module of the router's class whose forward hands the logits to hooks.

    transformers records router logits with a hook on every instance of the router class (an
    instance of a subclass is found by the same isinstance test), reading them at the position
    the router's own output holds them: `index` of `outputs` values (a bare tensor for 1).
    """
    key = (router_class, index, outputs)
    if key not in _PROBE_CLASSES:

        def __init__(self) -> None:
            nn.Module.__init__(self)

        def forward(self, router_logits: torch.Tensor):
            if outputs == 1:
                return router_logits
            answer: list = [None] * outputs
            answer[index] = router_logits
            return tuple(answer)

        _PROBE_CLASSES[key] = type(
            f"{router_class.__name__}LogitsProbe",
            (router_class,),
            {
                "__init__": __init__,
                "forward": forward,
                "__module__": __name__,
                # transformers' weight init would look for the router's weight: there is none
                "_is_hf_initialized": True,
            },
        )
    return _PROBE_CLASSES[key]


def _has_hooks(module: nn.Module, registry: str) -> bool:
    return bool(getattr(module, registry))


def _move_hooks(source: nn.Module, target: nn.Module, *, pre: bool) -> None:
    """Re-registers `source`'s forward hooks (and pre-hooks if `pre`) on `target`."""
    for hook_id, hook in source._forward_hooks.items():
        target.register_forward_hook(
            hook,
            with_kwargs=hook_id in source._forward_hooks_with_kwargs,
            always_call=hook_id in source._forward_hooks_always_called,
        )
    if pre:
        for hook_id, hook in source._forward_pre_hooks.items():
            target.register_forward_pre_hook(
                hook, with_kwargs=hook_id in source._forward_pre_hooks_with_kwargs
            )
