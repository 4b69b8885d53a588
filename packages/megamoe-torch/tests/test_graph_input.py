"""The replayed graph's input copy (graph_input.py): when its source is pointed elsewhere, with
which arguments, on which device, and what a refused update leaves. CPU: the runtime call is
stood in for; the node in a real graph is tested on the GPU (test_forward_graphs.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from megamoe_torch import graph_input
from megamoe_torch.graph_input import CopySource

pytestmark = pytest.mark.skipif(
    not graph_input.copy_node_updates_available(), reason="needs the CUDA runtime bindings"
)


def _copy_source(monkeypatch, *, current_device: int = 1, errors=()):
    """A CopySource of a stand-in node on device 1, its updates recorded."""
    calls = []
    errors = list(errors)
    success = graph_input._cudart.cudaError_t.cudaSuccess

    def set_params(graph_exec, node, dst, src, nbytes, kind):
        calls.append((graph_exec, node, dst, src, nbytes, kind))
        return (errors.pop(0) if errors else success,)

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current_device, raising=False)
    source = CopySource("exec", "node", dst=0x1000, src=0x2000, nbytes=4096, device_index=1)
    source._set_params = set_params
    return source, calls


def test_the_node_is_updated_only_when_the_tokens_moved(monkeypatch):
    source, calls = _copy_source(monkeypatch)
    kind = graph_input._cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
    assert source.point_at(0x2000) and calls == []  # where the capture's tokens lay
    assert source.point_at(0x3000)
    assert calls == [("exec", "node", 0x1000, 0x3000, 4096, kind)]
    assert source.point_at(0x3000) and len(calls) == 1
    assert source.point_at(0x2000) and calls[-1][3] == 0x2000
    assert source.source == 0x2000


def test_a_refused_update_leaves_the_last_source(monkeypatch):
    refused = graph_input._cudart.cudaError_t.cudaErrorInvalidValue
    source, calls = _copy_source(monkeypatch, errors=[refused])
    assert not source.point_at(0x3000)
    assert source.source == 0x2000
    assert source.point_at(0x3000)  # tried again, and taken
    assert len(calls) == 2 and source.source == 0x3000


def test_the_update_runs_with_the_graphs_device_current(monkeypatch):
    source, calls = _copy_source(monkeypatch, current_device=0)
    entered = []

    @contextlib.contextmanager
    def device(index):
        entered.append(index)
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    assert source.point_at(0x3000)
    assert entered == [1] and len(calls) == 1
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 1, raising=False)
    assert source.point_at(0x4000)
    assert entered == [1] and len(calls) == 2  # already current: no guard
