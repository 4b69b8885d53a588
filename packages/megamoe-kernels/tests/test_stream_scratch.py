"""The scratch the grouped GEMMs' launches share (split-K workspaces, the dynamic schedule's
counter): one per (device, stream, kind), made on first use and kept; under CUDA-graph capture,
one per capture and kind. Runs on any machine: the current stream is stood in for."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from megamoe_kernels.shim import expert_gemm


def test_stream_scratch_is_made_once_per_device_stream_and_kind(monkeypatch):
    current = SimpleNamespace(cuda_stream=1)
    monkeypatch.setattr(expert_gemm, "_current_stream_handle", lambda device: current.cuda_stream)
    monkeypatch.setattr(expert_gemm, "_STREAM_SCRATCH", {})
    made = []

    def make():
        made.append(object())
        return made[-1]

    first_device, second_device = torch.device("cuda", 0), torch.device("cuda", 1)
    counter = expert_gemm._stream_scratch(first_device, ("unit_counter",), make)
    assert expert_gemm._stream_scratch(first_device, ("unit_counter",), make) is counter
    workspace = expert_gemm._stream_scratch(first_device, ("split_k", 64, 2), make)
    other_size = expert_gemm._stream_scratch(first_device, ("split_k", 128, 4), make)
    on_other_device = expert_gemm._stream_scratch(second_device, ("unit_counter",), make)
    current.cuda_stream = 2
    on_other_stream = expert_gemm._stream_scratch(first_device, ("unit_counter",), make)
    assert len(made) == 5
    assert (
        len({id(s) for s in (counter, workspace, other_size, on_other_device, on_other_stream)})
        == 5
    )


def test_inside_fresh_scratch_nothing_is_kept(monkeypatch):
    from megamoe_kernels import fresh_scratch, keeps_buffers

    monkeypatch.setattr(expert_gemm, "_current_stream_handle", lambda device: 1)
    monkeypatch.setattr(expert_gemm, "_STREAM_SCRATCH", {})
    device = torch.device("cuda", 0)
    assert keeps_buffers()
    with fresh_scratch():
        assert not keeps_buffers()
        with fresh_scratch():  # nested: still fresh, and after the inner one ends
            pass
        assert not keeps_buffers()
        first = expert_gemm._stream_scratch(device, ("unit_counter",), object)
        assert expert_gemm._stream_scratch(device, ("unit_counter",), object) is not first
    assert keeps_buffers()
    kept = expert_gemm._stream_scratch(device, ("unit_counter",), object)
    assert expert_gemm._stream_scratch(device, ("unit_counter",), object) is kept


def test_each_capture_has_scratch_of_its_own(monkeypatch):
    # made in the capture (its fill recorded there) and shared by that capture's launches,
    # apart from the eager launches' scratch and from any other capture's; inside
    # fresh_scratch, made per call
    from megamoe_kernels import fresh_scratch

    state = SimpleNamespace(capture=None)
    monkeypatch.setattr(expert_gemm, "_current_stream_handle", lambda device: 1)
    monkeypatch.setattr(expert_gemm, "_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state.capture != 0)
    monkeypatch.setattr(expert_gemm, "_capture_id", lambda stream: state.capture)
    monkeypatch.setattr(expert_gemm, "_STREAM_SCRATCH", {})
    monkeypatch.setattr(expert_gemm, "_CAPTURE_SCRATCH", {})
    device = torch.device("cuda", 0)

    def scratch():
        return expert_gemm._stream_scratch(device, ("unit_counter",), object)

    state.capture = 0
    eager = scratch()
    state.capture = 7
    first_capture = scratch()
    assert first_capture is not eager
    assert scratch() is first_capture
    with fresh_scratch():
        assert scratch() is not first_capture
    state.capture = 8
    second_capture = scratch()
    assert second_capture not in (eager, first_capture)
    assert scratch() is second_capture
    state.capture = 0
    assert scratch() is eager
