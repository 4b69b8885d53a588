"""The input copy of a captured CUDA graph, pointed at each replay's tokens.

A replayed forward must bring the caller's tokens into the graph's static input. A torch
`copy_` before the replay costs the host 9-11 us (one H200 host); this module instead captures
the copy into the graph as its first node (a 1-D device-to-device memcpy) and, before a replay
whose tokens lie at another address than the last, points that node's source at them with
`cudaGraphExecMemcpyNodeSetParams1D` (about 3 us; nothing when the address is the last one's, as
in a loop that reuses its buffers). The update affects later launches only, never one already
enqueued (the runtime's contract), so no replay waits for the one before it. A graph captured
for a bucket of token counts (forward_graphs.py) also changes the copy's length, to the tokens
of each replay, and points a second such node, which copies the count into the device word the
kernels read, at that count's entry of a table of counts.

`CopySource.find(graph, dst, src, nbytes, device_index)` finds the node in a graph captured
with `keep_graph=True` and instantiated; None where the runtime bindings or the node are missing
(the caller then copies with torch, outside the graph). The runtime updates the node on the
current device's context, so an update is made with the graph's device current (as torch's
replay is).
"""

from __future__ import annotations

import torch

try:
    from cuda.bindings import runtime as _cudart
except ImportError:  # pragma: no cover - a declared dependency; without it torch copies
    _cudart = None


def copy_node_updates_available() -> bool:
    """Whether the CUDA runtime bindings that update a graph's memcpy node are importable."""
    return _cudart is not None


class CopySource:
    """The memcpy node of an instantiated graph that copies `nbytes` into `dst`: `point_at(src)`
    makes the graph's next launches copy from `src` (`point_at(src, nbytes)`: that many
    bytes)."""

    def __init__(self, graph_exec, node, *, dst: int, src: int, nbytes: int, device_index: int):
        self._graph_exec = graph_exec
        self._node = node
        self._dst = dst
        self._nbytes = nbytes
        self._device_index = device_index
        self._kind = _cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        self._set_params = _cudart.cudaGraphExecMemcpyNodeSetParams1D
        self.source = src  # the address the node copies from now

    @classmethod
    def find(
        cls, graph: torch.cuda.CUDAGraph, *, dst: int, src: int, nbytes: int, device_index: int
    ) -> CopySource | None:
        """The node of `graph` (captured with keep_graph=True on device `device_index`,
        instantiated) that copies `nbytes` from `src` to `dst`, or None."""
        if _cudart is None:
            return None
        success = _cudart.cudaError_t.cudaSuccess
        raw_graph = _cudart.cudaGraph_t(init_value=graph.raw_cuda_graph())
        error, _, count = _cudart.cudaGraphGetNodes(raw_graph, 0)
        if error != success:
            return None
        error, nodes, count = _cudart.cudaGraphGetNodes(raw_graph, count)
        if error != success:
            return None
        memcpy = _cudart.cudaGraphNodeType.cudaGraphNodeTypeMemcpy
        for node in nodes[:count]:
            error, node_type = _cudart.cudaGraphNodeGetType(node)
            if error != success or node_type != memcpy:
                continue
            error, params = _cudart.cudaGraphMemcpyNodeGetParams(node)
            if (
                error == success
                and int(params.dstPtr.ptr) == dst
                and int(params.srcPtr.ptr) == src
                and params.extent.width == nbytes
                and params.extent.height == params.extent.depth == 1
            ):
                graph_exec = _cudart.cudaGraphExec_t(init_value=graph.raw_cuda_graph_exec())
                return cls(
                    graph_exec, node, dst=dst, src=src, nbytes=nbytes, device_index=device_index
                )
        return None

    def point_at(self, src: int, nbytes: int | None = None) -> bool:
        """Makes the graph's next launches copy from `src` (`nbytes` of device memory of the same
        device, at least 1; None: as many as the last launch); False where the runtime refuses
        it (the node then still copies what it copied last)."""
        nbytes = self._nbytes if nbytes is None else nbytes
        if src == self.source and nbytes == self._nbytes:
            return True
        if torch._C._cuda_getDevice() == self._device_index:
            (error,) = self._set_source(src, nbytes)
        else:
            with torch.cuda.device(self._device_index):
                (error,) = self._set_source(src, nbytes)
        if error != _cudart.cudaError_t.cudaSuccess:
            return False
        self.source, self._nbytes = src, nbytes
        return True

    def _set_source(self, src: int, nbytes: int) -> tuple:
        return self._set_params(self._graph_exec, self._node, self._dst, src, nbytes, self._kind)
