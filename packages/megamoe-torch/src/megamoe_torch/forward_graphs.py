"""Small eager forwards replayed from CUDA graphs the layer captures itself.

An eager forward of the fused path issues five or more launches, each a few microseconds of
Python and TVM-FFI on the host, plus the router GEMM's dispatch through torch: 100-540 us of
host time per forward measured on the H200 host, several times the GPU time of a decode step.
A replay costs the host a copy of the tokens in, one `cudaGraphLaunch` and a copy of the
output out (43-177 us measured; docs/benchmarks.md).

`ForwardGraphs.forward(layer, x, router_logits=...)` returns (y, router_logits_TE or None),
fresh tensors (y in x's shape), or None where the forward should run eagerly. Graphs are kept
per (x's shape, dtype and device, the caller's stream, the identity and version of every
parameter and buffer of the layer) under one layer config: the first forward of a key runs
eagerly (it compiles the kernels and warms the caches the capture records), the second
captures, the later ones replay. Any change to a weight (in place, replaced, moved) changes the
key, so a replay never reads stale prepared weights; a new config (`use_backend`) drops every
graph. At most `MAX_GRAPHS` graphs per layer, the least recently used dropped first.

`ForwardGraphs.replay(layer, x, router_logits=...)` is the layer's lean path, taken before any
other work of a forward that autograd does not record: the replay of a graph already captured
for this key (which the layer's checks admitted when it captured), or None. Its host time is
the key (an address and a version per parameter), the copy in, the graph launch and the copy
out.

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
    x: torch.Tensor  # the static input, in the caller's shape
    y: torch.Tensor  # the static output, a view in the caller's shape
    router_logits_TE: torch.Tensor

    def run(self, x: torch.Tensor, router_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.x.copy_(x)
        self.graph.replay()
        # the next replay overwrites the graph's outputs: the caller gets its own
        logits_TE = self.router_logits_TE.clone() if router_logits else None
        return self.y.clone(), logits_TE


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
        self._config = None  # the layer config the graphs were captured under
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

    def _key(self, layer: torch.nn.Module, x: torch.Tensor, device_index: int) -> tuple:
        stream = torch._C._cuda_getCurrentRawStream(device_index)
        return (x.shape, x.dtype, device_index, stream, self._weights_signature(layer))

    def replay(
        self, layer: torch.nn.Module, x: torch.Tensor, *, router_logits: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The replay of the graph captured for this forward's key, or None (no graph yet, another
        config, a CPU tensor, or the caller's stream capturing a graph of its own)."""
        if not self._graphs or layer.config is not self._config:
            return None
        device_index = x.get_device()
        if device_index < 0:
            return None
        entry = self._graphs.get(self._key(layer, x, device_index))
        if entry is None or torch.cuda.is_current_stream_capturing():
            return None
        return entry.run(x, router_logits)

    def forward(
        self, layer: torch.nn.Module, x: torch.Tensor, *, router_logits: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """A forward the layer admitted for graphs: replayed, captured (the second forward of its
        key) or None (the first: run it eagerly)."""
        if not 0 < x.numel() // layer.config.hidden_size <= self.max_tokens:
            return None
        if layer.config is not self._config:
            self._forget()
            self._config = layer.config
        device_index = x.get_device()
        stream = torch._C._cuda_getCurrentRawStream(device_index)
        key = self._key(layer, x, device_index)
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:
                self._seen[key] = None
                if len(self._seen) > MAX_SEEN:
                    self._seen.popitem(last=False)
                return None
            del self._seen[key]
            entry = self._capture(layer, x, device_index, stream)
            self._graphs[key] = entry
            if len(self._graphs) > MAX_GRAPHS:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        return entry.run(x, router_logits)

    def _capture(
        self, layer: torch.nn.Module, x: torch.Tensor, device_index: int, stream: int
    ) -> _Graph:
        static_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        static_x.copy_(x)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA calls during the capture are not an error
        with torch.cuda.graph(
            graph, pool=_shared_pool(device_index, stream), capture_error_mode="thread_local"
        ):
            y_TH, router_logits_TE = layer._fused_forward_from_tokens(
                static_x.view(-1, layer.config.hidden_size)
            )
        _LIVE_GRAPHS.setdefault((device_index, stream), weakref.WeakSet()).add(graph)
        return _Graph(graph, static_x, y_TH.view(x.shape), router_logits_TE)
