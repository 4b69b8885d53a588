"""A value derived from tensors, kept until one of them changes.

A tensor changed when it was written in place (its `_version` moved) or replaced (another
storage: its `data_ptr`), so (data_ptr, _version) per tensor is what a derived value is keyed by:
the layer's prepared expert weights and fp32 router weight, BlockFP8Linear's dequantized weight,
and the weight signature the captured forward graphs check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

import torch

Value = TypeVar("Value")


def tensor_versions(tensors: Iterable[torch.Tensor | None]) -> tuple:
    """(data_ptr, _version) of each tensor (None stays None): equal while none of them changed."""
    # a list comprehension: half the time of a generator's tuple (forward_graphs' replay key)
    return tuple([None if t is None else (t.data_ptr(), t._version) for t in tensors])


class DerivedTensorCache(Generic[Value]):
    """Holds `derive()`'s value until the tensors it was derived from (or `context`) change.
    The value it replaces is dropped before `derive()` runs, so that (no caller holding it) its
    memory is free for the new one: prepared expert weights take 21 GB at DeepSeek-V3's size,
    and `megamoe demo` ran an 80 GB GPU out of memory where the old ones were still held while
    the new ones were prepared."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._value: Value | None = None

    def get(
        self,
        tensors: Iterable[torch.Tensor | None],
        derive: Callable[[], Value],
        *,
        context: tuple = (),
    ) -> Value:
        tensors = list(tensors)
        key = (*context, *tensor_versions(tensors))
        if key != self._key:
            self.clear()
            self._value = derive()
            # read again: a derivation may point the tensors at what it made (the layer's
            # routed weights at views of the weights prepared with its shared experts)
            self._key = (*context, *tensor_versions(tensors))
        return self._value  # type: ignore[return-value]

    def clear(self) -> None:
        self._key = self._value = None
