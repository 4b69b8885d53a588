"""A model's MoE block built from its config alone, to read a checkpoint's tensors by.

transformers builds the model on the meta device (no memory, no weights); the block of the
requested layer is read by its structure (reader.py) and says where its tensors sit in the
checkpoint: the module path of the block, its tensors' names and layout. Checkpoints on disk may
name tensors otherwise than the modules in memory do: transformers' own renamings for the model
(the ones from_pretrained applies) map the checkpoint's keys first. Its other loading
conversions are not applied; the per-expert tensors they merge are read by state_dict.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from megamoe_torch.hf.families import BlockReading, UnsupportedBlockError, moe_blocks
from megamoe_torch.hf.reader import read_block

# the model classes tried, in order, for a config (text models first, then multimodal ones)
_AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForImageTextToText", "AutoModel")


def checkpoint_block(
    hf_config: Any, *, layer: int | None, prefix: str | None
) -> tuple[BlockReading, str, Callable[[str], str]]:
    """(the reading of the model's MoE block at `layer`, or under `prefix`, or its first one;
    the block's module path in the model, with a trailing dot; the renaming of a checkpoint key
    into the model's names)."""
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            "reading this model's checkpoint needs transformers (pip install "
            "'megamoe-torch[hf]'), which builds the model's blocks from its config"
        ) from error
    config = _transformers_config(transformers, hf_config)
    model = _meta_model(transformers, config)
    blocks = moe_blocks(model)
    if not blocks:
        raise UnsupportedBlockError(
            f"the {type(model).__name__} built from this config holds no MoE block"
        )
    if prefix is not None:
        wanted = prefix.rstrip(".")
        chosen = [(name, block) for name, block in blocks if wanted.endswith(name)]
        what = f"under prefix {prefix!r}"
    elif layer is not None:
        chosen = [(n, b) for n, b in blocks if re.search(rf"\.{layer}\.", f".{n}.")]
        what = f"in layer {layer}"
    else:
        chosen, what = blocks[:1], "first"
    if not chosen:
        raise ValueError(
            f"the model has no MoE block {what}; its MoE blocks are "
            f"{[name for name, _ in blocks][:8]}"
        )
    name, block = chosen[0]
    return read_block(block, structure_only=True), f"{name}.", _key_renaming(model)


def block_prefix_in(
    state_dict: dict[str, torch.Tensor], *, model_path: str, router_weight: str, layer: int | None
) -> str:
    """Where the block's tensors sit in `state_dict`: at its module path in the model, else at
    the one prefix of the same layer and block name holding its router weight (checkpoints of
    multimodal models name the text model's layers otherwise)."""
    if f"{model_path}{router_weight}" in state_dict:
        return model_path
    block_name = model_path.rstrip(".").rsplit(".", 1)[-1]
    candidates = sorted(
        {
            key[: -len(router_weight)]
            for key in state_dict
            if key.endswith(f".{block_name}.{router_weight}")
            and (layer is None or f".{layer}." in f".{key}")
        }
    )
    if len(candidates) == 1:
        return candidates[0]
    raise ValueError(
        f"state_dict holds no single block at {model_path!r}: {len(candidates)} prefixes hold "
        f"{block_name}.{router_weight} ({candidates[:4]}); pass prefix="
    )


def _key_renaming(model: nn.Module) -> Callable[[str], str]:
    """transformers' renamings of checkpoint keys for `model`; the model's own keys stay (the
    renamings need not leave them alone)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings

        renamings = [
            t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)
        ]
    except (ImportError, AttributeError, TypeError):  # a transformers without them
        return lambda key: key
    model_keys = set(model.state_dict())
    return lambda key: key if key in model_keys else apply_renamings(key, renamings)


def _transformers_config(transformers: Any, hf_config: Any) -> Any:
    if not isinstance(hf_config, dict):
        return hf_config
    fields = {key: value for key, value in hf_config.items() if key != "model_type"}
    try:
        return transformers.AutoConfig.for_model(hf_config.get("model_type"), **fields)
    except ValueError as error:
        raise UnsupportedBlockError(
            f"model_type {hf_config.get('model_type')!r} is not one this transformers "
            f"{transformers.__version__} knows"
        ) from error


def _meta_model(transformers: Any, config: Any) -> nn.Module:
    failures = []
    for class_name in _AUTO_CLASSES:
        try:
            with torch.device("meta"):
                return getattr(transformers, class_name).from_config(config)
        except ValueError as error:  # not a model type of this auto class
            failures.append(f"{class_name}: {error}")
    raise UnsupportedBlockError(
        f"transformers builds no model of {type(config).__name__}: {'; '.join(failures)}"
    )
