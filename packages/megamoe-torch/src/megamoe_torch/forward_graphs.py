"""Small eager forwards replayed from CUDA graphs the layer captures itself.

An eager forward of the fused path issues five or more launches, each a few microseconds of
Python and TVM-FFI on the host, plus the router GEMM's dispatch through torch: 100-540 us of
host time per forward measured on the H200 host, several times the GPU time of a decode step.
A replay costs the host a copy of the tokens in, one `cudaGraphLaunch` and a copy of the
output out (43-177 us measured; docs/benchmarks.md).

`ForwardGraphs.forward(layer, x_TH, router_logits=...)` returns (y_TH, router_logits_TE or
None), fresh tensors, or None where the forward should run eagerly. Graphs are kept per (tokens,
device, the caller's stream, the identity and version of every parameter and buffer of the
layer): the first forward of a key runs eagerly (it compiles the kernels and warms the caches
the capture records), the second captures, the later ones replay. Any change to a weight (in
place, replaced, moved) changes the key, so a replay never reads stale prepared weights. At
most `MAX_GRAPHS` graphs per layer, the least recently used dropped first.

The graphs of one (device, stream), every layer's, share one memory pool while one of them
lives: replays on one stream never overlap, and each graph's static input and outputs stay
allocated while it lives, so a capture only reuses the pool's memory that no live graph's
inputs or outputs hold.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from megamoe_torch.tensor_cache import tensor_versions

MAX_GRAPHS = 16
# token counts seen once and not captured (yet), remembered for their second forward
MAX_SEEN = 64

# the live graphs captured for each (device, stream): a capture shares the memory pool of one
# of them (a pool none of whose graphs lives is never handed out again)
_LIVE_GRAPHS: dict[tuple[int, int], weakref.WeakSet] = {}


def _shared_pool(device_index: int, stream: int) -> tuple:
    for graph in _LIVE_GRAPHS.get((device_index, stream), ()):
        return graph.pool()
    return torch.cuda.graph_pool_handle()


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    x_TH: torch.Tensor
    y_TH: torch.Tensor
    router_logits_TE: torch.Tensor


class ForwardGraphs:
    """The captured forwards of one layer (see the module docstring), of up to `max_tokens`
    tokens. A capture records `layer._fused_forward_from_tokens(x_TH)`, which computes
    (y_TH, router_logits_TE) as an eager forward does; the layer decides which forwards may be
    captured (the fused path on one GPU, no autograd, no outer capture or compile, no
    host-synchronising checks). A copy or a pickle of the layer starts with no graphs.

    The layer comes with each call rather than being held: a layer and its graphs form no
    reference cycle, so a dropped layer's graphs are destroyed when its last reference goes,
    never by the cycle collector in the middle of another capture (destroying a graph there
    invalidates that capture)."""

    def __init__(self, *, max_tokens: int):
        self.max_tokens = max_tokens
        self._forget()

    def _forget(self) -> None:
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._modules: tuple = ()
        self._tensor_slots: list[tuple[dict, str]] = []

    def __getstate__(self) -> dict:
        return {"max_tokens": self.max_tokens}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._forget()

    def __len__(self) -> int:
        return len(self._graphs)

    def clear(self) -> None:
        """Drops every graph (their memory returns to the pool)."""
        self._forget()

    def _weights_signature(self, layer: torch.nn.Module) -> tuple:
        """(address, version) of each parameter and buffer the forward may read: any change
        to one gives another signature (the slots are listed once, while the layer's
        submodules stay the same objects)."""
        modules = tuple(layer._modules.values())
        if len(modules) != len(self._modules) or any(
            a is not b for a, b in zip(modules, self._modules, strict=True)
        ):
            self._modules = modules
            self._tensor_slots = [
                (container, name)
                for module in layer.modules()
                for container in (module._parameters, module._buffers)
                for name in container
            ]
        return tensor_versions(container[name] for container, name in self._tensor_slots)

    def forward(
        self, layer: torch.nn.Module, x_TH: torch.Tensor, *, router_logits: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        tokens = x_TH.shape[0]
        if not 0 < tokens <= self.max_tokens:
            return None
        device = x_TH.device
        stream = torch._C._cuda_getCurrentRawStream(device.index)
        key = (tokens, device.index, stream, self._weights_signature(layer))
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:
                self._seen[key] = None
                if len(self._seen) > MAX_SEEN:
                    self._seen.popitem(last=False)
                return None
            del self._seen[key]
            entry = self._capture(layer, x_TH, device.index, stream)
            self._graphs[key] = entry
            if len(self._graphs) > MAX_GRAPHS:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        entry.x_TH.copy_(x_TH)
        entry.graph.replay()
        # the next replay overwrites the graph's outputs: the caller gets its own
        logits_TE = entry.router_logits_TE.clone() if router_logits else None
        return entry.y_TH.clone(), logits_TE

    def _capture(
        self, layer: torch.nn.Module, x_TH: torch.Tensor, device_index: int, stream: int
    ) -> _Graph:
        static_x_TH = x_TH.clone()
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls during the capture are not an error
        with torch.cuda.graph(
            graph, pool=_shared_pool(device_index, stream), capture_error_mode="thread_local"
        ):
            y_TH, router_logits_TE = layer._fused_forward_from_tokens(static_x_TH)
        _LIVE_GRAPHS.setdefault((device_index, stream), weakref.WeakSet()).add(graph)
        return _Graph(graph, static_x_TH, y_TH, router_logits_TE)
